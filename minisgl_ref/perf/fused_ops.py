"""FlashInfer's fused kernels for the small per-token ops: RMSNorm (+ residual add), SiLU-and-mul, RoPE (chapters
08 and 11).

On a small model these element-wise ops are a large share of a decode step. Written in plain PyTorch, each is
several kernels that each read and write the whole activation: ``x + residual``, ``.float()``, ``pow``, ``mean``,
``rsqrt``, two multiplies and a cast for one RMSNorm. A fused kernel reads its inputs once and writes its output
once, and launches once. We use FlashInfer's kernels (the ones SGLang uses) when they can run:

=====================  ================================  ========================================
op                     plain PyTorch reference           fused (FlashInfer)
=====================  ================================  ========================================
RMSNorm                ``kernel_table.rms_norm``         ``flashinfer.norm.rmsnorm``
add + RMSNorm          ``kernel_table.add_rms_norm``     ``flashinfer.norm.fused_add_rmsnorm``
SiLU-and-mul           ``kernel_table.silu_and_mul``     ``flashinfer.activation.silu_and_mul``
RoPE (neox layout)     ``RotaryEmbedding.forward``       ``flashinfer.rope.apply_rope_with_``
                                                         ``cos_sin_cache_inplace``
=====================  ================================  ========================================

:mod:`minisgl_ref.perf.kernels` puts them into the layers' kernel table. The plain versions
(``layers/kernel_table.py``, ``layers/rotary.py``) stay the readable reference and run everywhere else: on the CPU
(so the oracle tests keep comparing exact float32 arithmetic), in float32, and when FlashInfer is not installed.
``MINISGL_FUSED=0`` turns the fused path off (for before/after measurements). The fused kernels compute in float32
internally too, but round at slightly different points (e.g. the residual sum is normalised before it is rounded to
bf16), so on the GPU they agree with the plain ops to bf16 rounding, not bit for bit (``tests/test_fused_ops.py``).
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from minisgl_ref import env


@functools.cache
def _flashinfer() -> ModuleType | None:
    if not env.fused_kernels_enabled():
        return None
    try:
        import flashinfer.activation
        import flashinfer.norm
        import flashinfer.rope
    except Exception:  # not installed, or no CUDA toolchain for its JIT: the plain ops are always correct
        return None
    return flashinfer


def fused_available(x: torch.Tensor) -> bool:
    """Whether the fused kernels apply to ``x``: a CUDA half/bf16 tensor and FlashInfer importable."""
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and _flashinfer() is not None


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dim, for a 2-D ``[T, hidden]`` or 3-D ``[T, heads, head_dim]``
    ``x`` (FlashInfer; callers check :func:`fused_available`)."""
    fi = _flashinfer()
    assert fi is not None
    if x.stride(-1) != 1:
        x = x.contiguous()
    # Row and head strides are passed to the kernel, so the q / k views of the fused qkv output need no copy.
    return fi.norm.rmsnorm(x, weight, eps)


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual), x + residual)`` in one kernel. Works in place: ``residual`` becomes the sum and
    ``x`` the normalised output, which is fine because the decoder layer never reads either again."""
    fi = _flashinfer()
    assert fi is not None
    x = x.contiguous()
    fi.norm.fused_add_rmsnorm(x, residual, weight, eps)
    return x, residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate_up = [gate | up]`` along the last dim, in one kernel."""
    fi = _flashinfer()
    assert fi is not None
    return fi.activation.silu_and_mul(gate_up.contiguous())


def rope_inplace(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` [T, H, D] and ``k`` [T, KVH, D] (neox layout) by ``positions`` in one kernel.

    ``cos_sin_cache`` is ``[max_position, D]`` float32: the cos table, then the sin table, along the last dim."""
    fi = _flashinfer()
    assert fi is not None
    # The kernel takes token and head strides, so q and k may be views into the fused qkv output: rotated in
    # place, no copies. Only the last dim must be contiguous.
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    fi.rope.apply_rope_with_cos_sin_cache_inplace(positions, q, k, q.shape[-1], cos_sin_cache, is_neox=True)
    return q, k
