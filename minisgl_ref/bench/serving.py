"""``python -m minisgl_ref bench serving``: an online load generator for a running server (chapters 10 and 11).

The offline benchmark (:mod:`~minisgl_ref.bench.offline`) hands the engine every request at once and times the
whole pile. A *server* is judged by its users instead, one request at a time: how long until the first token
arrives, how smoothly the rest follow, how long the whole answer takes, and how many requests per second the
server sustains while doing so. This module measures exactly that, from the outside, over HTTP, so it works
against this project's server and against an SGLang server alike (or anything else that speaks one of the APIs).

**How it drives the server.**

1. Build the workload: ``random`` (SGLang's random dataset: random token ids, prompt and output lengths drawn
   between ``range_ratio * len`` and ``len``) or ``shared-prefix`` (SGLang's generated-shared-prefix: groups of
   requests that share a long system prompt). Both come from :mod:`~minisgl_ref.bench.workloads` and are
   seeded, so every run sends the same requests.
2. Send one warm-up request, so that a wrong URL or key fails in a second rather than after the whole run.
3. Send the requests at their *arrival times*: all at once with ``--request-rate inf``, otherwise a Poisson
   process (exponential gaps with mean ``1 / rate``, seeded). ``--max-concurrency`` caps how many are in flight
   at once; a request that arrives while the cap is reached waits for a free slot, and that wait is *not*
   counted in its latency (the same choice SGLang makes: the cap models a client pool, not the server).
4. Stream every answer and timestamp each chunk as it arrives. Every request streams, because time to first
   token cannot be measured otherwise. The client is aiohttp on one event loop, as in ``sglang.bench_serving``:
   at saturation a fast server streams tens of thousands of events per second, and a client that spends more
   CPU per event than that budget allows timestamps them late and in bursts, which shows up as a bogus
   inter-token latency. aiohttp reads an event in about half the CPU time of httpx (measured in chapter 11).
5. Reduce the timestamps to the metrics of ``sglang.bench_serving`` (same names, same definitions; see
   :func:`compute_metrics`), print them, and save them with the run's provenance as JSON.

The backends differ only in the request body and in how a streamed event is read:

=================  ============================  =========================================================
backend            endpoint                      what counts as tokens in a streamed event
=================  ============================  =========================================================
minisgl            POST /generate (native)       the cumulative meta_info.completion_tokens
sglang             POST /generate (native)       the same (this server's native API is SGLang's)
openai             POST /v1/completions          a chunk with text; totals from the stream's usage chunk
openai-chat        POST /v1/chat/completions     a chunk with delta.content; totals from the usage chunk
=================  ============================  =========================================================

The native and completions backends send the prompts as token ids, so the server computes exactly the prompt
lengths the workload asked for; the chat backend must send text, so it decodes the ids with a tokenizer first
(the server then re-tokenizes it and adds its chat template: prompt lengths are read back from the usage the
server reports).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import numpy as np

from minisgl_ref.bench.workloads import Workload, random_workload, shared_prefix_workload

BACKENDS = ("minisgl", "sglang", "openai", "openai-chat")
DATASETS = ("random", "shared-prefix")
ENDPOINTS = {"minisgl": "/generate", "sglang": "/generate", "openai": "/v1/completions",
             "openai-chat": "/v1/chat/completions"}
WARMUP_TIMEOUT_S = 300.0

T = TypeVar("T")


# ------------------------------------------------------------------------------------------------- results


@dataclass
class RequestOutput:
    """What one request looked like from the client: its timestamps reduced to latencies (seconds).

    ``itl`` holds one gap per streamed chunk after the first (the time between two consecutive chunks that
    carried tokens). ``prompt_len`` and ``output_len`` are the server's own counts when it reports them (usage,
    ``meta_info``), else the workload's."""

    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (``0 <= q <= 100``) of a non-empty list, interpolated linearly between the two
    nearest ranks: NumPy's default (``np.percentile``), which ``sglang.bench_serving`` reports.

    Order the values; the percentile sits at the fractional position ``q / 100 * (n - 1)`` of the ordered list
    (position 0 is the smallest value, ``n - 1`` the largest), between the values at the positions just below
    and just above it, weighted by how close it is to each. So ``percentile([1, 2, 3, 4], 50) == 2.5`` and
    ``percentile(xs, 100) == max(xs)``. The values arrive in whatever order the requests finished."""
    if not values:
        raise ValueError("the percentile of no values is undefined")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    # BEGIN TASK 10.1: serving metrics from client-side timestamps
    xs = sorted(values)
    pos = q / 100 * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    # END TASK 10.1


def _stats(values: Sequence[float], name: str, percentiles: Sequence[int]) -> dict[str, float]:
    """``mean_<name>_ms``, ``median_<name>_ms``, ``std_<name>_ms`` and ``p<q>_<name>_ms`` of ``values``
    (seconds in, milliseconds out; the standard deviation is the population one, NumPy's default). An empty
    list gives zeros, as in SGLang, so that the keys always exist."""
    ms = [v * 1000.0 for v in values] or [0.0]
    arr = np.asarray(ms, dtype=np.float64)
    out = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(percentile(ms, 50)),
           f"std_{name}_ms": float(arr.std())}
    for q in percentiles:
        out[f"p{q}_{name}_ms"] = float(percentile(ms, q))
    return out


def compute_metrics(outputs: Sequence[RequestOutput], duration: float) -> dict[str, float]:
    """The metrics of ``sglang.bench_serving``, computed from what the client saw.

    Over the *successful* requests only (failures are counted, nothing else):

    * **throughputs** divide totals by the benchmark's wall ``duration``: ``request_throughput`` (requests/s),
      ``input_throughput`` and ``output_throughput`` (tokens/s), ``total_throughput`` (both); the totals are
      ``total_input_tokens`` and ``total_output_tokens`` (each request's ``prompt_len`` and ``output_len``);
    * **TTFT** (time to first token): request sent -> first chunk with a token. It contains the queueing and
      the whole prefill, so it grows with prompt length and with load;
    * **ITL** (inter-token latency): the gaps between consecutive chunks, pooled over all requests. Its tail
      (p99, max) shows the stalls a reader of a stream notices: a decode step that had to wait for another
      request's prefill, for example;
    * **TPOT** (time per output token), per request: ``(latency - ttft) / (output_len - 1)``, the average decode
      pace after the first token (requests with a single output token have none and are left out);
    * **E2E latency**: request sent -> last byte;
    * ``concurrency``: the sum of all E2E latencies over the duration, i.e. how many requests were in flight on
      average (Little's law).

    The keys: ``completed``, ``failed``, ``duration``, the two totals, the four throughputs, ``concurrency``,
    then :func:`_stats` of the TTFTs (``ttft``, p90 and p99), the TPOTs (``tpot``, p90 and p99), the pooled
    ITLs (``itl``, p90, p95 and p99, and ``max_itl_ms``, 0 when there are none) and the E2E latencies
    (``e2e_latency``, p90 and p99).
    """
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    # BEGIN TASK 10.1: serving metrics from client-side timestamps
    ok = [o for o in outputs if o.success]
    input_tokens = sum(o.prompt_len for o in ok)
    output_tokens = sum(o.output_len for o in ok)
    tpots = [(o.latency - o.ttft) / (o.output_len - 1) for o in ok if o.output_len > 1]
    itls = [gap for o in ok for gap in o.itl]
    e2e = [o.latency for o in ok]
    metrics: dict[str, float] = {
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "input_throughput": input_tokens / duration,
        "output_throughput": output_tokens / duration,
        "total_throughput": (input_tokens + output_tokens) / duration,
        "concurrency": sum(e2e) / duration,
    }
    metrics |= _stats([o.ttft for o in ok], "ttft", (90, 99))
    metrics |= _stats(tpots, "tpot", (90, 99))
    metrics |= _stats(itls, "itl", (90, 95, 99))
    metrics["max_itl_ms"] = max(itls) * 1000.0 if itls else 0.0
    metrics |= _stats(e2e, "e2e_latency", (90, 99))
    return metrics
    # END TASK 10.1


def arrival_times(n: int, request_rate: float, seed: int) -> list[float]:
    """When each of ``n`` requests is sent, in seconds after the start.

    ``inf`` sends everything at time 0. Otherwise the requests form a Poisson process of rate ``request_rate``:
    independent exponential gaps of mean ``1 / rate``, the arrival pattern of many independent users. The
    first request also waits one gap, as in SGLang. A private generator keeps the schedule reproducible."""
    if math.isinf(request_rate):
        return [0.0] * n
    if not request_rate > 0:
        raise ValueError(f"request_rate must be positive or inf, got {request_rate}")
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(n):
        t += rng.expovariate(request_rate)
        times.append(t)
    return times


# ------------------------------------------------------------------------------------------------- config


@dataclass
class ServingBenchConfig:
    """Everything one run needs; the CLI flags map one to one (SGLang's names)."""

    backend: str = "minisgl"
    base_url: str = "http://127.0.0.1:30000"
    model: str | None = None  # OpenAI backends: the model name (default: the first of /v1/models)
    api_key: str | None = None
    dataset_name: str = "random"
    num_prompts: int = 1000
    random_input_len: int = 1024
    random_output_len: int = 1024
    random_range_ratio: float = 0.0
    gsp_num_groups: int = 64
    gsp_prompts_per_group: int = 16
    gsp_system_prompt_len: int = 2048
    gsp_question_len: int = 128
    gsp_output_len: int = 256
    request_rate: float = math.inf
    max_concurrency: int | None = None
    temperature: float = 0.0
    ignore_eos: bool = True
    tokenizer: str | None = None  # openai-chat: decode the prompts with this model folder's tokenizer
    seed: int = 1
    warmup_requests: int = 1
    disable_tqdm: bool = True

    def validate(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.dataset_name not in DATASETS:
            raise ValueError(f"dataset_name must be one of {', '.join(DATASETS)}, got {self.dataset_name!r}")
        for name in ("num_prompts", "random_input_len", "random_output_len", "gsp_num_groups",
                     "gsp_prompts_per_group", "gsp_system_prompt_len", "gsp_question_len", "gsp_output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0.0 <= self.random_range_ratio <= 1.0:
            raise ValueError(f"random_range_ratio must be in [0, 1], got {self.random_range_ratio}")
        if not (self.request_rate > 0):
            raise ValueError(f"request_rate must be positive or inf, got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {self.max_concurrency}")
        if self.warmup_requests < 0:
            raise ValueError(f"warmup_requests must be >= 0, got {self.warmup_requests}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")


def build_workload(cfg: ServingBenchConfig) -> Workload:
    """The requests to send, as token ids plus SGLang sampling parameters."""
    if cfg.dataset_name == "random":
        lo_in = max(1, int(cfg.random_input_len * cfg.random_range_ratio))
        lo_out = max(1, int(cfg.random_output_len * cfg.random_range_ratio))
        wl = random_workload(cfg.num_prompts, input_len=(lo_in, cfg.random_input_len),
                             output_len=(lo_out, cfg.random_output_len), temperature=cfg.temperature, seed=cfg.seed)
        wl.spec["range_ratio"] = cfg.random_range_ratio
    else:
        wl = shared_prefix_workload(cfg.gsp_num_groups, cfg.gsp_prompts_per_group, cfg.gsp_system_prompt_len,
                                    cfg.gsp_question_len, cfg.gsp_output_len, temperature=cfg.temperature,
                                    seed=cfg.seed)
    for p in wl.sampling_params:
        p["ignore_eos"] = cfg.ignore_eos
    wl.spec["ignore_eos"] = cfg.ignore_eos
    return wl


# ------------------------------------------------------------------------------------------------ requests


def _body(cfg: ServingBenchConfig, prompt: list[int] | str, params: dict[str, Any]) -> dict[str, Any]:
    """The streaming request body of one request for ``cfg.backend``."""
    if cfg.backend in ("minisgl", "sglang"):
        key = "text" if isinstance(prompt, str) else "input_ids"
        return {key: prompt, "sampling_params": dict(params), "stream": True}
    common = {"model": cfg.model, "max_tokens": params["max_new_tokens"], "temperature": params["temperature"],
              "stream": True, "stream_options": {"include_usage": True},
              # not OpenAI's, but SGLang's (and ours): without it a request may stop early at EOS
              "ignore_eos": params.get("ignore_eos", False)}
    if cfg.backend == "openai":
        return {"prompt": prompt, **common}
    return {"messages": [{"role": "user", "content": prompt}], **common}


class _StreamReader:
    """Turns one streamed response into a :class:`RequestOutput`, one SSE event at a time."""

    def __init__(self, backend: str, start: float, prompt_len: int) -> None:
        self.native = backend in ("minisgl", "sglang")
        self.out = RequestOutput(prompt_len=prompt_len)
        self.start = start
        self.last: float | None = None
        self.tokens_seen = 0  # native: the cumulative completion_tokens of the last event
        self.chunks = 0  # openai: chunks that carried text

    def event(self, data: dict[str, Any], now: float) -> None:
        """One streamed event (parsed JSON) that arrived at ``now`` (``time.perf_counter`` seconds).

        The code before the timestamps reads the event: ``got_tokens`` says whether it carried at least one new
        token (a role chunk, an empty keep-alive or the final usage chunk carries none), and the counts go to
        ``self.out``. Then the timestamps: the request was sent at ``self.start``, and ``self.last`` is when the
        latest chunk with tokens arrived (None before the first). The first chunk with tokens sets
        ``self.out.ttft`` (seconds since the request was sent); every later one appends to ``self.out.itl`` the
        gap since the previous chunk with tokens. Chunks without a token change no timestamp."""
        if "error" in data:  # a request the server ended with an error mid-stream
            err = data["error"]
            raise RuntimeError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
        if self.native:
            meta = data.get("meta_info", {})
            tokens = int(meta.get("completion_tokens", self.tokens_seen))
            self.out.prompt_len = int(meta.get("prompt_tokens", self.out.prompt_len))
            got_tokens = tokens > self.tokens_seen
            self.tokens_seen = self.out.output_len = max(tokens, self.tokens_seen)
            if meta.get("finish_reason") and meta["finish_reason"].get("type") == "abort":
                raise RuntimeError(f"aborted: {meta['finish_reason'].get('message', '')}")
        else:
            usage = data.get("usage")
            if usage:
                self.out.prompt_len = int(usage.get("prompt_tokens", self.out.prompt_len))
                self.out.output_len = int(usage.get("completion_tokens", self.out.output_len))
            choices = data.get("choices") or []
            piece = ""
            if choices:
                c = choices[0]
                piece = c.get("text") or (c.get("delta") or {}).get("content") or ""
            got_tokens = bool(piece)
            self.chunks += got_tokens
        # BEGIN TASK 10.1: serving metrics from client-side timestamps
        if not got_tokens:
            return
        if self.last is None:
            self.out.ttft = now - self.start
        else:
            self.out.itl.append(now - self.last)
        self.last = now
        # END TASK 10.1

    def finish(self, now: float) -> RequestOutput:
        self.out.latency = now - self.start
        if not self.native and self.out.output_len == 0:
            self.out.output_len = self.chunks  # a server without usage in streams: one token per chunk
        if self.last is None:
            raise RuntimeError("the stream ended without any token")
        self.out.success = True
        return self.out


async def _sse_lines(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The lines of a streamed body, however the network cut it into chunks (and however long a line is:
    a native event carries the whole answer so far)."""
    pending = b""
    async for data in response.content.iter_any():
        lines = (pending + data).split(b"\n")
        pending = lines.pop()
        for line in lines:
            yield line
    if pending:
        yield pending


async def send_request(session: aiohttp.ClientSession, cfg: ServingBenchConfig, prompt: list[int] | str,
                       prompt_len: int, params: dict[str, Any]) -> RequestOutput:
    """Send one streaming request and time it. Never raises: a failure is a :class:`RequestOutput` with
    ``success=False`` and the reason, so one bad request does not end the benchmark."""
    start = time.perf_counter()
    reader = _StreamReader(cfg.backend, start, prompt_len)
    try:
        async with session.post(_url(cfg, ENDPOINTS[cfg.backend]), json=_body(cfg, prompt, params)) as r:
            if r.status != 200:
                text = (await r.read()).decode(errors="replace")
                raise RuntimeError(f"HTTP {r.status}: {text[:300]}")
            async for line in _sse_lines(r):
                if not line.startswith(b"data:"):
                    continue  # blank separators, comments, keep-alives
                payload = line[len(b"data:"):].strip()
                if payload == b"[DONE]":
                    break
                reader.event(json.loads(payload), time.perf_counter())
        return reader.finish(time.perf_counter())
    except Exception as e:  # noqa: BLE001 - recorded per request
        out = reader.out
        out.success, out.latency = False, time.perf_counter() - start
        out.error = f"{type(e).__name__}: {e}"
        return out


# --------------------------------------------------------------------------------------------------- a run


def _headers(cfg: ServingBenchConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


def _url(cfg: ServingBenchConfig, path: str) -> str:
    return cfg.base_url.rstrip("/") + path


async def _get_json(session: aiohttp.ClientSession, cfg: ServingBenchConfig, path: str) -> Any:
    """The JSON body of a GET that answered 200, or None (best effort: no answer, any other answer, or a body
    that is not JSON; an unreachable server is reported by the warm-up request, with its URL)."""
    try:
        async with session.get(_url(cfg, path)) as r:
            return json.loads(await r.read()) if r.status == 200 else None
    except (aiohttp.ClientError, ValueError):
        return None


async def _server_facts(session: aiohttp.ClientSession, cfg: ServingBenchConfig) -> dict[str, Any]:
    """What the server says about itself (best effort): its model name and, if native, its model info."""
    facts: dict[str, Any] = {}
    models = await _get_json(session, cfg, "/v1/models")
    if isinstance(models, dict) and models.get("data"):
        try:
            facts["model"] = models["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            pass
    info = await _get_json(session, cfg, "/get_model_info")
    if isinstance(info, dict):
        facts["model_info"] = info
    return facts


def _decode_prompts(cfg: ServingBenchConfig, prompts: list[list[int]], model_path: str | None) -> list[str]:
    """The chat backend sends text: decode the workload's ids with the served model's tokenizer (or
    ``cfg.tokenizer``; the embedded model's when neither is known)."""
    from minisgl_ref.models.loader import resolve_model_path
    from minisgl_ref.tokenizer import Tokenizer

    folder = resolve_model_path(cfg.tokenizer or model_path, "auto").path
    tok = Tokenizer.from_pretrained(folder)
    return [tok.decode(p, skip_special_tokens=True) for p in prompts]


async def benchmark(cfg: ServingBenchConfig, workload: Workload | None = None) -> dict[str, Any]:
    """Run the whole benchmark against ``cfg.base_url`` and return the results (metrics, settings, and the
    per-request details). Raises ``ConnectionError`` when the warm-up request fails."""
    cfg.validate()
    wl = workload or build_workload(cfg)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0)  # a long answer may stream for minutes
    connector = aiohttp.TCPConnector(limit=0)  # no pool limit: every request in flight has its connection
    async with aiohttp.ClientSession(headers=_headers(cfg), timeout=timeout, connector=connector) as client:
        facts = await _server_facts(client, cfg)
        if cfg.backend.startswith("openai") and cfg.model is None:
            cfg.model = facts.get("model")
        vocab = facts.get("model_info", {}).get("vocab_size")
        if vocab is not None and wl.max_vocab_id >= vocab:
            raise ValueError(f"the workload uses token id {wl.max_vocab_id}, but the served model's vocabulary "
                             f"has only {vocab} ids")
        prompts: list[list[int] | str] = list(wl.prompts)
        if cfg.backend == "openai-chat":
            model_path = facts.get("model_info", {}).get("tokenizer_path")
            prompts = list(_decode_prompts(cfg, wl.prompts, model_path))

        # Warm-up: a short request that must succeed (it also pays one-time costs outside the timing).
        for _ in range(cfg.warmup_requests):
            warm = await asyncio.wait_for(send_request(
                client, cfg, prompts[0], len(wl.prompts[0]),
                {**wl.sampling_params[0], "max_new_tokens": min(4, wl.sampling_params[0]["max_new_tokens"])}),
                WARMUP_TIMEOUT_S)
            if not warm.success:
                raise ConnectionError(f"the warm-up request to {cfg.base_url}{ENDPOINTS[cfg.backend]} failed: "
                                      f"{warm.error}")

        arrivals = arrival_times(len(prompts), cfg.request_rate, cfg.seed)
        gate = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        t0 = time.perf_counter()

        async def one(i: int) -> RequestOutput:
            delay = t0 + arrivals[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if gate is None:
                return await send_request(client, cfg, prompts[i], len(wl.prompts[i]), wl.sampling_params[i])
            async with gate:
                return await send_request(client, cfg, prompts[i], len(wl.prompts[i]), wl.sampling_params[i])

        outputs = await asyncio.gather(*[one(i) for i in range(len(prompts))])
        duration = time.perf_counter() - t0

    metrics = compute_metrics(outputs, duration)
    errors = sorted({o.error for o in outputs if not o.success})
    return {
        "backend": cfg.backend,
        "base_url": cfg.base_url,
        "model": cfg.model or facts.get("model"),
        "dataset_name": cfg.dataset_name,
        "workload": wl.summary(),
        "request_rate": cfg.request_rate if math.isfinite(cfg.request_rate) else "inf",
        "max_concurrency": cfg.max_concurrency,
        **metrics,
        "errors": errors[:20],
        "config": {k: (v if not isinstance(v, float) or math.isfinite(v) else "inf")
                   for k, v in asdict(cfg).items() if k != "api_key"},
        "requests": {
            "input_lens": [o.prompt_len for o in outputs],
            "output_lens": [o.output_len for o in outputs],
            "ttfts": [round(o.ttft, 6) for o in outputs],
            "latencies": [round(o.latency, 6) for o in outputs],
            "itls": [[round(x, 6) for x in o.itl] for o in outputs],
            "success": [o.success for o in outputs],
        },
    }


def run_sync(make: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine to completion from synchronous code, even inside a running event loop (a Jupyter
    notebook has one, and ``asyncio.run`` refuses to nest): then it runs on a fresh loop in a helper thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())  # type: ignore[arg-type]
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(make())  # type: ignore[arg-type]
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=target, name="bench-serving")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def run_benchmark(cfg: ServingBenchConfig, workload: Workload | None = None) -> dict[str, Any]:
    """:func:`benchmark`, from synchronous code (scripts, notebooks)."""
    return run_sync(lambda: benchmark(cfg, workload))


# ----------------------------------------------------------------------------------------------- reporting


def format_report(result: dict[str, Any]) -> str:
    """The results as the familiar ``bench_serving`` block of text."""
    m = result

    def row(label: str, value: Any, fmt: str = "{:<10.2f}") -> str:
        text = fmt.format(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)
        return f"{label:<40}{text}"

    lines = [
        "{s:{c}^60}".format(s=" Serving Benchmark Result ", c="="),
        row("Backend:", m["backend"]),
        row("Traffic request rate:", m["request_rate"]),
        row("Max request concurrency:", m["max_concurrency"] or "not set"),
        row("Successful requests:", m["completed"], "{}"),
        row("Failed requests:", m["failed"], "{}"),
        row("Benchmark duration (s):", m["duration"]),
        row("Total input tokens:", m["total_input_tokens"], "{}"),
        row("Total generated tokens:", m["total_output_tokens"], "{}"),
        row("Request throughput (req/s):", m["request_throughput"]),
        row("Input token throughput (tok/s):", m["input_throughput"]),
        row("Output token throughput (tok/s):", m["output_throughput"]),
        row("Total token throughput (tok/s):", m["total_throughput"]),
        row("Concurrency:", m["concurrency"]),
    ]
    for title, key, extra in (("End-to-End Latency", "e2e_latency", ("p90", "p99")),
                              ("Time to First Token", "ttft", ("p90", "p99")),
                              ("Time per Output Token (excl. 1st token)", "tpot", ("p90", "p99")),
                              ("Inter-Token Latency", "itl", ("p95", "p99"))):
        short = {"e2e_latency": "E2E Latency", "ttft": "TTFT", "tpot": "TPOT", "itl": "ITL"}[key]
        lines.append("{s:{c}^60}".format(s=title, c="-"))
        lines.append(row(f"Mean {short} (ms):", m[f"mean_{key}_ms"]))
        lines.append(row(f"Median {short} (ms):", m[f"median_{key}_ms"]))
        for q in extra:
            lines.append(row(f"P{q[1:]} {short} (ms):", m[f"{q}_{key}_ms"]))
        if key == "itl":
            lines.append(row("Max ITL (ms):", m["max_itl_ms"]))
    lines.append("=" * 60)
    if m.get("errors"):
        lines.append("errors (first few): " + "; ".join(m["errors"][:3]))
    return "\n".join(lines)


def add_serving_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``bench serving``, with ``sglang.bench_serving``'s names."""
    d = ServingBenchConfig()
    g = p.add_argument_group("target")
    g.add_argument("--backend", default=d.backend, choices=BACKENDS,
                   help="minisgl/sglang: native /generate; openai: /v1/completions; openai-chat: /v1/chat/completions")
    g.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:30000 (overrides --host/--port)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=30000)
    g.add_argument("--model", default=None, help="model name for the OpenAI backends (default: the server's)")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--tokenizer", default=None, help="openai-chat: model folder whose tokenizer decodes prompts")
    w = p.add_argument_group("workload")
    w.add_argument("--dataset-name", default=d.dataset_name, choices=DATASETS)
    w.add_argument("--num-prompts", type=int, default=d.num_prompts, help="random dataset: how many requests")
    w.add_argument("--random-input-len", type=int, default=d.random_input_len)
    w.add_argument("--random-output-len", type=int, default=d.random_output_len)
    w.add_argument("--random-range-ratio", type=float, default=d.random_range_ratio,
                   help="lengths are drawn in [ratio * len, len]; 1.0 makes them fixed")
    w.add_argument("--gsp-num-groups", type=int, default=d.gsp_num_groups)
    w.add_argument("--gsp-prompts-per-group", type=int, default=d.gsp_prompts_per_group)
    w.add_argument("--gsp-system-prompt-len", type=int, default=d.gsp_system_prompt_len)
    w.add_argument("--gsp-question-len", type=int, default=d.gsp_question_len)
    w.add_argument("--gsp-output-len", type=int, default=d.gsp_output_len)
    w.add_argument("--temperature", type=float, default=d.temperature)
    w.add_argument("--disable-ignore-eos", action="store_true", help="let requests stop at EOS")
    w.add_argument("--seed", type=int, default=d.seed)
    t = p.add_argument_group("traffic")
    t.add_argument("--request-rate", type=float, default=d.request_rate,
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    t.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    t.add_argument("--warmup-requests", type=int, default=d.warmup_requests)
    t.add_argument("--disable-tqdm", action="store_true", help="accepted for SGLang's scripts: there is no "
                   "progress bar to turn off")
    t.add_argument("--output-file", default=None, help="write the results and their provenance to this JSON file")


def config_from_args(args: argparse.Namespace) -> ServingBenchConfig:
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    cfg = ServingBenchConfig(
        backend=args.backend, base_url=base_url.rstrip("/"), model=args.model, api_key=args.api_key,
        dataset_name=args.dataset_name, num_prompts=args.num_prompts, random_input_len=args.random_input_len,
        random_output_len=args.random_output_len, random_range_ratio=args.random_range_ratio,
        gsp_num_groups=args.gsp_num_groups, gsp_prompts_per_group=args.gsp_prompts_per_group,
        gsp_system_prompt_len=args.gsp_system_prompt_len, gsp_question_len=args.gsp_question_len,
        gsp_output_len=args.gsp_output_len, request_rate=args.request_rate, max_concurrency=args.max_concurrency,
        temperature=args.temperature, ignore_eos=not args.disable_ignore_eos, tokenizer=args.tokenizer,
        seed=args.seed, warmup_requests=args.warmup_requests,
    )
    cfg.validate()
    return cfg


def write_results(result: dict[str, Any], path: str | Path, argv: list[str] | None = None) -> None:
    """Save the results next to their provenance (machine, software, command) as JSON."""
    from minisgl_ref.bench.provenance import collect_provenance  # imports torch: only when saving

    # The load average says how busy the client's machine was (on a shared machine, a lot: read it with the
    # latencies). It is the machine of the server too when the server runs locally.
    load = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    doc = {**result, "provenance": collect_provenance(argv, benchmark="serving", load_average_1_5_15_min=load)}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    try:
        result = run_benchmark(cfg)
    except aiohttp.ClientConnectionError as e:
        raise ConnectionError(f"cannot reach {cfg.base_url}: {e}") from e
    print(format_report(result))
    if args.output_file:
        write_results(result, args.output_file)
        print(f"results written to {args.output_file}", file=sys.stderr)
    return 0 if result["completed"] == len(result["requests"]["success"]) else 1
