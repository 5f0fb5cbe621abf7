"""The fused MoE: every expert of a layer in two launches of one grouped-GEMM Triton kernel (chapter 14).

:func:`~minisgl_ref.moe.experts.reference_experts` loops over the experts in Python: one pair of small matmuls
per expert that received a token, so Qwen3-30B-A3B's 128 experts (8 chosen per token) cost up to 128 x 2 matmul
launches per layer, each reading a weight matrix for a handful of rows. The expert weights are what costs: at
T = 1 the 8 chosen experts' weights are 8 x 3 x 2048 x 768 x 2 bytes = 75 MB per layer, against a few kilobytes
of activations. A fused MoE does the whole layer in three steps, each over all experts at once:

1. :func:`align_by_expert` sorts the ``T * k`` (token, choice) pairs by expert and pads each expert's group to a
   multiple of ``BLOCK_M`` rows, so that every block of ``BLOCK_M`` sorted rows belongs to exactly one expert.
2. The grouped GEMM (:func:`_grouped_gemm_kernel`): one program per (block of ``BLOCK_M`` sorted rows,
   ``BLOCK_N`` output columns) reads its block's expert id, gathers its rows' input vectors, and multiplies them
   by *that one expert's* weight tile. Launched first over ``w13`` with SiLU(gate) * up fused into the epilogue,
   then over ``w2`` with the routing weight multiplied in.
3. The ``k`` weighted rows of each token are summed (a reshape-sum in torch).

This is the structure of SGLang's and vLLM's ``fused_moe`` (``moe_align_block_size`` + ``fused_moe_kernel``),
written out plainly: one kernel, no autotuning, no quantised weights, no expert parallelism.

Importing this module imports ``triton``; ``TRITON_INTERPRET=1`` set before that import runs the kernel on the CPU
in Triton's interpreter (how ``tests/test_fused_moe.py`` checks it without a GPU). The kernel follows the
conventions of :mod:`minisgl_ref.attention.triton_kernels`: int64 index arithmetic, no helper ``@triton.jit``
calls, and bf16 tiles upcast to float32 under the interpreter, whose ``tl.dot`` cannot take bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl_ref.moe.experts import check_expert_inputs


def interpreted(kernel: object) -> bool:
    """True when ``kernel`` was decorated under ``TRITON_INTERPRET=1`` (it then runs on the CPU, in numpy)."""
    return not isinstance(kernel, triton.runtime.JITFunction)


def available(x: torch.Tensor) -> bool:
    """Whether :func:`fused_experts` can run on ``x``'s device: CUDA, or anywhere under Triton's interpreter
    (slow: for tests). Elsewhere the reference loop is the way."""
    return x.is_cuda or interpreted(_grouped_gemm_kernel)


# --------------------------------------------------------------------------------------------------------------
# 1. Sort and pad the (token, choice) pairs by expert
# --------------------------------------------------------------------------------------------------------------


def align_by_expert(topk_ids: torch.Tensor, num_experts: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``T * k`` (token, choice) pairs grouped by expert, each group padded to a multiple of ``block_m``.

    Pair ``p = t * k + j`` is token ``t``'s ``j``-th choice, expert ``topk_ids[t, j]``. Returns

    - ``sorted_token_ids`` (int32, ``[max_blocks * block_m]``): expert 0's pairs (in pair order), then padding up
      to a multiple of ``block_m``, then expert 1's, ... Padding rows hold the sentinel ``T * k`` (one past the last
      pair), which the kernel masks. An expert with no pair gets no row, hence no block.
    - ``expert_of_block`` (int32, ``[max_blocks]``): the expert of each block of ``block_m`` rows; ``-1`` past the
      last used block.
    - ``num_tokens_post_padded`` (int32, ``[1]``): how many rows are used (a multiple of ``block_m``).

    A pair whose id is negative gets no row at all: under expert parallelism (:mod:`~minisgl_ref.moe.ep`) it is
    routed to an expert another rank holds. It is counted in an extra bucket ``E`` that is given no blocks, and its
    place in the sort is written to a spare slot past the end that the caller never sees.

    Why this layout: the grouped GEMM gives each program one block of rows, and a block of one expert needs one
    weight tile per K step, read once for all its rows. Mixing experts in a block would mean one weight tile per
    row, i.e. no matrix product at all. The cost is the padding: each used expert wastes up to ``block_m - 1``
    rows of compute (never of weight traffic, which is the same tile either way). At decode (T = 1, k = 8) every
    used expert has one row in a block of 16, so 15/16 of the tensor-core work is padding, but that work is free:
    the kernel waits on the weights. At T = 1024 an expert of Qwen3-30B-A3B averages 64 rows, and the padding is
    a few percent.

    Why the sizes are the worst case and the count a tensor: the number of used rows depends on the routing,
    known only on the device. Sizing the outputs for the worst case (each used expert one row short of a full
    block: ``T * k + min(E, T * k) * (block_m - 1)`` rows) and launching the kernel over that many blocks, with
    programs past ``num_tokens_post_padded`` returning at once, keeps every size fixed by ``T``: no host
    synchronisation, so the whole layer can be captured in a CUDA graph and replayed with any routing. For the
    same reason the counts come from ``scatter_add_`` and not ``torch.bincount``, which reads the largest id back
    to the host to size its output.

    What to decide (task 14.1): the outputs' sizes, from ``T``, ``k``, ``E`` and ``block_m`` alone (the worst
    case above); where each expert's group starts among the padded rows (a running sum of the counts rounded up
    to whole blocks, so that an empty expert takes no room); where each pair lands inside its group (its rank
    among its expert's pairs, in pair order); and which expert owns each block.

    SGLang does this step in one small CUDA kernel (``moe_align_block_size``: per-expert counts in shared memory,
    a prefix sum, a scatter) because the torch operations below are some twenty launches of a few microseconds
    each, which matters in a decode step. The torch version is what the book shows: each line is one idea of the
    layout, and inside a CUDA graph the launches cost little.
    """
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [tokens, k], got {tuple(topk_ids.shape)}")
    if block_m < 1:
        raise ValueError(f"block_m must be positive, got {block_m}")
    # BEGIN TASK 14.1: sort and pad the pairs by expert
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    max_padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    max_blocks = (max_padded + block_m - 1) // block_m

    flat = torch.where(flat >= 0, flat, num_experts)  # skipped pairs (another rank's experts): bucket E
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # each group rounded up; 0 stays 0 (no block)
    padded.narrow(0, num_experts, 1).zero_()  # ... and the skipped bucket gets no rows (a fill on the device:
    # `padded[E] = 0` would copy a host scalar, which a CUDA graph cannot capture)
    group_start = torch.cumsum(counts, 0) - counts  # where expert e's pairs start among the sorted pairs
    padded_start = torch.cumsum(padded, 0) - padded  # ... and among the padded rows

    _, order = torch.sort(flat, stable=True)  # pair ids, grouped by expert, in pair order within a group
    expert_sorted = flat[order]
    rank = torch.arange(num_pairs, device=device) - group_start[expert_sorted]  # place within its expert's group
    spare = max_blocks * block_m  # one slot past the end, where skipped pairs land
    sorted_token_ids = torch.full((spare + 1,), num_pairs, dtype=torch.int32, device=device)
    where = torch.where(expert_sorted < num_experts, padded_start[expert_sorted] + rank, spare)
    sorted_token_ids.scatter_(0, where, order.to(torch.int32))
    sorted_token_ids = sorted_token_ids[:spare]

    blocks_end = torch.cumsum(padded[:num_experts] // block_m, 0)  # expert e owns [blocks_end[e-1], blocks_end[e])
    block = torch.arange(max_blocks, device=device)
    owner = torch.searchsorted(blocks_end, block, right=True)
    expert_of_block = torch.where(block < blocks_end[-1], owner, -1).to(torch.int32)
    num_tokens_post_padded = (blocks_end[-1:] * block_m).to(torch.int32)
    return sorted_token_ids, expert_of_block, num_tokens_post_padded
    # END TASK 14.1


# --------------------------------------------------------------------------------------------------------------
# 2. The grouped GEMM
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _grouped_gemm_kernel(
    A,  # [rows, K]: the tokens' hidden states (first launch) or the pairs' activations (second launch)
    B,  # [E, N or 2N, K]: w13 (gate rows, then up rows) or w2; C[row] = A[row] @ B[expert]^T
    C,  # out [num_pairs, N], indexed by pair id
    topk_weights,  # [num_pairs]: the routing weight of each pair (read with MUL_ROUTED_WEIGHT)
    sorted_token_ids,  # [max_blocks * BLOCK_M] int32: pair ids grouped by expert, padded with num_pairs
    expert_of_block,  # [max_blocks] int32
    num_tokens_post_padded,  # [1] int32: rows in use
    num_pairs,
    N,
    K,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    A_ROW_DIV: tl.constexpr,  # pair p reads row p // A_ROW_DIV of A: k for the hidden states, 1 for activations
    GATED: tl.constexpr,  # C = silu(A @ B[e, :N]^T) * (A @ B[e, N:2N]^T)
    MUL_ROUTED_WEIGHT: tl.constexpr,  # C = topk_weights[p] * (A @ B[e]^T)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # axis 0 varies fastest: neighbouring programs are an expert's consecutive blocks, reading the same weight tile
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded).to(tl.int64):
        return  # a block past the used rows (the grid is sized for the worst case)
    expert = tl.load(expert_of_block + pid_m).to(tl.int64)

    pair = tl.load(sorted_token_ids + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = pair < num_pairs  # the sentinel marks padding
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    col_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)

    a_ptrs = A + (pair // A_ROW_DIV)[:, None] * stride_am + offs_k[None, :] * stride_ak  # gathered rows
    b_ptrs = B + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk  # [BLOCK_K, BLOCK_N]
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
    acc_up = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)  # used by GATED only
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:  # the CPU interpreter cannot tl.dot bfloat16 (triton#11584): it goes through float32
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
        if GATED:  # the up rows sit N rows below the gate rows: same A tile, a second weight tile
            b_up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST:
                b_up = b_up.to(tl.float32)
            acc_up += tl.dot(a, b_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up  # silu(gate) * up, in float32, before the one rounding
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(topk_weights + pair, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    c_ptrs = C + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn  # back to the pair's own row
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


#: Block sizes. BLOCK_M follows the load (:func:`default_block_m`); BLOCK_N = 64 and BLOCK_K = 32 are the untuned
#: default of vLLM's and SGLang's fused MoE (with BLOCK_M = 64; for small batches they take BLOCK_M = 16). A
#: program holds one [BLOCK_M, 32] activation tile and two [32, 64] weight tiles (gate and up) per K step, 12 KB in
#: bf16 at BLOCK_M = 64, so 3 pipeline stages fit easily in shared memory at 4 warps. No autotuning: one fixed
#: choice, which scripts/gpu/measure/moe_kernel.py measures; tuned tables per (E, N, GPU) are a later step.
BLOCK_N = 64
BLOCK_K = 32
NUM_WARPS = 4
NUM_STAGES = 3


def default_block_m(num_pairs: int, num_experts: int) -> int:
    """16 rows per block while experts average fewer than 64 pairs, else 64.

    A block is padded to BLOCK_M rows, so with few pairs per expert a large block is mostly padding (decode:
    one pair in a block of 64 would be 63/64 wasted compute); 16 is the smallest tile ``tl.dot`` takes. Once the
    average expert fills a block of 64 (Qwen3-30B-A3B: E = 128, k = 8, so T >= 1024 tokens), the larger block
    reads each weight tile once for 64 rows instead of four times for 4 x 16, and the padding is a small part."""
    return 64 if num_pairs >= 64 * num_experts else 16


def _launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, topk_weights: torch.Tensor,
            sorted_token_ids: torch.Tensor, expert_of_block: torch.Tensor, num_tokens_post_padded: torch.Tensor,
            *, a_row_div: int, gated: bool, mul_routed_weight: bool, block_m: int, block_n: int,
            block_k: int) -> None:
    """One launch of the grouped GEMM over every block (used or not) and every BLOCK_N columns of ``c``."""
    n, k = c.shape[1], a.shape[1]
    upcast = interpreted(_grouped_gemm_kernel) and a.dtype == torch.bfloat16
    precision = "ieee" if a.dtype == torch.float32 or upcast else "tf32"  # fp32: exact products, not TF32
    grid = (expert_of_block.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, b, c, topk_weights, sorted_token_ids, expert_of_block, num_tokens_post_padded,
        c.shape[0], n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        A_ROW_DIV=a_row_div, GATED=gated, MUL_ROUTED_WEIGHT=mul_routed_weight,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=precision, UPCAST=upcast,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip


def fused_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, *, block_m: int | None = None, block_n: int = BLOCK_N,
                  block_k: int = BLOCK_K) -> torch.Tensor:
    """:func:`~minisgl_ref.moe.experts.reference_experts`, computed by the fused kernel.

    ``hidden`` [T, H]; ``w13`` [E, 2I, H] (gate rows, then up rows); ``w2`` [E, H, I]; ``topk_weights`` and
    ``topk_ids`` [T, k]. Any H and I: the kernel masks the last partial BLOCK_N / BLOCK_K tile.

    First launch: ``act[p] = silu(x[t] @ W1[e]^T) * (x[t] @ W3[e]^T)`` for each pair ``p = t * k + j``. The
    activation is fused into the GEMM: a program computes the gate tile and the matching up tile (the same
    columns, I rows further down ``w13``) from the same gathered activation rows, and multiplies them in
    registers before anything is stored. The alternative (store ``[T * k, 2I]`` gate-up rows, then an elementwise
    kernel) writes and re-reads twice the intermediate and costs one more launch; fused, only ``[T * k, I]`` is
    written, rounded once to the hidden dtype because it is the next GEMM's input.

    Second launch: ``out_pair[p] = w[p] * act[p] @ W2[e]^T``, written in float32. The ``k`` rows of a token are
    then summed by a reshape-sum in torch and rounded once to the hidden dtype, as the reference does. We chose
    the sum over atomic adds into ``[T, H]`` (SGLang and vLLM also sum the ``k`` rows in a separate small kernel,
    ``moe_sum``): it is deterministic (the same order of addition every run, so CUDA-graph replays and eager runs
    agree bit for bit), and costs one read of ``T * k * H * 4`` bytes (67 MB at T = 1024, next to the expert
    weights' 1.2 GB). The pair rows start at zero because a pair with a negative id (another rank's expert, see
    :mod:`~minisgl_ref.moe.ep`) is in no block and never written: one more write of the same bytes.
    """
    check_expert_inputs(hidden, w13, w2, topk_weights, topk_ids)
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, h = w13.shape
    inter = two_inter // 2
    if num_tokens == 0:
        return hidden.new_zeros(0, h)
    num_pairs = num_tokens * top_k
    if block_m is None:
        block_m = default_block_m(num_pairs, num_experts)
    if min(block_m, block_n, block_k) < 16:
        raise ValueError(f"block sizes must be at least 16 (tl.dot's smallest tile), got "
                         f"{block_m}, {block_n}, {block_k}")
    sorted_token_ids, expert_of_block, num_tokens_post_padded = align_by_expert(topk_ids, num_experts, block_m)
    weights = topk_weights.reshape(-1).contiguous()
    blocks = dict(block_m=block_m, block_n=block_n, block_k=block_k)

    act = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)
    _launch(hidden, w13, act, weights, sorted_token_ids, expert_of_block, num_tokens_post_padded,
            a_row_div=top_k, gated=True, mul_routed_weight=False, **blocks)
    out_pairs = torch.zeros(num_pairs, h, dtype=torch.float32, device=hidden.device)  # skipped pairs stay 0
    _launch(act, w2, out_pairs, weights, sorted_token_ids, expert_of_block, num_tokens_post_padded,
            a_row_div=1, gated=False, mul_routed_weight=True, **blocks)
    return out_pairs.view(num_tokens, top_k, h).sum(dim=1).to(hidden.dtype)
