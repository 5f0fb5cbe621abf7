"""Where a decode step's time goes, at every stage of the canonical workload (chapter 11).

Runs the canonical offline workload (256 requests) step by step with the default engine. Each time the number of
running requests first drops to or below one of ``--at`` (256, 192, 128, 64, 32, 16 by default), it profiles
``--steps`` engine steps with ``torch.profiler`` and records, per step:

* the wall time (``--steps`` steps between two synchronisations, so one step of overlap is lost per window);
* the GPU busy time, split into the attention kernels, the matrix multiplies, the sampler and everything else,
  and the number of kernels;
* the GPU's idle gaps between consecutive kernels, by the kind of the kernel that follows, and the transitions
  that cost the most;
* the KV floor: the bytes of KV the running requests' contexts hold, divided by ``--bandwidth``, which is what
  the attention kernel must read.

Before each profiled window, as many steps run unprofiled (the profiler slows the host down) with CUDA events
recorded around every launch: the GPU's idle time between the end of one step's work and the start of the next
step's launch (the host was late), and the host's time per phase (schedule, launch, process, of which waiting
for the tokens). Busy minus attention is the fixed cost of a step that the floor does not count. Writes
``decode_anatomy[_label].json`` (with provenance) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from minisgl_ref.bench.offline import stored_bytes
from minisgl_ref.bench.provenance import collect_provenance
from minisgl_ref.llm import LLM
from offline_suite import canonical_in_decode  # this folder, on sys.path when run as a script


def _kind(name: str) -> str:
    low = name.lower()
    if ("batchdecode" in low or "batchprefill" in low or "pagedattention" in low or "mergestates" in low
            or "split_decode" in low or "flash" in low and "attn" in low):  # FlashInfer's, ours, FA3
        return "attention"
    if "nvjet" in low or "gemm" in low or "cutlass" in low or "xmma" in low:
        return "matmul"
    if "race_kernel" in low or "argmax" in low:
        return "sampler"
    if low.startswith("memcpy") or low.startswith("memset"):
        return "copies"
    return "other"


class _Probe:
    """Host time per phase and CUDA events around every launch, by wrapping the engine's methods in place."""

    def __init__(self, engine) -> None:  # type: ignore[no-untyped-def]
        from minisgl_ref.engine import model_runner
        from minisgl_ref.engine.cuda_graph import CudaGraphRunner

        self.graph_runner_cls = CudaGraphRunner
        self.engine = engine
        self.host: dict[str, float] = {}
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.originals = {"schedule": engine.scheduler.schedule, "run": engine.runner.run,
                          "process": engine._process}
        self.tokens_cls = model_runner.StepOutput
        self.tokens_orig = model_runner.StepOutput.tokens

    def _timed(self, name: str, fn):  # type: ignore[no-untyped-def]
        def wrapper(*a, **k):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.host[name] = self.host.get(name, 0.0) + time.perf_counter() - t
        return wrapper

    def __enter__(self) -> _Probe:
        e = self.engine
        run = self.originals["run"]

        def run_with_events(*a, **k):  # type: ignore[no-untyped-def]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = run(*a, **k)
            end.record()
            self.events.append((start, end))
            return out

        e.scheduler.schedule = self._timed("schedule", self.originals["schedule"])
        e.runner.run = self._timed("launch", run_with_events)
        e._process = self._timed("process", self.originals["process"])
        self.tokens_cls.tokens = self._timed("wait_for_tokens", self.tokens_orig)
        # The parts of a launch (instance attributes shadow the class's methods until __exit__ deletes them).
        r = e.runner
        self.parts = [(r, "prepare"), (r, "forward"), (r.sampling, "info"), (r.sampler, "sample")]
        for graphs in r.graph_runners:  # decode graphs: one set per decode backend (the engine's, a cascade)
            if isinstance(graphs, self.graph_runner_cls):
                self.parts.append((graphs, "replay"))
                self.parts.append((graphs.backend, "prepare_replay"))
        for obj, name in self.parts:
            setattr(obj, name, self._timed(f"launch.{type(obj).__name__}.{name}", getattr(obj, name)))
        self.graph_replay = torch.cuda.CUDAGraph.replay
        torch.cuda.CUDAGraph.replay = self._timed("launch.CUDAGraph.replay", self.graph_replay)
        return self

    def __exit__(self, *exc) -> None:  # type: ignore[no-untyped-def]
        e = self.engine
        del e.scheduler.schedule, e.runner.run, e._process  # back to the class's methods
        self.tokens_cls.tokens = self.tokens_orig
        for obj, name in self.parts:
            delattr(obj, name)
        torch.cuda.CUDAGraph.replay = self.graph_replay

    def gaps_ms(self) -> tuple[float, float]:
        """(GPU idle between launches, GPU time from each launch's first to last event), summed."""
        idle = sum(max(0.0, a_end.elapsed_time(b_start)) for (_, a_end), (b_start, _) in zip(self.events, self.events[1:]))
        inside = sum(s.elapsed_time(t) for s, t in self.events[1:])
        return idle, inside


