"""Cascade decode attention: a prefix that several requests share is read once per step, not once per request
(chapter 11).

With a radix cache (chapter 04), requests with the same system prompt point their page-table rows at the *same*
KV slots for it. Plain decode attention (:mod:`minisgl_ref.attention.triton_kernels.decode_attention`) still
streams that prefix once per request: 16 requests behind a 2,048-token prompt read the same 2,048 tokens of K and
V 16 times per layer and step. Decode is bound by exactly those bytes, so the cascade splits each request's
attention in two and computes the shared half once per group:

* **pass 1, the shared prefix** (:func:`_cascade_prefix_kernel`): a program takes a *tile* of query rows of one
  group, for the query heads that read one KV head (grouped-query attention), and runs an online softmax over a
  piece of the group's prefix. Its K/V loads serve every query in the tile: one read of the prefix per group and
  step, however many requests share it. For each row and head it writes the piece's normalised output and its
  log-sum-exp, exactly like stage 1 of split-KV decode; the online softmax itself is stage 1's own
  (:func:`~minisgl_ref.attention.triton_kernels.decode_attention.attend_slots`), handed a tile of queries and
  the prefix's slots.
* **pass 2, each request's own suffix** (:func:`_cascade_suffix_kernel`): the split-KV decode of stage 1, over
  the slots after the request's shared prefix only (for a request that shares nothing, its whole context).
* **pass 3, the merge** (:func:`_cascade_merge_kernel`): fold the pieces of each pass into one partial result
  ``(o_1, lse_1)`` (prefix) and ``(o_2, lse_2)`` (suffix), then merge the two states::

      m = max(lse_1, lse_2),   o = (o_1 2^(lse_1 - m) + o_2 2^(lse_2 - m)) / (2^(lse_1 - m) + 2^(lse_2 - m))

  which is softmax attention over prefix + suffix: each part's share of the total softmax mass is
  ``2^lse_i / (2^lse_1 + 2^lse_2)``. A part with no keys has ``lse = -inf`` and weight 0.

**What the kernels read, and why it fits CUDA graphs.** Everything that depends on the groups (which rows, how
long the shared prefix, how it is cut into work items) is one small int32 *plan* buffer, built on the host when
the groups change (:mod:`minisgl_ref.perf.cascade`) and copied to the device in one transfer. Its layout
depends only on the batch size ``B``:

==========================  ===============================================================================
``plan[0]``, ``plan[1]``    number of pass-1 work items with small tiles, with large tiles
``plan[2 : 2 + B]``         shared prefix length of each batch row (0: the row shares nothing)
``plan[2 + B : 2 + 2B]``    how many pass-1 pieces each row received (what pass 3 merges)
``plan[2 + 2B : 2 + 3B]``   the batch rows of all groups, group after group (tiles index into it)
``plan[2 + 3B :]``          the work items, ``WORK_FIELDS`` int32 each (see :data:`WORK_FIELDS`): the small-tile
                            list, then the large-tile list
==========================  ===============================================================================

Pass 1 is a *persistent* grid: a fixed number of programs per KV head walk a work list (``for w in range(pid,
num_work, num_programs)``), so the grid does not depend on how many groups a step has. It runs twice, once per
tile size: a group whose queries (rows x GQA) fit 16 rows takes one small tile, so a pair of requests does not
pay for a 64-row tile of padding (on an H100, 64 groups of 4 requests run 25% faster than with one tile size),
while a large group takes 64-row tiles, so 256 requests behind one prefix read it 8 times, not 32 (2.4x faster
than 16-row tiles). Pass 2 derives its pieces
from each row's length inside the kernel, as split-KV decode does. So the three launches have the same shapes
for every batch of a given size, which is what lets a CUDA graph record them once and replay them with a new
plan (chapter 08). KV slots are read straight from the page table (``req_to_token[row, position]``); no
``kv_indices`` array is built.

Conventions as in the package docstring: int64 index arithmetic, inline arithmetic instead of helper jit
functions, base-2 exponentials (``lse`` in log2 units).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from minisgl_ref.attention.triton_kernels.decode_attention import attend_slots
from minisgl_ref.attention.triton_kernels.kv_indices import interpreted

#: int32 fields per pass-1 work item: (first entry of the tile's rows in the row list, number of the group's rows
#: from there on, first flattened (row, head) index of the tile, batch row whose page-table row holds the prefix,
#: first and one-past-last prefix position of the piece, piece index in the scratch buffers).
WORK_FIELDS = 7
#: int32 entries before the per-row arrays: the lengths of the two work lists.
HEADER = 2
#: Rows of a small pass-1 tile (tl.dot wants at least 16).
SMALL_BLOCK_M = 16


@triton.jit
def _cascade_prefix_kernel(
    Q,  # [B, H, D]
    K_Buffer,  # [num_slots, KVH, D]: the layer's KV pool
    V_Buffer,
    Table,  # [max_requests, max_context] int32: the page table
    ReqPoolIdx,  # [B]: each batch row's page-table row
    Plan,  # int32, laid out as in the module docstring
    Mid_O,  # out [B, H, pieces, D] float32
    Mid_LSE,  # out [B, H, pieces] float32 (log2 units)
    sm_scale_log2,
    rows_offset,  # HEADER + 2B: where the row list starts in Plan
    work_offset,  # HEADER + 3B: where the work items start in Plan
    stride_qb,
    stride_qh,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    stride_table,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    GROUP: tl.constexpr,  # query heads per KV head
    WORK: tl.constexpr,  # WORK_FIELDS
    LIST: tl.constexpr,  # 0: the small-tile work list, 1: the large-tile one
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,  # flattened (row, head) queries per tile (the list's tile size)
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    num_programs = tl.num_programs(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    num_work = tl.load(Plan + LIST).to(tl.int64)
    if LIST == 1:  # the large-tile list follows the small-tile one
        work_offset += tl.load(Plan).to(tl.int64) * WORK
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    for w in range(pid, num_work, num_programs):
        item = Plan + work_offset + w * WORK
        row_start = tl.load(item).to(tl.int64)
        num_rows = tl.load(item + 1).to(tl.int64)
        m_start = tl.load(item + 2).to(tl.int64)
        owner = tl.load(item + 3).to(tl.int64)
        lo = tl.load(item + 4).to(tl.int64)
        hi = tl.load(item + 5).to(tl.int64)
        piece = tl.load(item + 6).to(tl.int64)

        # The tile: queries m_start .. m_start + BLOCK_M of the group, flattened as (row, head of this KV head).
        # All of them read the same keys, so every K/V block loaded below serves the whole tile.
        m = m_start + offs_m
        tile_row = m // GROUP
        mask_m = tile_row < num_rows
        rows = tl.load(Plan + rows_offset + row_start + tile_row, mask=mask_m, other=0).to(tl.int64)
        heads = kv_head * GROUP + m % GROUP
        q = tl.load(
            Q + rows[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=mask_m[:, None] & mask_d[None, :],
            other=0.0,
        )
        if UPCAST:  # the CPU interpreter cannot tl.dot bfloat16 (triton#11584): it goes through float32
            q = q.to(tl.float32)
        table_row = Table + tl.load(ReqPoolIdx + owner).to(tl.int64) * stride_table

        acc, m_i, l_i = attend_slots(
            q, K_Buffer, V_Buffer, table_row, lo, hi, kv_head, stride_kbs, stride_kbh, stride_vbs, stride_vbh,
            sm_scale_log2, offs_d, mask_d, BLOCK_M, BLOCK_N, BLOCK_D, DOT_PRECISION, UPCAST,
        )  # fmt: skip  (the planner never makes an empty piece)

        mid = rows[:, None] * stride_mob + heads[:, None] * stride_moh + piece * stride_mos + offs_d[None, :]
        tl.store(Mid_O + mid, acc / l_i[:, None], mask=mask_m[:, None] & mask_d[None, :])
        tl.store(Mid_LSE + rows * stride_mlb + heads * stride_mlh + piece, m_i + tl.log2(l_i), mask=mask_m)


@triton.jit
def _cascade_suffix_kernel(
    Q,  # [B, H, D]
    K_Buffer,
    V_Buffer,
    Table,
    ReqPoolIdx,  # [B]
    SeqLens,  # [B]: whole context per row, the new token included
    Plan,
    Mid_O,
    Mid_LSE,
    sm_scale_log2,
    max_splits,
    piece_offset,  # suffix pieces go after the prefix pieces: piece_offset + split
    stride_qb,
    stride_qh,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    stride_table,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    GROUP: tl.constexpr,
    HEADER: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MIN_SPLIT_LEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # Split-KV decode stage 1 (decode_attention.py) over positions start .. seq_len of each row.
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64) // HEAD_BLOCKS
    head_block = tl.program_id(1).to(tl.int64) % HEAD_BLOCKS
    split = tl.program_id(2).to(tl.int64)
    in_group = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = in_group < GROUP
    heads = kv_head * GROUP + in_group
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    seq_len = tl.load(SeqLens + b).to(tl.int64)
    start = tl.load(Plan + HEADER + b).to(tl.int64)  # the row's shared prefix length (0 if it shares nothing)
    suffix_len = seq_len - start
    # How the suffix is cut into pieces; pass 3 repeats these lines. An empty suffix has no pieces.
    num_splits = tl.maximum(tl.minimum(max_splits, (suffix_len + MIN_SPLIT_LEN - 1) // MIN_SPLIT_LEN), 1)
    split_len = (suffix_len + num_splits - 1) // num_splits  # 0 for an empty suffix: no program works
    lo = start + split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    if lo < hi:
        q = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=mask_h[:, None] & mask_d[None, :],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
        table_row = Table + tl.load(ReqPoolIdx + b).to(tl.int64) * stride_table
        acc, m_i, l_i = attend_slots(
            q, K_Buffer, V_Buffer, table_row, lo, hi, kv_head, stride_kbs, stride_kbh, stride_vbs, stride_vbh,
            sm_scale_log2, offs_d, mask_d, BLOCK_H, BLOCK_N, BLOCK_D, DOT_PRECISION, UPCAST,
        )  # fmt: skip
        piece = piece_offset + split
        mid = b * stride_mob + heads[:, None] * stride_moh + piece * stride_mos + offs_d[None, :]
        tl.store(Mid_O + mid, acc / l_i[:, None], mask=mask_h[:, None] & mask_d[None, :])
        tl.store(Mid_LSE + b * stride_mlb + heads * stride_mlh + piece, m_i + tl.log2(l_i), mask=mask_h)


@triton.jit
def _cascade_merge_kernel(
    Mid_O,
    Mid_LSE,
    O,  # out [B, H, D]
    SeqLens,
    Plan,
    batch_size,  # B of the plan's layout
    max_splits,
    piece_offset,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    HEADER: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MIN_SPLIT_LEN: tl.constexpr,
    BLOCK_P: tl.constexpr,  # >= piece_offset (the most prefix pieces), a power of two
    BLOCK_S: tl.constexpr,  # >= max_splits, a power of two
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    mid_o = Mid_O + b * stride_mob + h * stride_moh
    mid_lse = Mid_LSE + b * stride_mlb + h * stride_mlh

    # (o_1, lse_1): the pieces pass 1 wrote for this row (none if it shares nothing).
    num_prefix = tl.load(Plan + HEADER + batch_size + b).to(tl.int64)
    offs_p = tl.arange(0, BLOCK_P)
    mask_p = offs_p < num_prefix
    lse_p = tl.load(mid_lse + offs_p, mask=mask_p, other=float("-inf"))
    o_p = tl.load(mid_o + offs_p[:, None] * stride_mos + offs_d[None, :], mask=mask_p[:, None] & mask_d[None, :],
                  other=0.0)  # fmt: skip
    max_p = tl.where(num_prefix > 0, tl.max(lse_p, 0), 0.0)  # 0, not -inf, keeps the arithmetic finite
    w_p = tl.exp2(lse_p - max_p)
    sum_p = tl.sum(w_p, 0)
    o1 = tl.sum(w_p[:, None] * o_p, 0) / tl.maximum(sum_p, 1e-30)
    lse1 = tl.where(num_prefix > 0, max_p + tl.log2(tl.maximum(sum_p, 1e-30)), float("-inf"))

    # (o_2, lse_2): the suffix pieces of pass 2 (cut exactly as that kernel cut them).
    start = tl.load(Plan + HEADER + b).to(tl.int64)
    suffix_len = tl.load(SeqLens + b).to(tl.int64) - start
    num_splits = tl.maximum(tl.minimum(max_splits, (suffix_len + MIN_SPLIT_LEN - 1) // MIN_SPLIT_LEN), 1)
    split_len = tl.maximum((suffix_len + num_splits - 1) // num_splits, 1)
    num_suffix = (suffix_len + split_len - 1) // split_len  # the pieces pass 2 did not skip as empty
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < num_suffix
    lse_s = tl.load(mid_lse + piece_offset + offs_s, mask=mask_s, other=float("-inf"))
    o_s = tl.load(mid_o + (piece_offset + offs_s)[:, None] * stride_mos + offs_d[None, :],
                  mask=mask_s[:, None] & mask_d[None, :], other=0.0)  # fmt: skip
    max_s = tl.where(num_suffix > 0, tl.max(lse_s, 0), 0.0)
    w_s = tl.exp2(lse_s - max_s)
    sum_s = tl.sum(w_s, 0)
    o2 = tl.sum(w_s[:, None] * o_s, 0) / tl.maximum(sum_s, 1e-30)
    lse2 = tl.where(num_suffix > 0, max_s + tl.log2(tl.maximum(sum_s, 1e-30)), float("-inf"))

    # merge_state: every decode row has at least one key, so m is finite.
    m = tl.maximum(lse1, lse2)
    a1 = tl.exp2(lse1 - m)
    a2 = tl.exp2(lse2 - m)
    out = (o1 * a1 + o2 * a2) / (a1 + a2)
    tl.store(O + b * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=mask_d)


def cascade_decode_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    plan: torch.Tensor,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    sm_scale: float,
    *,
    max_prefix_pieces: int,
    max_splits: int,
    prefix_programs: int,
    min_split_len: int = 128,
    block_m: int = 64,
    small_block_m: int = SMALL_BLOCK_M,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> None:
    """The three passes for a decode batch of ``B = q.shape[0]`` rows. q, o: [B, H, D]; k_buffer, v_buffer:
    [slots, KVH, D] (the new tokens stored already); ``req_to_token`` the device page table; ``plan`` int32 laid
    out for ``B`` (module docstring); ``mid_o`` [>= B, H, >= max_prefix_pieces + max_splits, D] and ``mid_lse``
    [>= B, H, >= max_prefix_pieces + max_splits] float32 scratch. ``prefix_programs`` programs per KV head walk
    pass 1's work lists; ``small_block_m`` and ``block_m`` (the two tile sizes) must be at least the GQA group, and
    the same values the planner cut the tiles with."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    group = num_heads // num_kv_heads
    assert group * num_kv_heads == num_heads, "query heads must be a multiple of KV heads"
    assert q.stride(-1) == 1 and o.stride(-1) == 1 and k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1
    assert req_to_token.stride(1) == 1 and mid_lse.stride(2) == 1 and min(block_m, small_block_m) >= group
    assert mid_o.shape[2] >= max_prefix_pieces + max_splits
    if batch == 0:
        return
    block_d = max(16, triton.next_power_of_2(head_dim))
    upcast = interpreted(_cascade_prefix_kernel) and q.dtype == torch.bfloat16
    precision = "ieee" if q.dtype == torch.float32 or upcast else "tf32"
    scale_log2 = sm_scale * math.log2(math.e)
    common = (q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0),
              v_buffer.stride(1), req_to_token.stride(0), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
              mid_lse.stride(0), mid_lse.stride(1))  # fmt: skip

    for work_list, tile in enumerate((small_block_m, block_m)):
        _cascade_prefix_kernel[(prefix_programs, num_kv_heads)](
            q, k_buffer, v_buffer, req_to_token, req_pool_indices, plan, mid_o, mid_lse, scale_log2,
            HEADER + 2 * batch, HEADER + 3 * batch, *common,
            GROUP=group, WORK=WORK_FIELDS, LIST=work_list, HEAD_DIM=head_dim, BLOCK_M=tile, BLOCK_N=block_n,
            BLOCK_D=block_d, DOT_PRECISION=precision, UPCAST=upcast, num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    block_h = 16  # tl.dot wants >= 16 rows; the GQA group is padded up to it
    head_blocks = triton.cdiv(group, block_h)
    _cascade_suffix_kernel[(batch, num_kv_heads * head_blocks, max_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, plan, mid_o, mid_lse, scale_log2,
        max_splits, max_prefix_pieces, *common,
        GROUP=group, HEADER=HEADER, HEAD_BLOCKS=head_blocks, HEAD_DIM=head_dim, MIN_SPLIT_LEN=min_split_len,
        BLOCK_H=block_h,
        BLOCK_N=block_n, BLOCK_D=block_d, DOT_PRECISION=precision, UPCAST=upcast, num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    _cascade_merge_kernel[(batch, num_heads)](
        mid_o, mid_lse, o, seq_lens, plan, batch, max_splits, max_prefix_pieces,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        o.stride(0), o.stride(1),
        HEADER=HEADER, HEAD_DIM=head_dim, MIN_SPLIT_LEN=min_split_len,
        BLOCK_P=max(2, triton.next_power_of_2(max_prefix_pieces)), BLOCK_S=max(2, triton.next_power_of_2(max_splits)),
        BLOCK_D=block_d, num_warps=4, num_stages=1,
    )  # fmt: skip
