"""Extend (prefill) attention: new queries over a paged cached prefix plus, causally, the new tokens (chapter 07).

An extend row of the batch has ``prefix_len`` tokens already in the KV pool (a radix-cache hit or earlier chunks
of a chunked prefill) and ``extend_len`` new tokens. New token ``i`` (position ``prefix_len + i``) sees

- every prefix token: no mask at all, read through the page table (``kv_indices``), and
- new tokens ``0 .. i``: a causal mask, read from the contiguous ``k``/``v`` of this forward pass.

The kernel walks those two parts one after the other with the same online softmax (FlashAttention's
running max / running sum / rescaled accumulator), so the result is one softmax over ``prefix + new``.

Grid ``(B, H, cdiv(max_extend_len, BLOCK_M))``: a program owns ``BLOCK_M`` new queries of one request and one
query head (GQA: it reads KV head ``h // group``). Programs past a request's ``extend_len`` do nothing. In the
causal part a program only visits key blocks up to its own last query, which halves the work of a plain prefill.

Why the new tokens are read from ``k``/``v`` and not from the pool where they were just stored: the values are
the same, but the contiguous copy needs no index load per key and its addresses are consecutive, and the split
makes the two kinds of visibility (all / causal) two simple loops instead of one mask over positions.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from minisgl_ref.attention.triton_kernels.kv_indices import interpreted


@triton.jit
def _extend_kernel(
    Q,  # [T, H, D]: the new tokens' queries, requests back to back
    K_Extend,  # [T, KVH, D]: the new tokens' keys and values
    V_Extend,
    K_Buffer,  # [num_slots, KVH, D]: the layer's KV pool (holds the prefixes)
    V_Buffer,
    O,  # out [T, H, D]
    qo_indptr,  # [B + 1]: request b's new tokens are rows qo_indptr[b] .. qo_indptr[b + 1] of Q/K_Extend/O
    kv_indptr,  # [B + 1]: request b's prefix slots are kv_indices[kv_indptr[b] .. kv_indptr[b + 1]]
    kv_indices,
    custom_mask,  # HAS_MASK: uint8, every masked request's [extend_len, extend_len] mask, row-major, back to back
    mask_offsets,  # HAS_MASK: [B] int64, where request b's mask starts in custom_mask, or -1 (causal)
    sm_scale_log2,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    HAS_MASK: tl.constexpr = False,
):
    # Index arithmetic in int64 from the start (see the package docstring).
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    block_m = tl.program_id(2).to(tl.int64)
    kv_head = h // GROUP

    qo_start = tl.load(qo_indptr + b).to(tl.int64)
    extend_len = tl.load(qo_indptr + b + 1).to(tl.int64) - qo_start
    kv_start = tl.load(kv_indptr + b).to(tl.int64)
    prefix_len = tl.load(kv_indptr + b + 1).to(tl.int64) - kv_start

    if block_m * BLOCK_M < extend_len:
        offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)  # index among the request's new tokens
        mask_m = offs_m < extend_len
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        q = tl.load(
            Q + (qo_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
            mask=mask_m[:, None] & mask_d[None, :],
            other=0.0,
        )
        if UPCAST:  # the CPU interpreter cannot tl.dot bfloat16 (triton#11584): it goes through float32
            q = q.to(tl.float32)
        # Every row sees key 0 (of the prefix, or its first new token), so the running max is finite after
        # the first block and the -inf start never meets a -inf score.
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
        acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)

        # Part 1: the cached prefix, through the page table. Visible to every new token.
        for start_n in range(0, prefix_len, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < prefix_len
            slots = tl.load(kv_indices + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
            k = tl.load(
                K_Buffer + slots[:, None] * stride_kbs + kv_head * stride_kbh + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :],
                other=0.0,
            )
            if k.dtype.is_fp8():  # an FP8 cache (chapter 15): its numbers in the query's dtype, scaled outside
                k = k.to(q.dtype)
            if UPCAST:
                k = k.to(tl.float32)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale_log2
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
            v = tl.load(
                V_Buffer + slots[:, None] * stride_vbs + kv_head * stride_vbh + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :],
                other=0.0,
            )
            if v.dtype.is_fp8():
                v = v.to(Q.dtype.element_ty)
            # Online softmax: rescale what was accumulated under the old running max, add this block.
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            p = p.to(v.dtype)
            if UPCAST:
                p, v = p.to(tl.float32), v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
            m_i = m_new

        # Part 2: the new tokens themselves, causally: new token i sees new tokens 0..i. Key blocks after this
        # program's last query are skipped entirely. A request with a custom mask (HAS_MASK and an offset >= 0)
        # also drops what its mask forbids; the mask is lower triangular, so the same blocks are skipped.
        causal_end = tl.minimum(extend_len, (block_m + 1) * BLOCK_M)
        if HAS_MASK:
            mask_start = tl.load(mask_offsets + b)
            # The request's real queries, if it has a mask (none otherwise). Made a [BLOCK_M] vector before it
            # meets a load's mask: Triton's interpreter refuses a mask combined with a scalar condition.
            tree_m = mask_m & ((offs_m * 0 + mask_start) >= 0)
        for start_n in range(0, causal_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < extend_len
            k = tl.load(
                K_Extend + (qo_start + offs_n)[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :],
                other=0.0,
            )
            if UPCAST:
                k = k.to(tl.float32)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale_log2
            visible = mask_n[None, :] & (offs_n[None, :] <= offs_m[:, None])
            if HAS_MASK:
                # Entries outside the request's square read as 1 (no change); a causal request reads none.
                allowed = tl.load(
                    custom_mask + mask_start + offs_m[:, None] * extend_len + offs_n[None, :],
                    mask=tree_m[:, None] & mask_n[None, :],
                    other=1,
                )
                visible = visible & (allowed != 0)
            qk = tl.where(visible, qk, float("-inf"))
            v = tl.load(
                V_Extend + (qo_start + offs_n)[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :],
                other=0.0,
            )
            m_new = tl.maximum(m_i, tl.max(qk, 1))  # the same online-softmax step as in part 1
            m_sub = m_new
            if HAS_MASK:
                # Without a prefix, a masked query may see no key of the first blocks: its running max is still
                # -inf, and exp2(-inf - -inf) would be NaN. Subtracting 0 there adds exactly nothing (p = 0).
                m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_sub)
            p = tl.exp2(qk - m_sub[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            p = p.to(v.dtype)
            if UPCAST:
                p, v = p.to(tl.float32), v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
            m_i = m_new

        out = acc / l_i[:, None]
        tl.store(
            O + (qo_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
            out.to(O.dtype.element_ty),
            mask=mask_m[:, None] & mask_d[None, :],
        )


def extend_launch_config(max_prefix_len: int) -> dict[str, int]:
    """Tile sizes, from measurements on an H100 (bf16, head dim 128, GQA 2, tokens/s of the kernel alone):
    with long cached prefixes, 128-query tiles with 2 pipeline stages reuse every prefix K/V load twice as much
    (4 x (2048 prefix + 512 new): 256 vs 137 TFLOP/s; 8 x (1000 + 1000): 250 vs 159); without one, 64-query
    tiles waste less on the causal diagonal (1 x 4096: 230 vs 198; 64 x (100 + 64): 84 vs 57)."""
    if max_prefix_len >= 512:
        return dict(block_m=128, block_n=64, num_warps=4, num_stages=2)
    return dict(block_m=64, block_n=64, num_warps=4, num_stages=1)


def extend_attention_fwd(
    q: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    o: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 1,
    custom_mask: torch.Tensor | None = None,
    mask_offsets: torch.Tensor | None = None,
) -> None:
    """q, o: [T, H, D]; k_extend, v_extend: [T, KVH, D] (this pass's new tokens); k_buffer, v_buffer:
    [slots, KVH, D] holding every request's prefix at ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``.

    ``custom_mask`` / ``mask_offsets`` (both or neither; :func:`pack_extend_masks` builds them): per-request masks
    over the new tokens (``ForwardBatch.extend_masks``), each lower triangular with a true diagonal."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_extend.shape[1]
    group = num_heads // num_kv_heads
    assert group * num_kv_heads == num_heads, "query heads must be a multiple of KV heads"
    for t in (q, k_extend, v_extend, o, k_buffer, v_buffer):
        assert t.stride(-1) == 1, "the head dimension must be contiguous"
    batch = qo_indptr.shape[0] - 1
    if batch == 0 or num_tokens == 0:
        return
    block_d = max(16, triton.next_power_of_2(head_dim))
    upcast = interpreted(_extend_kernel) and q.dtype == torch.bfloat16
    precision = "ieee" if q.dtype == torch.float32 or upcast else "tf32"  # fp32: exact products, not TF32
    has_mask = custom_mask is not None
    assert has_mask == (mask_offsets is not None), "custom_mask and mask_offsets go together"
    grid = (batch, num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q, k_extend, v_extend, k_buffer, v_buffer, o, qo_indptr, kv_indptr, kv_indices,
        custom_mask if has_mask else qo_indptr, mask_offsets if has_mask else qo_indptr,  # unused without a mask
        sm_scale * math.log2(math.e),
        q.stride(0), q.stride(1), k_extend.stride(0), k_extend.stride(1), v_extend.stride(0), v_extend.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1), o.stride(0), o.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_PRECISION=precision, UPCAST=upcast, HAS_MASK=has_mask, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


def pack_extend_masks(masks: list[torch.Tensor | None], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``ForwardBatch.extend_masks`` as the kernel reads them: the masked requests' ``[E, E]`` masks flattened
    back to back as uint8 on ``device``, and each request's start in it (-1 for a causal request), int64. Built
    on the host and copied once per step."""
    offsets, parts, total = [], [], 0
    for m in masks:
        if m is None:
            offsets.append(-1)
            continue
        offsets.append(total)
        parts.append(m.reshape(-1).to("cpu", torch.uint8))
        total += m.numel()
    flat = torch.cat(parts) if parts else torch.ones(1, dtype=torch.uint8)
    return flat.to(device, non_blocking=True), torch.tensor(offsets, dtype=torch.int64).to(device, non_blocking=True)
