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
        """Append one token to every unfinished request; return ``(request, new text)`` for each of them, in order.

        Finished requests are skipped (``running`` below). For the running ones, in one batched forward pass:

        1. Feed each request's *whole* sequence so far, prompt and generated tokens (``req.all_ids``): build the
           flat batch with ``ForwardBatch.for_full_sequences(sequences, self.backend, self.device)`` and call
           ``self.backend.init_forward_metadata(batch)``.
        2. ``self.model(batch.input_ids, batch.positions, batch)`` gives hidden states ``[T, hidden]`` for all T
           tokens of the batch, requests back to back. Only each request's *last* position predicts its next
           token: pick those rows (``batch.last_token_indices``, ``[B]``) and turn them into logits ``[B, vocab]``
           with ``self.model.compute_logits``.
        3. Sample one token per request: ``self.sampler(logits, sampling_batch(running, self.vocab_size,
           self.device))`` returns a ``[B]`` tensor of token ids.
        4. Hand each token to its request with ``req.append_token(token_id)`` (it records the token, applies the
           stop rules and returns the text the token made final) and return the pairs.
        """
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
        return [(r, r.append_token(t)) for r, t in zip(running, next_ids)]
        # END TASK 0.3

    def run(self, reqs: list[Req]) -> None:
        """Step until every request has finished."""
        while self.step(reqs):
            pass
