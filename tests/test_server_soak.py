"""A bounded soak of the HTTP server: over a minute of mixed concurrent traffic, and the server comes out whole.

For ``SOAK_SECONDS`` of wall time, asyncio clients (one ``httpx.AsyncClient``, a seeded RNG each) keep the server
busy with everything a real deployment sees at once:

* **greedy** requests, streamed or not, on all three routes, whose text must equal what the same request gave on
  the idle server before the soak (greedy decoding must not depend on what else is in the batch);
* **leavers**: long streams whose client disconnects after a few events;
* **fan-out**: ``n`` = 2-4 samples, one choice (or native output) each;
* **long prompts** of 1,000-3,000 tokens, arriving while the others stream;
* **watchers**: greedy streams whose event times are recorded, to measure the largest gap between consecutive
  events while long prompts are being prefilled (on a CPU the server cuts prompts into 32-token chunks that share
  their steps with the decode rows, so a long prompt must not freeze the streams);
* **bad requests**, a mix of the 4xx cases, each of which must get its own status and an OpenAI-style error.

It asserts: no 5xx ever; every stream that was not abandoned ends with ``data: [DONE]``; every greedy answer equals
its reference; the largest gap is under ``MAX_GAP_S`` (generous: the machine is shared); and at the end the request
table and the KV pool are idle again and the server and its children are alive. One line of counts is printed.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.server_utils import ServerProcess, alive, error_body_problem, running_server, sse_problem, wait_idle

pytestmark = pytest.mark.slow

SOAK_SECONDS = 75.0
SEED = 1234
MAX_GAP_S = 5.0
REQUEST_TIMEOUT_S = 120.0
BODY_LIMIT_MB = 2
CLIENTS = {"greedy": 4, "leaver": 2, "fanout": 2, "long_prompt": 1, "watcher": 2, "bad": 2}
CHAT = [{"role": "user", "content": "What is the capital of France?"}]

# Greedy requests whose answers are fixed by the model alone (ignore_eos: always the full length).
GREEDY = [
    ("/v1/completions", {"prompt": "The capital of Germany is", "max_tokens": 12, "temperature": 0,
                         "ignore_eos": True}),
    ("/v1/completions", {"prompt": [504, 3458, 282, 4649, 314], "max_tokens": 8, "temperature": 0}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 12, "temperature": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "Answer in one word."},
                                          {"role": "user", "content": "Name a colour."}],
                              "max_tokens": 6, "temperature": 0, "ignore_eos": True}),
    ("/generate", {"text": "def fibonacci(n):", "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                                   "ignore_eos": True}}),
    ("/generate", {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 10, "top_k": 1,
                                                                  "ignore_eos": True}}),
]
WATCHED = [{"prompt": f"Chapter {i}. It was a dark and stormy night;", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True} for i in range(2)]
LONG = "hello " * 9000  # > 8192 tokens
BAD = [  # (path, body: dict or raw bytes, expected status)
    ("/v1/chat/completions", b'{"messages": [', 400),
    ("/v1/completions", b"[1, 2]", 400),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400),
    ("/v1/chat/completions", {"messages": "hi"}, 400),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": "10"}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 10**12}, 400),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400),
    ("/v1/chat/completions", {"model": "gpt-4o", "messages": CHAT}, 404),
    ("/v1/completions", {"prompt": LONG, "max_tokens": 1}, 400),
    ("/generate", {"input_ids": [1, 2, 10**6]}, 400),
    ("/generate", {"text": "hi", "sampling_params": {"top-p": 0.5}}, 400),
    ("/generate", {"text": "hi", "sampling_params": {"n": 10**9}}, 400),
    ("/v1/chat/completions", {"messages": CHAT, "seed": 2**70}, 400),
    ("/v1/completions", {"prompt": [1, 2**70]}, 400),
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', 400),
    ("/v1/chat/completions", b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}}, 400),
    ("/generate", {"text": "hi", "sampling_params": {"regex": "(", "max_new_tokens": 2}}, 400),
    ("/generate", {"text": "hi", "sampling_params": {"stop_regex": "(", "max_new_tokens": 2}}, 400),
    ("/v1/completions", {"prompt": "x" * (BODY_LIMIT_MB * 2**20 + 1), "max_tokens": 1}, 413),
    ("/v1/nothing", {"x": 1}, 404),
]


@pytest.fixture(scope="module")
def server():
    with running_server("--log-level", "warning", "--max-request-body-mb", str(BODY_LIMIT_MB)) as srv:
        yield srv


@dataclass
class Soak:
    """What the clients saw, and when the long prompts were in flight."""

    deadline: float
    references: dict[int, str] = field(default_factory=dict)  # GREEDY index (or -1 - WATCHED index) -> text
    requests: Counter = field(default_factory=Counter)  # kind -> count
    statuses: Counter = field(default_factory=Counter)  # status -> count
    problems: list[str] = field(default_factory=list)
    streams_done: int = 0
    streams_left: int = 0
    long_spans: list[tuple[float, float]] = field(default_factory=list)
    long_tokens: list[int] = field(default_factory=list)
    watched: list[tuple[float, float, float]] = field(default_factory=list)  # (start, end, largest gap)

    def running(self) -> bool:
        return time.monotonic() < self.deadline

    def problem(self, kind: str, what: str) -> None:
        if len(self.problems) < 50:
            self.problems.append(f"{kind}: {what}"[:800])

    def max_gap_during_long_prompts(self) -> float:
        return max((gap for start, end, gap in self.watched
                    if any(s < end and start < e for s, e in self.long_spans)), default=0.0)


# ------------------------------------------------------------------------------------------------ one request


def content(body: Any) -> dict[str, Any]:
    return {"content": body} if isinstance(body, bytes) else {"json": body}


async def call(http: httpx.AsyncClient, soak: Soak, kind: str, path: str, body: Any) -> tuple[int, Any]:
    """A non-streamed request: its status and parsed body. A non-2xx must carry an OpenAI-style error."""
    soak.requests[kind] += 1
    r = await http.post(path, headers={"Content-Type": "application/json"}, **content(body))
    soak.statuses[r.status_code] += 1
    if r.status_code >= 300:
        problem = error_body_problem(r.content)
        if problem:
            soak.problem(kind, f"{path}: {problem}")
        return r.status_code, None
    return r.status_code, r.json()


async def stream(http: httpx.AsyncClient, soak: Soak, kind: str, path: str, body: dict[str, Any],
                 leave_after: int | None = None) -> tuple[int, list[Any], list[float]]:
    """A streamed request: its status, its events (ending in "[DONE]" unless abandoned) and their arrival times.
    With ``leave_after``, the client closes the connection after that many events."""
    soak.requests[kind] += 1
    events: list[Any] = []
    times: list[float] = []
    async with http.stream("POST", path, json={**body, "stream": True}) as r:
        soak.statuses[r.status_code] += 1
        if r.status_code != 200:
            problem = error_body_problem(await r.aread())
            soak.problem(kind, f"{path} {json.dumps(body)[:200]}: HTTP {r.status_code} ({problem or 'an error'})")
            return r.status_code, [], []
        text = ""
        async for chunk in r.aiter_text():
            text += chunk
            while "\n\n" in text:
                block, text = text.split("\n\n", 1)
                times.append(time.monotonic())
                events.append(block)
                if leave_after is not None and len(events) >= leave_after:
                    soak.streams_left += 1
                    return 200, events, times  # closing the response mid-stream closes the connection
    parsed, problem = sse_problem("".join(e + "\n\n" for e in events) + text)
    if problem:
        soak.problem(kind, f"{path} {json.dumps(body)[:200]}: {problem}")
    else:
        soak.streams_done += 1
    return 200, parsed, times


def text_of(path: str, answer: Any) -> str:
    if path == "/generate":
        return answer["text"]
    choice = answer["choices"][0]
    return choice["message"]["content"] if path == "/v1/chat/completions" else choice["text"]


def streamed_text(path: str, events: list[Any]) -> str:
    if path == "/generate":
        return events[-2]["text"]  # cumulative
    if path == "/v1/chat/completions":
        return "".join(c["delta"].get("content") or "" for e in events[:-1] for c in e["choices"])
    return "".join(c["text"] for e in events[:-1] for c in e["choices"])


# ------------------------------------------------------------------------------------------------- the clients


async def greedy_client(http: httpx.AsyncClient, soak: Soak, rng: random.Random) -> None:
    while soak.running():
        i = rng.randrange(len(GREEDY))
        path, body = GREEDY[i]
        if rng.random() < 0.5:
            status, events, _ = await stream(http, soak, "greedy", path, body)
            text = streamed_text(path, events) if status == 200 and events[-1:] == ["[DONE]"] else None
        else:
            status, answer = await call(http, soak, "greedy", path, body)
            text = text_of(path, answer) if status == 200 else None
        if status != 200:
            soak.problem("greedy", f"{path} {json.dumps(body)}: HTTP {status}")
        elif text is not None and text != soak.references[i]:
            soak.problem("greedy", f"{path} {json.dumps(body)}: want {soak.references[i]!r}, got {text!r}")


async def leaver_client(http: httpx.AsyncClient, soak: Soak, rng: random.Random) -> None:
    while soak.running():
        seed = rng.randrange(2**32)
        path, body = rng.choice([
            ("/generate", {"text": f"Tell me a long story about {seed}.", "sampling_params": {
                "max_new_tokens": 2000, "ignore_eos": True, "temperature": 0.8, "seed": seed}}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"Count from {seed}."}],
                                      "max_tokens": 2000, "ignore_eos": True, "temperature": 0.8, "seed": seed}),
            ("/v1/completions", {"prompt": f"{seed} bottles of beer", "max_tokens": 2000, "ignore_eos": True,
                                 "n": 2, "seed": seed}),
        ])
        await stream(http, soak, "leaver", path, body, leave_after=rng.randint(1, 6))


async def fanout_client(http: httpx.AsyncClient, soak: Soak, rng: random.Random) -> None:
    while soak.running():
        n, seed = rng.randint(2, 4), rng.randrange(2**63)
        path, body = rng.choice([
            ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 6, "temperature": 0.9, "n": n, "seed": seed}),
            ("/v1/completions", {"prompt": "My favourite fruit is", "max_tokens": 6, "temperature": 0.9, "n": n,
                                 "seed": seed}),
            ("/generate", {"text": "A list of animals:", "sampling_params": {"max_new_tokens": 6, "n": n,
                                                                            "temperature": 0.9, "seed": seed}}),
        ])
        if rng.random() < 0.5:
            status, events, _ = await stream(http, soak, "fanout", path, body)
            finishes = sorted(_finished_indexes(path, events)) if status == 200 and events else None
        else:
            status, answer = await call(http, soak, "fanout", path, body)
            finishes = sorted(range(len(answer)) if path == "/generate" else
                              [c["index"] for c in answer["choices"]]) if status == 200 else None
        if status != 200:
            soak.problem("fanout", f"{path}: HTTP {status}")
        elif finishes is not None and finishes != list(range(n)):
            soak.problem("fanout", f"{path} n={n}: finished choices {finishes}")


def _finished_indexes(path: str, events: list[Any]) -> list[int]:
    if path == "/generate":
        return [e.get("index", 0) for e in events[:-1] if e["meta_info"]["finish_reason"] is not None]
    return [c["index"] for e in events[:-1] for c in e["choices"] if c["finish_reason"] is not None]


WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact river mountain garden window letter music story").split()


async def long_prompt_client(http: httpx.AsyncClient, soak: Soak, rng: random.Random) -> None:
    while soak.running():
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1000, 2900)))
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
        start = time.monotonic()
        if rng.random() < 0.5:
            status, events, _ = await stream(http, soak, "long_prompt", "/v1/completions",
                                             {**body, "stream_options": {"include_usage": True}})
            usage = events[-2]["usage"] if status == 200 and events[-1:] == ["[DONE]"] else None
        else:
            status, answer = await call(http, soak, "long_prompt", "/v1/completions", body)
            usage = answer["usage"] if status == 200 else None
        soak.long_spans.append((start, time.monotonic()))
        if status != 200:
            soak.problem("long_prompt", f"HTTP {status}")
        elif usage is not None:
            soak.long_tokens.append(usage["prompt_tokens"])


async def watcher_client(http: httpx.AsyncClient, soak: Soak, rng: random.Random) -> None:
    while soak.running():
        i = rng.randrange(len(WATCHED))
        start = time.monotonic()
        status, events, times = await stream(http, soak, "watcher", "/v1/completions", WATCHED[i])
        if status != 200 or events[-1:] != ["[DONE]"]:
            continue  # already a problem
        gaps = [b - a for a, b in zip(times, times[1:])]  # from the first token on: queueing is not a gap
        soak.watched.append((start, time.monotonic(), max(gaps, default=0.0)))
        text = streamed_text("/v1/completions", events)
        if text != soak.references[-1 - i]:
            soak.problem("watcher", f"want {soak.references[-1 - i]!r}, got {text!r}")


async def bad_client(http: httpx.AsyncClient, soak: Soak, rng: random.Random) -> None:
    while soak.running():
        path, body, want = rng.choice(BAD)
        status, _ = await call(http, soak, "bad", path, body)
        if status != want:
            soak.problem("bad", f"{path} {(body if isinstance(body, bytes) else json.dumps(body).encode())[:200]!r}:"
                                f" want HTTP {want}, got {status}")
        await asyncio.sleep(0.2 + rng.random())


CLIENT_FUNCTIONS = {"greedy": greedy_client, "leaver": leaver_client, "fanout": fanout_client,
                    "long_prompt": long_prompt_client, "watcher": watcher_client, "bad": bad_client}


async def guarded(client: Any, http: httpx.AsyncClient, soak: Soak, rng: random.Random, name: str) -> None:
    """Run one client; a transport error or a malformed answer ends it with a problem instead of the soak."""
    try:
        await client(http, soak, rng)
    except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as e:
        soak.problem(name, f"the client died: {type(e).__name__}: {e}")


async def references(http: httpx.AsyncClient, soak: Soak) -> None:
    for i, (path, body) in enumerate(GREEDY):
        status, answer = await call(http, soak, "reference", path, body)
        assert status == 200, (path, body)
        soak.references[i] = text_of(path, answer)
    for i, body in enumerate(WATCHED):
        status, answer = await call(http, soak, "reference", "/v1/completions", body)
        assert status == 200, body
        soak.references[-1 - i] = text_of("/v1/completions", answer)


async def run_soak(url: str) -> Soak:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=32)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits) as http:
        soak = Soak(deadline=float("inf"))
        await references(http, soak)
        soak.deadline = time.monotonic() + SOAK_SECONDS
        tasks = [guarded(CLIENT_FUNCTIONS[kind], http, soak, random.Random(f"{SEED}-{kind}-{j}"), kind)
                 for kind, count in CLIENTS.items() for j in range(count)]
        await asyncio.wait_for(asyncio.gather(*tasks), SOAK_SECONDS + 2 * REQUEST_TIMEOUT_S)
    return soak


# ----------------------------------------------------------------------------------------------------- the test


def test_soak(server):
    wait_idle(server)
    pids = server.server_info()["pids"]
    t0 = time.monotonic()
    soak = asyncio.run(run_soak(server.url))
    elapsed = time.monotonic() - t0
    assert server.proc.poll() is None, f"the server died:\n{server.log_text()}"
    info = wait_idle(server, timeout=120)  # leavers' aborts and the last requests drain

    max_gap = soak.max_gap_during_long_prompts()
    overall_gap = max((g for _, _, g in soak.watched), default=0.0)
    overlapping = sum(any(s < end and start < e for s, e in soak.long_spans) for start, end, _ in soak.watched)
    print(f"\nsoak: {elapsed:.0f} s; requests {dict(soak.requests)}; statuses {dict(sorted(soak.statuses.items()))}; "
          f"streams done {soak.streams_done}, abandoned {soak.streams_left}; long prompts {len(soak.long_tokens)} "
          f"({min(soak.long_tokens, default=0)}-{max(soak.long_tokens, default=0)} tokens); max SSE gap "
          f"{max_gap:.2f} s over {overlapping} streams during long prompts ({overall_gap:.2f} s over all "
          f"{len(soak.watched)}); idle KV {info['available_kv_tokens']}/{info['max_total_num_tokens']}")

    assert not [s for s in soak.statuses if s >= 500], soak.statuses
    if soak.problems:
        pytest.fail(f"{len(soak.problems)} problems (the first 50):\n" + "\n".join(soak.problems), pytrace=False)
    assert server.proc.poll() is None and all(alive(pid) for pid in pids.values()), server.log_text()
    assert soak.long_tokens and all(900 <= n <= 3300 for n in soak.long_tokens), soak.long_tokens
    assert overlapping > 0, "no watched stream ran while a long prompt was in flight"
    assert max_gap < MAX_GAP_S, f"a stream waited {max_gap:.2f} s for its next event while a long prompt arrived"
    assert server.get("/health").status_code == 200
