"""Where does a cascade decode step spend its GPU time? A profile of decode on the shared-prefix workload.

    python3 scripts/gpu/measure/cascade_profile.py OUT.json [--groups 16] [--per-group 16] [--output-len 96] [engine flags]

Qwen3-0.6B with dummy bf16 weights, ``groups x per-group`` requests behind 2,048-token system prompts (128-token
questions), generated once untimed (compiles, graphs, radix cache warm), then once more under the PyTorch
profiler. Reported: GPU time per kernel name (top 20), the number of decode steps and the cascade's share of
them, so that the three cascade passes (prefix, suffix, merge) can be set against the rest of the step.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--per-group", type=int, default=16)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("kv", nargs="*", help="engine flags as key=value (python literals)")
    args = p.parse_intermixed_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from minisgl_ref import LLM
    from minisgl_ref.bench.cascade_stats import cascade_stats
    from minisgl_ref.bench.provenance import collect_provenance
    from minisgl_ref.bench.workloads import shared_prefix_workload

    flags = {k: ast.literal_eval(v) for k, v in (kv.split("=", 1) for kv in args.kv)}
    llm = LLM("qwen3-0.6b", load_format="dummy", dtype="bfloat16", device="cuda", **flags)
    wl = shared_prefix_workload(args.groups, args.per_group, 2048, 128, args.output_len, seed=3)
    llm.generate(wl.prompts, wl.sampling_params, use_tqdm=False)  # untimed: compiles, graphs, radix cache
    stats = cascade_stats(llm)  # counts from here on (None: the engine has no cascade)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(wl.prompts, wl.sampling_params, use_tqdm=False)
        torch.cuda.synchronize()
    steps, cascade_steps = (stats.decode_steps, stats.cascade_steps) if stats else (0, 0)
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0:
            rows.append({"name": e.key[:120], "count": e.count, "gpu_ms": us / 1e3})
    rows.sort(key=lambda r: -r["gpu_ms"])
    total = sum(r["gpu_ms"] for r in rows)
    for r in rows[:20]:
        print(f"{r['gpu_ms']:9.1f} ms {r['gpu_ms'] / total:6.1%} {r['count']:7d}  {r['name'][:90]}")
    doc = {"what": __doc__.split("\n\n")[0], "flags": flags, "groups": args.groups, "per_group": args.per_group,
           "output_len": args.output_len, "decode_steps": steps,
           "cascade_decode_steps": cascade_steps, "gpu_ms_total": total, "kernels": rows[:40],
           "provenance": collect_provenance(sys.argv)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"decode steps {doc['decode_steps']}, cascade {doc['cascade_decode_steps']}; GPU total {total:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
