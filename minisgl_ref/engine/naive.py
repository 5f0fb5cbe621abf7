"""The chapter-00 oracle: generation with no KV cache at all.

Every step feeds each unfinished request's *entire* sequence (prompt + everything generated so far) through the
model and keeps only the logits of the last position. That costs O(length^2) work per request, and it is the
point: there is no cache to get wrong, no page to alias, no step to overlap. Every faster engine in this book must
produce exactly the same greedy tokens as this loop (float32, CPU).
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl_ref.attention.torch_native import NoCacheAttentionBackend
from minisgl_ref.core.forward_batch import ForwardBatch
from minisgl_ref.core.request import Req, sampling_batch
from minisgl_ref.sampling.sampler import Sampler


class NaiveEngine:
    def __init__(self, model: nn.Module, vocab_size: int, device: torch.device | str = "cpu") -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.backend = NoCacheAttentionBackend()
        self.sampler = Sampler()

    @torch.inference_mode()
    def step(self, reqs: list[Req]) -> list[tuple[Req, str]]:
        """Append one token to every unfinished request; return (request, new text) for each of them."""
        running = [r for r in reqs if not r.finished]
        if not running:
            return []
        # BEGIN TASK 0.3: one step of the naive generation loop
        batch = ForwardBatch.for_full_sequences([r.all_ids for r in running], self.backend, self.device)
        self.backend.init_forward_metadata(batch)
        hidden = self.model(batch.input_ids, batch.positions, batch)
        logits = self.model.compute_logits(hidden[batch.last_token_indices])  # [B, vocab]
        info = sampling_batch(running, self.vocab_size, self.device)
        next_ids = self.sampler(logits, info).tolist()
        # END TASK 0.3
        return [(r, r.append_token(t)) for r, t in zip(running, next_ids)]

    def run(self, reqs: list[Req]) -> None:
        """Step until every request has finished."""
        while self.step(reqs):
            pass
