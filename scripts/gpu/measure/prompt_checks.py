"""Host time of checking a burst's prompt ids: one Python test per id against one pass in C (chapter 11).

Times, on the canonical workload's 256 prompts (143,083 ids), the id-by-id check the offline API used to run
(every id an int and not a bool, then every id in range) and the checks it runs now
(:func:`~minisgl_ref.core.request.are_token_ids` and :func:`~minisgl_ref.core.request.first_outside`).
Best of ``--repeats``. Writes JSON:

    python3 scripts/gpu/measure/prompt_checks.py --out results
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from minisgl_ref.bench.provenance import collect_provenance
from minisgl_ref.bench.workloads import canonical_workload
from minisgl_ref.core.request import are_token_ids, first_outside

VOCAB = 151_936  # Qwen3-0.6B


def per_id(ids: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in ids) and not any(
        t < 0 or t >= VOCAB for t in ids)


def whole(ids: list) -> bool:
    return are_token_ids(ids) and first_outside(ids, VOCAB) is None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    prompts = canonical_workload().prompts
    ms = {}
    for name, check in (("per_id", per_id), ("whole", whole)):
        best = float("inf")
        for _ in range(args.repeats):
            t = time.perf_counter()
            assert all(check(p) for p in prompts)
            best = min(best, time.perf_counter() - t)
        ms[name] = round(best * 1e3, 3)
    doc = {"what": __doc__.split("\n\n")[0], "prompts": len(prompts), "ids": sum(map(len, prompts)),
           "best_ms": ms, "provenance": collect_provenance(sys.argv)}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "prompt_checks.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{doc['ids']:,} ids: per id {ms['per_id']} ms, whole {ms['whole']} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
