#!/usr/bin/env bash
# Chapter 07's GPU run: attention backends against torch_native (pytest -m gpu), the engine on a Qwen3 dummy model
# with every backend, and the kernel microbenchmark. Everything lands in $OUT.
#
# On a GPU machine with flashinfer-python and FlashAttention-3 installed, from the repository root:
#   bash scripts/gpu/measure/attention.sh            # tests + full benchmark
#   ... && bash scripts/gpu/measure/attention.sh tests                                       # tests only
#   ... && bash scripts/gpu/measure/attention.sh bench                                       # benchmark only
# Anywhere else with CUDA, flashinfer-python and FlashAttention-3 installed: OUT=results bash scripts/gpu/measure/attention.sh
# The GPU machine's copy of the checkout has no usable .git: pass the commit for the results' provenance with
#   MINISGL_GIT_COMMIT=$(git rev-parse HEAD).
# Publishing (here, after fetching $OUT): merge the test errors into the benchmark file that chapter 07 reads:
#   python3 scripts/gpu/measure/attention_publish.py OUT/gpu_kernels_h100.json OUT/attention_errors.jsonl OUT/pytest.log \
#       docs/data/gpu_kernels_h100.json
set -o pipefail
what=${1:-all}
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer_ws}
export MINISGL_ATTN_ERRORS=$OUT/attention_errors.jsonl
: >"$MINISGL_ATTN_ERRORS"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"

status=0
if [ "$what" = all ] || [ "$what" = tests ]; then
    python3 scripts/gpu/measure/attention_warmup.py 2>&1 | tee "$OUT/warmup.log"
    timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -m gpu -p no:cacheprovider -q -rfEs --durations=20 \
        tests/test_attention_backends.py ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log" || status=1
else
    python3 scripts/gpu/measure/attention_warmup.py bench 2>&1 | tee "$OUT/warmup.log"
fi
if [ "$what" = all ] || [ "$what" = bench ] || [ "$what" = quick ]; then
    extra=""
    [ "$what" = quick ] && extra="--quick"
    python3 -m benchmarks.kernels $extra --output "$OUT/gpu_kernels_h100.json" 2>&1 | tee "$OUT/bench.log" \
        || status=1
fi
echo "=== summary ==="
grep -E "passed|failed|error" "$OUT/pytest.log" 2>/dev/null | tail -3
grep -E "^target|^copy" "$OUT/bench.log" 2>/dev/null
exit $status
