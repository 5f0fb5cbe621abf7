#!/usr/bin/env bash
# The GPU checks that a change to the engine's structure must pass, in three parts (PART=tests|tp|ab), each up
# to about ten minutes. Results go to $OUT with provenance; logs are tarred.
#
#   tests  every GPU test (pytest -m gpu): attention backends, cascade, CUDA graphs, sampling, fused ops, folded
#          norms, the server on a GPU. FA3 and FlashInfer must be installed (the GPU prelude).
#   tp     tensor parallelism on two GPUs: tp=2 against tp=1 (logits, greedy tokens), then an offline LLM and a
#          served model at --tp-size 2, started and stopped as a user does (scripts/gpu/measure/parallel_serving.py).
#   ab     the canonical offline workload, interleaved processes of $BASE (an older checkout) and this one
#          (scripts/gpu/ab.sh), then the shared-prefix workload with the radix cache on and off.
#
# Pass MINISGL_GIT_COMMIT=<commit> where the copy's .git is stale.
set -o pipefail
OUT=${OUT:-results}
PART=${PART:?PART=tests, tp or ab}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu_$PART.txt"
case $PART in
tests)
    timeout --kill-after=10 "${TEST_LIMIT:-500}" python3 -m pytest -m gpu -p no:cacheprovider -q -rfEs \
        -n "${WORKERS:-4}" --durations=15 --ignore=tests/test_site_browser.py \
        --ignore=tests/test_notebooks.py tests/ 2>&1 | tee "$OUT/gpu_tests.txt"
    ;;
tp)
    timeout --kill-after=10 150 python3 -m benchmarks.tp --phase check --tp-size 2 --dtype bfloat16 \
        --check-model qwen3-0.6b --check-load-format dummy --output "$OUT/tp_check.json" 2>&1 | tee "$OUT/tp_check.log"
    timeout --kill-after=10 360 python3 scripts/gpu/measure/parallel_serving.py --out "$OUT" --phases tp_exit,tp_serve \
        2>&1 | tee "$OUT/parallel_serving.log"
    ;;
ab)
    BASE=${BASE:-.baseline} ROUNDS=${ROUNDS:-2} OUT=$OUT bash scripts/gpu/ab.sh
    for radix in on off; do
        flag=""; [ $radix = off ] && flag=--disable-radix-cache
        timeout --kill-after=10 150 python3 -m minisgl_ref bench offline --model-path qwen3-0.6b --load-format dummy \
            --dtype bfloat16 --device cuda --workload shared-prefix $flag --output "$OUT/shared_prefix_radix_$radix.json" \
            2>&1 | tail -n 25 | tee "$OUT/shared_prefix_radix_$radix.log"
    done
    ;;
esac
