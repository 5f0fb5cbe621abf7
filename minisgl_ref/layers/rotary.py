"""Rotary position embedding (chapter 01).

RoPE rotates each (x_i, x_{i+d/2}) pair of a query or key by an angle ``position * inv_freq_i``. Attention scores
then depend only on the *difference* of two positions, which is what lets a KV cache keep keys computed long ago.

We precompute ``cos`` and ``sin`` for every position once (a table of ``max_position x rotary_dim``), so a forward
step only gathers rows. The table is built with the same float32 arithmetic as Hugging Face's implementation, so
the two agree bit for bit before the final multiply.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from minisgl_ref.layers.kernel_table import KERNELS

if TYPE_CHECKING:
    from minisgl_ref.layers.norm import RMSNorm


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies ``theta ** (-2i / d)`` for i in ``0 .. d/2 - 1`` (float32, ``[head_dim // 2]``),
    optionally rescaled the way Llama 3.1 stretches its context window (``rope_type: llama3``).

    ``scaling`` holds ``factor``, ``original_max_position_embeddings`` and optionally ``low_freq_factor``
    (default 1) and ``high_freq_factor`` (default 4). Work with each frequency's wavelength ``2 pi / inv_freq``
    (in tokens) and the two wavelength limits ``original_max_position_embeddings / low_freq_factor`` (long) and
    ``original_max_position_embeddings / high_freq_factor`` (short):

    * wavelength shorter than the short limit (high frequencies, which encode local word order): unchanged;
    * wavelength longer than the long limit (low frequencies, which never turned a full circle within the
      original context): divided by ``factor``, so that the longer context turns them no further than the
      original one did;
    * in between, a smooth blend: with ``smooth = (original_max_position_embeddings / wavelength - low_freq_factor)
      / (high_freq_factor - low_freq_factor)`` (0 at the long limit, 1 at the short one), the new inverse
      frequency is ``(1 - smooth) * inv_freq / factor + smooth * inv_freq``, which joins the other two bands
      without a jump.

    Use float32 arithmetic in this order (it is Hugging Face's), so the result matches theirs bit for bit.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    # BEGIN TASK 1.2: llama3 RoPE frequency scaling
    factor = float(scaling["factor"])
    low_ff = float(scaling.get("low_freq_factor", 1.0))
    high_ff = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low_ff, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_ctx / high_ff) & (wavelen <= old_ctx / low_ff)
    return torch.where(is_medium, blended, scaled)
    # END TASK 1.2


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # Kept in float32 and not saved in the state dict: it is derived, not learned.
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` [T, heads, head_dim] and ``k`` [T, kv_heads, head_dim] by their tokens' positions [T].

        Token t sits at ``positions[t]`` (any order, any gaps: a batch holds many requests back to back).
        ``self.cos_cache`` and ``self.sin_cache`` are float32 ``[max_position, head_dim // 2]``: row p holds
        ``cos(p * inv_freq)`` and ``sin(p * inv_freq)``. Gather each token's row, make it broadcast over the
        heads, and rotate q and k with :func:`_rotate`; return ``(q, k)`` in their input dtype.
        """
        # BEGIN TASK 1.1: apply rotary embedding
        cos = self.cos_cache[positions].unsqueeze(1)  # [T, 1, head_dim/2]
        sin = self.sin_cache[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)
        # END TASK 1.1

    def norm_and_rotate(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
        q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """QK-norm (when the model has one, Qwen3) and then RoPE: the kernel table's ``qk_norm_rope``
        (:mod:`~minisgl_ref.layers.kernel_table`). Plain, that is ``q_norm(q)``, ``k_norm(k)`` and this layer's
        forward; on a GPU with chapter 11's kernels installed, one Triton kernel does all of it in place."""
        return KERNELS.qk_norm_rope(positions, q, k, self, q_norm, k_norm)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate every pair of ``x`` [..., D] by the angles whose ``cos`` and ``sin`` are given ([..., D/2],
    broadcastable against ``x`` without its last dimension halved).

    The "NeoX" layout, which is how Hugging Face checkpoints store the q/k projection weights: the pair of
    ``x[i]`` is ``x[i + D/2]`` (not ``x[i + 1]``). With ``x1 = x[..., :D/2]`` and ``x2 = x[..., D/2:]`` the result
    is ``[x1 cos - x2 sin, x2 cos + x1 sin]`` (a rotation by +angle). Compute in float32 and return x's dtype.
    """
    # BEGIN TASK 1.1: apply rotary embedding
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
    # END TASK 1.1
