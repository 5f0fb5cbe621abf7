#!/usr/bin/env bash
# The engine's front doors on a GPU, end to end: `bench offline` (the canonical workload through the CLI) and
# `serve` (a real server process answering /generate, an OpenAI chat request by token ids, /flush_cache and
# /server_info, then stopping on SIGTERM). Qwen3-0.6B config, bf16, dummy weights. Logs land in $OUT.
#
#   OUT=results bash scripts/gpu/serve_smoke.sh
set -uo pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
read -ra model <<<"${MODEL_ARGS:---model-path qwen3-0.6b --load-format dummy --dtype bfloat16 --device cuda}"
status=0

echo "== bench offline (canonical)"
[ -n "${SKIP_BENCH:-}" ] || python3 -m minisgl_ref bench offline "${model[@]}" --output "$OUT/bench_offline_h100.json" 2>&1 \
    | tail -n 12 || status=1

echo "== serve"
before=$(pgrep -f "minisgl_ref|multiprocessing" | sort)
t0=$(date +%s)
python3 -m minisgl_ref serve "${model[@]}" --port 30000 >"$OUT/serve.log" 2>&1 &
pid=$!
for _ in $(seq 1 240); do
    curl -sf http://127.0.0.1:30000/health >/dev/null && break
    kill -0 $pid 2>/dev/null || break
    sleep 1
done
echo "ready after $(( $(date +%s) - t0 )) s"
python3 - <<'PY' || status=1
import json, urllib.request

def call(path, body=None):
    req = urllib.request.Request("http://127.0.0.1:30000" + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        body = r.read().decode()
        try:
            return r.status, json.loads(body)
        except ValueError:  # /flush_cache answers in plain text, as SGLang's does
            return r.status, body

s, out = call("/generate", {"input_ids": list(range(100, 164)), "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}})
assert s == 200 and len(out["output_ids"]) == 32, out
print("/generate:", s, out["meta_info"]["finish_reason"], len(out["output_ids"]), "tokens")
s, again = call("/generate", {"input_ids": list(range(100, 164)), "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}})
assert again["output_ids"] == out["output_ids"] and again["meta_info"]["cached_tokens"] > 0, again["meta_info"]
print("same prompt again: identical greedy tokens, cached tokens", again["meta_info"]["cached_tokens"])
batch = {"input_ids": [[7] * (n + 1) + list(range(n)) for n in range(48)],
         "sampling_params": [{"max_new_tokens": 16 + n, "ignore_eos": True} for n in range(48)]}
s, outs = call("/generate", batch)
assert s == 200 and [len(o["output_ids"]) for o in outs] == [16 + n for n in range(48)]
print("batch of 48: all complete")
s, flushed = call("/flush_cache", {})
print("/flush_cache:", s, flushed)
s, info = call("/server_info")
print("/server_info:", s, {k: info.get(k) for k in ("attention_backend", "page_size", "max_total_num_tokens")})
PY
kill -TERM $pid
for _ in $(seq 1 60); do kill -0 $pid 2>/dev/null || break; sleep 1; done
if kill -0 $pid 2>/dev/null; then echo "serve did not stop on SIGTERM"; status=1; else echo "serve stopped on SIGTERM"; fi
sleep 2
left=$(comm -13 <(echo "$before") <(pgrep -f "minisgl_ref|multiprocessing" | sort))
if [ -n "$left" ]; then echo "processes left behind: $left"; status=1; else echo "no process left behind"; fi
tail -n 5 "$OUT/serve.log"
exit $status
