"""The attention layer's device-independent part: head counts and scale; the math lives in a backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from minisgl_ref.core.forward_batch import ForwardBatch


@dataclass(frozen=True)
class RawDecodeInputs:
    """A decode layer's attention inputs before the QK-norm/RoPE kernel has run (norm folding, chapter 11): the
    QKV projection of the unnormalised residual rows ``x``, and what finishing it takes. A backend whose decode
    kernel can finish q, k and v itself takes these and saves that kernel."""

    qkv: torch.Tensor  # [B, (heads + 2 * kv_heads) * head_dim], the projection of x
    x: torch.Tensor  # [B, hidden]: q, k and v are divided by the rms of each row
    x_eps: float
    positions: torch.Tensor  # [B] int64
    cos: torch.Tensor  # [max_position, head_dim / 2] float32, NeoX pairs
    sin: torch.Tensor
    q_weight: torch.Tensor | None  # the QK-norm's weights (Qwen3), or None
    k_weight: torch.Tensor | None
    eps: float


class AttentionLayer(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, *,
                kv_stored: bool = False) -> torch.Tensor:
        """``kv_stored``: the new K/V are in the pool already (the RoPE kernel wrote them), so the backend
        only attends. Passed on only when true, so a backend written without it (a probe in a notebook) still
        fits every step that stores through the backend."""
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if kv_stored:
            return batch.attn_backend.forward(q, k, v, self, batch, kv_stored=True)
        return batch.attn_backend.forward(q, k, v, self, batch)

    def forward_raw_decode(self, raw: RawDecodeInputs, batch: ForwardBatch) -> torch.Tensor | None:
        """Attention of a decode step from :class:`RawDecodeInputs`, or ``None`` when the step's backend cannot
        finish them itself (the caller then runs the QK-norm/RoPE kernel and :meth:`forward`)."""
        attend_raw = getattr(batch.attn_backend, "attend_decode_raw", None)  # a probe backend may lack it
        if not batch.mode.is_decode or attend_raw is None:
            return None
        return attend_raw(raw, self, batch)
