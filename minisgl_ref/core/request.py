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
from typing import Any, NamedTuple

import torch

from minisgl_ref.sampling.params import SamplingParams
from minisgl_ref.sampling.sampler import SamplingBatchInfo
from minisgl_ref.tokenizer.detokenizer import IncrementalDetokenizer

_next_id = itertools.count()


def are_token_ids(ids: list[Any]) -> bool:
    """Whether every element is an ``int`` and none a ``bool`` (Python counts a bool as an int; a token id it is
    not). One pass over the types in C: a burst of 256 prompts is ~140k ids, and a Python-level test per id took
    three times as long (15 against 5 ms with the range check, on an H100 machine's host), before the first step
    could start. Only an unusual subclass of ``int`` takes the slow path."""
    if set(map(type, ids)) <= {int}:
        return True
    return all(isinstance(t, int) and not isinstance(t, bool) for t in ids)


def first_outside(ids: list[int], vocab_size: int) -> int | None:
    """The first id not in ``[0, vocab_size)``, or None. ``min`` and ``max`` run in C; the search by id in Python
    only when one of them is out of range."""
    if not ids or (0 <= min(ids) and max(ids) < vocab_size):
        return None
    return next(t for t in ids if not 0 <= t < vocab_size)


#: The most alternatives a request may ask for per token (OpenAI's limit for chat's ``top_logprobs``).
MAX_TOP_LOGPROBS = 20


class TokenLogprob(NamedTuple):
    """One token's log probability and the ``top`` most likely alternatives at its position, as
    ``(token id, logprob)`` pairs, best first. ``logprob`` is None for the first prompt token (nothing
    precedes it, so nothing predicted it)."""

    logprob: float | None
    top: list[tuple[int, float]]


