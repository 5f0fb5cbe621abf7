"""Continuous batching: deciding, every step, which requests run and how many tokens each (chapters 03, 05, 06).

The scheduler owns three groups of requests:

* ``waiting``: admitted to the engine but holding no KV yet (new, or retracted under memory pressure);
* ``chunked``: at most one request whose long prompt is being prefilled a chunk at a time (chapter 05);
* ``running``: prefilled requests that decode one token per step;
* ``extending``: running requests whose output grew by more than one token without a decode step (jump-forward
  decoding, chapter 12): they hold KV, and their next row is an extend row over the new tokens.

A running request may have its decode row widened into a row that also feeds a guess, tokens proposed for after
its last one, which the step checks (``Row.guess``: speculative decoding, chapter 13, sets the ``guesser``; by
default there is none and nothing changes). Such a row's request cannot be planned again until the step has been
processed, since only then is its length known: while one is in flight, :meth:`Scheduler.schedule` answers
``NEED_SYNC``.

A waiting request that is not ``ready`` (a test the engine hands over from its extensions: in chapter 12, a request
whose grammar is still compiling) keeps its place in the queue but is not admitted yet.

Each step it builds one :class:`ScheduledBatch`, a list of rows (one per request, all added by ``_add_row``).
Prefill has priority: waiting requests are admitted one at a time (``_admit``) while the step's
:class:`PrefillAdder` has token budget, request slots and KV memory left; with ``enable_mixed_chunk`` the running
requests' decode tokens ride along in the same step, otherwise they wait one step. Otherwise the step decodes
every running request, retracting the most recently admitted ones if the KV pool cannot hold one more token for
each. With the radix cache, a waiting request that would recompute a long prefix another request of the same step
is computing waits one step and then finds it cached (in-batch prefix caching, chapter 04).

The scheduler owns its queues: requests leave them only through ``finish``, ``abort``, ``retract`` and ``clear``.

The scheduler never touches the device except through the cache manager's page table: it is plain Python
bookkeeping, which is exactly the work that overlap scheduling (chapter 06) hides behind the GPU.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from minisgl_ref.core.batch import Guess, Row, ScheduledBatch
from minisgl_ref.core.config import EngineConfig
from minisgl_ref.core.request import Req
from minisgl_ref.kvcache.allocator import OutOfPages
from minisgl_ref.kvcache.radix import common_prefix_len
from minisgl_ref.scheduler.cache_manager import CacheManager


def prefix_key(req: Req, length: int) -> int | None:
    """A hash of ``req``'s cache salt and first ``length`` prompt tokens; None for a shorter prompt. Requests with
    the same key share at least ``length`` tokens of prefix (up to a hash collision, which only costs order)."""
    if len(req.input_ids) <= length:
        return None
    return hash((req.cache_salt, tuple(req.input_ids[:length])))


def group_by_prefix(reqs: list[Req], key: dict[Req, int | None], arrival: dict[Req, int]) -> list[Req]:
    """``reqs`` (waiting) in first-come order of *groups*: a request with a prefix key ranks as the earliest
    request of its group that the scheduler still holds (``arrival`` has every one, waiting or running); a request
    without one ranks as itself.

    Why (chapter 11): with plain first-come order, a queue of shuffled requests from 64 groups fills 256 decode
    slots with about four members of each group, so a decode step reads 64 shared prefixes and cascade attention
    saves a quarter of what it could. Admitted group by group, the same slots hold 16 whole groups, a step reads
    16 prefixes, and the members that follow the first find its prefix in the radix cache. A request is overtaken
    only by requests of a group whose oldest member still in the engine arrived before it: once that member has
    finished, the group loses its precedence, so a busy group cannot starve another."""
    first: dict[int, int] = {}
    for r, n in arrival.items():
        k = key.get(r)
        if k is not None and n < first.get(k, n + 1):
            first[k] = n

    def rank(r: Req) -> tuple[int, int]:
        k = key.get(r)
        return (arrival[r] if k is None else first[k], arrival[r])

    return sorted(reqs, key=rank)


class NeedSync:
    """What :meth:`Scheduler.schedule` returns when it would have to retract while a step is in flight
    (overlap): the retracted requests' KV could not be freed before that step completes, so the engine
    finishes the step first and asks again (chapter 06)."""


NEED_SYNC = NeedSync()


class Guesser(Protocol):
    """Who proposes guesses for running requests' rows (speculative decoding, chapter 13, plugs one in as
    ``Scheduler.guesser``). Asked while a step is scheduled, after its decode rows have their KV."""

    def active(self, running: list[Req]) -> bool:
        """Whether this step may carry guesses at all. While one is in flight the scheduler asks for that step to
        be processed first (``NEED_SYNC``): a guess follows a request's last token, which must be known."""
        ...

    def guesses(self, reqs: list[Req], room: list[int]) -> list[Guess | None]:
        """A guess (or None) for each of ``reqs``, whose tokens are all known on the host; ``room[i]`` is the most
        tokens ``reqs[i]``'s guess may hold (its output limit and context window leave no room for more)."""
        ...


