"""Continuous batching: deciding, every step, which requests run and how many tokens each (chapters 03, 05, 06).

The scheduler owns three groups of requests:

* ``waiting``: admitted to the engine but holding no KV yet (new, or retracted under memory pressure);
* ``chunked``: at most one request whose long prompt is being prefilled a chunk at a time (chapter 05);
* ``running``: prefilled requests that decode one token per step.

Each step it builds one :class:`ScheduledBatch`. Prefill has priority: if waiting requests fit (token budget,
request slots, KV memory), the step prefills them; with ``enable_mixed_chunk`` the running requests' decode
tokens ride along in the same step, otherwise they wait one step. Otherwise the step decodes every running
request, retracting the most recently admitted ones if the KV pool cannot hold one more token for each. With the
radix cache, a waiting request that would recompute a long prefix another request of the same step is computing
waits one step and then finds it cached (in-batch prefix caching, chapter 04).

The scheduler never touches the device except through the cache manager's page table: it is plain Python
bookkeeping, which is exactly the work that overlap scheduling (chapter 06) hides behind the GPU.
"""

from __future__ import annotations

import itertools
from collections import deque

from minisgl_ref.core.batch import ScheduledBatch
from minisgl_ref.core.config import EngineConfig
from minisgl_ref.core.request import Req
from minisgl_ref.kvcache.allocator import OutOfPages
from minisgl_ref.kvcache.radix import common_prefix_len
from minisgl_ref.scheduler.cache_manager import CacheManager


class NeedSync(Exception):
    """Raised by :meth:`Scheduler.schedule` when it would have to retract while a step is in flight (overlap):
    the engine then finishes that step first, so the retracted requests' KV can be freed immediately."""


