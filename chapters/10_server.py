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
# `minisgl_ref/bench/serving.py`.

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
from pathlib import Path

import httpx
import torch
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from minisgl_ref import LLM, SamplingParams
from minisgl_ref.bench.serving import (
    RequestOutput,
    ServingBenchConfig,
    compute_metrics,
    format_report,
    run_benchmark,
)
from minisgl_ref.bench import serving
from minisgl_ref.course import task_source
from minisgl_ref.server import messages, scheduler_process
from minisgl_ref.core.config import ModelArgs
from minisgl_ref.server.args import Addresses, ServerArgs
from minisgl_ref.server.detokenizer_process import DetokenizerWorker, load_tokenizer

CHAPTER_START = time.perf_counter()

# One torch thread in this notebook's process, as in the other chapters: the server we start below runs its own
# engine in its own process, and the two should not fight over a small machine's cores.
torch.set_num_threads(int(os.environ.get("MINISGL_THREADS", "1")))

ROOT = Path.cwd() if (Path.cwd() / "minisgl_ref").is_dir() else Path.cwd().parent
DATA = ROOT / "docs" / "data" / "bench_serving_cpu.json"


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
# * The **API server** (the process you start) runs uvicorn's event loop (uvloop, with the httptools parser, when
#   they are installed). Every HTTP connection is a coroutine on it, so thousands of idle streams cost almost
#   nothing; busy ones cost CPU per streamed token, which chapter 11 measures. The `TokenizerManager` lives here
#   too: it turns text into token ids, checks each request (prompt length against the context window, ids against
#   the vocabulary), and keeps one queue per request in flight. Like SGLang's tokenizer manager, and unlike a separate tokenizer
#   process, this means a bad request gets its 400 before it enters the pipeline at all.
# * The **scheduler** owns the engine and nothing else. Its loop drains whatever messages have arrived, runs one
#   `engine.step()`, and sends every request's new token ids on. It never waits for a client and never decodes
#   text for one. With tensor parallelism (chapter 09) there is one scheduler per rank; rank 0 talks to the
#   other processes. It builds its engine with `build_runtime` (`minisgl_ref/runtime.py`), the very function
#   behind `LLM(...)`, from the same settings objects (`ModelArgs`, `EngineConfig`, `TPArgs`) that the
#   command-line flags are generated from: an HTTP request and an `LLM.generate` call run the same engine.
# * The **detokenizer** turns ids into text, one `IncrementalDetokenizer` (chapter 02) per request. Decoding is
#   cheap per token but not free, and here it costs the scheduler nothing.
#
# Why processes rather than threads? Python runs one thread of Python code at a time (the GIL). The scheduler's
# loop is Python between device calls; if JSON parsing and text decoding ran in the same process they would
# steal time from it at every step, and on a GPU every such millisecond is an idle device (chapter 06). Separate
# processes also fail separately, which the launcher uses: if a child dies, it notices.
#
# The processes talk over **ZeroMQ** `PUSH`/`PULL` sockets on `ipc://` files in a private temporary folder: one
# receiving socket per process, any number of senders, messages delivered whole and in order, and a send never
# blocks the sender (it queues). Here are the addresses a server would use:

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
# * **Where stop rules live.** EOS and stop token ids need only ids, so the scheduler applies them (it must know
#   at once, to stop spending compute). A request with stop *strings* also gets an `IncrementalDetokenizer` in
#   the scheduler, and `Req.append_token` applies every rule in one place, exactly as offline. The detokenizer
#   runs its own copy with the same stop strings; both are deterministic functions of the ids, so they agree.
# * **The first row carries an `init`**: the request's stop strings, `skip_special_tokens` and the last prompt
#   ids (context for decoding the first output token). Later rows carry only new ids.
# * **Aborts** ride the same channel as requests. When an HTTP handler stops listening (the client closed the
#   connection, so Starlette cancels the response), `TokenizerManager.generate`'s `finally` block sends
#   `AbortReq(rid)`; the scheduler calls `engine.abort`, which frees the request's KV. Under overlap scheduling
#   (chapter 06) a batch may still be in flight that writes those slots, so the frees are deferred one step,
#   exactly as for a normal finish.
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
#   arrived (zero or more, without blocking) and steps at once. Only an idle engine sleeps on the socket, and
#   even then with a timeout (`IDLE_POLL_MS`, 200 ms), so that the process notices when its parent is gone. A
#   loop that waited for a message before each step would add that wait to every token of every stream.
# * **Take every waiting message before the step.** Ten requests that arrive together must enter the engine
#   together, so that one prefill step computes all ten; taking one message per turn would prefill them one step
#   apart, and cost nine extra steps.
# * **Send each token once.** After a step, each request that advanced gets one row with the ids it gained since
#   its last row (`self.sent[rid]` counts what went out), all rows of the step in one `BatchTokenOut`. The row
#   that finishes a request is its last one; a request answered at the door (`max_new_tokens=0` with no prompt
#   scores asked for, or refused) gets a single final row; and a step that raises ends in an abort of everything
#   in flight, not in a dead process.

# %%
print(task_source(scheduler_process, "10.2"))

# %% [markdown]
# `tests/test_server_scheduler.py` grades it the way the server uses it, but in one process: a real
# `SchedulerWorker` on a tiny model with its loop in a thread, and the test on the other ends of its sockets,
# sending requests and aborts as the API server does and reading the rows as the detokenizer does. What the rows
# add up to must be exactly the offline engine's tokens.
#
# ## 4. Start the real server
#
# `python -m minisgl_ref serve` takes SGLang's flag names: `--model-path` (default: the embedded
# SmolLM2-135M-Instruct), `--host`, `--port`, `--max-total-tokens`, `--max-running-requests`,
# `--chunked-prefill-size`, `--page-size`, `--disable-radix-cache`, `--attention-backend`, `--tp-size`,
# `--api-key`, `--enable-metrics`, `--served-model-name`, `--shell` and the rest (`--help` lists them).
#
# Start-up is ordered so that a client never talks to a half-loaded server: the launcher spawns the scheduler
# and the detokenizer, each reports on a pipe when its model and tokenizer are loaded (or why they failed), and
# only then does uvicorn open the port. Before that, a connection is *refused*, which every HTTP client
# understands. We start one with a small KV pool and count the refusals:

