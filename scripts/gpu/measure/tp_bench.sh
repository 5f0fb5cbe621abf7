#!/usr/bin/env bash
# Chapter 09's GPU run on two GPUs: tensor parallelism checked (tp=2 against tp=1 on a small Qwen3, bf16) and
# measured (decode step time at batch 1 and 64, and the canonical offline workload, on a Qwen3-14B config with
# dummy weights, at tp=1 and tp=2), plus the collectives of one forward pass counted and timed. About 8 minutes.
# Every phase runs in its own process under its own time limit and writes its own JSON, so a slow phase costs
# only its own numbers; the last step merges them into $OUT/tp_bench.json (with provenance).
#
# On a machine with two GPUs and flashinfer-python and FlashAttention-3 installed, from the repository root:
#   export PYTHONPATH=$PWD:$PYTHONPATH && bash scripts/gpu/measure/tp_bench.sh
# Set NCCL_NVLS_ENABLE=0 (NVLink multicast off) first; this script refuses to run without it.
# Knobs (environment): NUM_PROMPTS (canonical workload size, default 256), MODEL (default qwen3-14b),
# CHECK_MODEL (default qwen3-0.6b), DECODE_BS (default 1,64), ENGINE_ARGS (JSON engine keyword arguments, default
# {}; e.g. '{"disable_cuda_graph": true}'), OUT (default results), and the time limits CHECK_LIMIT (120 s), RUN_LIMIT (190 s
# for each tp size) and COMM_DEADLINE (480: the comm phase runs only if less time than this has passed). If the tp=2 run fails to produce decode times with
# the default engine, it is retried once with CUDA graphs off (a CUDA graph that captures NCCL calls is the likeliest
# thing to break), as tp2_run_eager.
# On a copy of the working tree whose .git is stale, pass the commit in, as
#   MINISGL_GIT_COMMIT=<output of git rev-parse HEAD here>, so the results' provenance names the right one.
set -o pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
if [ "$NCCL_NVLS_ENABLE" != 0 ]; then
    echo "NCCL_NVLS_ENABLE must be 0 on this machine (source the GPU prelude)" >&2
    exit 2
fi
LOG="$OUT/tp_bench.log"
: >"$LOG"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt" | tee -a "$LOG"
ngpu=$(nvidia-smi -L | wc -l)
if [ "$ngpu" -lt 2 ]; then
    echo "tensor parallelism needs 2 GPUs, found $ngpu" | tee -a "$LOG" >&2
    exit 2
fi

MODEL=${MODEL:-qwen3-14b}
CHECK_MODEL=${CHECK_MODEL:-qwen3-0.6b}
NUM_PROMPTS=${NUM_PROMPTS:-256}
DECODE_BS=${DECODE_BS:-1,64}
ENGINE_ARGS=${ENGINE_ARGS:-"{}"}
DTYPE=${DTYPE:-bfloat16}
DEVICE=${DEVICE:-cuda}  # (DEVICE=cpu DTYPE=float32 with a fake nvidia-smi is how the script was dry-run on a CPU)
bench="python3 -m benchmarks.tp"
status=0

phase() {  # phase NAME TIMEOUT_S ARGS...: run one phase, log it, remember a failure
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s, elapsed ${SECONDS}s) ===" | tee -a "$LOG"
    timeout --kill-after=10 "$limit" $bench "$@" --output "$OUT/$name.json" 2>&1 | tee -a "$LOG"
    local rc=$?
    [ $rc -ne 0 ] && { echo "=== $name: exit status $rc ===" | tee -a "$LOG"; status=1; }
    return 0
}

# 1. Correctness: logits and greedy tokens, tp=2 against tp=1, bf16, on a small model.
phase tp_check "${CHECK_LIMIT:-120}" --phase check --device "$DEVICE" --tp-size 2 --dtype "$DTYPE" --check-model "$CHECK_MODEL" --check-load-format dummy \
    --engine-args "$ENGINE_ARGS"
# 2-3. Speed: the same measurements at tp=1 and tp=2 on the big model (decode steps first: they are quick).
for tp in 1 2; do
    phase "tp${tp}_run" "${RUN_LIMIT:-190}" --phase run --device "$DEVICE" --tp-size $tp --model-path "$MODEL" --load-format dummy --dtype "$DTYPE" \
        --decode-batch-sizes "$DECODE_BS" --num-prompts "$NUM_PROMPTS" --engine-args "$ENGINE_ARGS"
done
extra_inputs=""
if ! grep -q '"step_s"' "$OUT/tp2_run.json" 2>/dev/null && [ "$SECONDS" -lt 380 ]; then
    phase tp2_run_eager 150 --phase run --device "$DEVICE" --tp-size 2 --model-path "$MODEL" --load-format dummy --dtype "$DTYPE" \
        --decode-batch-sizes "$DECODE_BS" --num-prompts "$((NUM_PROMPTS / 2))" \
        --engine-args '{"disable_cuda_graph": true}'
    extra_inputs="$OUT/tp2_run_eager.json"
fi
# 4. Communication of one prefill (512 tokens) and one decode (batch 64) forward pass, if time is left.
if [ "$SECONDS" -lt "${COMM_DEADLINE:-480}" ]; then
    phase tp_comm 80 --phase comm --tp-size 2 --model-path "$MODEL" --load-format dummy --dtype "$DTYPE" \
        --device "$DEVICE" --comm-prefill-tokens 512 --comm-decode-batch 64
fi
$bench --phase merge --inputs "$OUT"/tp_check.json "$OUT"/tp1_run.json "$OUT"/tp2_run.json "$OUT"/tp_comm.json \
    $extra_inputs --output "$OUT/tp_bench.json" 2>&1 | tee -a "$LOG" || status=1

echo "=== summary (${SECONDS}s) ===" | tee -a "$LOG"
grep -E "^\[tp\]" "$LOG" | grep -v wrote
exit $status
