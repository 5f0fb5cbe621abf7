"""Banning the tokens a grammar forbids, on the logits' device, for the constrained rows only (chapter 12).

Each constrained row of a step gets one row of a packed bitmask (bit ``v`` of the row set: token ``v`` is
allowed), filled on the CPU by its request's matcher; the mask is then applied to that row's logits, turning every
forbidden logit into ``-inf`` before the sampler sees them. Penalties, temperature and top-k/p then work on the
allowed tokens only, and a greedy row takes the best *allowed* token.

* **Only constrained rows pay.** The host buffer has a row for every row a step can have, but only the
  constrained rows are filled and ``apply_token_bitmask_inplace`` gets their indices: a free row's logits are
  never read or written. A step with no constrained row does not get here at all.
* **Filled in parallel.** Each row's fill walks its matcher's pushdown automaton and checks the tokens its
  precomputed tables leave uncertain: about 0.01 ms inside an unbounded string, about 0.9 ms inside a string
  with a ``maxLength`` (on an H100 machine's host, ``docs/data/constrained_bench_h100_profile.txt``). Row after
  row, 64 bounded rows would take 60 ms, a dozen decode steps' worth; xgrammar's batch fill spreads the rows
  over a thread pool in native code (no GIL): 14 ms for those 64 rows, still more than the 5 ms forward pass it
  overlaps with, which is why bounded strings cost several times the free time per token (chapter 12).
* **On the logits' device, without a wait.** xgrammar ships a CPU kernel and, for CUDA tensors, a Triton one.
  The bitmask is small (``vocab / 32`` int32 per row: 6 KB for a 49k vocabulary), so it is copied to the device
  rather than the logits to the host. The copy must not make the CPU wait for the device: the mask is filled
  while the forward pass runs, and a copy that waited for it would put the whole forward pass on the CPU's
  critical path. A copy from ordinary (pageable) memory can wait: CUDA stages it through a bounded buffer of its
  own, and a mask of 64 rows (400 KB) does not fit it, so the call returns only when the device has reached the
  copy, after the forward pass. A copy from *pinned* memory is a DMA the device runs in stream order while the
  call returns at once; but then the host buffer is read after the call returns, so the next step must not
  refill it. Hence two pinned buffers, used in turn, each with an event recorded after its copy: a buffer is
  refilled only once its copy of two steps ago is done (it always is, by then).
* **Padded vocabularies.** The matchers' tokenizer info was built with the model's vocabulary size (the logits'
  width), which may exceed the tokenizer's: xgrammar never allows the padding ids, so their bits are 0 and a
  constrained row can never sample one.
"""

from __future__ import annotations

import os

import torch
import xgrammar as xgr

from minisgl_ref.constrained.matcher import GrammarState


#: Threads of the batch fill: half the machine's cores, at most 16 (the scheduler and the tokenizer need some).
FILL_THREADS = max(1, min(16, (os.cpu_count() or 2) // 2))


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

    @property
    def host(self) -> torch.Tensor:
        """The buffer this step fills."""
        return self._buffers[self._turn]

    def fill(self, rows: list[tuple[int, GrammarState]]) -> None:
        """Fill row ``i`` of the mask from ``state`` for every ``(i, state)`` of ``rows``: one row directly,
        several through xgrammar's threads."""
        done = self._copied[self._turn]
        if done is not None:
            done.synchronize()  # this buffer's copy of two steps ago: long finished, the wait is for safety
        if len(rows) == 1:
            i, state = rows[0]
            state.fill(self.host, i)
        elif rows:
            self._batch.batch_fill_next_token_bitmask([state.xgr_matcher for _, state in rows], self.host,
                                                      [i for i, _ in rows])

    def apply(self, logits: torch.Tensor, rows: list[int]) -> None:
        """Set to ``-inf``, in place, the logits of ``rows`` whose tokens their mask rows forbid."""
        if not rows:
            return
        mask = self.host[: logits.shape[0]]
        if logits.device.type != "cpu":
            mask = mask.to(logits.device, non_blocking=True)  # pinned: queued behind the forward pass, no wait
            event = torch.cuda.Event()
            event.record()
            self._copied[self._turn] = event
            self._turn = (self._turn + 1) % len(self._buffers)
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[1], indices=rows)