# %%
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
print(f"finish_reason={resp.choices[0].finish_reason}, usage={resp.usage.model_dump()}, {chat_s:.2f} s")
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
print("meta_info:", served[0]["meta_info"])

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
            shown = "data: {..., " + json.dumps({k: event[k] for k in ("choices", "usage") if k in event}) + "}"
        print(f"{(time.perf_counter() - t0) * 1000:7.0f} ms  {shown[:160]}")

# %% [markdown]
# The first chunk (the assistant's role) goes out as soon as the request is accepted; the first *token* follows
# after the prefill. SGLang's native stream differs in one way: each event carries the *cumulative* text and ids
# so far, not a delta. Its log probabilities are the exception, as in SGLang: an event holds the entries of the
# output tokens it adds (`output_token_logprobs`, `output_top_logprobs`) and `output_token_logprobs_length`, the
# count so far (equal to `completion_tokens`), so a stream of n tokens sends n entries rather than n²/2; the
# prompt's entries, all known after the prefill, come whole in every event.
#
# Usage, on the OpenAI routes, comes once at the end with `stream_options.include_usage`. With
# `stream_options.continuous_usage_stats` (SGLang's and vLLM's extension) *every* chunk carries a `usage` object
# for its choice so far: the prompt's tokens, all computed before the first token, and the tokens generated up to
# that chunk, so a client can show a running count or stop paying attention at a budget without counting tokens
# itself.
#
# ### Log probabilities
#
# Evaluation harnesses, classifiers built on a chat model and uncertainty-aware applications all ask the same
# question: how likely was each token? OpenAI's chat API answers it with `logprobs: true` (and `top_logprobs: k`
# for the k likeliest alternatives at each position), its completions API with `logprobs: k` (and `echo: true`
# to score the prompt too), and SGLang's `/generate` with `return_logprob`, `top_logprobs_num` and
# `logprob_start_len`, the first prompt position to score. Its default, -1, means SGLang's "from the last prompt
# token on": `input_token_logprobs` then holds one entry, the last prompt token's, which SGLang's frontend reads
# when it scores choices against their unconditional likelihood. That position differs between the prompts of one
# batch, so the request carries the rule and each sequence turns it into a position against its own prompt
# (`RequestOptions.logprob_start`). The engine's `Req` keeps the plain meaning, -1 for none of the prompt, which the
# OpenAI routes need: chat never scores the prompt, completions only with `echo` (from position 0).
#
# Inside the engine the three flat fields become one object, `Req.logprobs`, a `LogprobRequest` (None for a request
# that asked for nothing, the common case): the question, `top` alternatives per token and the first prompt
# position `start`, and the answers as the engine computes them, one `TokenLogprob` per token in `prompt` (from
# `start` on) and in `output`. Each bound is checked when the request is built, and the error names the field.
#
# *Which* probabilities? Those of the distribution the token was drawn from: the logits after `logit_bias` and
# the penalties, divided by the temperature (by 1 for greedy requests), before top-k/top-p/min-p cut it down.
# That is what SGLang reports, and for a greedy request it is plain `log_softmax` of the model's logits, which
# `tests/test_logprobs.py` checks against HF transformers. Prompt positions are scored with the raw logits.
#
# The cost is paid only by the steps that need it. The sampler computes one `log_softmax` over the batch, and a
# `topk`, only in a step where some request asked; a prompt's scores come from the hidden states of its positions,
# turned into logits a few hundred positions at a time, so a long prompt never needs a `[prompt, vocab]` tensor.
# One subtlety is the radix cache: a cached prefix is never computed, so it has no logits. A request that asks
# for prompt scores from position `s` therefore reuses at most `s - 1` cached tokens (`Req.reusable_prefix_len`),
# and the rest is computed again.

# %%
resp = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=6, temperature=0,
                                      logprobs=True, top_logprobs=3)
for item in resp.choices[0].logprobs.content:
    alternatives = ", ".join(f"{t.token!r} {t.logprob:.2f}" for t in item.top_logprobs)
    print(f"{item.token!r:>12} {item.logprob:6.2f}   top 3: {alternatives}")
scored = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=2,
                                   temperature=0, logprobs=1, echo=True).choices[0].logprobs
print("echo, prompt and answer:", [(t, None if lp is None else round(lp, 2))
                                   for t, lp in zip(scored.tokens, scored.token_logprobs)])

# %% [markdown]
# A greedy answer's tokens are always the top alternative. The first prompt token has no score (nothing came
# before it to predict it), which OpenAI's API writes as `null`.
#
# **Scoring without generating: prefill-only requests.** Likelihood-based evaluation, and the `select` of SGLang's
# frontend language, ask how likely a *given* text is, and want nothing generated: `max_new_tokens: 0` with
# `return_logprob` (from `logprob_start_len` on, or by default the last prompt token). Such a request
# (`Req.prefill_only`) is scheduled like any other; its prefill computes the prompt's log probabilities, and the
# engine then ends it, by `length`, without appending the token that step sampled. A request with
# `max_new_tokens: 0` that wants no prompt scores (no `return_logprob`) has nothing to compute and is answered at
# once, as before. Here three continuations are scored in one batch, as `select` does (and
# `tests/test_sglang_frontend.py` runs SGLang's own frontend programs against this server):

