"""Tensor and data parallelism on a machine with two GPUs, as a user runs them (chapters 09 and 10).

    NCCL_NVLS_ENABLE=0 python3 scripts/gpu/measure/parallel_serving.py --out results [--phases tp_exit,tp_serve,dp]

Each phase starts real processes the way a user does and writes what it saw to ``OUT/parallel_serving.json``
(with provenance), plus each process's log:

* ``tp_exit``: chapter 09's check (``python3 -m benchmarks.tp --phase check``: tp=2 logits and greedy tokens
  against tp=1) under a time limit. It records when the result file appeared and when the process exited; a
  process still alive 20 s after its result gets every thread's stack dumped (py-spy, where installed) into
  ``OUT/hang_<phase>.txt`` before it is killed. Then an offline ``LLM(tp_size=2)`` is sent SIGTERM in the middle
  of a long generate call, and the time until no process of it is left is recorded.
* ``tp_serve``: ``serve --tp-size 2``: start-up compiles on both ranks (the logs are searched for a failed one),
  greedy answers by token ids (the same prompt twice: identical tokens, the second from the radix cache), a batch,
  a storm of streaming clients that disconnect at random moments, then a request that must still complete, no
  request left running, and SIGTERM: the time until every process of the server has exited.
* ``dp``: request throughput at saturation (``bench serving`` with every request sent at once) against one
  server on one GPU, then against ``serve --dp-size 2`` (one worker per GPU behind SGLang's router); then one
  worker of the data-parallel server is killed in the middle of a run, and the launcher must stop the rest and
  exit with status 1, leaving no process behind.

The model is the Qwen3-0.6B config with dummy weights in bfloat16 (no tokenizer: prompts go in as token ids).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

MODEL = ["--model-path", "qwen3-0.6b", "--load-format", "dummy", "--dtype", "bfloat16"]
PY = sys.executable


def sh(cmd: str) -> str:
    return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()


def provenance() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {
        "gpus": sh("nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader").splitlines(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
        "commit": os.environ.get("MINISGL_GIT_COMMIT") or sh("git rev-parse HEAD"),
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "CUDA_VISIBLE_DEVICES")},
    }
    for name in ("flashinfer", "xgrammar", "sglang_router", "triton"):
        try:
            out[name] = __import__(name).__version__
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            out[name] = f"unavailable: {type(e).__name__}"
    return out


def tree(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += [int(c) for c in sh(f"pgrep -P {p}").split()]
    return out


def alive(pids: list[int]) -> list[int]:
    out = []
    for p in pids:
        try:
            os.kill(p, 0)
        except ProcessLookupError:
            continue
        stat = Path(f"/proc/{p}/stat").read_text() if Path(f"/proc/{p}/stat").exists() else ""
        if ") Z " not in stat:  # a zombie has exited; it only waits for its parent to read its status
            out.append(p)
    return out


def dump_stacks(pids: list[int], path: Path) -> None:
    """Every thread's stack of each process (py-spy with native frames where it works; the kernel's view else)."""
    parts = []
    for p in alive(pids):
        cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:300]
        parts.append(f"===== pid {p}: {cmd}")
        spy = subprocess.run(["py-spy", "dump", "--native", "--pid", str(p)], capture_output=True, text=True,
                             timeout=60) if sh("command -v py-spy") else None
        parts.append(spy.stdout + spy.stderr if spy is not None else "(no py-spy)")
        for task in sorted(Path(f"/proc/{p}/task").glob("*")):
            try:
                parts.append(f"  thread {task.name} {(task / 'comm').read_text().strip()} "
                             f"wchan={(task / 'wchan').read_text().strip()}")
            except OSError:
                pass
    path.write_text("\n".join(parts) + "\n")


def wait_gone(pids: list[int], limit: float) -> float | None:
    """Seconds until none of ``pids`` is alive (None: some still were after ``limit``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if not alive(pids):
            return time.monotonic() - t0
        time.sleep(0.1)
    return None


def minisgl_procs() -> list[int]:
    found = subprocess.run(["pgrep", "-f", "minisgl_ref|multiprocessing.spawn|sglang_router"], capture_output=True,
                           text=True).stdout.split()
    return [int(p) for p in found if int(p) != os.getpid()]


# ------------------------------------------------------------------------------------------------- tp_exit


def run_watched(name: str, cmd: list[str], result: Path, out: Path, limit: float) -> dict[str, Any]:
    """Run ``cmd``; note when ``result`` gets its final write and when the process exits; dump stacks if it
    lingers."""
    log = open(out / f"{name}.log", "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    rec: dict[str, Any] = {"cmd": " ".join(cmd)}
    seen = None
    while proc.poll() is None and time.monotonic() - t0 < limit:
        if seen is None and result.exists() and '"phase_wall_s"' in result.read_text():  # the final write
            seen = time.monotonic()
            rec["result_after_s"] = seen - t0
        late = time.monotonic() - t0 > limit - 25  # out of time: see where it is before it is killed
        if (seen is not None and time.monotonic() - seen > 20) or late:
            rec["lingered" if seen is not None else "unfinished"] = True
            dump_stacks(tree(proc.pid), out / f"hang_{name}.txt")
            break
        time.sleep(0.2)
    if proc.poll() is None:
        pids = tree(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rec["killed"] = True
        rec["left_after_kill"] = alive(pids)
    rec["exit_code"] = proc.returncode
    rec["wall_s"] = time.monotonic() - t0
    if seen is not None:
        rec["exit_after_result_s"] = rec["wall_s"] - rec["result_after_s"]
    text = (out / f"{name}.log").read_text(errors="replace")
    rec["compile_failures"] = [ln for ln in text.splitlines() if "start-up compile of" in ln and "failed" in ln]
    return rec


SIGTERM_LLM = """
import sys, time
from minisgl_ref import LLM, SamplingParams
llm = LLM("qwen3-0.6b", load_format="dummy", dtype="bfloat16", tp_size=2)
print("READY", flush=True)
llm.generate([[7] * 64] * 64, SamplingParams(max_new_tokens=30000, ignore_eos=True))
"""


def phase_tp_exit(out: Path) -> dict[str, Any]:
    res = out / "tp_check.json"
    rec = {"check": run_watched("tp_check", [PY, "-m", "benchmarks.tp", "--phase", "check", "--device", "cuda",
                                             "--tp-size", "2", "--dtype", "bfloat16", "--check-model",
                                             "qwen3-0.6b", "--check-load-format", "dummy", "--output", str(res)],
                                res, out, 330)}
    if res.exists():
        check = json.loads(res.read_text())
        rec["check"]["result"] = {k: check.get(k) for k in ("logits_rel_err_norm", "logits_ok", "ranks_identical",
                                                           "argmax_agreement", "greedy_first_token_agree",
                                                           "greedy_common_prefix", "shutdown_s", "phase_wall_s")}
    if os.environ.get("SKIP_SIGTERM"):
        return rec
    # SIGTERM in the middle of an offline tp=2 generate call.
    log = open(out / "tp_sigterm.log", "w")
    proc = subprocess.Popen([PY, "-c", SIGTERM_LLM], stdout=subprocess.PIPE, stderr=log, text=True,
                            start_new_session=True)
    t0 = time.monotonic()
    ready = False
    while time.monotonic() - t0 < 180:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            break
        if line.strip() == "READY":
            ready = True
            break
    time.sleep(5.0)  # deep in decoding
    pids = tree(proc.pid)
    rec["sigterm"] = {"ready": ready, "processes": len(pids)}
    proc.send_signal(signal.SIGTERM)
    gone = wait_gone(pids, 30)
    rec["sigterm"]["all_exited_s"] = gone
    if gone is None:
        dump_stacks(pids, out / "hang_tp_sigterm.txt")
        for p in alive(pids):
            os.kill(p, signal.SIGKILL)
    proc.wait()
    rec["sigterm"]["exit_code"] = proc.returncode
    return rec


# ------------------------------------------------------------------------------------------------ serving


class Server:
    """A ``serve`` process group, its log, and its URL."""

    def __init__(self, name: str, flags: list[str], port: int, out: Path, env: dict[str, str] | None = None):
        self.name, self.port, self.url = name, port, f"http://127.0.0.1:{port}"
        self.log_path = out / f"{name}.log"
        self.proc = subprocess.Popen([PY, "-m", "minisgl_ref", "serve", *MODEL, "--port", str(port), *flags],
                                     stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, **(env or {})})
        self.t0 = time.monotonic()

    def wait_ready(self, limit: float = 300) -> float:
        while time.monotonic() - self.t0 < limit:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} while starting")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    # the router answers /health before its workers are registered: wait for a real answer
                    r = httpx.post(self.url + "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {
                        "max_new_tokens": 1}}, timeout=30)
                    if r.status_code == 200:
                        return time.monotonic() - self.t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {limit} s")

    def post(self, path: str, body: dict[str, Any], timeout: float = 120) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=timeout)

    def stop(self, limit: float = 60) -> dict[str, Any]:
        pids = tree(self.proc.pid)
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(limit)
        except subprocess.TimeoutExpired:
            pass
        launcher_s = time.monotonic() - t0 if self.proc.poll() is not None else None
        gone = wait_gone(pids, max(1.0, limit - (time.monotonic() - t0)))
        rec = {"processes": len(pids), "launcher_exit_s": launcher_s, "exit_code": self.proc.returncode,
               "all_exited_s": None if gone is None else time.monotonic() - t0}
        if gone is None:
            dump_stacks(pids, self.log_path.with_name(f"hang_{self.name}_stop.txt"))
            rec["left"] = alive(pids)
            for p in alive(pids):
                os.kill(p, signal.SIGKILL)
        return rec


