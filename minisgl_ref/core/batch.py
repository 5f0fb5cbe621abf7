"""One scheduled step: which requests run, and how many new tokens each (chapters 03-06).

The scheduler's plan is a list of typed rows, one per request. It is only a plan: what running it produced (the
sampled tokens, log probabilities) comes back from the model runner as a separate result, so a batch never
changes after it has been scheduled.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from minisgl_ref.core.request import Req


@dataclass(slots=True)
class Row:
    """One request's part of a step."""

    req: Req
    prefix_len: int  # tokens of the request already in the KV cache (or being computed) before this step
    extend_len: int  # new tokens in this step (1 for a decode row)
    is_decode: bool  # a decode row's input token is the one the previous step sampled on the device
    emits: bool  # does the row produce the request's next token? (not a partial prefill chunk)
    epoch: int  # the request's epoch when scheduled: a retracted (or jumped-forward) request ignores this row

    @property
    def is_live(self) -> bool:
        """Does the row's result still matter? Not if its request finished (the extra token overlap computes
        after the end), or was retracted or jumped forward (chapter 12) since it was scheduled."""
        return not self.req.finished and self.req.epoch == self.epoch


@dataclass(eq=False)
class ScheduledBatch:
    rows: list[Row]

    @cached_property
    def reqs(self) -> list[Req]:
        return [row.req for row in self.rows]

    @cached_property
    def is_decode(self) -> bool:
        """Every row decodes one token (the fast paths of chapters 03 and 08 apply)."""
        return all(row.is_decode for row in self.rows)

    @property
    def num_tokens(self) -> int:
        return sum(row.extend_len for row in self.rows)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(row.extend_len for row in self.rows if not row.is_decode)
