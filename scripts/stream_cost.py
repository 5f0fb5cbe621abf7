"""CPU time per streamed token event, in the API server process and in the benchmark client (chapter 11).

At saturation a server streams one SSE event per running request per decode step: 256 requests at 60 steps a
second are 15,000 events a second, every one of them passing through one Python process on each side of the
socket. If either side spends more CPU per event than that budget allows, events queue up and reach the client
in bursts, and the measured inter-token latency is then the client's (or the API server's) backlog, not the
engine's. This script measures that budget directly, as CPU seconds per event, which does not depend on how
fast the engine is: so a CPU machine with a tiny random model can measure it.

For each server variant it starts ``python -m minisgl_ref serve`` on a tiny Qwen3-shaped model with random
weights, sends ``--num-prompts`` streaming ``/generate`` requests at once (``--output-len`` tokens each,
``ignore_eos``) with each client, and reads the CPU time the API server process and the client process spent
meanwhile (``/proc/<pid>/stat`` and ``time.process_time``). Variants and clients alternate over ``--rounds``,
so a slow spell of a shared machine hits all of them.

* server ``current``: this checkout (uvloop and httptools when installed; native events splice in the ids'
  text kept from earlier events).
* server ``before``: the checkout at ``--before-rev`` (a git worktree), with uvloop and httptools hidden, so it
  runs on asyncio's loop and the pure-Python h11 parser as it did.
* client ``aiohttp``: ``bench serving``'s own request function.
* client ``httpx``: the same reading loop on ``httpx.AsyncClient`` (what ``bench serving`` used before).

    python scripts/stream_cost.py --output docs/data/stream_cost_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TINY = {  # Qwen3's architecture at a size whose forward pass costs next to nothing on a CPU
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 10240, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
    "hidden_act": "silu", "tie_word_embeddings": True, "torch_dtype": "float32", "bos_token_id": 1,
    "eos_token_id": 2, "attention_bias": False,
}
# Runs the server with some modules made unimportable (an entry of None in sys.modules fails the import).
HIDE_AND_SERVE = ("import runpy, sys\n"
                  "for name in sys.argv[1].split(','):\n"
                  "    if name: sys.modules[name] = None\n"
                  "sys.argv = ['minisgl_ref'] + sys.argv[2:]\n"
                  "runpy.run_module('minisgl_ref', run_name='__main__')\n")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------------------------ clients


def _requests(n: int, output_len: int) -> list[dict[str, Any]]:
    rng = random.Random(0)
    return [{"input_ids": [rng.randint(0, 10000) for _ in range(32)],
             "sampling_params": {"max_new_tokens": output_len, "ignore_eos": True, "temperature": 0.6}}
            for _ in range(n)]


async def _run_aiohttp(port: int, bodies: list[dict[str, Any]]) -> list[Any]:
    import aiohttp

    from minisgl_ref.bench.serving import ServingBenchConfig, send_request

    cfg = ServingBenchConfig(base_url=f"http://127.0.0.1:{port}")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        return await asyncio.gather(*(send_request(session, cfg, b["input_ids"], 32, b["sampling_params"])
                                      for b in bodies))


async def _run_httpx(port: int, bodies: list[dict[str, Any]]) -> list[Any]:
    import httpx

    from minisgl_ref.bench.serving import _StreamReader

    async def one(client: httpx.AsyncClient, body: dict[str, Any]) -> Any:
        reader = _StreamReader("minisgl", time.perf_counter(), 32)
        async with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:"):].strip()
                if payload == "[DONE]":
                    break
                reader.event(json.loads(payload), time.perf_counter())
        return reader.finish(time.perf_counter())

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=None, limits=limits) as client:
        return await asyncio.gather(*(one(client, b) for b in bodies))


def client_main(lib: str, port: int, n: int, output_len: int) -> None:
    """One client run, in its own process: prints its CPU seconds and the latencies as one JSON line."""
    runner = {"aiohttp": _run_aiohttp, "httpx": _run_httpx}[lib]
    bodies = _requests(n, output_len)
    cpu0, t0 = time.process_time(), time.perf_counter()
    outs = asyncio.run(runner(port, bodies))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    failed = [o.error for o in outs if not o.success]
    itl = sorted(g for o in outs for g in o.itl)
    print(json.dumps({"client_cpu_s": cpu, "wall_s": wall, "failed": len(failed), "first_error": failed[:1],
                      "events": sum(o.output_len for o in outs),
                      "itl_p50_ms": 1e3 * itl[len(itl) // 2], "itl_p99_ms": 1e3 * itl[int(0.99 * len(itl))]}))


# ------------------------------------------------------------------------------------------------ servers


class Server:
    def __init__(self, variant: str, tree: Path, model: Path, port: int, hide: str) -> None:
        cmd = [sys.executable, "-c", HIDE_AND_SERVE, hide, "serve", "--model-path", str(model), "--load-format",
               "dummy", "--device", "cpu", "--port", str(port), "--max-running-requests", "256",
               "--log-level", "warning"]
        env = {**os.environ, "PYTHONPATH": str(tree)}
        self.variant, self.port = variant, port
        self.proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        import httpx

        for _ in range(240):
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {variant} exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server {variant} did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def measure(server: Server, lib: str, n: int, output_len: int) -> dict[str, Any]:
    before = cpu_seconds(server.proc.pid)
    r = subprocess.run([sys.executable, __file__, "--client", lib, "--port", str(server.port), "--num-prompts",
                        str(n), "--output-len", str(output_len)], capture_output=True, text=True, cwd=ROOT, check=False,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    if r.returncode != 0:
        raise RuntimeError(f"client {lib} failed: {r.stderr[-2000:]}")
    run = json.loads(r.stdout.strip().splitlines()[-1])
    server_cpu = cpu_seconds(server.proc.pid) - before
    events = run["events"]
    return {"server": server.variant, "client": lib, **run, "server_cpu_s": server_cpu,
            "server_us_per_event": 1e6 * server_cpu / events, "client_us_per_event": 1e6 * run["client_cpu_s"] / events}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--client", choices=("aiohttp", "httpx"), help=argparse.SUPPRESS)  # one client run
    ap.add_argument("--port", type=int, default=31011)
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--before-rev", default="2c2badb")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    if args.client:
        client_main(args.client, args.port, args.num_prompts, args.output_len)
        return 0

    work = Path(tempfile.mkdtemp(prefix="stream_cost_"))
    (work / "tiny").mkdir()
    (work / "tiny" / "config.json").write_text(json.dumps(TINY))
    before_tree = work / "before"
    subprocess.run(["git", "worktree", "add", "--detach", str(before_tree), args.before_rev], cwd=ROOT, check=True,
                   capture_output=True)
    variants = {"before": (before_tree, "uvloop,httptools"), "current": (ROOT, "")}
    rows = []
    try:
        for rnd in range(args.rounds):
            for variant, (tree, hide) in variants.items():
                server = Server(variant, tree, work / "tiny", args.port, hide)
                try:
                    for lib in ("httpx", "aiohttp") if rnd % 2 == 0 else ("aiohttp", "httpx"):
                        row = measure(server, lib, args.num_prompts, args.output_len)
                        rows.append({"round": rnd, **row})
                        print(f"round {rnd} server {variant:<8} client {lib:<8} server {row['server_us_per_event']:6.1f}"
                              f" us/event  client {row['client_us_per_event']:6.1f} us/event  ITL p50/p99 "
                              f"{row['itl_p50_ms']:.1f}/{row['itl_p99_ms']:.1f} ms  failed {row['failed']}",
                              flush=True)
                finally:
                    server.stop()
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(before_tree)], cwd=ROOT, capture_output=True, check=False)
        shutil.rmtree(work, ignore_errors=True)

    summary: dict[str, Any] = {}
    for variant in variants:
        for lib in ("httpx", "aiohttp"):
            sel = [r for r in rows if r["server"] == variant and r["client"] == lib]
            summary[f"{variant}/{lib}"] = {key: round(sum(r[key] for r in sel) / len(sel), 1)
                                           for key in ("server_us_per_event", "client_us_per_event")}
    if args.output:
        from minisgl_ref.bench.provenance import collect_provenance

        doc = {"what": "CPU microseconds per streamed /generate event in the API server process and the client "
                       f"({args.num_prompts} requests at once, {args.output_len} output tokens each, a tiny "
                       "random-weight model on the CPU); means over rounds in `summary`",
               "summary": summary, "runs": rows,
               "provenance": collect_provenance(sys.argv, benchmark="stream_cost")}
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
