// Split-KV decode attention for grouped-query heads of dimension 128, bf16, pages of one token (chapter 11).
//
// The work of a decode step is cut into *items*: a piece of one request's context, for one KV head (the host cuts
// the pieces: minisgl_ref/perf/split_decode.py). Each item is one thread block, and there are several waves
// of them, so the GPU hands the next item to whichever SM frees up first: a long context costs no more than its
// share. An item of a request
// with one piece writes the output directly; the pieces of a longer context write partial results (output and
// log-sum-exp), and the last of them to finish, found with one atomic counter per (request, KV head), merges
// them. No second kernel, no grid-wide barrier.
//
// Inside a block, the half-warps take turns over the item's tokens; a half-warp holds one token's 256-byte K (and
// V) row, 16 bytes a lane, so a warp reads two rows per load. The item's slot numbers are first read into shared
// memory (a window of 1,024 at a time), and the rows of the next step are loaded into a second set of registers
// while this step's are used.
#include "split_decode.h"

namespace {

constexpr int HEAD_DIM = 128;
constexpr int MAX_CHUNK = 1024;            // slot numbers held in shared memory at a time

#define LOAD(p) __ldg(p)  // read-only path: the cache does not change during the kernel

__device__ __forceinline__ void bf16x8_to_float(const uint4& raw, float* f) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 x = __bfloat1622float2(h[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}

// MIN_BLOCKS: the blocks an SM must be able to hold at once (the compiler keeps the registers a thread uses low
// enough); 1 leaves the choice to the compiler.
template <int GROUP, int UNROLL, int THREADS, int MIN_BLOCKS = 1>
__global__ void __launch_bounds__(THREADS, MIN_BLOCKS) split_decode_kernel(const SplitDecodeArgs a) {
  const int kvh = blockIdx.x % a.num_kv_heads;  // the heads of one item are neighbours in the grid
  const int4 desc = a.items[blockIdx.x / a.num_kv_heads];  // (request, first index, end index, partial row)
  const int req = desc.x, begin = desc.y, end = desc.z, item = desc.w;
  if (begin >= end) return;  // padding item (a captured graph keeps its grid size)
  constexpr int HALF_WARPS = THREADS / 16;
  const int parts = a.req_parts[req];
  const int tid = threadIdx.x, hw = tid >> 4, hl = tid & 15;
  const int num_q_heads = a.num_kv_heads * GROUP;

  float qf[GROUP][8];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    const int64_t off = req * a.q_stride_tok + (kvh * GROUP + g) * a.q_stride_head + hl * 8;
    const uint4 raw = *reinterpret_cast<const uint4*>(a.q + off);
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
    for (int i = tid; i < len; i += THREADS) sm_slot[i] = a.kv_indices[w0 + i];
    __syncthreads();

    constexpr int STEP = HALF_WARPS * UNROLL;
    const int iters = (len + STEP - 1) / STEP;  // the same for every thread: no lane leaves a shuffle early
    uint4 ka[UNROLL], va[UNROLL], kb[UNROLL], vb[UNROLL];
    auto load = [&](uint4 (&kr)[UNROLL], uint4 (&vr)[UNROLL], int it) {
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int p = it * STEP + hw + HALF_WARPS * u;
        if (p < len) {
          const int64_t off = static_cast<int64_t>(sm_slot[p]) * a.kv_stride_slot + head_off;
          kr[u] = LOAD(reinterpret_cast<const uint4*>(a.k + off));
          vr[u] = LOAD(reinterpret_cast<const uint4*>(a.v + off));
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
// per KV head, and for 1 or 2 also the build for four blocks an SM (large batches).
template <int GROUP>
cudaError_t launch_group(const SplitDecodeArgs& a, int unroll, int threads, int min_blocks, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(a.num_items * a.num_kv_heads));
  if (grid.x == 0) return cudaSuccess;
#define SPLIT_DECODE_VARIANT(U, T, B)                                 \
  if (unroll == U && threads == T && min_blocks == B) {               \
    split_decode_kernel<GROUP, U, T, B><<<grid, T, 0, stream>>>(a);   \
    return cudaGetLastError();                                        \
  }
  SPLIT_DECODE_VARIANT(4, 128, 1)
  if constexpr (GROUP <= 2) {  // four blocks of 128 threads an SM: at most 128 registers a thread, no spills
    SPLIT_DECODE_VARIANT(4, 128, 4)
  }
#undef SPLIT_DECODE_VARIANT
  return cudaErrorNotSupported;
}

}  // namespace

cudaError_t split_decode_launch(const SplitDecodeArgs& a, int unroll, int threads, int min_blocks,
                                cudaStream_t stream) {
  switch (a.group) {
    case 1: return launch_group<1>(a, unroll, threads, min_blocks, stream);
    case 2: return launch_group<2>(a, unroll, threads, min_blocks, stream);
    case 4: return launch_group<4>(a, unroll, threads, min_blocks, stream);
    default: return cudaErrorNotSupported;
  }
}