def _unprofiled(engine, steps: int) -> dict:  # type: ignore[no-untyped-def]
    torch.cuda.synchronize()
    with _Probe(engine) as probe:
        t0 = time.perf_counter()
        for _ in range(steps + 1):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / (steps + 1)
    idle, inside = probe.gaps_ms()
    n = max(1, len(probe.events) - 1)
    return {"wall_ms_per_step": round(wall, 3), "gpu_idle_between_steps_ms": round(idle / n, 3),
            "gpu_launch_to_end_ms": round(inside / n, 3),
            "host_ms_per_step": {k: round(v * 1e3 / (steps + 1), 3) for k, v in probe.host.items()}}


def _window(engine, steps: int, kv_bytes_per_token: int, bandwidth: float) -> dict:  # type: ignore[no-untyped-def]
    running = engine.scheduler.running
    rows = len(running)
    context = sum(len(r.input_ids) + len(r.output_ids) for r in running)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    by_kind: dict[str, float] = {}
    kernels = 0
    top: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_type.name != "CUDA" or e.self_device_time_total <= 0:
            continue
        kind = _kind(e.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + e.self_device_time_total / 1e3 / steps
        if kind != "copies":
            kernels += e.count
        top[e.key[:80]] = e.self_device_time_total / 1e3 / steps
    busy = sum(by_kind.values())
    return {
        "running": rows, "context_tokens": context, "profiled_wall_ms_per_step": round(wall_ms, 3),
        "gpu_busy_ms_per_step": round(busy, 3),
        "kv_floor_ms_per_step": round(context * kv_bytes_per_token / bandwidth * 1e3, 3),
        "ms_per_step_by_kind": {k: round(v, 3) for k, v in sorted(by_kind.items())},
        "kernels_per_step": round(kernels / steps, 1),
        "top_kernels_ms_per_step": {k: round(v, 4) for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:12]},
        "gaps": kernel_gaps(prof, steps),
    }


def _short(name: str) -> str:
    """A kernel's name without its template arguments and parameter list, for grouping."""
    for cut in ("<", "("):
        name = name.split(cut)[0]
    return name.removeprefix("void ").strip()[:60]


def kernel_gaps(prof, steps: int) -> dict:  # type: ignore[no-untyped-def]
    """The GPU's idle time between consecutive kernels, per step: in total, and by the kind of kernel that came
    next (a dependent kernel cannot start before the previous one ends, so each gap is the time the next one
    took to get going), with the worst transitions by name. From the profiler's raw device events, in start
    order on the one stream a decode step uses. Copies (memcpy, memset) count as events of their own (kind
    "copies"), so a gap before or after one is the time the stream took to switch to or from the copy."""
    events = [e for e in prof.profiler.kineto_results.events()
              if e.device_type().name == "CUDA" and e.duration_ns() > 0]
    events.sort(key=lambda e: e.start_ns())
    by_kind: dict[str, float] = {}
    by_pair: dict[str, list[float]] = {}
    total = around_copies = 0.0
    for a, b in zip(events, events[1:]):
        gap = (b.start_ns() - a.end_ns()) / 1e3  # us; negative: overlapped (programmatic dependent launch)
        if gap > 200:  # between steps: the host, not the GPU
            continue
        total += gap
        if "copies" in (_kind(a.name()), _kind(b.name())):
            around_copies += gap
        kind = _kind(b.name())
        by_kind[kind] = by_kind.get(kind, 0.0) + gap
        by_pair.setdefault(f"{_short(a.name())} -> {_short(b.name())}", []).append(gap)
    pairs = sorted(by_pair.items(), key=lambda kv: -sum(kv[1]))[:12]
    return {"gap_ms_per_step": round(total / 1e3 / steps, 3),
            "gap_ms_per_step_next_to_copies": round(around_copies / 1e3 / steps, 3),
            "gap_ms_per_step_by_next_kind": {k: round(v / 1e3 / steps, 3) for k, v in sorted(by_kind.items())},
            "top_transitions": [{"pair": k, "per_step": round(len(v) / steps, 1), "mean_us": round(sum(v) / len(v), 2),
                                 "min_us": round(min(v), 2)} for k, v in pairs]}


