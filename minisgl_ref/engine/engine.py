"""The engine loop: schedule, run, process results, with or without overlap (chapters 03-06).

Without overlap each step is strictly sequential::

    schedule(N) -> run(N) -> wait for N's tokens -> process(N)

so the device idles while the CPU schedules and processes. With overlap (the default) the CPU schedules and
launches step N+1 *before* it looks at step N's tokens::

    schedule(N+1) -> launch(N+1) -> process(N) (waits for N only) -> schedule(N+2) -> ...

Three consequences, each handled explicitly here or in the scheduler:

1. Step N+1 was scheduled without knowing which requests step N finished, so it computes one token too many for
   them. ``process`` drops every token of a request that has already finished (or was retracted since).
2. Step N+1's decode inputs are step N's sampled tokens, which the CPU has not seen: the model runner reads them
   from a device-side token buffer.
3. KV slots freed while processing step N may still be written by step N+1: every free goes through one
   :class:`~minisgl_ref.kvcache.inflight.InflightFrees`, which releases it once the steps in flight have been
   processed. The overlapped engine tells it when a step is launched and when one has been processed; without
   overlap nothing is ever in flight, and it frees at once.

And one rare case needs a synchronisation: when memory is so short that the scheduler must retract requests, it
returns ``NEED_SYNC`` while a step is in flight (their KV could not be freed before that step completes); the
engine then processes the step in flight first and schedules again.

**Failures stay inside the request that caused them.** A server cannot let one bad request take down every
other one. Each request is checked at the door (:meth:`Engine.request_problem`: every token id it carries must
be a vocabulary id); a failure while appending one request's token aborts that request alone; and if launching a
step fails, the engine finishes the step in flight, rolls the failed step back, aborts the requests that fail the
door check again (or, if none does, every request of that step, since nobody can be singled out) and sends the
rest back to the queue, to be prefilled again from the radix cache as after a retraction.

One thing is deliberately *not* one step late: a prefill row's prompt tokens go into the radix tree as soon as
its step is launched (``_commit_launched``), so that step N+1's requests can already reuse step N's prompts.

On the CPU ``launch`` computes synchronously, so nothing actually overlaps, but every one of these code paths
runs, which is what the tests check.

**Structured output (chapter 12)** adds one dependency that overlap has to respect: a constrained row's token
mask depends on every token its request has accepted, and under overlap the previous step's token is still on
the device when the next step is launched. The engine therefore splits such a launch in two, as SGLang does:

    schedule(N+1) -> forward(N+1) launched -> wait for N's tokens, advance the matchers with them ->
        fill the masks of N+1's constrained rows on the CPU -> apply them on the device -> sample(N+1) ->
        process(N) (detokenizing, stop rules, jump-forward, finishing requests)

The forward pass of N+1 is already queued on the device while the CPU waits for N's tokens and fills the masks, so
the device still never idles for the CPU's grammar work; what waits is only N+1's sampling. The runner calls back
into the engine between the forward pass and sampling (:meth:`Engine._grammar_mask`); a step without constrained
rows gets no callback and runs exactly as before, and an engine that has never seen a constrained request does not
even look at the rows. Only the matchers need N's tokens before N+1's masks can be filled, so only they advance
there (:meth:`Engine._accept_early`, a few microseconds per row); the rest of processing N (detokenizing every row's
token, on a GPU about a millisecond of host work at a few dozen rows) would, done there, sit between the forward
pass and sampling with the device idle, so it stays in ``_finish_inflight``, after N+1's sampling has been launched,
where ``_append`` uses the remembered outcome instead of accepting the token again. (The host still processes N
before it schedules and launches N+2, so where the host's work per step is what sets the step's length, this order
does not shorten it; the grammar's own cost there is the accepting and the filling.) A request that step N finishes
or jumps forward gets its row of N+1 masked from a matcher that has only accepted N's token (or left unmasked, if
that token ended its grammar): that row's token is discarded when N+1 is processed, as under overlap without
grammars. Each request's matcher sees the same tokens in the same order as without overlap, so the outputs are those
of the non-overlapped engine. A request whose grammar is still compiling waits in the queue
(:meth:`Engine._poll_grammars`); a grammar that fails to compile aborts its request only.

Jump-forward decoding (``EngineConfig.enable_jump_forward``, :mod:`minisgl_ref.constrained.jump_forward`) happens
where a token is processed: when the grammar forces a continuation, the request's output grows by the forced
tokens at once, its rows in flight become obsolete (its epoch changes), and the scheduler gives it an extend row
over the new tokens next, riding along with the decode rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

import torch
from torch import nn

from minisgl_ref.attention.registry import create_attention_backend
from minisgl_ref.constrained.backend import GrammarBackend
from minisgl_ref.constrained.bitmask import TokenBitmask
from minisgl_ref.constrained.jump_forward import plan_jump
from minisgl_ref.constrained.spec import spec_of
from minisgl_ref.core.batch import ScheduledBatch
from minisgl_ref.core.config import EngineConfig
from minisgl_ref.core.request import Req, TokenLogprob
from minisgl_ref.distributed.group import min_over_ranks
from minisgl_ref.engine.attention_planner import AttentionSetup, PlannerFactory, default_planner
from minisgl_ref.engine.graphs import GraphSettings
from minisgl_ref.engine.model_runner import ModelRunner, StepOutput
from minisgl_ref.engine.prompt_logprobs import PromptLogprobPlan
from minisgl_ref.engine.step_trace import StepTrace
from minisgl_ref.kvcache.allocator import PageAllocator
from minisgl_ref.kvcache.inflight import InflightFrees
from minisgl_ref.kvcache.pool import KVPool
from minisgl_ref.kvcache.req_to_token import ReqToTokenPool
from minisgl_ref.models.config import ModelConfig
from minisgl_ref.sampling.sampler import StepLogprobs
from minisgl_ref.scheduler.cache_manager import CacheManager, NaiveCacheManager
from minisgl_ref.scheduler.scheduler import NeedSync, Scheduler

CPU_DEFAULT_MAX_TOTAL_TOKENS = 16384
log = logging.getLogger(__name__)


class LaunchFailed(Exception):
    """Running a scheduled step failed; the engine rolls that step back (see :meth:`Engine._recover`)."""

    def __init__(self, batch: ScheduledBatch, step: int, error: Exception) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.batch, self.step, self.error = batch, step, error


@dataclass
class Launched:
    """A step on its way: its number (in launch order), its plan, and what the device will produce."""

    step: int
    batch: ScheduledBatch
    output: StepOutput
    after_idle: bool = False  # nothing ran before it: the time since the previous step was idle, not waiting
    # Chapter 12: rows whose token the request's matcher has already been given, before the step is processed
    # (:meth:`Engine._accept_early`), with the outcome (an exception: the matcher failed); ``_append`` uses it.
    grammar_accepted: dict[int, bool | Exception] = field(default_factory=dict)
    _tokens: list[int] | None = field(default=None, repr=False)

    def tokens(self) -> list[int]:
        """The step's sampled tokens on the host (:meth:`StepOutput.tokens`, waited for once and kept: a
        constrained step's mask may need them before the step is processed)."""
        if self._tokens is None:
            self._tokens = self.output.tokens()
        return self._tokens


