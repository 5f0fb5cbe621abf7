#!/usr/bin/env bash
# Chapter 11's online serving numbers: `bench serving` against a real `serve` process, Poisson arrivals at three
# request rates and all at once (saturation), the canonical length distribution (prompts and outputs of 100-1024
# tokens, ignore_eos), Qwen3-0.6B config with dummy bf16 weights. Two servers, one after the other: the default
# engine, then --enable-mixed-chunk (decode rows ride along in prefill steps), then mixed chunks with a small
# prefill budget per step (mixed-512: at most 512 prompt tokens beside the decode rows), so that the inter-token
# latency tail with long prompts arriving during decode can be compared. Each server writes a step trace
# (--step-log), and the summary puts the engine's own step gaps beside the client's ITL for each run, which tells
# whether a tail comes from the engine or from the way to the client. SERVERS=nopad is the default engine with
# extend steps unpadded (--extend-token-multiple 1), for the A/B of chapter 11, section 11. One JSON per run in $OUT, then a summary.
#
#   OUT=results bash scripts/gpu/measure/serving_sweep.sh
#   RATES="8 16" SERVERS=default NUM_PROMPTS=100 OUT=results bash scripts/gpu/measure/serving_sweep.sh   # a shorter run
# Other knobs: INPUT_LEN, OUTPUT_LEN (default 1024 each), RANGE_RATIO (default 0.09765625: lengths from 100 to 1024),
# MODEL_ARGS (the served model, default Qwen3-0.6B config, dummy bf16 weights).
set -uo pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer_ws}
read -ra model <<<"${MODEL_ARGS:---model-path qwen3-0.6b --load-format dummy --dtype bfloat16 --device cuda}"
status=0
port=30000
for server in ${SERVERS:-default mixed mixed-512}; do
    case "$server" in
        default) flags=() ;;
        mixed) flags=(--enable-mixed-chunk) ;;
        mixed-512) flags=(--enable-mixed-chunk --chunked-prefill-size 512 --max-prefill-tokens 512) ;;
        nopad) flags=(--extend-token-multiple 1) ;;
        *) echo "unknown server $server" >&2; exit 2 ;;
    esac
    t0=$(date +%s.%N)
    rm -f "$OUT/steps_$server.jsonl" "$OUT/windows_$server.txt"
    python3 -m minisgl_ref serve "${model[@]}" "${flags[@]}" --port $port --step-log "$OUT/steps_$server.jsonl" \
        >"$OUT/serve_$server.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 600); do
        curl -sf http://127.0.0.1:$port/health >/dev/null && break
        kill -0 $pid 2>/dev/null || break
        sleep 0.5
    done
    ready=$(python3 -c "import time; print(f'{time.time() - $t0:.1f}')")
    echo "=== serve ($server) ready after $ready s"
    echo "$ready" >"$OUT/serve_${server}_ready_s.txt"
    for rate in ${RATES:-8 16 24} inf; do
        t_start=$(date +%s.%N)
        python3 -m minisgl_ref bench serving --port $port --dataset-name random \
            --num-prompts "${NUM_PROMPTS:-200}" --random-input-len "${INPUT_LEN:-1024}" --random-output-len "${OUTPUT_LEN:-1024}" \
            --random-range-ratio "${RANGE_RATIO:-0.09765625}" --request-rate "$rate" --seed 1 --disable-tqdm \
            --output-file "$OUT/serving_${server}_rate_${rate}.json" >"$OUT/serving_${server}_rate_${rate}.log" 2>&1 \
            || { status=1; tail -n 20 "$OUT/serving_${server}_rate_${rate}.log"; }
        echo "$rate $t_start $(date +%s.%N)" >>"$OUT/windows_$server.txt"
    done
    kill -TERM $pid
    for _ in $(seq 1 60); do kill -0 $pid 2>/dev/null || break; sleep 1; done
done
python3 - "$OUT" <<'PY' || status=1
import json, sys
from pathlib import Path

from minisgl_ref.bench.step_trace import summarize

out = Path(sys.argv[1])
rows = []
print(f"{'server':<9} {'rate':>5} {'req/s':>6} {'out tok/s':>9} {'TTFT p50/p99 ms':>16} {'ITL p50/p99 ms':>15} "
      f"{'p99/p50':>7} {'TPOT p50 ms':>11} {'E2E p50/p99 s':>14} {'step gap p50/p99 ms':>20}")
steps, windows = {}, {}
for f in out.glob("steps_*.jsonl"):
    server = f.stem.removeprefix("steps_")
    steps[server] = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    w = out / f"windows_{server}.txt"
    if w.exists():
        windows[server] = {r: (float(a), float(b)) for r, a, b in (line.split() for line in w.read_text().splitlines())}
for f in sorted(out.glob("serving_*_rate_*.json"), key=lambda f: (f.stem.split("_")[1], float(f.stem.split("_rate_")[1]))):
    r = json.loads(f.read_text())
    run = r["runs"][0] if "runs" in r else r
    server, rate = f.stem.split("_")[1], f.stem.split("_rate_")[1]
    tail = run["p99_itl_ms"] / run["median_itl_ms"]
    engine = {}
    if server in steps and rate in windows.get(server, {}):
        engine = summarize(steps[server], *windows[server][rate])
    rows.append({"server": server, "request_rate": run["request_rate"], "itl_p99_over_p50": tail,
                 **{k: run[k] for k in ("request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
                                        "median_itl_ms", "p99_itl_ms", "median_tpot_ms", "p99_tpot_ms",
                                        "median_e2e_latency_ms", "p99_e2e_latency_ms", "completed", "failed")},
                 "engine_step_gaps": engine})
    gaps = f"{engine.get('gap_p50_ms', float('nan')):>8.1f}/{engine.get('gap_p99_ms', float('nan')):<8.1f}"
    print(f"{server:<9} {run['request_rate']:>5} {run['request_throughput']:>6.2f} {run['output_throughput']:>9,.0f} "
          f"{run['median_ttft_ms']:>7.0f}/{run['p99_ttft_ms']:<8.0f} {run['median_itl_ms']:>6.1f}/{run['p99_itl_ms']:<8.1f} "
          f"{tail:>7.2f} {run['median_tpot_ms']:>11.2f} {run['median_e2e_latency_ms'] / 1e3:>6.1f}/"
          f"{run['p99_e2e_latency_ms'] / 1e3:<7.1f} {gaps}")
(out / "serving_sweep_summary.json").write_text(json.dumps(rows, indent=1) + "\n")
PY
exit $status
