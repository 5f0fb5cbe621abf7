"""Where the first tenth of a second of a timed canonical run goes, host and GPU side by side (chapter 11).

``bench offline`` times one ``llm.generate`` call, from the moment it receives the 256 prompts. Before the first
prefill step can start, the host builds 256 requests; before each step's kernels run, it schedules and prepares
the step; and the first step has no earlier one to hide behind. This script runs the bench's warm-up workload in a
fresh engine, then the canonical workload twice through ``llm.generate`` as the bench does (the radix cache
emptied before each), and records a timeline of each run's first steps: the host's intervals (building the
requests, admitting them, scheduling, preparing, launching, sampling, waiting for tokens, processing) and, from
CUDA events around every launch, when each step's GPU work started and ended, on one clock. A third run under
``cProfile`` (the prefill phase only: queueing and prefill steps) names the host functions that cost most.
Writes JSON and prints the timelines:

    python3 scripts/gpu/measure/run_start.py --out results
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from first_prefill import warmed_engine  # noqa: E402 - this folder, put on sys.path above
from prefill_anatomy import prefill_phase  # noqa: E402

from minisgl_ref.bench.provenance import collect_provenance  # noqa: E402
from minisgl_ref.bench.workloads import canonical_workload  # noqa: E402
from minisgl_ref.engine import model_runner  # noqa: E402

STEPS = 40  # steps of a run whose host intervals and GPU spans are kept
#: Caching-allocator counters recorded after each kept launch: a device allocation, a retry (which frees cached
#: blocks and waits for the device) or a device-wide sync on the host side of a step is a stall.
ALLOC_STATS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


class Timeline:
    """Host intervals of wrapped methods and GPU spans of launches, in ms since ``start()``, for ``STEPS`` steps."""

    def __init__(self, llm) -> None:  # type: ignore[no-untyped-def]
        e = llm.engine
        self.runner = r = e.runner
        self.host: list[tuple[str, float, float]] = []
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.steps = 0
        self.allocs: list[list[int]] = []
        self.targets = [(llm, "_params_list"), (llm, "make_request"), (e, "add_request"), (e.scheduler, "schedule"),
                        (r, "prepare"), (r, "pad_extend"), (r, "forward"), (r.sampling, "info"), (r.sampler, "sample"),
                        (e, "_process")]
        self.run_orig = r.run
        self.tokens_orig = model_runner.StepOutput.tokens

    def _keep(self) -> bool:
        return self.steps < STEPS

    def _wrap(self, label: str, fn):  # type: ignore[no-untyped-def]
        def wrapper(*a, **k):  # type: ignore[no-untyped-def]
            s = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if self._keep():
                    self.host.append((label, s, time.perf_counter()))
        return wrapper

    def __enter__(self) -> Timeline:
        for obj, name in self.targets:
            setattr(obj, name, self._wrap(name, getattr(obj, name)))
        run = self.run_orig

        def run_with_events(*a, **k):  # type: ignore[no-untyped-def]
            keep = self._keep()
            if keep:
                s, t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
            h = time.perf_counter()
            out = run(*a, **k)
            if keep:
                t.record()
                self.events.append((s, t))
                self.host.append(("run", h, time.perf_counter()))
                stats = torch.cuda.memory_stats()
                self.allocs.append([stats.get(k, 0) for k in ALLOC_STATS])
            self.steps += 1
            return out

        self.targets.append((self.runner, "run"))
        self.runner.run = run_with_events
        model_runner.StepOutput.tokens = self._wrap("wait_for_tokens", self.tokens_orig)
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        self.allocs_before = [stats.get(k, 0) for k in ALLOC_STATS]
        self.base = torch.cuda.Event(enable_timing=True)
        self.base.record()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize()
        for obj, name in self.targets:
            delattr(obj, name)  # back to the class's method
        model_runner.StepOutput.tokens = self.tokens_orig

    def summary(self, wall_s: float) -> dict:
        ms = lambda t: round((t - self.t0) * 1e3, 3)  # noqa: E731
        gpu = [(round(self.base.elapsed_time(s), 3), round(self.base.elapsed_time(t), 3)) for s, t in self.events]
        totals: dict[str, float] = {}
        for label, s, t in self.host:
            totals[label] = totals.get(label, 0.0) + (t - s) * 1e3
        return {"wall_s": round(wall_s, 4), "host": [(label, ms(s), ms(t)) for label, s, t in self.host],
                "gpu_spans_ms": gpu, "host_ms_by_label": {k: round(v, 2) for k, v in totals.items()},
                "alloc_counters": {"names": ALLOC_STATS, "before": self.allocs_before,
                                   "after_each_launch": self.allocs}}


def timed_run(llm) -> dict:  # type: ignore[no-untyped-def]
    wl = canonical_workload()
    assert llm.engine.flush_cache()
    with Timeline(llm) as tl:
        t = time.perf_counter()
        llm.generate(wl.prompts, wl.sampling_params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    return tl.summary(wall)


def show(name: str, run: dict) -> None:
    print(f"\n== {name}: wall {run['wall_s']:.3f} s; host ms in the first {STEPS} steps: {run['host_ms_by_label']}")
    spans = iter(run["gpu_spans_ms"])
    for label, s, t in run["host"]:
        if label in ("make_request", "add_request"):
            continue
        line = f"  host {label:<16} {s:9.2f} -> {t:9.2f} ({t - s:7.2f})"
        if label == "run":
            g = next(spans, None)
            if g is not None:
                line += f"   GPU {g[0]:9.2f} -> {g[1]:9.2f} ({g[1] - g[0]:7.2f})"
        print(line)
    first = [(s, t) for label, s, t in run["host"] if label == "make_request"]
    if first:
        print(f"  make_request x{len(first)}: {first[0][0]:.2f} -> {first[-1][1]:.2f} ms")


def profile_text(prof: cProfile.Profile, *sorts: tuple[str, int]) -> str:
    """A cProfile's top functions under each (sort key, how many) in turn, as pstats prints them."""
    text = io.StringIO()
    for key, n in sorts:
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(n)
    return text.getvalue()


def write_result(out: Path, stem: str, label: str, result: dict) -> None:
    """``result`` with the run's provenance, as ``out/STEM[_LABEL].json``."""
    result["provenance"] = collect_provenance(label=label)
    (out / f"{stem}{'_' + label if label else ''}.json").write_text(json.dumps(result, indent=1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "results"))
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    llm, startup = warmed_engine()
    runs = {}
    for name in ("first", "second"):
        runs[name] = timed_run(llm)
        show(name, runs[name])
    assert llm.engine.flush_cache()
    prof = cProfile.Profile()
    prof.enable()
    phase = prefill_phase(llm, profiled=False)
    prof.disable()
    llm.engine.run_until_done()
    text = profile_text(prof, ("tottime", 35))
    print(text)
    write_result(out, "run_start", args.label, {
        "what": "the host and GPU timeline of the first steps of two timed canonical runs in one fresh engine, and a "
                "cProfile of a third run's queueing and prefill steps",
        "startup_s": round(startup, 1), "runs": runs, "profiled_prefill_phase": phase,
        "profile_top": text.splitlines()[:60]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
