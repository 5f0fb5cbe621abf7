#!/usr/bin/env bash
# One chapter's GPU measurements: the runs behind the data files the chapter cites (docs/data/*_h100.json,
# *_h200.json), written into $OUT (default results/). Publish a result by copying it into docs/data/ under the name
# the chapter reads (the table in scripts/gpu/README.md), then `python scripts/benchmarks_page.py`.
#
#   bash scripts/gpu/chapter.sh NN [PART ...]     # NN: 07 to 12; no PART: every part of that chapter
#   bash scripts/gpu/chapter.sh list              # the parts of every chapter
#
# Run from the repository root on a CUDA machine with the engine installed (`pip install -e ".[dev]"`),
# flashinfer-python and FlashAttention-3 (scripts/gpu/README.md says what each chapter needs). Chapter 09 and the
# `dp` part of chapter 10 need two GPUs and NCCL_NVLS_ENABLE=0. On a copy of the checkout without a usable .git,
# pass MINISGL_GIT_COMMIT=$(git rev-parse HEAD) so that the results' provenance names the commit that ran.
set -o pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
M=$here/measure
OUT=${OUT:-results}
export OUT PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer_ws}

# The parts of each chapter, in the order they run when none is named.
declare -A PARTS=(
    [07]="attention"
    [08]="offline"
    [09]="tp serving"
    [10]="features serving dp"
    [11]="offline anatomy split prefill timeline cascade startup cold sweep mixed"
    [12]="bounded typical real plain mixed adaptive padded random"
)

usage() {  # exit status
    echo "usage: bash scripts/gpu/chapter.sh NN [PART ...]; the parts of each chapter:"
    for ch in 07 08 09 10 11 12; do echo "  $ch: ${PARTS[$ch]}"; done
    exit "${1:-2}"
}

need_nvls_off() {
    [ "${NCCL_NVLS_ENABLE:-}" = 0 ] || { echo "set NCCL_NVLS_ENABLE=0 (NVLink multicast off) first" >&2; exit 2; }
}

# A JSON-schema grammar's cost per output token (chapter 12): OUT file name, then constrained_bench.py arguments.
grammar() {
    local name=$1; shift
    python3 "$M/constrained_bench.py" "$OUT/$name" "$@" 2>&1 | tee "$OUT/${name%.json}.log" | tail -n 6
}

