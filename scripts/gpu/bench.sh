#!/usr/bin/env bash
# The canonical workload from a cold start: `bench offline` in a first process (empty compile caches: it pays
# for every JIT and Triton compile at start-up) and in a second one (warm disk caches), one JSON with both.
#   bash scripts/gpu/bench.sh OUTPUT.json [extra bench offline args...]
set -euo pipefail
out=$1; shift
tmp=$(mktemp -d)
python3 -m minisgl_ref bench offline --output "$tmp/cold.json" "$@"
python3 -m minisgl_ref bench offline --output "$tmp/warm.json" "$@"
python3 - "$out" "$tmp" "$*" <<'PY'
import json, os, sys
out, tmp, extra = sys.argv[1:]
doc = {"what": "the canonical workload from a cold start: a first process (cold compile caches), then a second",
       "command": ("python -m minisgl_ref bench offline " + extra).strip(),
       "git_commit": os.environ.get("MINISGL_GIT_COMMIT", "unknown"),
       "cold": json.load(open(f"{tmp}/cold.json")), "warm": json.load(open(f"{tmp}/warm.json"))}
json.dump(doc, open(out, "w"), indent=1)
for k in ("cold", "warm"):
    r = doc[k]["results"][0]
    print(f"{k}: start-up {r['startup_s']:.1f} s, {r['output_throughput']:,.0f} output tok/s "
          f"({r['roofline_fraction']:.1%} of the floor), compiled during the run: {r.get('compiled_during_run')}")
PY
