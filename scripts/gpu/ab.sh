#!/usr/bin/env bash
# Compare the canonical offline workload between this checkout and another one (say, an older commit unpacked
# with `git archive OLD | tar -x -C .baseline`), in interleaved processes: A B A B ... Each process runs one
# untimed warm-up and two timed runs (benchmarks/canonical_ab.py), so the result holds the spread within a
# process and between processes, for both versions. Writes $OUT/canonical_ab.json.
#
#   BASE=.baseline BASE_LABEL=7ceb3f6 NEW_LABEL=$(git rev-parse --short HEAD) bash scripts/gpu/ab.sh
# BASE_ARGS and NEW_ARGS are extra arguments of each side's benchmarks/canonical_ab.py: with BASE=. the same
# checkout against itself under two settings, e.g. NEW_ARGS="--page-size 64". BASE_ENV and NEW_ENV are extra
# environment assignments for each side's process, e.g. NEW_ENV="MINISGL_FOLD_NORMS=0".
set -euo pipefail
OUT=${OUT:-results}
BASE=${BASE:-.baseline}
ROUNDS=${ROUNDS:-2}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer_ws}
here=$PWD
rows="$OUT/canonical_ab.jsonl"
: >"$rows"
for round in $(seq 1 "$ROUNDS"); do
    for side in base new; do
        if [ $side = base ]; then root=$BASE label=${BASE_LABEL:-base} args=${BASE_ARGS:-} vars=${BASE_ENV:-}
        else root=$here label=${NEW_LABEL:-new} args=${NEW_ARGS:-} vars=${NEW_ENV:-}; fi
        env $vars PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" python3 benchmarks/canonical_ab.py --label "$label" $args \
            2> >(tail -n 5 >"$OUT/ab_${side}_${round}.err") | tee -a "$rows"
    done
done
python3 - "$rows" "$OUT/canonical_ab.json" <<'PY'
import json, os, sys
from minisgl_ref.bench.provenance import collect_provenance
rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
by = {}
for r in rows:
    by.setdefault(r["label"], []).extend(x["tok_s"] for x in r["runs"])
summary = {k: {"runs_tok_s": v, "min": min(v), "max": max(v), "median": sorted(v)[len(v) // 2]} for k, v in by.items()}
json.dump({"benchmark": "canonical_ab", "workload": "canonical offline, 256 requests, 133,966 output tokens",
           "model": "qwen3-0.6b (dummy weights, bf16)", "processes": rows, "summary": summary,
           "provenance": collect_provenance(["scripts/gpu/ab.sh"], base=os.environ.get("BASE_LABEL"),
                                            new=os.environ.get("NEW_LABEL"), rounds=os.environ.get("ROUNDS"),
                                            **{k.lower(): os.environ[k] for k in ("BASE_ARGS", "NEW_ARGS", "BASE_ENV",
                                                                                "NEW_ENV") if os.environ.get(k)})},
          open(sys.argv[2], "w"), indent=1)
for k, s in summary.items():
    print(f"{k:>12}: {', '.join(f'{x:,.0f}' for x in s['runs_tok_s'])} tok/s (median {s['median']:,.0f})")
PY
