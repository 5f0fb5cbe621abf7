# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 10 — The server
#
# **What you will build.** `python -m minisgl_ref serve`: the engine of chapters 03-09 behind an HTTP server that
# speaks OpenAI's API (`/v1/chat/completions`, `/v1/completions`, `/v1/responses`, `/v1/models`) and SGLang's
# native one (`/generate` and friends), streams tokens as they are made, notices clients that leave, and reports
# Prometheus metrics. Its heartbeat is the scheduler's loop, which feeds the engine and drains it (task 10.2). Then
# `python -m minisgl_ref bench serving`, the load generator that measures a server the way its users experience
# it (task 10.1).
#
# **Why it matters.** Up to now one Python call owned the engine: `LLM.generate` handed it every request at once
# and waited for all of them. A server is different in every way that matters. Requests arrive one by one, at
# any time, from clients that may disconnect; each client wants its first token quickly and the rest as they
# come; a bad request must be refused without disturbing the others; and the engine must never sit idle while
# the process that holds it parses JSON. SGLang and Mini-SGLang answer this with the same design, which we
# follow: several processes, each doing one job, passing small messages.
#
# The oracle is still the judge: a greedy request sent over HTTP must come back with exactly the token ids of
# chapter 00's loop.
#
# In this chapter you will:
#
# 1. see the four processes and why the work is split that way;
# 2. encode the messages they exchange, and count their bytes;
# 3. follow one request end to end, from the HTTP handler to the scheduler to the detokenizer and back, and write
#    the scheduler's loop: receive, step, send (task 10.2);
# 4. start the real server on the embedded model and watch it refuse connections until the model is loaded;
# 5. talk to it with the official `openai` client, check it against the oracle, and read a raw SSE stream;
# 6. send it bad requests, walk away from a stream mid-way, and read its metrics;
# 7. measure it under load with `bench serving` (task 10.1), and stop it cleanly;
# 8. put two servers behind SGLang's router with `--dp-size 2`, and see requests that share a prefix stay together.
#
# Modules: `minisgl_ref/server/` (`launch.py`, `http_server.py`, `tokenizer_manager.py`, `scheduler_process.py`,
# `detokenizer_process.py`, `messages.py`, `metrics.py`, `shell.py`, `data_parallel.py`) and
# `minisgl_ref/bench/serving.py`. The [server reference](../server-reference.md) collects what a first reading can
# skip: every request field, the metrics, failure isolation, the watchdog and data parallelism in detail.

# %% tags=["setup"]
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm's widget bar; its text bar is enough here

import httpx
import torch
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from minisgl_ref import LLM, SamplingParams
from minisgl_ref.bench.serving import (
    RequestOutput,
    ServingBenchConfig,
    compute_metrics,
    run_benchmark,
)
from minisgl_ref.bench import serving
from minisgl_ref.book import show_code, show_table, shorten, wrap
from minisgl_ref.server import messages, scheduler_process
from minisgl_ref.core.config import ModelArgs
from minisgl_ref.server.args import Addresses, ServerArgs
from minisgl_ref.server.detokenizer_process import DetokenizerWorker, load_tokenizer

CHAPTER_START = time.perf_counter()

# One torch thread in this notebook's process, as in the other chapters: the server we start below runs its own
# engine in its own process, and the two should not fight over a small machine's cores.
torch.set_num_threads(int(os.environ.get("MINISGL_THREADS", "1")))

ROOT = Path.cwd() if (Path.cwd() / "minisgl_ref").is_dir() else Path.cwd().parent


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid``, read from /proc (Linux)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    """Is process ``pid`` running (present in /proc and not a zombie)?"""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


# %% [markdown]
# ## 1. Four processes
#
# ```mermaid
# flowchart TB
#     C["HTTP clients<br/>(openai, curl, bench serving)"]
#     subgraph API["API server process"]
#         U["uvicorn + FastAPI<br/>http_server.py"]
#         TM["TokenizerManager<br/>tokenize, validate, route outputs"]
#     end
#     S["scheduler process (one per TP rank)<br/>Engine.step() in a loop"]
#     D["detokenizer process<br/>IncrementalDetokenizer per request"]
#     C -- "HTTP / SSE" --> U
#     U --> TM
#     TM -- "GenerateReqInput, AbortReq, RpcReq" --> S
#     S -- "BatchTokenOut" --> D
#     D -- "BatchStrOut" --> TM
#     S -- "RpcResp" --> TM
# ```
#
# * The **API server** (the process you start) runs uvicorn's event loop. Every HTTP connection is a coroutine on
#   it, so thousands of idle streams cost almost nothing. The `TokenizerManager` lives here too: it turns text into
#   token ids, checks each request (prompt length against the context window, ids against the vocabulary), and
#   keeps one queue per request in flight, so a bad request gets its 400 before it enters the pipeline at all.
# * The **scheduler** owns the engine and nothing else. Its loop drains whatever messages have arrived, runs one
#   `engine.step()`, and sends every request's new token ids on; it never waits for a client. With tensor
#   parallelism (chapter 09) there is one scheduler per rank. It builds its engine with `build_runtime`
#   (`minisgl_ref/runtime.py`), the very function behind `LLM(...)`, from the same settings objects that the
#   command-line flags are generated from: an HTTP request and an `LLM.generate` call run the same engine.
# * The **detokenizer** turns ids into text, one `IncrementalDetokenizer` (chapter 02) per request. Decoding is
#   cheap per token but not free, and here it costs the scheduler nothing.
#
# Why processes rather than threads? Python runs one thread of Python code at a time (the GIL): JSON parsing and
# text decoding in the scheduler's process would steal time from its loop at every step, and on a GPU every such
# millisecond is an idle device (chapter 06). The processes talk over **ZeroMQ** `PUSH`/`PULL` sockets on `ipc://`
# files in a private folder: messages arrive whole and in order, and a send never blocks the sender. Here are the
# addresses a server would use:

# %%
addrs = Addresses.fresh()
print(f"scheduler   listens on {addrs.scheduler}\ndetokenizer listens on {addrs.detokenizer}\n"
      f"API server  listens on {addrs.api}")

# %% [markdown]
# ## 2. Messages, and what they cost
#
# Each message is a small dataclass (`minisgl_ref/server/messages.py`). On the wire it becomes
# `msgpack([class name, [field values]])`: no field names (they would be repeated in every message), no pickle
# (unpickling executes whatever the sender wrote, which no process should accept from a socket), only plain
# ints, strings, lists and dicts. By the time a request leaves the API server it *is* plain data: token ids and
# sampling parameters.
#
# Outputs are **batched**: one `BatchTokenOut` per engine step carries one row per request that advanced, so a
# decode step of 64 requests costs one message, not 64.

