#!/usr/bin/env bash
# Chapter 11's start-up and shared-prefix measurements, from a cold start, in one go:
#
#   startup   `bench offline` (canonical workload) in a first process after a cold start (every kernel cache
#             empty), then in a second process (caches on disk): start-up seconds and the first timed run of each.
#   cascade   scripts/gpu/measure/cascade_ab.sh: the shared-prefix workload with the radix cache and cascade attention,
#             the radix cache without it, and no radix cache.
#   profile   scripts/gpu/measure/cascade_profile.py: GPU time per kernel of cascade decode steps (16 groups of 16).
#   triton    `bench offline` (canonical) with --attention-backend triton, twice (the first run compiles its
#             kernels), to hold against the default backend's warm run.
#   tests     the GPU tests of the attention backends, the cascade, CUDA graphs and the fused kernels.
#   serving   scripts/gpu/measure/serving_sweep.sh: bench serving against serve at three Poisson rates and saturation.
#   grammar   scripts/gpu/measure/constrained_bench.py: a JSON-schema grammar's cost per output token, and jump-forward
#             ($GRAMMAR_ARGS go to it, e.g. a model folder with dummy weights).
#
# From the repository root on a GPU machine with flashinfer-python and FlashAttention-3 installed:
#   OUT=results bash scripts/gpu/measure/startup_and_shared_prefix.sh startup cascade tests serving grammar
set -o pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer_ws}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
status=0
for part in "$@"; do
    case "$part" in
        startup)
            for run in cold warm; do
                echo "=== startup/$run: bench offline (canonical), a fresh process"
                python3 -m minisgl_ref bench offline --output "$OUT/startup_$run.json" 2>&1 \
                    | tee "$OUT/startup_$run.log" | grep -E "warm-up|compil|ready|\[bench\]|out tok/s|^ *[a-z_]+ +[0-9]" \
                    || status=1
            done
            python3 - "$OUT" <<'PY' || status=1
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for run in ("cold", "warm"):
    r = json.loads((out / f"startup_{run}.json").read_text())["results"][0]
    print(f"{run:<5} start-up {r['startup_s']:6.1f} s   first timed run {r['output_throughput']:9,.0f} tok/s "
          f"({r['wall_s']:.2f} s, {r['roofline_fraction']:.0%} of the floor)")
PY
            ;;
        cascade)
            OUT="$OUT" bash scripts/gpu/measure/cascade_ab.sh || status=1 ;;
        profile)
            python3 scripts/gpu/measure/cascade_profile.py "$OUT/cascade_profile.json" 2>&1 | tail -n 24 || status=1 ;;
        triton)
            for run in 1 2; do
                python3 -m minisgl_ref bench offline --attention-backend triton --output "$OUT/triton_backend_$run.json" \
                    2>&1 | grep -E "^overlap|start-up|compiled" || status=1
            done ;;
        tests)
            python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_cascade_attention.py \
                tests/test_attention_backends.py tests/test_cuda_graph.py tests/test_triton_fused.py \
                2>&1 | tail -n 30 | tee "$OUT/gpu_tests.log" || status=1 ;;
        serving)
            OUT="$OUT" bash scripts/gpu/measure/serving_sweep.sh || status=1 ;;
        grammar)
            python3 scripts/gpu/measure/constrained_bench.py "$OUT/constrained_bench_h100.json" ${GRAMMAR_ARGS:-} 2>&1 \
                | tee "$OUT/constrained_bench.log" | tail -n 4 || status=1 ;;
        *) echo "unknown part $part" >&2; exit 2 ;;
    esac
done
exit $status
