"""The FP8 matmul of group-scaled operands, in Triton (chapter 15): ``C = (A * s_A) (B * s_B)^T``.

``A [M, K]`` is the activation in e4m3 with one scale per token and ``G``-wide group of features (``s_A [M,
ceil(K / G)]``); ``B [N, K]`` the weight in e4m3 with one scale per output row and group (``s_B [N, ceil(K / G)]``,
the form :func:`~minisgl_ref.quant.linear.prepare_layer_` loads a 128 x 128 checkpoint into). Inside one group both
scales are constant along K, so a group's contribution is the FP8 product of the two tiles times the outer product
of the scales::

    C[m, n] = sum over groups g of  s_A[m, g] * s_B[n, g] * sum over k in g of A[m, k] * B[n, k]

One program computes a ``BLOCK_M x BLOCK_N`` tile of C, stepping along K one group at a time (``BLOCK_K = G``):
it loads the two FP8 tiles (one byte an element: half the bytes of bf16, which is the point in a memory-bound
decode step), multiplies them on the tensor cores, and adds the product scaled by its rows' and columns' scales to
a float32 accumulator. This is the structure of DeepSeek-V3's block-FP8 GEMM as SGLang runs it, with a scale per
weight row rather than per 128 rows.

Under Triton's interpreter (no GPU) the tiles are upcast to float32 before ``tl.dot``, which computes exactly: every
e4m3 number is a float32 number.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl_ref.attention.triton_kernels.kv_indices import interpreted


@triton.jit
def _group_scaled_gemm_kernel(
    A, B, C, As, Bs,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn, stride_asm, stride_asg, stride_bsn, stride_bsg,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # the scale group: one scale per row per BLOCK_K columns
    UPCAST: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
    for g in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        k = g * BLOCK_K + offs_k
        mask_k = k < K
        a = tl.load(A + offs_m[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(B + offs_n[:, None] * stride_bn + k[None, :] * stride_bk,
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        a_scale = tl.load(As + offs_m * stride_asm + g * stride_asg, mask=mask_m, other=0.0)
        b_scale = tl.load(Bs + offs_n * stride_bsn + g * stride_bsg, mask=mask_n, other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(a, tl.trans(b)) * a_scale[:, None] * b_scale[None, :]
    tl.store(C + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(C.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def group_scaled_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                      group: int, out_dtype: torch.dtype) -> torch.Tensor:
    """``(a * a_scale) @ (b * b_scale)^T`` for e4m3 ``a [M, K]``, ``b [N, K]`` and float32 group scales
    ``a_scale [M, ceil(K / group)]``, ``b_scale [N, ceil(K / group)]``; the result ``[M, N]`` in ``out_dtype``."""
    if group < 16 or group & (group - 1):
        raise ValueError(f"the scale group must be a power of two of at least 16 (a tl.dot tile), got {group}")
    m, k = a.shape
    n = b.shape[0]
    groups = -(-k // group)
    if b.shape[1] != k or a_scale.shape != (m, groups) or b_scale.shape != (n, groups):
        raise ValueError(f"shapes do not match: a {tuple(a.shape)}, a_scale {tuple(a_scale.shape)}, "
                         f"b {tuple(b.shape)}, b_scale {tuple(b_scale.shape)}, group {group}")
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return c
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)  # decode steps have few rows: do not pad them to 64
    block_n = 64 if n <= 4096 else 128
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _group_scaled_gemm_kernel[grid](
        a, b, c, a_scale, b_scale, m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=group, UPCAST=interpreted(_group_scaled_gemm_kernel),
    )  # fmt: skip
    return c
