// The arguments of the split-KV decode kernel (split_decode.cu), shared with its PyTorch binding (split_decode.cpp).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdint>

struct SplitDecodeArgs {
  const __nv_bfloat16* q;  // [batch, query heads, 128], head dimension contiguous
  int64_t q_stride_tok, q_stride_head;
  const __nv_bfloat16* k;  // [slots, KV heads, 128], one layer of the pool; v has the same layout
  const __nv_bfloat16* v;
  int64_t kv_stride_slot;
  const int32_t* kv_indices;    // the batch's context slots, request after request
  const int4* items;            // per piece: (request, first index, end index, partial-result row)
  const int32_t* req_parts;     // pieces per request
  const int32_t* req_first_row; // a request's first partial-result row (its rows are consecutive)
  float* part_o;                // [rows, query heads, 128]
  float* part_lse;              // [rows, query heads], base 2
  int32_t* counters;            // [batch, KV heads], zero between calls
  __nv_bfloat16* out;           // [batch, query heads, 128]
  int64_t out_stride_tok, out_stride_head;
  int num_items, num_kv_heads, group;
  float scale_log2;             // softmax scale x log2(e)
};

// Launches the kernel on `stream`; returns cudaErrorNotSupported for a shape or variant that is not compiled in
// (a failed launch returns its own error).
cudaError_t split_decode_launch(const SplitDecodeArgs& args, int unroll, int threads, int min_blocks,
                                cudaStream_t stream);