def greedy(server: Server, ids: list[int], n: int = 32) -> dict[str, Any]:
    r = server.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                                                         "ignore_eos": True}})
    r.raise_for_status()
    return r.json()


def disconnect_storm(server: Server, clients: int, seed: int = 0) -> dict[str, Any]:
    """``clients`` streaming requests at once, each dropped by its client after a random moment."""
    rng = random.Random(seed)
    statuses: list[Any] = []

    def client(k: int, wait: float) -> None:
        body = {"input_ids": [rng.randint(10, 5000) for _ in range(64 + k)], "stream": True,
                "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True, "temperature": 0.7}}
        try:
            with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
                t0 = time.monotonic()
                for _ in r.iter_lines():
                    if time.monotonic() - t0 > wait:
                        break  # leaving the block closes the connection mid-stream
                statuses.append(r.status_code)
        except httpx.HTTPError as e:
            statuses.append(type(e).__name__)

    threads = [threading.Thread(target=client, args=(k, rng.uniform(0.0, 1.5))) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    # every dropped request must leave the scheduler
    t0 = time.monotonic()
    running = None
    while time.monotonic() - t0 < 30:
        info = httpx.get(server.url + "/server_info", timeout=10).json()
        running = info.get("num_running_reqs", 0) + info.get("num_queue_reqs", 0)
        if running == 0:
            break
        time.sleep(0.2)
    return {"clients": clients, "statuses": sorted({str(s) for s in statuses}), "idle_after_s":
            time.monotonic() - t0 if running == 0 else None, "left_running": running}


def phase_tp_serve(out: Path) -> dict[str, Any]:
    before = set(minisgl_procs())
    server = Server("tp_serve", ["--tp-size", "2"], 30001, out)
    rec: dict[str, Any] = {"ready_s": server.wait_ready()}
    rng = random.Random(1)
    prompt = [rng.randint(10, 10000) for _ in range(200)]
    a, b = greedy(server, prompt), greedy(server, prompt)
    rec["greedy"] = {"tokens": len(a["output_ids"]), "repeat_identical": a["output_ids"] == b["output_ids"],
                     "repeat_cached_tokens": b["meta_info"]["cached_tokens"]}
    batch = {"input_ids": [[7] * (n + 1) + list(range(n)) for n in range(48)],
             "sampling_params": [{"max_new_tokens": 16 + n, "ignore_eos": True} for n in range(48)]}
    outs = server.post("/generate", batch).json()
    rec["batch_complete"] = [len(o["output_ids"]) for o in outs] == [16 + n for n in range(48)]
    rec["storm"] = disconnect_storm(server, 64)
    rec["after_storm"] = {"health": httpx.get(server.url + "/health", timeout=10).status_code,
                          "greedy_again_identical": greedy(server, prompt)["output_ids"] == a["output_ids"]}
    log = server.log_path.read_text(errors="replace")
    rec["compile_failures"] = [ln for ln in log.splitlines() if "start-up compile of" in ln and "failed" in ln]
    rec["compile_lines"] = [ln[-300:] for ln in log.splitlines() if "start-up compiles done" in ln]
    rec["stop"] = server.stop()
    rec["left_processes"] = sorted(set(minisgl_procs()) - before)
    return rec


def bench(url: str, out: Path, name: str, prompts: int, limit: float = 240) -> dict[str, Any]:
    path = out / f"{name}.json"
    cmd = [PY, "-m", "minisgl_ref", "bench", "serving", "--backend", "minisgl", "--base-url", url,
           "--num-prompts", str(prompts), "--random-input-len", "512", "--random-output-len", "256",
           "--random-range-ratio", "0.5", "--request-rate", "inf", "--disable-tqdm", "--output-file", str(path)]
    with open(out / f"{name}.log", "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    res = json.loads(path.read_text()) if path.exists() else {}
    keep = ("completed", "duration", "request_throughput", "output_throughput", "total_output_tokens",
            "median_ttft_ms", "median_itl_ms", "p99_itl_ms")
    return {"exit_code": rc, **{k: res.get(k) for k in keep}}


def phase_dp(out: Path, prompts: int) -> dict[str, Any]:
    rec: dict[str, Any] = {"prompts": prompts}
    before = set(minisgl_procs())
    one = Server("dp1_serve", [], 30002, out, env={"CUDA_VISIBLE_DEVICES": "0"})
    rec["dp1_ready_s"] = one.wait_ready()
    rec["dp1"] = bench(one.url, out, "dp1_bench", prompts)
    rec["dp1_stop"] = one.stop()
    two = Server("dp2_serve", ["--dp-size", "2"], 30003, out)
    rec["dp2_ready_s"] = two.wait_ready()
    rec["dp2"] = bench(two.url, out, "dp2_bench", prompts)
    if rec["dp1"].get("request_throughput") and rec["dp2"].get("request_throughput"):
        rec["dp2_over_dp1_request_throughput"] = rec["dp2"]["request_throughput"] / rec["dp1"]["request_throughput"]
    # kill one worker in the middle of a run
    workers = [p for p in tree(two.proc.pid)[1:]
               if b"serve" in Path(f"/proc/{p}/cmdline").read_bytes() and b"sglang_router" not in
               Path(f"/proc/{p}/cmdline").read_bytes() and int(sh(f"ps -o ppid= -p {p}") or 0) == two.proc.pid]
    rec["workers"] = workers
    pids = tree(two.proc.pid)
    runner = threading.Thread(target=lambda: rec.__setitem__("dp2_killed_bench",
                                                             bench(two.url, out, "dp2_killed_bench", prompts, 100)))
    runner.start()
    time.sleep(3.0)
    t0 = time.monotonic()
    if workers:
        os.kill(workers[-1], signal.SIGKILL)
    try:
        two.proc.wait(90)
    except subprocess.TimeoutExpired:
        pass
    rec["after_kill"] = {"launcher_exit_code": two.proc.poll(), "launcher_exit_s": time.monotonic() - t0
                         if two.proc.poll() is not None else None}
    gone = wait_gone(pids, 30)
    rec["after_kill"]["all_exited_s"] = None if gone is None else time.monotonic() - t0
    if gone is None:
        dump_stacks(pids, out / "hang_dp_kill.txt")
        rec["after_kill"]["left"] = alive(pids)
        for p in alive(pids):
            os.kill(p, signal.SIGKILL)
    runner.join(120)
    rec["left_processes"] = sorted(set(minisgl_procs()) - before)
    return rec


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results")
    ap.add_argument("--phases", default="tp_exit,tp_serve,dp")
    ap.add_argument("--dp-prompts", type=int, default=1024)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if os.environ.get("NCCL_NVLS_ENABLE") != "0":
        print("set NCCL_NVLS_ENABLE=0 first", file=sys.stderr)
        return 2
    result: dict[str, Any] = {"benchmark": "parallel_serving", "provenance": provenance(), "phases": {}}
    path = out / "parallel_serving.json"
    phases = {"tp_exit": lambda: phase_tp_exit(out), "tp_serve": lambda: phase_tp_serve(out),
              "dp": lambda: phase_dp(out, args.dp_prompts)}
    for name in args.phases.split(","):
        t0 = time.monotonic()
        print(f"=== {name}", file=sys.stderr, flush=True)
        try:
            result["phases"][name] = phases[name]()
        except Exception as e:  # noqa: BLE001 - the other phases still run
            result["phases"][name] = {"error": f"{type(e).__name__}: {e}"}
        result["phases"][name]["phase_s"] = time.monotonic() - t0
        print(json.dumps(result["phases"][name], indent=1)[:3000], file=sys.stderr, flush=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