# %%
choices = [" Paris", " London", " a city"]
outs = httpx.post(URL + "/generate", timeout=60, json={
    "text": ["The capital of France is" + c for c in choices], "return_logprob": True, "logprob_start_len": 5,
    "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 0}}).json()
for c, out in zip(choices, outs):
    meta = out["meta_info"]
    entries = meta["input_token_logprobs"]
    print(f"{c!r:>10}: mean {sum(e[0] for e in entries) / len(entries):6.2f} over {[e[2] for e in entries]}, "
          f"completion_tokens={meta['completion_tokens']}, finish={meta['finish_reason']}")
# Without logprob_start_len: each prompt's last token only (one entry each, though the prompts differ in length).
last = httpx.post(URL + "/generate", timeout=60, json={
    "text": ["The capital of France is" + c for c in choices], "return_logprob": True,
    "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 0}}).json()
print("default start:", [[(e[2], round(e[0], 2)) for e in o["meta_info"]["input_token_logprobs"]] for o in last])

# %% [markdown]
# ### More of what a request can ask
#
# | field | where | what it does |
# | --- | --- | --- |
# | `logit_bias` | OpenAI routes, `sampling_params` | adds a bias in [-100, 100] to chosen token ids' logits (chapter 02) |
# | `stop_regex` | OpenAI routes, `sampling_params` | ends the answer once its text matches a regular expression (chapter 02) |
# | `cache_salt` | every route | only requests with the same salt share cached prefixes (chapter 04) |
# | `continue_final_message` | chat | the last, assistant message is continued rather than answered |
# | `response_format` | OpenAI routes | `{"type": "json_object"}`: a JSON object; `{"type": "json_schema", "json_schema": {"name", "schema"}}`: JSON valid for the schema |
# | `json_schema`, `regex`, `ebnf` | OpenAI routes, `sampling_params` | SGLang's spelling of a grammar the whole answer must follow (one at most; `json_schema` is a JSON string) |
# | `tools`, `tool_choice`, `parallel_tool_calls` | chat | OpenAI's function calling: the answer may (`"auto"`), must (`"required"`, or a named function) or must not (`"none"`) call one of the functions |
# | `stream_options.continuous_usage_stats` | OpenAI routes | every streamed chunk carries its choice's usage so far |
# | `rid` | `/generate` | the request's name, reported back as `meta_info.id` (one per prompt, or `rid_0`, `rid_1`, ...) |
#
# A grammar is enforced while decoding (chapter 12 shows how): every token that would leave it is banned before
# sampling, so the answer is valid by construction, even from a 135M-parameter model. Tools are a convention on
# top of that, kept in `minisgl_ref/server/tools.py`: the functions are described in the prompt (by the chat
# template, when it knows how, or by a system prompt in the Hermes style, asking for
# `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), `"required"` and a named function are forced by a
# JSON schema built from the functions' parameters, and `"auto"` answers are parsed: a call the model wrote comes
# back as `message.tool_calls` with `finish_reason: "tool_calls"`, anything else as content. Streams send a call's
# id and name first and its arguments in fragments after, as OpenAI's do. A function's `strict: true` (arguments
# that follow its schema exactly) is what the grammar of `"required"` and named calls gives; under `"auto"` it is
# kept by a *structural tag* (chapter 12): the text stays free until the model writes `<tool_call>`, and from there
# a grammar holds the call to one of the functions and its arguments to that function's schema.
#
# Fields that would change the answer but are not implemented (`structural_tag` on the OpenAI routes -- `/generate`
# takes it in `sampling_params` --, images, LoRA adapters, ...) are refused with a 400 that names them: an answer that silently ignored one would look right and be wrong. A chat
# message's fields beyond role and content (`reasoning_content`, say) go to the chat template, which decides what
# the model reads; the retired `function_call` and `audio`, which no template here renders, are refused. Fields that
# change nothing by their nature are accepted: `user` (for a provider's abuse monitoring), `stream_options` without
# a stream (a whole answer always carries its usage).

# %%
opened = CHAT + [{"role": "assistant", "content": "Sure! The capital of France is"}]
cont = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=opened, max_tokens=8,
                                      temperature=0, extra_body={"continue_final_message": True})
print("continued:", repr(opened[-1]["content"] + cont.choices[0].message.content))
schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}}, "required": ["capital"]}
shaped = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=24, temperature=0,
                                        response_format={"type": "json_schema",
                                                         "json_schema": {"name": "answer", "schema": schema}})
print("json_schema:", shaped.choices[0].message.content)
weather = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}
forced = client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=32,
                                        messages=[{"role": "user", "content": "Is it raining in Paris?"}],
                                        tools=[weather], tool_choice="required", parallel_tool_calls=False)
call = forced.choices[0].message.tool_calls[0]
print("tool call:", forced.choices[0].finish_reason, call.function.name, call.function.arguments)
refused = httpx.post(URL + "/v1/chat/completions", json={"messages": CHAT, "structural_tag": "{}"}, timeout=30)
print(refused.status_code, refused.json()["error"]["message"])

# %% [markdown]
# ### The Responses API
#
# OpenAI's newer API, `POST /v1/responses` (what the SDK's `client.responses.create` calls), asks for what a chat
# request asks, under other names: the conversation is `input` (a string, or a list of *items*: messages, the
# model's earlier `function_call`s and the `function_call_output`s that answer them), the system prompt is
# `instructions`, the limit is `max_output_tokens`, a grammar is `text.format`, and a function tool loses chat's
# `function` wrapper. `minisgl_ref/server/responses.py` translates such a request into a chat request and runs the
# chat route's own code on it: the template, the tools' prompt and grammar, the sampling parameters and every check
# (an error is renamed to the field the client sent). So the two routes give the same greedy answer to the same
# conversation. What changes is the answer's shape. `output` is a list of items, a `message` with `output_text`
# parts and a `function_call` per call, in the order the text held them; `status` is `"incomplete"`, with
# `incomplete_details.reason: "max_output_tokens"`, when the limit cut the answer; and a stream is a sequence of
# named events (an `event:` line, then its `data:`, each with a `sequence_number`) from `response.created` to
# `response.completed` (or `response.incomplete`, as in the four-token stream below). A response is kept in memory
# unless the request says `store: false` (the store is bounded: the oldest are forgotten first), so
# `previous_response_id` continues a conversation without sending it again and `GET /v1/responses/{id}` reads one
# back. What the engine cannot do (`background`, `reasoning`, web search and the other built-in tools, image
# inputs) is refused by name.

# %%
first = client.responses.create(model="SmolLM2-135M-Instruct", input=CHAT[0]["content"], max_output_tokens=32,
                                temperature=0)
as_chat = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=32, temperature=0)
print(first.status, repr(first.output_text), "same as chat:", first.output_text == as_chat.choices[0].message.content)
assert first.output_text == as_chat.choices[0].message.content
follow_up = client.responses.create(model="SmolLM2-135M-Instruct", previous_response_id=first.id,
                                    input="And the capital of Italy?", max_output_tokens=24, temperature=0)
