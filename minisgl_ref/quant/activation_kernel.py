"""Quantizing an activation to e4m3 in one kernel (chapter 15).

An FP8 projection multiplies FP8 operands, so every step quantizes each projection's input on the fly: the
largest magnitude of each token (or of each ``group`` of its features), the scale ``amax / 448``, and the cast.
Written with PyTorch operations (:func:`~minisgl_ref.quant.fp8.quantize_activation`, the reference) that is about
ten kernels and as many float32 copies of the activation; four projections per layer make it a few hundred small
kernels per decode step, which cost more time than FP8 weights save on a small model. Here one program reads one
token's group once, finds its maximum, and writes the FP8 numbers and the scale: one kernel per projection.

The arithmetic is the reference's (float32, a correctly rounded division, the same clamp), so the two agree
bit for bit; the tests check that on a GPU and through Triton's interpreter. (The interpreter's own cast to e4m3
rounds a value just below a power of two down to half of it, so there the kernel stores the float32 quotient and
PyTorch casts it.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl_ref.attention.triton_kernels.kv_indices import interpreted
from minisgl_ref.quant.fp8 import E4M3, E4M3_MAX, MIN_SCALE


@triton.jit
def _quantize_groups_kernel(
    X, Q, S, K, stride_xm, stride_qm, stride_sm,
    GROUP: tl.constexpr,  # features per scale (a whole row when it covers K)
    BLOCK: tl.constexpr,  # GROUP rounded up to a power of two
    FP8_MAX: tl.constexpr,
    MIN_S: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < GROUP) & (cols < K)
    x = tl.load(X + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FP8_MAX, MIN_S)
    q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
    tl.store(Q + row * stride_qm + cols, q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + row * stride_sm + g, scale)


def quantize_activation_fused(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~minisgl_ref.quant.fp8.quantize_activation` of a 2-D ``x [T, K]`` in one kernel: e4m3 numbers and
    float32 scales ``[T, 1]`` (``group`` None) or ``[T, ceil(K / group)]``."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"expected a 2-D activation with contiguous rows, got shape {tuple(x.shape)}")
    t, k = x.shape
    width = k if group is None else group
    groups = -(-k // width)
    q = torch.empty(t, k, dtype=torch.float32 if interpreted(_quantize_groups_kernel) else E4M3, device=x.device)
    s = torch.empty(t, groups, dtype=torch.float32, device=x.device)
    if t:
        _quantize_groups_kernel[(t, groups)](
            x, q, s, k, x.stride(0), q.stride(0), s.stride(0),
            GROUP=width, BLOCK=triton.next_power_of_2(width), FP8_MAX=E4M3_MAX, MIN_S=MIN_SCALE,
        )  # fmt: skip
    return q.to(E4M3), s