# %%
req = messages.GenerateReqInput(rid="3f2a-0", input_ids=list(range(1000, 1032)),
                                sampling_params=SamplingParams(max_new_tokens=64, temperature=0.7).to_dict())
step = messages.BatchTokenOut(rids=[f"req-{i}" for i in range(64)], new_ids=[[1234]] * 64, finished=[False] * 64,
                              finish_reasons=[None] * 64, cached_tokens=[0] * 64, inits=[None] * 64)
for name, msg in (("GenerateReqInput (32 prompt ids)", req), ("BatchTokenOut (64 rows, 1 token each)", step)):
    packed = messages.encode(msg)
    as_json = json.dumps({"type": type(msg).__name__, **msg.__dict__}).encode()
    assert messages.decode(packed) == msg  # the round trip is exact
    print(f"{name:<40} msgpack {len(packed):>5} B   json {len(as_json):>5} B   pickle {len(pickle.dumps(msg)):>5} B")

# %% [markdown]
# A few kilobytes per step, whatever the batch holds: at hundreds of steps per second that is nothing next to
# the device's work. (SGLang pickles Python objects between its processes with ZeroMQ's `send_pyobj`;
# Mini-SGLang, like us, turns its message dataclasses into plain types first.)
#
# ## 3. The life of one request
#
# Here is a streaming chat request, end to end, with the function that handles each step and the message that
# carries it between processes:
#
# ```mermaid
# ---
# config:
#   sequence:
#     mirrorActors: false
# ---
# sequenceDiagram
#     participant C as client
#     participant H as HTTP handler<br/>(http_server.py)
#     participant T as TokenizerManager<br/>(API process)
#     participant S as scheduler<br/>process
#     C->>H: POST /v1/chat/completions<br/>{"messages": [...], "stream": true}
#     H->>H: validate JSON (pydantic)<br/>-> 400 on bad input
#     H->>T: chat_ids(messages): chat<br/>template + tokenize
#     T->>T: check_prompt: length vs context,<br/>ids vs vocab -> 400
#     H-->>C: 200, first SSE chunk<br/>{"delta": {"role": "assistant"}}
#     T->>S: GenerateReqInput(rid,<br/>input_ids, sampling_params)
#     S->>S: engine.add_request(Req)<br/>-> waiting queue
# ```
#
# ```mermaid
# ---
# config:
#   sequence:
#     mirrorActors: false
# ---
# sequenceDiagram
#     participant C as client
#     participant H as HTTP handler
#     participant T as Tokenizer<br/>Manager
#     participant D as detokenizer
#     participant S as scheduler
#     loop every engine.step()
#         S->>S: prefill or<br/>decode batch<br/>(ch. 03-06)
#         S->>D: BatchTokenOut(rids,<br/>new_ids, finished,<br/>finish_reasons,<br/>cached_tokens, inits)
#         D->>D: Incremental<br/>Detokenizer.step(ids)<br/>-> text delta
#         D->>T: BatchStrOut(rids,<br/>deltas, new_ids,<br/>finished, ...)
#         T->>T: _recv_loop: each<br/>row to its request's<br/>queue
#         T->>H: (index, Chunk)<br/>from generate()
#         H-->>C: data: {"choices":<br/>[{"delta": {"content":<br/>"..."}}]}
#     end
#     S->>S: request finished:<br/>free or cache its<br/>KV (chapter 04)
#     H-->>C: data: {"choices":<br/>[{"finish_reason":<br/>"stop"}]}
#     H-->>C: data: {"choices": [],<br/>"usage": {...}}<br/>(include_usage)
#     H-->>C: data: [DONE]
#     Note over C,S: a client that leaves early: T sends AbortReq(rid), S calls engine.abort(req), KV is freed
# ```
#
# Three details are worth a closer look:
#
# * **Where stop rules live.** The scheduler applies every stop rule, as offline (`Req.append_token`), so that it
#   stops spending compute at once; the detokenizer runs its own copy of the stop strings on the same ids, so the
#   two agree.
# * **The first row carries an `init`**: the request's stop strings, `skip_special_tokens` and the last prompt
#   ids (context for decoding the first output token). Later rows carry only new ids.
# * **Aborts** ride the same channel as requests. When the client closes the connection, Starlette cancels the
#   response and `TokenizerManager.generate`'s `finally` block sends `AbortReq(rid)`; the scheduler calls
#   `engine.abort`, which frees the request's KV (one step later under overlap scheduling, as for a finish).
#
# The detokenizer's part can be watched without a server: feed its worker one request's ids in three steps, as
# three `BatchTokenOut` messages would, and look at the text deltas it sends on.

# %%
args = ServerArgs()  # the embedded model, as `serve` uses by default
tokenizer = load_tokenizer(args)
ids = tokenizer.encode(" The capital of France is Paris. 🇫🇷")
detok = DetokenizerWorker(args, addrs, tokenizer)
pieces = [ids[:3], ids[3:8], ids[8:]]
for i, new_ids in enumerate(pieces):
    row = messages.BatchTokenOut(
        rids=["demo"], new_ids=[new_ids], finished=[i == len(pieces) - 1],
        finish_reasons=[{"type": "length", "matched": None}] if i == len(pieces) - 1 else [None],
        cached_tokens=[0], inits=[{"stop": [], "skip_special_tokens": True, "prompt_tail": []}] if i == 0 else [None])
    out = detok.process(row)
    print(f"step {i}: ids {new_ids} -> delta {out.deltas[0]!r}")
detok.close()
shutil.rmtree(addrs.folder)  # the socket folder of this demo

# %% [markdown]
# The flag emoji is two regional-indicator characters of four UTF-8 bytes each, spread over several byte-level
# tokens. Step 1 ends in the middle of the first one, so decoding its ids would end in a broken character; the
# incremental detokenizer (chapter 02) then sends nothing at all and waits, and step 2 carries the whole rest.
# A client never receives half a character, at the price of an occasional empty step.
#
# ### The scheduler's loop (task 10.2)
#
# The scheduler process is one loop around the engine, `SchedulerWorker.run`, and it is where continuous batching
# meets the outside world. Three rules make it work:
#
# * **Never wait while there is work.** If the engine has requests running, the loop takes whatever messages have
#   arrived (zero or more, without blocking) and steps at once. Only an idle engine sleeps on the socket, with a
#   timeout (`IDLE_POLL_MS`, 200 ms) so that it notices when its parent is gone.
# * **Take every waiting message before the step.** Ten requests that arrive together must enter the engine
#   together, so that one prefill step computes all ten.
# * **Send each token once.** After a step, each request that advanced gets one row with the ids it gained since
#   its last row (`self.sent[rid]`), all rows of the step in one `BatchTokenOut`; a request answered at the door
#   gets a single final row, and a step that raises ends in an abort of everything in flight, not a dead process.

