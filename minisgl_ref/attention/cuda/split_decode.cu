// Split-KV decode attention for grouped-query heads of dimension 128, bf16, pages of one token (chapter 11).
//
// The work of a decode step is cut into *items*: a piece of one request's context, for one KV head (the host cuts
// the pieces: minisgl_ref/attention/split_decode.py). Each item is one thread block, and there are several waves
// of them, so the GPU hands the next item to whichever SM frees up first: a long context costs no more than its
// share. An item of a request
// with one piece writes the output directly; the pieces of a longer context write partial results (output and
// log-sum-exp), and the last of them to finish, found with one atomic counter per (request, KV head), merges
// them. No second kernel, no grid-wide barrier.
//
// Inside a block, the half-warps take turns over the item's tokens; a half-warp holds one token's 256-byte K (and
// V) row, 16 bytes a lane, so a warp reads two rows per load. The item's slot numbers are first read into shared
// memory (a window of 1,024 at a time), and the rows of the next step are loaded into a second set of registers
// while this step's are used. Compiled with SPLIT_DECODE_STREAMING_LOADS, the rows are read with streaming
// (evict-first) loads instead of ordinary ones.
#include "split_decode.h"

namespace {

constexpr int HEAD_DIM = 128;
constexpr int MAX_CHUNK = 1024;            // slot numbers held in shared memory at a time

#ifdef SPLIT_DECODE_STREAMING_LOADS
#define LOAD(p) __ldcs(p)
#else
#define LOAD(p) __ldg(p)  // read-only path: the cache does not change during the kernel
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

__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

__device__ __forceinline__ uint4 float_to_bf16x8(const float* f) {
  uint4 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return raw;
}

// One raw head of q or k (lane hl's eight values), finished as the QK-norm/RoPE kernel of layers/triton_fused.py
// finishes it, rounding to bf16 at the same points: divided by the row's rms, normalised over the head and scaled
// by `weight` (with `has_weight`), rotated by the angles `c`, `s` of this lane's dimensions. Lane hl of a
// half-warp holds dimensions hl*8 .. hl*8+7, so a dimension's RoPE partner (i + 64) is in lane hl ^ 8.
__device__ __forceinline__ void finish_head(const uint4& raw, float x_r, bool has_weight, const uint4& weight,
                                            float eps, const float* c, const float* s, int hl, float* out) {
  float f[8];
  bf16x8_to_float(raw, f);
  float ss = 0.f;
#pragma unroll
  for (int d = 0; d < 8; ++d) {
    f[d] = round_bf16(f[d] * x_r);
    ss = fmaf(f[d], f[d], ss);
  }
  if (has_weight) {
#pragma unroll
    for (int off = 8; off >= 1; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    const float r = 1.f / sqrtf(ss / HEAD_DIM + eps);
    float w[8];
    bf16x8_to_float(weight, w);
#pragma unroll
    for (int d = 0; d < 8; ++d) f[d] = round_bf16(w[d] * round_bf16(f[d] * r));
  }
  const bool first_half = hl < 8;
#pragma unroll
  for (int d = 0; d < 8; ++d) {
    const float partner = __shfl_xor_sync(0xffffffffu, f[d], 8);
    out[d] = round_bf16(first_half ? f[d] * c[d] - partner * s[d] : f[d] * c[d] + partner * s[d]);
  }
}

template <int GROUP, int UNROLL, int THREADS>
__global__ void __launch_bounds__(THREADS) split_decode_kernel(const SplitDecodeArgs a) {
  const int kvh = blockIdx.x % a.num_kv_heads;  // the heads of one item are neighbours in the grid
  const int4 desc = a.items[blockIdx.x / a.num_kv_heads];  // (request, first index, end index, partial row)
  const int req = desc.x, begin = desc.y, end = desc.z, item = desc.w;
  if (begin >= end) return;  // padding item (a captured graph keeps its grid size)
  constexpr int HALF_WARPS = THREADS / 16;
  constexpr int STEP = HALF_WARPS * UNROLL;
  constexpr int X_CHUNKS = 4;  // with a.raw: residual rows of up to X_CHUNKS x 8 x THREADS values
  const int parts = a.req_parts[req];
  const int tid = threadIdx.x, hw = tid >> 4, hl = tid & 15;
  const int num_q_heads = a.num_kv_heads * GROUP;
  const int64_t head_off = static_cast<int64_t>(kvh) * HEAD_DIM + hl * 8;

  // Every load the first rows and the query need is issued at once, before any of them is used, so that their
  // latencies overlap: the query (with a.raw: the raw q, k and v, the residual row, the QK-norm weights, the RoPE
  // angles and whether this block holds the request's new token), and the first window of slot numbers.
  uint4 q_raw[GROUP], k_raw, v_raw, x_raw[X_CHUNKS], q_w, k_w;
  float rope_c[8], rope_s[8];  // the RoPE angles of this lane's dimensions
  bool owner = false;
  int64_t new_slot = 0;
#pragma unroll
  for (int g = 0; g < GROUP; ++g)
    q_raw[g] = *reinterpret_cast<const uint4*>(a.q + req * a.q_stride_tok + (kvh * GROUP + g) * a.q_stride_head +
                                               hl * 8);
  if (a.raw) {
    const int64_t pos = a.positions[req];
    new_slot = a.new_slots[req];
    const int last = a.kv_indices[end - 1];
    const int64_t row = req * a.q_stride_tok + kvh * HEAD_DIM + hl * 8;
    k_raw = *reinterpret_cast<const uint4*>(a.raw_k + row);
    v_raw = *reinterpret_cast<const uint4*>(a.raw_v + row);
#pragma unroll
    for (int i = 0; i < X_CHUNKS; ++i) {
      const int col = (i * THREADS + tid) * 8;
      x_raw[i] = col < a.hidden ? *reinterpret_cast<const uint4*>(a.x + req * a.x_stride_tok + col)
                                : make_uint4(0, 0, 0, 0);
    }
    if (a.q_weight != nullptr) {
      q_w = *reinterpret_cast<const uint4*>(a.q_weight + hl * 8);
      k_w = *reinterpret_cast<const uint4*>(a.k_weight + hl * 8);
    }
    const int i0 = (hl & 7) * 8;  // this lane's first dimension within its half
    const float4* c4 = reinterpret_cast<const float4*>(a.cos + pos * (HEAD_DIM / 2) + i0);
    const float4* s4 = reinterpret_cast<const float4*>(a.sin + pos * (HEAD_DIM / 2) + i0);
    const float4 c_lo = c4[0], c_hi = c4[1], s_lo = s4[0], s_hi = s4[1];
    const float cs[16] = {c_lo.x, c_lo.y, c_lo.z, c_lo.w, c_hi.x, c_hi.y, c_hi.z, c_hi.w,
                          s_lo.x, s_lo.y, s_lo.z, s_lo.w, s_hi.x, s_hi.y, s_hi.z, s_hi.w};
#pragma unroll
    for (int d = 0; d < 8; ++d) {
      rope_c[d] = cs[d];
      rope_s[d] = cs[8 + d];
    }
    owner = last == new_slot;  // the same for the whole block
  }

  // The item's slot numbers, read into shared memory a window at a time: the row loads below then wait on one
  // memory latency, not on an index load followed by the row it names.
  __shared__ int sm_slot[MAX_CHUNK];
  // With a.raw: the new token's K and V rows for this KV head, when this block holds the request's last token.
  __shared__ uint4 sm_new_k[16], sm_new_v[16];
  __shared__ float sm_sum[THREADS / 32];
  int w0 = begin, len = min(MAX_CHUNK, end - begin);
  // The new token's index in the window, when this block writes it: its rows are then read from shared memory
  // (the read-only loads below need not see this block's own writes).
  int fresh = -1;
  uint4 ka[UNROLL], va[UNROLL], kb[UNROLL], vb[UNROLL];
  auto load = [&](uint4 (&kr)[UNROLL], uint4 (&vr)[UNROLL], int it) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int p = it * STEP + hw + HALF_WARPS * u;
      if (p == fresh) {
        kr[u] = sm_new_k[hl];
        vr[u] = sm_new_v[hl];
      } else if (p < len) {
        const int64_t off = static_cast<int64_t>(sm_slot[p]) * a.kv_stride_slot + head_off;
        kr[u] = LOAD(reinterpret_cast<const uint4*>(a.k + off));
        vr[u] = LOAD(reinterpret_cast<const uint4*>(a.v + off));
      }
    }
  };
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) ka[u] = va[u] = kb[u] = vb[u] = make_uint4(0, 0, 0, 0);
  for (int i = tid; i < len; i += THREADS) sm_slot[i] = a.kv_indices[w0 + i];
  __syncthreads();
  load(ka, va, 0);  // the first rows are in flight while the query is finished

  float qf[GROUP][8];
  if (a.raw) {
    // The rms of the request's residual row, summed over the whole block.
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < X_CHUNKS; ++i) {
      float f[8];
      bf16x8_to_float(x_raw[i], f);
#pragma unroll
      for (int d = 0; d < 8; ++d) ss = fmaf(f[d], f[d], ss);
    }
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if ((tid & 31) == 0) sm_sum[tid >> 5] = ss;
    __syncthreads();
    ss = 0.f;
