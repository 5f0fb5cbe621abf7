"""A per-step record of what the engine ran and when its tokens came out (chapter 11, "where the latency tail
comes from").

An online client sees the engine only through the gaps between its tokens. A long gap can come from the engine
(a step that took long: a prefill of a long prompt, a step with many rows) or from the path the token travels
afterwards (the detokenizer, the API server, the client's own event loop). Tracing each step tells the two
apart: if the client's inter-token latency tail is as long as the longest steps, the engine is the cause, and
the record says which kind of step it was.

:class:`StepTrace` is an engine extension (:mod:`~minisgl_ref.engine.extension`): it writes one JSON object per
line, when the engine has processed a step (its tokens reached the host and were appended to their requests, which
is when a client's tokens leave the engine):

* ``t``: wall-clock time (``time.time()``), to line steps up with a client's own timestamps;
* ``gap_ms``: milliseconds since the previous step was processed -- the engine's share of the
  inter-token latency of every request that decoded in both steps (0 for the first step of a busy period:
  after the engine was idle there was no token to wait after);
* ``rows``, ``decode_rows``: rows of the step, and how many of them decode one token each;
* ``prefill_tokens``: prompt tokens the step computed (0 in a pure decode step).

``python -m minisgl_ref serve --step-log FILE`` and ``bench offline --step-log FILE`` attach it to the engine
(``engine.extensions.attach``); it costs one short write per step and is off by default.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import IO

from minisgl_ref.core.batch import ScheduledBatch
from minisgl_ref.engine.extension import EngineExtension
from minisgl_ref.engine.step import Launched, StepEvent

# A pause longer than this between two steps means the engine ran out of work in between: the next step starts
# a new busy period, and its gap says nothing about a request's inter-token latency.
IDLE_GAP_S = 1.0


class StepTrace(EngineExtension):
    """Appends one line per processed step to a file (see the module docstring for the fields)."""

    def __init__(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        # Line-buffered: a server is stopped by a signal, and a buffered tail would be lost (one write per step
        # is a few microseconds against steps of milliseconds).
        self._file: IO[str] = open(path, "a", buffering=1)  # noqa: SIM115 - kept open for the engine's life
        self._last: float | None = None

    def after_step(self, launched: Launched, events: list[StepEvent]) -> None:
        self.record(launched.batch, launched.after_idle)

    def record(self, batch: ScheduledBatch, idle_before: bool = False) -> None:
        """A step has just been processed. ``idle_before``: the engine had nothing in flight before this step
        was launched, so the time since the previous step was not spent waiting for this one."""
        now = time.perf_counter()
        gap = 0.0 if self._last is None or idle_before or now - self._last > IDLE_GAP_S else now - self._last
        self._last = now
        decode_rows = sum(1 for row in batch.rows if row.is_decode)
        line = {"t": round(time.time(), 6), "gap_ms": round(1e3 * gap, 3), "rows": len(batch.rows),
                "decode_rows": decode_rows, "prefill_tokens": batch.num_prefill_tokens}
        self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self._file.close()


def token_gaps(lines: list[dict]) -> list[tuple[float, int]]:
    """What a request that decodes through the trace sees: for each step with decode rows, the milliseconds since
    the previous step with decode rows (the steps in between, prefill-only ones, included) and the prompt tokens
    computed in that time (that step's own included). A busy period's first step starts afresh."""
    out: list[tuple[float, int]] = []
    gap, prefill, started = 0.0, 0, False
    for s in lines:
        if s["gap_ms"] == 0:  # a new busy period: nothing to measure from
            gap, prefill, started = 0.0, 0, False
        gap += s["gap_ms"]
        prefill += s["prefill_tokens"]
        if s["decode_rows"] > 0:
            if started:
                out.append((gap, prefill))
            gap, prefill, started = 0.0, 0, True
    return out


def summarize(lines: list[dict], since: float | None = None, until: float | None = None) -> dict[str, float]:
    """Percentiles of the decode-to-decode gaps of :func:`token_gaps` (optionally only for the steps between
    two wall-clock times), over all of them and split by whether prompt tokens were computed in the gap."""

    def pct(values: list[float], q: float) -> float:
        if not values:
            return float("nan")
        values = sorted(values)
        return values[min(len(values) - 1, int(q * len(values)))]

    window = [s for s in lines if (since is None or s["t"] >= since) and (until is None or s["t"] <= until)]
    gaps = token_gaps(window)
    all_ms = [g for g, _ in gaps]
    pure = [g for g, n in gaps if n == 0]
    mixed = [g for g, n in gaps if n > 0]
    return {"gaps": len(gaps), "gaps_with_prefill": len(mixed),
            "gap_p50_ms": pct(all_ms, 0.5), "gap_p99_ms": pct(all_ms, 0.99), "gap_max_ms": max(all_ms, default=float("nan")),
            "decode_only_p50_ms": pct(pure, 0.5), "decode_only_p99_ms": pct(pure, 0.99),
            "with_prefill_p50_ms": pct(mixed, 0.5), "with_prefill_max_ms": max(mixed, default=float("nan")),
            "prefill_tokens_in_gap_p50": pct([n for _, n in gaps if n], 0.5)}