# %%
show_code(scheduler_process, task="10.2")

# %% [markdown]
# `tests/test_server_scheduler.py` grades it in one process: a real `SchedulerWorker` on a tiny model, the test on
# the other ends of its sockets; what the rows add up to must be exactly the offline engine's tokens.
#
# ## 4. Start the real server
#
# `python -m minisgl_ref serve` takes SGLang's flag names (`--model-path`, default the embedded model, `--port`,
# `--max-total-tokens`, `--chunked-prefill-size`, `--tp-size`, `--enable-metrics` and the rest: `--help`).
#
# Start-up is ordered so that a client never talks to a half-loaded server: the launcher spawns the scheduler
# and the detokenizer, each reports on a pipe when its model and tokenizer are loaded (or why they failed), and
# only then does uvicorn open the port. Before that, a connection is *refused*, which every HTTP client
# understands. We start one with a small KV pool and count the refusals:

# %% tags=["hide-input"]
PORT = free_port()
URL = f"http://127.0.0.1:{PORT}"
server_log = tempfile.NamedTemporaryFile("w+", prefix="minisgl-ch10-", suffix=".log", delete=False)
t_start = time.perf_counter()
server = subprocess.Popen(
    [sys.executable, "-m", "minisgl_ref", "serve", "--port", str(PORT), "--max-total-tokens", "4096",
     "--enable-metrics", "--log-level", "warning"],
    stdout=server_log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
    env={**os.environ, "PYTHONUNBUFFERED": "1"},
)

refused = 0
while True:
    if server.poll() is not None:
        raise RuntimeError(f"the server exited with {server.returncode}:\n{Path(server_log.name).read_text()}")
    try:
        if httpx.get(URL + "/health", timeout=2).status_code == 200:
            break
    except httpx.TransportError:  # connection refused: the port is not open yet
        refused += 1
    if time.perf_counter() - t_start > 240:
        raise TimeoutError(Path(server_log.name).read_text())
    time.sleep(0.25)
startup_s = time.perf_counter() - t_start
print(f"ready after {startup_s:.1f} s ({refused} connection attempts refused while the model loaded)")
print("processes:", json.dumps(httpx.get(URL + "/get_server_info").json()["pids"]))

# %% [markdown]
# ## 5. Talk to it
#
# Any OpenAI client works: point its `base_url` at the server's `/v1`. The answer below is greedy
# (`temperature=0`), so it is the engine's deterministic best guess.

# %%
client = OpenAI(base_url=URL + "/v1", api_key="unused", max_retries=0)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
t0 = time.perf_counter()
resp = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=32, temperature=0)
chat_s = time.perf_counter() - t0
print(repr(resp.choices[0].message.content))
print(wrap(f"finish_reason={resp.choices[0].finish_reason}, usage={resp.usage.model_dump(exclude_none=True)}, "
           f"{chat_s:.2f} s"))
assert "Paris" in resp.choices[0].message.content

# %% [markdown]
# `finish_reason` says what really happened: `"stop"` when the model ended its turn (it sampled `<|im_end|>`, an
# EOS id) or hit a stop string, `"length"` when `max_tokens` ran out.
#
# **The oracle check.** The same greedy request through the whole server and through chapter 00's naive loop
# (no KV cache, no batching, no processes) must give the same token ids. The native `/generate` endpoint
# returns them:

# %%
oracle = LLM(device="cpu", engine="naive")
prompts = ["The capital of Germany is", "def fibonacci(n):"]
expected = oracle.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12), use_tqdm=False)
served = httpx.post(URL + "/generate", json={"text": prompts, "sampling_params": {"temperature": 0,
                                                                                   "max_new_tokens": 12}},
                    timeout=120).json()
for e, s in zip(expected, served):
    print(f"{s['text']!r:<50} oracle ids == served ids: {e.output_ids == s['output_ids']}")
    assert e.output_ids == s["output_ids"]
print(wrap(f"meta_info: {served[0]['meta_info']}"))

# %% [markdown]
# ### Streaming: server-sent events
#
# With `"stream": true` the response is `text/event-stream`: one `data: {json}` line per chunk, a blank line
# after each, and `data: [DONE]` at the end. Here is a raw stream as the bytes arrive, with each event's arrival
# time. The same prompt was just answered, so the radix cache (chapter 04) already holds it: look at
# `cached_tokens` in the usage chunk.

# %%
body = {"model": "SmolLM2-135M-Instruct", "messages": CHAT, "max_tokens": 8, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}}
t0 = time.perf_counter()
with httpx.stream("POST", URL + "/v1/chat/completions", json=body, timeout=120) as r:
    print(r.status_code, r.headers["content-type"])
    for line in r.iter_lines():
        if not line:
            continue
        shown = line  # the id, object, created and model fields repeat in every chunk: show what changes
        if line != "data: [DONE]":
            event = json.loads(line[len("data: "):])
            event["choices"] = [{k: v for k, v in c.items() if v is not None and k != "index"}
                                for c in event["choices"]]  # and leave out the fields that are null
            shown = "data: {..., " + json.dumps({k: event[k] for k in ("choices", "usage") if k in event}) + "}"
        print(wrap(f"{(time.perf_counter() - t0) * 1000:7.0f} ms  {shown}", indent=" " * 20))

# %% [markdown]
# The first chunk (the assistant's role) goes out as soon as the request is accepted; the first *token* follows
# after the prefill. Usage comes once at the end with `stream_options.include_usage` (or in every chunk with
# `continuous_usage_stats`). SGLang's native `/generate` stream differs in one way: each event carries the
# *cumulative* text and ids so far, not a delta.
#
# ### Log probabilities
#
# How likely was each token? OpenAI's chat API answers with `logprobs: true` (and `top_logprobs: k` for the k
# likeliest alternatives), its completions API with `logprobs: k` (and `echo: true` to score the prompt too), and
# SGLang's `/generate` with `return_logprob`, `top_logprobs_num` and `logprob_start_len`, the first prompt position
# to score. The probabilities are those of the distribution the token was drawn from (after `logit_bias`, the
# penalties and the temperature, before top-k/top-p cut it down); for a greedy request that is plain
# `log_softmax` of the model's logits, which `tests/test_logprobs.py` checks against HF transformers. Only steps in
# which some request asked pay for them. The [server reference](../server-reference.md#log-probabilities) has the
# details: SGLang's default start position, how the engine carries the question, and the radix cache's part.

# %%
resp = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=6, temperature=0,
                                      logprobs=True, top_logprobs=3)
for item in resp.choices[0].logprobs.content:
    alternatives = ", ".join(f"{t.token!r} {t.logprob:.2f}" for t in item.top_logprobs)
    print(shorten(f"{item.token!r:>12} {item.logprob:6.2f}   top 3: {alternatives}"))
