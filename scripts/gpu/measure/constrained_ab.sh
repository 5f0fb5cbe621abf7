#!/usr/bin/env bash
# Chapter 12's GPU numbers against earlier versions of the engine, one after another on one GPU:
#   1. benchmarks/h2d_copy.py: does a bitmask-sized copy make the host wait for the GPU?
#   2. scripts/gpu/measure/constrained_bench.py (typical schema, constrained against free twins) at batch 32 and 64 for
#      this checkout and for each overlay directory in OVERLAYS (files laid over the checkout for that run: an
#      older engine.py, say, from `git show REV:path`), then restored;
#   3. the full bench for this checkout (batch 1/32/64/256, with jump-forward) unless FULL=0.
# The embedded model must resolve (scripts/gpu/measure/embedded_model.sh on a machine without a package index).
#   OUT=results OVERLAYS="old/before old/order" bash scripts/gpu/measure/constrained_ab.sh
set -o pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer_ws}
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
stamp "embedded model"
python3 -c "from minisgl_ref.models.embedded import embedded_model_path; print(embedded_model_path())" 2>&1 | tail -n 1
stamp "host side of bitmask copies"
timeout 60 python3 -m benchmarks.h2d_copy --output "$OUT/h2d_copy_h100.json" 2>&1 | tail -n 5
bench() {  # name, extra arguments
    local name=$1; shift
    stamp "constrained bench: $name"
    local log=/tmp/constrained_ab_${name}.log
    timeout "${LIMIT:-150}" python3 scripts/gpu/measure/constrained_bench.py "$OUT/constrained_ab_${name}.json" --schema typical \
        --max-new-tokens 320 "$@" >"$log" 2>&1
    grep "^bs" "$log" || { tail -n 5 "$log"; cp "$log" "$OUT/"; }
}
REPEATS=${REPEATS:-5}
bench current --batch-sizes 32 64 --skip-jump-forward --repeats "$REPEATS"
for overlay in ${OVERLAYS:-}; do
    name=$(basename "$overlay")
    backup=$(mktemp -d)
    files=$(cd "$overlay" && find . -type f)
    for f in $files; do mkdir -p "$backup/$(dirname "$f")"; cp "$f" "$backup/$f"; cp "$overlay/$f" "$f"; done
    bench "$name" --batch-sizes 32 64 --skip-jump-forward --repeats "$REPEATS"
    for f in $files; do cp "$backup/$f" "$f"; done
done
bench current_again --batch-sizes 32 64 --skip-jump-forward --repeats "$REPEATS"
if [ "${FULL:-1}" = 1 ]; then LIMIT=300 bench full --batch-sizes 1 32 64 256 --repeats "$REPEATS"; fi
stamp done
