"""The server (chapter 10), tested from the outside: a real ``python -m minisgl_ref serve`` on the embedded model,
driven by the official ``openai`` client, raw HTTP and signals.

One server (with ``--api-key`` and ``--enable-metrics``) serves most of the module; the tests that break a
server (killing a child) or need another mode (``--shell``) start their own. The last test stops the shared
server with SIGTERM and checks that no process is left behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
from typing import Any

import httpx
import pytest

from tests.server_utils import ServerProcess, alive, children_of, parse_sse, running_server, wait_idle

pytestmark = pytest.mark.slow

API_KEY = "sk-minisgl-test"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    with running_server("--enable-metrics", "--log-level", "warning", api_key=API_KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def llm():
    """The offline engine on the same model, for token-for-token comparisons."""
    import torch

    from minisgl_ref import LLM

    torch.set_num_threads(1)
    return LLM()


def metrics(server: ServerProcess) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    r = server.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if not sample.name.endswith("_bucket"):
                out[sample.name] = sample.value
    return out


# ------------------------------------------------------------------------------------------------ basics


def test_health_models_and_info(server, client):
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed for /health
    models = client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]
    info = server.get("/get_model_info").json()
    assert info["context_length"] == 8192 and info["vocab_size"] == 49152 and info["is_generation"]
    sinfo = server.server_info()
    assert sinfo["max_total_num_tokens"] > 0 and "api_key" not in sinfo
    assert set(sinfo["pids"]) == {"server", "scheduler", "detokenizer"}
    assert server.get("/health_generate").status_code == 200


def test_chat_completion(server, client, llm):
    resp = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=32,
                                          temperature=0)
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"  # the model ended its turn (EOS) before 32 tokens
    expected = llm.chat(CHAT, {"max_new_tokens": 32, "temperature": 0}, use_tqdm=False)[0]
    assert choice.message.content == expected.text
    assert resp.usage.prompt_tokens == len(llm.chat_prompt_ids(CHAT))
    assert resp.usage.completion_tokens == expected.completion_tokens
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens

    short = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=3,
                                           temperature=0)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
    assert expected.text.startswith(short.choices[0].message.content)


def test_chat_streaming(server, client):
    full = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=32,
                                          temperature=0)
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=32,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # The same prompt again: all but its last token come from the radix cache.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == full.usage.prompt_tokens - 1


def test_completions(server, client, llm):
    prompt = "Hello, my name is"
    resp = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=12, temperature=0)
    expected = llm.generate(prompt, {"max_new_tokens": 12, "temperature": 0}, use_tqdm=False)[0]
    assert resp.choices[0].text == expected.text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 12 and resp.usage.prompt_tokens == expected.prompt_tokens

    # A stop string: the text ends just before it, and the finish reason says "stop".
    stopped = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=12,
                                        temperature=0, stop=[","])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == expected.text.split(",")[0]

    stream = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=12,
                                       temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 12

    # A batch of prompts, token ids as a prompt.
    batch = client.completions.create(model="SmolLM2-135M-Instruct", prompt=[prompt, expected.text],
                                      max_tokens=2, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    ids = client.completions.create(model="SmolLM2-135M-Instruct", prompt=llm.tokenizer.encode(prompt),
                                    max_tokens=12, temperature=0)
    assert ids.choices[0].text == expected.text


def test_native_generate_matches_offline(server, llm):
    """The same greedy request through HTTP and through the offline LLM gives the same tokens."""
    prompts = ["The capital of Germany is", "def fibonacci(n):"]
    expected = llm.generate(prompts, {"max_new_tokens": 16, "temperature": 0}, use_tqdm=False)
    r = server.post("/generate", json={"text": prompts, "sampling_params": {"max_new_tokens": 16,
                                                                             "temperature": 0}})
    assert r.status_code == 200, r.text
    outs = r.json()
    assert [o["output_ids"] for o in outs] == [e.output_ids for e in expected]
    assert [o["text"] for o in outs] == [e.text for e in expected]
    meta = outs[0]["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 16}
    assert meta["prompt_tokens"] == expected[0].prompt_tokens and meta["completion_tokens"] == 16
    assert meta["e2e_latency"] > 0 and meta["id"] and "cached_tokens" in meta

    # input_ids, streamed: every event carries the cumulative text; the last one the finish reason.
    ids = llm.tokenizer.encode(prompts[0])
    r = server.post("/generate", json={"input_ids": ids, "stream": True,
                                       "sampling_params": {"max_new_tokens": 16, "temperature": 0}})
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    texts = [e["text"] for e in events[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    streamed_ids = [e["output_ids"] for e in events[:-1]]
    assert all(b[:len(a)] == a and len(b) >= len(a) for a, b in zip(streamed_ids, streamed_ids[1:]))
    assert texts[-1] == expected[0].text and events[-2]["output_ids"] == expected[0].output_ids
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "length"


def test_native_event_with_spliced_ids_is_the_plain_encoding():
    """A native stream event built from the ids' text grown chunk by chunk says what encoding it whole says."""
    from minisgl_ref.server.http_server import Output, native_sse, sse
    from minisgl_ref.server.tokenizer_manager import Chunk

    out = Output()
    for ids, text in (([], ""), ([7], "a"), ([0, 151645], "é\"\n"), ([], ""), ([42], "")):
        out.add(Chunk(text, ids, False, None, 0, len(out.ids) + len(ids), 3, "r"))
        event = {"text": out.text, "output_ids": out.ids, "meta_info": {"id": "r", "finish_reason": None},
                 "index": 1}
        assert json.loads(native_sse(event, out.ids_json)[len("data: "):]) == json.loads(sse(event)[len("data: "):])
        assert native_sse(event, out.ids_json).endswith("\n\n")


