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
3. KV slots freed while processing step N may still be written by step N+1: frees are released one step late.

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
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from minisgl_ref.attention.registry import create_attention_backend
from minisgl_ref.core.batch import ScheduledBatch
from minisgl_ref.core.config import EngineConfig
from minisgl_ref.core.request import Req, TokenLogprob
from minisgl_ref.distributed.group import min_over_ranks
from minisgl_ref.engine.model_runner import ModelRunner
from minisgl_ref.kvcache.allocator import PageAllocator
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

    def __init__(self, batch: ScheduledBatch, error: Exception) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.batch, self.error = batch, error


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
        context = context_length or model_config.max_position_embeddings
        self.req_to_token = ReqToTokenPool(self.config.max_running_requests + 1, context + 1, self.device)
        from minisgl_ref.layers.attention import AttentionLayer

        num_kv_heads = next(m for m in model.modules() if isinstance(m, AttentionLayer)).num_kv_heads
        self.kv_pool = KVPool(model_config.num_layers, num_pages * page, num_kv_heads, model_config.head_dim,
                              dtype, self.device)
        manager_cls = NaiveCacheManager if self.config.disable_radix_cache else CacheManager
        self.cache = manager_cls(self.allocator, self.req_to_token)
        self.scheduler = Scheduler(self.config, self.cache)
        num_q_heads = next(m for m in model.modules() if isinstance(m, AttentionLayer)).num_heads  # per rank
        backend = create_attention_backend(self.config, self.kv_pool, self.req_to_token, num_q_heads=num_q_heads,
                                           device=self.device)  # chapter 07: --attention-backend and defaults
        graph_max_bs = self.config.cuda_graph_max_bs or min(self.config.max_running_requests, 256)
        self.runner = ModelRunner(model, model_config.vocab_size, self.req_to_token, backend, self.device,
                                  use_cuda_graph=not self.config.disable_cuda_graph and self.device.type == "cuda",
                                  cuda_graph_max_bs=graph_max_bs)
        self.overlap = not self.config.disable_overlap_schedule
        self.inflight: ScheduledBatch | None = None
        self._waiting_for_inflight: list[torch.Tensor] = []
        self._release_after_inflight: list[Req] = []  # aborted while a step writing their KV was in flight
        self.stats = EngineStats()

    @property
    def max_total_tokens(self) -> int:
        return self.allocator.capacity_pages * self.allocator.page_size

    def request_problem(self, req: Req) -> str | None:
        """What makes ``req`` impossible to run on this model, or None (the door check)."""
        return req.token_id_problem(self.model_config.vocab_size)

    def add_request(self, req: Req) -> None:
        """Queue ``req``; raises ``ValueError`` (naming the field) if it cannot run on this model."""
        problem = self.request_problem(req)
        if problem is not None:
            raise ValueError(problem)
        if req.finished:
            return
        self.scheduler.add(req)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.inflight is not None or bool(self.scheduler.aborted)

    # ------------------------------------------------------------------------------------------------ steps

    def step(self) -> list[StepEvent]:
        """Advance the engine by one scheduled batch; return what happened to requests."""
        if not self.overlap:
            try:
                batch = self._schedule_and_launch()
            except LaunchFailed as failed:
                self._recover(failed)
                return self._drain_aborted()
            events = self._drain_aborted()
            if batch is not None:
                events += self._process(batch)
            return events

        # Overlap: launch the next batch first, then process the one in flight. Slots freed while a batch is in
        # flight wait until that batch has been processed (and so has certainly completed).
        self.cache.defer_frees = self.inflight is not None
        try:
            batch = self._schedule_and_launch()
        except NeedSync:
            # Memory is short and the scheduler wants to retract: let the step in flight finish first so that
            # everything it holds can be freed at once, then schedule again with nothing in flight.
            events = self._finish_inflight()
            batch = self._schedule_and_launch()
            self.inflight = batch
            return events + self._drain_aborted()
        except LaunchFailed as failed:
            events = self._finish_inflight()
            self._recover(failed)
            return events + self._drain_aborted()
        waits_for_inflight = self.cache.take_pending()
        events = self._drain_aborted()
        if self.inflight is not None:
            self.cache.defer_frees = batch is not None
            events += self._process(self.inflight)
            self._release_aborted()
        self._free(self._waiting_for_inflight + waits_for_inflight)
        self._waiting_for_inflight = self.cache.take_pending()  # these may still be touched by `batch`
        self.inflight = batch
        return events

    def _finish_inflight(self) -> list[StepEvent]:
        self.cache.defer_frees = False
        events = self._process(self.inflight) if self.inflight is not None else []
        self._release_aborted()
        self.inflight = None
        self._free(self._waiting_for_inflight + self.cache.take_pending())
        self._waiting_for_inflight = []
        return events

    def _free(self, pending: list[torch.Tensor]) -> None:
        for slots in pending:
            self.allocator.free_slots(slots)

    def _drain_aborted(self) -> list[StepEvent]:
        aborted, self.scheduler.aborted = self.scheduler.aborted, []
        return [StepEvent(r, "", True) for r in aborted]

    def _schedule_and_launch(self) -> ScheduledBatch | None:
        batch = self.scheduler.schedule()
        if batch is None:
            return None
        try:
            self.runner.run(batch)
        except Exception as e:  # noqa: BLE001 - one request's bad data must not end the engine
            raise LaunchFailed(batch, e) from e
        self._commit_launched(batch)
        self.stats.steps += 1
        self.stats.prefill_tokens += batch.num_prefill_tokens
        self.stats.decode_tokens += batch.num_tokens - batch.num_prefill_tokens
        return batch

    def _commit_launched(self, batch: ScheduledBatch) -> None:
        """Offer the prompt tokens that ``batch`` computes to the radix tree as soon as the step is launched.

        Waiting until the step is processed would, under overlap, be one step late: the next step is scheduled
        before this one is processed, and its requests would miss the prefix. Committing now is safe because
        every later step is launched after this one (on one CUDA stream, in order; on the CPU, synchronously),
        so any request that matches these slots reads them after this step has written them. The page-table
        rows may be repointed now too: this step's slots were already read by ``runner.run``. Duplicate copies
        (two rows of this step computing the same new prefix) are written by this step, so they are freed only
        once it has been processed."""
        for req, is_decode in zip(batch.reqs, batch.is_decode_row):
            if not is_decode:
                self.cache.commit(req, free=batch.free_when_done.append)

    # BEGIN TASK 6.1: process a step's results (one step late under overlap)
    def _process(self, batch: ScheduledBatch) -> list[StepEvent]:
        tokens = batch.tokens()  # the one wait for the device per step: after it, the step's tokens are here
        self._free(batch.free_when_done)
        if batch.prompt_logprobs is not None:
            self._record_prompt_logprobs(batch)
        logprobs = _rows(batch.logprobs) if batch.logprobs is not None else None
        events = []
        for i, (req, token, emits, epoch) in enumerate(zip(batch.reqs, tokens, batch.emits, batch.epochs)):
            if not emits or req.finished or req.retractions != epoch:
                # a partial prefill chunk (its KV was committed at launch), the extra token overlap computed
                # after the end, or a retracted request's old step
                continue
            req.num_inflight -= 1
            if logprobs is not None and req.return_logprob:
                req.output_logprobs.append(logprobs(i, req.top_logprobs_num))
            delta = self._append(req, token)
            if req.finished:
                self.scheduler.remove_finished(req)
            events.append(StepEvent(req, delta, req.finished))
        return events
    # END TASK 6.1

    def _record_prompt_logprobs(self, batch: ScheduledBatch) -> None:
        """Append the prompt log probabilities this step computed to their requests, in prompt order. A position
        already recorded (a retracted request computing its prompt again) is skipped."""
        plan, computed = batch.prompt_logprobs  # type: ignore[misc]
        entry = _rows(computed)
        j = 0
        for row, first, count in plan.spans:
            req = batch.reqs[row]
            live = not req.finished and req.retractions == batch.epochs[row]
            for pos in range(first, first + count):
                if live and pos == req.logprob_start_len + len(req.input_logprobs):
                    req.input_logprobs.append(entry(j, req.top_logprobs_num))
                j += 1

    def _append(self, req: Req, token: int) -> str:
        """``req.append_token``, with a failure (in its detokenizer, say) aborting this request only."""
        try:
            return req.append_token(token)
        except Exception as e:  # noqa: BLE001
            log.exception("request %s failed while appending its token", req.rid)
            req.abort(f"this request failed while processing its output: {type(e).__name__}: {e}")
            return ""

    def _recover(self, failed: LaunchFailed) -> None:
        """Undo a step whose launch failed (nothing is in flight any more) and decide who pays for it.

        Each row gets back the KV length it had before the step, so nothing this step may have half-written
        reaches the radix cache. Requests that fail the door check now (their data changed since admission, or
        a check was missing) are aborted with the reason; if none does, the step's failure cannot be pinned on
        anyone and all of its requests are aborted with the error. The others are retracted: back to the
        waiting queue with their tokens, to be prefilled again (from the cache) by a later step."""
        batch, sched = failed.batch, self.scheduler
        log.error("a step of %d requests failed: %s", len(batch.reqs), failed, exc_info=failed.error)
        problems = {id(r): p for r in batch.reqs if (p := self.request_problem(r)) is not None}
        for req, prefix_len, emits, epoch in zip(batch.reqs, batch.prefix_lens, batch.emits, batch.epochs):
            if req.finished or req.retractions != epoch or req.req_pool_idx is None:
                continue  # finished or retracted meanwhile: its KV has been given back already
            req.kv_committed_len = prefix_len
            req.num_inflight -= emits
            if req in sched.running:
                sched.running.remove(req)
            if sched.chunked is req:
                sched.chunked = None
            if problems and id(req) not in problems:
                sched.retract(req)
                continue
            reason = problems.get(id(req)) or f"the engine step failed: {failed}"
            req.abort(f"this request could not be processed: {reason}")
            sched.remove_finished(req)
            sched.aborted.append(req)  # reported by this step's events

    def run_until_done(self) -> None:
        while self.has_work:
            self.step()

    def flush_cache(self) -> bool:
        """Drop every cached prefix (the server's /flush_cache); refused (False) while requests run or wait."""
        return not self.has_work and self.cache.flush_cache()

    def abort(self, req: Req, message: str = "aborted") -> None:
        """Stop a request wherever it is (the server calls this when a client disconnects)."""
        sched = self.scheduler
        if self.inflight is not None and req in self.inflight.reqs:
            # The step in flight still writes this request's KV, and the prompt tokens it computes are already
            # in the radix tree (committed at launch). Released now, they would be unpinned and could be evicted
            # and handed out while still being written. So: out of the queues now, released once that step has
            # been processed (``_release_aborted``).
            if req in sched.running:
                sched.running.remove(req)
            if sched.chunked is req:
                sched.chunked = None
            sched.arrival.pop(req, None)
            self._release_after_inflight.append(req)
            req.abort(message)
            return
        # Nothing in flight writes its slots; any frees still wait for the step in flight, as all frees do.
        self.cache.defer_frees = self.inflight is not None
        if req in sched.waiting:
            sched.waiting.remove(req)
            if req.req_pool_idx is not None:
                self.cache.release(req)
            sched.arrival.pop(req, None)
        elif req in sched.running or sched.chunked is req:
            sched.remove_finished(req)
        if self.inflight is not None:
            self._waiting_for_inflight += self.cache.take_pending()
        req.abort(message)

    def abort_all(self, message: str) -> list[StepEvent]:
        """Last resort after a failure that :meth:`step` could not contain: abort every request and start
        afresh with empty queues. Nothing whose KV may be half-written enters the radix cache: each request
        gives back only the prefix it already shared with the tree."""
        sched = self.scheduler
        held = [*sched.running, *sched.waiting, *([sched.chunked] if sched.chunked else []),
                *(self.inflight.reqs if self.inflight else []), *self._release_after_inflight]
        self.inflight, self._release_after_inflight = None, []
        self.cache.defer_frees = False
        self._free(self._waiting_for_inflight + self.cache.take_pending())
        self._waiting_for_inflight = []
        reqs = list({id(r): r for r in held}.values())
        for req in reqs:
            req.abort(message)
            if req.req_pool_idx is not None:
                req.kv_committed_len = req.tree_len
                self.cache.release(req)
        sched.running.clear()
        sched.waiting.clear()
        sched.chunked = None
        sched.arrival.clear()
        return [StepEvent(r, "", True) for r in reqs] + self._drain_aborted()

    def _release_aborted(self) -> None:
        """Release the requests aborted while a step that writes their KV was in flight (it has been processed)."""
        for req in self._release_after_inflight:
            self.cache.release(req)
        self._release_after_inflight = []


def _rows(logprobs: StepLogprobs) -> Callable[[int, int], TokenLogprob]:
    """``entry(i, k)``: row ``i`` of a step's log probabilities with its ``k`` best alternatives, as plain Python
    (one ``tolist`` per tensor for the whole step, not one per row)."""
    chosen, values, ids = logprobs.chosen.tolist(), logprobs.top_values.tolist(), logprobs.top_ids.tolist()
    return lambda i, k: TokenLogprob(chosen[i], list(zip(ids[i][:k], values[i][:k])))
