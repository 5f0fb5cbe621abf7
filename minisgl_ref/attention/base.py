"""The attention backend interface (chapters 00, 03 and 07).

A model's attention layer computes q, k, v and hands them to ``batch.attn_backend``. The backend decides where k
and v are stored and how attention over everything the request has seen is computed. Its shape follows SGLang's
backends: metadata is prepared once per step (shared by all layers) and each layer then calls ``forward``, which
dispatches on the batch's mode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from minisgl_ref.engine.forward_batch import ForwardBatch
    from minisgl_ref.layers.attention import AttentionLayer


class AttentionBackend:
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Compute whatever every layer of this step needs (index tensors, kernel plans). Called once per step."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] for the T new tokens. Returns [T, heads * head_dim]."""
        if batch.mode.is_decode:
            return self.forward_decode(q, k, v, layer, batch)
        return self.forward_extend(q, k, v, layer, batch)

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        raise NotImplementedError

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        raise NotImplementedError
