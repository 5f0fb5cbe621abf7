// Split-KV decode attention for grouped-query heads of dimension 128, bf16, pages of one token (chapter 11).
//
// The work of a decode step is cut into *items*: a piece of at most `chunk` tokens of one request's context,
// for one KV head. Each item is one thread block, and there are several waves of them, so the GPU hands the
// next item to whichever SM frees up first: a long context costs no more than its share. An item of a request
// with one piece writes the output directly; the pieces of a longer context write partial results (output and
// log-sum-exp), and the last of them to finish, found with one atomic counter per (request, KV head), merges
// them. No second kernel, no grid-wide barrier.
//
// Inside a block, the half-warps take turns over the item's tokens; a half-warp holds one token's 256-byte K (and
// V) row, 16 bytes a lane, so a warp reads two rows per load. The item's slot numbers are first read into shared
// memory (a window of 1,024 at a time), and the rows of the next step are loaded into a second set of registers
// while this step's are used. Compiled with SPLIT_DECODE_STREAMING_LOADS, the rows are read with streaming
// (evict-first) loads instead of ordinary ones.
#include <cuda_bf16.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

namespace {

constexpr int HEAD_DIM = 128;
constexpr int MAX_CHUNK = 1024;            // slot numbers held in shared memory at a time

#ifdef SPLIT_DECODE_STREAMING_LOADS
#define LOAD(p) __ldcs(p)
#else
#define LOAD(p) (*(p))
#endif

__device__ __forceinline__ void bf16x8_to_float(const uint4& raw, float* f) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 x = __bfloat1622float2(h[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}

template <int GROUP, int UNROLL, int THREADS>
__global__ void __launch_bounds__(THREADS) split_decode_kernel(
    const __nv_bfloat16* __restrict__ q, int64_t q_stride_tok, int64_t q_stride_head,
    const __nv_bfloat16* __restrict__ k, const __nv_bfloat16* __restrict__ v, int64_t kv_stride_slot,
    const int32_t* __restrict__ kv_indices, const int4* __restrict__ items, const int32_t* __restrict__ req_parts,
    const int32_t* __restrict__ req_first_item, float* __restrict__ part_o,
    float* __restrict__ part_lse, int32_t* __restrict__ counters, __nv_bfloat16* __restrict__ out,
    int64_t out_stride_tok, int64_t out_stride_head, int num_kv_heads, float scale_log2) {
  const int kvh = blockIdx.x % num_kv_heads;  // the heads of one item are neighbours in the grid
  const int4 desc = items[blockIdx.x / num_kv_heads];  // (request, first index, end index, where its partial goes)
  const int req = desc.x, begin = desc.y, end = desc.z, item = desc.w;
  if (begin >= end) return;  // padding item (a captured graph keeps its grid size)
  constexpr int HALF_WARPS = THREADS / 16;
  const int parts = req_parts[req];
  const int tid = threadIdx.x, hw = tid >> 4, hl = tid & 15;
  const int num_q_heads = num_kv_heads * GROUP;

  float qf[GROUP][8];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    const int64_t off = req * q_stride_tok + (kvh * GROUP + g) * q_stride_head + hl * 8;
    const uint4 raw = *reinterpret_cast<const uint4*>(q + off);
    bf16x8_to_float(raw, qf[g]);
  }
  float m[GROUP], l[GROUP], acc[GROUP][8];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int d = 0; d < 8; ++d) acc[g][d] = 0.f;
  }
  const int64_t head_off = static_cast<int64_t>(kvh) * HEAD_DIM + hl * 8;

  // The item's slot numbers, read into shared memory a window at a time: the row loads below then wait on one
  // memory latency, not on an index load followed by the row it names.
  __shared__ int sm_slot[MAX_CHUNK];
  for (int w0 = begin; w0 < end; w0 += MAX_CHUNK) {
  const int len = min(MAX_CHUNK, end - w0);
  if (w0 != begin) __syncthreads();  // every thread is done with the previous window
  for (int i = tid; i < len; i += THREADS) sm_slot[i] = kv_indices[w0 + i];
  __syncthreads();

  constexpr int STEP = HALF_WARPS * UNROLL;
  const int iters = (len + STEP - 1) / STEP;  // the same for every thread: no lane leaves a shuffle early
  uint4 ka[UNROLL], va[UNROLL], kb[UNROLL], vb[UNROLL];
  auto load = [&](uint4 (&kr)[UNROLL], uint4 (&vr)[UNROLL], int it) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int p = it * STEP + hw + HALF_WARPS * u;
      if (p < len) {
        const int64_t off = static_cast<int64_t>(sm_slot[p]) * kv_stride_slot + head_off;
        kr[u] = LOAD(reinterpret_cast<const uint4*>(k + off));
        vr[u] = LOAD(reinterpret_cast<const uint4*>(v + off));
      }
    }
  };
  auto consume = [&](const uint4 (&kr)[UNROLL], const uint4 (&vr)[UNROLL], int it) {
    float s[GROUP][UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float kf[8];
      bf16x8_to_float(kr[u], kf);
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        float x = 0.f;
#pragma unroll
        for (int d = 0; d < 8; ++d) x = fmaf(qf[g][d], kf[d], x);
        s[g][u] = x;
      }
    }