@dataclass(eq=False)
class LogprobRequest:
    """What a request asked to learn about its tokens' log probabilities (chapter 10), and the answers so far.

    A request that asks for none has no such object (``Req.logprobs is None``), so the common case costs nothing:
    not a field to fill, nor an extra kernel in the sampler. The question is two numbers, ``top`` and ``start``;
    the answers, ``prompt`` and ``output``, grow as the engine computes them, one entry per token.
    """

    #: Alternatives to report per token, the likeliest first (0..MAX_TOP_LOGPROBS): the sampler's ``topk`` is
    #: as wide as the widest request of its step.
    top: int = 0
    #: The first prompt position to report, or -1 for none of the prompt (only the output). A wanted position
    #: must be computed, so it also limits how much of the prompt the prefix cache may supply.
    start: int = -1
    #: One entry per prompt position from ``start`` on, in order; the first prompt token's value is None.
    prompt: list[TokenLogprob] = field(default_factory=list)
    #: One entry per output token, in order.
    output: list[TokenLogprob] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Each message names the field and, in parentheses, the API parameter that fills it (SGLang's names).
        if not 0 <= self.top <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs.top (top_logprobs_num) must be in [0, {MAX_TOP_LOGPROBS}], got {self.top}")
        if self.start < -1:
            raise ValueError(f"logprobs.start (logprob_start_len) must be -1 or a prompt position, got {self.start}")
        if self.start == 0 and not self.prompt:
            self.prompt.append(TokenLogprob(None, []))  # nothing precedes the first prompt token to predict it

    @classmethod
    def asked(cls, return_logprob: bool, top_logprobs_num: int = 0,
              logprob_start_len: int = -1) -> LogprobRequest | None:
        """The object for the three flat fields that APIs and messages carry (SGLang's names), None if
        ``return_logprob`` is off: without it the other two mean nothing."""
        return cls(top_logprobs_num, logprob_start_len) if return_logprob else None

    def fresh(self) -> LogprobRequest:
        """The same question with no answers yet: what a rank that rebuilds the request starts from (chapter 09)."""
        return LogprobRequest(self.top, self.start)

    def prompt_pending(self, prompt_len: int) -> bool:
        """Whether prompt positions are asked for that have not all been computed yet."""
        return self.start >= 0 and len(self.prompt) < prompt_len - self.start


@dataclass(frozen=True)
class FinishReason:
    """Why a request stopped. ``kind`` uses OpenAI's words: ``stop`` (EOS, a stop token or a stop string),
    ``length`` (max_new_tokens or the context window) or ``abort``."""

    kind: str  #: ``stop``, ``length`` or ``abort``
    matched: int | str | None = None  #: the stop token id or stop string that ended it
    message: str | None = None  #: for aborts: what went wrong

    def to_dict(self) -> dict[str, object]:
        d: dict[str, object] = {"type": self.kind}
        if self.matched is not None:
            d["matched"] = self.matched
        if self.message is not None:
            d["message"] = self.message
        return d


@dataclass(eq=False)
class Req:
    #: The prompt's token ids (never empty).
    input_ids: list[int]
    #: How to choose tokens and when to stop (checked once, when the params were built).
    params: SamplingParams
    #: The model's end-of-sequence ids: a stop token unless ``params.ignore_eos``.
    eos_token_ids: frozenset[int] = frozenset()
    #: Turns output ids into text and finds stop strings; None when ids go in and ids come out.
    detokenizer: IncrementalDetokenizer | None = None
    context_len: int | None = None  #: the model's window: prompt + output may not exceed it
    #: The request's name in logs, aborts and server messages.
    rid: str = field(default_factory=lambda: f"req-{next(_next_id)}")
    #: Every token appended so far, the stop token included (:meth:`append_token`).
    output_ids: list[int] = field(default_factory=list)
    #: None while the request runs; set once, by the rule that ended it.
    finish_reason: FinishReason | None = None
    cached_tokens: int = 0  #: prompt tokens whose KV was found in a cache (chapter 04)
    #: Only requests with the same salt share cached prefixes (chapter 04): a tenant's salt keeps others from
    #: learning, through time to first token, which prompts it has sent.
    cache_salt: str | None = None
    #: Requests without a seed still get one, drawn now, so that the request samples reproducibly *within* its own
    #: lifetime even if the engine rebuilds its sampling state (for example after being retracted, chapter 03).
    sampling_seed: int = field(default_factory=lambda: secrets.randbits(62))
    # KV bookkeeping, owned by the cache manager and scheduler (chapters 03-06); unused by the naive oracle.
    req_pool_idx: int | None = None  #: row in the page table
    #: Tokens whose K/V has been computed or is being computed by a scheduled step: the scheduler moves it when it
    #: schedules a row, before the step runs, so that the next step (under overlap) can be planned at once.
    kv_scheduled_len: int = 0
    kv_allocated_len: int = 0  #: tokens that have a slot
    tree_len: int = 0  #: leading tokens whose slots belong to the radix tree
    last_node: Any = None  #: deepest radix node this request pins
    num_inflight: int = 0  #: tokens sampled on the device but not yet appended (overlap scheduling)
    #: Changes whenever the request starts over from a different point than its rows in flight assumed: a
    #: retraction (chapter 03), or output grown by several tokens at once (jump-forward, chapter 12). A row
    #: scheduled under another epoch is obsolete (``Row.is_live``).
    epoch: int = 0
    #: Log probabilities (chapter 10): what the request asked for and the entries computed so far; None if none.
    logprobs: LogprobRequest | None = None

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
        if self.logprobs is not None and self.logprobs.start >= len(self.input_ids):
            raise ValueError(f"logprobs.start (logprob_start_len) must be -1 or a prompt position below "
                             f"{len(self.input_ids)}, got {self.logprobs.start}")
        if self.params.max_new_tokens == 0 and not self.wants_prompt_logprobs:
            self.finish_reason = FinishReason("length")  # nothing to generate, nothing to score: done on arrival

    @property
    def prefill_only(self) -> bool:
        """``max_new_tokens=0`` with prompt log probabilities asked for: a *scoring* request (SGLang's ``select``,
        likelihood-based evaluation). Its answer is the prompt's log probabilities, which only a prefill computes,
        so it is scheduled like any request and ends right after its prefill, with no output token: the engine
        drops the token that step sampled (:meth:`end_after_prefill`)."""
        return self.params.max_new_tokens == 0 and self.logprobs is not None and self.logprobs.start >= 0

    def end_after_prefill(self) -> None:
        """A prefill-only request's prefill has run (its prompt log probabilities are recorded): it ends here, by
        length, with nothing appended."""
        assert self.prefill_only and not self.finished, f"{self.rid} is not a prefill-only request in flight"
        self.finish_reason = FinishReason("length")

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    def token_id_problem(self, vocab_size: int) -> str | None:
        """Which token id of this request lies outside the vocabulary, naming the field (None if all are fine).

        Every id a request carries becomes an index into a [vocab] row somewhere (the embedding, a stop-token
        mask, a logit bias); one bad id there fails the step of the whole batch, so engines refuse it first."""
        for name, ids in (("input_ids", self.input_ids), ("stop_token_ids", self.params.stop_token_ids),
                          ("logit_bias", list(self.params.logit_bias or {}))):
            bad = first_outside(ids or [], vocab_size)
            if bad is not None:
                return f"{name}: token id {bad} is not in this model's vocabulary [0, {vocab_size})"
        return None

    @property
    def return_logprob(self) -> bool:
        """Whether log probabilities were asked for at all (SGLang's name for the switch)."""
        return self.logprobs is not None

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt log probabilities asked for and not all computed yet."""
        return self.logprobs is not None and self.logprobs.prompt_pending(len(self.input_ids))

    @property
    def reusable_prefix_len(self) -> int:
        """How many leading tokens may come from the prefix cache. The last one never does (its logits are
        needed), and a prompt position whose log probability is wanted must be computed, together with the
        position before it, whose logits predict it."""
        limit = len(self.all_ids) - 1
        if self.wants_prompt_logprobs:
            assert self.logprobs is not None
            limit = min(limit, max(self.logprobs.start - 1, 0))
        return limit

    @property
    def output_text(self) -> str:
        return self.detokenizer.output_text if self.detokenizer else ""

    def append_token(self, token_id: int) -> str:
        """Record one sampled token, decide whether the request is done, and return the new text it produced.

        The token is already in ``output_ids`` when this runs; ``n = len(output_ids)`` counts it. The rules, in
        this order (the first that applies wins):

        1. **Stop token.** ``token_id`` is one of ``params.stop_token_ids``, or one of ``eos_token_ids`` unless
           ``params.ignore_eos`` is set, and ``n >= params.min_new_tokens``: finish with
           ``FinishReason("stop", matched=token_id)``. The stop token stays in ``output_ids`` but its text is not
           part of the output: do not feed it to the detokenizer; return whatever the detokenizer still holds
           back (``self._flush()``). Before ``min_new_tokens`` a stop token is an ordinary token.
        2. **Stop string.** Otherwise feed the token to the detokenizer (``self.detokenizer.step([token_id])``,
           which returns the text that became final). Stop strings can span several tokens, so only the
           detokenizer can see them: when its ``matched_stop`` is set, finish with
           ``FinishReason("stop", matched=<that string>)`` and return the text it gave.
        3. **Length.** Otherwise, once ``n`` reaches ``params.max_new_tokens``, or the prompt plus the output fill
           the context window (``len(input_ids) + n >= context_len``, when ``context_len`` is set), finish with
           ``FinishReason("length")`` and return the step's text followed by ``self._flush()`` (the text the
           detokenizer held back, in case more tokens completed a stop string, is final now).

        Without a detokenizer (``self.detokenizer is None``: token ids in, token ids out) every text is ``""``
        and rule 2 never fires.
        """
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

    def finish_by_stop_token(self, token_id: int) -> str:
        """End the request at ``token_id``, which its own stop rules did not end on but something else says
        must be the last (a grammar that accepted it as its end, say with ``ignore_eos``, chapter 12), and return
        the text the detokenizer still held back."""
        if self.finished:
            return ""
        self.finish_reason = FinishReason("stop", matched=token_id)
        return self._flush()

    def replace_tail(self, rollback: int, tokens: list[int], text_ids: list[int]) -> str:
        """Replace the last ``rollback`` output tokens by ``tokens`` (jump-forward decoding, chapter 12) and return
        the new text. The detokenizer cannot take back text it has already given out, so it is fed ``text_ids``,
        the forced text tokenized on its own: the caller has checked that ``tokens`` decode to the replaced
        tokens' text followed by that same text. A stop string inside the forced text ends the request."""
        if rollback:
            del self.output_ids[-rollback:]
        self.output_ids.extend(tokens)
        if self.detokenizer is None:
            return ""
        delta = self.detokenizer.step(text_ids)
        if self.detokenizer.matched_stop is not None:
            self.finish_reason = FinishReason("stop", matched=self.detokenizer.matched_stop)
        return delta

    def abort(self, message: str) -> None:
        if not self.finished:
            self.finish_reason = FinishReason("abort", message=message)

    def _flush(self) -> str:
        return self.detokenizer.finish() if self.detokenizer else ""


def sampling_batch(reqs: list[Req], vocab_size: int, device: torch.device | str) -> SamplingBatchInfo:
    """The sampling state of a batch of requests, one row each, in order (chapter 02): what every engine builds
    from its requests before it samples."""
    return SamplingBatchInfo.build(
        params_list=[r.params for r in reqs],
        prompt_ids_list=[r.input_ids for r in reqs],
        output_ids_list=[r.output_ids for r in reqs],
        eos_token_ids_list=[r.eos_token_ids for r in reqs],
        vocab_size=vocab_size,
        device=device,
        seeds=[r.sampling_seed for r in reqs],
    )
