"""Gather the result folders of scripts/gpu/perf2_round.sh runs into the files chapters 11 and 12 read.

    python3 scripts/gpu/perf2_publish.py --startup-before DIR --startup-after DIR --cascade-fcfs DIR \\
        --cascade-grouped DIR --serving DIR --grammar-bounded FILE --grammar-typical FILE

Writes docs/data/perf2_h100.json (start-up before and after, the Triton backend beside the default, the cascade
A/B under both admission orders, the cascade profile), docs/data/bench_serving_sweep_h100.json (every serving run
without its per-request rows) and copies the two grammar benchmarks to docs/data/constrained_bench*_h100.json.
Every entry keeps the provenance its run wrote (GPU, driver, versions, commit, command).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "docs" / "data"


def bench(path: Path) -> dict:
    """One `bench offline` results file: its single run, with the file's provenance."""
    doc = json.loads(path.read_text())
    return {**doc["results"][0], "provenance": doc["provenance"]}


def main() -> int:
    p = argparse.ArgumentParser()
    for name in ("startup-before", "startup-after", "cascade-fcfs", "cascade-grouped", "serving"):
        p.add_argument(f"--{name}", type=Path, required=True)
    p.add_argument("--grammar-bounded", type=Path, required=True)
    p.add_argument("--grammar-typical", type=Path, required=True)
    args = p.parse_args()

    def startup(folder: Path) -> dict:
        return {run: bench(folder / f"startup_{run}.json") for run in ("cold", "warm")}

    def cascade(folder: Path) -> dict:
        return {run: bench(folder / f"shared_prefix_{run}.json") for run in ("radix_cascade", "radix_plain", "noradix")}

    after = args.startup_after
    doc = {
        "what": "bench offline on an H100: start-up and first timed run of fresh processes on a bare machine "
                "(cold, then warm disk caches), before and after compiling everything at start-up; the Triton "
                "attention backend beside the default; the shared-prefix workload with cascade attention, under "
                "first-come and grouped admission; GPU time per kernel of cascade decode steps",
        "startup_before": startup(args.startup_before),
        "startup_after": startup(after),
        "triton_backend": [bench(after / f"triton_backend_{run}.json") for run in (1, 2)],
        "cascade_fcfs_admission": cascade(args.cascade_fcfs),
        "cascade_grouped_admission": cascade(args.cascade_grouped),
        "cascade_profile": json.loads((args.cascade_grouped / "cascade_profile.json").read_text()),
    }
    (DATA / "perf2_h100.json").write_text(json.dumps(doc, indent=1) + "\n")

    runs = []
    for f in sorted(args.serving.glob("serving_*_rate_*.json"),
                    key=lambda f: (f.stem.split("_")[1], float(f.stem.split("_rate_")[1]))):
        r = json.loads(f.read_text())
        r.pop("requests", None)
        runs.append({"server": f.stem.split("_")[1], **r})
    ready = {s: float((args.serving / f"serve_{s}_ready_s.txt").read_text()) for s in ("default", "mixed")}
    serving = {"what": "bench serving against serve on an H100 (Qwen3-0.6B config, dummy bf16 weights): canonical "
                       "lengths, Poisson arrivals at 8, 16 and 24 requests/s and all at once, the default engine and "
                       "--enable-mixed-chunk", "ready_s": ready, "runs": runs}
    (DATA / "bench_serving_sweep_h100.json").write_text(json.dumps(serving, indent=1) + "\n")
    shutil.copyfile(args.grammar_bounded, DATA / "constrained_bench_h100.json")
    shutil.copyfile(args.grammar_typical, DATA / "constrained_bench_typical_h100.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