print(repr(follow_up.output_text), follow_up.usage.input_tokens, "input tokens,",
      follow_up.usage.input_tokens_details.cached_tokens, "of them cached")
print([e.type for e in client.responses.create(model="SmolLM2-135M-Instruct", input="Say hello.",
                                                max_output_tokens=4, temperature=0, stream=True)])

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
for name, path, payload in bad:
    r = httpx.post(URL + path, json=payload, timeout=30)
    err = r.json()["error"]
    print(f"{name:<32} {r.status_code}  param={err['param']!r:<16} {err['message'][:90]}")
r = httpx.post(URL + "/v1/completions", content=b'{"prompt": "hi", ', timeout=30,
               headers={"Content-Type": "application/json"})
print(f"{'malformed JSON':<32} {r.status_code}  {r.json()['error']['message'][:100]}")

# %% [markdown]
# **One request's failure is that request's alone.** Checking at the door is the first line. Every token id a
# request carries (its prompt, `stop_token_ids`, the keys of `logit_bias`) ends up as an index into some
# `[vocab]`-sized row: the embedding table, the stop-token mask that `min_tokens` uses, the bias added to the
# logits. One id outside the vocabulary there does not fail one row, it fails the whole batch's step, and with it
# every request in the batch. So the API server checks ids against the vocabulary and answers 400, and the engine
# checks them again when a request is added (`Req.token_id_problem`), for callers that bypass the API.
#
# The engine does not rely on the door alone. If a step fails anyway (a request whose data changed after the
# check, a bug, a device error), `Engine.step` rolls that step back: every row gets back the KV length it had
# before the step, so nothing the failed step may have half-written reaches the radix cache. It then runs the
# door check on the step's requests again; those that fail it are aborted with the reason, and the others go
# back to the waiting queue, exactly as after a retraction (chapter 03), to be prefilled again from the cache.
# Only when nobody can be singled out are all of the step's requests aborted with the error. A failure while
# appending one request's token (its detokenizer, say) aborts just that request. And around all of it, the
# scheduler process catches what is left, aborts everything in flight, and keeps serving: a client sees an error
# for its own request, never a server that is gone. `tests/test_request_isolation.py` injects each kind of failure
# into one request of a batch and checks that the others produce exactly the oracle's tokens.

# %%
r = httpx.post(URL + "/v1/chat/completions", timeout=30, json={
    "messages": CHAT, "max_tokens": 4, "min_tokens": 1, "stop_token_ids": [10**6]})
print(r.status_code, r.json()["error"])
assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"

# %% [markdown]
# **Valid numbers can be traps too.** A repetition penalty may be any number in (0, 2], and a `/generate`
# temperature any number from 0 up. In float32, `5e-324` is 0 and `1e300` is infinite; a grammar's `-inf` logit
# times 0, or divided by infinity, is NaN, and a NaN row let the draw pick a token the grammar forbids, which
# aborted the request with a 500. A property-based fuzzer found this one (`tests/test_server_fuzz.py`). The
# sampler now keeps both numbers inside float32's range (chapter 02, penalties and temperature), and the request
# is served. The same fuzzer found two more ways to a row of `-inf`: `min_tokens` bans EOS where a complete grammar
# allows nothing else (there the grammar now wins), and `stop_token_ids` that are text tokens can corner a grammar
# (there the stop ids now win; chapter 12 shows both).

# %%
r = httpx.post(URL + "/generate", timeout=60, json={
    "text": "The capital of France is", "return_logprob": True,
    "sampling_params": {"max_new_tokens": 6, "temperature": 1e300, "repetition_penalty": 5e-324,
                        "json_schema": json.dumps({"type": "object"})}})
print(r.status_code, repr(r.json()["text"]), [round(e[0], 2) for e in r.json()["meta_info"]["output_token_logprobs"]])
assert r.status_code == 200

# %% [markdown]
# **A client that leaves.** Here a client asks for 2,000 tokens, reads three events and closes the connection.
# The server notices (the response task is cancelled), sends `AbortReq`, and the scheduler frees the KV. We
# watch the pool through `/get_server_info` (`available_kv_tokens` counts free slots plus cached ones that
# eviction could free):

# %%
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
# before the running requests take their next step. On a GPU a step of 8,192 prompt tokens takes tens of
# milliseconds, so that is fine. On a CPU the same rule would be a disaster: one core needs about 65 ms for a
# decode step of the embedded model, but about 37 s to prefill a 3,000-token prompt in one step, and every
# running stream would freeze for those 37 s. So `serve` on a CPU changes two defaults: prompts are cut into
# chunks of 32 tokens (`--chunked-prefill-size 32`), and each chunk shares its step with the running requests'
# decode rows (`--enable-mixed-chunk`). Measured on one core, a 3,000-token prompt arriving while one request
# streams:
#
# | chunk size | mixed with decode | longest pause of the running stream | the long prompt's own prefill |
# | --- | --- | --- | --- |
# | whole prompt (8,192) | no | 37 s | 37 s |
# | 128 | yes | 1.1-1.8 s | 21 s |
# | 64 | yes | 0.5-0.7 s | 23 s |
# | 32 (CPU default) | yes | 0.3-0.45 s (about 5 decode steps) | 28 s |
#
# The trade-off is plain in the last column: smaller chunks mean more steps, each of which reads all the weights
# once, so the long prompt itself takes longer. (Chunks of a few hundred tokens are even faster in total than one
# huge step here, because the plain attention of the CPU path grows quadratically with the tokens of a step.)
# Thirty-two tokens keep the pause of everyone else within a few decode steps for a quarter more time on the long
# prompt. On a GPU the chunks stay SGLang's 8,192 tokens, but `serve` mixes there too: with the prompt's step
# replayed as a CUDA graph (chapter 11, section 7), the running requests then wait one step of ~2.5 ms for a
# 1,000-token prompt instead of that step plus their own. Both flags can be set either way.
#
# We can watch it: one stream runs while a 600-token prompt arrives; we record the gaps between the stream's
# events.