class Scheduler:
    def __init__(self, config: EngineConfig, cache: CacheManager) -> None:
        self.config = config
        self.cache = cache
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.new_token_ratio = config.init_new_token_ratio
        self.arrival: dict[Req, int] = {}  # request -> its admission number (retraction picks the newest)
        self._arrivals = itertools.count()
        self.num_retractions = 0
        self.aborted: list[Req] = []  # requests the scheduler had to give up on, reported by the engine

    # ------------------------------------------------------------------------------------------------ queue

    def add(self, req: Req) -> None:
        capacity = self.cache.allocator.capacity_pages * self.cache.page_size
        if len(req.input_ids) + 1 > capacity:
            req.abort(f"the prompt needs {len(req.input_ids) + 1} KV slots but the whole pool holds {capacity}")
            self.aborted.append(req)
            return
        self.arrival[req] = next(self._arrivals)
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    def remove_finished(self, req: Req) -> None:
        """The request is done: give its KV back (into the radix tree where it can be shared)."""
        if req in self.running:
            self.running.remove(req)
        if self.chunked is req:
            self.chunked = None
        self.cache.release(req)
        self.arrival.pop(req, None)

    # --------------------------------------------------------------------------------------------- schedule

    def schedule(self) -> ScheduledBatch | None:
        # Requests that will certainly finish by length once their in-flight token lands need no further step.
        decodable = [r for r in self.running if len(r.output_ids) + r.num_inflight < r.params.max_new_tokens]
        batch = self._schedule_prefill()
        if batch is not None:
            if self.config.enable_mixed_chunk and decodable:
                self._add_decode_rows(batch, decodable, allow_retract=False)
            return batch
        if decodable:
            batch = ScheduledBatch([], [], [], [], [], [])
            self._add_decode_rows(batch, decodable, allow_retract=True)
            self.new_token_ratio = max(self.config.min_new_token_ratio,
                                       self.new_token_ratio - self.config.new_token_ratio_decay)
            return batch if batch.reqs else None
        return None

    def _future_tokens(self, req: Req) -> int:
        """The most KV slots ``req`` can still need for its output: its remaining ``max_new_tokens``, but never
        past the context window (a request with max_new_tokens=30000 on a 2k-token model needs at most 2k)."""
        left = req.params.max_new_tokens - len(req.output_ids) - req.num_inflight
        if req.context_len is not None:
            left = min(left, req.context_len - len(req.all_ids) - req.num_inflight)
        return max(left, 0)

    def _reserved_tokens(self) -> int:
        """KV that running requests will still need for their remaining output, discounted by the ratio."""
        return int(sum(self._future_tokens(r) * self.new_token_ratio for r in self.running))

    def _ordered_waiting(self) -> list[Req]:
        if self.config.schedule_policy == "fcfs" or not self.cache.shares_prefixes:
            return list(self.waiting)
        # lpm: requests with the longest cached prefix first, so shared prefixes are reused while still cached.
        tree = self.cache.tree
        lengths = {r: tree.match_prefix(r.all_ids[:-1], r.cache_salt).length for r in self.waiting}
        return sorted(self.waiting, key=lambda r: -lengths[r])

    # BEGIN TASK 4.5: in-batch prefix caching
    def _defer_for_in_batch_prefix(self, req: Req, computing: list[tuple[str | None, list[int]]]) -> bool:
        """Should ``req`` (just matched against the tree) wait one step because a request already admitted to
        this prefill step is computing a long stretch of ``req``'s own uncached prefix?

        ``computing`` holds, for each prefill row of the step so far, its cache salt and the tokens whose KV that request will have
        once the step has run. Right after launch those tokens enter the radix tree (``Engine._commit_launched``),
        so next step ``req`` finds them cached instead of computing a second copy. Short overlaps (below the
        threshold) are not worth a step of latency."""
        threshold = self.config.in_batch_prefix_threshold
        if threshold < 0 or not self.cache.shares_prefixes or not computing:
            return False
        tokens = req.all_ids[: req.reusable_prefix_len]
        overlap = max((common_prefix_len(tokens, other) for salt, other in computing if salt == req.cache_salt),
                      default=0)
        return overlap - req.kv_committed_len >= threshold
    # END TASK 4.5

    # BEGIN TASK 5.1: admission with token budgets and chunking
    def _schedule_prefill(self) -> ScheduledBatch | None:
        if self.chunked is None and not self.waiting:
            # Nothing to prefill (most decode steps). Returning before _reserved_tokens(), which walks every
            # running request, saves ~1 ms of host time per step at 256 running requests (chapter 08, G2).
            return None
        cfg = self.config
        budget = cfg.max_prefill_tokens
        chunking = cfg.chunked_prefill_size > 0
        batch = ScheduledBatch([], [], [], [], [], [])
        available = self.cache.available_tokens - self._reserved_tokens()
        # per prefill row: its cache salt and the tokens it will have computed after this step
        computing: list[tuple[str | None, list[int]]] = []

        candidates = ([self.chunked] if self.chunked else []) + self._ordered_waiting()
        for req in candidates:
            is_new = req is not self.chunked
            if is_new and len(self.running) + len(batch.reqs) + (self.chunked is not None) >= cfg.max_running_requests:
                break
            if is_new and self.cache.req_to_token.num_free == 0:
                break
            if is_new:
                self.cache.match(req)  # reuse a cached prefix; pins it
                if self._defer_for_in_batch_prefix(req, computing):
                    self.cache.release(req)  # unpin; it keeps its place in the queue and matches again next step
                    continue
            remaining = len(req.all_ids) - req.kv_committed_len
            if chunking:
                n = min(remaining, budget, cfg.chunked_prefill_size)
            elif remaining <= budget or not batch.reqs:
                n = remaining  # without chunking a prompt goes whole: alone in its step if it exceeds the budget
            else:
                if is_new:
                    self.cache.release(req)
                break
            # Admission reserves room for the request's future output (the bet of chapter 03). A request that
            # would run alone reserves only what the pool has left: if it outgrows the pool it is aborted then,
            # with a clear message, instead of never being admitted at all.
            alone = not batch.reqs and not self.running and self.chunked in (None, req)
            reserve = 0 if n < remaining else int(self._future_tokens(req) * self.new_token_ratio)
            needed = self.cache.allocator.pages_needed(req.kv_allocated_len, n) * self.cache.page_size
            if alone:
                reserve = min(reserve, max(available - needed, 0))
            if n <= 0 or needed + reserve > available:
                if is_new:
                    self.cache.release(req)  # give the pinned prefix back; try again next step
                break
            if is_new:
                self.waiting.remove(req)
                self.cache.tree.record_lookup(len(req.all_ids), req.kv_committed_len)
            try:
                self.cache.alloc(req, n)
            except OutOfPages:  # the estimate above was optimistic: put it back and stop admitting
                self.cache.release(req)
                self.waiting.appendleft(req)
                if self.chunked is req:
                    self.chunked = None
                break
            available -= needed + reserve
            budget -= n
            done = n == remaining
            self._add_row(batch, req, n, decode=False, emits=done)
            computing.append((req.cache_salt, req.all_ids[: req.kv_committed_len]))
            if done:
                if self.chunked is req:
                    self.chunked = None
                self.running.append(req)
            else:
                self.chunked = req  # a partial prefill: continue it first next step
                break
            if budget <= 0:
                break
        return batch if batch.reqs else None
    # END TASK 5.1

    def _add_row(self, batch: ScheduledBatch, req: Req, n: int, *, decode: bool, emits: bool) -> None:
        batch.reqs.append(req)
        batch.prefix_lens.append(req.kv_committed_len)
        batch.extend_lens.append(n)
        batch.is_decode_row.append(decode)
        batch.emits.append(emits)
        batch.epochs.append(req.retractions)
        req.kv_committed_len += n
        if emits:
            req.num_inflight += 1

    # BEGIN TASK 3.2: decode rows and retraction
    def _add_decode_rows(self, batch: ScheduledBatch, reqs: list[Req], *, allow_retract: bool) -> None:
        """One new token for each request; if the pool cannot hold them, retract the newest requests.

        A partially prefilled (chunked) request holds KV too and counts as the newest candidate: retracting it is
        cheaper than retracting a request that is already decoding, and without that a long prompt growing chunk
        by chunk could squeeze out the last running request. Only a request that has the whole pool to itself and
        still cannot grow is aborted."""
        reqs = [r for r in reqs if r not in batch.reqs]
        alloc = self.cache.allocator

        def pages_for(rs: list[Req]) -> int:
            return sum(alloc.pages_needed(r.kv_allocated_len, 1) for r in rs)

        while reqs and pages_for(reqs) * self.cache.page_size > self.cache.available_tokens:
            if not allow_retract:
                return  # mixed step: the decode rows simply wait for the next step
            if self.cache.defer_frees:
                raise NeedSync
            holders = reqs + ([self.chunked] if self.chunked is not None else [])
            if len(holders) == 1 and len(self.running) == 1:
                victim = reqs.pop()
                self.running.remove(victim)
                victim.abort("the KV cache pool is too small for this request's context")
                self.cache.release(victim)
                self.arrival.pop(victim, None)
                self.aborted.append(victim)
                return
            victim = max(holders, key=lambda r: self.arrival.get(r, 0))
            if victim is self.chunked:
                self.chunked = None
            else:
                reqs.remove(victim)
                self.running.remove(victim)
            self.retract(victim)
        self.cache.alloc_decode(reqs)
        # _add_row(batch, req, 1, decode=True, emits=True) for each request, a list at a time
        n = len(reqs)
        batch.reqs += reqs
        batch.prefix_lens += [r.kv_committed_len for r in reqs]
        batch.extend_lens += [1] * n
        batch.is_decode_row += [True] * n
        batch.emits += [True] * n
        batch.epochs += [r.retractions for r in reqs]
        for req in reqs:
            req.kv_committed_len += 1
            req.num_inflight += 1
    # END TASK 3.2

    def retract(self, req: Req) -> None:
        """Send a request that holds KV back to the waiting queue, keeping its tokens: it will be prefilled again
        (reusing whatever of its KV the radix cache still holds) and continue where it stopped. The caller has
        already taken it out of ``running`` (or ``chunked``)."""
        self.cache.release(req)
        req.retractions += 1
        req.num_inflight = 0
        self.num_retractions += 1
        self.waiting.appendleft(req)
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1)
