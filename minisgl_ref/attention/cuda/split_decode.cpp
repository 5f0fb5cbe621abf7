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

// The arguments every call shares: the cache, the plan, the partial results and the output. `q` is the finished
// query, or (raw) the query part of the QKV output.
SplitDecodeArgs common_args(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& kv_indices, const torch::Tensor& items,
                            const torch::Tensor& req_parts, const torch::Tensor& req_first_row,
                            torch::Tensor& part_o, torch::Tensor& part_lse, torch::Tensor& counters,
                            torch::Tensor& out, double scale) {
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
  return a;
}

void launch(const SplitDecodeArgs& a, int64_t unroll, int64_t threads) {
  const cudaError_t err = split_decode_launch(a, static_cast<int>(unroll), static_cast<int>(threads),
                                              c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "split_decode: ", err == cudaErrorInvalidValue ?
              "no compiled variant for this group size, unroll and block size" : cudaGetErrorString(err));
}

}  // namespace

void split_decode(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                  const torch::Tensor& kv_indices, const torch::Tensor& items, const torch::Tensor& req_parts,
                  const torch::Tensor& req_first_row, torch::Tensor& part_o, torch::Tensor& part_lse,
                  torch::Tensor& counters, torch::Tensor& out, double scale, int64_t unroll, int64_t threads) {
  launch(common_args(q, k, v, kv_indices, items, req_parts, req_first_row, part_o, part_lse, counters, out, scale),
         unroll, threads);
}

// The same attention over raw inputs (SplitDecodeArgs::raw): q, raw_k and raw_v are views of the QKV projection
// of the residual rows x; the kernel finishes them itself and writes the new token's K and V into k and v.
void split_decode_raw(const torch::Tensor& q, const torch::Tensor& raw_k, const torch::Tensor& raw_v,
                      const torch::Tensor& x, double x_eps, const c10::optional<torch::Tensor>& q_weight,
                      const c10::optional<torch::Tensor>& k_weight, double eps, const torch::Tensor& cos,
                      const torch::Tensor& sin, const torch::Tensor& positions, const torch::Tensor& new_slots,
                      torch::Tensor& k, torch::Tensor& v, const torch::Tensor& kv_indices,
                      const torch::Tensor& items, const torch::Tensor& req_parts, const torch::Tensor& req_first_row,
                      torch::Tensor& part_o, torch::Tensor& part_lse, torch::Tensor& counters, torch::Tensor& out,
                      double scale, int64_t unroll, int64_t threads) {
  SplitDecodeArgs a =
      common_args(q, k, v, kv_indices, items, req_parts, req_first_row, part_o, part_lse, counters, out, scale);
  // (A dimension of size one may have any stride in a view: only the rows of a larger batch are checked.)
  const int64_t batch = q.size(0), kv_heads = k.size(1);
  TORCH_CHECK(q.stride(1) == 128, "split_decode_raw: the query heads of a token must be contiguous");
  for (const torch::Tensor* t : {&raw_k, &raw_v}) {
    TORCH_CHECK(t->scalar_type() == torch::kBFloat16 && t->dim() == 3 && t->size(0) == batch &&
                    t->size(1) == kv_heads && t->size(2) == 128 && (batch == 1 || t->stride(0) == q.stride(0)) &&
                    t->stride(1) == 128 && t->stride(2) == 1,
                "split_decode_raw: raw k and v must be [B, KV heads, 128] views of the QKV output");
  }
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.size(0) == batch && x.stride(1) == 1 &&
                  x.size(1) % 8 == 0 && (batch == 1 || x.stride(0) % 8 == 0),
              "split_decode_raw: x must be [B, hidden] bf16 rows, hidden a multiple of 8");
  TORCH_CHECK(x.size(1) <= 32 * threads, "split_decode_raw: a residual row of at most 32 values per thread");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "split_decode_raw: the pool layers must be contiguous");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.dim() == 2 &&
                  cos.size(1) == 64 && cos.is_contiguous() && sin.sizes() == cos.sizes() && sin.is_contiguous(),
              "split_decode_raw: cos and sin must be contiguous float32 [max position, 64]");
  for (const torch::Tensor* t : {&positions, &new_slots}) {
    TORCH_CHECK(t->is_cuda() && t->scalar_type() == torch::kInt64 && t->is_contiguous() && t->numel() == batch,
                "split_decode_raw: positions and new_slots must be contiguous int64 [B]");
  }
  TORCH_CHECK(q_weight.has_value() == k_weight.has_value(), "split_decode_raw: give both QK-norm weights or neither");
  if (q_weight.has_value()) {
    for (const torch::Tensor* t : {&*q_weight, &*k_weight}) {
      TORCH_CHECK(t->scalar_type() == torch::kBFloat16 && t->numel() == 128 && t->is_contiguous(),
                  "split_decode_raw: QK-norm weights must be contiguous bf16 [128]");
    }
    a.q_weight = bf16(*q_weight);
    a.k_weight = bf16(*k_weight);
  }
  a.raw = true;
  a.raw_k = bf16(raw_k);
  a.raw_v = bf16(raw_v);
  a.x = bf16(x);
  a.x_stride_tok = x.stride(0);
  a.hidden = static_cast<int>(x.size(1));
  a.x_eps = static_cast<float>(x_eps);
  a.eps = static_cast<float>(eps);
  a.cos = cos.data_ptr<float>();
  a.sin = sin.data_ptr<float>();
  a.positions = positions.data_ptr<int64_t>();
  a.new_slots = new_slots.data_ptr<int64_t>();
  a.k_pool = reinterpret_cast<__nv_bfloat16*>(k.data_ptr());
  a.v_pool = reinterpret_cast<__nv_bfloat16*>(v.data_ptr());
  launch(a, unroll, threads);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("split_decode", &split_decode, "split-KV decode attention (minisgl_ref/attention/cuda/split_decode.cu)");
  m.def("split_decode_raw", &split_decode_raw, "the same, finishing the raw QKV projection itself");
}
