"""The sampling tensors of each step, reused from one decode step to the next (chapters 06 and 08).

Every step samples with a :class:`~minisgl_ref.sampling.sampler.SamplingBatchInfo`: about ten tensors packed from
the requests' sampling parameters (temperatures, top-k/p, seeds, penalties, ...). Packing them from Python lists
costs host time on every step, and per-step host work is what a small model's decode step cannot afford (chapter
08, "per-token costs": ~2 ms of GPU time for Qwen3-0.6B at batch 1). Between two decode steps of the same
requests nothing changes but the step counter, so :class:`SamplingState` keeps the last decode step's tensors and
moves that counter instead of rebuilding.
"""

from __future__ import annotations

import torch

from minisgl_ref.core.batch import ScheduledBatch
from minisgl_ref.core.request import Req, sampling_batch
from minisgl_ref.sampling.sampler import SamplingBatchInfo, to_device


class SamplingState:
    """The sampling tensors of the model runner's steps. ``token_buffer`` is the runner's device buffer of each
    page-table row's last sampled token (the penalties of a request with a token in flight count it)."""

    def __init__(self, vocab_size: int, device: torch.device, token_buffer: torch.Tensor) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.token_buffer = token_buffer
        self._last: tuple[list[Req], SamplingBatchInfo] | None = None  # (reqs, info) of the last decode step

    def info(self, batch: ScheduledBatch) -> SamplingBatchInfo:
        """The batch's sampling state; reused from the previous decode step when that is exact."""
        reqs = batch.reqs
        cached = self._reuse(batch)
        if cached is not None:
            return cached
        info = sampling_batch(reqs, self.vocab_size, self.device)
        # With overlap, a request may have one token sampled on the device that its Python lists do not show
        # yet. Its sampling step and penalty counts must include it, or seeded streams and penalties would
        # differ from the non-overlapped engine.
        pending = [i for i, row in enumerate(batch.rows) if row.req.num_inflight > row.emits]
        if pending:
            rows = to_device(torch.tensor(pending), self.device)
            info.steps[rows] += 1
            if info.output_counts is not None:
                pool_rows = to_device(torch.tensor([reqs[i].req_pool_idx for i in pending]), self.device)
                info.output_counts[rows, self.token_buffer[pool_rows]] += 1
        if batch.is_decode and not info.need_penalties:
            self._last = (list(reqs), info)
        else:
            self._last = None
        return info

    def _reuse(self, batch: ScheduledBatch) -> SamplingBatchInfo | None:
        """Decode after decode with the same requests (or a subset, in order) and no penalties: the previous
        step's tensors are right except that every request is one token further, so ``steps += 1`` (and a
        row filter when some requests left) replaces rebuilding ~10 tensors from Python lists.

        Penalty batches are always rebuilt: their [B, V] counts would also need the last tokens."""
        last = self._last
        if last is None or not batch.is_decode:
            return None
        prev_reqs, info = last
        reqs = batch.reqs
        if len(reqs) == len(prev_reqs) and all(a is b for a, b in zip(reqs, prev_reqs)):
            keep = None
        else:
            pos = {id(r): i for i, r in enumerate(prev_reqs)}
            keep = [pos.get(id(r), -1) for r in reqs]
            if -1 in keep or keep != sorted(keep):
                return None
        if keep is not None:
            info.filter(keep)
            self._last = (list(reqs), info)
        info.steps += 1
        return info
