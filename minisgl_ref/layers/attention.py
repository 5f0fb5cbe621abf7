"""The attention layer's device-independent part: head counts and scale; the math lives in a backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from minisgl_ref.core.forward_batch import ForwardBatch


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
