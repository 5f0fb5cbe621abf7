"""A request's life, from token ids in to a finished answer out (chapter 00).

Every engine in the book, from the naive oracle to the overlapped, CUDA-graphed one, moves the same ``Req``
through the same states: waiting, running (appending one token per step), finished. What differs between engines
is only *how* the next token is computed. Keeping the stop rules here, in one place, is what makes their outputs
comparable token for token.
"""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass, field
from typing import Any

from minisgl_ref.sampling.params import SamplingParams
from minisgl_ref.tokenizer.detokenizer import IncrementalDetokenizer

_next_id = itertools.count()


@dataclass(frozen=True)
class FinishReason:
    """Why a request stopped. ``kind`` uses OpenAI's words: ``stop`` (EOS, a stop token or a stop string),
    ``length`` (max_new_tokens or the context window) or ``abort``."""

    kind: str
    matched: int | str | None = None  # the stop token id or stop string that ended it
    message: str | None = None  # for aborts: what went wrong

    def to_dict(self) -> dict[str, object]:
        d: dict[str, object] = {"type": self.kind}
        if self.matched is not None:
            d["matched"] = self.matched
        if self.message is not None:
            d["message"] = self.message
        return d


@dataclass(eq=False)
class Req:
    input_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    detokenizer: IncrementalDetokenizer | None = None
    context_len: int | None = None  # the model's window: prompt + output may not exceed it
    rid: str = field(default_factory=lambda: f"req-{next(_next_id)}")
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    cached_tokens: int = 0  # prompt tokens whose KV was found in a cache (chapter 04)
    # Requests without a seed still get one, drawn now, so that the request samples reproducibly *within* its own
    # lifetime even if the engine rebuilds its sampling state (for example after being retracted, chapter 03).
    sampling_seed: int = field(default_factory=lambda: secrets.randbits(62))
    # KV bookkeeping, owned by the cache manager and scheduler (chapters 03-06); unused by the naive oracle.
    req_pool_idx: int | None = None  # row in the page table
    kv_committed_len: int = 0  # tokens whose K/V has been computed
    kv_allocated_len: int = 0  # tokens that have a slot (one more than committed while a decode is in flight)
    tree_len: int = 0  # leading tokens whose slots belong to the radix tree
    last_node: Any = None  # deepest radix node this request pins
    num_inflight: int = 0  # tokens sampled on the device but not yet appended (overlap scheduling)
    retractions: int = 0

    def __post_init__(self) -> None:
        if not self.input_ids:
            raise ValueError("input_ids must not be empty")
        if self.params.seed is not None:
            self.sampling_seed = self.params.seed
        if self.context_len is not None and len(self.input_ids) >= self.context_len:
            raise ValueError(
                f"input_ids has {len(self.input_ids)} tokens, which leaves no room in the context window "
                f"of {self.context_len} tokens"
            )
        if self.params.max_new_tokens == 0:
            self.finish_reason = FinishReason("length")  # nothing to generate: done on arrival

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def output_text(self) -> str:
        return self.detokenizer.output_text if self.detokenizer else ""

    def append_token(self, token_id: int) -> str:
        """Record one sampled token, decide whether the request is done, and return the new text it produced."""
        assert not self.finished, f"{self.rid} already finished; an engine appended a token after the end"
        self.output_ids.append(token_id)
        # BEGIN TASK 0.2: stop conditions
        params = self.params
        n_out = len(self.output_ids)
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
            if n_out >= params.min_new_tokens:
                self.finish_reason = FinishReason("stop", matched=token_id)
                return self._flush()  # the stop token itself is not part of the text
        delta = self.detokenizer.step([token_id]) if self.detokenizer else ""
        if self.detokenizer and self.detokenizer.matched_stop is not None:
            self.finish_reason = FinishReason("stop", matched=self.detokenizer.matched_stop)
            return delta
        if n_out >= params.max_new_tokens or (
            self.context_len is not None and len(self.input_ids) + n_out >= self.context_len
        ):
            self.finish_reason = FinishReason("length")
            return delta + self._flush()
        # END TASK 0.2
        return delta

    def abort(self, message: str) -> None:
        if not self.finished:
            self.finish_reason = FinishReason("abort", message=message)

    def _flush(self) -> str:
        return self.detokenizer.finish() if self.detokenizer else ""