# %%
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
# `model_name`), so a Grafana dashboard built for SGLang reads it unchanged. What a client experiences is measured
# in the API process as outputs stream past; what only the scheduler knows (running and queued requests, KV use,
# cache hit rate, tokens computed) is fetched from it over an RPC message each time `/metrics` is scraped.
#
# | metric | type | meaning |
# | --- | --- | --- |
# | `sglang:num_running_reqs` | gauge | requests in the running batch |
# | `sglang:num_queue_reqs` | gauge | requests waiting to be scheduled |
# | `sglang:num_waiting_reqs` | gauge | the same value as `num_queue_reqs`, under the other name dashboards use |
# | `sglang:token_usage` | gauge | fraction of the KV pool held by requests |
# | `sglang:num_used_tokens` | gauge | KV slots held by requests: `max_total_num_tokens - available_kv_tokens` |
# | `sglang:max_total_num_tokens` | gauge | size of the KV pool, in tokens |
# | `sglang:cache_hit_rate` | gauge | fraction of looked-up prompt tokens found in the radix cache |
# | `sglang:gen_throughput` | gauge | tokens decoded per second between the last two scrapes |
# | `sglang:decode_throughput` | gauge | the same value as `gen_throughput` |
# | `sglang:prefill_throughput` | gauge | prompt tokens prefilled per second between the last two scrapes |
# | `sglang:num_requests_total` | counter | requests that ended, however they ended |
# | `sglang:num_aborted_requests_total` | counter | those of them aborted by the server or because their client left |
# | `sglang:prompt_tokens_total` | counter | prompt tokens of ended requests |
# | `sglang:generation_tokens_total` | counter | output tokens that ended requests produced |
# | `sglang:cached_tokens_total` | counter | prompt tokens of ended requests served from the radix cache |
# | `sglang:time_to_first_token_seconds` | histogram | arrival to first output token, per request that got one |
# | `sglang:inter_token_latency_seconds` | histogram | gap between consecutive output tokens |
# | `sglang:time_per_output_token_seconds` | histogram | per request, `(e2e - ttft) / (completion_tokens - 1)` |
# | `sglang:e2e_request_latency_seconds` | histogram | arrival to end (last token, or the abort), per request |
#
# A slot that only the radix cache holds counts as available, not used: eviction can free it the moment a request
# needs it. The three throughputs are rates over the interval between two scrapes: the scheduler reports how many
# tokens it has prefilled and decoded since it started, and each scrape divides the change since the previous
# scrape by the time between them (the first scrape has no interval and reports 0). A request's first token comes
# out of its prefill step, so `gen_throughput` counts the tokens of decode steps, as SGLang's does.
#
# **Aborted requests count like the others.** A request counts from the moment the scheduler has it: one refused
# with a 4xx never does. Each one is counted exactly once, when it ends, whether it finished, was aborted by the
# server, or was abandoned by its client: once in `num_requests_total` and in the e2e histogram, with its prompt,
# cached and generated tokens (for an abandoned one, the tokens that had reached the API server) in the token
# counters, and in the TPOT histogram if it produced two tokens or more. An aborted request is also counted in
# `num_aborted_requests_total`. Time to first token and inter-token latency are observed as tokens arrive, so a
# request aborted before its first token counts in `num_requests_total` but not in the TTFT histogram. So
# `e2e_request_latency_seconds_count` always equals `num_requests_total`, and dividing `generation_tokens_total`
# by it gives the mean output length of all requests, abandoned ones included. The `/health_generate` probe is
# the server's own request and counts nowhere.
#
# The client that walked away above is counted: it is the one aborted request so far. We scrape twice around a
# request, so that the throughputs cover an interval in which the server worked:

# %%
def scrape_metrics() -> tuple[dict[str, float], str]:
    text = httpx.get(URL + "/metrics", timeout=30).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if not s.name.endswith("_bucket")}, text


scrape_metrics()
client.completions.create(model="SmolLM2-135M-Instruct", prompt="Once upon a time", max_tokens=16, temperature=0)
values, scrape = scrape_metrics()
for name in ("num_requests_total", "num_aborted_requests_total", "prompt_tokens_total", "generation_tokens_total",
             "cached_tokens_total", "num_running_reqs", "num_queue_reqs", "num_used_tokens", "max_total_num_tokens",
             "token_usage", "cache_hit_rate", "prefill_throughput", "gen_throughput"):
    print(f"sglang:{name:<36} {values['sglang:' + name]:g}")
for h in ("time_to_first_token_seconds", "inter_token_latency_seconds", "time_per_output_token_seconds",
          "e2e_request_latency_seconds"):
    n, total = values[f"sglang:{h}_count"], values[f"sglang:{h}_sum"]
    print(f"sglang:{h:<36} {n:g} observations, mean {total / n * 1000:.0f} ms")
assert values["sglang:num_aborted_requests_total"] >= 1
assert values["sglang:e2e_request_latency_seconds_count"] == values["sglang:num_requests_total"]
buckets = [(s.labels["le"], s.value) for fam in text_string_to_metric_families(scrape) for s in fam.samples
           if s.name == "sglang:time_to_first_token_seconds_bucket"]
print("TTFT histogram (cumulative counts, le = upper bound in s):", ", ".join(f"{le}: {v:g}" for le, v in buckets[:9]))

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
print(task_source(serving, "10.1"))

# %% [markdown]
# On synthetic timings whose answers we know:

# %%
synthetic = [RequestOutput(True, 100, 5, ttft=0.2, itl=[0.1] * 4, latency=0.6),
             RequestOutput(True, 50, 3, ttft=0.4, itl=[0.3, 0.5], latency=1.2)]
m = compute_metrics(synthetic, duration=2.0)
print({k: round(m[k], 1) for k in ("request_throughput", "output_throughput", "mean_ttft_ms", "mean_tpot_ms",
                                   "mean_itl_ms", "max_itl_ms", "mean_e2e_latency_ms", "concurrency")})
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
print(format_report(live))
assert live["completed"] == 8 and live["total_output_tokens"] == 64

# %% [markdown]
# On a CPU the engine's steps are slow, so every number here is dominated by model time: TTFT is a prefill of
# the requests that arrived together, ITL is one decode step of the whole running batch. Read the *shapes*:
# TTFT grows with the queue, ITL with the batch.
#
# A longer run, measured once and committed (`docs/data/bench_serving_cpu.json`, with the machine and the exact
# command recorded in it), is read back here rather than re-measured:

# %%
ref = json.loads(DATA.read_text())
prov = ref["provenance"]
print(f"command : {prov['command']}\nmachine : {prov['hardware']['cpu']} ({prov['hardware']['cpu_count']} cores), "
      f"torch {prov['software']['torch']}, {prov['date']}, load average while measuring "
      f"{prov['settings'].get('load_average_1_5_15_min')}\nworkload: {ref['workload']}")
rows = [("requests completed", f"{ref['completed']}"), ("duration", f"{ref['duration']:.1f} s"),
        ("request throughput", f"{ref['request_throughput']:.2f} req/s"),
        ("output throughput", f"{ref['output_throughput']:.1f} tok/s"),
        ("TTFT mean / median / p99", f"{ref['mean_ttft_ms']:.0f} / {ref['median_ttft_ms']:.0f} / "
                                     f"{ref['p99_ttft_ms']:.0f} ms"),
        ("ITL mean / median / p99", f"{ref['mean_itl_ms']:.0f} / {ref['median_itl_ms']:.0f} / "
                                    f"{ref['p99_itl_ms']:.0f} ms"),
        ("TPOT mean / median / p99", f"{ref['mean_tpot_ms']:.0f} / {ref['median_tpot_ms']:.0f} / "
                                     f"{ref['p99_tpot_ms']:.0f} ms"),
        ("E2E mean / median / p99", f"{ref['mean_e2e_latency_ms']:.0f} / {ref['median_e2e_latency_ms']:.0f} / "
                                    f"{ref['p99_e2e_latency_ms']:.0f} ms")]
for k, v in rows:
    print(f"  {k:<28} {v}")

# %% [markdown]
# ### On a GPU
#
# The same load generator against the same server on one H100, serving Qwen3-0.6B (random weights, bf16, every
# engine feature on: radix cache, chunked prefill, overlap scheduling, CUDA graphs, the default attention
# backends). 200 requests of 512-1024 prompt tokens and 128-256 output tokens, Poisson arrivals at 4 and 16
# requests per second, then all 200 at once. Measured once and committed (`docs/data/bench_serving_h100.json`,
# with its provenance); read back here:

# %%
gpu = json.loads((ROOT / "docs" / "data" / "bench_serving_h100.json").read_text())
hw = gpu["runs"][0]["provenance"]["hardware"]
print(f"server: {gpu['server_command']}\nGPU: {hw['gpu']} (driver {hw['nvidia_driver']}), {hw['cpu_count']} CPU cores")
print(f"{'rate':>5} {'req/s':>6} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'ITL p50':>8} "
      f"{'ITL p99':>8} {'E2E p50':>8} {'in flight':>9}")
for r in gpu["runs"]:
    print(f"{r['request_rate']:>5} {r['request_throughput']:6.1f} {r['output_throughput']:9.0f} "
          f"{r['median_ttft_ms']:7.0f}ms {r['p99_ttft_ms']:7.0f}ms {r['median_tpot_ms']:7.1f}ms "
          f"{r['median_itl_ms']:6.2f}ms {r['p99_itl_ms']:6.0f}ms {r['median_e2e_latency_ms']:6.0f}ms "
          f"{r['concurrency']:9.1f}")

# %% [markdown]
# Read it row by row:
#
# * **4 req/s.** The server keeps up easily: about 2 requests in flight, first token in ~25 ms, then a token
#   every ~2.7 ms. Output throughput (~810 tok/s) is simply what the arrivals ask for.
# * **16 req/s.** Still keeping up (16.1 req/s completed), with ~19 requests in flight: bigger decode batches
#   cost more per step, so TPOT roughly doubles to ~5 ms, and a new request's prefill now and then lands in a
#   running decode batch's way (ITL p99 ~38 ms).
# * **All at once.** 200 prompts (152k tokens) arrive together; prefilling them, at most 16,384 tokens per step
#   (`--max-prefill-tokens`), takes about half a second, which is everybody's TTFT. Then all 200 decode together at ~14 ms per token, ~10k output
#   tokens/s. The median ITL of 0.05 ms is not a fast decode step: with 200 streams, a stream's chunks often
#   reach the client *together*, in one read, and the gaps inside such a burst are nearly zero. (Most likely the
#   API server, one Python process writing 200 SSE streams, falls behind the engine now and then and catches up
#   in bursts; exercise 6 asks you to find out.) TPOT, computed from
#   each request's first and last token, is the honest per-token pace here; this is why both are reported.
#
# The engine's offline throughput on this GPU is chapter 11's subject; here what matters is the shape: latency
# stays flat while the server keeps up, and TTFT is what grows first when it no longer does.

# %% [markdown]
# ## 8. Stop it
#
# `Ctrl-C` in the server's terminal or `SIGTERM` from a supervisor: uvicorn stops accepting connections and gives
# open streams a few seconds, then the launcher sends `SIGTERM` to every child, waits for each, kills any that
# linger, removes the socket folder, and exits with status 0. (A terminal's Ctrl-C reaches the whole process
# group; the children ignore `SIGINT` and leave the shutdown order to the parent.)
#
# The other way a server can end is a child dying: the launcher's watchdog checks the children every 200 ms.
# When one has died, every request in flight ends with an abort, `/health` and every new request answer 503
# naming the dead process for a short grace period, and the server exits with status 1, so a supervisor restarts
# it instead of leaving a server that accepts connections and never answers
# (`tests/test_server.py::test_dead_scheduler_fails_fast` kills the scheduler to check exactly this).
#
# A scheduler can also be alive and stuck: a kernel that never returns, a collective waiting for a rank that hangs.
# Its process exists, so the check above sees nothing, and without more `/health` would say 200 while every request
# waits for ever. The scheduler's loop comes round at least every 200 ms when idle and once per step when busy, so
# the time since it last came round is the time spent inside the current step. It writes that moment into a few
# bytes of shared memory at the top of every turn (`minisgl_ref/server/watchdog.py`), and past
# `--watchdog-timeout` seconds (60 by default) `/health` and `/health_generate` answer 503 saying for how long,
# within 0.2 s of the limit; a thread in the scheduler logs its main thread's Python stack, which says where it is
# stuck. Requests are not refused meanwhile, and everything turns back by itself if the step ends: a step that is
# only slow (a huge prompt in one chunk on a CPU) is reported but not punished. SGLang's flag of the same name ends
# the server instead; here a supervisor that probes `/health` decides. `tests/test_server_watchdog.py` checks both
# kinds: one long prefill step, and a scheduler frozen with SIGSTOP while idle.