scored = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=2,
                                   temperature=0, logprobs=1, echo=True).choices[0].logprobs
print(wrap("echo, prompt and answer: " + str([(t, None if lp is None else round(lp, 2))
                                              for t, lp in zip(scored.tokens, scored.token_logprobs)])))

# %% [markdown]
# A greedy answer's tokens are always the top alternative. The first prompt token has no score (nothing came
# before it to predict it), which OpenAI's API writes as `null`.
#
# **Scoring without generating.** Likelihood-based evaluation, and the `select` of SGLang's frontend language, ask
# how likely a *given* text is and want nothing generated: `max_new_tokens: 0` with `return_logprob`. Such a
# request (`Req.prefill_only`) is scheduled like any other; its prefill computes the prompt's log probabilities,
# and the engine then ends it, by `length`, without appending the token that step sampled. Here three
# continuations are scored in one batch, as `select` does (`tests/test_sglang_frontend.py` runs SGLang's own
# frontend programs against this server):

# %%
choices = [" Paris", " London", " a city"]
outs = httpx.post(URL + "/generate", timeout=60, json={
    "text": ["The capital of France is" + c for c in choices], "return_logprob": True, "logprob_start_len": 5,
    "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 0}}).json()
for c, out in zip(choices, outs):
    meta = out["meta_info"]
    entries = meta["input_token_logprobs"]
    print(f"{c!r:>10}: mean {sum(e[0] for e in entries) / len(entries):6.2f} over {[e[2] for e in entries]}, "
          f"completion_tokens={meta['completion_tokens']}, finish={meta['finish_reason']['type']}")
# Without logprob_start_len: each prompt's last token only (one entry each, though the prompts differ in length).
last = httpx.post(URL + "/generate", timeout=60, json={
    "text": ["The capital of France is" + c for c in choices], "return_logprob": True,
    "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 0}}).json()
print(wrap("default start: " + str([[(e[2], round(e[0], 2)) for e in o["meta_info"]["input_token_logprobs"]]
                                   for o in last])))

# %% [markdown]
# ### More of what a request can ask
#
# A request can also bias chosen tokens (`logit_bias`), stop on a regular expression (`stop_regex`), keep its
# cached prefixes to itself (`cache_salt`), continue the last assistant message (`continue_final_message`), and ask
# for an answer that follows a grammar: `response_format` with a JSON schema, SGLang's `json_schema`, `regex` or
# `ebnf`, or OpenAI's function calling (`tools`, `tool_choice`), which the server turns into a grammar too
# (chapter 12 shows how). A field that would change the answer but is not implemented is refused with a 400 that
# names it: an answer that silently ignored it would look right and be wrong. The
# [server reference](../server-reference.md#request-fields) lists every field and how tool calls are prompted,
# parsed and streamed.

# %%
opened = CHAT + [{"role": "assistant", "content": "Sure! The capital of France is"}]
cont = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=opened, max_tokens=8,
                                      temperature=0, extra_body={"continue_final_message": True})
print(wrap("continued: " + repr(opened[-1]["content"] + cont.choices[0].message.content)))
schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}}, "required": ["capital"]}
shaped = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=24, temperature=0,
                                        response_format={"type": "json_schema",
                                                         "json_schema": {"name": "answer", "schema": schema}})
print(wrap("json_schema: " + shaped.choices[0].message.content))
weather = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}
forced = client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=32,
                                        messages=[{"role": "user", "content": "Is it raining in Paris?"}],
                                        tools=[weather], tool_choice="required", parallel_tool_calls=False)
call = forced.choices[0].message.tool_calls[0]
print(wrap(f"tool call: {forced.choices[0].finish_reason} {call.function.name} {call.function.arguments}"))
refused = httpx.post(URL + "/v1/chat/completions", json={"messages": CHAT, "structural_tag": "{}"}, timeout=30)
print(wrap(f"{refused.status_code} {refused.json()['error']['message']}"))

# %% [markdown]
# ### The Responses API
#
# OpenAI's newer API, `POST /v1/responses` (the SDK's `client.responses.create`), asks for what a chat request
# asks, under other names: the conversation is `input`, the system prompt `instructions`, the limit
# `max_output_tokens`. `minisgl_ref/server/responses.py` translates such a request into a chat request and runs the
# chat route's own code on it, so the two routes give the same greedy answer to the same conversation. What
# changes is the answer's shape (a list of output items; a stream of named events from `response.created` to
# `response.completed`) and that a response is kept, so `previous_response_id` continues a conversation without
# sending it again. The [server reference](../server-reference.md#the-responses-api) has the rest.

# %%
first = client.responses.create(model="SmolLM2-135M-Instruct", input=CHAT[0]["content"], max_output_tokens=32,
                                temperature=0)
as_chat = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=32, temperature=0)
print(wrap(f"{first.status} {first.output_text!r} same as chat: "
           f"{first.output_text == as_chat.choices[0].message.content}"))
assert first.output_text == as_chat.choices[0].message.content
follow_up = client.responses.create(model="SmolLM2-135M-Instruct", previous_response_id=first.id,
                                    input="And the capital of Italy?", max_output_tokens=24, temperature=0)
print(wrap(f"{follow_up.output_text!r} {follow_up.usage.input_tokens} input tokens, "
           f"{follow_up.usage.input_tokens_details.cached_tokens} of them cached"))
print(wrap(str([e.type for e in client.responses.create(model="SmolLM2-135M-Instruct", input="Say hello.",
                                                        max_output_tokens=4, temperature=0, stream=True)])))

# %% [markdown]
# ## 6. Bad requests, walking away, metrics
#
# Every bad request gets a 4xx with an OpenAI-style error body naming the problem and the parameter, and is
# refused before it reaches the scheduler, so it cannot disturb the requests that are running:

# %%
bad = [
    ("temperature out of range", "/v1/chat/completions", {"messages": CHAT, "temperature": 3.5}),
    ("absurd max_tokens", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 10**9}),
    ("unknown model", "/v1/completions", {"model": "gpt-4o", "prompt": "hi"}),
    ("token id outside the vocabulary", "/generate", {"input_ids": [1, 2, 10**6]}),
]
answers = []
for name, path, payload in bad:
    r = httpx.post(URL + path, json=payload, timeout=30)
    err = r.json()["error"]
    answers.append((name, r.status_code, err["param"], err["message"]))
r = httpx.post(URL + "/v1/completions", content=b'{"prompt": "hi", ', timeout=30,
               headers={"Content-Type": "application/json"})
answers.append(("malformed JSON", r.status_code, r.json()["error"]["param"], r.json()["error"]["message"]))
assert all(400 <= status < 500 for _, status, _, _ in answers)
show_table(answers, headers=["request", "status", "param", "message"])

