"""What the scheduler asks of KV memory, with and without prefix sharing (chapters 03-04).

A request's KV lives in the slots listed in its page-table row (:class:`ReqToTokenPool`). The first
``req.tree_len`` of them belong to the radix tree (shared, pinned while the request runs); the rest belong to the
request alone. Four calls make up a request's life:

* ``match(req)`` on admission (scheduler): reuse a cached prefix, if any;
* ``alloc(req, n)`` before a step (scheduler): slots for the next ``n`` tokens, evicting cached prefixes if needed;
* ``commit(req)`` once a prefill step is launched (engine): offer its tokens to the cache so others can share them;
* ``release(req)`` when the request finishes or is retracted (scheduler): cache what is reusable, free the rest.

Every slot it frees goes through ``frees``, an :class:`~minisgl_ref.kvcache.inflight.InflightFrees` that the
engine owns: with overlap scheduling (chapter 06) the step already running on the device may still write the slots
of a request the CPU has just seen finish, so they are given back only once that step has been processed.

This module lives with the scheduler, not in ``minisgl_ref.kvcache``: every call takes a request (its prompt,
its cache salt, how far it has been scheduled) and decides policy over memory (what to share, what to evict, when
to free). ``kvcache`` below it is memory alone (pages, the KV pool, page-table rows, the radix tree over token
ids) and knows nothing of requests, so it can be read and tested without the scheduler.
"""

from __future__ import annotations

import numpy as np
import torch

from minisgl_ref.core.request import Req
from minisgl_ref.kvcache.allocator import OutOfPages, PageAllocator
from minisgl_ref.kvcache.inflight import InflightFrees
from minisgl_ref.kvcache.radix import RadixCache
from minisgl_ref.kvcache.req_to_token import ReqToTokenPool