#pragma unroll
    for (int w = 0; w < THREADS / 32; ++w) ss += sm_sum[w];
    const float x_r = 1.f / sqrtf(ss / a.hidden + a.x_eps);
    const bool has_weight = a.q_weight != nullptr;
#pragma unroll
    for (int g = 0; g < GROUP; ++g) finish_head(q_raw[g], x_r, has_weight, q_w, a.eps, rope_c, rope_s, hl, qf[g]);
    if (owner) {
      float kf[8], vf[8];
      finish_head(k_raw, x_r, has_weight, k_w, a.eps, rope_c, rope_s, hl, kf);
      bf16x8_to_float(v_raw, vf);
#pragma unroll
      for (int d = 0; d < 8; ++d) vf[d] = round_bf16(vf[d] * x_r);
      if (hw == 0) {
        const uint4 kr = float_to_bf16x8(kf), vr = float_to_bf16x8(vf);
        sm_new_k[hl] = kr;
        sm_new_v[hl] = vr;
        const int64_t off = new_slot * a.kv_stride_slot + head_off;
        *reinterpret_cast<uint4*>(a.k_pool + off) = kr;
        *reinterpret_cast<uint4*>(a.v_pool + off) = vr;
      }
      __syncthreads();
      if (w0 + len == end) {
        fresh = len - 1;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {  // the first rows were loaded before the new one was written
          if (hw + HALF_WARPS * u == fresh) {
            ka[u] = sm_new_k[hl];
            va[u] = sm_new_v[hl];
          }
        }
      }
    }
  } else {
#pragma unroll
    for (int g = 0; g < GROUP; ++g) bf16x8_to_float(q_raw[g], qf[g]);
  }
  float m[GROUP], l[GROUP], acc[GROUP][8];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int d = 0; d < 8; ++d) acc[g][d] = 0.f;
  }

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
        s[g][u] = valid ? s[g][u] * a.scale_log2 : -INFINITY;
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
  while (true) {
    // Two register buffers: the rows of the next step are in flight while this step's are used. The window's
    // first rows are already loaded.
    const int iters = (len + STEP - 1) / STEP;  // the same for every thread: no lane leaves a shuffle early
    for (int it = 0; it < iters; it += 2) {
      if (it + 1 < iters) load(kb, vb, it + 1);
      consume(ka, va, it);
      if (it + 1 >= iters) break;
      if (it + 2 < iters) load(ka, va, it + 2);
      consume(kb, vb, it + 1);
    }
    w0 += MAX_CHUNK;
    if (w0 >= end) break;
    len = min(MAX_CHUNK, end - w0);
    fresh = owner && w0 + len == end ? len - 1 : -1;
    __syncthreads();  // every thread is done with the previous window
    for (int i = tid; i < len; i += THREADS) sm_slot[i] = a.kv_indices[w0 + i];
    __syncthreads();
    load(ka, va, 0);
  }

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
      a.out[req * a.out_stride_tok + head * a.out_stride_head + d] = __float2bfloat16(o);
    } else {
      a.part_o[(static_cast<int64_t>(item) * num_q_heads + head) * HEAD_DIM + d] = o;
      if (d == 0) a.part_lse[static_cast<int64_t>(item) * num_q_heads + head] = mx + log2f(sum_l);
    }
  }
  if (parts == 1) return;

  // The last piece of this (request, KV head) to finish merges all of them.
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    const int done = atomicAdd(&a.counters[req * a.num_kv_heads + kvh], 1);
    sm_last = done == parts - 1;
  }
  __syncthreads();
  if (!sm_last) return;
  __threadfence();
  const int first = a.req_first_row[req];
  for (int x = tid; x < GROUP * HEAD_DIM; x += THREADS) {
    const int head = kvh * GROUP + x / HEAD_DIM, d = x % HEAD_DIM;
    float mx = -INFINITY;
    for (int p = 0; p < parts; ++p)
      mx = fmaxf(mx, __ldcg(a.part_lse + static_cast<int64_t>(first + p) * num_q_heads + head));
    float sum_w = 0.f, o = 0.f;
    for (int p = 0; p < parts; ++p) {
      const int64_t row = static_cast<int64_t>(first + p) * num_q_heads + head;
      const float w = exp2f(__ldcg(a.part_lse + row) - mx);
      sum_w += w;
      o += w * __ldcg(a.part_o + row * HEAD_DIM + d);
    }
    a.out[req * a.out_stride_tok + head * a.out_stride_head + d] = __float2bfloat16(o / sum_w);
  }
  if (tid == 0) a.counters[req * a.num_kv_heads + kvh] = 0;  // ready for the next call (and the next graph replay)
}

