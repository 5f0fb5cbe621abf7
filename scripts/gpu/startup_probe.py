"""Where does a fresh process's first run lose time? Build the canonical engine, then time several runs of the
canonical workload in the same process, and report every step of it to JSON.

    python3 scripts/gpu/startup_probe.py OUT.json [--runs 3] [--label cold] [engine flags as key=value ...]

Reported: seconds to build the engine (model, KV pool, CUDA graphs), the untimed warm-up workload, and each timed
run (output tok/s). A first run slower than the later ones means something still compiles inside the timed call;
comparing a first process on a bare machine with a second one shows what the disk caches buy.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--label", default="")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--quick", action="store_true", help="the tiny model and workload (a CPU smoke test of this script)")
    p.add_argument("--workload", default="canonical", choices=["canonical", "shared-prefix"])
    p.add_argument("kv", nargs="*", help="engine flags as key=value (python literals)")
    args = p.parse_intermixed_args()
    t_import = time.perf_counter()
    import ast

    import torch

    from minisgl_ref.bench import offline
    from minisgl_ref.bench.provenance import collect_provenance
    from minisgl_ref.bench.workloads import canonical_workload, shared_prefix_workload, warmup_workload

    compiles: list[dict] = []
    phase = {"now": "build"}
    try:  # record every Triton kernel compile, with the phase it happened in
        from triton.runtime import jit as triton_jit

        original = triton_jit.JITFunction._do_compile

        def traced(self, *a, **k):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            out = original(self, *a, **k)
            compiles.append({"phase": phase["now"], "kernel": getattr(self, "__name__", str(self.fn)),
                             "seconds": round(time.perf_counter() - t, 3)})
            return out

        triton_jit.JITFunction._do_compile = traced
    except Exception as e:  # noqa: BLE001 - a probe reports what it can
        print("cannot trace triton compiles:", e, file=sys.stderr)
    from torch._dynamo.utils import counters as dynamo_counters

    def graphs() -> int:
        return int(dynamo_counters["stats"]["unique_graphs"])

    dynamo: dict[str, int] = {}
    extra = {}
    for item in args.kv:
        k, v = item.split("=", 1)
        try:
            extra[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            extra[k] = v
    import_s = time.perf_counter() - t_import
    model = offline.resolve_model(None, None, quick=args.quick)
    kwargs = offline.resolve_engine_kwargs(extra, args.quick)
    t0 = time.perf_counter()
    llm = offline.build_llm(model, "paged", kwargs)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    build_s = time.perf_counter() - t0
    workload = (canonical_workload(**offline.QUICK_CANONICAL) if args.quick else canonical_workload(256)
                if args.workload == "canonical"
                else shared_prefix_workload(**offline.FULL_SHARED_PREFIX))
    warm_s = None
    dynamo["build"] = graphs()
    phase["now"] = "warmup"
    if not args.no_warmup:
        t0 = time.perf_counter()
        w = warmup_workload()
        llm.generate(w.prompts, w.sampling_params, use_tqdm=False)
        offline._forget_warmup(llm)
        sync()
        warm_s = time.perf_counter() - t0
    dynamo["warmup"] = graphs() - dynamo["build"]
    runs = []
    for i in range(args.runs):
        phase["now"] = f"run{i + 1}"
        before = graphs()
        outputs, wall, counters = offline.time_generate(llm, workload)
        tokens = sum(o.completion_tokens for o in outputs)
        floor = offline.workload_floor_seconds(workload, llm.config, offline.H100_MEASURED_BANDWIDTH)
        runs.append({"run": i + 1, "wall_s": round(wall, 3), "output_tok_s": round(tokens / wall, 1),
                     "roofline_fraction": round(floor / wall, 3), "steps": counters.steps,
                     "new_dynamo_graphs": graphs() - before,
                     "triton_compiles": sum(c["phase"] == phase["now"] for c in compiles)})
        print(f"[probe {args.label}] run {i + 1}: {wall:.2f} s, {tokens / wall:,.0f} tok/s", file=sys.stderr)
        offline._forget_warmup(llm)
    result = {"label": args.label, "workload": workload.name, "engine_kwargs": kwargs, "import_s": round(import_s, 2),
              "build_s": round(build_s, 2), "warmup_s": warm_s and round(warm_s, 2), "runs": runs,
              "dynamo_graphs": dynamo, "triton_compiles": compiles,
              "provenance": collect_provenance(), "command": " ".join(sys.argv)}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("label", "build_s", "warmup_s", "runs", "dynamo_graphs")}))
    for c in compiles:
        if c["phase"].startswith("run") or c["seconds"] > 0.5:
            print("  triton compile", c, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