def test_chunks_that_piled_up_are_sent_as_one_per_sequence():
    """A handler that fell behind gets, per sequence, one chunk saying what all its waiting chunks said."""
    from minisgl_ref.server.tokenizer_manager import Chunk, coalesce

    def chunk(text, ids, done=False, lp=None):
        return Chunk(text, ids, done, {"type": "length"} if done else None, 2, 0, 5, "r", logprobs=lp)

    pending = [(1, chunk("a", [1], lp={"input": ["p"], "output": ["x1"]})), (0, chunk("b", [2])),
               (1, chunk("c", [3], lp={"input": [], "output": ["x3"]})), (0, chunk("", [4], done=True)),
               (1, chunk("d", [5], done=True))]
    merged = coalesce(pending)
    assert [i for i, _ in merged] == [1, 0]
    one, zero = merged[0][1], merged[1][1]
    assert (one.text, one.token_ids, one.finished, one.logprobs) == ("acd", [1, 3, 5], True,
                                                                      {"input": ["p"], "output": ["x1", "x3"]})
    assert (zero.text, zero.token_ids, zero.finished, zero.logprobs) == ("b", [2, 4], True, None)
    assert coalesce(pending[:1]) == pending[:1]


def test_sampling_parameters_honoured(server, client, llm):
    """Seeded sampling with penalties, top_p and a temperature gives exactly the offline engine's tokens; ``n``
    samples are ``n`` choices, sample j seeded with ``seed + j`` (so choice 0 is the n=1 answer)."""
    params = dict(max_new_tokens=12, temperature=0.9, top_p=0.8, presence_penalty=0.5, frequency_penalty=0.7)
    expected = llm.chat([CHAT] * 3, [{**params, "seed": 1234 + j} for j in range(3)], use_tqdm=False)
    openai_params = dict(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=12, temperature=0.9, top_p=0.8,
                         seed=1234, presence_penalty=0.5, frequency_penalty=0.7)
    one = client.chat.completions.create(**openai_params)
    assert one.choices[0].message.content == expected[0].text
    many = client.chat.completions.create(**openai_params, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.message.content for c in many.choices] == [e.text for e in expected]
    assert many.usage.completion_tokens == sum(e.completion_tokens for e in expected)


METRIC_NAMES = (
    # gauges
    "num_running_reqs", "num_queue_reqs", "num_waiting_reqs", "token_usage", "cache_hit_rate", "gen_throughput",
    "decode_throughput", "prefill_throughput", "num_used_tokens", "max_total_num_tokens",
    # histograms (their _count; _sum and _bucket come with it)
    "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
    "time_per_output_token_seconds_count", "e2e_request_latency_seconds_count",
    # counters
    "prompt_tokens_total", "generation_tokens_total", "cached_tokens_total", "num_requests_total",
    "num_aborted_requests_total",
)


# ------------------------------------------------------------------------------- logprobs and request options

LP_TOL = 1e-4  # the server's engine batches differently from the offline one; float32 agrees to ~1e-6