#pragma unroll
    for (int off = 8; off >= 1; off >>= 1) {  // sum over the 16 lanes of a half-warp
#pragma unroll
      for (int g = 0; g < GROUP; ++g)
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) s[g][u] += __shfl_xor_sync(0xffffffffu, s[g][u], off);
    }
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      float mx = m[g];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const bool valid = it * STEP + hw + HALF_WARPS * u < len;
        s[g][u] = valid ? s[g][u] * scale_log2 : -INFINITY;
        mx = fmaxf(mx, s[g][u]);
      }
      if (mx == -INFINITY) continue;  // no token of this half-warp yet
      const float corr = exp2f(m[g] - mx);
      l[g] *= corr;
#pragma unroll
      for (int d = 0; d < 8; ++d) acc[g][d] *= corr;
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const float p = exp2f(s[g][u] - mx);  // 0 for a padding token
        l[g] += p;
        float vf[8];
        bf16x8_to_float(vr[u], vf);
#pragma unroll
        for (int d = 0; d < 8; ++d) acc[g][d] = fmaf(p, vf[d], acc[g][d]);
      }
      m[g] = mx;
    }
  };
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) ka[u] = va[u] = kb[u] = vb[u] = make_uint4(0, 0, 0, 0);
  // Two register buffers: the rows of the next step are in flight while this step's are used.
  load(ka, va, 0);
  for (int it = 0; it < iters; it += 2) {
    if (it + 1 < iters) load(kb, vb, it + 1);
    consume(ka, va, it);
    if (it + 1 >= iters) break;
    if (it + 2 < iters) load(ka, va, it + 2);
    consume(kb, vb, it + 1);
  }
  }  // windows

  // Combine the half-warps' running states.
  __shared__ float sm_m[HALF_WARPS][GROUP], sm_l[HALF_WARPS][GROUP];
  __shared__ float sm_acc[HALF_WARPS][GROUP][HEAD_DIM];
  __shared__ int sm_last;
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    if (hl == 0) {
      sm_m[hw][g] = m[g];
      sm_l[hw][g] = l[g];
    }
#pragma unroll
    for (int d = 0; d < 8; ++d) sm_acc[hw][g][hl * 8 + d] = acc[g][d];
  }
  __syncthreads();
  for (int x = tid; x < GROUP * HEAD_DIM; x += THREADS) {  // one output value (head, dimension) per step
    const int g = x / HEAD_DIM, d = x % HEAD_DIM;
    float mx = -INFINITY;
#pragma unroll
    for (int h = 0; h < HALF_WARPS; ++h) mx = fmaxf(mx, sm_m[h][g]);
    float sum_l = 0.f, o = 0.f;
#pragma unroll
    for (int h = 0; h < HALF_WARPS; ++h) {
      const float w = sm_m[h][g] == -INFINITY ? 0.f : exp2f(sm_m[h][g] - mx);
      sum_l += sm_l[h][g] * w;
      o += sm_acc[h][g][d] * w;
    }
    o /= sum_l;
    const int head = kvh * GROUP + g;
    if (parts == 1) {
      out[req * out_stride_tok + head * out_stride_head + d] = __float2bfloat16(o);
    } else {
      part_o[(static_cast<int64_t>(item) * num_q_heads + head) * HEAD_DIM + d] = o;
      if (d == 0) part_lse[static_cast<int64_t>(item) * num_q_heads + head] = mx + log2f(sum_l);
    }
  }
  if (parts == 1) return;

  // The last piece of this (request, KV head) to finish merges all of them.
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    const int done = atomicAdd(&counters[req * num_kv_heads + kvh], 1);
    sm_last = done == parts - 1;
  }
  __syncthreads();
  if (!sm_last) return;
  __threadfence();
  const int first = req_first_item[req];
  for (int x = tid; x < GROUP * HEAD_DIM; x += THREADS) {
    const int head = kvh * GROUP + x / HEAD_DIM, d = x % HEAD_DIM;
    float mx = -INFINITY;
    for (int p = 0; p < parts; ++p)
      mx = fmaxf(mx, __ldcg(part_lse + static_cast<int64_t>(first + p) * num_q_heads + head));
    float sum_w = 0.f, o = 0.f;
    for (int p = 0; p < parts; ++p) {
      const int64_t row = static_cast<int64_t>(first + p) * num_q_heads + head;
      const float w = exp2f(__ldcg(part_lse + row) - mx);
      sum_w += w;
      o += w * __ldcg(part_o + row * HEAD_DIM + d);
    }
    out[req * out_stride_tok + head * out_stride_head + d] = __float2bfloat16(o / sum_w);
  }
  if (tid == 0) counters[req * num_kv_heads + kvh] = 0;  // ready for the next call (and the next graph replay)
}

