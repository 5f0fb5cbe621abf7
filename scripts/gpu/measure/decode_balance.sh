#!/usr/bin/env bash
# Decode attention at the canonical workload's stages, every way of cutting the work (benchmarks/decode_balance.py).
# From the repository root on a GPU machine with flashinfer-python (and FlashAttention-3 for the fa3 variant):
#   OUT=results bash scripts/gpu/measure/decode_balance.sh --uniform --marks 256,128,16
# Extra arguments go to benchmarks/decode_balance.py. Writes $OUT/decode_balance_h100.json and the compile logs.
set -o pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer_ws}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
t0=$(date +%s)
# FlashInfer compiles each kernel family on first use: the CUDA-core and the tensor-core decode side by side.
python3 -c "from benchmarks.decode_balance import warm; warm(False)" >"$OUT/warm_cuda_cores.log" 2>&1 &
python3 -c "from benchmarks.decode_balance import warm; warm(True)" >"$OUT/warm_tensor_cores.log" 2>&1 &
wait
echo "JIT warm-up: $(( $(date +%s) - t0 )) s"; tail -n 3 "$OUT"/warm_*.log
python3 -m benchmarks.decode_balance --output "$OUT/decode_balance_h100.json" "$@"