def test_chat_logprobs_match_the_offline_engine(server, client, llm):
    """``logprobs`` + ``top_logprobs`` in OpenAI's shape, streamed and not, with the offline engine's numbers;
    the answer's tokens spell its content (the EOS that ended it is not one of them)."""
    kw = dict(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=24, temperature=0, logprobs=True,
              top_logprobs=3)
    resp = client.chat.completions.create(**kw)
    choice = resp.choices[0]
    content = choice.logprobs.content
    assert choice.finish_reason == "stop" and len(content) == resp.usage.completion_tokens - 1
    assert "".join(t.token for t in content) == choice.message.content
    ref = llm.generate(llm.chat_prompt_ids(CHAT), {"max_new_tokens": 24, "temperature": 0}, use_tqdm=False,
                       return_logprob=True, top_logprobs_num=3)[0]
    for item, (logprob, token_id, top) in zip(content, ref.output_token_logprobs):
        assert abs(item.logprob - logprob) < LP_TOL
        assert item.bytes == list(item.token.encode())
        assert len(item.top_logprobs) == 3 and item.top_logprobs[0].token == item.token  # greedy: the best one
        assert [abs(a.logprob - b) < LP_TOL for a, (_, b) in zip(item.top_logprobs, top)] == [True] * 3
    stream = client.chat.completions.create(**kw, stream=True)
    streamed = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [(t.token, round(t.logprob, 4)) for t in content]
    r = server.post("/v1/chat/completions", json={"messages": CHAT, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_completion_logprobs_with_echo(server, client, llm):
    prompt = "The capital of France is"
    ids = llm.tokenizer.encode(prompt)
    resp = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=5, temperature=0,
                                     logprobs=2, echo=True)
    choice = resp.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt) and len(lp.tokens) == len(ids) + 5
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[len(ids)] == len(prompt) and lp.text_offset == sorted(lp.text_offset)
    assert "".join(lp.tokens) == choice.text
    ref = llm.generate(ids, {"max_new_tokens": 5, "temperature": 0}, use_tqdm=False, return_logprob=True,
                       top_logprobs_num=2, logprob_start_len=0)[0]
    expected = [e[0] for e in ref.input_token_logprobs + ref.output_token_logprobs]
    assert all((a is None and b is None) or abs(a - b) < LP_TOL for a, b in zip(lp.token_logprobs, expected))
    assert all(t is None or (len(t) in (2, 3) and tok in t) for t, tok in zip(lp.top_logprobs, lp.tokens))
    chunks = list(client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=5,
                                            temperature=0, logprobs=2, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == lp.text_offset
    plain_echo = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=5,
                                           temperature=0, echo=True)
    assert plain_echo.choices[0].text == choice.text and plain_echo.choices[0].logprobs is None


