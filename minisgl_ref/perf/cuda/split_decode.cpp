// PyTorch binding of the split-KV decode kernel (split_decode.cu): checks the tensors, fills the arguments, and
// launches on the current stream (so a CUDA graph being captured records it).
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "split_decode.h"

namespace {

const __nv_bfloat16* bf16(const torch::Tensor& t) { return reinterpret_cast<const __nv_bfloat16*>(t.data_ptr()); }

void check_i32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == torch::kInt32 && t.is_contiguous(), name,
              " must be a contiguous int32 CUDA tensor");
}

}  // namespace

void split_decode(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                  const torch::Tensor& kv_indices, const torch::Tensor& items, const torch::Tensor& req_parts,
                  const torch::Tensor& req_first_row, torch::Tensor& part_o, torch::Tensor& part_lse,
                  torch::Tensor& counters, torch::Tensor& out, double scale, int64_t unroll, int64_t threads,
                  int64_t min_blocks) {
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && k.scalar_type() == torch::kBFloat16 &&
                  v.scalar_type() == torch::kBFloat16 && out.scalar_type() == torch::kBFloat16,
              "split_decode: bf16 query, cache and output only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && out.dim() == 3,
              "split_decode: q and out must be [B, H, 128], k and v [slots, KV heads, 128]");
  TORCH_CHECK(q.size(2) == 128 && k.size(2) == 128 && q.stride(2) == 1 && k.stride(2) == 1 && out.stride(2) == 1,
              "split_decode: head dim 128, contiguous");
  TORCH_CHECK(k.stride(1) == 128 && v.strides() == k.strides(), "split_decode: K and V rows of [KV heads, 128]");
  TORCH_CHECK(items.dim() == 2 && items.size(1) == 4, "split_decode: items must be [n, 4]");
  check_i32(kv_indices, "kv_indices");
  check_i32(items, "items");
  check_i32(req_parts, "req_parts");
  check_i32(req_first_row, "req_first_row");
  check_i32(counters, "counters");
  TORCH_CHECK(part_o.scalar_type() == torch::kFloat32 && part_lse.scalar_type() == torch::kFloat32 &&
                  part_o.is_contiguous() && part_lse.is_contiguous(),
              "split_decode: float32 contiguous partial results");
  const int kv_heads = static_cast<int>(k.size(1));
  TORCH_CHECK(q.size(1) % kv_heads == 0, "split_decode: query heads must be a multiple of KV heads");
  TORCH_CHECK(part_o.size(0) >= items.size(0) && part_o.size(1) == q.size(1), "split_decode: part_o too small");
  TORCH_CHECK(counters.numel() >= q.size(0) * kv_heads, "split_decode: counters too small");
  SplitDecodeArgs a{};
  a.q = bf16(q);
  a.q_stride_tok = q.stride(0);
  a.q_stride_head = q.stride(1);
  a.k = bf16(k);
  a.v = bf16(v);
  a.kv_stride_slot = k.stride(0);
  a.kv_indices = kv_indices.data_ptr<int32_t>();
  a.items = reinterpret_cast<const int4*>(items.data_ptr<int32_t>());
  a.req_parts = req_parts.data_ptr<int32_t>();
  a.req_first_row = req_first_row.data_ptr<int32_t>();
  a.part_o = part_o.data_ptr<float>();
  a.part_lse = part_lse.data_ptr<float>();
  a.counters = counters.data_ptr<int32_t>();
  a.out = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());
  a.out_stride_tok = out.stride(0);
  a.out_stride_head = out.stride(1);
  a.num_items = static_cast<int>(items.size(0));
  a.num_kv_heads = kv_heads;
  a.group = static_cast<int>(q.size(1)) / kv_heads;
  a.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  const cudaError_t err = split_decode_launch(a, static_cast<int>(unroll), static_cast<int>(threads),
                                              static_cast<int>(min_blocks), c10::cuda::getCurrentCUDAStream());
  const char* why = err == cudaErrorNotSupported
                        ? "no compiled variant for this group size, unroll, block size and blocks per SM"
                        : cudaGetErrorString(err);
  TORCH_CHECK(err == cudaSuccess, "split_decode: ", why);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("split_decode", &split_decode, "split-KV decode attention (minisgl_ref/perf/cuda/split_decode.cu)");
}
