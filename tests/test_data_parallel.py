"""``serve --dp-size 2`` (chapter 10): two whole servers behind SGLang's router, tested from the outside on CPU.

The fast tests check the flag and the worker command line without loading a model. The slow ones start one
launcher on the embedded model (two workers with one torch thread each, and the router), talk to it through the
router, show with the workers' own statistics that requests sharing a long prefix all land on one worker, whose
radix cache then serves them, and finally stop it with SIGTERM and check that no process is left behind. The last
test kills a worker while the launcher waits for the workers to load, and checks that the launcher stops the rest
and exits non-zero.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from minisgl_ref.cli import build_parser, main
from minisgl_ref.core.config import ModelArgs, TPArgs
from minisgl_ref.server.args import ServerArgs
from minisgl_ref.server.data_parallel import ROUTER_INSTALL, worker_command, worker_envs
from tests.server_utils import ServerProcess, alive, descendants_of, wait_for_log

API_KEY = "sk-minisgl-dp-test"
MODEL = "SmolLM2-135M-Instruct"
READY = "The router is ready"
WORKER_LINE = re.compile(r"^worker (\d+) at (http://\S+) \(pid (\d+)\)$", re.M)
DP_FLAGS = ("--dp-size", "2", "--device", "cpu", "--log-level", "warning")
# Two workers on a small machine: one torch thread each (the launcher would pick (cores - 1) // 2 by itself).
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
# ~400 tokens that every request of the shared-prefix test starts with
SYSTEM = " ".join(f"Rule {i}: answer politely and briefly about topic number {i}." for i in range(25))


def in_groups(pgids: list[int]) -> list[int]:
    """Live processes in these process groups (each worker leads its own, and its children stay in it)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            state, _, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]
            if int(pgrp) in pgids and state != "Z":
                out.append(int(entry.name))
    return out


def wait_all_gone(pids: list[int], groups: list[int], timeout: float = 10) -> list[int]:
    """Wait until none of ``pids`` and nothing in ``groups`` is alive; returns what is left."""
    deadline = time.monotonic() + timeout
    while True:
        left = sorted({p for p in pids if alive(p)} | set(in_groups(groups)))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def server_args(argv: list[str]) -> ServerArgs:
    ns = build_parser().parse_args(argv)
    return ServerArgs.from_cli(ns)


# ---------------------------------------------------------------------------------------------- fast: flags


def test_worker_command_round_trips() -> None:
    """A worker is started with every model, engine and server flag of the launcher, on its own port."""
    args = server_args([
        "serve", "--dp-size", "3", "--host", "0.0.0.0", "--port", "4000", "--device", "cpu", "--dtype", "float32",
        "--context-length", "512", "--max-running-requests", "8", "--chunked-prefill-size", "64", "--page-size", "4",
        "--schedule-policy", "lpm", "--enable-mixed-chunk", "--disable-cuda-graph", "--mem-fraction-static", "0.5",
        "--served-model-name", "m", "--api-key", "k", "--enable-metrics", "--log-level", "warning",
        "--speculative-algorithm", "NGRAM", "--speculative-num-steps", "3", "--speculative-max-batch", "4",
    ])
    cmd = worker_command(args, 1234)
    assert cmd[:4] == [sys.executable, "-m", "minisgl_ref", "serve"] and "--dp-size" not in cmd
    assert server_args(cmd[3:]) == dataclasses.replace(args, host="127.0.0.1", port=1234, dp_size=1)


