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

Later chapters plug into this loop through a declared seam (:mod:`~minisgl_ref.engine.extension`), never by
editing it: structured output (chapter 12) masks logits and checks tokens there, the step trace (chapter 11) records
each processed step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from minisgl_ref.attention.registry import create_attention_backend
from minisgl_ref.core.batch import ScheduledBatch
from minisgl_ref.core.config import EngineConfig
from minisgl_ref.core.request import Req, TokenLogprob
from minisgl_ref.distributed.group import min_over_ranks
from minisgl_ref.engine.attention_planner import AttentionSetup, PlannerFactory, default_planner
from minisgl_ref.engine.extension import EngineExtension, Extensions
from minisgl_ref.engine.graphs import GraphSettings
from minisgl_ref.engine.model_runner import ModelRunner
from minisgl_ref.engine.prompt_logprobs import PromptLogprobPlan
from minisgl_ref.engine.step import Launched, StepEvent
from minisgl_ref.kvcache.allocator import PageAllocator
from minisgl_ref.kvcache.inflight import InflightFrees
from minisgl_ref.kvcache.pool import kv_pool_class
from minisgl_ref.kvcache.req_to_token import ReqToTokenPool
from minisgl_ref.layers.attention import AttentionLayer
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
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0  # tokens whose KV was computed in extend rows (what prefix caching saves)
    decode_tokens: int = 0
    cached_tokens: int = 0

    def count(self, batch: ScheduledBatch) -> None:
        """A step of ``batch`` was launched."""
        self.steps += 1
        self.prefill_tokens += batch.num_prefill_tokens
        self.decode_tokens += batch.num_tokens - batch.num_prefill_tokens


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
    pool_cls = kv_pool_class(config.kv_cache_dtype)
    per_token = pool_cls.bytes_per_slot(model_config.num_layers, model_config.num_kv_heads, model_config.head_dim,
                                        dtype)
    tokens = int(budget // per_token)
    if tokens < config.page_size * 2:
        raise ValueError(
            f"mem_fraction_static={config.mem_fraction_static} leaves no room for the KV cache after the weights"
        )
    return tokens


class Engine:
    def __init__(self, model: nn.Module, model_config: ModelConfig, config: EngineConfig | None = None, *,
                 device: torch.device | str = "cpu", context_length: int | None = None,
                 extensions: Sequence[EngineExtension] = (), attention_planner: PlannerFactory | None = None) -> None:
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
        context = model_config.usable_context(context_length or None)
        self.req_to_token = ReqToTokenPool(self.config.max_running_requests + 1, context + 1, self.device)
        num_kv_heads = next(m for m in model.modules() if isinstance(m, AttentionLayer)).num_kv_heads
        pool_cls = kv_pool_class(self.config.kv_cache_dtype)  # chapter 15 may store it in FP8
        self.kv_pool = pool_cls(model_config.num_layers, num_pages * page, num_kv_heads, model_config.head_dim,
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
        # What later chapters plug in (structured output, the step trace): called at the seam's hooks only.
        self.extensions = Extensions(self, extensions)

    @property
    def max_total_tokens(self) -> int:
        return self.allocator.capacity_pages * self.allocator.page_size

    def request_problem(self, req: Req) -> str | None:
        """What makes ``req`` impossible to run on this model, or None (the door check, extensions' included)."""
        return req.token_id_problem(self.model_config.vocab_size) or self.extensions.check(req)

    def add_request(self, req: Req) -> None:
        """Queue ``req``; raises ``ValueError`` (naming the field) if it cannot run on this model."""
        problem = self.request_problem(req)
        if problem is not None:
            raise ValueError(problem)
        if req.finished:
            return
        self.extensions.admit(req)
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
        self.extensions.before_step()
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

        The point of overlap is that the host never leaves the device idle: the next step is scheduled and
        launched *before* the host waits for the tokens of the one in flight, and that wait
        (:meth:`_finish_inflight`) is the only one. What has to be decided, and why:

        * *Launching.* ``self._schedule_and_launch()`` returns a :class:`Launched`, None (nothing to run), or
          ``NEED_SYNC``: the scheduler would have to retract, and the memory a retraction frees is held by the
          step in flight until it completes. Only finishing that step first (keeping its events) lets a second
          attempt succeed. Launching tells ``self.frees``, so every free from then on waits for the new step.
        * *A launch that fails* (:class:`LaunchFailed`) must not lose the step in flight: its tokens are real.
          Finish it, then roll the failed step back with ``self._recover(failed)``.
        * *Otherwise* report the requests the scheduler gave up on (``self._take_aborted()``), then finish the
          step in flight, and keep the step just launched as ``self.inflight`` for the next call (None if
          nothing was launched).

        Return the events in the order they happened."""
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
        (stop rules included; a row that fed a guess appends what ``row_tokens`` says, chapter 13), finish the
        requests that are done, and return one event per emitting row.

        A row is skipped if it emits nothing (a partial prefill chunk, whose KV was committed at launch) or is no
        longer live: under overlap, the extra token computed for a request that finished in the step before, or
        the old row of a request retracted since it was scheduled (chapter 06). A prefill-only request
        (``Req.prefill_only``, chapter 10) ends at its emitting row, and its token is dropped too: the prompt's log
        probabilities, recorded first, are its answer. Under overlap the next step never holds a row of it (the
        scheduler gives decode rows only to requests below ``max_new_tokens``), and at any tensor-parallel rank
        the request is rebuilt with the same fields, so every rank ends it at the same step."""
        batch, out = launched.batch, launched.output
        tokens = launched.tokens()  # the one wait for the device per step: after it, the step's tokens are here
        self.extensions.watch_tokens()
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
            if logprobs is not None and req.logprobs is not None and row.guess is None:  # a guess's: row_tokens
                req.logprobs.output.append(logprobs(i, req.logprobs.top))
            delta = ""
            for appended in self.extensions.row_tokens(launched, i, token) if row.guess else (token,):
                delta += self._append(launched, i, appended)  # a row that fed a guess may append several
                if req.finished:
                    break  # a stop inside a run of accepted tokens: the rest is dropped
            if req.finished:
                self.scheduler.finish(req)
            events.append(StepEvent(req, delta, req.finished))
        self.extensions.after_step(launched, events)
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
            process = self.extensions.logits_processor(batch, self.inflight)  # chapter 12's masks, say
            output = self.runner.run(batch) if process is None else self.runner.run(batch, process)
        except Exception as e:  # noqa: BLE001 - one request's bad data must not end the engine
            raise LaunchFailed(batch, step, e) from e
        self._commit_launched(batch)
        self.stats.count(batch)
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
            if not row.is_decode and row.guess is None:  # a guess's KV enters the tree only once it is accepted
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

    def _append(self, launched: Launched, i: int, token: int) -> str:
        """Append row ``i``'s ``token`` to its request between the extensions' token hooks (which may refuse the
        token, or end or extend the output after it), and return the new text. A failure anywhere here (in the
        detokenizer, in a hook) aborts this request only."""
        req = launched.batch.rows[i].req
        try:
            refusal = self.extensions.before_token(launched, i, token)
            if refusal is not None:
                req.abort(refusal)
                return ""
            delta = req.append_token(token)
            if not req.finished:
                delta += self.extensions.after_token(launched, i, token)
            return delta
        except Exception as e:  # noqa: BLE001
            log.exception("request %s failed while appending its token", req.rid)
            req.abort(f"this request failed while processing its output: {type(e).__name__}: {e}")
            return ""

    # ----------------------------------------------------------------------------------------------- failures

    def _recover(self, failed: LaunchFailed) -> list[StepEvent]:
        """Undo a step whose launch failed (nothing is in flight any more) and decide who pays for it.

        Requests that fail the door check now (their data changed since admission, or a check was missing) are
        aborted with the reason; if none does, the step's failure cannot be pinned on anyone and all of its
        requests are aborted with the error. The scheduler rolls the step back and retracts the others
        (:meth:`Scheduler.roll_back`); returns the events of the aborted ones."""
        log.error("a step of %d requests failed: %s", len(failed.batch.rows), failed, exc_info=failed.error)
        problems = {r: p for r in failed.batch.reqs if (p := self.request_problem(r)) is not None}
        aborted = self.scheduler.roll_back(failed.batch, problems, f"the engine step failed: {failed}")
        self.frees.processed(failed.step)  # nothing of the failed step is in flight
        return [StepEvent(r, "", True) for r in aborted]

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


def _rows(logprobs: StepLogprobs) -> Callable[[int, int], TokenLogprob]:
    """``entry(i, k)``: row ``i`` of a step's log probabilities with its ``k`` best alternatives, as plain Python
    (one ``tolist`` per tensor for the whole step, not one per row)."""
    chosen, values, ids = logprobs.chosen.tolist(), logprobs.top_values.tolist(), logprobs.top_ids.tolist()
    return lambda i, k: TokenLogprob(chosen[i], list(zip(ids[i][:k], values[i][:k])))
