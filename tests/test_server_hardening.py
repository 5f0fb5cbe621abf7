"""The server's boundary (chapter 10), from the outside: what it accepts that is unusual but valid, the size limit
on request bodies, and that one client's big body does not freeze the streams of the others.

(The requests it must refuse are ``BAD_REQUESTS`` in test_server.py.) One server, with a small body limit so that
a body just under it is quick to build and to tokenize.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any

import httpx
import pytest

from tests.server_utils import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
LIMIT_MB = 4
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-request-body-mb", str(LIMIT_MB), "--log-level", "warning")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.kill_all()


def test_seeds_are_any_64_bit_integer(server):
    """A seed may be any integer that fits in 64 bits, signed or unsigned; the engine uses its low 64 bits, so
    ``2**64 - 1`` and ``-1`` are the same seed. With ``n`` samples, ``seed + j`` wraps instead of overflowing."""
    def output_ids(seed: int, n: int = 1) -> list[list[int]]:
        r = server.post("/generate", json={"text": "Once upon a time", "sampling_params": {
            "max_new_tokens": 8, "temperature": 1.0, "seed": seed, "n": n}})
        assert r.status_code == 200, r.text
        outs = r.json()
        return [o["output_ids"] for o in (outs if isinstance(outs, list) else [outs])]

    top = output_ids(2**64 - 1, n=2)
    assert top[0] == output_ids(-1)[0]  # the same low 64 bits
    assert top[1] == output_ids(0)[0]  # seed + 1 wrapped to 0
    assert output_ids(-(2**63)) and output_ids(2**63)


def test_harmless_fields_are_accepted(server):
    """Metadata and the "not used" values of unsupported fields change nothing: the same greedy answer."""
    plain = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "temperature": 0}
    extras = {"user": "u-1", "metadata": {"team": "a"}, "store": False, "service_tier": "auto",
              "parallel_tool_calls": True, "stream_options": None, "tool_choice": "none", "tools": [],
              "modalities": ["text"], "response_format": {"type": "text"}, "no_stop_trim": False,
              "spaces_between_special_tokens": True, "return_hidden_states": False,
              # null means "the default" wherever OpenAI documents a field as nullable
              "stream": None, "n": None, "logprobs": None, "top_logprobs": None, "logit_bias": None}
    a = server.post("/v1/chat/completions", json=plain)
    b = server.post("/v1/chat/completions", json={**plain, **extras})
    assert a.status_code == b.status_code == 200, b.text
    assert a.json()["choices"][0]["message"] == b.json()["choices"][0]["message"]


@pytest.mark.parametrize("response_format", [None, {"type": "json_object"}])
def test_extreme_but_valid_sampling_numbers_answer(server, response_format):
    """A repetition penalty near 0 is valid, and 5e-324 is even 0 in float32; a temperature of 1e300 is valid and
    inf in float32. Both once made NaN logits, so that the draw took a token the grammar forbids (a 500) or the
    log probabilities were NaN. Every answer is a 200 now, with finite log probabilities. (The OpenAI routes
    take temperatures up to 2, as OpenAI does; /generate takes any.)"""
    for temperature, penalty in [(0.0, 5e-324), (1.0, 5e-324), (1.0, 1e-40)]:
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "temperature": temperature, "seed": 7,
                "repetition_penalty": penalty, "logprobs": True, "top_logprobs": 2}
        if response_format:
            body["response_format"] = response_format
        r = server.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, (temperature, penalty, r.text)
        entries = r.json()["choices"][0]["logprobs"]["content"]
        assert entries and all(math.isfinite(e["logprob"]) for e in entries)
    grammar = {"json_schema": json.dumps({"type": "object"})} if response_format else {}
    for temperature, penalty in [(1e300, 1.0), (1e300, 5e-324)]:
        r = server.post("/generate", json={"text": "The capital of France is", "return_logprob": True,
                                           "sampling_params": {"max_new_tokens": 4, "temperature": temperature,
                                                               "repetition_penalty": penalty, **grammar}})
        assert r.status_code == 200, (temperature, penalty, r.text)
        entries = r.json()["meta_info"]["output_token_logprobs"]
        assert entries and all(math.isfinite(e[0]) for e in entries), entries


def test_min_tokens_yields_to_a_complete_grammar(server):
    """The grammar "(yes|no)" is complete after one word and then allows only EOS, which min_new_tokens bans: the
    row had no token left, and the draw took one the grammar forbids (a 500). The grammar wins: a 200, "yes" or
    "no". Likewise when the request's stop_token_ids cover what the grammar allows."""
    for extra in ({}, {"stop_token_ids": list(range(0, 49152, 7))}):
        for temperature in (0.0, 1.0):
            r = server.post("/generate", json={"text": "Is Paris in France? Answer:", "sampling_params": {
                "max_new_tokens": 8, "min_new_tokens": 6, "temperature": temperature, "regex": "(yes|no)",
                **extra}})
            assert r.status_code == 200, (extra.keys(), temperature, r.text)
            assert r.json()["text"] in ("yes", "no")
    r = server.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 8, "min_tokens": 8,
                                                 "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].startswith("{")
    # Stop ids that are text tokens can corner a grammar: the only ways on are stop ids. One of them ends it.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    for seed in range(4):
        r = server.post("/v1/chat/completions", json={
            "model": MODEL, "messages": CHAT, "max_tokens": 16, "min_tokens": 16, "temperature": 1.0, "seed": seed,
            "stop_token_ids": list(range(0, 49152, 7)), "response_format": {"type": "json_schema", "json_schema": {
                "name": "answer", "schema": schema}}})
        assert r.status_code == 200, (seed, r.text)
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_model_routes(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    assert card.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.status_code == 404 and e.value.code == "model_not_found"

    # SGLang's newer names of the info routes answer exactly like the older ones.
    assert server.get("/model_info").json() == server.get("/get_model_info").json()
    new, old = server.get("/server_info").json(), server.get("/get_server_info").json()
    assert new.keys() == old.keys() and new["pids"] == old["pids"]


def _body(size: int, *, text: bool = True) -> bytes:
    """A /v1/completions body of about ``size`` bytes: one long text prompt, or token ids."""
    if text:
        return json.dumps({"model": MODEL, "prompt": "hello " * (size // 6), "max_tokens": 1}).encode()
    return json.dumps({"model": MODEL, "prompt": [42] * (size // 4), "max_tokens": 1}).encode()


def _post(server: ServerProcess, body: Any, **kw: Any) -> httpx.Response:
    return server.post("/v1/completions", content=body, headers={"Content-Type": "application/json"}, **kw)


def test_body_size_limit(server):
    """Over the limit: 413 at once, by Content-Length or (chunked) by counting. Under it: read, parsed and
    answered on its merits (here: a prompt longer than the context)."""
    limit = LIMIT_MB * 2**20
    for over in (_body(limit + 1024), _body(limit + 1024, text=False)):
        assert len(over) > limit
        t0 = time.monotonic()
        r = _post(server, over)
        assert r.status_code == 413, r.text
        assert time.monotonic() - t0 < 5
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "request_too_large"
        assert f"{LIMIT_MB} MiB" in err["message"] and "--max-request-body-mb" in err["message"]

    over = _body(limit + 1024)
    r = _post(server, iter([over[i:i + 65536] for i in range(0, len(over), 65536)]))  # no Content-Length
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    under = _body(limit - 1024, text=False)
    assert len(under) < limit
    r = _post(server, under)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert server.get("/health").status_code == 200


def test_big_bodies_do_not_freeze_streams(server):
    """While a stream runs, bodies just under the size limit arrive (a long text prompt: seconds of tokenizing;
    a long token-id prompt; a batch of a million one-token prompts) and one over it. The stream's tokens keep
    coming: no gap between its events exceeds 2 s. On a 2-core CPU a token takes ~0.1-0.2 s, and up to ~0.4 s
    while the tokenizing thread competes with the engine for the cores; the same text body parsed and tokenized
    on the event loop stalled the stream for ~7 s, and the batch (fanned out on the event loop) for minutes."""
    limit = LIMIT_MB * 2**20
    bodies = {  # built before the clock starts
        "text": _body(limit - 1024),
        "ids": _body(limit - 1024, text=False),
        "batch": json.dumps({"model": MODEL, "prompt": [[42]] * ((limit - 1024) // 6), "max_tokens": 1}).encode(),
        "over": _body(limit + 1024),
    }
    assert all(len(b) < limit for name, b in bodies.items() if name != "over")

    async def main() -> tuple[list[float], dict[str, Any]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
            times: list[float] = []
            first = asyncio.Event()
            done = asyncio.Event()
            results: dict[str, Any] = {}

            async def stream() -> None:
                body = {"prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0, "stream": True,
                        "ignore_eos": True}
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            times.append(time.monotonic())
                            first.set()
                        if done.is_set():
                            return  # leaving aborts the request

            async def send(name: str, body: bytes) -> None:
                await first.wait()
                t0 = time.monotonic()
                r = await http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
                results[name] = (r.status_code, r.json()["error"], time.monotonic() - t0)

            async def big_ones() -> None:
                await asyncio.gather(*[send(name, body) for name, body in bodies.items()])
                await asyncio.sleep(1.0)  # and the stream still flows afterwards
                done.set()

            await asyncio.gather(stream(), big_ones())
            return times, results

    times, results = asyncio.run(main())
    for name in ("text", "ids"):
        status, err, _ = results[name]
        assert status == 400 and err["code"] == "context_length_exceeded", (name, err)
    status, err, _ = results["batch"]
    assert status == 400 and err["param"] == "prompt" and "more than the" in err["message"], err
    status, err, took = results["over"]
    assert status == 413 and took < 5, (status, took)
    gaps = [b - a for a, b in zip(times, times[1:])]
    print(f"stream: {len(times)} events, max gap {max(gaps):.2f} s; answered after "
          + ", ".join(f"{name} {r[2]:.1f} s" for name, r in results.items()))
    assert len(times) > 10 and max(gaps) < 2.0, max(gaps)


def test_overlapping_parses_keep_the_collector_paused_until_the_last_ends():
    """Bodies are parsed in worker threads, several at once: the garbage collector stays off from the first parse
    to the end of the last, and is on again afterwards, so a parse that finishes early never switches it back on
    under one still running (which would then collect over the whole heap, holding the GIL)."""
    import gc
    import threading

    from minisgl_ref.server.protocol import gc_paused, parse_json_body

    assert gc.isenabled()
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[bool] = []

    def first() -> None:
        with gc_paused():
            first_in.set()
            second_in.wait(5)
        first_out.set()

    def second() -> None:
        first_in.wait(5)
        with gc_paused():
            second_in.set()
            first_out.wait(5)
            seen.append(gc.isenabled())  # the first parse has ended; this one still runs

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == [False] and gc.isenabled()
    assert parse_json_body(b'{"prompt": [[1], [2]]}') == {"prompt": [[1], [2]]} and gc.isenabled()
    with pytest.raises(Exception, match="not valid JSON"):
        parse_json_body(b"{")
    assert gc.isenabled()  # a failed parse resumes it too
