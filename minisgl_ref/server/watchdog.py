"""Noticing a scheduler stuck inside one step (chapter 10).

A process that has died is easy to see: the launcher checks its children every 200 ms and ``/health`` turns 503
(``launch.py``). A scheduler that is alive but stuck -- a kernel that never returns, a collective waiting for a
rank that hangs, a step that loops -- is not: its process exists, the API server keeps accepting requests, and
every one of them waits for ever while ``/health`` says 200. A load balancer or a supervisor that probes
``/health`` then keeps sending traffic to a server that will never answer.

The scheduler's loop comes round at least every 200 ms when it is idle (it sleeps on its socket with that
timeout) and once per engine step when it is busy. So the time since the loop last came round is the time the
scheduler has spent inside its current step. :class:`LoopClock` keeps that moment in shared memory: the scheduler
writes it at the top of every turn (one store of a float, no lock, no system call), and the API server's process
reads it. Past ``--watchdog-timeout`` seconds:

* ``/health`` and ``/health_generate`` answer 503, saying for how long the scheduler has been inside one step;
  they turn 200 again by themselves if the step ends;
* the launcher logs it once (and logs the recovery);
* a thread in the scheduler logs where its main thread is (its Python stack) and what the engine holds, which is
  what one needs to find out why.

Requests are not refused meanwhile: a step that is merely slow (a huge prompt in one chunk on a CPU) finishes,
and the requests behind it go on. The stated time: ``/health`` turns 503 at most ``--watchdog-timeout`` + 0.2 s
after the step started (the launcher's check runs every 200 ms; ``/health`` itself reads the clock directly).
SGLang's flag of the same name ends the server; here the server stays up, so that the stack is logged and a
supervisor that probes ``/health`` decides what to do.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from multiprocessing.sharedctypes import RawArray
from typing import Any, Callable

from minisgl_ref.server.process_utils import ParentWatch

#: How often the scheduler's own watchdog thread looks at the clock.
CHECK_PERIOD_S = 0.5


class LoopClock:
    """When the scheduler's loop last came round, shared between processes: ``[turn start, turns]`` in a
    ``RawArray`` of two doubles, on ``time.monotonic()``'s clock (the same in every process of a machine). Made
    in the launcher and handed to the scheduler process, which pickles it as the shared memory it is."""

    def __init__(self, ctx: Any = None) -> None:
        self.cells = (ctx.RawArray if ctx is not None else RawArray)("d", 2)
        self.cells[0] = time.monotonic()

    def tick(self) -> None:
        self.cells[0] = time.monotonic()
        self.cells[1] += 1

    @property
    def turns(self) -> int:
        return int(self.cells[1])

    def inside_for(self, now: float | None = None) -> float:
        """Seconds since the loop last came round: how long the scheduler has been inside its current turn."""
        return (time.monotonic() if now is None else now) - self.cells[0]

    def stuck(self, timeout_s: float) -> str | None:
        """Why the scheduler counts as stuck (None while it is not)."""
        inside = self.inside_for()
        if timeout_s <= 0 or inside <= timeout_s:
            return None
        return (f"the scheduler has been inside one engine step for {inside:.1f} s, longer than the watchdog's "
                f"{timeout_s:g} s (--watchdog-timeout)")


class LoopWatch(ParentWatch):
    """The scheduler loop's ``self.watch``: ``alive()`` runs once at the top of every turn, so besides checking
    the parent it ticks the :class:`LoopClock`."""

    def __init__(self, clock: LoopClock | None) -> None:
        super().__init__()
        self.clock = clock
        if clock is not None:
            clock.tick()  # the loop is about to start: the time spent loading the model is no stuck step

    def alive(self) -> bool:
        if self.clock is not None:
            self.clock.tick()
        return super().alive()


def start_stuck_step_logger(clock: LoopClock, timeout_s: float, describe: Callable[[], str],
                            log: logging.Logger) -> threading.Thread | None:
    """In the scheduler process: a daemon thread that, once per stuck turn, logs how long the turn has lasted,
    ``describe()`` (what the engine holds) and the main thread's Python stack. A loop stuck in Python holds the
    interpreter only between bytecodes and a loop stuck in a kernel or a collective has released it, so the thread
    gets to run in both cases."""
    if timeout_s <= 0:
        return None
    main = threading.main_thread().ident

    def watch() -> None:
        reported = -1
        while True:
            time.sleep(CHECK_PERIOD_S)
            turn = clock.turns
            if turn == reported or clock.stuck(timeout_s) is None:
                continue
            reported = turn
            frame = sys._current_frames().get(main)  # noqa: SLF001 - the documented way to read another stack
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)\n"
            try:
                state = describe()
            except Exception as e:  # noqa: BLE001 - the engine is mid-step: its state may be half updated
                state = f"(could not describe the engine: {type(e).__name__}: {e})"
            log.error("%s; engine: %s; the scheduler's main thread is at:\n%s", clock.stuck(timeout_s), state,
                      stack.rstrip())

    thread = threading.Thread(target=watch, name="stuck-step-watchdog", daemon=True)
    thread.start()
    return thread