template <int GROUP>
void launch_group(int unroll, int threads, dim3 grid, cudaStream_t stream, const __nv_bfloat16* q, int64_t qs0,
                  int64_t qs1,
                  const __nv_bfloat16* k, const __nv_bfloat16* v, int64_t kvs, const int32_t* idx, const int4* items,
                  const int32_t* rp, const int32_t* rf, float* po, float* pl,
                  int32_t* cnt, __nv_bfloat16* out, int64_t os0, int64_t os1, int nkv, float scale_log2) {
#define SPLIT_DECODE_LAUNCH(U, T)                                                                                     \
  split_decode_kernel<GROUP, U, T><<<grid, T, 0, stream>>>(q, qs0, qs1, k, v, kvs, idx, items, rp, rf, po, pl, cnt, \
                                                            out, os0, os1, nkv, scale_log2)
  TORCH_CHECK(threads == 128 || threads == 256, "threads must be 128 or 256, got ", threads);
  switch (unroll) {
    case 2: if (threads == 128) SPLIT_DECODE_LAUNCH(2, 128); else SPLIT_DECODE_LAUNCH(2, 256); break;
    case 4: if (threads == 128) SPLIT_DECODE_LAUNCH(4, 128); else SPLIT_DECODE_LAUNCH(4, 256); break;
    default: TORCH_CHECK(false, "unroll must be 2 or 4, got ", unroll);
  }
#undef SPLIT_DECODE_LAUNCH
}

}  // namespace

void split_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor kv_indices, torch::Tensor items,
                  torch::Tensor req_parts,
                  torch::Tensor req_first_item, torch::Tensor part_o, torch::Tensor part_lse, torch::Tensor counters,
                  torch::Tensor out, double scale, int64_t unroll, int64_t threads) {
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && k.scalar_type() == torch::kBFloat16, "bf16 only");
  TORCH_CHECK(q.size(2) == HEAD_DIM && k.size(-1) == HEAD_DIM && q.stride(2) == 1 && k.stride(-1) == 1,
              "head dim 128, contiguous");
  TORCH_CHECK(k.strides().equals(v.strides()), "K and V must share a layout");
  const int nkv = static_cast<int>(k.size(1));
  const int group = static_cast<int>(q.size(1)) / nkv;
  TORCH_CHECK(items.dim() == 2 && items.size(1) == 4 && items.is_contiguous(), "items must be [n, 4] int32");
  const dim3 grid(static_cast<unsigned>(items.size(0) * nkv));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const float scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  auto bf = [](const torch::Tensor& t) { return reinterpret_cast<const __nv_bfloat16*>(t.data_ptr()); };
  auto i32 = [](const torch::Tensor& t) { return t.data_ptr<int32_t>(); };
  auto* o = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());
  if (group == 2) {
    launch_group<2>(static_cast<int>(unroll), static_cast<int>(threads), grid, stream, bf(q), q.stride(0), q.stride(1),
                    bf(k), bf(v), k.stride(0), i32(kv_indices),
                    reinterpret_cast<const int4*>(items.data_ptr<int32_t>()), i32(req_parts), i32(req_first_item),
                    part_o.data_ptr<float>(), part_lse.data_ptr<float>(), i32(counters), o, out.stride(0),
                    out.stride(1), nkv, scale_log2);
  } else {
    TORCH_CHECK(false, "query heads per KV head must be 2, got ", group);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("split_decode", &split_decode, "split-KV decode attention"); }