# %%
kids = children(server.pid)
server.send_signal(signal.SIGTERM)
code = server.wait(60)
time.sleep(0.2)
still_alive = [p for p in kids if alive(p)]
print(f"exit status {code}; children {kids} still alive: {still_alive}")
assert code == 0 and not still_alive
os.unlink(server_log.name)

# %% [markdown]
# ## 9. The shell
#
# `python -m minisgl_ref serve --shell` starts the same processes but, instead of opening a port, chats in the
# terminal through the same `TokenizerManager`. Each turn resends the whole conversation, so from the second
# turn on the radix cache holds everything but the newest message; the shell prints the cached count after each
# answer. `/reset` clears the history, `/set temperature 0` changes a sampling parameter, `/exit` quits.
#
# ```text
# $ python -m minisgl_ref serve --shell
# Chatting with SmolLM2-135M-Instruct. /reset clears the history, /set NAME VALUE changes a sampling parameter, ...
# >>> /set temperature 0
# (temperature = 0)
# >>> What is the capital of France?
# The capital of France is Paris.
# [prompt 37 tokens, cached 0; generated 8 in 1.67 s]
# >>> And of Italy?
# The capital of Italy is Rome.
# [prompt 59 tokens, cached 44; generated 8 in 1.72 s]
# ```
#
# The second turn's 59 tokens are the first turn's 37 prompt tokens and 8 answer tokens, then the new message;
# 44 of them were already in the radix cache: all of the first turn except the answer's last token (`<|im_end|>`,
# sampled but never fed back through the model, so it has no KV).
#
# ## 10. Data parallelism with SGLang's router
#
# One server is one engine: one copy of the weights, one KV pool, one radix cache, on one GPU (or one
# tensor-parallel group of them, chapter 09). When a model already fits and the requests outgrow what one engine
# can do, the simplest way to serve more is to run more copies, each on its own device, and spread the requests
# over them. This is **data parallelism**: the copies share nothing, every request is served start to end by one
# of them, and throughput grows with the number of copies. What is left to decide is which copy gets each request,
# and that is a router's job.
#
# The obvious router, round-robin, counts requests fairly but ignores what they contain. Our server's best trick,
# the radix cache of chapter 04, is private to each copy: a long system prompt that copy A has cached does nothing
# for a request that lands on copy B, which computes it again and stores a second copy of its KV. With N copies
# behind round-robin, a shared prefix is computed and stored N times, and each copy's pool has to hold every
# popular prefix, so the cache that all N pools add up to is, in effect, no bigger than one pool.
#
# SGLang's router (the `sglang-router` package, a load balancer written in Rust) has a `cache_aware` policy for
# exactly this. For each worker it keeps a rough radix tree of the request *texts* it has sent there (text, not
# tokens: it does not need the tokenizer, and text prefixes line up with token prefixes well enough). A new request
# is matched against every worker's tree: if some worker already saw a long enough part of its beginning (by
# default 30% of it, `--cache-threshold`) the request goes there, because that worker probably still holds the
# KV. Otherwise it goes to the worker whose tree is smallest, so different prefixes spread over the copies. And
# when the workers' loads (requests in flight) drift too far apart, it stops chasing hits and sends work to the
# least loaded worker until they even out. Requests that share a prefix end up on one worker, whose cache hits;
# requests that do not still fill every worker.
#
# `serve --dp-size N` puts this together (`minisgl_ref/server/data_parallel.py`): it starts N ordinary servers,
# each a `python -m minisgl_ref serve` on a free loopback port with the same model and engine flags (on a GPU
# machine each on its own GPUs through `CUDA_VISIBLE_DEVICES`; on a CPU with the cores shared out through
# `OMP_NUM_THREADS`), waits until they answer `/health`, starts the router on `--host/--port`, and prints one ready
# line when the router has registered them all. It prints each worker's address too, so you can ask one
# directly for its `/get_server_info`. Ctrl-C or SIGTERM stops the router first, then the workers; if any of them
# dies, the launcher stops the rest and exits with status 1, as the single server does when one of its processes
# dies. With `--api-key`, the router checks the key on every inference request and passes it on to the workers.
#
# ```bash
# pip install 'minisgl_ref[router]'    # sglang-router: a binary wheel (manylinux x86_64 and aarch64)
# ./minisgl serve --dp-size 2          # two workers on free local ports, the router on 127.0.0.1:30000
# curl -s http://127.0.0.1:30000/v1/chat/completions -H 'Content-Type: application/json' \
#   -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}'
# ```
#
# Name the model in chat requests sent through the router: when the field is missing the router fills in
# `"unknown"`, which our server refuses with a 404 (it only accepts the name it serves).
#
# These are the command lines the launcher runs for two workers (the ports are the OS's choice each time) and
# for the router; nothing is started here:

# %%
from minisgl_ref.server.data_parallel import router_command, worker_command

dp_args = ServerArgs(dp_size=2, model=ModelArgs(device="cpu"))
dp_urls = [f"http://127.0.0.1:{port}" for port in (41001, 41002)]
for url in dp_urls:
    print("python", " ".join(worker_command(dp_args, int(url.rsplit(":", 1)[1]))[1:]))
print("python", " ".join(router_command(dp_args, dp_urls, metrics_port=41003)[1:]))