class CacheManager:
    """Prefix sharing through a radix tree (the default)."""

    shares_prefixes = True

    def __init__(self, allocator: PageAllocator, req_to_token: ReqToTokenPool,
                 frees: InflightFrees | None = None) -> None:
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.page_size = allocator.page_size
        self.tree = RadixCache(allocator)
        # The engine's: frees wait while a step that may write the slots is in flight. Alone (no engine launching
        # steps), a cache manager frees at once.
        self.frees = frees or InflightFrees(allocator)

    # ------------------------------------------------------------------------------------------------ memory

    @property
    def evictable_tokens(self) -> int:
        return self.tree.evictable_size

    @property
    def available_tokens(self) -> int:
        """Tokens that could be allocated right now: free pages plus what eviction could free."""
        return self.allocator.num_free_tokens + self.evictable_tokens

    def cached_prefix_len(self, req: Req) -> int:
        """How much of ``req`` the cache holds now, without touching the tree (the lpm policy sorts by it)."""
        return self.tree.peek_prefix_len(req.all_ids[:-1], req.cache_salt)

    def record_lookup(self, req: Req) -> None:
        """Count an admitted request's prompt against the hit rate (once, however often it was matched)."""
        self.tree.record_lookup(len(req.all_ids), req.kv_scheduled_len)

    # -------------------------------------------------------------------------------------------- life cycle

    def match(self, req: Req) -> int:
        """Give ``req`` a page-table row and reuse the longest cached prefix of its tokens. Returns its length.

        At least one token is always left to compute: the step needs the last token's logits."""
        req.req_pool_idx = self.req_to_token.alloc()
        result = self.tree.match_prefix(req.all_ids[: req.reusable_prefix_len], req.cache_salt)
        self.tree.inc_lock(result.node)
        self.req_to_token.write(req.req_pool_idx, 0, result.slots)
        req.last_node = result.node
        req.tree_len = req.kv_scheduled_len = req.kv_allocated_len = result.length
        # cached_tokens counts *prompt* tokens (OpenAI's usage.prompt_tokens_details): a retracted request that
        # re-matches its own output tokens must not report more cached tokens than its prompt has.
        req.cached_tokens = max(req.cached_tokens, min(result.length, len(req.input_ids)))
        return result.length

    def alloc(self, req: Req, n: int) -> torch.Tensor:
        """Slots for the request's next ``n`` tokens, written into its page-table row."""
        assert req.req_pool_idx is not None
        seq_len = req.kv_allocated_len
        needed_pages = self.allocator.pages_needed(seq_len, n)
        if needed_pages > self.allocator.num_free_pages:
            self.evict((needed_pages - self.allocator.num_free_pages) * self.page_size)
        # Only a partly filled last page needs its last slot; read from the host copy of the page table.
        last = int(self.req_to_token.host_np[req.req_pool_idx, seq_len - 1]) if seq_len % self.page_size else 0
        slots = self.allocator.alloc_tokens(seq_len, last, n)
        # Host copy only: these slots belong to tokens of the batch being scheduled, and the model runner writes
        # all of a step's new slots into the device table at once (one copy instead of one per request).
        self.req_to_token.write(req.req_pool_idx, seq_len, slots, device=False)
        req.kv_allocated_len = seq_len + n
        return slots

    def alloc_decode(self, reqs: list[Req]) -> None:
        """One slot each for the next token of ``reqs``, written into their page-table rows (host copy only).

        The same as ``alloc(req, 1)`` for each, done for the whole decode batch at once: this runs every step for
        every running request, and at a batch of 256 a Python call, a few tiny torch ops and a one-element tensor
        per request cost the host about a millisecond per step, as much as the GPU needs for a tenth of it
        (chapter 11). A request whose last page has room continues in it (slot after its last one); the others
        take the first slot of a fresh page."""
        if not reqs:
            return
        ps, host = self.page_size, self.req_to_token.host_np
        rows = np.fromiter((r.req_pool_idx for r in reqs), dtype=np.int64, count=len(reqs))
        lens = np.fromiter((r.kv_allocated_len for r in reqs), dtype=np.int64, count=len(reqs))
        if ps == 1:
            fresh = np.ones(len(reqs), dtype=bool)
        else:
            fresh = lens % ps == 0
        num_fresh = int(fresh.sum())
        if num_fresh > self.allocator.num_free_pages:
            self.evict((num_fresh - self.allocator.num_free_pages) * ps)
        slots = np.empty(len(reqs), dtype=np.int64)
        slots[fresh] = np.asarray(self.allocator.alloc_pages(num_fresh), dtype=np.int64) * ps
        if num_fresh < len(reqs):
            cont = ~fresh
            slots[cont] = host[rows[cont], lens[cont] - 1].astype(np.int64) + 1
        host[rows, lens] = slots
        for req in reqs:
            req.kv_allocated_len += 1

    def evict(self, num_tokens: int) -> None:
        freed = self.tree.evict(num_tokens)
        if freed < num_tokens and self.allocator.num_free_tokens < num_tokens:
            raise OutOfPages(f"needed {num_tokens} more KV slots; eviction found only {freed}")

    def commit(self, req: Req, *, upto: int | None = None) -> None:
        """Put the request's computed tokens (whole pages, the first ``upto`` at most) into the tree, so that other
        requests can share them, and make the request use the tree's copy of them.

        The engine calls it right after launching a prefill step (the KV exists once that step has run, before any
        later step reads it) and on release. What has to be decided, and why:

        * *How far.* The request's KV is computed (or being computed) for its first ``req.kv_scheduled_len``
          tokens, and the caller may ask for fewer (``upto``); the tree stores whole pages only. The first
          ``req.tree_len`` tokens of its page-table row point at the tree's slots already: if nothing lies
          beyond them, there is nothing to do.
        * *Who owns the slots.* ``self.tree.insert`` (with ``req.all_ids`` and the slots of the request's row,
          ``self.req_to_token.read``, under ``req.cache_salt``) may find that another request inserted some of
          these tokens first (two requests with a common *new* prefix in one batch): the tree keeps its own
          copy and says how many tokens it had. The request's own slots for those tokens are then duplicates
          that nobody will read again, except a step still in flight, which may be writing them; so they go
          back through ``self.frees.free``, which waits for such steps. Slots that were the tree's all along
          are not the request's to free.
        * *What the row must point at.* The tree's slots for every token stored (``self.tree.match_prefix``
          gives them, and the node where they end), written over the start of the row
          (``self.req_to_token.write``): the KV is identical, and the duplicates are about to be reused.
        * *What stays pinned.* The request now depends on the new node's path, not the old one's: it pins the
          new node and unpins ``req.last_node``, in an order that never leaves the shared path unpinned, and
          records the new ``req.last_node`` and ``req.tree_len``."""
        assert req.req_pool_idx is not None and req.last_node is not None
        # BEGIN TASK 4.4: share a request's computed prefix
        n = req.kv_scheduled_len if upto is None else min(upto, req.kv_scheduled_len)
        n -= n % self.page_size
        if n <= req.tree_len:
            return
        tokens = req.all_ids[:n]
        row = self.req_to_token.read(req.req_pool_idx, n)
        already = self.tree.insert(tokens, row, req.cache_salt)
        duplicates = row[req.tree_len : max(already, req.tree_len)]
        if len(duplicates):
            self.frees.free(duplicates)
        result = self.tree.match_prefix(tokens, req.cache_salt)
        assert result.length == n
        self.req_to_token.write(req.req_pool_idx, 0, result.slots)
        self.tree.inc_lock(result.node)
        self.tree.dec_lock(req.last_node)
        req.last_node, req.tree_len = result.node, n
        # END TASK 4.4

    def release(self, req: Req) -> None:
        """The request is done (or retracted): keep its computed prefix in the tree, free everything else."""
        if req.req_pool_idx is None:
            return
        # The tree takes what processed steps computed. Not the slot of a token that only the step in flight is
        # computing (under overlap, the extra row of a request that has just finished): once unpinned, tree
        # pages can be evicted and handed out at once, so they must hold no pending writes. That slot is freed
        # with the request's own slots below, which wait for the step in flight.
        self.commit(req, upto=len(req.all_ids) - 1)
        own = self.req_to_token.read(req.req_pool_idx, req.kv_allocated_len, start=req.tree_len)
        self.frees.free(own)
        assert req.last_node is not None
        self.tree.dec_lock(req.last_node)
        self._forget(req)

    def _forget(self, req: Req) -> None:
        assert req.req_pool_idx is not None
        self.req_to_token.free(req.req_pool_idx)
        req.req_pool_idx, req.last_node = None, None
        req.tree_len = req.kv_scheduled_len = req.kv_allocated_len = 0

    def flush_cache(self) -> bool:
        """Drop every cached prefix (the server's /flush_cache). Refused while requests pin some of it."""
        if self.tree.protected_size:
            return False
        self.tree.flush()
        return True

    @property
    def hit_rate(self) -> float:
        return self.tree.hit_rate


class NaiveCacheManager(CacheManager):
    """No sharing (``--disable-radix-cache``): every request computes and owns all of its KV."""

    shares_prefixes = False

    @property
    def evictable_tokens(self) -> int:
        return 0

    def match(self, req: Req) -> int:
        req.req_pool_idx = self.req_to_token.alloc()
        req.last_node = self.tree.root
        req.tree_len = req.kv_scheduled_len = req.kv_allocated_len = 0
        return 0

    def record_lookup(self, req: Req) -> None:
        pass

    def commit(self, req: Req, *, upto: int | None = None) -> None:
        pass

    def release(self, req: Req) -> None:
        if req.req_pool_idx is None:
            return
        self.frees.free(self.req_to_token.read(req.req_pool_idx, req.kv_allocated_len))
        self._forget(req)
