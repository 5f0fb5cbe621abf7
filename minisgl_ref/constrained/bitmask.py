"""Banning the tokens a grammar forbids, on the logits' device, for the constrained rows only (chapter 12).

Each constrained row of a step gets one row of a packed bitmask (bit ``v`` of the row set: token ``v`` is
allowed), filled on the CPU by its request's matcher; the mask is then applied to that row's logits, turning every
forbidden logit into ``-inf`` before the sampler sees them. Penalties, temperature and top-k/p then work on the
allowed tokens only, and a greedy row takes the best *allowed* token.

* **Only constrained rows pay.** The host buffer has a row for every row a step can have, but only the
  constrained rows are filled and ``apply_token_bitmask_inplace`` gets their indices: a free row's logits are
  never read or written. A step with no constrained row does not get here at all.
* **Filled in parallel when it pays.** Each row's fill walks its matcher's pushdown automaton and checks the
  tokens its precomputed tables leave uncertain: about 0.01 ms inside an unbounded string, about 0.9 ms inside a
  string with a ``maxLength`` (on an H100 machine's host, ``docs/data/constrained_bench_h100_profile.txt``). Row
  after row, 64 bounded rows would take 60 ms, a dozen decode steps' worth; xgrammar's batch fill spreads the
  rows over a thread pool in native code: 14 ms for those 64 rows. But handing rows to the pool has a price of
  its own, ~0.3 ms a call on a 16-core host at a few dozen cheap rows, more than filling them on the calling
  thread. So the fill times itself: while a step's fills would take one thread less than twice that hand-off
  (``POOL_HANDOFF_US``), one thread fills them in turn; beyond, the pool takes them.
* **On the logits' device, without a wait.** xgrammar ships a CPU kernel and, for CUDA tensors, a Triton one.
  The bitmask is small (``vocab / 32`` int32 per row: 6 KB for a 49k vocabulary), so it is copied to the device
  rather than the logits to the host, asynchronously: the forward pass is still running, and the CPU must not
  wait for it. From ordinary (pageable) memory such a copy does not wait for the device, but the CPU first
  copies the bytes into CUDA's own staging memory, which costs it about 65 µs at 64 rows and 200 µs at 256 on
  an H100 machine's host (``docs/data/h2d_copy_h100.json``, with the GPU busy). From *pinned* memory the device
  fetches the bytes itself, in stream order, and the call costs 20-35 µs; but then the host buffer is read after
  the call has returned, so the next step must not refill it. Hence two pinned buffers, used in turn, each with
  an event recorded after its copy: a buffer is refilled only once its copy of two steps ago is done (it always
  is).
* **Padded vocabularies.** The matchers' tokenizer info was built with the model's vocabulary size (the logits'
  width), which may exceed the tokenizer's: xgrammar never allows the padding ids, so their bits are 0 and a
  constrained row can never sample one.
"""

from __future__ import annotations

import os
import time

import torch
import xgrammar as xgr

from minisgl_ref.constrained.matcher import GrammarState


#: Threads of the batch fill: half the machine's cores, at most 16 (the scheduler and the tokenizer need some).
FILL_THREADS = max(1, min(16, (os.cpu_count() or 2) // 2))
#: What handing a step's rows to xgrammar's thread pool costs, in microseconds (measured on a 16-core host). The
#: pool takes a step's fills when one thread would need more than twice this.
POOL_HANDOFF_US = 300.0


class TokenBitmask:
    """The host bitmask of one engine: ``max_rows`` rows of ``vocab_size`` bits; on a CUDA ``device``, two pinned
    buffers used in turn (see the module docstring)."""

    def __init__(self, vocab_size: int, max_rows: int, device: torch.device | None = None) -> None:
        self.vocab_size = vocab_size
        cuda = device is not None and device.type == "cuda"
        # int32 [max_rows, ceil(vocab / 32)] on the CPU, pinned when it is copied to a GPU
        self._buffers = [xgr.allocate_token_bitmask(max_rows, vocab_size) for _ in range(2 if cuda else 1)]
        if cuda:
            self._buffers = [b.pin_memory() for b in self._buffers]
        self._copied: list[torch.cuda.Event | None] = [None] * len(self._buffers)
        self._turn = 0
        self._batch = xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)
        self.us_per_row = 0.0  # the last step's fill time per row, on one thread (what decides the pool)

    @property
    def host(self) -> torch.Tensor:
        """The buffer this step fills."""
        return self._buffers[self._turn]

    def fill(self, rows: list[tuple[int, GrammarState]]) -> None:
        """Fill row ``i`` of the mask from ``state`` for every ``(i, state)`` of ``rows``: on this thread while
        the fills are cheap, on xgrammar's thread pool when one thread would need more than twice
        ``POOL_HANDOFF_US``. The estimate is the last step's cost per row on one thread; after a pooled step,
        its time less the hand-off, times the threads that shared it."""
        done = self._copied[self._turn]
        if done is not None:
            done.synchronize()  # this buffer's copy of two steps ago: long finished, the wait is for safety
        if not rows:
            return
        pool = len(rows) > 1 and FILL_THREADS > 1 and len(rows) * self.us_per_row > 2 * POOL_HANDOFF_US
        start = time.perf_counter()
        cornerable = [(i, state) for i, state in rows if state.can_be_cornered]
        if pool:
            for _, state in cornerable:
                state.at_dead_end = False
            self._batch.batch_fill_next_token_bitmask([state.xgr_matcher for _, state in rows], self.host,
                                                      [i for i, _ in rows])
        else:
            for i, state in rows:
                state.fill(self.host, i)
        elapsed_us = (time.perf_counter() - start) * 1e6
        if pool:
            elapsed_us = max(elapsed_us - POOL_HANDOFF_US, 0.0) * min(FILL_THREADS, len(rows))
        self.us_per_row = elapsed_us / len(rows)
        # A row that allows nothing is a grammar at a dead end (matcher.py). Only a request whose stop ids include
        # text tokens can get there, so the others pay nothing for the check.
        for i, state in cornerable:
            if not self.host[i].any():
                state.open_dead_end(self.host, i)

    def apply(self, logits: torch.Tensor, rows: list[int]) -> None:
        """Set to ``-inf``, in place, the logits of ``rows`` whose tokens their mask rows forbid."""
        if not rows:
            return
        mask = self.host[: logits.shape[0]]
        if logits.device.type != "cpu":
            mask = mask.to(logits.device, non_blocking=True)  # pinned: the device fetches it after the forward
            event = torch.cuda.Event()
            event.record()
            self._copied[self._turn] = event
            self._turn = (self._turn + 1) % len(self._buffers)
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[1], indices=rows)
