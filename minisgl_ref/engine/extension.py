"""The engine's seam: the few moments of its loop where a later chapter may act (chapters 06, 11, 12).

The core engine (chapters 03-10) schedules, runs and processes steps of plain requests, and nothing more. A
feature added later -- structured output in chapter 12, the per-step trace of chapter 11 -- needs to act at a
few moments of that loop: when a request arrives, before a step is scheduled, between a step's forward pass and
its sampling, around each token appended to a request, and after a step has been processed. Each of these
moments is one method of :class:`EngineExtension`, whose default does nothing; an extension overrides only the
moments it needs. :func:`~minisgl_ref.runtime.build_runtime` decides which extensions an engine gets, and the
engine never imports them: it knows the seam, not what plugs into it.

One engine's step in order, with its hooks::

    add_request:  check (may refuse the request) -> admit
    step:         before_step -> schedule (ready: may a waiting request be admitted now?)
                  -> forward pass -> logits_processor (mask the logits) -> sample -> ...
    processing:   for each emitting row: [row_tokens, for a row that fed a guess: the tokens it appends]
                  -> for each token: before_token (may refuse the token) -> append -> after_token
                  -> after_step

**Only what overrides is called.** :class:`Extensions` keeps, for each hook, the extensions that override it,
and the engine calls those alone: a hook nobody overrides costs the engine an empty loop, once per step (the
token hooks: once per row). A bare engine, with no extension at all, runs exactly the loop of chapters 03-10;
and a step for which every ``logits_processor`` returns None is sampled without any callback. The token hooks
are the ones to keep cheap: structured output's two, for requests without a grammar, add about 0.4 us per row
(0.1 ms per step of 256 rows, measured on a small shared 2-core x86 host), against ~0.4 us per row of
``append_token`` alone and far more for detokenizing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

import torch

from minisgl_ref.core.batch import ScheduledBatch
from minisgl_ref.core.config import EngineConfig
from minisgl_ref.core.request import Req
from minisgl_ref.engine.model_runner import ModelRunner
from minisgl_ref.engine.step import Launched, StepEvent
from minisgl_ref.kvcache.pool import KVPool
from minisgl_ref.sampling.params import EXTENSION_FIELDS
from minisgl_ref.scheduler.scheduler import Scheduler

LogitsProcessor = Callable[[torch.Tensor], None]


class EngineView(Protocol):
    """What an extension may see of its engine: the settings, the scheduler (its queues, ``abort``,
    ``extend_next``, ``guesser``), the step in flight, the model runner (its ``token_buffer``: an extension
    that appends tokens no step sampled puts the last one there, where the next decode row reads its input) and
    the KV pool (whose ``move`` puts KV computed in one slot into another)."""

    config: EngineConfig
    scheduler: Scheduler
    inflight: Launched | None
    runner: ModelRunner
    kv_pool: KVPool


class EngineExtension:
    """A feature that plugs into the engine's loop. Every hook's default does nothing (or allows everything);
    override the ones the feature needs. The engine calls them on its own thread, in the order of the module
    docstring; an exception from a token hook aborts that request only, like any failure while appending."""

    #: The sampling parameters this extension honours, out of ``EXTENSION_FIELDS`` (structured output: the grammar
    #: fields). A request that sets one that no extension of its engine claims is refused at the door, by name.
    claims: frozenset[str] = frozenset()

    def bind(self, engine: EngineView) -> None:
        """The engine this extension serves, given once, before any other hook.

        An extension that keeps per-request state serves one engine; it reads the engine's settings, scheduler
        and step in flight through ``engine`` when its hooks run."""

    def check(self, req: Req) -> str | None:
        """An extra door check: why ``req`` cannot run on this engine, or None.

        Part of :meth:`Engine.request_problem`: ``add_request`` raises ``ValueError`` with it before anything is
        queued, and a step whose launch failed asks again, to decide whom to blame."""
        return None

    def admit(self, req: Req) -> None:
        """``req`` is about to be queued: start what it needs before it may run.

        A grammar's compile, say, which takes milliseconds to seconds: it runs on other threads while the request
        waits, and :meth:`ready` says when it is done."""

    def ready(self, req: Req) -> bool:
        """Whether the waiting ``req`` may be admitted to a step now.

        A request that is not ready keeps its place in the queue and is asked again next step. The scheduler
        calls this once per waiting request and step, so keep it to a lookup."""
        return True

    def before_step(self) -> None:
        """At the start of every ``Engine.step``, before anything is scheduled.

        The place to poll work that :meth:`admit` started, and to abort the requests it failed for (through the
        scheduler, whose aborted list the step reports)."""

    def logits_processor(self, batch: ScheduledBatch, inflight: Launched | None) -> LogitsProcessor | None:
        """A function that changes the logits of ``batch`` in place before it is sampled, or None.

        Asked as the step is launched. The model runner calls the function with the logits [rows, vocab] after
        the forward pass has been launched and before sampling (a -inf bans a token). ``inflight`` is the previous
        step, still on the device under overlap: the function may wait for its tokens (:meth:`Launched.tokens`)
        while this step's forward pass is already queued. None leaves the step alone; a step that nobody
        processes is sampled without any callback."""
        return None

    def watches_tokens(self) -> bool:
        """Whether the token hooks must run while the next step is processed (asked once per step).

        Token hooks run once per appended token; an extension whose hooks act on some requests only (structured
        output: those with a grammar) says False while it has none, and the step's tokens are appended without
        calling it."""
        return True

    def row_tokens(self, launched: Launched, i: int, token: int) -> list[int] | None:
        """The tokens row ``i`` of ``launched`` appends, for a row that fed a guess (``Row.guess``), or None.

        Asked only for such rows (speculative decoding, chapter 13, makes them), as the step is processed and
        before anything of the row is appended: ``token``, sampled after the row's last guessed token, is only
        right if the whole guess was. The extension that made the guess checks it against the row's logits
        (``launched.output.row_logits``) and returns what to append, in order; each token then goes through the
        token hooks and the request's stop rules, and a token that ends the request drops the rest. The first
        extension that answers decides; if none does, ``token`` is appended. The engine records no log
        probability for such a row (its own is that of ``token``): the extension that answers records those of
        the tokens it returns, as each is appended (in :meth:`before_token`), for a request that wants them."""
        return None

    def before_token(self, launched: Launched, i: int, token: int) -> str | None:
        """A reason to refuse the ``token`` that row ``i`` of ``launched`` sampled, or None.

        Called as the step is processed, before the row's request (``launched.batch.rows[i].req``) appends the
        token; a refused token is not appended, and the request is aborted with the reason."""
        return None

    def after_token(self, launched: Launched, i: int, token: int) -> str:
        """The text to add after row ``i``'s request appended ``token`` ("" for none).

        Called only while the request is still running after the token. The hook may end the request or extend
        its output (then bump ``req.epoch``: its rows in flight are obsolete); what it returns follows the
        token's own text."""
        return ""

    def after_step(self, launched: Launched, events: list[StepEvent]) -> None:
        """``launched`` has been processed, and ``events`` is what that did to its requests.

        Called once per step, in launch order, after every emitting row's token was appended and before the
        engine returns the events."""


