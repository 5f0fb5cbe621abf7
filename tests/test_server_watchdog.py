"""The stuck-step watchdog (chapter 10, server/watchdog.py): ``/health`` turns 503 while the scheduler has been
inside one engine step for longer than ``--watchdog-timeout``, the scheduler logs where it is, and everything
turns back once the step ends."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from minisgl_ref.server.watchdog import LoopClock, LoopWatch
from tests.server_utils import running_server

TIMEOUT_S = 1.0


def test_loop_clock_counts_time_inside_a_turn():
    clock = LoopClock()
    LoopWatch(clock)  # the loop is about to start: the clock is fresh
    assert clock.stuck(0.2) is None
    time.sleep(0.3)
    reason = clock.stuck(0.2)
    assert reason is not None and "--watchdog-timeout" in reason and "0.2 s" in reason
    assert clock.stuck(0) is None, "a timeout of 0 turns the watchdog off"
    watch = LoopWatch(clock)
    turns = clock.turns
    assert watch.alive()  # a turn of the loop: ticks the clock
    assert clock.turns == turns + 1 and clock.stuck(0.2) is None


@pytest.fixture(scope="module")
def server():
    # One chunk of up to 4,096 tokens a step, so that one long prompt is one long step on a CPU.
    with running_server("--watchdog-timeout", str(TIMEOUT_S), "--chunked-prefill-size", "4096",
                        "--max-prefill-tokens", "4096") as srv:
        yield srv


def _health(server, path: str = "/health") -> httpx.Response:
    return httpx.get(server.url + path, timeout=30)


def test_a_long_step_turns_health_to_503_and_back(server):
    assert _health(server).status_code == 200
    result: dict[str, httpx.Response] = {}
    body = {"input_ids": [(17 * i) % 40000 + 100 for i in range(1500)],
            "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    worker = threading.Thread(target=lambda: result.update(r=server.post("/generate", json=body)))
    worker.start()
    seen: list[httpx.Response] = []
    while worker.is_alive():
        r = _health(server)
        if r.status_code != 200:
            seen.append(r)
            seen.append(_health(server, "/health_generate"))
            break
        time.sleep(0.05)
    worker.join(300)
    assert seen, f"/health stayed 200 through a step of {result['r'].json()['meta_info']['e2e_latency']} s"
    for r in seen:
        assert r.status_code == 503
        message = r.json()["error"]["message"]
        assert "inside one engine step" in message and "--watchdog-timeout" in message, message
    assert result["r"].status_code == 200 and len(result["r"].json()["output_ids"]) == 2
    assert _health(server).status_code == 200
    assert _health(server, "/health_generate").status_code == 200
    log = server.log_text()
    assert "main thread is at" in log and "step" in log.split("main thread is at", 1)[1], log
    assert "/health is 200 again" in log


def test_a_frozen_scheduler_is_reported_even_when_idle(server):
    pid = server.server_info()["pids"]["scheduler"]
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + TIMEOUT_S + 10
        while _health(server).status_code == 200:
            assert time.monotonic() < deadline, "/health stayed 200 for a frozen scheduler"
            time.sleep(0.1)
        assert _health(server).status_code == 503
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while _health(server).status_code != 200:
        assert time.monotonic() < deadline, "/health did not come back after the scheduler went on"
        time.sleep(0.1)
    r = server.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 200