def test_generate_logprobs_in_sglang_shape(server, llm):
    ids = llm.tokenizer.encode("One, two, three,")
    body = {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 2,
            "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    meta = server.post("/generate", json=body).json()["meta_info"]
    assert [t[1] for t in meta["input_token_logprobs"]] == ids[2:]
    assert len(meta["output_token_logprobs"]) == 4 == len(meta["output_top_logprobs"])
    assert all(isinstance(t[0], float) and isinstance(t[2], str) for t in meta["output_token_logprobs"])
    assert all(len(top) == 2 for top in meta["output_top_logprobs"] + meta["input_top_logprobs"])
    ref = llm.generate(ids, {"max_new_tokens": 4, "temperature": 0}, use_tqdm=False, return_logprob=True,
                       logprob_start_len=2)[0]
    assert all(abs(a[0] - b[0]) < LP_TOL for a, b in zip(meta["output_token_logprobs"], ref.output_token_logprobs))
    events = parse_sse(server.post("/generate", json={**body, "stream": True}).text)
    # A stream event carries only its new output tokens' entries (tests/test_sglang_frontend.py has the details).
    assert [e for ev in events[:-1] for e in ev["meta_info"]["output_token_logprobs"]] == meta["output_token_logprobs"]
    bad = server.post("/generate", json={**body, "logprob_start_len": len(ids)})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprob_start_len"


def test_logit_bias_stop_regex_cache_salt_and_continue_final_message(server, client, llm):
    base = dict(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=8, temperature=0)
    plain = client.chat.completions.create(**base)
    first = llm.tokenizer.encode(plain.choices[0].message.content)[0]
    biased = client.chat.completions.create(**base, logit_bias={str(first): -100})
    assert llm.tokenizer.encode(biased.choices[0].message.content)[0] != first

    counted = client.completions.create(model="SmolLM2-135M-Instruct", prompt="1, 2, 3,", max_tokens=30,
                                        temperature=0, extra_body={"stop_regex": r"\b7\b"})
    assert counted.choices[0].finish_reason == "stop" and counted.choices[0].text.endswith("7")

    salted = dict(model="SmolLM2-135M-Instruct", prompt="A salted prompt about caches " * 4, max_tokens=1)
    a1 = client.completions.create(**salted, extra_body={"cache_salt": "tenant-a"})
    b1 = client.completions.create(**salted, extra_body={"cache_salt": "tenant-b"})
    a2 = client.completions.create(**salted, extra_body={"cache_salt": "tenant-a"})
    assert a1.usage.prompt_tokens_details.cached_tokens == 0 and b1.usage.prompt_tokens_details.cached_tokens == 0
    assert a2.usage.prompt_tokens_details.cached_tokens == a2.usage.prompt_tokens - 1

    opened = CHAT + [{"role": "assistant", "content": "The capital of France is"}]
    cont = client.chat.completions.create(**{**base, "messages": opened}, extra_body={"continue_final_message": True})
    expected_ids = llm.tokenizer.apply_chat_template(opened, add_generation_prompt=False,
                                                     continue_final_message=True)
    assert cont.usage.prompt_tokens == len(expected_ids)
    assert "Paris" in cont.choices[0].message.content
    r = server.post("/v1/chat/completions", json={"messages": CHAT, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_metrics_move(server, client):
    before = metrics(server)
    resp = client.completions.create(model="SmolLM2-135M-Instruct", prompt="One, two, three,", max_tokens=5,
                                     temperature=0)
    after = metrics(server)
    m = "sglang:"
    assert after[m + "prompt_tokens_total"] - before[m + "prompt_tokens_total"] == resp.usage.prompt_tokens
    assert after[m + "generation_tokens_total"] - before[m + "generation_tokens_total"] == 5
    assert after[m + "num_requests_total"] - before[m + "num_requests_total"] == 1
    assert after[m + "time_to_first_token_seconds_count"] == before[m + "time_to_first_token_seconds_count"] + 1
    assert after[m + "inter_token_latency_seconds_count"] == before[m + "inter_token_latency_seconds_count"] + 4
    assert (after[m + "time_per_output_token_seconds_count"]
            == before[m + "time_per_output_token_seconds_count"] + 1)
    assert after[m + "e2e_request_latency_seconds_count"] == before[m + "e2e_request_latency_seconds_count"] + 1
    for gauge in ("num_running_reqs", "num_queue_reqs", "num_waiting_reqs", "token_usage", "cache_hit_rate"):
        assert m + gauge in after
    assert after[m + "token_usage"] == 0.0 and 0 <= after[m + "cache_hit_rate"] <= 1
    assert after[m + "num_used_tokens"] == 0 and after[m + "max_total_num_tokens"] > 0
    # The request was prefilled and decoded between the two scrapes, so both rates over that interval are > 0.
    assert after[m + "prefill_throughput"] > 0
    assert after[m + "gen_throughput"] == after[m + "decode_throughput"] > 0


def test_metrics_count_aborted_requests_like_finished_ones(server):
    """Every SGLang metric name is served; and requests whose clients leave mid-stream are counted exactly like
    finished ones: once in the request counter, the e2e and TTFT histograms, plus once as aborted."""
    wait_idle(server)
    before = metrics(server)
    assert not [n for n in METRIC_NAMES if "sglang:" + n not in before]
    assert not [n for n in before if not n.startswith("sglang:")]
    n_finish, n_leave, max_new = 3, 5, 6

    async def one(http: httpx.AsyncClient, i: int, leave: bool) -> dict[str, Any]:
        """Stream one request; a leaver closes the connection after its first 1-3 events that carry tokens.
        Returns the last event's meta_info and whether the client saw a token."""
        body = {"text": f"Count to {i} slowly, please.", "stream": True,
                "sampling_params": {"max_new_tokens": 4000 if leave else max_new, "ignore_eos": True,
                                    "temperature": 0.8, "seed": i}}
        seen, meta = 0, {}
        async with http.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                meta = event["meta_info"]
                seen += bool(event["output_ids"])
                if leave and seen >= 1 + i % 3:
                    break  # leave mid-stream
        return {"got_token": seen > 0, "left": leave, **meta}

    async def main() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=300) as http:
            return await asyncio.gather(*[one(http, i, leave=i >= n_finish) for i in range(n_finish + n_leave)])

    results = asyncio.run(main())
    assert server.get("/health_generate").status_code == 200  # an internal request: counted nowhere
    got_first = sum(r["got_token"] for r in results)
    assert got_first == n_finish + n_leave  # every client read at least one token before leaving
    finished = [r for r in results if not r["left"]]
    assert all(r["finish_reason"]["type"] == "length" and r["completion_tokens"] == max_new for r in finished)

    # An abandoned request is counted when the server notices its client left, a moment after the client closed:
    # wait until the scheduler has dropped every request (it learns of the abort after the count is made).
    wait_idle(server, timeout=60)
    after = metrics(server)

    def delta(name: str) -> float:
        return after["sglang:" + name] - before["sglang:" + name]

    assert delta("num_requests_total") == got_first
    assert delta("e2e_request_latency_seconds_count") == got_first
    assert delta("time_to_first_token_seconds_count") == got_first
    assert delta("num_aborted_requests_total") == n_leave
    assert delta("prompt_tokens_total") == sum(r["prompt_tokens"] for r in results)
    # Generated tokens: exactly those of the finished requests, plus at least what each leaver's client saw.
    seen_by_leavers = sum(r["completion_tokens"] for r in results if r["left"])
    assert delta("generation_tokens_total") >= n_finish * max_new + seen_by_leavers
    assert delta("generation_tokens_total") < n_finish * max_new + n_leave * 4000


# ------------------------------------------------------------------------------------------------ load


async def _stream_one(http: httpx.AsyncClient, i: int) -> dict[str, Any]:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": f"Question {i}: what comes after {i}?", "max_tokens": 4,
            "temperature": 0.7, "seed": i, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        text = "".join([piece async for piece in r.aiter_text()])
    events = parse_sse(text)
    assert events[-1] == "[DONE]"
    finishes = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 4
    return usage


def test_64_concurrent_streams(server):
    async def main() -> list[dict[str, Any]]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=300,
                                     limits=limits) as http:
            return await asyncio.gather(*[_stream_one(http, i) for i in range(64)])

    usages = asyncio.run(main())
    assert len(usages) == 64
    wait_idle(server)


def test_disconnects_free_the_kv_pool(server):
    before = wait_idle(server)
    aborted_before = metrics(server)["sglang:num_aborted_requests_total"]

    async def leave_early(http: httpx.AsyncClient, i: int) -> int:
        body = {"text": f"Tell me a very long story about the number {i}.", "stream": True,
                "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True, "temperature": 0.8}}
        events = 0
        async with http.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events += 1
                if events >= 2 + i % 3:
                    break  # leave mid-stream: closing the response closes the connection
        return events

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=300) as http:
            await asyncio.gather(*[leave_early(http, i) for i in range(20)])

    t0 = time.monotonic()
    asyncio.run(main())
    after = wait_idle(server, timeout=60)  # 20 x 4000 tokens would take far longer if they were not aborted
    assert time.monotonic() - t0 < 120
    assert after["available_kv_tokens"] == before["available_kv_tokens"] == after["max_total_num_tokens"]
    assert metrics(server)["sglang:num_aborted_requests_total"] - aborted_before == 20


# ------------------------------------------------------------------------------------------------ errors

LONG_PROMPT = "hello " * 9000  # > 8192 tokens

BAD_REQUESTS = [
    # (name, path, body (dict, or raw bytes), headers, status, param, message fragment)
    ("malformed JSON", "/v1/chat/completions", b'{"messages": [', None, 400, None, "not valid JSON"),
    ("body not an object", "/v1/completions", b"[1, 2]", None, 400, None, "JSON object"),
    ("NaN", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}', None, 400, None, "NaN"),
    ("messages wrong type", "/v1/chat/completions", {"messages": "hi"}, None, 400, "messages", "valid list"),
    ("max_tokens wrong type", "/v1/chat/completions", {"messages": CHAT, "max_tokens": "10"}, None, 400,
     "max_tokens", "valid integer"),
    ("negative max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": -5}, None, 400, "max_tokens",
     "greater than or equal to 1"),
    ("absurd max_tokens", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 10**12}, None, 400,
     "max_tokens", "maximum context length"),
    ("temperature too high", "/v1/chat/completions", {"messages": CHAT, "temperature": 3.5}, None, 400,
     "temperature", "less than or equal to 2"),
    ("negative temperature", "/v1/completions", {"prompt": "hi", "temperature": -1}, None, 400, "temperature",
     "greater than or equal to 0"),
    ("top_p zero", "/v1/completions", {"prompt": "hi", "top_p": 0}, None, 400, "top_p", "top_p"),
    ("unknown model", "/v1/chat/completions", {"model": "gpt-4o", "messages": CHAT}, None, 404, "model",
     "does not exist"),
    ("prompt too long", "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 1}, None, 400, "prompt",
     "maximum context length"),
    ("chat too long", "/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, None,
     400, "messages", "maximum context length"),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, None, 400,
     "messages.0.role", "Input should be"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, None, 400, "messages", "at least 1"),
    ("token id out of range", "/generate", {"input_ids": [1, 2, 10**6]}, None, 400, "input_ids", "out of range"),
    ("unknown sampling param", "/generate", {"text": "hi", "sampling_params": {"top-p": 0.5}}, None, 400,
     "sampling_params", "unknown sampling parameter"),
    ("bad native param", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, None, 400,
     "max_new_tokens", "max_new_tokens must be >= 0"),
    ("neither text nor ids", "/generate", {"sampling_params": {}}, None, 400, "text", "exactly one"),
    ("missing API key", "/v1/completions", {"prompt": "hi"}, {"Authorization": ""}, 401, None, "API key"),
    ("wrong API key", "/v1/models", None, {"Authorization": "Bearer nope"}, 401, None, "invalid API key"),
    ("unknown route", "/v1/nothing", {"x": 1}, None, 404, None, "Not Found"),
    ("unknown model by id", "/v1/models/gpt-4o", None, None, 404, "model", "does not exist"),
    # Values that once came back as 500s (msgpack, torch or the tokenizer failing on them) or killed the scheduler.
    ("seed over 64 bits", "/v1/chat/completions", {"messages": CHAT, "seed": 2**70}, None, 400, "seed", "64 bits"),
    ("native seed over 64 bits", "/generate", {"text": "hi", "sampling_params": {"seed": 2**64}}, None, 400,
     "sampling_params.seed", "64 bits"),
    ("top_k over 64 bits", "/v1/completions", {"prompt": "hi", "top_k": 10**30}, None, 400, "top_k", "64 bits"),
    ("stop id over 64 bits", "/v1/completions", {"prompt": "hi", "stop_token_ids": [2**70]}, None, 400,
     "stop_token_ids.0", "64 bits"),
    ("prompt id over 64 bits", "/v1/completions", {"prompt": [1, 2**70]}, None, 400, "prompt.1", "64 bits"),
    ("native n huge", "/generate", {"text": "hi", "sampling_params": {"n": 10**9}}, None, 400, "n", "<= 128"),
    ("chat stop id out of vocab", "/v1/chat/completions",
     {"messages": CHAT, "min_tokens": 1, "stop_token_ids": [49152]}, None, 400, "stop_token_ids", "out of range"),
    ("completion stop id out of vocab", "/v1/completions",
     {"prompt": "hi", "min_tokens": 1, "stop_token_ids": [10**6]}, None, 400, "stop_token_ids", "out of range"),
    ("native stop id out of vocab", "/generate",
     {"text": "hi", "sampling_params": {"min_new_tokens": 1, "stop_token_ids": [60000]}}, None, 400,
     "stop_token_ids", "out of range"),
    ("logit_bias key out of vocab", "/generate", {"text": "hi", "sampling_params": {"logit_bias": {"49152": 1.0}}},
     None, 400, "logit_bias", "out of range"),
    ("nested 100000 deep", "/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, 400,
     None, "nests more than"),
    ("nested 900 deep", "/v1/chat/completions", b'{"messages": ' + b"[" * 900 + b"]" * 900 + b"}", None, 400,
     "messages", "nests more than"),
    ("lone surrogate in prompt", "/v1/completions", b'{"prompt": "a\\ud800b"}', None, 400, "prompt",
     "lone surrogate"),
    ("lone surrogate in text", "/generate", b'{"text": ["ok", "\\udfff"]}', None, 400, "text.1", "lone surrogate"),
    ("lone surrogate in chat", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
     None, 400, "messages.0.content", "lone surrogate"),
    ("lone surrogate in stop", "/v1/completions", b'{"prompt": "hi", "stop": ["\\ud800"]}', None, 400, "stop.0",
     "lone surrogate"),
    ("lone surrogate in native stop", "/generate", b'{"text": "hi", "sampling_params": {"stop": "\\ud800"}}', None,
     400, "sampling_params.stop", "lone surrogate"),
    ("lone surrogate in model", "/v1/completions", b'{"prompt": "hi", "model": "\\ud800"}', None, 400, "model",
     "lone surrogate"),
    # Lists long enough to keep the server busy for seconds (pydantic, msgpack, one message per sequence).
    ("too many messages", "/v1/chat/completions", {"messages": CHAT * 5000}, None, 400, "messages", "more than the"),
    ("too many stop strings", "/v1/completions", {"prompt": "hi", "stop": ["x"] * 5000}, None, 400, "stop",
     "more than the"),
    ("batch too long", "/generate", {"text": ["hi"] * 5000}, None, 400, "text", "more than the"),
    ("too many sequences", "/v1/completions", {"prompt": ["hi"] * 9, "n": 128}, None, 400, "prompt", "sequences"),
    ("own chat template", "/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {
        "chat_template": "{% for i in range(10**9) %}{% endfor %}"}}, None, 400, "chat_template_kwargs",
     "cannot be set"),
    ("logprob_start_len past the prompt", "/generate", {"text": "hi", "return_logprob": True,
                                                        "logprob_start_len": 50}, None, 400, "logprob_start_len",
     "below the prompt"),
    ("logit_bias key not a number", "/v1/completions", {"prompt": "hi", "logit_bias": {"\u00b2": 5}}, None, 400,
     "logit_bias", "logit_bias"),
    ("too many native sequences", "/generate", {"input_ids": [[1, 2]] * 1025}, None, 400, "input_ids",
     "sequences"),
    # Grammars that xgrammar cannot parse, and tools that cannot be called (tests/test_server_structured.py has more).
    ("bad regex", "/v1/completions", {"prompt": "hi", "regex": "[0-9"}, None, 400, "regex", "not a valid grammar"),
    ("bad json_schema", "/generate", {"text": "hi", "sampling_params": {"json_schema": '{"type": "nope"}'}}, None,
     400, "json_schema", "not a valid grammar"),
    ("two grammars", "/v1/chat/completions", {"messages": CHAT, "regex": "a", "ebnf": 'root ::= "a"'}, None, 400,
     "ebnf", "only one of"),
    ("tool_choice without tools", "/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, None, 400,
     "tool_choice", "needs tools"),
    # Fields that would change the answer and are not implemented: refused by name, never silently ignored.
    *[(f"unsupported {name}", path, body, None, 400, name, "not supported") for name, path, body in [
        ("structural_tag", "/v1/chat/completions", {"messages": CHAT, "structural_tag": "{}"}),
        ("sampling_params.no_stop_trim", "/generate", {"text": "hi", "sampling_params": {"no_stop_trim": True}}),
        ("spaces_between_special_tokens", "/v1/completions",
         {"prompt": "hi", "spaces_between_special_tokens": False}),
        ("lora_path", "/generate", {"text": "hi", "lora_path": "my-adapter"}),
        ("return_hidden_states", "/v1/completions", {"prompt": "hi", "return_hidden_states": True}),
        ("custom_logit_processor", "/v1/chat/completions", {"messages": CHAT, "custom_logit_processor": "{}"}),
        ("input_embeds", "/generate", {"input_embeds": [[0.5, 0.25]]}),
        ("image_data", "/generate", {"text": "hi", "image_data": "cat.png"}),
        ("functions", "/v1/chat/completions", {"messages": CHAT, "functions": [{"name": "f"}]}),
        ("function_call", "/v1/chat/completions", {"messages": CHAT, "function_call": "auto"}),
        ("audio", "/v1/chat/completions", {"messages": CHAT, "audio": {"voice": "alloy", "format": "wav"}}),
        ("modalities", "/v1/chat/completions", {"messages": CHAT, "modalities": ["text", "audio"]}),
        ("prediction", "/v1/chat/completions", {"messages": CHAT, "prediction": {"type": "content", "content": "x"}}),
        ("suffix", "/v1/completions", {"prompt": "hi", "suffix": "the end"}),
    ]],
]


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request(server, case):
    name, path, body, headers, status, param, fragment = case
    h = {**server.headers, **(headers or {})}
    h = {k: v for k, v in h.items() if v}
    if body is None:
        r = httpx.get(server.url + path, headers=h, timeout=60)
    elif isinstance(body, bytes):
        r = httpx.post(server.url + path, content=body, headers={**h, "Content-Type": "application/json"},
                       timeout=60)
    else:
        r = httpx.post(server.url + path, json=body, headers=h, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert fragment in err["message"], err
    if param is not None:
        assert err["param"] == param, err


def test_bad_requests_do_not_disturb_others(server, client):
    """A stream runs while every bad request above is sent; it completes normally, and so does the next one."""
    async def main() -> tuple[str, list[int]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:  # headers per request
            body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "stream": True,
                    "ignore_eos": True}

            async def stream() -> str:
                async with http.stream("POST", "/v1/completions", json=body, headers=server.headers) as r:
                    return "".join([p async for p in r.aiter_text()])

            async def bad() -> list[int]:
                codes = []
                for _, path, b, headers, _, _, _ in BAD_REQUESTS:
                    kw: dict[str, Any] = {"content": b} if isinstance(b, bytes) else {"json": b}
                    h = {k: v for k, v in {**server.headers, **(headers or {})}.items() if v}
                    codes.append((await http.post(path, headers=h, **kw)).status_code if b is not None else
                                 (await http.get(path, headers=h)).status_code)
                return codes

            text, codes = await asyncio.gather(stream(), bad())
            return text, codes

    text, codes = asyncio.run(main())
    assert [c for c in codes if not 400 <= c < 500] == [], list(zip([b[0] for b in BAD_REQUESTS], codes))
    events = parse_sse(text)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    resp = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Once upon a time", max_tokens=24,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert resp.choices[0].text == "".join(e["choices"][0]["text"] for e in events[:-1])


def test_flush_cache(server):
    wait_idle(server)
    r = server.post("/flush_cache")
    assert r.status_code == 200, r.text
    info = server.server_info()
    assert info["evictable_kv_tokens"] == 0 and info["free_kv_tokens"] == info["max_total_num_tokens"]
    body = {"text": "A fresh prompt after the flush", "sampling_params": {"max_new_tokens": 1}}
    assert server.post("/generate", json=body).json()["meta_info"]["cached_tokens"] == 0
    assert server.post("/generate", json=body).json()["meta_info"]["cached_tokens"] > 0


# ----------------------------------------------------------------------------------- lifecycle and shell


def test_shell_follow_up_turns_hit_the_cache():
    script = "/set temperature 0\n/set max_new_tokens 12\nWhat is the capital of France?\nAnd of Italy?\n" \
             "/reset\n/exit\n"
    srv = ServerProcess("--shell", "--log-level", "warning", stdin=subprocess.PIPE)
    try:
        out, _ = srv.proc.communicate(script.encode(), timeout=240)
        text = out.decode() if out else srv.log_text()
    finally:
        srv.kill_all()
    assert srv.proc.returncode == 0, text
    stats = [tuple(map(int, m)) for m in re.findall(r"\[prompt (\d+) tokens, cached (\d+); generated (\d+)", text)]
    assert len(stats) == 2, text
    (p1, c1, _), (p2, c2, _) = stats
    assert p2 > p1 and c2 >= p1, text  # turn 2 reuses all of turn 1's prompt (and more) from the radix cache
    assert "(history cleared)" in text
    assert "Traceback" not in text and "destroyed but it is pending" not in text, text  # a clean exit


def test_dead_scheduler_fails_fast():
    """Killing the scheduler: the request in flight ends with an abort, /health says why, new requests get 503,
    and the server exits non-zero (after a short grace period) instead of hanging."""
    import threading

    srv = ServerProcess("--log-level", "warning", env={"MINISGL_DEAD_CHILD_GRACE_S": "3"})
    try:
        srv.wait_ready()
        pids = srv.server_info()["pids"]
        events: list[Any] = []
        started = threading.Event()

        def long_stream() -> None:
            body = {"text": "Count to a million:", "stream": True,
                    "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
            with httpx.stream("POST", srv.url + "/generate", json=body, timeout=120) as r:
                text = ""
                for piece in r.iter_text():
                    text += piece
                    started.set()
            events.extend(parse_sse(text))

        t = threading.Thread(target=long_stream)
        t.start()
        assert started.wait(60)
        os.kill(pids["scheduler"], signal.SIGKILL)
        t.join(30)
        assert not t.is_alive(), "the stream in flight did not end"
        assert events[-1] == "[DONE]" and events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
        assert "scheduler" in events[-2]["meta_info"]["finish_reason"]["message"]

        health = httpx.get(srv.url + "/health", timeout=5)
        assert health.status_code == 503 and "scheduler" in health.json()["error"]["message"]
        r = srv.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and "scheduler" in r.json()["error"]["message"]
        assert srv.proc.wait(30) != 0
        time.sleep(0.5)
        assert not alive(pids["detokenizer"]) and not alive(pids["scheduler"])
    finally:
        srv.kill_all()


@pytest.mark.parametrize("flags, fragment", [
    (["--attention-backend", "flashinfer"], "attention backend 'flashinfer' needs a CUDA device"),
    (["--decode-attention-backend", "fa3"], "attention backend 'fa3' needs a CUDA device"),
    (["--attention-backend", "nope"], "invalid choice: 'nope'"),
    (["--port", "0"], "--port must be in 1..65535"),
    (["--max-running-requests", "0"], "max_running_requests"),
    (["--max-request-body-mb", "0"], "--max-request-body-mb must be a positive number"),
], ids=["flashinfer-on-cpu", "fa3-on-cpu", "unknown-backend", "bad-port", "bad-engine-flag", "bad-body-limit"])
def test_bad_flags_fail_before_starting(flags, fragment, capsys):
    """A flag the server cannot honour ends ``serve`` at once with one ``error:`` line and status 2, before any
    child process loads the model."""
    from minisgl_ref.cli import main

    try:
        code = main(["serve", "--device", "cpu", *flags])
    except SystemExit as e:  # argparse rejects unknown choices itself, also with status 2
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and fragment in err, err
    assert "Traceback" not in err


def test_ctrl_c_stops_every_process():
    """Ctrl-C in a terminal sends SIGINT to the whole process group: the children ignore it, the server stops
    them in order and exits with status 0, leaving no process behind."""
    srv = ServerProcess("--log-level", "warning", "--max-total-tokens", "2048")
    try:
        srv.wait_ready()
        pids = srv.server_info()["pids"]
        kids = children_of(srv.proc.pid)
        assert {pids["scheduler"], pids["detokenizer"]} <= set(kids)
        os.killpg(srv.proc.pid, signal.SIGINT)
        assert srv.proc.wait(60) == 0, srv.log_text()
        time.sleep(0.5)
        assert [p for p in kids if alive(p)] == []
    finally:
        srv.kill_all()


def test_sigterm_stops_every_process(server):
    """Last: SIGTERM to the shared server stops it and all of its children, with exit status 0."""
    pids = server.server_info()["pids"]
    kids = children_of(server.proc.pid)
    assert {pids["scheduler"], pids["detokenizer"]} <= set(kids)
    assert server.terminate(timeout=60) == 0, server.log_text()
    time.sleep(0.5)
    assert [p for p in kids if alive(p)] == []


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_serve_engine_defaults_per_device(device: str) -> None:
    """``serve`` mixes decode rows into prompt steps on every device, and cuts prompts into 32-token chunks on a
    CPU only (chapter 10); a flag given on the command line wins either way."""
    from minisgl_ref.cli import build_parser
    from minisgl_ref.server.args import ServerArgs

    def engine(*flags: str):  # type: ignore[no-untyped-def]
        return ServerArgs.from_cli(build_parser().parse_args(["serve", "--device", device, *flags])).engine

    assert engine().enable_mixed_chunk is True
    assert engine().chunked_prefill_size == (32 if device == "cpu" else 8192)
    assert engine("--no-enable-mixed-chunk", "--chunked-prefill-size", "64").enable_mixed_chunk is False
    assert engine("--chunked-prefill-size", "64").chunked_prefill_size == 64
