"""The per-token ops of a decoder layer, called through one table that a faster implementation may fill
(chapter 01; chapter 11 fills it).

A layer does a handful of small element-wise ops besides its matmuls and its attention: RMSNorm (with and without
the residual add), SwiGLU's ``silu(gate) * up``, QK-norm and RoPE on the query and key heads, and the store of the
new keys and values into the KV pool. Each touches every value of a few kilobytes per token and does almost no
arithmetic, so on a GPU it costs what its memory traffic and its launch cost, and a kernel that does two or three
of them in one pass is much faster than the plain PyTorch ops one after the other (chapter 11 measures it).

So the layers (``norm.py``, ``activation.py``, ``rotary.py``) and the KV pool do not compute these ops themselves:
they call :data:`KERNELS`, a :class:`KernelTable` whose entries are, until someone installs others, the plain
PyTorch references defined in this module. They run everywhere (CPU, any dtype) and are what the chapter-00
oracle tests compare, exactly, in float32. :mod:`minisgl_ref.perf.kernels` (chapter 11) installs entries that run
a fused FlashInfer or Triton kernel where one applies (a CUDA tensor in half precision) and these same plain ops
everywhere else.

========================  ==========================================================  ===========================
entry                     computes                                                    called by
========================  ==========================================================  ===========================
``rms_norm``              ``x / rms(x) * weight`` over the last dim                   ``RMSNorm(x)``
``add_rms_norm``          ``(rms_norm(x + residual), x + residual)``                  ``RMSNorm(x, residual)``
``silu_and_mul``          ``silu(gate) * up`` for ``gate_up = [gate | up]``           ``SiluAndMul``
``qk_norm_rope``          QK-norm of every head (when the model has one), then RoPE   ``RotaryEmbedding.``
                                                                                      ``norm_and_rotate``
``store_kv``              ``k_pool[slots] = k; v_pool[slots] = v``                    ``KVPool.store``
========================  ==========================================================  ===========================

An installed entry may work in place (the fused kernels write into their inputs, which the layers never read
again); callers use what an entry returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Protocol

import torch
import torch.nn.functional as F


class Norm(Protocol):
    """What ``qk_norm_rope`` needs of a QK-norm layer (an :class:`~minisgl_ref.layers.norm.RMSNorm`)."""

    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class Rotary(Protocol):
    """What ``qk_norm_rope`` needs of the rotary layer (a :class:`~minisgl_ref.layers.rotary.RotaryEmbedding`):
    its float32 tables ``[max_position, head_dim // 2]`` for kernels that rotate themselves, and its plain forward."""

    head_dim: int
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]: ...


# --------------------------------------------------------------------------------------- the plain references


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim of ``x`` (any leading dims: rows, or heads)."""
    # Statistics in float32 even for bf16 activations: the mean of squares of 4096 bf16 numbers loses digits.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``: a decoder layer's "add, then normalise" in one call."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, where ``gate_up = [gate | up]`` along the last dim (one merged projection)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def qk_norm_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, rotary: Rotary,
                 q_norm: Norm | None = None, k_norm: Norm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalise every query and key head (Qwen3's QK-norm, when both norms are given), then rotate ``q``
    [T, heads, head_dim] and ``k`` [T, kv_heads, head_dim] by their tokens' ``positions`` with ``rotary``."""
    if q_norm is not None and k_norm is not None:
        q, k = q_norm(q), k_norm(k)
    return rotary(positions, q, k)


def store_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Write the new tokens' keys and values ``[T, kv_heads, head_dim]`` into their ``slots`` [T] of one layer's
    pools ``[num_slots, kv_heads, head_dim]``, in the pools' dtype."""
    k_pool[slots] = k.to(k_pool.dtype)
    v_pool[slots] = v.to(v_pool.dtype)


# ------------------------------------------------------------------------------------------------- the table


@dataclass
class KernelTable:
    """The entries the layers call; each starts as the plain reference above."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = rms_norm
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float],
                           tuple[torch.Tensor, torch.Tensor]] = add_rms_norm
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul
    qk_norm_rope: Callable[..., tuple[torch.Tensor, torch.Tensor]] = qk_norm_rope
    store_kv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None] = store_kv

    def reset(self) -> None:
        """Put every plain reference back."""
        for f in fields(self):
            setattr(self, f.name, f.default)

    def is_plain(self) -> bool:
        """Whether every entry is its plain reference (nothing installed)."""
        return all(getattr(self, f.name) is f.default for f in fields(self))


#: The table every layer of the process calls (one per process, like the CUDA device it serves).
KERNELS = KernelTable()
