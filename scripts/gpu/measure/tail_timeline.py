"""The host and the GPU on one clock in the tail of a canonical run, where few requests are left (chapter 11).

With fewer than ~30 requests running a decode step takes the GPU ~2 ms, about as long as the host needs to
schedule, prepare and launch it, and the steps take longer than their kernels. This script runs the canonical
workload twice in one fresh engine (as ``bench offline`` does, the radix cache emptied before each run) and, for
every decode step of at most ``--below`` rows, records each engine phase's host interval and, with a CUDA event
at the entry and exit of each phase, when the GPU reached that point of the stream. A phase the GPU reaches
within microseconds of the host launching it is one the GPU waited for; a large lag means the host was ahead.
A third run profiles the host's functions over the same steps (``cProfile``). Writes JSON and prints a summary:

    python3 scripts/gpu/measure/tail_timeline.py --out results
"""

from __future__ import annotations

import argparse
import cProfile
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from first_prefill import warmed_engine  # noqa: E402 - this folder, put on sys.path above
from run_start import profile_text, write_result  # noqa: E402

from minisgl_ref.bench.workloads import canonical_workload  # noqa: E402
from minisgl_ref.engine import model_runner  # noqa: E402


class TailProbe:
    """Host intervals and GPU marks of the engine's phases for decode steps of at most ``below`` rows."""

    def __init__(self, llm: Any, below: int, keep: int, profile: cProfile.Profile | None = None) -> None:
        e = llm.engine
        self.engine, self.runner = e, e.runner
        self.below, self.keep, self.profile = below, keep, profile
        self.active = False
        self.kept = 0
        self.records: list[tuple[str, float, float, Any, Any]] = []  # label, host start, end, GPU events
        self.targets = [(e.scheduler, "schedule"), (self.runner, "prepare"), (self.runner, "forward"),
                        (self.runner.sampling, "info"), (self.runner.sampler, "sample"), (e, "_process")]

    def _wrap(self, label: str, fn: Callable) -> Callable:
        def wrapper(*a: Any, **k: Any) -> Any:
            if not self.active:
                return fn(*a, **k)
            s_ev = t_ev = None
            if self.profile is None:
                s_ev, t_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s_ev.record()
            s = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                t = time.perf_counter()
                if t_ev is not None:
                    t_ev.record()
                self.records.append((label, s, t, s_ev, t_ev))
        return wrapper

    def __enter__(self) -> TailProbe:
        for obj, name in self.targets:
            setattr(obj, name, self._wrap(name, getattr(obj, name)))
        run = self.runner.run
        self.tokens_orig = model_runner.StepOutput.tokens
        model_runner.StepOutput.tokens = self._wrap("wait_for_tokens", self.tokens_orig)

        def run_watch(batch: Any, *a: Any, **k: Any) -> Any:
            small = batch.is_decode and len(batch.rows) <= self.below
            if small and not self.active and self.kept < self.keep:
                self.active = True
                if self.profile is not None:
                    self.profile.enable()
            if self.active:
                self.kept += 1
                if self.kept > self.keep:
                    self.active = False
                    if self.profile is not None:
                        self.profile.disable()
            return self._wrap("run", run)(batch, *a, **k)

        self.runner.run = run_watch
        self.targets.append((self.runner, "run"))
        torch.cuda.synchronize()
        self.base = torch.cuda.Event(enable_timing=True)
        self.base.record()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.active and self.profile is not None:
            self.profile.disable()
        torch.cuda.synchronize()
        for obj, name in self.targets:
            delattr(obj, name)
        model_runner.StepOutput.tokens = self.tokens_orig

    def summary(self) -> dict[str, Any]:
        ms = lambda t: round((t - self.t0) * 1e3, 3)  # noqa: E731
        gpu = lambda ev: None if ev is None else round(self.base.elapsed_time(ev), 3)  # noqa: E731
        rows = [(label, ms(s), ms(t), gpu(se), gpu(te)) for label, s, t, se, te in self.records]
        by: dict[str, dict[str, list[float]]] = {}
        for label, s, t, gs, gt in rows:
            d = by.setdefault(label, {"host_ms": [], "gpu_lag_at_entry_ms": []})
            d["host_ms"].append(t - s)
            if gs is not None:
                d["gpu_lag_at_entry_ms"].append(gs - s)
        runs = [r for r in rows if r[0] == "run"]
        period = [(b[1] - a[1]) for a, b in zip(runs, runs[1:])]
        med = lambda xs: round(sorted(xs)[len(xs) // 2], 3) if xs else None  # noqa: E731
        return {"timeline": rows, "steps": len(runs), "median_step_period_ms": med(period),
                "by_label": {k: {"calls": len(v["host_ms"]), "median_host_ms": med(v["host_ms"]),
                                 "median_gpu_lag_at_entry_ms": med(v["gpu_lag_at_entry_ms"])}
                             for k, v in by.items()}}  # fmt: skip


def timed_run(llm: Any, below: int, keep: int, profile: cProfile.Profile | None = None) -> dict[str, Any]:
    wl = canonical_workload()
    assert llm.engine.flush_cache()
    with TailProbe(llm, below, keep, profile) as probe:
        t = time.perf_counter()
        llm.generate(wl.prompts, wl.sampling_params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    out = probe.summary()
    out["wall_s"] = round(wall, 4)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "results"))
    ap.add_argument("--below", type=int, default=32, help="keep decode steps of at most this many rows")
    ap.add_argument("--keep", type=int, default=60, help="steps kept per run")
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    llm, startup = warmed_engine()
    runs = {}
    for name in ("first", "second"):
        runs[name] = timed_run(llm, args.below, args.keep)
        r = runs[name]
        print(f"== {name}: wall {r['wall_s']} s, {r['steps']} steps kept, median period {r['median_step_period_ms']} ms")
        for label, d in r["by_label"].items():
            print(f"   {label:<16} {d['calls']:>4} calls, host {d['median_host_ms']:>7} ms, "
                  f"GPU lag at entry {d['median_gpu_lag_at_entry_ms']} ms")
    prof = cProfile.Profile()
    timed_run(llm, args.below, args.keep, prof)
    text = profile_text(prof, ("tottime", 30), ("cumulative", 40))
    print(text[:12000])
    write_result(out, "tail_timeline", args.label, {
        "what": "host phases and GPU marks of the decode steps of at most --below rows of two timed canonical runs in "
                "one fresh engine, and a cProfile of the same steps of a third run",
        "below": args.below, "startup_s": round(startup, 1), "runs": runs,
        "profile_top": text.splitlines()[:140]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
