"""Decode attention: one new query per request over its whole paged context, with split-KV (chapter 07).

A decode step has a single query token per request, so the natural grid (one program per request and head) is
tiny: 64 requests x 8 KV heads is 512 programs, each streaming a long context on its own. Decode is memory bound
(every cached K/V byte is read once per step), and a grid that small cannot keep enough loads in flight. The fix
is *split-KV* ("flash-decoding"): cut each request's context into ``num_splits`` pieces and give each piece its
own program.

Stage 1, grid ``(B, KV heads x head blocks, max_splits)``: program ``(b, g, s)`` takes the query heads that share
KV head ``g`` (grouped-query attention: query head ``h`` reads KV head ``h // group``, so those heads can share
every K/V load) and runs an online softmax over its piece of the context. It writes, per head, the piece's
normalised output ``o_s = sum_j p_j v_j / sum_j p_j`` and its log-sum-exp ``lse_s = log sum_j exp(score_j)``.

Stage 2, grid ``(B, heads)``: merge the pieces (all of a head's pieces in one tile, no loop). With
``m = max_s lse_s`` and weights ``w_s = exp(lse_s - m)``, ``o = sum_s w_s o_s / sum_s w_s`` is exactly softmax
attention over the whole context: each piece's share of the total softmax mass is ``exp(lse_s) / sum_t exp(lse_t)``.
:func:`merge_kv_splits` launches stage 2 alone (what the tests of the merge call).

The number of splits of request ``b`` is computed *inside* both kernels from its context length:
``min(max_splits, cdiv(seq_len, min_split_len))``. No per-request metadata is needed for it, so the CUDA-graph
replay path does not have to compute anything for the splits; short requests use fewer pieces and the programs
of unused pieces exit at once. All exponentials are base 2 (``exp2`` is one instruction; the scale is multiplied
by ``log2(e)`` once), so ``lse`` is stored in log2 units.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from minisgl_ref.attention.triton_kernels.kv_indices import interpreted


@triton.jit
def attend_slots(
    q,  # [ROWS, BLOCK_D] queries that all read KV head `kv_head` (float32 when UPCAST)
    K_Buffer,  # [num_slots, KVH, D]: the layer's KV pool
    V_Buffer,
    slot_ptr,  # slot_ptr + i holds the pool slot of context position i
    lo,  # the piece of context to read: positions lo .. hi (at least one)
    hi,
    kv_head,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    sm_scale_log2,
    offs_d,
    mask_d,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # The online softmax of every query over one piece of paged context, shared by this module's stage 1 and both
    # of the cascade's attention passes (which differ only in where the slots and queries come from). Returns the
    # unnormalised output acc, the running max m and the running sum l, per query row, in log2 units. Every block
    # has at least one valid key, so m is finite after the first one.
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.full([ROWS], 0.0, dtype=tl.float32)
    acc = tl.full([ROWS, BLOCK_D], 0.0, dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        # The paged part: position -> pool slot (int64 before multiplying by the stride).
        slots = tl.load(slot_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(
            K_Buffer + slots[:, None] * stride_kbs + kv_head * stride_kbh + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )
        if k.dtype.is_fp8():  # an FP8 cache (chapter 15): its numbers in the query's dtype; the caller folds the
            k = k.to(q.dtype)  # layer's key scale into sm_scale and multiplies the output by the value scale
        if UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale_log2  # [ROWS, BLOCK_N]
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V_Buffer + slots[:, None] * stride_vbs + kv_head * stride_vbh + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )
        if v.dtype.is_fp8():
            v = v.to(q.dtype)
        p = p.to(v.dtype)  # like FlashAttention: probabilities in the input dtype for the second matmul
        if UPCAST:
            p, v = p.to(tl.float32), v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def context_piece(kv_indptr, b, split, max_splits, MIN_SPLIT_LEN: tl.constexpr):
    """Where piece ``split`` of request ``b``'s context lies: ``(kv_start, lo, hi)``, the request's first entry in
    ``kv_indices`` and the piece's positions ``lo .. hi`` in its context (``lo >= hi``: an unused piece). A
    request is cut into ``min(max_splits, cdiv(seq_len, MIN_SPLIT_LEN))`` pieces of equal length; stage 2 repeats
    the first two lines of this arithmetic, and they must agree."""
    kv_start = tl.load(kv_indptr + b).to(tl.int64)
    seq_len = tl.load(kv_indptr + b + 1).to(tl.int64) - kv_start
    num_splits = tl.minimum(max_splits, (seq_len + MIN_SPLIT_LEN - 1) // MIN_SPLIT_LEN)
    split_len = (seq_len + num_splits - 1) // num_splits
    lo = split * split_len
    return kv_start, lo, tl.minimum(lo + split_len, seq_len)


@triton.jit
def _decode_stage1_kernel(
    Q,  # [B, H, D]
    K_Buffer,  # [num_slots, KVH, D]: the layer's KV pool
    V_Buffer,
    kv_indptr,  # [B + 1]
    kv_indices,  # [kv_indptr[B]]: pool slots of each request's context, in token order
    Mid_O,  # out [B, H, max_splits, D] float32: each piece's normalised output
    Mid_LSE,  # out [B, H, max_splits] float32: each piece's log2-sum-exp2
    sm_scale_log2,  # softmax scale * log2(e)
    max_splits,
    stride_qb,
    stride_qh,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_BLOCKS: tl.constexpr,  # cdiv(GROUP, BLOCK_H) programs per KV head
    HEAD_DIM: tl.constexpr,
    MIN_SPLIT_LEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # Index arithmetic in int64 from the start (see the package docstring).
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64) // HEAD_BLOCKS
    head_block = tl.program_id(1).to(tl.int64) % HEAD_BLOCKS
    split = tl.program_id(2).to(tl.int64)

    # The query heads of this program: a block of the heads that read `kv_head`. Rows beyond the group are
    # padding (tl.dot needs at least 16 rows); they compute on zeros and are never stored.
    in_group = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = in_group < GROUP
    heads = kv_head * GROUP + in_group
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    kv_start, lo, hi = context_piece(kv_indptr, b, split, max_splits, MIN_SPLIT_LEN)
    if lo < hi:  # programs of unused pieces do nothing
        q = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=mask_h[:, None] & mask_d[None, :],
            other=0.0,
        )
        if UPCAST:  # the CPU interpreter cannot tl.dot bfloat16 (triton#11584): it goes through float32
            q = q.to(tl.float32)
        acc, m_i, l_i = attend_slots(
            q, K_Buffer, V_Buffer, kv_indices + kv_start, lo, hi, kv_head, stride_kbs, stride_kbh, stride_vbs,
            stride_vbh, sm_scale_log2, offs_d, mask_d, BLOCK_H, BLOCK_N, BLOCK_D, DOT_PRECISION, UPCAST,
        )  # fmt: skip

        mid = b * stride_mob + heads[:, None] * stride_moh + split * stride_mos + offs_d[None, :]
        tl.store(Mid_O + mid, acc / l_i[:, None], mask=mask_h[:, None] & mask_d[None, :])
        tl.store(Mid_LSE + b * stride_mlb + heads * stride_mlh + split, m_i + tl.log2(l_i), mask=mask_h)


@triton.jit
def _decode_stage2_kernel(
    Mid_O,  # [B, H, >= max_splits, D] float32: stage 1's normalised output of each piece
    Mid_LSE,  # [B, H, >= max_splits] float32: stage 1's log2-sum-exp2 of each piece
    O,  # out [B, H, D]
    kv_indptr,  # [B + 1]: request b's context length is kv_indptr[b + 1] - kv_indptr[b]
    max_splits,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    MIN_SPLIT_LEN: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= max_splits, a power of two
    BLOCK_D: tl.constexpr,  # >= HEAD_DIM, a power of two
):
    """Stage 2, program ``(b, h)`` of grid ``(B, H)``: merge request ``b``'s pieces into ``O[b, h, :]``.

    What stage 1 left: for each piece ``s`` that it computed, ``Mid_O[b, h, s, :]`` is the piece's *normalised*
    output ``o_s = sum_j 2^(x_j) v_j / sum_j 2^(x_j)`` and ``Mid_LSE[b, h, s]`` its ``lse_s = log2 sum_j 2^(x_j)``
    (``x_j`` the scores in log2 units: the kernels work in base 2 throughout). Other pieces hold garbage from
    earlier steps: never read them.

    Which pieces stage 1 computed, from the context length ``n`` (repeat stage 1's arithmetic exactly):
    ``num_splits = min(max_splits, cdiv(n, MIN_SPLIT_LEN))``, ``split_len = cdiv(n, num_splits)``, and piece ``s``
    covers tokens ``[s * split_len, min((s + 1) * split_len, n))``, so the non-empty pieces are the first
    ``cdiv(n, split_len)`` (can be fewer than ``num_splits``: n = 5 in 4 pieces of 2 leaves the 4th empty).

    Write ``O[b, h, :] = sum_s w_s o_s / sum_s w_s`` with ``w_s = 2^(lse_s - m)``, ``m = max_s lse_s`` over the
    computed pieces: each piece's share of the whole softmax is ``2^(lse_s) / sum_t 2^(lse_t)``, and subtracting
    ``m`` keeps every exponent <= 0 (no overflow). Load all pieces of the head at once (``tl.arange(0, BLOCK_S)``,
    masked; a masked ``lse`` must contribute weight 0), reduce with ``tl.max`` / ``tl.sum`` over axis 0, and store
    in ``O``'s dtype (``O.dtype.element_ty``), masking the head-dim padding (``BLOCK_D >= HEAD_DIM``)."""
    # BEGIN TASK 7.1: merge the split-KV pieces by their log-sum-exp
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    seq_len = (tl.load(kv_indptr + b + 1) - tl.load(kv_indptr + b)).to(tl.int64)
    num_splits = tl.minimum(max_splits, (seq_len + MIN_SPLIT_LEN - 1) // MIN_SPLIT_LEN)  # as in stage 1
    split_len = (seq_len + num_splits - 1) // num_splits
    num_pieces = (seq_len + split_len - 1) // split_len  # the pieces stage 1 did not skip as empty

    # All pieces at once (one load each, not a loop of dependent loads): weight of piece s is 2^(lse_s - max).
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < num_pieces
    lse = tl.load(Mid_LSE + b * stride_mlb + h * stride_mlh + offs_s, mask=mask_s, other=float("-inf"))
    o = tl.load(
        Mid_O + b * stride_mob + h * stride_moh + offs_s[:, None] * stride_mos + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    w = tl.exp2(lse - tl.max(lse, 0))  # 0 for the masked pieces
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(O + b * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=mask_d)
    # END TASK 7.1


def merge_kv_splits(
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    o: torch.Tensor,
    kv_indptr: torch.Tensor,
    max_splits: int,
    min_split_len: int = 128,
) -> None:
    """Stage 2 alone: merge the pieces that stage 1 wrote into ``mid_o`` [B, H, >= max_splits, D] and ``mid_lse``
    [B, H, >= max_splits] (float32, log2 units) into ``o`` [B, H, D]. ``kv_indptr`` and ``min_split_len`` must be
    the ones stage 1 ran with: the pieces are recomputed from them."""
    batch, num_heads, head_dim = o.shape
    assert o.stride(-1) == 1 and mid_o.stride(-1) == 1 and mid_lse.stride(2) == 1
    if batch == 0:
        return
    grid = (batch, num_heads)
    args = (
        mid_o, mid_lse, o, kv_indptr, max_splits,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        o.stride(0), o.stride(1),
    )  # fmt: skip
    meta = dict(HEAD_DIM=head_dim, MIN_SPLIT_LEN=min_split_len, BLOCK_S=max(2, triton.next_power_of_2(max_splits)),
                BLOCK_D=max(16, triton.next_power_of_2(head_dim)), num_warps=4, num_stages=1)  # fmt: skip
    try:
        _decode_stage2_kernel[grid](*args, **meta)
    except Exception as exc:  # the interpreter wraps what a kernel raises: an unwritten kernel says so plainly
        if isinstance(exc.__cause__, NotImplementedError):
            raise exc.__cause__ from None
        raise


def decode_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    sm_scale: float,
    max_splits: int,
    min_split_len: int = 128,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> None:
    """Paged decode attention. q, o: [B, H, D]; k_buffer, v_buffer: [slots, KVH, D]; request b's context is
    ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` (its new token included: store before calling). ``mid_o``
    [>= B, H, >= max_splits, D] and ``mid_lse`` [>= B, H, >= max_splits] are float32 scratch for stage 1."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    group = num_heads // num_kv_heads
    assert group * num_kv_heads == num_heads, "query heads must be a multiple of KV heads"
    assert q.stride(-1) == 1 and o.stride(-1) == 1 and k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1
    assert mid_o.shape[2] >= max_splits and mid_lse.shape[2] >= max_splits and mid_lse.stride(2) == 1
    if batch == 0:
        return
    block_h = 16  # tl.dot wants >= 16 rows; GQA groups are padded up to it
    block_d = max(16, triton.next_power_of_2(head_dim))
    head_blocks = triton.cdiv(group, block_h)
    upcast = interpreted(_decode_stage1_kernel) and q.dtype == torch.bfloat16
    # float32 inputs: exact products, not TF32 (the default for fp32 tl.dot on NVIDIA GPUs)
    precision = "ieee" if q.dtype == torch.float32 or upcast else "tf32"

    grid1 = (batch, num_kv_heads * head_blocks, max_splits)
    _decode_stage1_kernel[grid1](
        q, k_buffer, v_buffer, kv_indptr, kv_indices, mid_o, mid_lse,
        sm_scale * math.log2(math.e), max_splits,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, HEAD_BLOCKS=head_blocks, HEAD_DIM=head_dim, MIN_SPLIT_LEN=min_split_len,
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d, DOT_PRECISION=precision, UPCAST=upcast,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    merge_kv_splits(mid_o, mid_lse, o, kv_indptr, max_splits, min_split_len)