// The variants compiled in: the engine's (128 threads, 4 rows per half-warp and buffer) for 1, 2 or 4 query heads
// per KV head; with SPLIT_DECODE_ALL_VARIANTS also the ones benchmarks/decode_balance.py compares.
template <int GROUP>
cudaError_t launch_group(const SplitDecodeArgs& a, int unroll, int threads, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(a.num_items * a.num_kv_heads));
  if (grid.x == 0) return cudaSuccess;
#define SPLIT_DECODE_VARIANT(U, T)                              \
  if (unroll == U && threads == T) {                            \
    split_decode_kernel<GROUP, U, T><<<grid, T, 0, stream>>>(a); \
    return cudaGetLastError();                                  \
  }
  SPLIT_DECODE_VARIANT(4, 128)
#ifdef SPLIT_DECODE_ALL_VARIANTS
  SPLIT_DECODE_VARIANT(2, 128)
  SPLIT_DECODE_VARIANT(2, 256)
  SPLIT_DECODE_VARIANT(4, 256)
#endif
#undef SPLIT_DECODE_VARIANT
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t split_decode_launch(const SplitDecodeArgs& a, int unroll, int threads, cudaStream_t stream) {
  switch (a.group) {
    case 1: return launch_group<1>(a, unroll, threads, stream);
    case 2: return launch_group<2>(a, unroll, threads, stream);
    case 4: return launch_group<4>(a, unroll, threads, stream);
    default: return cudaErrorInvalidValue;
  }
}
