"""One scheduled step: which requests run, and how many new tokens each (chapters 03-06).

The scheduler's plan is a list of typed rows, one per request. It is only a plan: what running it produced (the
sampled tokens, log probabilities) comes back from the model runner as a separate result, so a batch never
changes after it has been scheduled.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from minisgl_ref.core.request import Req


@dataclass(frozen=True, eq=False)  # compared by identity: a mask tensor has no single truth value
class Guess:
    """Tokens a row feeds after its request's known ones, which are not (yet) part of the request: a guess the
    step checks (speculative decoding, chapter 13, fills it; the core only carries it).

    The row's input is its known tokens followed by ``tokens``; ``depths[i]`` is how far after the last known
    token guessed token ``i`` sits (1, 2, 3, ... for a chain; a tree repeats depths), so its position is the last
    known token's plus ``depths[i]``, while its KV slot is the row's next one in order. ``mask`` says which of the
    last known token and the guessed tokens each of them may attend to (``[n + 1, n + 1]`` bool, lower triangular
    with a true diagonal; ``ForwardBatch.extend_masks`` carries it): None for a chain, which attends causally. A
    tree needs one, since siblings must not see each other. Such a row is never a decode row; the model runner
    computes the logits at every one of its positions (``StepOutput.row_logits``), and the tokens it appends are
    decided by whoever made the guess (``EngineExtension.row_tokens``), since the token sampled at its last
    position follows a guess that may be wrong."""

    tokens: tuple[int, ...]
    depths: tuple[int, ...]
    mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.depths) or not self.tokens:
            raise ValueError(f"a guess needs one depth per token and at least one token: {len(self.tokens)} "
                             f"tokens, {len(self.depths)} depths")
        n = len(self.tokens) + 1
        if self.mask is None and not self.is_chain:
            raise ValueError("a guess that is not a chain needs a mask: its siblings must not see each other")
        if self.mask is not None and tuple(self.mask.shape) != (n, n):
            raise ValueError(f"a guess of {n - 1} tokens needs a [{n}, {n}] mask, got {tuple(self.mask.shape)}")

    @property
    def is_chain(self) -> bool:
        """One token per depth, in order: the row is then an ordinary causal extend row."""
        return self.depths == tuple(range(1, len(self.tokens) + 1))


@dataclass(slots=True)
class Row:
    """One request's part of a step."""

    req: Req
    prefix_len: int  # tokens of the request already in the KV cache (or being computed) before this step
    extend_len: int  # new tokens in this step (1 for a decode row)
    is_decode: bool  # a decode row's input token is the one the previous step sampled on the device
    emits: bool  # does the row produce the request's next token? (not a partial prefill chunk)
    epoch: int  # the request's epoch when scheduled: a retracted (or jumped-forward) request ignores this row
    guess: Guess | None = None  # tokens fed after the known ones, to be checked (chapter 13); None for most rows

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
        """Tokens of extend rows; a row that feeds a guess (chapter 13) decodes, and counts with the decode ones."""
        return sum(row.extend_len for row in self.rows if not row.is_decode and row.guess is None)
