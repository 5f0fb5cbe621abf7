"""One scheduled step: which requests, how many new tokens each, and what comes back (chapters 03-06)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from minisgl_ref.core.forward_batch import ForwardBatch
from minisgl_ref.core.request import Req
from minisgl_ref.sampling.sampler import SamplingBatchInfo, StepLogprobs


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
    # On a GPU, the runner also starts copying the tokens into pinned host memory right after sampling, and
    # records an event when that copy is done (see ``tokens``).
    next_tokens_host: torch.Tensor | None = None
    copy_done: torch.cuda.Event | None = None
    # Log probabilities, only in steps where some request asked for them (chapter 10): of each row's sampled
    # token, and of the prompt positions the model runner's plan lists (``(plan, logprobs)``).
    logprobs: StepLogprobs | None = None
    prompt_logprobs: tuple[Any, StepLogprobs] | None = None
    stats: dict[str, int] = field(default_factory=dict)
    # Slots that only this step writes and nobody needs afterwards (duplicate copies of a prefix that another
    # request of the same step also computed): freed once the step has been processed.
    free_when_done: list[torch.Tensor] = field(default_factory=list)

    def tokens(self) -> list[int]:
        """The sampled tokens on the host: the one wait for the device per step.

        On a GPU this waits for *this* step's copy event only. ``next_tokens.tolist()`` would queue its copy on
        the stream behind everything launched since, which under overlap is the whole next step: the CPU would
        then wait for step N+1 to finish before it could process step N, and the GPU would idle while the CPU
        processed, scheduled and launched (a quarter of every decode step on an H100, chapter 11)."""
        if self.copy_done is not None and self.next_tokens_host is not None:
            self.copy_done.synchronize()
            return self.next_tokens_host.tolist()
        assert self.next_tokens is not None, "the step has not been launched"
        return self.next_tokens.tolist()

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def is_decode(self) -> bool:
        return all(self.is_decode_row)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for n, d in zip(self.extend_lens, self.is_decode_row) if not d)
