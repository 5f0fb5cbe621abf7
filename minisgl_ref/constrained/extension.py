"""Structured output as an engine extension: what the engine's loop does for constrained requests (chapter 12).

The engine of chapters 03-10 knows nothing of grammars. :class:`StructuredOutput` plugs into its seam
(:mod:`~minisgl_ref.engine.extension`) and keeps everything a constrained request needs, per request: the
grammar's compile while the request waits, its matcher once it runs, the masks of its rows, and jump-forward.

* **At the door** (``check``): a request that asks for a grammar needs the model's tokenizer; an engine built
  without one (``backend=None``) refuses it, naming the field.
* **In the queue** (``admit``, ``ready``, ``before_step``): the grammar compiles on the backend's threads while
  the request keeps its place in the queue; the scheduler passes it over until the compile is done. Each step
  polls the compiles: a finished one gives its request a matcher, a failed one aborts its request only (the engine
  goes on with the others). When nothing else can run, the poll waits a little for a compile instead of spinning.

**Overlap.** A constrained row's token mask depends on every token its request has accepted, and under overlap
the previous step's token is still on the device when the next step is launched. The engine therefore splits
such a launch in two, as SGLang does::

    schedule(N+1) -> forward(N+1) launched -> wait for N's tokens, advance the matchers with them ->
        fill the masks of N+1's constrained rows on the CPU -> apply them on the device -> sample(N+1) ->
        process(N) (detokenizing, stop rules, jump-forward, finishing requests)

The forward pass of N+1 is already queued on the device while the CPU waits for N's tokens and fills the masks, so
the device still never idles for the CPU's grammar work; what waits is only N+1's sampling. The runner calls the
extension's logits processor between the forward pass and sampling (:meth:`StructuredOutput.logits_processor`); a
step without constrained rows gets no processor and runs exactly as before, and while no constrained request runs
the extension does not even look at the rows. Only the matchers need N's tokens before N+1's masks can be filled,
so only they advance there (:meth:`StructuredOutput._accept_early`, a few microseconds per row); the rest of
processing N (detokenizing every row's token, on a GPU about a millisecond of host work at a few dozen rows)
would, done there, sit between the forward pass and sampling with the device idle, so it stays where the engine
processes N, after N+1's sampling has been launched, where :meth:`StructuredOutput.before_token` uses the
remembered outcome instead of accepting the token again. (The host still processes N before it schedules and
launches N+2, so where the host's work per step is what sets the step's length, this order does not shorten it;
the grammar's own cost there is the accepting and the filling.) A request that step N finishes or jumps forward
gets its row of N+1 masked from a matcher that has only accepted N's token (or left unmasked, if that token ended
its grammar): that row's token is discarded when N+1 is processed, as under overlap without grammars. Each
request's matcher sees the same tokens in the same order as without overlap, so the outputs are those of the
non-overlapped engine.

**A run of tokens** (``may_draft``, ``allowed_after``): speculative decoding (chapter 13) appends several tokens in
one step, and checks its drafts under the grammar first. :meth:`StructuredOutput.allowed_after` gives the mask
after the request's output plus a drafted path (its matcher accepts the path, fills, and rolls back); the matcher
itself advances only as tokens are appended, once per token, through :meth:`StructuredOutput.before_token`.

**Around each token** (``before_token``, ``after_token``): the matcher accepts the token (a refused token aborts
the request: the mask forbids it, so only a failure gets there); a grammar that has ended ends the request. Then
jump-forward decoding (``EngineConfig.enable_jump_forward``, :mod:`~minisgl_ref.constrained.jump_forward`): when
the grammar forces a continuation, the request's output grows by the forced tokens at once, its rows in flight
become obsolete (its epoch changes), and the scheduler gives it an extend row over the new tokens next, riding
along with the decode rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from typing import Any

import torch
import xgrammar as xgr

from minisgl_ref.constrained.backend import GrammarBackend
from minisgl_ref.constrained.bitmask import TokenBitmask
from minisgl_ref.constrained.jump_forward import plan_jump
from minisgl_ref.constrained.matcher import GrammarState
from minisgl_ref.constrained.spec import spec_of
from minisgl_ref.core.batch import ScheduledBatch
from minisgl_ref.core.request import Req
from minisgl_ref.engine.extension import EngineExtension, EngineView, LogitsProcessor
from minisgl_ref.engine.step import Launched, StepEvent
from minisgl_ref.sampling.params import GRAMMAR_FIELDS


class StructuredOutput(EngineExtension):
    """Constrained decoding for one engine (see the module docstring). ``backend`` compiles the grammars for the
    model's vocabulary (None: the model has no tokenizer, and constrained requests are refused at the door)."""

    def __init__(self, backend: GrammarBackend | None) -> None:
        self.backend = backend
        self._engine: EngineView | None = None
        self._compiling: dict[Req, Future[Any]] = {}  # waiting requests whose grammar is compiling, in order
        self._matchers: dict[Req, GrammarState] = {}  # admitted constrained requests, pruned as they finish
        self._bitmask: TokenBitmask | None = None  # allocated with the first constrained step
        self._scratch: torch.Tensor | None = None  # one bitmask row for :meth:`allowed_after`
        # The step in flight whose rows' tokens the matchers have already been given (:meth:`_accept_early`),
        # and each outcome by row (an exception: the matcher failed); :meth:`before_token` uses them.
        self._early_step: Launched | None = None
        self._early: dict[int, bool | Exception] = {}
        # Jump-forward decoding: how often, and how many tokens were appended without a decode step (net of the
        # tail tokens their retokenization replaced): the decode steps it saved.
        self.jump_forwards = 0
        self.jump_forward_tokens = 0

    claims = frozenset(GRAMMAR_FIELDS)

    def bind(self, engine: EngineView) -> None:
        self._engine = engine

    def watches_tokens(self) -> bool:
        """Only while some admitted request has a matcher: a free request's tokens never meet a grammar."""
        return bool(self._matchers)

    @property
    def engine(self) -> EngineView:
        assert self._engine is not None, "StructuredOutput is used by an engine, which binds it first"
        return self._engine

    def matcher(self, req: Req) -> GrammarState | None:
        """``req``'s matcher: from the end of its grammar's compile until the first step after it finished."""
        return self._matchers.get(req)

    # ------------------------------------------------------------------------------------------ a run of tokens

    def may_draft(self, req: Req) -> bool:
        """Whether ``req``'s tokens may be checked a run at a time (speculative decoding, chapter 13): a request
        without a grammar may; one with a grammar once its matcher exists, and only without jump-forward, which
        would append forced tokens in the middle of a run that was verified without them."""
        if spec_of(req.params) is None:
            return True
        return req in self._matchers and not self.engine.config.enable_jump_forward

    def allowed_after(self, req: Req, tokens: Sequence[int]) -> torch.Tensor | None:
        """The tokens ``req``'s grammar allows after its output followed by ``tokens`` (a path it allows), as a
        ``[vocab]`` bool mask (True: allowed), exactly the mask a plain step would apply there; None when
        ``req`` follows no grammar, or a stop token on the path ended it. The matcher is left as it was: it
        accepts ``tokens`` one by one, fills the mask, and rolls them back; it advances only as tokens are
        appended (:meth:`before_token`, once per token)."""
        matcher = self._matchers.get(req)
        if matcher is None:
            return None
        if self._scratch is None:
            assert self.backend is not None, "a request with a matcher had its grammar compiled by the backend"
            self._scratch = xgr.allocate_token_bitmask(1, self.backend.vocab_size)
        return matcher.allowed_after(tokens, self._scratch)

    # ---------------------------------------------------------------------------------------------- the door

    def check(self, req: Req) -> str | None:
        spec = spec_of(req.params)
        if spec is not None and self.backend is None:
            return f"{spec.field} needs the model's tokenizer, and this engine has none"
        return None

    def admit(self, req: Req) -> None:
        """Start compiling ``req``'s grammar (compiles are cached, so most requests find theirs done)."""
        spec = spec_of(req.params)
        if spec is not None and req not in self._matchers:
            assert self.backend is not None, "check() refuses grammars without a backend"
            self._compiling[req] = self.backend.compile_async(spec)

    def ready(self, req: Req) -> bool:
        return req not in self._compiling

    def before_step(self) -> None:
        if self._compiling:
            self._poll_grammars()

    def _poll_grammars(self) -> None:
        """Give each waiting request whose grammar has compiled its matcher (the scheduler may admit it now), and
        abort the ones whose grammar failed to compile, with the reason; the engine goes on with the others. When
        nothing else can run, wait a little for a compile instead of spinning."""
        engine, sched = self.engine, self.engine.scheduler
        idle = engine.inflight is None and not (sched.running or sched.chunked or sched.extending)
        if idle and all(r in self._compiling for r in sched.waiting):
            wait_futures(list(self._compiling.values()), timeout=0.05, return_when=FIRST_COMPLETED)
        for req, future in list(self._compiling.items()):
            if not req.finished and not future.done():
                continue
            del self._compiling[req]
            if req.finished:
                continue
            error = future.exception()
            if error is not None:
                sched.abort(req, f"this request could not be processed: {error}")
                sched.aborted.append(req)
                continue
            assert self.backend is not None
            stops = set(req.params.stop_token_ids or ()) | (set() if req.params.ignore_eos else set(req.eos_token_ids))
            self._matchers[req] = self.backend.matcher(future.result(), stops)

    # ------------------------------------------------------------------------------------------------ masks

    def logits_processor(self, batch: ScheduledBatch, inflight: Launched | None) -> LogitsProcessor | None:
        """For a step with constrained rows (None for a step without): bring the rows' matchers up to date, fill
        their masks and apply them to the logits.

        Under overlap a constrained row's request may still have its previous token in the step in flight
        (``num_inflight > 1``: that token and this row's). Then only the matchers are advanced now
        (:meth:`_accept_early`): the wait for the step's tokens happens while this step's forward pass is
        already queued on the device, and a few microseconds per row of accepting are all that stands between
        the forward pass and sampling. The rest of processing that step -- detokenizing, the stop rules,
        jump-forward, finishing requests, a millisecond or so of host work at a few dozen rows -- waits until the
        engine processes it, after this step's sampling has been launched: done here, the device would idle
        through it. A row is left unmasked if its token is discarded anyway: its request finished or jumped
        forward in an earlier step, its grammar ended with the token just accepted, or that token was refused
        (the request is aborted when the step is processed)."""
        if not self._matchers:
            return None
        self._matchers = {r: m for r, m in self._matchers.items() if not r.finished}
        rows = [i for i, row in enumerate(batch.rows) if row.emits and row.req in self._matchers]
        if not rows:
            return None

        def apply(logits: torch.Tensor) -> None:
            refused: set[Req] = set()  # requests whose matcher refused (or failed on) their token in flight
            if inflight is not None and any(batch.rows[i].req.num_inflight > 1 for i in rows):
                refused = self._accept_early(inflight)
            live = [i for i in rows if self._maskable(batch.rows[i].req, batch.rows[i].is_live, refused)]
            if self._bitmask is None:
                max_rows = self.engine.config.max_running_requests + 1
                self._bitmask = TokenBitmask(logits.shape[1], max_rows, logits.device)
            self._bitmask.fill([(i, self._matchers[batch.rows[i].req]) for i in live])
            self._bitmask.apply(logits, live)

        return apply

    def _maskable(self, req: Req, live: bool, refused: set[Req]) -> bool:
        """Whether a constrained row's token can still be kept, so that its mask is worth filling: the row is
        live, its request's matcher did not refuse the token in flight (``refused``), and has not ended (a matcher
        that accepted its stop token has no next mask)."""
        return live and req not in refused and not self._matchers[req].is_terminated

    def _accept_early(self, launched: Launched) -> set[Req]:
        """Advance the matchers by the tokens of ``launched`` (the step in flight) before the next step's masks
        are filled, and remember each outcome for :meth:`before_token`, which then does not accept the token
        again. Only rows that the engine would append are accepted: they emit, are live, and their request has a
        grammar (and is not prefill-only). Returns the requests whose matcher refused its token or failed.

        Nothing else of the step is processed here, so nothing else can change before the engine processes it: a
        row accepted here is still live there, unless its request was aborted meanwhile (then its token is
        dropped with the request). If the next step's launch fails after this, the step in flight is processed
        as usual, with these outcomes."""
        tokens = launched.tokens()  # waits for the step in flight (its forward pass was queued before this one's)
        if launched is not self._early_step:
            self._early_step, self._early = launched, {}
        rows = launched.batch.rows
        for i, (row, token) in enumerate(zip(rows, tokens)):
            req = row.req
            matcher = self._matchers.get(req)
            if not row.emits or not row.is_live or matcher is None or i in self._early or req.prefill_only:
                continue
            try:
                self._early[i] = matcher.accept(token)
            except Exception as e:  # noqa: BLE001 - the request fails when its token is processed, alone
                self._early[i] = e
        return {rows[i].req for i, ok in self._early.items() if isinstance(ok, Exception) or not ok}

    # ----------------------------------------------------------------------------------------------- tokens

    def before_token(self, launched: Launched, i: int, token: int) -> str | None:
        """The request's matcher accepts the token, unless it already has (:meth:`_accept_early`: then its
        outcome counts, and a failure there is raised now); a refused token aborts the request."""
        matcher = self._matchers.get(launched.batch.rows[i].req)
        if matcher is None:
            return None
        accepted = self._early.get(i) if launched is self._early_step else None
        if accepted is None:
            accepted = matcher.accept(token)
        elif isinstance(accepted, Exception):
            raise accepted  # the matcher failed while accepting early: handled as if it failed now
        return None if accepted else f"token {token} is not allowed by this request's grammar"

    def after_token(self, launched: Launched, i: int, token: int) -> str:
        """If the grammar has ended, so has the request; otherwise, with jump-forward on, append what it forces."""
        req = launched.batch.rows[i].req
        matcher = self._matchers.get(req)
        if matcher is None:
            return ""
        delta = req.finish_by_stop_token(token) if matcher.is_terminated else ""
        if not req.finished and self.engine.config.enable_jump_forward:
            delta += self._jump_forward(req, matcher)
        return delta

    def after_step(self, launched: Launched, events: list[StepEvent]) -> None:
        if launched is self._early_step:  # its outcomes have been used
            self._early_step, self._early = None, {}

    def _jump_forward(self, req: Req, matcher: GrammarState) -> str:
        """If ``req``'s grammar now forces a continuation, append it without decode steps and return its text.

        Only output tokens that the radix tree does not share yet may be retokenized (``tree_len``), and the
        request must have room for the forced tokens below ``max_new_tokens`` and its context window; requests
        that return log probabilities never jump (the forced tokens have none). The request's rows in flight
        become obsolete (its epoch changes) and its KV is kept up to where the old and new tokens agree, minus
        the last token, whose KV only a row in flight may be computing: the extend row recomputes from there."""
        assert self.backend is not None
        if req.return_logprob:
            return ""
        max_rollback = len(req.all_ids) - max(req.tree_len, len(req.input_ids))
        length_before = len(req.all_ids)
        jump = plan_jump(matcher, self.backend.tokenizer, req.output_ids, max_rollback)
        if jump is None:
            return ""
        grown = len(jump.tokens) - jump.rollback
        room = req.params.max_new_tokens - len(req.output_ids)
        if req.context_len is not None:
            room = min(room, req.context_len - len(req.all_ids))
        if grown >= room:  # the request would end inside the forced text: let it decode to its limit instead
            matcher.rollback(len(jump.tokens))
            matcher.accepts(req.output_ids[len(req.output_ids) - jump.rollback :])
            return ""
        req.epoch += 1  # its rows in flight (this request's next decode row, under overlap) are obsolete
        req.num_inflight = 0
        req.kv_scheduled_len = min(req.kv_scheduled_len, length_before - max(jump.rollback, 1))
        delta = req.replace_tail(jump.rollback, jump.tokens, jump.text_ids)
        self.jump_forwards += 1
        self.jump_forward_tokens += grown
        if not req.finished:
            self.engine.scheduler.extend_next(req)
        return delta