# %% [markdown]
# **One request's failure is that request's alone.** Every token id a request carries (its prompt,
# `stop_token_ids`, the keys of `logit_bias`) ends up as an index into some `[vocab]`-sized row, and one id outside
# the vocabulary there would fail the whole batch's step, with every request in it. So ids are checked at the door
# (and again when the engine adds a request), and if a step fails anyway the engine rolls it back and aborts only
# the requests that fail the check again; the others are prefilled again from the cache. The
# [server reference](../server-reference.md#failure-isolation) tells how each kind of failure stays with its
# request; `tests/test_request_isolation.py` checks that the others produce exactly the oracle's tokens.

# %%
r = httpx.post(URL + "/v1/chat/completions", timeout=30, json={
    "messages": CHAT, "max_tokens": 4, "min_tokens": 1, "stop_token_ids": [10**6]})
print(wrap(f"{r.status_code} {r.json()['error']}"))
assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"

# %% [markdown]
# **Valid numbers can be traps too.** In float32, a repetition penalty of `5e-324` is 0 and a temperature of
# `1e300` is infinite; with a grammar's `-inf` logits that made a NaN row, and the draw could pick a token the
# grammar forbids. A property-based fuzzer (`tests/test_server_fuzz.py`) found it; the sampler now keeps both
# numbers inside float32's range (chapter 02), and the request is served:

# %%
r = httpx.post(URL + "/generate", timeout=60, json={
    "text": "The capital of France is", "return_logprob": True,
    "sampling_params": {"max_new_tokens": 6, "temperature": 1e300, "repetition_penalty": 5e-324,
                        "json_schema": json.dumps({"type": "object"})}})
print(wrap(f"{r.status_code} {r.json()['text']!r} "
           f"{[round(e[0], 2) for e in r.json()['meta_info']['output_token_logprobs']]}"))
assert r.status_code == 200

# %% [markdown]
# **A client that leaves.** Here a client asks for 2,000 tokens, reads three events and closes the connection.
# The server notices (the response task is cancelled), sends `AbortReq`, and the scheduler frees the KV. We
# watch the pool through `/get_server_info` (`available_kv_tokens` counts free slots plus cached ones that
# eviction could free):

# %% tags=["hide-input"]
def kv() -> dict:
    return httpx.get(URL + "/get_server_info", timeout=30).json()


def show(info: dict) -> str:
    return (f"running={info['num_running_reqs']} available_kv={info['available_kv_tokens']}"
            f"/{info['max_total_num_tokens']}")


before = kv()
print("before :", show(before))
body = {"text": "Tell me a very long story.", "stream": True,
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0.8}}
with httpx.stream("POST", URL + "/generate", json=body, timeout=120) as r:
    events = 0
    for line in r.iter_lines():
        events += line.startswith("data:")
        if events == 3:
            print("during :", show(kv()))
            break  # leaving the `with` block closes the connection
t0 = time.perf_counter()
while True:
    state = kv()
    if state["num_running_reqs"] == 0 and state["available_kv_tokens"] == before["available_kv_tokens"]:
        break
    assert time.perf_counter() - t0 < 60, f"the KV was not given back: {show(state)}"
    time.sleep(0.05)
print(f"after  : {show(state)}  (all of it back {(time.perf_counter() - t0) * 1000:.0f} ms after the client left)")

# %% [markdown]
# **A long prompt while others stream.** Prefill has priority (chapter 05): a prompt that arrives is computed
# before the running requests take their next step. On a GPU that step takes tens of milliseconds; on one CPU core
# a 3,000-token prompt in one step takes about 37 s, and every running stream would freeze for as long. So `serve`
# on a CPU cuts prompts into chunks of 32 tokens (`--chunked-prefill-size 32`) and lets each chunk share its step
# with the running requests' decode rows (`--enable-mixed-chunk`): the running stream then pauses for about five
# decode steps at most, and the long prompt itself takes about a quarter longer. (The
# [server reference](../server-reference.md#long-prompts-on-a-cpu) has the measurements for other chunk sizes.)
# We can watch it: one stream runs while a 600-token prompt arrives; we record the gaps between the stream's
# events.

# %% tags=["hide-input"]
def pause_while_a_long_prompt_arrives() -> tuple[float, float]:
    """Stream in a thread; after a second, send the long prompt from here. Returns (longest gap, prefill time)."""
    import threading

    arrivals: list[float] = []

    def stream() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 80, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", URL + "/v1/completions", json=body, timeout=300) as resp:
            arrivals.extend(time.perf_counter() for line in resp.iter_lines() if line.startswith("data:"))

    reader = threading.Thread(target=stream)
    reader.start()
    time.sleep(1.0)  # let the stream get going
    t = time.perf_counter()
    httpx.post(URL + "/v1/completions", json={"prompt": "word " * 600, "max_tokens": 1}, timeout=300)
    prefill = time.perf_counter() - t
    reader.join()
    return max(b - a for a, b in zip(arrivals, arrivals[1:])), prefill


worst_gap, long_prefill = pause_while_a_long_prompt_arrives()
print(f"longest pause of the running stream: {worst_gap:.2f} s; the 600-token prompt took {long_prefill:.1f} s")

# %% [markdown]
# ### Metrics
#
# With `--enable-metrics`, `/metrics` serves Prometheus text under SGLang's names (`sglang:` prefix, one label
# `model_name`), so a Grafana dashboard built for SGLang reads it unchanged: gauges for the running and queued
# requests, KV use and cache hit rate, rates of prefilled and decoded tokens between two scrapes, counters of
# requests and tokens, and histograms of time to first token, inter-token latency, time per output token and
# end-to-end latency. What a client experiences is measured in the API process as outputs stream past; what only
# the scheduler knows is fetched from it each time `/metrics` is scraped. Every request the scheduler received is
# counted exactly once when it ends, aborted ones included, so `e2e_request_latency_seconds_count` always equals
# `num_requests_total`. The [server reference](../server-reference.md#metrics) lists every metric and what
# counts where.
#
# The client that walked away above is counted: it is the one aborted request so far. We scrape twice around a
# request, so that the throughputs cover an interval in which the server worked:

# %% tags=["hide-input"]
def scrape_metrics() -> tuple[dict[str, float], str]:
    text = httpx.get(URL + "/metrics", timeout=30).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if not s.name.endswith("_bucket")}, text


scrape_metrics()
client.completions.create(model="SmolLM2-135M-Instruct", prompt="Once upon a time", max_tokens=16, temperature=0)
values, scrape = scrape_metrics()
shown = [f"{name:<28} {values['sglang:' + name]:>9.4g}" for name in (
    "num_requests_total", "num_aborted_requests_total", "prompt_tokens_total", "generation_tokens_total",
    "cached_tokens_total", "num_running_reqs", "num_queue_reqs", "num_used_tokens", "max_total_num_tokens",
    "token_usage", "cache_hit_rate", "prefill_throughput", "gen_throughput")]