def graph_launch_cost(kernels: int = 300, replays: int = 200) -> dict:
    """Host time of one ``CUDAGraph.replay()`` of a graph of ``kernels`` tiny kernels, with the GPU idle before
    each replay (synchronised) and with replays queued back to back."""
    x = torch.zeros(256, device="cuda")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            x.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for _ in range(kernels):
            x.add_(1)
    g.replay()
    torch.cuda.synchronize()
    idle = []
    for _ in range(replays):
        torch.cuda.synchronize()
        t = time.perf_counter()
        g.replay()
        idle.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(replays):
        g.replay()
    queued = (time.perf_counter() - t) / replays
    torch.cuda.synchronize()
    gpu = (time.perf_counter() - t) / replays
    idle.sort()
    return {"kernels": kernels, "host_us_per_replay_gpu_idle": round(idle[len(idle) // 2] * 1e6, 1),
            "host_us_per_replay_queued": round(queued * 1e6, 1), "wall_us_per_replay_queued": round(gpu * 1e6, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--at", default="256,192,128,64,32,16")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--no-launch-cost", action="store_true", help="skip the graph replay cost of tiny kernels")
    ap.add_argument("--bandwidth", type=float, default=3.0e12)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=os.environ.get("OUT", "results"))
    ap.add_argument("--engine-arg", action="append", default=[], metavar="NAME=JSON",
                    help="another engine argument, its value as JSON (e.g. split_decode_min_batch=0); repeatable")
    args = ap.parse_args()
    extra = {name: json.loads(value) for name, _, value in (a.partition("=") for a in args.engine_arg)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    marks = sorted((int(x) for x in args.at.split(",")), reverse=True)

    t0 = time.perf_counter()
    llm = LLM("qwen3-0.6b", load_format="dummy", dtype="bfloat16", device="cuda", **extra)
    start_s = time.perf_counter() - t0
    kv_bytes = stored_bytes(llm)[1]  # the bytes the pool holds per token (an FP8 cache: half)
    engine = canonical_in_decode(llm)
    windows = []
    for _ in range(4):  # let the first decode steps settle
        engine.step()
    while engine.has_work and marks:
        if len(engine.scheduler.running) <= marks[0]:
            while marks and len(engine.scheduler.running) <= marks[0]:
                marks.pop(0)
            plain = _unprofiled(engine, args.steps)
            w = _window(engine, args.steps, kv_bytes, args.bandwidth)
            w["unprofiled"] = plain
            print(json.dumps(w), flush=True)
            windows.append(w)
        else:
            engine.step()
    launches = [] if args.no_launch_cost else [graph_launch_cost(n) for n in (30, 300, 1000)]
    for row in launches:
        print(json.dumps(row), flush=True)
    result = {
        "graph_launch_cost": launches,
        "what": "decode steps of the canonical workload, profiled at several numbers of running requests",
        "label": args.label, "start_s": round(start_s, 1), "windows": windows,
        "kv_bytes_per_token": kv_bytes, "bandwidth": args.bandwidth,
        "provenance": collect_provenance(label=args.label, steps=args.steps, engine_args=extra),
    }
    name = f"decode_anatomy{'_' + args.label if args.label else ''}.json"
    (out / name).write_text(json.dumps(result, indent=1))
    print(f"{'running':>7} {'wall':>6} {'idle':>6} {'busy':>6} {'kvfloor':>7} {'attn':>6} {'mm':>6} {'samp':>6} "
          f"{'other':>6} {'kern':>5}  host ms per step (unprofiled)")
    for w in windows:
        k = w["ms_per_step_by_kind"]
        u = w["unprofiled"]
        print(f"{w['running']:>7} {u['wall_ms_per_step']:>6.2f} {u['gpu_idle_between_steps_ms']:>6.2f} "
              f"{w['gpu_busy_ms_per_step']:>6.2f} {w['kv_floor_ms_per_step']:>7.2f} {k.get('attention', 0):>6.2f} "
              f"{k.get('matmul', 0):>6.2f} {k.get('sampler', 0):>6.2f} {k.get('other', 0):>6.2f} "
              f"{w['kernels_per_step']:>5.0f}")
        print("        host ms per step: " + ", ".join(f"{k} {v}" for k, v in u["host_ms_per_step"].items()))
        g = w["gaps"]
        print(f"        kernel gaps {g['gap_ms_per_step']} ms/step, by next kind {g['gap_ms_per_step_by_next_kind']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