@dataclass
class StepEvent:
    req: Req
    delta: str  # new text (empty when the tokenizer holds it back or the model has none)
    finished: bool


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0  # tokens whose KV was computed in extend rows (what prefix caching saves)
    decode_tokens: int = 0
    cached_tokens: int = 0
    # Jump-forward decoding (chapter 12): how often, and how many tokens were appended without a decode step
    # (net of the tail tokens their retokenization replaced): the decode steps it saved.
    jump_forwards: int = 0
    jump_forward_tokens: int = 0


def kv_pool_tokens(config: EngineConfig, model_config: ModelConfig, device: torch.device, dtype: torch.dtype) -> int:
    """How many tokens of KV to allocate: ``--max-total-tokens`` if given, else what memory allows."""
    if config.max_total_tokens is not None:
        return config.max_total_tokens
    if device.type != "cuda":
        return CPU_DEFAULT_MAX_TOTAL_TOKENS
    # Memory that PyTorch's caching allocator holds but no tensor uses (say, a previous Engine's KV pool in the
    # same process) counts as used in mem_get_info: hand it back first, or a second Engine sizes its pool too small.
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = total - free  # the weights are already loaded, so they count here
    budget = total * config.mem_fraction_static - used_by_others
    per_token = KVPool.bytes_per_slot(model_config.num_layers, model_config.num_kv_heads, model_config.head_dim, dtype)
    tokens = int(budget // per_token)
    if tokens < config.page_size * 2:
        raise ValueError(
            f"mem_fraction_static={config.mem_fraction_static} leaves no room for the KV cache after the weights"
        )
    return tokens


class Engine:
    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        config: EngineConfig | None = None,
        *,
        device: torch.device | str = "cpu",
        context_length: int | None = None,
        grammar_backend: GrammarBackend | None = None,
        attention_planner: PlannerFactory | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.device = torch.device(device)
        self.model_config = model_config
        dtype = next(model.parameters()).dtype
        page = self.config.page_size
        # With tensor parallelism every rank must schedule alike, so all take the smallest rank's pool (chapter 09).
        tokens = min_over_ranks(kv_pool_tokens(self.config, model_config, self.device, dtype))
        num_pages = tokens // page + 1  # + the reserved dummy page 0
        self.allocator = PageAllocator(num_pages, page, self.device)
        self.frees = InflightFrees(self.allocator)  # every free waits for the steps in flight (chapter 06)
        context = context_length or model_config.max_position_embeddings
        self.req_to_token = ReqToTokenPool(self.config.max_running_requests + 1, context + 1, self.device)
        from minisgl_ref.layers.attention import AttentionLayer

        num_kv_heads = next(m for m in model.modules() if isinstance(m, AttentionLayer)).num_kv_heads
        self.kv_pool = KVPool(model_config.num_layers, num_pages * page, num_kv_heads, model_config.head_dim,
                              dtype, self.device)
        manager_cls = NaiveCacheManager if self.config.disable_radix_cache else CacheManager
        self.cache = manager_cls(self.allocator, self.req_to_token, self.frees)
        self.scheduler = Scheduler(self.config, self.cache)
        num_q_heads = next(m for m in model.modules() if isinstance(m, AttentionLayer)).num_heads  # per rank
        backend = create_attention_backend(self.config, self.kv_pool, self.req_to_token, num_q_heads=num_q_heads,
                                           device=self.device)  # chapter 07: --attention-backend and defaults
        # Which backend each step's attention runs on (an extension may add decode backends: chapter 11).
        planner = (attention_planner or default_planner)(AttentionSetup(self.config, self.kv_pool, self.req_to_token,
                                                                        backend, num_q_heads))
        self.runner = ModelRunner(model, model_config.vocab_size, self.req_to_token, planner, self.device,
                                  graphs=GraphSettings.of(self.config, self.device),
                                  extend_token_multiple=self.config.extend_token_multiple)
        self.overlap = not self.config.disable_overlap_schedule
        self.inflight: Launched | None = None
        self.stats = EngineStats()
        self.trace: StepTrace | None = None  # a per-step record to a file, when asked for (--step-log)
        # Structured output (chapter 12): None without a tokenizer; compiles lazily, so free requests never pay.
        self.grammar = grammar_backend
        self._bitmask: TokenBitmask | None = None  # allocated with the first constrained step
        self._compiling: list[Req] = []  # waiting requests whose grammar is compiling
        self._constrained: set[Req] = set()  # admitted requests with a grammar, pruned as they finish

    @property
    def max_total_tokens(self) -> int:
        return self.allocator.capacity_pages * self.allocator.page_size

    def request_problem(self, req: Req) -> str | None:
        """What makes ``req`` impossible to run on this model, or None (the door check)."""
        return req.token_id_problem(self.model_config.vocab_size)

    def add_request(self, req: Req) -> None:
        """Queue ``req``; raises ``ValueError`` (naming the field) if it cannot run on this model.

        A request with a grammar starts its compile here (on the backend's threads) and waits in the queue
        until it is ready (chapter 12)."""
        problem = self.request_problem(req)
        if problem is not None:
            raise ValueError(problem)
        spec = spec_of(req.params)
        if spec is not None and self.grammar is None:
            raise ValueError(f"{spec.field} needs the model's tokenizer, and this engine has none")
        if req.finished:
            return
        if spec is not None and req.grammar is None:
            assert self.grammar is not None
            req.grammar_pending = self.grammar.compile_async(spec)
            self._compiling.append(req)
            self._constrained.add(req)
        self.scheduler.add(req)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.inflight is not None or bool(self.scheduler.aborted)

    def run_until_done(self) -> None:
        while self.has_work:
            self.step()

    def flush_cache(self) -> bool:
        """Drop every cached prefix (the server's /flush_cache); refused (False) while requests run or wait."""
        return not self.has_work and self.cache.flush_cache()

    # ------------------------------------------------------------------------------------------------ steps

    def step(self) -> list[StepEvent]:
        """Advance the engine by one scheduled batch; return what happened to requests.

        Without overlap: schedule and launch step N, then process it (:meth:`_step_sync`). With overlap: schedule
        and launch step N+1, then process step N, which has been in flight since the previous call
        (:meth:`_step_overlap`)."""
        if self._compiling:
            self._poll_grammars()
        return self._step_overlap() if self.overlap else self._step_sync()

    def _step_sync(self) -> list[StepEvent]:
        """Schedule step N, launch it, wait for its tokens and process them. Nothing is ever in flight between two
        calls, so the frees never have to wait (steps launched here are not counted by ``self.frees``)."""
        try:
            launched = self._schedule_and_launch()
        except LaunchFailed as failed:
            return self._recover(failed) + self._take_aborted()
        events = self._take_aborted()
        return events + (self._process(launched) if isinstance(launched, Launched) else [])

    def _step_overlap(self) -> list[StepEvent]:
        """One overlapped step: schedule and launch step N+1 while step N (``self.inflight``, launched by the
        previous call, or None) may still run on the device; only then process step N. Returns the events.

        1. ``self._schedule_and_launch()`` schedules the next step and launches it (it tells ``self.frees``, so
           every free from now on waits for it). It returns a :class:`Launched`, None (nothing to run), or
           ``NEED_SYNC``: the scheduler would have to retract while a step is in flight. Then finish the step in
           flight first (:meth:`_finish_inflight`, keeping its events) and schedule and launch again: with
           nothing in flight the scheduler can retract.
        2. If launching raises :class:`LaunchFailed`, finish the step in flight, then roll the failed step back
           with ``self._recover(failed)``, and return the events of both plus ``self._take_aborted()``.
        3. Otherwise collect ``self._take_aborted()`` (requests the scheduler gave up on), then finish the step in
           flight (step N: its tokens, the one wait for the device), and keep the step just launched as
           ``self.inflight`` (None if nothing was launched): the next call processes it. Return the events in
           that order."""
        # BEGIN TASK 6.1: the overlapped step and its deferred frees
        events: list[StepEvent] = []
        try:
            launched = self._schedule_and_launch()
            if isinstance(launched, NeedSync):  # retracting needs the memory the step in flight holds
                events += self._finish_inflight()
                launched = self._schedule_and_launch()
        except LaunchFailed as failed:
            events += self._finish_inflight()
            return events + self._recover(failed) + self._take_aborted()
        events += self._take_aborted()
        events += self._finish_inflight()
        self.inflight = launched if isinstance(launched, Launched) else None
        return events
        # END TASK 6.1

    def _finish_inflight(self) -> list[StepEvent]:
        """Process the step in flight (``self.inflight``), if any, and return its events ([] if none).

        Clear ``self.inflight`` first, process the step with :meth:`_process` (which waits for its tokens), and
        then tell the frees that this step has been processed (``self.frees.processed(launched.step)``): the
        device is done with it, so the slots that only it could still write go back to the allocator."""
        # BEGIN TASK 6.1: the overlapped step and its deferred frees
        launched, self.inflight = self.inflight, None
        if launched is None:
            return []
        events = self._process(launched)
        self.frees.processed(launched.step)  # this step has completed: what waited for it can be freed
        return events
        # END TASK 6.1

    def _process(self, launched: Launched) -> list[StepEvent]:
        """Wait for a launched step's tokens and apply them: append each emitting row's token to its request
        (stop rules included), finish the requests that are done, and return one event per appended token.

        A row is skipped if it emits nothing (a partial prefill chunk, whose KV was committed at launch) or is no
        longer live: under overlap, the extra token computed for a request that finished in the step before, or
        the old row of a request retracted since it was scheduled (chapter 06). A prefill-only request
        (``Req.prefill_only``, chapter 10) ends at its emitting row, and its token is dropped too: the prompt's log
        probabilities, recorded first, are its answer. Under overlap the next step never holds a row of it (the
        scheduler gives decode rows only to requests below ``max_new_tokens``), and at any tensor-parallel rank
        the request is rebuilt with the same fields, so every rank ends it at the same step."""
        batch, out = launched.batch, launched.output
        tokens = launched.tokens()  # the one wait for the device per step: after it, the step's tokens are here
        if self.trace is not None:
            self.trace.record(batch, launched.after_idle)
        if out.prompt_logprobs is not None:
            self._record_prompt_logprobs(batch, *out.prompt_logprobs)
        logprobs = _rows(out.logprobs) if out.logprobs is not None else None
        events = []
        for i, (row, token) in enumerate(zip(batch.rows, tokens)):
            req = row.req
            if not row.emits or not row.is_live:
                continue
            req.num_inflight -= 1
            if req.prefill_only:  # scoring: the prompt's log probabilities were the answer, not a token
                req.end_after_prefill()
                self.scheduler.finish(req)
                events.append(StepEvent(req, "", True))
                continue
            if logprobs is not None and req.logprobs is not None:
                req.logprobs.output.append(logprobs(i, req.logprobs.top))
            delta = self._append(req, token, launched.grammar_accepted.get(i))
            if req.grammar is not None and not req.finished and self.config.enable_jump_forward:
                delta += self._jump_forward(req)
            if req.finished:
                self.scheduler.finish(req)
            events.append(StepEvent(req, delta, req.finished))
        return events

    def _take_aborted(self) -> list[StepEvent]:
        return [StepEvent(r, "", True) for r in self.scheduler.take_aborted()]

    def _schedule_and_launch(self) -> Launched | NeedSync | None:
        idle = self.inflight is None and not self.scheduler.running and self.scheduler.chunked is None
        batch = self.scheduler.schedule()
        if batch is None or isinstance(batch, NeedSync):
            return batch
        # Under overlap the step stays in flight after this call, and every free must wait until it has been
        # processed (chapter 06). Without overlap it is processed before anything is allocated again: it is not
        # counted (step 0), and frees go back at once.
        step = self.frees.launch() if self.overlap else 0
        try:
            mask = self._grammar_mask(batch) if self._constrained else None
            output = self.runner.run(batch) if mask is None else self.runner.run(batch, mask)
        except Exception as e:  # noqa: BLE001 - one request's bad data must not end the engine
            raise LaunchFailed(batch, step, e) from e
        self._commit_launched(batch)
        self.stats.steps += 1
        self.stats.prefill_tokens += batch.num_prefill_tokens
        self.stats.decode_tokens += batch.num_tokens - batch.num_prefill_tokens
        return Launched(step, batch, output, idle)

    def _commit_launched(self, batch: ScheduledBatch) -> None:
        """Offer the prompt tokens that ``batch`` computes to the radix tree as soon as the step is launched.

        Waiting until the step is processed would, under overlap, be one step late: the next step is scheduled
        before this one is processed, and its requests would miss the prefix. Committing now is safe because
        every later step is launched after this one (on one CUDA stream, in order; on the CPU, synchronously),
        so any request that matches these slots reads them after this step has written them. The page-table
        rows may be repointed now too: this step's slots were already read by ``runner.run``. Duplicate copies
        (two rows of this step computing the same new prefix) are written by this step, so their frees wait
        until it has been processed."""
        for row in batch.rows:
            if not row.is_decode:
                self.cache.commit(row.req)

    def _record_prompt_logprobs(self, batch: ScheduledBatch, plan: PromptLogprobPlan, computed: StepLogprobs) -> None:
        """Append the prompt log probabilities this step computed to their requests, in prompt order. A position
        already recorded (a retracted request computing its prompt again) is skipped."""
        entry = _rows(computed)
        j = 0
        for i, first, count in plan.spans:
            row = batch.rows[i]
            wanted = row.req.logprobs
            assert wanted is not None  # the plan lists only rows that asked
            for pos in range(first, first + count):
                if row.is_live and pos == wanted.start + len(wanted.prompt):
                    wanted.prompt.append(entry(j, wanted.top))
                j += 1

    def _append(self, req: Req, token: int, accepted: bool | Exception | None = None) -> str:
        """``req.append_token``, with a failure (in its detokenizer, say) aborting this request only. A
        constrained request's matcher accepts the token first; if its grammar has ended, so has the request.

        Under overlap the matcher has usually been given the token already, before the next step's sampling
        (:meth:`_accept_early`); ``accepted`` is then that outcome, and the token is not accepted a second time.
        Everything else -- detokenizing, the stop rules, ending the request with its grammar, and jump-forward
        in :meth:`_process` -- happens only here, after the next step's sampling has been launched."""
        try:
            if req.grammar is not None:
                if accepted is None:
                    accepted = req.grammar.accept(token)
                elif isinstance(accepted, Exception):
                    raise accepted  # the matcher failed while accepting early: handled as if it failed now
                if not accepted:
                    req.abort(f"token {token} is not allowed by this request's grammar")  # the mask forbids it
                    return ""
            delta = req.append_token(token)
            if req.grammar is not None and not req.finished and req.grammar.is_terminated:
                delta += req.finish_by_grammar(token)
            return delta
        except Exception as e:  # noqa: BLE001
            log.exception("request %s failed while appending its token", req.rid)
            req.abort(f"this request failed while processing its output: {type(e).__name__}: {e}")
            return ""

    # -------------------------------------------------------------------------------- structured output

    def _poll_grammars(self) -> None:
        """Give each waiting request whose grammar has compiled its matcher (the scheduler may admit it now), and
        abort the ones whose grammar failed to compile, with the reason; the engine goes on with the others. When
        nothing else can run, wait a little for a compile instead of spinning."""
        idle = self.inflight is None and not (self.scheduler.running or self.scheduler.chunked
                                              or self.scheduler.extending)
        if idle and all(r.grammar_pending is not None for r in self.scheduler.waiting):
            wait_futures([r.grammar_pending for r in self._compiling if r.grammar_pending is not None],
                         timeout=0.05, return_when=FIRST_COMPLETED)
        still: list[Req] = []
        for req in self._compiling:
            future = req.grammar_pending
            if req.finished or future is None:
                req.grammar_pending = None
                continue
            if not future.done():
                still.append(req)
                continue
            req.grammar_pending = None
            error = future.exception()
            if error is not None:
                self.scheduler.abort(req, f"this request could not be processed: {error}")
                self.scheduler.aborted.append(req)
                continue
            assert self.grammar is not None
            stops = set(req.params.stop_token_ids or ()) | (set() if req.params.ignore_eos else set(req.eos_token_ids))
            req.grammar = self.grammar.matcher(future.result(), stops)
        self._compiling = still

    def _grammar_mask(self, batch: ScheduledBatch) -> Callable[[torch.Tensor], None] | None:
        """What the runner calls between the forward pass and sampling for a step with constrained rows (None for
        a step without): bring the rows' matchers up to date, fill their masks and apply them to the logits.

        Under overlap a constrained row's request may still have its previous token in the step in flight
        (``num_inflight > 1``: that token and this row's). Then only the matchers are advanced now
        (:meth:`_accept_early`): the wait for the step's tokens happens while this step's forward pass is
        already queued on the device, and a few microseconds per row of accepting are all that stands between
        the forward pass and sampling. The rest of processing that step -- detokenizing, the stop rules,
        jump-forward, finishing requests, a millisecond or so of host work at a few dozen rows -- waits for
        ``_finish_inflight``, after this step's sampling has been launched: done here, the device would idle
        through it. A row is left unmasked if its token is discarded anyway: its request finished or jumped
        forward in an earlier step, its grammar ended with the token just accepted, or that token was refused
        (the request is aborted when the step is processed)."""
        self._constrained = {r for r in self._constrained if not r.finished}
        rows = [i for i, row in enumerate(batch.rows) if row.emits and row.req.grammar is not None]
        if not rows:
            return None

        def apply(logits: torch.Tensor) -> None:
            refused: set[int] = set()  # requests whose matcher refused (or failed on) their token in flight
            if self.inflight is not None and any(batch.rows[i].req.num_inflight > 1 for i in rows):
                refused = self._accept_early(self.inflight)
            live = [i for i in rows if _maskable(batch.rows[i].req, batch.rows[i].is_live, refused)]
            if self._bitmask is None:
                self._bitmask = TokenBitmask(logits.shape[1], self.config.max_running_requests + 1, logits.device)
            self._bitmask.fill([(i, batch.rows[i].req.grammar) for i in live])  # type: ignore[misc]
            self._bitmask.apply(logits, live)

        return apply

    def _accept_early(self, launched: Launched) -> set[int]:
        """Advance the matchers by the tokens of ``launched`` (the step in flight) before the next step's masks
        are filled, and remember each outcome on ``launched`` for :meth:`_append`, which then does not accept
        the token again. Only rows that :meth:`_process` would append are accepted: they emit, are live, and
        their request has a grammar (and is not prefill-only). Returns the ids of the requests whose matcher
        refused its token or failed.

        Nothing else of the step is processed here, so nothing else can change before :meth:`_process`: a row
        accepted here is still live there, unless its request was aborted meanwhile (then its token is dropped
        with the request). If the next step's launch fails after this, the step in flight is processed as
        usual, with these outcomes."""
        tokens = launched.tokens()  # waits for the step in flight (its forward pass was queued before this one's)
        rows = launched.batch.rows
        for i, (row, token) in enumerate(zip(rows, tokens)):
            req = row.req
            if (not row.emits or not row.is_live or req.grammar is None or i in launched.grammar_accepted
                    or req.prefill_only):
                continue
            try:
                launched.grammar_accepted[i] = req.grammar.accept(token)
            except Exception as e:  # noqa: BLE001 - the request fails when its token is processed, alone
                launched.grammar_accepted[i] = e
        return {id(rows[i].req) for i, ok in launched.grammar_accepted.items() if isinstance(ok, Exception) or not ok}

    def _jump_forward(self, req: Req) -> str:
        """If ``req``'s grammar now forces a continuation, append it without decode steps (chapter 12) and return
        its text.

        Only output tokens that the radix tree does not share yet may be retokenized (``tree_len``), and the
        request must have room for the forced tokens below ``max_new_tokens`` and its context window; requests
        that return log probabilities never jump (the forced tokens have none). The request's rows in flight
        become obsolete (its epoch changes) and its KV is kept up to where the old and new tokens agree, minus
        the last token, whose KV only a row in flight may be computing: the extend row recomputes from there."""
        assert req.grammar is not None and self.grammar is not None
        if req.return_logprob:
            return ""
        max_rollback = len(req.all_ids) - max(req.tree_len, len(req.input_ids))
        length_before = len(req.all_ids)
        jump = plan_jump(req.grammar, self.grammar.tokenizer, req.output_ids, max_rollback)
        if jump is None:
            return ""
        grown = len(jump.tokens) - jump.rollback
        room = req.params.max_new_tokens - len(req.output_ids)
        if req.context_len is not None:
            room = min(room, req.context_len - len(req.all_ids))
        if grown >= room:  # the request would end inside the forced text: let it decode to its limit instead
            req.grammar.rollback(len(jump.tokens))
            req.grammar.accepts(req.output_ids[len(req.output_ids) - jump.rollback :])
            return ""
        req.jumps += 1  # its rows in flight (this request's next decode row, under overlap) are obsolete
        req.num_inflight = 0
        req.kv_scheduled_len = min(req.kv_scheduled_len, length_before - max(jump.rollback, 1))
        delta = req.jump_forward(jump.rollback, jump.tokens, jump.text_ids)
        self.stats.jump_forwards += 1
        self.stats.jump_forward_tokens += grown
        if not req.finished:
            self.scheduler.extend_next(req)
        return delta

    # ----------------------------------------------------------------------------------------------- failures

    def _recover(self, failed: LaunchFailed) -> list[StepEvent]:
        """Undo a step whose launch failed (nothing is in flight any more) and decide who pays for it.

        Each row gets back the KV length it had before the step, so nothing this step may have half-written
        reaches the radix cache. Requests that fail the door check now (their data changed since admission, or
        a check was missing) are aborted with the reason; if none does, the step's failure cannot be pinned on
        anyone and all of its requests are aborted with the error. The others are retracted: back to the
        waiting queue with their tokens, to be prefilled again (from the cache) by a later step."""
        batch, sched = failed.batch, self.scheduler
        log.error("a step of %d requests failed: %s", len(batch.rows), failed, exc_info=failed.error)
        problems = {id(r): p for r in batch.reqs if (p := self.request_problem(r)) is not None}
        events = []
        for row in batch.rows:
            req = row.req
            if not row.is_live or req.req_pool_idx is None:
                continue  # finished or retracted meanwhile: its KV has been given back already
            req.kv_scheduled_len = row.prefix_len
            req.num_inflight -= row.emits
            if problems and id(req) not in problems:
                sched.retract(req)
                continue
            reason = problems.get(id(req)) or f"the engine step failed: {failed}"
            if sched.abort(req, f"this request could not be processed: {reason}"):
                self.cache.release(req)
            events.append(StepEvent(req, "", True))
        self.frees.processed(failed.step)  # nothing of the failed step is in flight
        return events

    def abort(self, req: Req, message: str = "aborted") -> None:
        """Stop a request wherever it is (the server calls this when a client disconnects).

        A step in flight may still write the request's KV, and the prompt tokens that step computes are already
        in the radix tree (committed at launch): released now, they would be unpinned and could be evicted and
        handed out while still being written. So the release waits until the steps in flight are processed."""
        if self.scheduler.abort(req, message):
            self.frees.later(lambda: self.cache.release(req))

    def abort_all(self, message: str) -> list[StepEvent]:
        """Last resort after a failure that :meth:`step` could not contain: abort every request and start
        afresh with empty queues. Nothing whose KV may be half-written enters the radix cache: each request
        gives back only the prefix it already shared with the tree."""
        held = self.scheduler.clear() + (self.inflight.batch.reqs if self.inflight else [])
        self.inflight = None
        reqs = list({id(r): r for r in held}.values())
        for req in reqs:
            req.abort(message)
            req.kv_scheduled_len = req.tree_len
        self.frees.drain()  # nothing is in flight any more: deferred frees and releases run now
        for req in reqs:
            self.cache.release(req)
        return [StepEvent(r, "", True) for r in reqs] + self._take_aborted()


def _maskable(req: Req, live: bool, refused: set[int]) -> bool:
    """Whether a constrained row's token can still be kept, so that its mask is worth filling: the row is live,
    its request's matcher did not refuse the token in flight (``refused``: request ids), and has not ended (a
    matcher that accepted its stop token has no next mask)."""
    return live and req.grammar is not None and id(req) not in refused and not req.grammar.is_terminated


def _rows(logprobs: StepLogprobs) -> Callable[[int, int], TokenLogprob]:
    """``entry(i, k)``: row ``i`` of a step's log probabilities with its ``k`` best alternatives, as plain Python
    (one ``tolist`` per tensor for the whole step, not one per row)."""
    chosen, values, ids = logprobs.chosen.tolist(), logprobs.top_values.tolist(), logprobs.top_ids.tolist()
    return lambda i, k: TokenLogprob(chosen[i], list(zip(ids[i][:k], values[i][:k])))
