"""Same-process A/B of the sampler's draw on the canonical workload: the current kernel (bf16 logits read
directly, each row's vocabulary split over several programs) against an earlier version given as two files
(its launcher and its kernel; with ``--old-float32`` the old launcher is fed float32 logits, as the first
versions needed). Runs alternate, A B A B ..., on one
engine, after the usual untimed warm-up; also times the draw alone at a few row counts (CUDA graphs of ten draws,
so that the host's launches do not count; ``--draw-only``: only that).

    python3 scripts/gpu/measure/sampler_ab.py OUT.json --old-launcher OLD_fused_draw.py --old-kernel OLD_race_kernel.py

Both old files are what ``git show REV:minisgl_ref/sampling/fused_draw.py`` (and ``race_kernel.py``) print.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path
from types import ModuleType


def load(name: str, path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--old-launcher", required=True)
    p.add_argument("--old-kernel", required=True)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--old-float32", action="store_true", help="convert the logits to float32 for the old launcher")
    p.add_argument("--draw-only", action="store_true", help="time the draw alone, not the canonical workload")
    args = p.parse_args()
    import torch

    from benchmarks.kernels import time_graph
    from minisgl_ref.bench import offline
    from minisgl_ref.bench.provenance import collect_provenance
    from minisgl_ref.bench.workloads import canonical_workload, warmup_workload
    from minisgl_ref.sampling import fused_draw, sampler

    old_kernel = load("old_race_kernel", args.old_kernel)
    old = load("old_fused_draw", args.old_launcher)
    old._kernel = lambda: old_kernel.race_kernel  # type: ignore[attr-defined]
    new_temperature, new_probs = fused_draw.temperature_sample, fused_draw.sample_from_probs

    def old_temperature(logits, temperatures, seeds, steps):  # type: ignore[no-untyped-def]
        if args.old_float32:
            logits = logits.float()  # the copy the first versions needed
        return old.temperature_sample(logits, temperatures, seeds, steps)

    variants = {"new": (new_temperature, new_probs), "old": (old_temperature, old.sample_from_probs)}

    def use(name: str) -> None:
        fused_draw.temperature_sample, fused_draw.sample_from_probs = variants[name]

    # The draw alone: bf16 logits as the LM head writes them, seeded rows, temperature 0.6.
    dev = torch.device("cuda")
    vocab = 151936
    micro = []
    for rows in (1, 8, 64, 128, 256):
        logits = torch.randn(rows, vocab, device=dev).to(torch.bfloat16)
        temps = torch.full((rows,), 0.6, device=dev)
        seeds = torch.arange(rows, device=dev)
        steps = torch.zeros(rows, dtype=torch.int64, device=dev)
        row = {"rows": rows}
        for name in ("new", "old", "new", "old"):  # each call captured ten times in a CUDA graph: no launch cost
            fn = variants[name][0]
            seconds, _ = time_graph(lambda: fn(logits, temps, seeds, steps), repeats=30)  # noqa: B023
            row.setdefault(f"{name}_us", []).append(round(seconds * 1e6, 1))
        agree = bool(torch.equal(variants["new"][0](logits, temps, seeds, steps),
                                 variants["old"][0](logits, temps, seeds, steps)))
        row["same_tokens"] = agree
        eager = sampler.temperature_sample(logits.float(), temps, seeds, steps)
        row["new_same_as_eager"] = bool(torch.equal(variants["new"][0](logits, temps, seeds, steps), eager))
        if rows == 256:  # many draws: how often do the two kernels pick different tokens?
            logits = (torch.randn(rows, vocab, device=dev) * 3).to(torch.bfloat16)
            differ = 0
            for step in range(200):
                steps.fill_(step)
                differ += int((variants["new"][0](logits, temps, seeds, steps)
                               != variants["old"][0](logits, temps, seeds, steps)).sum())
            row.update(draws_compared=200 * rows, draws_differing=differ)
        micro.append(row)
        print(json.dumps(row), flush=True)

    if args.draw_only:
        result = {"what": __doc__.split("\n\n")[0], "draw_alone_us": micro, "provenance": collect_provenance(sys.argv)}
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        return 0
    model = offline.resolve_model(None, None, quick=False)
    kwargs = offline.resolve_engine_kwargs({}, False)
    llm = offline.build_llm(model, "paged", kwargs)
    w = warmup_workload()
    for name in variants:  # each variant meets its kernels before the timed runs
        use(name)
        llm.generate(w.prompts, w.sampling_params, use_tqdm=False)
    offline._forget_warmup(llm)
    workload = canonical_workload(256)
    floor = offline.workload_floor_seconds(workload, llm.config, offline.H100_MEASURED_BANDWIDTH)
    runs = []
    for i in range(2 * args.pairs):
        name = ("new", "old")[i % 2]
        use(name)
        outputs, wall, counters = offline.time_generate(llm, workload)
        tokens = sum(o.completion_tokens for o in outputs)
        runs.append({"variant": name, "wall_s": round(wall, 3), "output_tok_s": round(tokens / wall, 1),
                     "roofline_fraction": round(floor / wall, 3), "steps": counters.steps})
        print(json.dumps(runs[-1]), flush=True)
        offline._forget_warmup(llm)
    use("new")
    summary = {name: statistics.median(r["output_tok_s"] for r in runs if r["variant"] == name) for name in variants}
    result = {"what": __doc__.split("\n\n")[0], "draw_alone_us": micro, "canonical_runs": runs,
              "median_output_tok_s": summary, "provenance": collect_provenance(sys.argv)}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("summary:", json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
