"""A split-K matrix multiply for the few rows of a decode step, with programmatic dependent launch (chapter 11).

``out[M, N] = x[M, K] @ w[N, K]^T`` where ``M`` (running requests) is small and ``w`` is a layer's weight. At
such row counts a multiply is a read of its weights, and cuBLAS's kernels reach about half the bandwidth on
Qwen3-0.6B's 4-12 MB matrices: each kernel spends a few microseconds filling the GPU with loads and draining it.
Two ideas attack that here:

* **Split K.** A 1,024-column output in tiles of 32 columns is 32 programs for 132 SMs; cutting K into ``SPLIT``
  slices gives each tile ``SPLIT`` programs. Each writes its float32 partial sum to a workspace and bumps a
  per-tile counter; the program that arrives last adds the partials and writes the output, then resets the
  counter for the next call (one kernel, no separate reduction).
* **Start before the previous kernel ends.** With programmatic dependent launch (Hopper), a kernel may be
  scheduled while its predecessor is still draining. The weights never depend on the predecessor, so each
  program first asks the L2 cache to fetch its slice of them, and only then waits (``gdc_wait``) for the
  predecessor's output, its input rows. The read of the weights overlaps the previous kernel's tail.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _kernel():  # type: ignore[no-untyped-def]
    import triton
    import triton.language as tl

    @triton.jit
    def _l2_prefetch(ptrs):  # type: ignore[no-untyped-def]
        # One prefetch per pointer; the dummy result keeps the asm alive (is_pure=False).
        return tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                         dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def splitk_gemm(x, w, out, part, count, M, N, K, K_PER,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                    PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr, LATE_TRIGGER: tl.constexpr):
        pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        k_lo = pid_k * K_PER
        if PDL:
            if PREFETCH_LINES > 0:
                if pid_m == 0:  # the other row tiles find the slice in L2
                    for k0 in range(k_lo, k_lo + K_PER, PREFETCH_LINES * 64):
                        rl = k0 + tl.arange(0, PREFETCH_LINES) * 64  # one 128-byte line per 64 bf16 values
                        _l2_prefetch(w + rn[:, None] * K + rl[None, :])
            tl.extra.cuda.gdc_wait()
            if not LATE_TRIGGER:  # after the wait: at most two multiplies in flight, never a cascade
                tl.extra.cuda.gdc_launch_dependents()
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_lo + K_PER, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x + rm[:, None] * K + rk[None, :], mask=rm[:, None] < M, other=0.0)
            b = tl.load(w + rn[:, None] * K + rk[None, :])
            acc += tl.dot(a, tl.trans(b))
        if PDL:
            if LATE_TRIGGER:
                tl.extra.cuda.gdc_launch_dependents()
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        if SPLIT == 1:
            tl.store(out + rm[:, None] * N + rn[None, :], acc.to(out.dtype.element_ty), mask=mask)
        else:
            tile = pid_m * tl.num_programs(0) + pid_n
            tl.store(part + (pid_k * BLOCK_M * tl.num_programs(2) + rm[:, None]) * N + rn[None, :], acc)
            tl.debug_barrier()  # every thread's partial is written before the counter says so
            arrived = tl.atomic_add(count + tile, 1, sem="acq_rel")
            if arrived == SPLIT - 1:  # the last slice of this tile: add them all up
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(SPLIT):
                    total += tl.load(part + (s * BLOCK_M * tl.num_programs(2) + rm[:, None]) * N + rn[None, :],
                                     cache_modifier=".cg")
                tl.store(out + rm[:, None] * N + rn[None, :], total.to(out.dtype.element_ty), mask=mask)
                tl.atomic_xchg(count + tile, 0)

    return splitk_gemm


class Workspace:
    """Float32 partials and per-tile counters, shared by every multiply on one stream (they run one at a time)."""

    def __init__(self, device: torch.device, floats: int = 1 << 22, tiles: int = 1 << 14) -> None:
        self.part = torch.empty(floats, dtype=torch.float32, device=device)
        self.count = torch.zeros(tiles, dtype=torch.int32, device=device)


def skinny_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, ws: Workspace, config: tuple,
                  pdl: bool = False, prefetch: bool = True, late_trigger: bool = False) -> torch.Tensor:
    """``out = x @ w.T`` with ``config = (BLOCK_N, BLOCK_K, SPLIT, stages)``; ``x`` and ``w`` contiguous."""
    block_n, block_k, split, stages = config
    m, k = x.shape
    n = w.shape[0]
    if k % (split * block_k) or n % block_n:
        raise ValueError(f"config {config} does not tile a {n}x{k} weight")
    block_m = 16 if m <= 16 else 64
    grid = (n // block_n, split, -(-m // block_m))
    if split > 1 and (split * block_m * grid[2] * n > ws.part.numel() or grid[0] * grid[2] > ws.count.numel()):
        raise ValueError("workspace too small for this multiply")
    extra = {"launch_pdl": True} if pdl else {}
    lines = 0
    if pdl and prefetch:  # prefetch lines per row and loop step: a power of two that divides the slice
        lines = 32
        while (k // split // 64) % lines:
            lines //= 2
    _kernel()[grid](x, w, out, ws.part, ws.count, m, n, k, k // split, BLOCK_M=block_m, BLOCK_N=block_n,
                    BLOCK_K=block_k, SPLIT=split, PDL=pdl, PREFETCH_LINES=lines, LATE_TRIGGER=late_trigger, num_warps=4, num_stages=stages,
                    **extra)
    return out
