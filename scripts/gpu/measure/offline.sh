#!/usr/bin/env bash
# Chapters 08 and 11's GPU run: the CUDA-graph and fused-op tests, decode step times (graph vs eager), the
# canonical offline workload with the full engine, the stage ladder by attention backend and CUDA graphs, and
# profiles. Everything lands in $OUT (gpu_offline_h100.json, logs, profile tables).
#
# On a GPU machine with flashinfer-python and FlashAttention-3 installed, from the repository root:
#   bash scripts/gpu/measure/offline.sh                 # tests + everything
#   ... && bash scripts/gpu/measure/offline.sh quick       # tests, step times, canonical run, profiles (no ladder)
#   ... && PARTS=ladder bash scripts/gpu/measure/offline.sh bench                                # one part only
# Anywhere else with CUDA and flashinfer / FA3 installed: OUT=results bash scripts/gpu/measure/offline.sh
# On a copy of the working tree whose .git is stale, pass the commit in, as
#   MINISGL_GIT_COMMIT=<output of git rev-parse HEAD here>, so the results' provenance names the right one.
set -o pipefail
what=${1:-all}
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer_ws}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"

# FlashInfer JIT-compiles each kernel family on first use (~25 s each): compile them side by side first.
t0=$(date +%s)
python3 scripts/gpu/measure/attention_warmup.py bench >"$OUT/warmup_attention.log" 2>&1 &
python3 - >"$OUT/warmup_fused.log" 2>&1 <<'PY' &
import torch
from minisgl_ref.perf import fused_ops, kernels
x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
w = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
print("flashinfer importable:", fused_ops._flashinfer() is not None)
if fused_ops.fused_available(x):
    fused_ops.rmsnorm(x, w, 1e-6); fused_ops.fused_add_rmsnorm(x.clone(), x.clone(), w, 1e-6); fused_ops.silu_and_mul(x)
    from minisgl_ref.layers.rotary import RotaryEmbedding
    rope = RotaryEmbedding(128, 4096, 1e6).cuda()
    q = torch.randn(4, 16, 128, device="cuda", dtype=torch.bfloat16)
    fused_ops.rope_inplace(torch.arange(4, device="cuda"), q, q[:, :8].clone(), kernels.cos_sin_cache(rope, q.device))
    torch.cuda.synchronize()
    print("fused ops compiled")
PY
wait
echo "JIT warm-up: $(( $(date +%s) - t0 )) s"; tail -n 2 "$OUT/warmup_attention.log" "$OUT/warmup_fused.log"

status=0
if [ "$what" = all ] || [ "$what" = quick ] || [ "$what" = tests ]; then
    timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -m gpu -p no:cacheprovider -q -rfEs --durations=10 \
        ${TESTS:-tests/test_cuda_graph.py tests/test_fused_ops.py} ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log" || status=1
fi
case "$what" in
    all) parts=${PARTS:-bandwidth,steps,canonical,profile,ladder} ;;
    quick) parts=${PARTS:-bandwidth,steps,canonical,profile} ;;
    bench) parts=${PARTS:-bandwidth,steps,canonical,profile,ladder} ;;
    *) parts="" ;;
esac
if [ -n "$parts" ]; then
    python3 scripts/gpu/measure/offline_suite.py --parts "$parts" --out "$OUT" ${SUITE_ARGS:-} 2>&1 \
        | tee "$OUT/suite.log" || status=1
fi
echo "=== summary ==="
grep -E "passed|failed|error" "$OUT/pytest.log" 2>/dev/null | tail -3
sed -n '/^canonical:/,$p' "$OUT/suite.log" 2>/dev/null
exit $status
