"""Chapter 10: the scheduler process's loop (receive, step, send), run in this process on a tiny model.

The real :class:`SchedulerWorker` with its real ZeroMQ sockets, its loop in a thread; the test plays its two
neighbours, the API server (it sends ``GenerateReqInput``, ``AbortReq`` and ``RpcReq`` messages) and the
detokenizer (it receives the ``BatchTokenOut`` rows). What the loop sends must add up to exactly what the offline
engine generates with the same settings, each token once, with one final row per request. The model is a tiny
Qwen2 with random (name-seeded) weights, so nothing here needs a download or a tokenizer, and each check takes a
second or two.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import zmq

from minisgl_ref.core.config import EngineConfig, ModelArgs
from minisgl_ref.runtime import Runtime, build_runtime
from minisgl_ref.sampling.params import SamplingParams
from minisgl_ref.server import scheduler_process
from minisgl_ref.server.args import Addresses
from minisgl_ref.server.messages import AbortReq, BatchTokenOut, GenerateReqInput, RpcReq, RpcResp, decode, encode
from minisgl_ref.server.scheduler_process import SchedulerWorker

# Radix cache, overlap and chunking off: the loop does not depend on them, and the plain engine keeps it simple.
ENGINE = dict(disable_radix_cache=True, disable_overlap_schedule=True, chunked_prefill_size=-1,
              max_prefill_tokens=1024, max_total_tokens=2048)
PROMPTS = {"a": [5, 6, 7, 8, 9], "b": list(range(20, 50)), "c": [300, 1, 2]}
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny_qwen2")
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "float32"}))
    return str(folder)


@pytest.fixture(scope="module")
def runtime(model_folder) -> Runtime:
    torch.set_num_threads(1)
    return build_runtime(ModelArgs(model_folder, "dummy", device="cpu"), EngineConfig(**ENGINE))


def offline_ids(runtime: Runtime, prompts: dict[str, list[int]], max_new_tokens: dict[str, int]) -> dict[str, list]:
    """What the same engine generates offline, greedily: the answer the loop's rows must add up to."""
    from minisgl_ref.core.request import Req

    reqs = {rid: Req(input_ids=list(ids), rid=f"offline-{rid}", context_len=runtime.context_length,
                     params=SamplingParams(max_new_tokens=max_new_tokens[rid], **GREEDY))
            for rid, ids in prompts.items()}
    for req in reqs.values():
        runtime.engine.add_request(req)
    runtime.engine.run_until_done()
    return {rid: req.output_ids for rid, req in reqs.items()}


class _Watch:
    """Stands in for the worker's ParentWatch: alive until the test says stop."""

    def __init__(self) -> None:
        self.stopped = threading.Event()

    def alive(self) -> bool:
        return not self.stopped.is_set()


