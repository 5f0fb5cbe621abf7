#!/usr/bin/env bash
# Chapters 14 and 15's GPU run, in parts of up to about ten minutes (PART=tests|canonical|decode|steps|moe). Results
# go to $OUT with provenance; the published files are made from them by scripts/gpu/measure/quantization_publish.py.
#
#   tests      the GPU tests of FP8 weights, the FP8 cache, the FP8 GEMM and the MoE layer (pytest -m gpu).
#   canonical  the canonical offline workload on Qwen3-0.6B (dummy weights), one fresh process per variant
#              (VARIANTS): bf16, FP8 projections with group scales (fp8) or per-channel ones (w8a8_fp8), an FP8
#              cache (fp8_kv), FP8 projections and cache (both); ROUND names the round (cold: the first on a
#              machine, kernels compiled in it; warm: a repeat with the compile caches filled).
#   decode     Qwen3-0.6B decode steps at 64 and 256 requests of 1,024 tokens (quant_steps.py): bf16 with the
#              default decode kernels, bf16 on FlashInfer alone, and an FP8 cache (FlashInfer).
#   steps      decode step times of Qwen3-14B at batch 1, 16 and 64 by FP8 projection variant (quant_steps.py).
#   moe        Qwen3-30B-A3B (dummy weights) on the canonical workload with its routing counted, then the fused
#              MoE kernel against the reference loop (moe_endtoend.py).
#
# Pass MINISGL_GIT_COMMIT=<commit> where the copy's .git is stale; BW: the bandwidth for the floors (bytes/s).
set -o pipefail
OUT=${OUT:-results}
PART=${PART:?PART=tests, canonical, decode or moe}
BW=${BW:-4.278e12}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu_$PART.txt"
bench() {  # bench NAME LIMIT FLAGS...: one bench offline run in a fresh process
    local name=$1 limit=$2; shift 2
    local t0=$(date +%s)
    timeout --kill-after=10 "$limit" python3 -m minisgl_ref bench offline --load-format dummy --dtype bfloat16 \
        --device cuda --hbm-bandwidth "$BW" --output "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
    echo "$name: rc=$? $(( $(date +%s) - t0 )) s"; tail -n 4 "$OUT/$name.log"
}
case $PART in
tests)
    timeout --kill-after=10 "${TEST_LIMIT:-240}" python3 -m pytest -m gpu -p no:cacheprovider -q -rfEs \
        -n "${WORKERS:-4}" --durations=10 tests/test_fp8_weights.py tests/test_fp8_kv_cache.py \
        tests/test_fp8_gemm.py tests/test_fused_moe.py tests/test_moe_models.py tests/test_moe_distribution.py \
        tests/test_moe_ep.py 2>&1 | tee "$OUT/gpu_tests_quant.txt" | tail -n 40
    ;;
canonical)
    ROUND=${ROUND:-cold}
    for v in ${VARIANTS:-bf16 fp8 w8a8_fp8 fp8_kv both}; do
        case $v in
        bf16) flags=() ;;
        fp8) flags=(--quantization fp8) ;;
        w8a8_fp8) flags=(--quantization w8a8_fp8) ;;
        fp8_kv) flags=(--kv-cache-dtype fp8_e4m3) ;;
        both) flags=(--quantization fp8 --kv-cache-dtype fp8_e4m3) ;;
        esac
        bench "fp8_canonical_${v}_$ROUND" 150 --model-path qwen3-0.6b "${flags[@]}"
    done
    ;;
decode)
    timeout --kill-after=10 "${DECODE_LIMIT:-200}" python3 scripts/gpu/measure/quant_steps.py --out "$OUT" \
        --model qwen3-0.6b --variants none,nosplit,fp8_kv --batch-sizes 64,256 --context 1024 --attention default \
        --label kv --bandwidth "$BW" > "$OUT/quant_steps_kv.log" 2>&1
    echo "quant_steps kv: rc=$?"; tail -n 8 "$OUT/quant_steps_kv.log"
    ;;
steps)
    timeout --kill-after=10 "${STEPS_LIMIT:-300}" python3 scripts/gpu/measure/quant_steps.py --out "$OUT" \
        --bandwidth "$BW" > "$OUT/quant_steps_weights.log" 2>&1
    echo "quant_steps: rc=$?"; tail -n 12 "$OUT/quant_steps_weights.log"
    ;;
moe)
    bench moe_canonical_qwen3_30b_a3b 300 --model-path qwen3-30b-a3b --enable-expert-distribution-metrics
    timeout --kill-after=10 "${ENDTOEND_LIMIT:-240}" python3 scripts/gpu/measure/moe_endtoend.py --out "$OUT" \
        > "$OUT/moe_endtoend.log" 2>&1
    echo "moe_endtoend: rc=$?"; tail -n 12 "$OUT/moe_endtoend.log"
    ;;
esac