# %% [markdown]
# What it buys, measured on this 2-core machine with two workers and six chat requests that share a ~410-token
# system prompt and ask different questions (about 425 prompt tokens each): behind `cache_aware`, all six went to
# one worker, which computed 474 prompt tokens in all (the first request's 426, then about 10 per request) while
# the other worker ran not a single step; behind `--policy round_robin` the requests alternated, each worker
# computed the shared prompt once, and together they computed 887. With more workers and more distinct prefixes
# the gap grows. `tests/test_data_parallel.py` checks the `cache_aware` half: it reads each worker's
# `/get_server_info` around five such requests and asserts that one worker ran all of them, serving the prompt from
# its cache after the first, while the other ran not a step; then it stops the launcher with SIGTERM and checks
# that none of its processes is left.
#
# On a CPU this is a demonstration, not a speed-up: two workers share the same two cores. The point of data
# parallelism is on a machine with several GPUs, where `--dp-size 2` doubles the hardware serving requests
# (`--dp-size 2 --tp-size 2` needs four GPUs: two servers of two ranks each).
#
# On two H200s (`docs/data/parallel_serving_h200.json`, from `scripts/gpu/parallel_serving.py`; Qwen3-0.6B config,
# bf16, dummy weights), 1,024 requests of 256-512 prompt and 128-256 output tokens, sent all at once by
# `bench serving`: one server on one GPU completed them at 71 requests/s (13.6k output tok/s); `--dp-size 2`, one
# worker per GPU behind the router, at 212 requests/s (40.7k output tok/s), 2.98 times as many. More than twice,
# because with the whole burst queued a single server is limited by more than its GPU: it decodes at most
# `--max-running-requests` (256) requests at a time, and its one API server process carries every streamed token.
# Two servers double both, and the median time to first token falls from 4.7 s to 1.0 s. Then one worker was killed
# (SIGKILL) in the middle of a run: the launcher saw it, stopped the router and the other worker, and exited with
# status 1 after 2.2 s, leaving no process behind. (The router's log warns that it could not download the model's
# tokenizer: it tries, for routing by tokens, and routes by text without it.)

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
#    --worker-urls URL1 URL2 --policy round_robin`), then `--policy cache_aware`, and send both the same mix:
#    three groups of requests, each group sharing its own long system prompt. Compare the workers' `prefill_tokens`
#    and `cache_hit_rate` in `/get_server_info`. Then send many requests of one group at once: at what imbalance
#    does `cache_aware` give up on the hits to even out the load (`--balance-abs-threshold`,
#    `--balance-rel-threshold`)?
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
# NCCL_NVLS_ENABLE=0 python3 scripts/gpu/parallel_serving.py --out results --phases dp   # two GPUs
#
# # the GPU numbers: a server on one H100, then one bench per rate (4, 16, inf)
# python -m minisgl_ref serve --model-path qwen3-0.6b --load-format dummy --dtype bfloat16 &
# python -m minisgl_ref bench serving --num-prompts 200 --random-input-len 1024 --random-output-len 256 \
#   --random-range-ratio 0.5 --request-rate 16
# ```
#
# The committed CPU numbers above come from the third command, against the second, on the machine named in the
# JSON file.
#
# Measured on a 2-core x86_64 CPU (AMD EPYC) shared with other jobs (load average 6-8 while measuring), no GPU,
# Python 3.11, torch 2.13 (CPU), SmolLM2-135M-Instruct in float32; the server's engine uses one torch thread.
#
# | what | measured |
# | --- | --- |
# | server start, process spawn to the first `/health` 200 | 29-68 s (the port stays closed until the model is loaded) |
# | greedy chat "What is the capital of France?" (37 prompt tokens, 8 output) | "The capital of France is Paris.", 1.6-2.7 s |
# | oracle: 2 prompts x 12 greedy tokens through `/generate` vs chapter 00's loop | identical token ids (2/2) |
# | a client leaves a 2,000-token stream after 3 events | the pool is back to 4096/4096 free or evictable within ~0.3 s |
# | a 3,000-token prompt arrives while a stream runs (one core, 32-token chunks mixed with decode) | longest pause of the stream 0.3-0.45 s (37 s if prefilled in one step) |
# | GPU (`docs/data/gpu_request_features_h100.json`): log probabilities for 64 requests x 128 tokens, top 5 | 19.7k vs 21.4k output tok/s without (about 8%) |
# | `bench serving`, 16 requests, 64-128 prompt and 16-32 output tokens, 1 req/s (`docs/data/bench_serving_cpu.json`) | 0.53 req/s, 13.6 output tok/s; TTFT median 2.7 s; ITL median 0.56 s, p99 7.5 s; TPOT median 0.73 s |
# | `bench serving` in this chapter, 8 x (32 -> 8 tokens) at 4 req/s | TTFT median 2.3 s, ITL median 0.51 s, 9.2 output tok/s |
# | the whole chapter, `python chapters/10_server.py` | 87-119 s wall on the loaded machine, most of it the server's start |
#
# On an idle machine every time above shrinks several-fold: a decode step of this model at batch 16 is CPU work
# that the other jobs were sharing. The ITL tail (p99) is where new requests' prefills cut into the running
# decode batch (chapter 05's trade-off, seen from the client). The last cell prints this run's numbers.
#
# Expected on one H100 80GB HBM3 (`docs/data/bench_serving_h100.json`; Qwen3-0.6B config, bf16, dummy weights;
# 200 requests of 512-1024 prompt and 128-256 output tokens):
#
# | request rate | output tok/s | TTFT median | ITL median / p99 | TPOT median |
# | --- | --- | --- | --- | --- |
# | 4 req/s | 814 | 25 ms | 2.4 / 13.4 ms | 2.7 ms |
# | 16 req/s | 3,078 | 42 ms | 3.9 / 37.8 ms | 5.2 ms |
# | all at once | 10,200 | 568 ms | 0.05 / 113 ms | 14.0 ms |
#
# Expected on 2 x H200 (`docs/data/parallel_serving_h200.json`; Qwen3-0.6B config, bf16, dummy weights; 1,024
# requests of 256-512 prompt and 128-256 output tokens, all at once):
#
# | server | requests/s | output tok/s | TTFT median |
# | --- | --- | --- | --- |
# | one server, one GPU | 71 | 13,645 | 4.7 s |
# | `--dp-size 2`, one worker per GPU behind the router | 212 (2.98x) | 40,703 | 1.0 s |

# %%
print(f"this run: server ready in {startup_s:.0f} s; greedy chat answer in {chat_s:.2f} s; bench serving "
      f"(8 x 32 -> 8 tokens at 4 req/s): median TTFT {live['median_ttft_ms']:.0f} ms, median ITL "
      f"{live['median_itl_ms']:.0f} ms, output {live['output_throughput']:.1f} tok/s; chapter ran in "
      f"{time.perf_counter() - CHAPTER_START:.0f} s")