class Neighbours:
    """A SchedulerWorker on ``runtime`` with its loop in a thread, and the sockets of its two neighbours."""

    def __init__(self, runtime: Runtime) -> None:
        self.addrs = Addresses.fresh()
        self.ctx = zmq.Context()
        self.detok = self.ctx.socket(zmq.PULL)
        self.detok.bind(self.addrs.detokenizer)
        self.api = self.ctx.socket(zmq.PULL)
        self.api.bind(self.addrs.api)
        self.worker = SchedulerWorker(runtime, self.addrs)
        self.worker.watch = _Watch()
        self.to_scheduler = self.ctx.socket(zmq.PUSH)
        self.to_scheduler.connect(self.addrs.scheduler)
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.rows: dict[str, list[tuple[list[int], bool, Any, Any]]] = {}  # rid -> (new ids, finished, reason, init)
        self.messages: list[BatchTokenOut] = []

    def start(self) -> None:
        def loop() -> None:
            try:
                self.worker.run()
            except BaseException as e:  # noqa: BLE001 - reported by the test
                self.error = e

        self.thread = threading.Thread(target=loop, name="scheduler-loop", daemon=True)
        self.thread.start()

    def send(self, msg: Any) -> None:
        self.to_scheduler.send(encode(msg))

    def generate(self, rid: str, max_new_tokens: int, prompt: list[int] | None = None) -> None:
        params = SamplingParams(max_new_tokens=max_new_tokens, **GREEDY)
        self.send(GenerateReqInput(rid, list(prompt or PROMPTS[rid]), params.to_dict()))

    def wait_delivered(self) -> None:
        """Until the scheduler's socket has received what we sent (ZeroMQ delivers in the background)."""
        deadline = time.monotonic() + 5
        while not self.worker.recv.poll(0):
            assert time.monotonic() < deadline, "the messages did not reach the scheduler's socket"
            time.sleep(0.01)
        time.sleep(0.2)  # the first one is there; give the rest of a burst the same chance

    def _take(self, timeout_ms: int) -> bool:
        if not self.detok.poll(timeout_ms):
            return False
        msg = decode(self.detok.recv())
        assert isinstance(msg, BatchTokenOut), f"the detokenizer only receives BatchTokenOut, got {msg!r}"
        self.messages.append(msg)
        for i, rid in enumerate(msg.rids):
            got = self.rows.setdefault(rid, [])
            assert not (got and got[-1][1]), f"request {rid} got a row after its final one"
            got.append((list(msg.new_ids[i]), msg.finished[i], msg.finish_reasons[i], msg.inits[i]))
        return True

    def collect(self, rids: list[str], timeout: float = 20.0, guard: Callable[[], None] | None = None,
                engine_may_fail: bool = False) -> dict[str, list[tuple[list[int], bool, Any, Any]]]:
        """Read rows until each of ``rids`` has had its final row. Fails at once if the loop died (or ``guard``
        raises), and soon if the engine is idle while some request still waits for its final row; and, unless
        ``engine_may_fail``, with the engine's error if a request was aborted because a step raised."""
        deadline, quiet_since = time.monotonic() + timeout, time.monotonic()
        while not all(self.rows.get(r) and self.rows[r][-1][1] for r in rids):
            if guard is not None:
                guard()
            self.check_alive()
            if self._take(100):
                quiet_since = time.monotonic()
                continue
            missing = [r for r in rids if not (self.rows.get(r) and self.rows[r][-1][1])]
            if not self.worker.engine.has_work and time.monotonic() - quiet_since > 1.0:
                raise AssertionError(f"the engine has nothing left to do, but {missing} never got a final row "
                                     f"(rows so far: {self.rows})")
            assert time.monotonic() < deadline, f"{missing} did not finish within {timeout} s: {self.rows}"
        if not engine_may_fail:  # a step that raised ends its requests with an abort: show that error itself
            for r in rids:
                reason = self.rows[r][-1][2]
                if isinstance(reason, dict) and str(reason.get("message", "")).startswith("the engine failed"):
                    raise AssertionError(f"request {r}: {reason['message']}")
        return self.rows

    def check_alive(self) -> None:
        """Raise what ended the loop, if it has ended: a loop must run until it is told to stop."""
        if self.error is not None:
            raise self.error
        assert self.thread is None or self.thread.is_alive(), "the scheduler loop returned before it was stopped"

    def wait_first_row(self, rid: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.rows.get(rid):
            self.check_alive()
            assert time.monotonic() < deadline, f"no row for request {rid} within {timeout} s"
            self._take(100)

    def rpc(self, method: str, rpc_id: int = 1) -> RpcResp:
        self.send(RpcReq(rpc_id, method))
        assert self.api.poll(10_000), f"no answer to the {method} RPC"
        resp = decode(self.api.recv())
        assert isinstance(resp, RpcResp) and resp.rpc_id == rpc_id
        return resp

    def close(self) -> None:
        self.worker.watch.stopped.set()
        if self.thread is not None and self.thread.is_alive():
            try:
                self.send(RpcReq(0, "get_stats"))  # wakes a loop asleep on its socket
            except zmq.ZMQError:
                pass
            self.thread.join(10)
        self.worker.close()
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.addrs.folder, ignore_errors=True)


@pytest.fixture
def neighbours(runtime):
    n = Neighbours(runtime)
    yield n
    n.close()
    assert not runtime.engine.has_work, "a test left requests in the engine"


def ids_of(rows: list[tuple[list[int], bool, Any, Any]]) -> list[int]:
    return [t for new_ids, *_ in rows for t in new_ids]


