"""One scheduled step: which requests, how many new tokens each, and what comes back (chapters 03-06)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minisgl_ref.engine.forward_batch import ForwardBatch
from minisgl_ref.sampling.sampler import SamplingBatchInfo
from minisgl_ref.scheduler.request import Req


@dataclass(eq=False)
class ScheduledBatch:
    reqs: list[Req]
    prefix_lens: list[int]  # tokens of each request already in the KV cache before this step
    extend_lens: list[int]  # new tokens of each request in this step (1 for a decode row)
    is_decode_row: list[bool]  # decode rows take their input token from the device token buffer
    emits: list[bool]  # does this row produce the request's next token? (not for a partial prefill chunk)
    epochs: list[int]  # each request's retraction count when scheduled: a retracted request ignores the result
    forward_batch: ForwardBatch | None = None
    sampling_info: SamplingBatchInfo | None = None
    next_tokens: torch.Tensor | None = None  # [B] on the device, filled by the model runner
    stats: dict[str, int] = field(default_factory=dict)
    # Slots that only this step writes and nobody needs afterwards (duplicate copies of a prefix that another
    # request of the same step also computed): freed once the step has been processed.
    free_when_done: list[torch.Tensor] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def is_decode(self) -> bool:
        return all(self.is_decode_row)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for n, d in zip(self.extend_lens, self.is_decode_row) if not d)