def test_worker_envs(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU the workers share the cores; on a GPU machine each gets its own --tp-size GPUs."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    envs = worker_envs(ServerArgs(dp_size=2, model=ModelArgs(device="cpu")))
    assert [e["OMP_NUM_THREADS"] for e in envs] == [str(max(1, (cores - 1) // 2))] * 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    envs = worker_envs(ServerArgs(dp_size=2, model=ModelArgs(device="cuda"), tp=TPArgs(tp_size=2)))
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3,5", "6,7"]
    with pytest.raises(ValueError, match="needs 6 GPUs, 4 visible"):
        worker_envs(ServerArgs(dp_size=3, model=ModelArgs(device="cuda"), tp=TPArgs(tp_size=2)))


def test_dp_size_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert server_args(["serve"]).dp_size == 1
    for argv, message in ((["--dp-size", "0"], "--dp-size must be at least 1"),
                          (["--dp-size", "2", "--shell"], "--shell chats with one server")):
        assert main(["serve", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_missing_router_is_one_error_line() -> None:
    """Without sglang-router, --dp-size 2 says how to install it, at once, before any process starts."""
    code = ("import sys; sys.modules['sglang_router'] = None\n"  # as if the package were not installed
            "from minisgl_ref.cli import main; sys.exit(main(['serve', '--dp-size', '2', '--device', 'cpu']))")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    assert ROUTER_INSTALL in r.stderr and "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 60  # no model was loaded


# ------------------------------------------------------------------------------------- slow: a real launcher


@dataclasses.dataclass
class DPServer:
    launcher: ServerProcess
    workers: list[str]  # worker i's URL, from the launcher's "worker i at URL (pid P)" lines
    worker_pids: list[int]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def worker_info(self, i: int) -> dict[str, Any]:
        r = httpx.get(self.workers[i] + "/get_server_info", headers=self.headers, timeout=60)
        r.raise_for_status()
        return r.json()

    def chat(self, messages: list[dict[str, str]], max_tokens: int, base: str | None = None) -> dict[str, Any]:
        r = httpx.post((base or self.launcher.url) + "/v1/chat/completions", headers=self.headers, timeout=300,
                       json={"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()


def parse_workers(log: str) -> tuple[list[str], list[int]]:
    found = sorted((int(i), url, int(pid)) for i, url, pid in WORKER_LINE.findall(log))
    return [url for _, url, _ in found], [pid for _, _, pid in found]


@pytest.fixture(scope="module")
def dp():
    pytest.importorskip("sglang_router")
    srv = ServerProcess(*DP_FLAGS, api_key=API_KEY, env=ONE_THREAD)
    tree: list[int] = []
    try:
        log = wait_for_log(srv, READY)
        tree = descendants_of(srv.proc.pid)
        yield DPServer(srv, *parse_workers(log))
    finally:
        srv.kill_all()
        for pid in tree:  # last resort, if a test failed before the launcher could stop them
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_router_and_workers(dp: DPServer) -> None:
    assert len(dp.workers) == 2 and len(set(dp.workers)) == 2
    for i, url in enumerate(dp.workers):
        info = dp.worker_info(i)
        assert url.endswith(f":{info['port']}") and info["dp_size"] == 1 and info["pids"]["server"] == dp.worker_pids[i]
    # the router knows the same two workers (its worker-management API), and checks the API key itself
    listed = httpx.get(dp.launcher.url + "/workers", headers=dp.headers, timeout=30).json()["workers"]
    assert sorted(w["url"] for w in listed) == sorted(dp.workers)
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(dp.launcher.url + "/generate", headers=headers, timeout=60,
                       json={"text": "Hi", "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 401


@pytest.mark.slow
def test_chat_and_generate_through_router(dp: DPServer) -> None:
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    resp = dp.chat(chat, max_tokens=16)
    assert resp["object"] == "chat.completion" and "Paris" in resp["choices"][0]["message"]["content"]
    direct = dp.chat(chat, max_tokens=16, base=dp.workers[1])  # a greedy answer does not depend on the path
    assert direct["choices"][0]["message"]["content"] == resp["choices"][0]["message"]["content"]
    # the README's curl names no model: the router fills in a placeholder, which the workers accept
    r = httpx.post(dp.launcher.url + "/v1/chat/completions", headers=dp.headers, timeout=300,
                   json={"messages": chat, "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == resp["choices"][0]["message"]["content"]

    r = httpx.post(dp.launcher.url + "/generate", headers=dp.headers, timeout=300,
                   json={"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4,
                                                                                 "temperature": 0}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["text"] and out["meta_info"]["completion_tokens"] == 4 and len(out["output_ids"]) == 4


@pytest.mark.slow
def test_shared_prefix_lands_on_one_worker(dp: DPServer) -> None:
    """cache_aware routing: five requests with one long system prompt and different questions all go to one
    worker, whose radix cache holds the prompt after the first; the other worker runs not a single step."""
    before = [dp.worker_info(i) for i in range(2)]
    questions = ["What is 2 + 2?", "Name a color.", "What is the capital of Italy?", "Say hello.", "Name a fruit."]
    usages = [dp.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}], max_tokens=2)["usage"]
              for q in questions]
    after = [dp.worker_info(i) for i in range(2)]

    steps = [after[i]["engine_steps"] - before[i]["engine_steps"] for i in range(2)]
    computed = [after[i]["prefill_tokens"] - before[i]["prefill_tokens"] for i in range(2)]
    hot = 0 if steps[0] else 1
    assert steps[hot] > 0 and steps[1 - hot] == 0 and computed[1 - hot] == 0, (steps, computed)

    prompt = [u["prompt_tokens"] for u in usages]
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert min(prompt) > 300
    assert all(c >= 0.9 * p for c, p in zip(cached[1:], prompt[1:])), (cached, prompt)
    # the hot worker computed the prompt once, then only each request's own few tokens
    assert computed[hot] < prompt[0] + 0.1 * sum(prompt[1:]), (computed, prompt)
    assert after[hot]["cache_hit_rate"] > before[hot]["cache_hit_rate"]


@pytest.mark.slow
def test_sigterm_stops_every_process(dp: DPServer) -> None:
    """Must run last in this module: it stops the shared launcher."""
    tree = descendants_of(dp.launcher.proc.pid)
    assert set(dp.worker_pids) <= set(tree) and len(tree) >= 3  # two workers (and their children), the router
    assert dp.launcher.terminate(timeout=90) == 0
    assert not wait_all_gone(tree, dp.worker_pids), dp.launcher.log_text()


@pytest.mark.slow
def test_dead_worker_stops_the_rest() -> None:
    """A worker that dies (here: SIGKILL while its children load the model, so they are orphaned) ends the whole
    launcher, with status 1 and nothing left running, the dead worker's children included."""
    pytest.importorskip("sglang_router")
    srv = ServerProcess(*DP_FLAGS, env=ONE_THREAD)
    try:
        log = wait_for_log(srv, "worker 1 at", timeout=120)
        _, pids = parse_workers(log)
        deadline = time.monotonic() + 60
        while len(in_groups([pids[1]])) < 3 and time.monotonic() < deadline:  # the worker and its first children
            time.sleep(0.1)
        tree = descendants_of(srv.proc.pid)
        assert len(tree) >= 4, tree
        os.kill(pids[1], signal.SIGKILL)  # the worker alone: its scheduler and detokenizer live on
        assert srv.proc.wait(90) == 1
        assert not wait_all_gone(tree, pids)
        assert "worker 1" in srv.log_text() and "exited with code -9" in srv.log_text()
    finally:
        srv.kill_all()