for h in ("time_to_first_token_seconds", "inter_token_latency_seconds", "time_per_output_token_seconds",
          "e2e_request_latency_seconds"):
    n, total = values[f"sglang:{h}_count"], values[f"sglang:{h}_sum"]
    shown.append(f"{h.removesuffix('_seconds'):<22} {n:>3g} x, mean {total / n * 1000:>5.0f} ms")
for left, right in zip(shown[::2], shown[1::2] + [""]):  # two columns, names without the sglang: prefix
    print(f"{left:<46}{right}")
assert values["sglang:num_aborted_requests_total"] >= 1
assert values["sglang:e2e_request_latency_seconds_count"] == values["sglang:num_requests_total"]
buckets = [(s.labels["le"], s.value) for fam in text_string_to_metric_families(scrape) for s in fam.samples
           if s.name == "sglang:time_to_first_token_seconds_bucket"]
print(wrap("TTFT histogram (cumulative counts, le = upper bound in s): "
           + ", ".join(f"{le}: {v:g}" for le, v in buckets[:9])))

# %% [markdown]
# ## 7. Measure it: `bench serving` (task 10.1)
#
# One request at a time tells us little about a server. `python -m minisgl_ref bench serving` sends a seeded
# workload at a chosen **request rate** (Poisson arrivals: exponential gaps with mean `1 / rate`, the traffic
# of many independent users; `inf` sends everything at once) and optionally a **concurrency cap**, streams every
# answer, timestamps each chunk, and reduces the timestamps to `sglang.bench_serving`'s metrics:
#
# | metric | definition | what moves it |
# | --- | --- | --- |
# | TTFT | request sent -> first token | queueing + prefill (prompt length, load) |
# | ITL | gap between consecutive chunks, pooled | decode step time; stalls when prefills cut in |
# | TPOT | `(e2e - ttft) / (output_tokens - 1)`, per request | the average decode pace |
# | E2E latency | request sent -> last byte | all of the above |
# | throughputs | completed requests, input and output tokens per second of the run | how busy the engine is kept |
# | concurrency | sum of E2E latencies / duration | requests in flight on average (Little's law) |
#
# Task 10.1 is the client's arithmetic: each stream's arrival times turned into a TTFT and a list of gaps
# (`_StreamReader.event`; a chunk without a token, such as the first chunk of a chat stream that only names the
# assistant's role, moves no clock), percentiles as NumPy computes them, and `compute_metrics`, the reduction:

# %%
show_code(serving, task="10.1")

# %% [markdown]
# On synthetic timings whose answers we know:

# %%
synthetic = [RequestOutput(True, 100, 5, ttft=0.2, itl=[0.1] * 4, latency=0.6),
             RequestOutput(True, 50, 3, ttft=0.4, itl=[0.3, 0.5], latency=1.2)]
m = compute_metrics(synthetic, duration=2.0)
print(wrap(str({k: round(m[k], 1) for k in ("request_throughput", "output_throughput", "mean_ttft_ms",
                                              "mean_tpot_ms", "mean_itl_ms", "max_itl_ms", "mean_e2e_latency_ms",
                                              "concurrency")})))
assert abs(m["mean_tpot_ms"] - 250.0) < 1e-9 and abs(m["output_throughput"] - 4.0) < 1e-9

# %% [markdown]
# Now against the live server: 8 requests of 32 random prompt tokens and 8 output tokens each, at 4 requests
# per second, through the native API (`--backend openai` or `openai-chat` would use the OpenAI routes, and
# `--base-url` points it at any server, an SGLang one included). The same run from a shell is
# `python -m minisgl_ref bench serving --port PORT --num-prompts 8 --random-input-len 32 --random-output-len 8
# --random-range-ratio 1 --request-rate 4`.

# %%
cfg = ServingBenchConfig(backend="minisgl", base_url=URL, num_prompts=8, random_input_len=32,
                         random_output_len=8, random_range_ratio=1.0, request_rate=4.0, seed=1)
live = run_benchmark(cfg)
assert live["completed"] == 8 and live["total_output_tokens"] == 64
summary = [("completed", f"{live['completed']} requests in {live['duration']:.1f} s"),
           ("throughput", f"{live['request_throughput']:.2f} req/s, {live['output_throughput']:.1f} output tok/s")]
summary += [(name, " / ".join(f"{live[f'{stat}_{key}_ms']:.0f}" for stat in ("mean", "median", "p99")) + " ms")
            for name, key in (("TTFT", "ttft"), ("ITL", "itl"), ("TPOT", "tpot"), ("E2E", "e2e_latency"))]
show_table(summary + [("concurrency", f"{live['concurrency']:.2f}")], headers=["", "mean / median / p99"])

# %% [markdown]
# On a CPU the engine's steps are slow, so every number here is dominated by model time: TTFT is a prefill of
# the requests that arrived together, ITL is one decode step of the whole running batch. Read the *shapes*:
# TTFT grows with the queue, ITL with the batch. (A longer CPU run, 16 requests at 1 request/s, is tabled in the
# [server reference](../server-reference.md#measured-on-a-cpu).)

# %% [markdown]
# ### On a GPU
#
# The same load generator against the same server on one H100, serving Qwen3-0.6B (random weights, bf16, every
# engine feature on: radix cache, chunked prefill, overlap scheduling, CUDA graphs, the default attention
# backends). 200 requests of 512-1024 prompt tokens and 128-256 output tokens, Poisson arrivals at 4 and 16
# requests per second, then all 200 at once. Measured once and committed (`docs/data/bench_serving_h100.json`,
# with its provenance); read back here:

# %% tags=["hide-input"]
gpu = json.loads((ROOT / "docs" / "data" / "bench_serving_h100.json").read_text())
hw = gpu["runs"][0]["provenance"]["hardware"]
print(wrap(f"server: {gpu['server_command']}\nGPU: {hw['gpu']} (driver {hw['nvidia_driver']}), "
           f"{hw['cpu_count']} CPU cores", indent=" " * 8))
show_table([(r["request_rate"], f"{r['request_throughput']:.1f}", f"{r['output_throughput']:,.0f}",
             f"{r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f}", f"{r['median_tpot_ms']:.1f}",
             f"{r['median_itl_ms']:.2f} / {r['p99_itl_ms']:.0f}", f"{r['median_e2e_latency_ms']:.0f}",
             f"{r['concurrency']:.1f}") for r in gpu["runs"]],
           headers=["rate", "req/s", "out tok/s", "TTFT p50 / p99 ms", "TPOT p50 ms", "ITL p50 / p99 ms",
                    "E2E p50 ms", "in flight"])