run_part() {  # chapter, part
    case "$1/$2" in
    # Chapter 07: attention backends against torch_native, and the kernel benchmark -> gpu_kernels_h100.json.
    07/attention) bash "$M/attention.sh" all ;;
    # Chapter 08 (and 11, section 3): graph and fused-op tests, step times, the canonical run, the stage ladder,
    # profiles -> gpu_offline_h100.json and its profile tables.
    08/offline | 11/offline) bash "$M/offline.sh" all ;;
    # Chapter 09: tp=2 against tp=1 and the Qwen3-14B runs -> tp_bench.json (docs/data/tp_bench_h200.json).
    09/tp) need_nvls_off; bash "$M/tp_bench.sh" ;;
    # Chapters 09 and 10: serving at --tp-size 2 and --dp-size 2 as a user starts and stops it
    # -> parallel_serving.json (docs/data/parallel_serving_h200.json).
    09/serving) need_nvls_off; python3 "$M/parallel_serving.py" --out "$OUT" --phases tp_exit,tp_serve ;;
    10/dp) need_nvls_off; python3 "$M/parallel_serving.py" --out "$OUT" --phases dp ;;
    # Chapter 10: log probabilities, stop strings and the other per-request features on a GPU
    # -> docs/data/gpu_request_features_h100.json.
    10/features) python3 "$M/request_features.py" --out "$OUT" ;;
    # Chapter 10: `bench serving` against a real server, 200 requests of 1024 prompt and 256 output tokens (half to
    # all of it) at 4 and 16 req/s, then all at once -> bench_serving_h100.json.
    10/serving) SERVERS=default RATES="4 16" NUM_PROMPTS=200 OUTPUT_LEN=256 RANGE_RATIO=0.5 \
        bash "$M/serving_sweep.sh" ;;
    # Chapter 11, section 4: a decode step by kernel kind at each stage -> decode_anatomy_h100.json.
    11/anatomy) python3 "$M/decode_anatomy.py" --out "$OUT" --at 256,128,64,32,16 ;;
    # Chapter 11, section 4: our split-KV kernel against FlashInfer in the 28-layer chain
    # -> decode_balance_split_cap_h100.json (and _small_ with --marks 80,48,32,24,16,8).
    11/split) bash "$M/decode_balance.sh" --variants fi_graph,cudacap_200_4_128 --marks 256,192,160,128,96,64 \
        --layers 28 --slot-order canonical --with-matmuls ;;
    # Chapter 11, section 4: the prefill phase's kernels against its compute floor -> prefill_anatomy_h100.json.
    11/prefill) python3 "$M/prefill_anatomy.py" --out "$OUT" ;;
    # Chapter 11, section 7: the first call of each prefill matmul shape -> matmul_first_call_h100.json.
    11/timeline) python3 "$M/prefill_timeline.py" "$OUT/matmul_first_call_h100" --linear-only ;;
    # Chapter 11, section 5: the shared-prefix workload, radix cache and cascade attention on and off, and the
    # GPU time per kernel of cascade decode steps; section 6: start-up from a cold and a warm process
    # -> startup_and_cascade_h100.json.
    11/cascade) bash "$M/startup_and_shared_prefix.sh" cascade profile ;;
    11/startup) bash "$M/startup_and_shared_prefix.sh" startup ;;
    # Chapter 11, section 6: a cold start, then a warm start -> canonical_cold_start_*_h100.json.
    11/cold) bash "$here/bench.sh" "$OUT/canonical_cold_start.json" ;;
    # Chapter 11, section 7: client latencies beside the engine's step gaps -> bench_serving_sweep_h100.json;
    # mixed steps at 8 and 16 req/s -> serving_mixed_graphs_h100.json.
    11/sweep) NUM_PROMPTS=160 bash "$M/serving_sweep.sh" ;;
    11/mixed) SERVERS="default mixed" RATES="8 16" bash "$M/serving_sweep.sh" ;;
    # Chapter 12 (the embedded model must resolve: measure/embedded_model.sh without a package index).
    # Random weights in float32, bounded strings and the typical schema -> constrained_bench_h100.json,
    # constrained_bench_typical_h100.json; FOLDER holds SmolLM2's config and tokenizer.
    12/bounded) grammar constrained_bench_h100.json --model-path "${FOLDER:?FOLDER=SmolLM2 config folder}" \
        --load-format dummy --max-new-tokens 400 ;;
    12/typical) grammar constrained_bench_typical_h100.json --schema typical \
        --model-path "${FOLDER:?FOLDER=SmolLM2 config folder}" --load-format dummy --max-new-tokens 600 ;;
    # The embedded model's real weights -> constrained_bench_real_{typical,bounded}_h100.json.
    12/real) grammar constrained_bench_real_typical_h100.json --schema typical --max-new-tokens 320
        grammar constrained_bench_real_bounded_h100.json --schema bounded --max-new-tokens 320 ;;
    # In bfloat16 without and with mixed steps -> constrained_bench_typical_{plain,mixed}_h100.json.
    12/plain) grammar constrained_bench_typical_plain_h100.json --schema typical --max-new-tokens 320 \
        --batch-sizes 1 32 64 256 ;;
    12/mixed) grammar constrained_bench_typical_mixed_h100.json --schema typical --max-new-tokens 320 \
        --batch-sizes 1 32 64 256 --mixed ;;
    # Five alternating runs per kind, fills decided step by step -> constrained_bench_typical_adaptive_h100.json;
    # the host side of a mask's copy -> h2d_copy_h100.json.
    12/adaptive) grammar constrained_bench_typical_adaptive_h100.json --schema typical --max-new-tokens 320 \
        --batch-sizes 1 32 64 256 --repeats 5
        python3 -m benchmarks.h2d_copy --output "$OUT/h2d_copy_h100.json" ;;
    # Against a larger forward pass: the 135M model zero-padded to 2.1B, and the 135M model itself
    # -> constrained_bench_typical_padded_rustdecode_h100.json, constrained_bench_typical_135m_rustdecode_h100.json.
    12/padded) python3 "$M/padded_model.py" /tmp/padded
        grammar constrained_bench_typical_padded_rustdecode_h100.json --schema typical --max-new-tokens 160 \
            --batch-sizes 1 64 256 --repeats 5 --skip-jump-forward --model-path /tmp/padded
        grammar constrained_bench_typical_135m_rustdecode_h100.json --schema typical --max-new-tokens 160 \
            --batch-sizes 1 64 256 --repeats 5 --skip-jump-forward ;;
    # SmolLM2-1.7B's shape with random weights -> constrained_bench_typical_random_1p7b_h100.json.
    12/random) python3 "$M/smollm2_1p7b_folder.py" /tmp/random17
        grammar constrained_bench_typical_random_1p7b_h100.json --schema typical --max-new-tokens 160 \
            --batch-sizes 1 64 256 --repeats 5 --skip-jump-forward --model-path /tmp/random17 --load-format dummy ;;
    *) echo "chapter $1 has no part '$2'" >&2; usage >&2 ;;
    esac
}

[ $# -ge 1 ] || usage >&2
if [ "$1" = list ]; then usage 0; fi
chapter=$1; shift
[ -n "${PARTS[$chapter]:-}" ] || usage >&2
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
status=0
for part in ${*:-${PARTS[$chapter]}}; do
    echo "=== chapter $chapter: $part"
    run_part "$chapter" "$part" || status=1
done
exit $status
