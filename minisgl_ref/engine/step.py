"""A step on its way and what it did: what the engine loop and its extensions pass between them (chapters 03-06).

:class:`Launched` is a step that has been handed to the device; :class:`StepEvent` is what processing it did to
one request. They live in a module of their own so that the extension seam
(:mod:`~minisgl_ref.engine.extension`) can name them without importing the engine itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl_ref.core.batch import ScheduledBatch
from minisgl_ref.core.request import Req
from minisgl_ref.engine.model_runner import StepOutput


@dataclass
class Launched:
    """A step on its way: its number (in launch order), its plan, and what the device will produce."""

    step: int
    batch: ScheduledBatch
    output: StepOutput
    after_idle: bool = False  # nothing ran before it: the time since the previous step was idle, not waiting
    _tokens: list[int] | None = field(default=None, repr=False)

    def tokens(self) -> list[int]:
        """The step's sampled tokens on the host (:meth:`StepOutput.tokens`, waited for once and kept: an
        extension may need them before the step is processed, as structured output's masks do in chapter 12)."""
        if self._tokens is None:
            self._tokens = self.output.tokens()
        return self._tokens


@dataclass
class StepEvent:
    req: Req
    delta: str  # new text (empty when the tokenizer holds it back or the model has none)
    finished: bool
