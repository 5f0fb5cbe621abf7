"""The first prefill phase of a fresh engine against a later one (chapter 11).

``bench offline`` times the canonical workload on an engine that has only run a tiny warm-up workload (four
32-token prompts), so the timed run's prefill phase is the first time the engine runs steps of thousands of
tokens. This script measures what that first time costs: in a fresh engine it runs the bench's warm-up workload,
then (``--prepare``) optionally one burst of prompts as large as a prefill step's token budget, one output token
each, then times the canonical workload's prefill phase twice, step by step (as ``prefill_anatomy.py`` does),
and records the caching allocator's device allocations (``cudaMalloc`` calls) of each phase. Writes JSON:

    python3 scripts/gpu/measure/first_prefill.py --prepare none --out results
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefill_anatomy import prefill_phase  # noqa: E402 - this folder, put on sys.path above

from minisgl_ref.bench.provenance import collect_provenance  # noqa: E402
from minisgl_ref.bench.workloads import warmup_workload  # noqa: E402
from minisgl_ref.llm import LLM  # noqa: E402


def first_phase(llm) -> dict:  # type: ignore[no-untyped-def]
    """The canonical workload's prefill phase, timed step by step (``prefill_anatomy.prefill_phase``) from the
    moment its requests start being queued, as ``bench offline`` times a run, and what the caching allocator
    holds after it."""
    phase = prefill_phase(llm, profiled=False)
    queue = phase["queue_ms"]
    phase["wall_ms"] = round(phase["wall_ms"] + queue, 2)
    phase["step_end_ms"] = [round(t + queue, 2) for t in phase["step_end_ms"]]
    phase["reserved_gb_after"] = round(torch.cuda.memory_stats()["reserved_bytes.all.current"] / 1e9, 3)
    return phase


def warmed_engine() -> tuple[LLM, float]:
    """A fresh engine as ``bench offline`` builds it, after the bench's warm-up workload, and its start-up seconds."""
    t0 = time.perf_counter()
    llm = LLM("qwen3-0.6b", load_format="dummy", dtype="bfloat16", device="cuda")
    startup = time.perf_counter() - t0
    wu = warmup_workload()
    llm.generate(wu.prompts, wu.sampling_params, use_tqdm=False)
    return llm, startup


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "results"))
    ap.add_argument("--prepare", choices=("none", "burst"), default="none")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    llm, startup = warmed_engine()
    assert llm.engine.flush_cache()
    prepare_ms = None
    if args.prepare == "burst":
        budget = llm.engine.config.max_prefill_tokens
        n = 16
        g = torch.Generator().manual_seed(7)
        prompts = torch.randint(100, 10_000, (n, budget // n), generator=g).tolist()
        t = time.perf_counter()
        llm.generate(prompts, [{"max_new_tokens": 1, "temperature": 0.6, "ignore_eos": True}] * n, use_tqdm=False)
        torch.cuda.synchronize()
        prepare_ms = round((time.perf_counter() - t) * 1e3, 2)
        assert llm.engine.flush_cache()
    phases = [first_phase(llm) for _ in range(2)]
    doc = {"what": __doc__.split("\n\n")[0], "prepare": args.prepare, "prepare_ms": prepare_ms,
           "startup_s": round(startup, 2), "phases": phases, "provenance": collect_provenance(sys.argv)}
    (out / f"first_prefill_{args.prepare}.json").write_text(json.dumps(doc, indent=1) + "\n")
    for p in phases:
        print(f"prepare={args.prepare}: queue {p['queue_ms']} ms, phase {p['wall_ms']} ms, first step ends at "
              f"{p['step_end_ms'][0]} ms, {p['device_allocs']} device allocations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