@dataclass
class PrefillAdder:
    """What one prefill step still has room for while requests are admitted one by one (chapter 05)."""

    budget: int  # new tokens the step may still compute
    available: int  # KV slots still free for it, after the running requests' reservations
    rows: list[Row] = field(default_factory=list)
    # per prefill row: its cache salt and the tokens it will have computed after this step (chapter 04)
    computing: list[tuple[str | None, list[int]]] = field(default_factory=list)
    # requests held back this step to reuse a prefix computed in it (chapter 04): each keeps a slot for next step,
    # so that the group it belongs to is not pushed out by others (chapter 11)
    held: int = 0


class Scheduler:
    def __init__(self, config: EngineConfig, cache: CacheManager,
                 ready: Callable[[Req], bool] | None = None) -> None:
        self.config = config
        self.cache = cache
        # May this waiting request be admitted now? None: every one may (the engine sets it from its extensions).
        self.ready = ready
        # Who widens decode rows into rows that feed a guess (chapter 13); None: plain decode rows.
        self.guesser: Guesser | None = None
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.extending: list[Req] = []  # output grew by several tokens (a jump-forward): an extend row next
        self.new_token_ratio = config.init_new_token_ratio
        self.arrival: dict[Req, int] = {}  # request -> its admission number (retraction picks the newest)
        self._arrivals = itertools.count()
        self._prefix_key: dict[Req, int | None] = {}  # request -> its prompt's first tokens, hashed (grouping)
        self.num_retractions = 0
        self.aborted: list[Req] = []  # requests the scheduler had to give up on, reported by the engine

    # ------------------------------------------------------------------------------------------------ queues

    def add(self, req: Req) -> None:
        capacity = self.cache.allocator.capacity_pages * self.cache.page_size
        if len(req.input_ids) + 1 > capacity:
            req.abort(f"the prompt needs {len(req.input_ids) + 1} KV slots but the whole pool holds {capacity}")
            self.aborted.append(req)
            return
        self.arrival[req] = next(self._arrivals)
        self._prefix_key[req] = prefix_key(req, self.config.cascade_min_prefix_len)
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.extending)

    @property
    def num_running(self) -> int:
        """Requests that hold KV: decoding, or with a prompt part-way through chunked prefill."""
        return len(self.running) + (self.chunked is not None) + len(self.extending)

    def _dequeue(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
        elif self.chunked is req:
            self.chunked = None
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.extending:
            self.extending.remove(req)

    def finish(self, req: Req) -> None:
        """The request is done: give its KV back (into the radix tree where it can be shared)."""
        self._dequeue(req)
        self.arrival.pop(req, None)
        self._prefix_key.pop(req, None)
        self.cache.release(req)

    def abort(self, req: Req, message: str) -> bool:
        """Take ``req`` out of the queues, finished with ``message``. Returns whether it still holds KV, which
        the caller releases (at once, or once a step in flight that writes it has been processed)."""
        self._dequeue(req)
        self.arrival.pop(req, None)
        self._prefix_key.pop(req, None)
        req.abort(message)
        return req.req_pool_idx is not None

    def retract(self, req: Req) -> None:
        """Send a request that holds KV back to the waiting queue, keeping its tokens: it will be prefilled again
        (reusing whatever of its KV the radix cache still holds) and continue where it stopped."""
        self._dequeue(req)
        self.cache.release(req)
        req.epoch += 1  # its rows in flight are obsolete
        req.num_inflight = 0
        self.num_retractions += 1
        self.waiting.appendleft(req)
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1)

    def roll_back(self, batch: ScheduledBatch, problems: dict[Req, str], error: str) -> list[Req]:
        """Undo ``batch``, a step whose launch failed (the engine's recovery, chapters 06 and 10): the inverse of
        ``_add_row`` for each of its live rows. Each row's request gets back the KV length it had before the step
        (so nothing the step may have half-written reaches the radix cache) and no longer counts the step's token
        as in flight. A request named in ``problems`` is aborted with its problem; without any problem every
        request is aborted with ``error`` (nobody can be singled out); the others are retracted, to be prefilled
        again from the cache. Returns the aborted requests (their KV is released)."""
        aborted = []
        for row in batch.rows:
            req = row.req
            if not row.is_live or req.req_pool_idx is None:
                continue  # finished or retracted meanwhile: its KV has been given back already
            req.kv_scheduled_len = row.prefix_len
            req.num_inflight -= row.emits
            if problems and req not in problems:
                self.retract(req)
                continue
            if self.abort(req, f"this request could not be processed: {problems.get(req) or error}"):
                self.cache.release(req)
            aborted.append(req)
        return aborted

    def clear(self) -> list[Req]:
        """Empty every queue (the engine's last resort); returns the requests that were in them."""
        reqs = [*self.running, *self.waiting, *([self.chunked] if self.chunked else []), *self.extending]
        self.running, self.chunked, self.extending = [], None, []
        self.waiting.clear()
        self.arrival.clear()
        self._prefix_key.clear()
        return reqs

    def extend_next(self, req: Req) -> None:
        """A running request jumped forward (chapter 12): its new tokens need an extend row, not a decode row."""
        self.running.remove(req)
        self.extending.append(req)

    def take_aborted(self) -> list[Req]:
        aborted, self.aborted = self.aborted, []
        return aborted

    # --------------------------------------------------------------------------------------------- schedule

    def schedule(self) -> ScheduledBatch | NeedSync | None:
        if self.guesser is not None and self._settle_first(self.guesser):
            return NEED_SYNC
        # Requests that will certainly finish by length once their in-flight token lands need no further step.
        decodable = [r for r in self.running if len(r.output_ids) + r.num_inflight < r.params.max_new_tokens]
        rows = self._schedule_prefill()
        extend = self._extend_rows() if self.extending else []
        if rows or extend:
            # Jumped-forward requests' few tokens ride along with the decode rows (they would stall every other
            # request for a step otherwise); a real prefill step takes them only with mixed chunks, as before.
            if (self.config.enable_mixed_chunk or not rows) and decodable:
                self._add_decode_rows(rows, decodable, allow_retract=False)
                self._add_guesses(rows)
            return ScheduledBatch(extend + rows)
        if not decodable:
            return None
        if self._add_decode_rows(rows, decodable, allow_retract=True) is NEED_SYNC:
            return NEED_SYNC
        self._add_guesses(rows)
        self.new_token_ratio = max(self.config.min_new_token_ratio,
                                   self.new_token_ratio - self.config.new_token_ratio_decay)
        return ScheduledBatch(rows) if rows else None

    def _extend_rows(self) -> list[Row]:
        """An extend row for each request that jumped forward (chapter 12): it computes the KV of the tokens after
        ``kv_scheduled_len`` (the forced ones, and any of the old tail they replaced) and emits the next token.
        Slots the request already holds past that point are reused; only what lies beyond ``kv_allocated_len``
        is allocated. A request that does not fit waits for a later step; the request joins ``running`` again.
        The few forced tokens are not charged to the prefill budget."""
        rows: list[Row] = []
        for req in list(self.extending):
            n = len(req.all_ids) - req.kv_scheduled_len
            fresh = max(0, req.kv_scheduled_len + n - req.kv_allocated_len)
            if fresh:
                needed = self.cache.allocator.pages_needed(req.kv_allocated_len, fresh) * self.cache.page_size
                if needed > self.cache.available_tokens:
                    continue
                try:
                    self.cache.alloc(req, fresh)
                except OutOfPages:
                    continue
            self.extending.remove(req)
            self.running.append(req)
            self._add_row(rows, req, n, decode=False, emits=True)
        return rows

    def _settle_first(self, guesser: Guesser) -> bool:
        """Must the step in flight be processed before this one is planned (chapter 13)? Yes if it holds a row
        that fed a guess, whose request's length is unknown until then: such a request's scheduled KV runs past
        its known tokens (at any other time it never does, overlap or not). Yes too if this step may carry
        guesses: a guess needs its request's last token, which a row in flight is still computing. The cost is
        overlap itself (chapter 06): while speculation is on, the host schedules and processes with the device
        idle, as without overlap."""
        if not self.cache.frees.in_flight:
            return False
        return (any(r.kv_scheduled_len > len(r.input_ids) + len(r.output_ids) for r in self.running)
                or guesser.active(self.running))

    def _add_guesses(self, rows: list[Row]) -> None:
        """Widen decode rows into rows that also feed the guesser's guesses (chapter 13).

        Only a decode row whose request has no other token in flight qualifies (its last token is known on the
        host). A guess takes KV slots like extend tokens and counts against the step's token budget
        (``max_prefill_tokens``); one that does not fit is dropped and its request just decodes this step."""
        guesser = self.guesser
        if guesser is None or not guesser.active(self.running):
            return
        plain = [row for row in rows if row.is_decode and row.req.num_inflight == 1]
        if not plain:
            return
        budget = self.config.max_prefill_tokens - sum(row.extend_len for row in rows)
        room = [self._future_tokens(row.req) for row in plain]
        for row, limit, guess in zip(plain, room, guesser.guesses([row.req for row in plain], room)):
            n = len(guess.tokens) if guess is not None else 0
            if n == 0 or n > min(limit, budget):
                continue
            req = row.req
            if self.cache.allocator.pages_needed(req.kv_allocated_len, n) * self.cache.page_size \
                    > self.cache.available_tokens:
                continue
            try:
                self.cache.alloc(req, n)
            except OutOfPages:
                continue
            row.extend_len, row.is_decode, row.guess = 1 + n, False, guess
            req.kv_scheduled_len += n
            budget -= n

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
        ready = list(self.waiting) if self.ready is None else [r for r in self.waiting if self.ready(r)]
        if not self.cache.shares_prefixes:
            return ready
        if any(self._prefix_key.get(r) is not None for r in ready):
            ready = group_by_prefix(ready, self._prefix_key, self.arrival)
        if self.config.schedule_policy == "fcfs":
            return ready
        # lpm: requests with the longest cached prefix first, so shared prefixes are reused while still cached.
        lengths = {r: self.cache.cached_prefix_len(r) for r in ready}
        return sorted(ready, key=lambda r: -lengths[r])  # stable: groups stay together

    def _add_row(self, rows: list[Row], req: Req, n: int, *, decode: bool, emits: bool) -> None:
        rows.append(Row(req, req.kv_scheduled_len, n, decode, emits, req.epoch))
        req.kv_scheduled_len += n
        if emits:
            req.num_inflight += 1

    def _defer_for_in_batch_prefix(self, req: Req, computing: list[tuple[str | None, list[int]]]) -> bool:
        """Should ``req`` (just matched against the tree) wait one step because a request already admitted to
        this prefill step is computing a long stretch of ``req``'s own uncached prefix?

        ``computing`` holds, for each prefill row of the step so far, its cache salt and the tokens whose KV that
        request will have once the step has run. Right after launch those tokens enter the radix tree
        (``Engine._commit_launched``), so next step ``req`` finds them cached instead of computing a second
        copy. Short overlaps (below the threshold) are not worth a step of latency.

        What to compute: the longest common prefix (``common_prefix_len``) of the part of ``req`` that the cache
        could ever give it (``req.all_ids[: req.reusable_prefix_len]``) with the tokens of any row of the same
        cache salt (other salts never share). Of that overlap, the first ``req.kv_scheduled_len`` tokens are
        cached for ``req`` already (its match): only the rest would be computed twice. Defer (return True) when
        that rest is at least ``self.config.in_batch_prefix_threshold`` tokens."""
        threshold = self.config.in_batch_prefix_threshold
        if threshold < 0 or not self.cache.shares_prefixes or not computing:
            return False  # the check is off, there is no cache to wait for, or no one else in this step yet
        # BEGIN TASK 4.5: in-batch prefix caching
        tokens = req.all_ids[: req.reusable_prefix_len]
        overlap = max((common_prefix_len(tokens, other) for salt, other in computing if salt == req.cache_salt),
                      default=0)
        return overlap - req.kv_scheduled_len >= threshold
        # END TASK 4.5

    def _has_room_for_new(self, adder: PrefillAdder) -> bool:
        """A request slot and a page-table row for one more request (besides those kept for held-back ones).

        The requests admitted earlier in this step are counted once, by ``num_running``: each joins ``running``
        (or becomes ``chunked``) as its row is added. Counting ``adder.rows`` as well would count them twice, and
        a burst of requests would then be admitted in halves, step after step (128, 64, 32, ... of 256)."""
        return (self.num_running + adder.held < self.config.max_running_requests
                and self.cache.req_to_token.num_free > adder.held)

    def _schedule_prefill(self) -> list[Row]:
        """The prefill rows of this step: the chunked request first, then waiting requests while they fit."""
        if self.chunked is None and not self.waiting:
            # Nothing to prefill (most decode steps). Returning before _reserved_tokens(), which walks every
            # running request, saves ~1 ms of host time per step at 256 running requests (chapter 08, G2).
            return []
        adder = PrefillAdder(self.config.max_prefill_tokens, self.cache.available_tokens - self._reserved_tokens())
        for req in ([self.chunked] if self.chunked else []) + self._ordered_waiting():
            if req is not self.chunked:
                if not self._has_room_for_new(adder):
                    break
                self.cache.match(req)  # reuse a cached prefix; pins it
                # Only a cache that shares prefixes can make a request worth holding back (chapter 04).
                if self.cache.shares_prefixes and adder.computing \
                        and self._defer_for_in_batch_prefix(req, adder.computing):
                    self.cache.release(req)  # unpin; it keeps its place in the queue and matches again next step
                    adder.held += 1
                    continue
            row = self._admit(req, adder)
            if row is None or not row.emits or adder.budget <= 0:
                break  # out of room, or a partial chunk (it goes on first next step), or out of budget
        return adder.rows

    def _admit(self, req: Req, adder: PrefillAdder) -> Row | None:
        """Add ``req``'s next prefill row to the step if budget and memory allow; None (and the request left where
        it was, unpinned) if not.

        With chunked prefill (``chunked_prefill_size > 0``, chapter 05) the row may be a chunk of the prompt:
        :meth:`_admit_chunk`. Without it the rest of the request goes whole, in one row: alone in a step of its
        own if it exceeds the step's token budget (as in SGLang), never cut behind the user's back. Its memory
        is chapter 03's bet: the request must leave room, beside its own tokens, for the output it may still
        produce (discounted by ``new_token_ratio``), since that room is what keeps the running requests from
        being retracted; only a request that would hold the pool alone may start with less (it is aborted later,
        with a clear message, if it really outgrows the pool), or it would never start at all."""
        if self.config.chunked_prefill_size > 0:
            return self._admit_chunk(req, adder)
        n = len(req.all_ids) - req.kv_scheduled_len
        if n > adder.budget and adder.rows:
            return self._not_admitted(req)
        room = adder.available - self.cache.allocator.pages_needed(req.kv_allocated_len, n) * self.cache.page_size
        promised = int(self._future_tokens(req) * self.new_token_ratio)
        if room < 0 or (promised > room and not self._alone(req, adder)):
            return self._not_admitted(req)
        row = self._add_prefill_row(req, adder, n)
        if row is not None:
            adder.budget -= n
            adder.available = max(room - promised, 0)  # a lone request may have been promised more than is left
        return row

    def _admit_chunk(self, req: Req, adder: PrefillAdder) -> Row | None:
        """With chunked prefill: add ``req``'s next chunk to the step if the step's token budget and the KV memory
        allow, and return its row; return None if not.

        ``req`` is either ``self.chunked`` (the request part-way through its prefill: it always comes first) or a
        waiting request that ``cache.match`` has just given a page-table row and its cached prefix. The KV of its
        first ``req.kv_scheduled_len`` tokens exists (or is being computed); the KV of every later token of the
        request is what prefilling it must compute. ``adder`` is what the step still has room for:
        ``adder.budget`` new tokens and ``adder.available`` KV slots (free and evictable slots, minus what the
        running requests have reserved and what earlier rows of this step took).

        What has to be decided, and why:

        * *How much of the request this step computes.* A step runs at most ``max_prefill_tokens`` new tokens
          (its budget, which bounds how long the decoding requests wait for it) and a request at most
          ``config.chunked_prefill_size`` per step (so that one long prompt is spread over several steps and
          cannot hold everyone else up). Think about which tokens still need KV: a request retracted while
          decoding (chapter 03) comes back holding none, with output tokens as well as its prompt.
        * *What memory the row takes.* Its tokens' fresh pages (``allocator.pages_needed``), and, once the row
          finishes the prefill and the request starts decoding, room for the output it may still produce: the
          bet of chapter 03, ``self._future_tokens(req)`` discounted by ``self.new_token_ratio``. A chunk that
          leaves part of the prompt for later produces no token yet.
        * *Who may start with less than that room.* A reserve is a promise to the requests already holding KV;
          only a request that would hold the pool alone (``self._alone``) has no one to break it to. If it could
          not start with part of its reserve, a request whose reserve exceeds the whole pool would never run
          (it is aborted later, with a clear message, if it really outgrows the pool).
        * *Admitted or not.* A request that does not fit is left as it was, by ``self._not_admitted(req)``.
          One that fits gets its row from ``self._add_prefill_row(req, adder, n)`` (None if the allocation
          failed after all), and what the row took is charged to ``adder``, so that the step's later rows see
          what is left."""
        # BEGIN TASK 5.1: admission with token budgets and chunking
        remaining = len(req.all_ids) - req.kv_scheduled_len
        n = min(remaining, adder.budget, self.config.chunked_prefill_size)
        reserve = 0 if n < remaining else int(self._future_tokens(req) * self.new_token_ratio)
        needed = self.cache.allocator.pages_needed(req.kv_allocated_len, n) * self.cache.page_size
        if self._alone(req, adder):
            reserve = min(reserve, max(adder.available - needed, 0))
        if n <= 0 or needed + reserve > adder.available:
            return self._not_admitted(req)
        row = self._add_prefill_row(req, adder, n)
        if row is not None:
            adder.budget -= n
            adder.available -= needed + reserve
        return row
        # END TASK 5.1

    def _alone(self, req: Req, adder: PrefillAdder) -> bool:
        """Would ``req`` be the only request of the step and the only one holding KV?"""
        return not adder.rows and not self.running and self.chunked in (None, req)

    def _not_admitted(self, req: Req) -> None:
        """``req`` does not fit this step: a new request gives its pinned prefix back (and tries again next
        step); the chunked request keeps its KV and its place."""
        if req is not self.chunked:
            self.cache.release(req)
        return None

    def _add_prefill_row(self, req: Req, adder: PrefillAdder, n: int) -> Row | None:
        """Allocate slots for ``req``'s next ``n`` tokens and add its prefill row to ``adder.rows``. A row that
        completes the prompt emits the first (or next) token and the request joins ``running``; a partial chunk
        emits nothing and the request becomes ``self.chunked``. Returns the row, or None if the allocation
        failed (the admission estimate was optimistic about eviction): the request then goes back to the front
        of the queue, holding nothing. The caller charges the step's budgets."""
        done = n == len(req.all_ids) - req.kv_scheduled_len
        try:
            self.cache.alloc(req, n)
        except OutOfPages:
            self._dequeue(req)
            self.cache.release(req)
            self.waiting.appendleft(req)
            return None
        if req is not self.chunked:
            self.waiting.remove(req)
            self.cache.record_lookup(req)
        self._add_row(adder.rows, req, n, decode=False, emits=done)
        adder.computing.append((req.cache_salt, req.all_ids[: req.kv_scheduled_len]))
        if done:
            self.chunked = None
            self.running.append(req)
        else:
            self.chunked = req  # a partial prefill: continue it first next step
        return adder.rows[-1]

    def _add_decode_rows(self, rows: list[Row], reqs: list[Req], *, allow_retract: bool) -> NeedSync | None:
        """Add one decode row (one new token) for each request of ``reqs`` to ``rows``; if the pool cannot hold
        one more token for each of them, retract the newest requests until it can.

        ``reqs`` are running requests in admission order; ``rows`` may already hold this step's prefill rows
        (a mixed step, chapter 05), and a request already there gets no second row (filtered out above).

        What has to be decided, and why:

        * *Room.* A token needs a slot, and slots come a page at a time: a request whose last page still has a
          free slot needs no new page (``allocator.pages_needed`` knows), the others a whole page each. What
          the step may take is ``self.cache.available_tokens`` (free slots, and cached ones it may evict).
        * *When it does not fit.* A mixed step never retracts (``allow_retract=False``): its decode rows just
          wait for the next step, and none is added. While a step is still in flight
          (``self.cache.frees.in_flight``, overlap scheduling, chapter 06) retracting could free nothing before
          that step completes: answer ``NEED_SYNC`` and change nothing (the engine finishes that step and asks
          again). Otherwise someone must give way, and the cheapest to send back is the request that has had
          the least time to grow: the newest holder of KV by admission number (``self.arrival``), which may be
          the partially prefilled ``self.chunked``. ``self.retract`` sends it back to the front of the queue
          with its tokens; then look at the room again.
        * *When giving way cannot help.* A request that is the only one holding KV and the only one running
          would, once retracted, come back to the same pool and fail again, forever. It is aborted instead
          (``self.abort``, with a message saying that the KV cache pool is too small for its context), its KV
          released, and it goes to ``self.aborted`` for the engine to report; no rows are added.
        * *The rows.* One slot each from ``self.cache.alloc_decode(reqs)``, then one row per request, in order,
          by ``self._add_row(rows, req, 1, decode=True, emits=True)`` (it records where the row starts and
          moves the request on). Return None."""
        in_batch = {id(row.req) for row in rows}
        reqs = [r for r in reqs if id(r) not in in_batch]
        # BEGIN TASK 3.2: decode rows and retraction
        alloc = self.cache.allocator
        while reqs and sum(alloc.pages_needed(r.kv_allocated_len, 1) for r in reqs) * alloc.page_size \
                > self.cache.available_tokens:
            if not allow_retract:
                return None  # mixed step: the decode rows simply wait for the next step
            if self.cache.frees.in_flight:
                return NEED_SYNC
            holders = reqs + ([self.chunked] if self.chunked is not None else [])
            victim = max(holders, key=lambda r: self.arrival.get(r, 0))
            if victim is not self.chunked:
                reqs.remove(victim)
            if len(holders) == 1 and len(self.running) == 1:
                self.abort(victim, "the KV cache pool is too small for this request's context")
                self.cache.release(victim)
                self.aborted.append(victim)
                return None
            self.retract(victim)
        self.cache.alloc_decode(reqs)
        for req in reqs:
            self._add_row(rows, req, 1, decode=True, emits=True)
        return None
        # END TASK 3.2
