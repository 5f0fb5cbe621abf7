"""A split-KV decode kernel whose programs read every KV head of a token at once (chapter 11).

``benchmarks/gather_bandwidth.py`` found that an H100 gathers a decode step's KV cache fastest in whole 2 KiB
rows (all 8 KV heads of a token, K or V) rather than in 256-byte pieces (one head): 3.04 against 2.94 TB/s. The
``triton`` backend's decode kernel reads one KV head per program, so each of its loads is a 256-byte piece. This
kernel is the same split-KV algorithm with the other cut: program ``(b, s)`` takes piece ``s`` of request ``b``'s
context for *every* head.

How one ``tl.dot`` serves 8 KV heads. A tile of ``BLOCK_N`` tokens is loaded as ``BLOCK_N x 8`` rows of 128
(token-major, head-minor: each token's 2 KiB in one piece). All 16 query heads are multiplied with all of those
rows, and the scores of a query head with the rows of other KV heads are masked to ``-inf`` before the softmax,
so they get probability 0 and add nothing to the second product. Seven eighths of the tensor-core work is thrown
away, which a memory-bound kernel can afford. The pieces are merged by the ``triton`` backend's stage 2.

``benchmarks/decode_balance.py`` times it as ``allheads_S_N_W_T`` (pieces of ``S`` tokens, tiles of ``N``
tokens, ``W`` warps, ``T`` pipeline stages).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from minisgl_ref.attention.triton_kernels.decode_attention import context_piece, merge_kv_splits


@triton.jit
def _allheads_stage1(Q, K, V, kv_indptr, kv_indices, Mid_O, Mid_LSE, sm_scale_log2, max_splits,
                     stride_qb, stride_qh, stride_ks, stride_vs, stride_mob, stride_moh, stride_mos,
                     stride_mlb, stride_mlh,
                     H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, MIN_SPLIT_LEN: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    kv_start, lo, hi = context_piece(kv_indptr, b, split, max_splits, MIN_SPLIT_LEN)
    if lo < hi:
        GROUP: tl.constexpr = H // KVH
        R: tl.constexpr = BLOCK_N * KVH  # rows of a K tile: token-major, head-minor
        offs_h = tl.arange(0, H)
        offs_d = tl.arange(0, D)
        offs_r = tl.arange(0, R)
        q = tl.load(Q + b * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :])  # [H, D]
        # score [h, r] is real only where row r's head is query head h's KV head
        same_head = (offs_h[:, None] // GROUP) == (offs_r[None, :] % KVH)
        m_i = tl.full([H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([H], dtype=tl.float32)
        acc = tl.zeros([H, D], dtype=tl.float32)
        tok_in_tile = offs_r // KVH
        head_of_row = (offs_r % KVH).to(tl.int64)
        for start in range(lo, hi, BLOCK_N):
            pos = start + tok_in_tile
            valid = pos < hi
            slot = tl.load(kv_indices + kv_start + pos, mask=valid, other=0).to(tl.int64)
            k = tl.load(K + slot[:, None] * stride_ks + head_of_row[:, None] * D + offs_d[None, :],
                        mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * sm_scale_log2  # [H, R]
            s = tl.where(same_head & valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + slot[:, None] * stride_vs + head_of_row[:, None] * D + offs_d[None, :],
                        mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        mid = b * stride_mob + offs_h[:, None] * stride_moh + split * stride_mos + offs_d[None, :]
        tl.store(Mid_O + mid, acc / l_i[:, None])
        tl.store(Mid_LSE + b * stride_mlb + offs_h * stride_mlh + split, m_i + tl.log2(l_i))


def allheads_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, kv_indptr: torch.Tensor,
                    kv_indices: torch.Tensor, mid_o: torch.Tensor, mid_lse: torch.Tensor, sm_scale: float,
                    max_splits: int, min_split_len: int = 128, block_n: int = 16, num_warps: int = 4,
                    num_stages: int = 2) -> None:
    """Same arguments as :func:`minisgl_ref.attention.triton_kernels.decode_attention.decode_attention_fwd`
    (``k``, ``v``: ``[slots, KV heads, D]`` with each slot's heads contiguous)."""
    batch, H, D = q.shape  # noqa: N806
    KVH = k.shape[1]  # noqa: N806
    assert k.stride(1) == D and v.stride(1) == D and q.stride(2) == 1
    _allheads_stage1[(batch, max_splits)](
        q, k, v, kv_indptr, kv_indices, mid_o, mid_lse, sm_scale * math.log2(math.e), max_splits,
        q.stride(0), q.stride(1), k.stride(0), v.stride(0), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), H=H, KVH=KVH, D=D, MIN_SPLIT_LEN=min_split_len, BLOCK_N=block_n,
        num_warps=num_warps, num_stages=num_stages)
    merge_kv_splits(mid_o, mid_lse, o, kv_indptr, max_splits, min_split_len)