E = TypeVar("E", bound=EngineExtension)
HOOKS = ("check", "admit", "ready", "before_step", "logits_processor", "row_tokens", "before_token", "after_token",
         "after_step")


def overrides(extension: EngineExtension, hook: str) -> bool:
    """Whether ``extension``'s class has its own ``hook`` (the default does nothing, so it need not be called)."""
    return getattr(type(extension), hook) is not getattr(EngineExtension, hook)


class Extensions:
    """The extensions of one engine, in order, and each hook called on them as one: what the engine calls.

    They may change between steps (:meth:`attach`, :meth:`detach`: ``bench offline`` traces only its timed run).
    The scheduler's readiness test follows them: None while no extension has a ``ready`` of its own, so that the
    scheduler then takes its waiting queue as it is."""

    def __init__(self, engine: EngineView, extensions: Iterable[EngineExtension] = ()) -> None:
        self._engine = engine
        self.all: list[EngineExtension] = []
        self._hooks: dict[str, list[EngineExtension]] = {}
        # The token hooks run once per appended token: kept as bound methods, the calls cost least.
        self._before_token: list[Callable[[Launched, int, int], str | None]] = []
        self._after_token: list[Callable[[Launched, int, int], str]] = []
        for extension in extensions:
            self.attach(extension)
        self._index()

    def attach(self, extension: EngineExtension) -> None:
        extension.bind(self._engine)
        self.all.append(extension)
        self._index()

    def detach(self, extension: EngineExtension) -> None:
        self.all.remove(extension)
        self._index()

    def find(self, kind: type[E]) -> E | None:
        """The first extension of class ``kind`` (or a subclass), or None."""
        return next((e for e in self.all if isinstance(e, kind)), None)

    def _index(self) -> None:
        self._hooks = {hook: [e for e in self.all if overrides(e, hook)] for hook in HOOKS}
        self._claimed = frozenset().union(*(e.claims for e in self.all))
        self._engine.scheduler.ready = self._ready_test()

    def _ready_test(self) -> Callable[[Req], bool] | None:
        tests = [e.ready for e in self._hooks["ready"]]
        if len(tests) <= 1:
            return tests[0] if tests else None
        return lambda req: all(test(req) for test in tests)

    # ------------------------------------------------------------------------------------------- the hooks

    def check(self, req: Req) -> str | None:
        unclaimed = next((f for f in EXTENSION_FIELDS if getattr(req.params, f) is not None and f not in self._claimed),
                         None)
        if unclaimed is not None:
            return f"{unclaimed} is not supported by this engine: none of its extensions honours it"
        return next((p for e in self._hooks["check"] if (p := e.check(req)) is not None), None)

    def admit(self, req: Req) -> None:
        for e in self._hooks["admit"]:
            e.admit(req)

    def before_step(self) -> None:
        for e in self._hooks["before_step"]:
            e.before_step()

    def logits_processor(self, batch: ScheduledBatch, inflight: Launched | None) -> LogitsProcessor | None:
        """The extensions' processors for this step, called in order as one; None if none has one."""
        hooks = self._hooks["logits_processor"]
        found = [p for e in hooks if (p := e.logits_processor(batch, inflight)) is not None]
        if len(found) <= 1:
            return found[0] if found else None

        def each(logits: torch.Tensor) -> None:
            for process in found:
                process(logits)

        return each

    def watch_tokens(self) -> None:
        """Before a step is processed: the token hooks of the extensions that watch this step's tokens."""
        watching = [e for e in self._hooks["before_token"] + self._hooks["after_token"] if e.watches_tokens()]
        self._before_token = [e.before_token for e in self._hooks["before_token"] if e in watching]
        self._after_token = [e.after_token for e in self._hooks["after_token"] if e in watching]

    def row_tokens(self, launched: Launched, i: int, token: int) -> list[int]:
        """The tokens a row that fed a guess appends: the first extension's answer, else the sampled ``token``."""
        for e in self._hooks["row_tokens"]:
            tokens = e.row_tokens(launched, i, token)
            if tokens is not None:
                return tokens
        return [token]

    def before_token(self, launched: Launched, i: int, token: int) -> str | None:
        """The first extension's reason to refuse the token, or None (once per appended token: a plain loop)."""
        for hook in self._before_token:
            reason = hook(launched, i, token)
            if reason is not None:
                return reason
        return None

    def after_token(self, launched: Launched, i: int, token: int) -> str:
        """Each extension's text, in order, while the request runs (one that ends it ends the turn)."""
        delta = ""
        for hook in self._after_token:
            if launched.batch.rows[i].req.finished:
                break
            delta += hook(launched, i, token)
        return delta

    def after_step(self, launched: Launched, events: list[StepEvent]) -> None:
        for e in self._hooks["after_step"]:
            e.after_step(launched, events)
