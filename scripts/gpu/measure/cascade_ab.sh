#!/usr/bin/env bash
# Cascade decode attention, A/B on SGLang's shared-prefix workload (chapter 11): `bench offline --workload
# shared-prefix` (64 groups x 16 prompts, 2,048-token system prompts, 128-token questions, 256 output tokens,
# Qwen3-0.6B with dummy bf16 weights, default engine) three times, each in a fresh process:
#
#   radix_cascade    radix cache on, cascade on (the default engine)
#   radix_plain      radix cache on, --disable-cascade-attention
#   noradix          --disable-radix-cache (nothing is shared, so there is no cascade either: this is also
#                    "radix off, cascade on")
#
# One JSON per run in $OUT (bench offline's results file: throughput, roofline, and with the cascade the KV bytes
# per decode step with and without it), then a summary table and $OUT/cascade_ab_summary.json.
#
# On an H100 with flashinfer-python and FlashAttention-3 installed, from the repository root:
#   bash scripts/gpu/measure/cascade_ab.sh
#   OUT=results BENCH_ARGS="--gsp-groups 16" bash scripts/gpu/measure/cascade_ab.sh     # a quarter of the workload
#   RUNS="radix_cascade radix_plain" bash scripts/gpu/measure/cascade_ab.sh             # skip the slow radix-off run
#   SKIP_WARMUP=1 ...                     # the machine has run the engine already (kernels compiled and cached)
set -o pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer_ws}
status=0
# A fresh machine compiles kernels on first use (FlashInfer's JIT, Triton, ~2 min) and caches them on disk. bench
# offline's own warm-up is four tiny requests, which leaves some of that to the first timed run, so a short
# shared-prefix run in a process of its own (cascade on: it captures both sets of decode graphs) goes first.
if [ "${SKIP_WARMUP:-0}" != 1 ]; then
    echo "=== warm-up (not recorded)"
    python3 -m minisgl_ref bench offline --workload shared-prefix --gsp-groups 4 --gsp-output-len 16 \
        >"$OUT/shared_prefix_warmup.log" 2>&1 || { status=1; tail -n 20 "$OUT/shared_prefix_warmup.log"; }
fi
for run in ${RUNS:-radix_cascade radix_plain noradix}; do
    case "$run" in
        radix_cascade) flags="" ;;
        radix_plain) flags="--disable-cascade-attention" ;;
        noradix) flags="--disable-radix-cache" ;;
        *) echo "unknown run $run" >&2; exit 2 ;;
    esac
    echo "=== $run: bench offline --workload shared-prefix $flags ${BENCH_ARGS:-}"
    python3 -m minisgl_ref bench offline --workload shared-prefix $flags ${BENCH_ARGS:-} \
        --output "$OUT/shared_prefix_$run.json" 2>&1 | tee "$OUT/shared_prefix_$run.log" || status=1
done
python3 - "$OUT" <<'PY' || status=1
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
runs = {}
for name in ("radix_cascade", "radix_plain", "noradix"):
    f = out / f"shared_prefix_{name}.json"
    if f.exists():
        runs[name] = json.loads(f.read_text())["results"][0]
print(f"{'run':<15} {'out tok/s':>10} {'wall s':>8} {'decode steps':>12} {'cascade':>8} {'KV GB/step':>11} {'plain GB/step':>13}")
for name, r in runs.items():
    gb = lambda v: "-" if v is None else f"{v / 1e9:.2f}"  # noqa: E731
    print(f"{name:<15} {r['output_throughput']:>10,.0f} {r['wall_s']:>8.2f} {r.get('decode_steps') or '-':>12} "
          f"{r.get('cascade_decode_steps') or '-':>8} {gb(r.get('kv_bytes_per_decode_step')):>11} "
          f"{gb(r.get('kv_bytes_per_decode_step_plain')):>13}")
summary = {name: {k: r.get(k) for k in ("output_throughput", "wall_s", "decode_steps", "cascade_decode_steps",
                                        "kv_bytes_per_decode_step", "kv_bytes_per_decode_step_plain",
                                        "roofline_fraction")} for name, r in runs.items()}
if "noradix" in runs:
    base = runs["noradix"]["output_throughput"]
    for name in ("radix_cascade", "radix_plain"):
        if name in runs:
            summary[name]["x_vs_noradix"] = runs[name]["output_throughput"] / base
            print(f"{name} / noradix: {summary[name]['x_vs_noradix']:.2f}x")
if {"radix_cascade", "radix_plain"} <= runs.keys():
    x = runs["radix_cascade"]["output_throughput"] / runs["radix_plain"]["output_throughput"]
    summary["cascade_speedup"] = x
    print(f"cascade on / off (radix on): {x:.2f}x")
(out / "cascade_ab_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
PY
exit $status
