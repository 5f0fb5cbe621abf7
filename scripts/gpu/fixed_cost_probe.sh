#!/usr/bin/env bash
# What a decode step costs beyond reading the KV cache, in one GPU session (chapter 11):
#   1. the GPU tests of the Triton attention kernels (MINISGL_TEST_BACKENDS=triton) and of the fused draw;
#   2. the sampler's draw, this checkout's kernel against an older one (scripts/gpu/sampler_ab.py): alone, and on
#      the canonical workload in one process, runs alternating;
#   3. the kernel gaps of decode steps at 256, 64 and 16 running (scripts/gpu/decode_anatomy.py);
#   4. decode attention cut into pieces of 128/256 tokens (benchmarks/decode_balance.py, variant fi_chunkN).
# Each part has a time limit; a part that runs out leaves its log. PARTS picks some (default: all four). From the
# repository root:
#   OLD=path/to/old_files OUT=results [PARTS="tests sampler anatomy balance"] bash scripts/gpu/fixed_cost_probe.sh
# where OLD holds old_race_kernel.py and old_fused_draw.py (`git show REV:minisgl_ref/sampling/...`).
set -o pipefail
OUT=${OUT:-results}
OLD=${OLD:-old}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer_ws}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
PARTS=${PARTS:-tests sampler anatomy balance}
want() { [[ " $PARTS " == *" $1 "* ]]; }

if want tests; then
stamp "GPU tests: Triton attention kernels, cascade, fused draw"
MINISGL_TEST_BACKENDS=triton timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_attention_backends.py tests/test_cascade_attention.py -k "not default" >"$OUT/gpu_tests_triton.txt" 2>&1
echo "rc=$?" >>"$OUT/gpu_tests_triton.txt"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_sampling.py -k "fused" >>"$OUT/gpu_tests_triton.txt" 2>&1
echo "rc=$?" >>"$OUT/gpu_tests_triton.txt"
tail -n 4 "$OUT/gpu_tests_triton.txt"
fi

if want sampler; then
stamp "sampler A/B"
timeout 200 python3 scripts/gpu/sampler_ab.py "$OUT/sampler_ab_h100.json" --old-kernel "$OLD/old_race_kernel.py" \
    --old-launcher "$OLD/old_fused_draw.py" --pairs 2 >"$OUT/sampler_ab.log" 2>&1
tail -n 9 "$OUT/sampler_ab.log"
fi

if want anatomy; then
stamp "decode anatomy with kernel gaps"
timeout 150 python3 scripts/gpu/decode_anatomy.py --out "$OUT" --at 256,64,16 --label gaps --no-launch-cost \
    >"$OUT/decode_anatomy.log" 2>&1
tail -n 12 "$OUT/decode_anatomy.log"
fi

if want balance; then
stamp "decode attention in pieces"
timeout 150 python3 -m benchmarks.decode_balance --output "$OUT/decode_balance_chunks_h100.json" --uniform \
    --marks 256,128,16 --variants fi_graph,fi_chunk128,fi_chunk256 >"$OUT/decode_balance.log" 2>&1
tail -n 12 "$OUT/decode_balance.log"
fi
stamp "done"
