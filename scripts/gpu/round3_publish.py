"""Turn one GPU round's raw outputs into the result files chapters 11 and 12 read (run here, after fetching them).

    python3 scripts/gpu/round3_publish.py CONSTRAINED_DIR SWEEP_BEFORE_DIR SWEEP_AFTER_DIR CANONICAL_DIR STALL_DIR

* docs/data/constrained_bench_real_{typical,bounded}_h100.json: copied (real SmolLM2 weights);
* docs/data/serving_step_gaps_h100.json: per server and rate, the client's latencies beside the engine's own step
  gaps (from the servers' --step-log), before and after the server processes froze their start-up objects;
* docs/data/canonical_steps_h100.json: the canonical run's step times by running batch size (--step-log);
* docs/data/prefill_stall_h100.json: copied.

``--commit DIR=SHA`` records the commit a run's working tree was at, when the device's checkout had no usable
.git (its provenance then names an older commit); the provenance keeps what it recorded, beside a note.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from minisgl_ref.bench.step_trace import summarize

DATA = Path(__file__).resolve().parents[2] / "docs" / "data"


def fix_commit(doc: dict, sha: str | None) -> dict:
    if sha:
        prov = doc.setdefault("provenance", {})
        prov["working_tree_commit"] = sha
        prov["git_commit_note"] = ("the run's checkout had no usable .git, so software.git_commit names an older "
                                   "commit; working_tree_commit is the commit whose working tree ran")
    return doc


def sweep(folder: Path) -> list[dict]:
    rows = json.loads((folder / "serving_sweep_summary.json").read_text())
    out = []
    for server in sorted({r["server"] for r in rows}):
        lines = [json.loads(x) for x in (folder / f"steps_{server}.jsonl").read_text().splitlines() if x.strip()]
        windows = {r: (float(a), float(b)) for r, a, b in
                   (x.split() for x in (folder / f"windows_{server}.txt").read_text().splitlines())}
        for r in (x for x in rows if x["server"] == server):
            rate = "inf" if r["request_rate"] in ("inf", float("inf")) else f"{float(r['request_rate']):g}"
            engine = summarize(lines, *windows[rate])
            window = [s for s in lines if windows[rate][0] <= s["t"] <= windows[rate][1]]
            slow = [s for s in window if s["gap_ms"] > 15]
            nxt = {id(s): window[i + 1] if i + 1 < len(window) else None for i, s in enumerate(window)}
            engine["steps_over_15ms"] = len(slow)
            engine["steps_over_15ms_next_to_a_prefill"] = sum(
                1 for s in slow if s["prefill_tokens"] or (nxt[id(s)] and nxt[id(s)]["prefill_tokens"]))
            out.append({**{k: v for k, v in r.items() if k != "engine_step_gaps"}, "engine_step_gaps": engine})
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("constrained")
    p.add_argument("sweep_before")
    p.add_argument("sweep_after")
    p.add_argument("canonical")
    p.add_argument("stall")
    p.add_argument("--commit", action="append", default=[], help="DIR=SHA")
    args = p.parse_args()
    commits = dict(c.split("=", 1) for c in args.commit)
    for schema in ("typical", "bounded"):
        src = Path(args.constrained) / f"constrained_bench_real_{schema}_h100.json"
        doc = fix_commit(json.loads(src.read_text()), commits.get(args.constrained))
        (DATA / src.name).write_text(json.dumps(doc, indent=1) + "\n")
    before, after = Path(args.sweep_before), Path(args.sweep_after)
    doc = {"what": "bench serving against serve on an H100 (Qwen3-0.6B config, dummy bf16 weights, canonical lengths, "
                   "160 requests per rate): the client's TTFT / ITL beside the engine's own step gaps from --step-log "
                   "(the time between two steps' tokens as a decoding request sees it), before and after the server "
                   "processes froze their start-up objects (gc.freeze)",
           "command": "NUM_PROMPTS=160 bash scripts/gpu/serving_sweep.sh",
           "before_gc_freeze": sweep(before), "after_gc_freeze": sweep(after),
           "provenance": {"before_gc_freeze": commits.get(args.sweep_before, "see the serving JSON files"),
                          "after_gc_freeze": commits.get(args.sweep_after, "see the serving JSON files")}}
    for key, folder in (("before_gc_freeze", before), ("after_gc_freeze", after)):
        one = next(folder.glob("serving_*_rate_8.json"))
        doc["provenance"][key] = fix_commit(json.loads(one.read_text()), commits.get(str(folder)))["provenance"]
    (DATA / "serving_step_gaps_h100.json").write_text(json.dumps(doc, indent=1) + "\n")
    can = Path(args.canonical)
    steps = [json.loads(x) for x in (can / "canonical_steps.jsonl").read_text().splitlines() if x.strip()]
    bins: dict[int, list[float]] = {}
    for s in steps:
        if not s["prefill_tokens"]:
            bins.setdefault(min(s["decode_rows"] // 32 * 32, 224), []).append(s["gap_ms"])
    run = fix_commit(json.loads((can / "canonical_steplog.json").read_text()), commits.get(args.canonical))
    doc = {"what": "the canonical offline workload on an H100 with --step-log: decode step times by running batch "
                   "size (bins of 32 requests), and the prefill steps",
           "command": "python -m minisgl_ref bench offline --step-log steps.jsonl --output run.json",
           "decode_bins": [{"rows_from": b, "steps": len(v), "median_ms": sorted(v)[len(v) // 2],
                            "total_s": sum(v) / 1e3} for b, v in sorted(bins.items())],
           "prefill_steps": [{"prefill_tokens": s["prefill_tokens"], "gap_ms": s["gap_ms"]}
                             for s in steps if s["prefill_tokens"]],
           "run": run}
    (DATA / "canonical_steps_h100.json").write_text(json.dumps(doc, indent=1) + "\n")
    shutil.copy(Path(args.stall) / "prefill_stall_h100.json", DATA / "prefill_stall_h100.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
