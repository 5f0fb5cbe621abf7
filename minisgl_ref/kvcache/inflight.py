"""Giving KV memory back only once no step in flight can still write it (chapter 06).

With overlap scheduling the CPU processes step N while step N+1 already runs on the device. When processing N
finishes a request, step N+1 may still be writing that request's KV (the one extra token overlap computes after
the end). If its slots went straight back to the allocator, the next step could hand them to another request
while they are being written. So every free goes through one object, :class:`InflightFrees`:

* ``free(slots)`` gives slots back now when no step is in flight, and otherwise parks them, tagged with the
  newest launched step;
* ``later(fn)`` does the same for any other deferred act (the engine releases a request aborted mid-step this way);
* the overlapped engine calls ``launch()`` before it runs a step and ``processed(step)`` once it has processed
  one: that step has certainly completed, so everything parked while it was the newest step in flight is
  released.

Steps are numbered in launch order, and a step is processed only after every earlier one, so one counter for
each side is all the state there is. Without overlap the engine does not count its steps here at all: each one
is processed before anything is allocated again, so nothing is ever in flight and every free is immediate.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minisgl_ref.kvcache.allocator import PageAllocator


class InflightFrees:
    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self.launched = 0  # the number of the newest launched step (steps count from 1)
        self.processed_through = 0  # every step up to this one has been processed
        # (the newest step in flight when parked, slots to free or another deferred act), in parking order
        self._parked: list[tuple[int, torch.Tensor | Callable[[], None]]] = []

    @property
    def in_flight(self) -> bool:
        """Is a launched step still unprocessed (so that a slot freed now might still be written)?"""
        return self.launched > self.processed_through

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    @property
    def parked_slots(self) -> list[torch.Tensor]:
        """The slots waiting for a step in flight (what chapter 06 compares with the slots that step writes)."""
        return [what for _, what in self._parked if isinstance(what, torch.Tensor)]

    def free(self, slots: torch.Tensor) -> None:
        """The cache manager's way to give slots back: now, or once the steps in flight have been processed.

        With a step in flight, park a copy of ``slots`` (the caller may reuse its tensor) in ``self._parked``,
        tagged with the number of the newest launched step (``self.launched``): :meth:`processed` gives them to
        the allocator once that step has been processed, not before."""
        if not len(slots):
            return
        if not self.in_flight:
            self.allocator.free_slots(slots)  # nothing in flight (always so without overlap): nobody can write them
            return
        # BEGIN TASK 6.1: the overlapped step and its deferred frees
        self._parked.append((self.launched, slots.clone()))
        # END TASK 6.1

    def later(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once every step launched so far has been processed (at once if none is in flight).

        With a step in flight, park ``fn`` in ``self._parked`` like :meth:`free` parks slots, tagged with the
        newest launched step; :meth:`processed` calls it."""
        if not self.in_flight:
            fn()
            return
        # BEGIN TASK 6.1: the overlapped step and its deferred frees
        self._parked.append((self.launched, fn))
        # END TASK 6.1

    def launch(self) -> int:
        """A step is about to run on the device; returns its number."""
        self.launched += 1
        return self.launched

    def processed(self, step: int) -> None:
        """Step ``step`` (and so every earlier one) has been processed: release what only it kept parked.

        Every entry of ``self._parked`` tagged with a step up to ``self.processed_through`` is released, in
        parking order: slots go to ``allocator.free_slots``, a deferred act is called. Entries tagged with a
        later step (still in flight) stay parked, in order. Take the released entries out of ``self._parked``
        *before* running them: a deferred release that runs here frees slots of its own through :meth:`free`,
        and if a later step is still in flight those are parked anew, under that step, and must not be lost."""
        self.processed_through = max(self.processed_through, step)
        if not self._parked:
            return  # nothing waits (always so without overlap)
        # BEGIN TASK 6.1: the overlapped step and its deferred frees
        ready = [what for s, what in self._parked if s <= self.processed_through]
        self._parked = [(s, what) for s, what in self._parked if s > self.processed_through]
        for what in ready:  # a deferred release run here parks its own frees if a later step is in flight
            if isinstance(what, torch.Tensor):
                self.allocator.free_slots(what)
            else:
                what()
        # END TASK 6.1

    def drain(self) -> None:
        """Nothing is in flight any more (the engine finished or gave up every launched step): release all."""
        self.processed(self.launched)