@pytest.mark.task("10.2")
def test_rows_add_up_to_the_offline_tokens(runtime, neighbours):
    """Three requests and one that asks for no tokens: every output id is sent exactly once and in order, the
    first row of each request carries its ``init``, and each request ends with exactly one final row."""
    lengths = {"a": 6, "b": 11, "c": 3}
    expected = offline_ids(runtime, PROMPTS, lengths)
    neighbours.start()
    for rid, n in lengths.items():
        neighbours.generate(rid, n)
    neighbours.generate("nothing", 0, prompt=[1, 2, 3])  # answered at the door: its only row is a final one
    rows = neighbours.collect([*lengths, "nothing"])
    for rid in lengths:
        assert ids_of(rows[rid]) == expected[rid], f"request {rid}: the rows' ids are not the generated ones"
        assert rows[rid][-1][2]["type"] == "length"
        assert rows[rid][0][3] is not None and all(init is None for *_, init in rows[rid][1:])
    assert rows["nothing"] == [([], True, rows["nothing"][0][2], rows["nothing"][0][3])]
    assert rows["nothing"][0][2]["type"] == "length"
    stats = neighbours.rpc("get_stats").result
    assert stats["num_running_reqs"] == 0 and stats["num_tracked_reqs"] == 0


@pytest.mark.task("10.2")
def test_requests_that_arrive_together_share_the_first_step(neighbours):
    """Messages waiting together are all taken before the next step, so one prefill step computes all three
    prompts and the first BatchTokenOut carries a token for each of them."""
    for rid in PROMPTS:
        neighbours.generate(rid, 4)
    neighbours.wait_delivered()
    neighbours.start()
    neighbours.collect(list(PROMPTS))
    first = neighbours.messages[0]
    assert sorted(first.rids) == sorted(PROMPTS), f"the first step ran only {first.rids}"
    assert all(len(ids) == 1 for ids in first.new_ids)


@pytest.mark.task("10.2")
def test_the_loop_never_waits_for_messages_while_requests_run(neighbours, monkeypatch):
    """While the engine has work the loop must not sleep on its socket: each step follows the last at once.
    Here an idle wait would last a minute, so one wait between two steps fails the test."""
    waits: list[int] = []

    class WatchedPoller(zmq.Poller):
        def poll(self, timeout: Any = None) -> Any:
            if timeout and neighbours.worker.engine.has_work:
                waits.append(timeout)
            return super().poll(timeout)

    monkeypatch.setattr(scheduler_process, "IDLE_POLL_MS", 60_000)
    monkeypatch.setattr(zmq, "Poller", WatchedPoller)
    def no_wait() -> None:
        assert not waits, f"the loop slept on its socket (up to {waits[0]} ms) while the engine had work"

    neighbours.start()
    neighbours.generate("a", 12)
    rows = neighbours.collect(["a"], timeout=10.0, guard=no_wait)
    assert len(ids_of(rows["a"])) == 12
    no_wait()


@pytest.mark.task("10.2")
def test_an_abort_ends_a_running_request_at_once(runtime, neighbours):
    """An AbortReq for a running request: its final row says ``abort``, it leaves the engine, and the loop goes
    on serving the next request."""
    expected = offline_ids(runtime, {"a": PROMPTS["a"]}, {"a": 3})["a"]
    neighbours.start()
    neighbours.generate("b", 400)
    neighbours.wait_first_row("b")  # running: it has had its first token
    neighbours.send(AbortReq("b"))
    rows = neighbours.collect(["b"])
    assert rows["b"][-1][2]["type"] == "abort", f"the aborted request ended with {rows['b'][-1][2]}"
    assert len(ids_of(rows["b"])) < 400
    neighbours.generate("a", 3)
    assert ids_of(neighbours.collect(["a"])["a"]) == expected
    stats = neighbours.rpc("get_stats").result
    assert stats["num_running_reqs"] == 0 and stats["num_tracked_reqs"] == 0


@pytest.mark.task("10.2")
def test_a_failed_step_aborts_what_is_in_flight_and_the_loop_goes_on(neighbours, monkeypatch):
    """An exception out of ``engine.step()`` must not end the loop (the scheduler process would die, and the
    server with it): the requests in flight end with an abort naming the error, and the next request is served."""
    engine = neighbours.worker.engine
    real_step, calls = engine.step, []

    def failing_step():  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the device fell over")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    neighbours.start()
    neighbours.generate("a", 50)
    rows = neighbours.collect(["a"], engine_may_fail=True)
    reason = rows["a"][-1][2]
    assert reason["type"] == "abort" and "the device fell over" in reason["message"], reason
    neighbours.generate("c", 3)
    assert len(ids_of(neighbours.collect(["c"])["c"])) == 3