# %% [markdown]
# At 4 and 16 requests/s the server keeps up (2 and ~19 requests in flight): the first token comes in 25-42 ms and
# TPOT grows with the decode batch, from ~2.7 to ~5 ms. With all 200 at once, prefilling 152k prompt tokens takes
# about half a second, which is everybody's TTFT, and then all 200 decode together at ~14 ms per token. The median
# ITL of 0.05 ms there is not a fast step: a stream's chunks reach the client in bursts, and the gaps inside a burst
# are nearly zero (exercise 6; chapter 11 finds where the bursts come from). TPOT, from each request's first and
# last token, is the honest pace. Latency stays flat while the server keeps up, and TTFT grows first when it no
# longer does.

# %% [markdown]
# ## 8. Stop it
#
# `Ctrl-C` or `SIGTERM`: uvicorn stops accepting connections and gives open streams a few seconds, then the
# launcher sends `SIGTERM` to every child, waits for each, kills any that linger, removes the socket folder, and
# exits with status 0. If a child dies instead, the launcher notices within 200 ms, aborts every request in
# flight, answers 503 for a short grace period, and exits with status 1, so that a supervisor restarts it
# (`tests/test_server.py::test_dead_scheduler_fails_fast`).
#
# A scheduler can also be alive and stuck (a kernel that never returns, a collective waiting for a rank that
# hangs). It writes the moment its loop last came round into shared memory, and past `--watchdog-timeout` seconds
# (60 by default) `/health` answers 503 saying for how long, while a thread logs where the scheduler is stuck
# (`minisgl_ref/server/watchdog.py`; the [server reference](../server-reference.md#a-stuck-scheduler) has the
# details).

# %%
kids = children(server.pid)
server.send_signal(signal.SIGTERM)
code = server.wait(60)
time.sleep(0.2)
still_alive = [p for p in kids if alive(p)]
print(f"exit status {code}; {len(kids)} children, still alive: {still_alive}")
assert code == 0 and not still_alive
os.unlink(server_log.name)

# %% [markdown]
# ## 9. The shell
#
# `python -m minisgl_ref serve --shell` starts the same processes but, instead of opening a port, chats in the
# terminal through the same `TokenizerManager`. Each turn resends the whole conversation, so from the second turn
# on the radix cache holds everything but the newest message, and the shell prints the cached count after each
# answer (a transcript is in the [server reference](../server-reference.md#the-shell)).
#
# ## 10. Data parallelism with SGLang's router
#
# One server is one engine: one copy of the weights, one KV pool, one radix cache. When the requests outgrow what
# one engine can do, the simplest way to serve more is to run more copies and spread the requests over them:
# **data parallelism**. The copies share nothing, so which copy gets a request matters. Round-robin ignores what
# requests contain, and a long system prompt cached by copy A does nothing for a request that lands on copy B.
# SGLang's router (the `sglang-router` package) has a `cache_aware` policy: it keeps, for each worker, a rough radix
# tree of the request texts it sent there, sends a request to the worker that already saw a long enough part of its
# beginning, and otherwise to the least loaded one. `serve --dp-size N` (`minisgl_ref/server/data_parallel.py`)
# starts N ordinary servers on free loopback ports, waits until they answer `/health`, and starts the router in
# front of them; if any of them dies, the launcher stops the rest and exits with status 1.
#
# ```bash
# pip install 'minisgl_ref[router]'    # sglang-router: a binary wheel (manylinux x86_64 and aarch64)
# ./minisgl serve --dp-size 2          # two workers on free local ports, the router on 127.0.0.1:30000
# ```
#
# These are the command lines the launcher runs for two workers (the ports are the OS's choice each time) and
# for the router; nothing is started here:

# %%
from minisgl_ref.server.data_parallel import router_command, worker_command

dp_args = ServerArgs(dp_size=2, model=ModelArgs(device="cpu"))
dp_urls = [f"http://127.0.0.1:{port}" for port in (41001, 41002)]
first, second = (worker_command(dp_args, int(url.rsplit(":", 1)[1])) for url in dp_urls)
assert [a for a in first if a != "41001"] == [a for a in second if a != "41002"]  # only the port differs
print(wrap("python " + " ".join(first[1:]), indent=" " * 8))
print("python ... the same, with --port 41002")
print(wrap("python " + " ".join(router_command(dp_args, dp_urls, metrics_port=41003)[1:]), indent=" " * 8))

# %% [markdown]
# What it buys: with two workers and six chat requests that share a ~410-token system prompt, `cache_aware` sent
# all six to one worker, which computed 474 prompt tokens in all (the first request's 426, then about 10 per
# request); behind `--policy round_robin` each worker computed the shared prompt once, 887 tokens together
# (`tests/test_data_parallel.py` checks the `cache_aware` half). On a CPU that is a demonstration, not a speed-up:
# both workers share the same cores. On two H200s (`docs/data/parallel_serving_h200.json`; Qwen3-0.6B config, bf16,
# dummy weights, 1,024 requests sent at once), one server completed 71 requests/s and `--dp-size 2` 212, 2.98
# times as many, with the median time to first token falling from 4.7 s to 1.0 s. The
# [server reference](../server-reference.md#data-parallelism) explains why more than twice, and what happens when a
# worker dies.

# %% [markdown]
# ## Summary
#
# * **Processes with one job each.** The API server (uvicorn and the `TokenizerManager`) parses, checks and
#   streams; the scheduler owns the engine, built by the same `build_runtime` as `LLM`; the detokenizer turns ids
#   into text. They pass small msgpack messages over ZeroMQ, one `BatchTokenOut` per engine step.
# * **The scheduler's loop** (task 10.2). Never wait while there is work, take every waiting message before a
#   step, send each token once.
# * **The APIs.** OpenAI's chat, completions and responses routes and SGLang's `/generate`, with streaming, log
#   probabilities, prefill-only scoring, aborts when a client leaves, Prometheus metrics, a watchdog for a stuck
#   scheduler, and a port that opens only once the model is loaded.
# * **The oracle.** A greedy request over HTTP returns exactly the token ids of chapter 00's loop.
# * **Measured with `bench serving`** (task 10.1: TTFT, ITL, TPOT, E2E). On one H100 with Qwen3-0.6B, at 4
#   requests/s the first token comes in about 25 ms and then one every ~2.7 ms; at 16 requests/s TPOT is about 5
#   ms; with all 200 requests at once the server writes about 10k output tokens/s.
# * **Data parallelism.** `--dp-size 2` behind SGLang's cache-aware router keeps requests with a shared prefix on
#   one worker (474 prompt tokens computed against 887 with round-robin on the CPU); on two H200s it completed
#   2.98 times as many requests per second as one server.
# * **Next.** Chapter 11 measures the whole engine against its physical floor, and the CPU cost of each streamed
#   token.

# %% [markdown]
# ## Exercises
#
# 1. **Task 10.1.** Write the three `TASK 10.1` regions of `minisgl_ref/bench/serving.py` (the stream reader's
#    timestamps, `percentile` and `compute_metrics`) and grade them with
#    `python -m minisgl_ref.course grade --task 10.1`. Why is TPOT left undefined for a request with
#    one output token, and why is ITL pooled over requests while TPOT is averaged per request? Find a workload in
#    which mean ITL and mean TPOT differ by a factor of two.
# 2. **Task 10.2.** Write the three `TASK 10.2` regions of `minisgl_ref/server/scheduler_process.py` (`run`,
#    `_drain_messages`, `_rows_for`) and grade them with `python -m minisgl_ref.course grade --task 10.2`: the
#    checks run a real `SchedulerWorker` on a tiny model in the test's process, play the API server and the
#    detokenizer on its sockets, and compare what arrives with the offline engine's tokens. Then measure what
#    blocking costs: make the loop wait on its socket for up to 5 ms before every step, and time a 64-token
#    stream on the embedded model. Where does the time go, and how would the answer change on a GPU whose decode
#    step takes 3 ms?
# 3. **Load curve.** Run `bench serving` against a server at request rates 0.5, 1, 2 and 4 (keep
#    `--num-prompts` small on a CPU). Plot median TTFT and output throughput against the rate. Where does the
#    server saturate, and what happens to TTFT beyond that point? Compare `--max-concurrency 2` at rate `inf`.
# 4. **Abort under overlap.** `SchedulerWorker._abort` calls `engine.abort`, which holds back the aborted
#    request's release while a step is in flight (`InflightFrees.later`). Explain, with chapter 06's timeline,
#    which step could still write the aborted request's KV slots, and what another request that received those
#    slots would see if they were given back at once.
# 5. **Another metric.** Add a Prometheus counter for requests that finished on a stop string
#    (`finish_reason.type == "stop"` with a string `matched`) and check that it moves in `test_metrics_move`.
# 6. **Bursts.** In the GPU table, the median ITL at rate `inf` is 0.05 ms. Find where the chunks of one stream
#    bunch up: add timestamps to `BatchStrOut` (when the scheduler sent the row, when the detokenizer forwarded
#    it) and compare them with the client's arrival times in `bench serving`. SGLang's `--stream-interval`
#    sends a stream's chunks every N tokens instead of every token: what would it do to these numbers? (Chapter 11,
#    section 10, measures what one streamed token costs the API server and the client.)
# 7. **Routing policies.** Start two servers and the router by hand (`python -m sglang_router.launch_router
#    --worker-urls URL1 URL2 --policy round_robin`, then `--policy cache_aware`) and send three groups of requests,
#    each sharing its own long system prompt. Compare the workers' `prefill_tokens` and `cache_hit_rate` in
#    `/get_server_info`. At what imbalance does `cache_aware` give up on the hits to even out the load
#    (`--balance-abs-threshold`, `--balance-rel-threshold`)?
#
# ## Reproduce
#
# ```bash
# python chapters/10_server.py                          # this chapter, end to end (starts and stops a server)
# ./minisgl serve                                       # the server on the embedded model, port 30000
# curl -s http://127.0.0.1:30000/v1/chat/completions -H 'Content-Type: application/json' \
#   -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0}'
# python -m minisgl_ref bench serving --num-prompts 16 --random-input-len 128 --random-output-len 32 \
#   --random-range-ratio 0.5 --request-rate 1 --output-file docs/data/bench_serving_cpu.json
# python -m minisgl_ref.course grade --chapter 10      # tasks 10.1 and 10.2, well under a minute
# python -m pytest tests/test_server.py tests/test_server_hardening.py tests/test_bench_serving.py  # 3-8 minutes
# python -m pytest tests/test_server_fuzz.py tests/test_server_soak.py   # fuzz and soak: about 5 minutes
# python -m pytest tests/test_logprobs.py tests/test_request_isolation.py   # logprobs oracle, failure isolation
#
# # data parallelism: two workers behind SGLang's router (pip install 'minisgl_ref[router]' first)
# ./minisgl serve --dp-size 2 --device cpu
# python -m pytest tests/test_data_parallel.py           # about 1 minute on 2 busy cores
# python -m pytest tests/test_server_watchdog.py        # the stuck-step watchdog, about 30 s
# NCCL_NVLS_ENABLE=0 bash scripts/gpu/chapter.sh 10 dp   # two GPUs: parallel_serving.py --phases dp
#
# # the GPU numbers: a server on one H100, then one bench per rate (4, 16, inf), as `bash scripts/gpu/chapter.sh 10
# # serving` runs them (and `features`: the per-request features on a GPU)
# python -m minisgl_ref serve --model-path qwen3-0.6b --load-format dummy --dtype bfloat16 &
# python -m minisgl_ref bench serving --num-prompts 200 --random-input-len 1024 --random-output-len 256 \
#   --random-range-ratio 0.5 --request-rate 16
# ```
#
# The committed CPU numbers above come from the third command, against the second, on the machine named in the
# JSON file. What each step of this chapter takes on a 2-core CPU (server start 29-68 s, a greedy chat answer
# 1.6-2.7 s, the whole chapter 87-119 s on a loaded machine) is tabled in the
# [server reference](../server-reference.md#measured-on-a-cpu); the last cell prints this run's numbers.
#
# Expected on one H100 80GB HBM3 (`docs/data/bench_serving_h100.json`; Qwen3-0.6B config, bf16, dummy weights;
# 200 requests of 512-1024 prompt and 128-256 output tokens):
#
# | request rate | output tok/s | TTFT median | ITL median / p99 | TPOT median |
# | --- | --- | --- | --- | --- |
# | 4 req/s | 814 | 25 ms | 2.4 / 13.4 ms | 2.7 ms |
# | 16 req/s | 3,078 | 42 ms | 3.9 / 37.8 ms | 5.2 ms |
# | all at once | 10,200 | 568 ms | 0.05 / 113 ms | 14.0 ms |

# %%
print(wrap(f"this run: server ready in {startup_s:.0f} s; greedy chat answer in {chat_s:.2f} s; bench serving "
           f"(8 x 32 -> 8 tokens at 4 req/s): median TTFT {live['median_ttft_ms']:.0f} ms, median ITL "
           f"{live['median_itl_ms']:.0f} ms, output {live['output_throughput']:.1f} tok/s; chapter ran in "
           f"{time.perf_counter() - CHAPTER_START:.0f} s"))
