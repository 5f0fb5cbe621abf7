"""Prometheus metrics under SGLang's names, so that a dashboard built for SGLang's ``/metrics`` works unchanged
(chapter 10).

Everything a client experiences is measured where the client experiences it: in the API server, as outputs
stream past (time to first token, inter-token latency, end-to-end latency, token counts). What only the
scheduler knows (running and queued requests, KV usage, cache hit rate, tokens computed) is fetched from it when
``/metrics`` is scraped. A private ``CollectorRegistry`` keeps these apart from anything else in the process.
Every series carries one label, ``model_name`` (the served model name), as SGLang's do.

The metrics (``prometheus_client`` appends ``_total`` to a counter's name, and ``_bucket`` / ``_sum`` /
``_count`` to a histogram's):

Gauges, set from the scheduler's statistics at each scrape:

- ``sglang:num_running_reqs``: requests in the running batch (a half-prefilled chunked request included).
- ``sglang:num_queue_reqs``: requests waiting to be scheduled.
- ``sglang:num_waiting_reqs``: the same value as ``num_queue_reqs``, under the other name dashboards use.
- ``sglang:token_usage``: fraction of the KV pool held by requests (``num_used_tokens / max_total_num_tokens``).
- ``sglang:num_used_tokens``: KV slots held by requests: ``max_total_num_tokens - available_kv_tokens``
  (slots that only the prefix cache holds count as available, since eviction can free them).
- ``sglang:max_total_num_tokens``: size of the KV pool, in tokens.
- ``sglang:cache_hit_rate``: fraction of looked-up prompt tokens found in the prefix cache (0 without one).
- ``sglang:gen_throughput``: tokens decoded per second between the last two scrapes (one per decode row of a
  step; a request's first token comes out of its prefill step and is not in it).
- ``sglang:decode_throughput``: the same value as ``gen_throughput``.
- ``sglang:prefill_throughput``: prompt tokens prefilled (KV computed, cache hits excluded) per second between
  the last two scrapes.
- ``sglang:spec_accept_length``: with speculative decoding (chapter 13), the tokens each verify row appended
  (its accepted drafts and one bonus token), averaged over the rows verified between the last two scrapes (it
  keeps its value through an interval without any; 0 until the first).

Counters, advanced once per request when it ends (see the counting rule below):

- ``sglang:num_requests_total``: requests that ended, however they ended.
- ``sglang:num_aborted_requests_total``: the subset of those that were aborted (by the server, or because
  their client went away).
- ``sglang:prompt_tokens_total``: prompt tokens of those requests.
- ``sglang:generation_tokens_total``: output tokens those requests produced (for an aborted one, the tokens
  that had reached the API server when it was aborted).
- ``sglang:cached_tokens_total``: prompt tokens of those requests that the prefix cache served.

Histograms, in seconds:

- ``sglang:time_to_first_token_seconds``: arrival to first output token, once per request that got one.
- ``sglang:inter_token_latency_seconds``: gap between consecutive output tokens, once per token that arrives
  after the first output (tokens that arrive together share the gap since the previous output evenly).
- ``sglang:time_per_output_token_seconds``: per request with at least two output tokens, the mean decode pace
  ``(e2e - ttft) / (completion_tokens - 1)``, with ``e2e`` taken at its last token.
- ``sglang:e2e_request_latency_seconds``: arrival to end (last output, or the abort), once per request.

The gauges ``gen_throughput``, ``decode_throughput`` and ``prefill_throughput`` are rates over the interval
between two scrapes: the scheduler reports cumulative token counts, and each scrape divides their change since
the previous scrape by the wall time between the two (the first scrape reports 0). With several scrapers, each
scrape closes the interval of whichever came before it.

**Counting rule.** A request counts from the moment it was handed to the scheduler (it passed validation: a
request refused with a 4xx, or one the server could not even enqueue, counts nowhere). Each such request is
counted exactly once when it ends, whether it finished, was aborted by the server, or was abandoned by its
client: once in ``num_requests_total``, once in ``e2e_request_latency_seconds``, with its prompt, generated and
cached tokens in the three token counters, and in ``time_per_output_token_seconds`` if it produced two tokens
or more. An aborted one is also counted once in ``num_aborted_requests_total``. ``time_to_first_token_seconds``
and ``inter_token_latency_seconds`` are observed as tokens arrive, so a request aborted before its first token
is in ``num_requests_total`` but not in the TTFT histogram. Internal requests (the ``/health_generate`` probe)
count nowhere.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "sglang:"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


@dataclass
class RequestTrack:
    """What the metrics need to know about one request while it runs (times from ``time.perf_counter``)."""

    created: float
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    ended: bool = False


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name}
        names = list(self.labels)
        r = self.registry

        def counter(name: str, doc: str) -> Any:
            return Counter(PREFIX + name, doc, names, registry=r).labels(**self.labels)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(PREFIX + name, doc, names, registry=r).labels(**self.labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(PREFIX + name, doc, names, buckets=buckets, registry=r).labels(**self.labels)

        # Counters: "_total" is added by prometheus_client.
        self.num_requests = counter("num_requests", "Requests that ended (finished or aborted).")
        self.num_aborted_requests = counter("num_aborted_requests",
                                            "Requests aborted, by the server or because the client left.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of ended requests.")
        self.generation_tokens = counter("generation_tokens", "Output tokens produced by ended requests.")
        self.cached_tokens = counter("cached_tokens", "Prompt tokens of ended requests served from the cache.")
        # Gauges, from the scheduler at each scrape.
        self.num_running_reqs = gauge("num_running_reqs", "Requests in the running batch.")
        self.num_queue_reqs = gauge("num_queue_reqs", "Requests waiting to be scheduled.")
        self.num_waiting_reqs = gauge("num_waiting_reqs", "Requests waiting to be scheduled (= num_queue_reqs).")
        self.token_usage = gauge("token_usage", "Fraction of the KV pool held by requests.")
        self.num_used_tokens = gauge("num_used_tokens", "KV slots held by requests.")
        self.max_total_num_tokens = gauge("max_total_num_tokens", "KV pool size in tokens.")
        self.cache_hit_rate = gauge("cache_hit_rate", "Fraction of looked-up prompt tokens found in the cache.")
        self.gen_throughput = gauge("gen_throughput", "Decoded tokens per second since the previous scrape.")
        self.decode_throughput = gauge("decode_throughput",
                                       "Decoded tokens per second since the previous scrape (= gen_throughput).")
        self.prefill_throughput = gauge("prefill_throughput",
                                        "Prefilled prompt tokens per second since the previous scrape.")
        # Histograms.
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens in seconds.",
                             ITL_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Per request, (e2e - ttft) / (completion_tokens - 1) in seconds.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency in seconds.",
                             E2E_BUCKETS)
        self.spec_accept_length = gauge("spec_accept_length",
                                        "Tokens appended per verify row of speculative decoding, recently.")
        # The previous scrape's cumulative counters, for the throughput gauges: (time, prefill, decode).
        self._last_counts: tuple[float, int, int] | None = None
        self._last_spec = (0, 0)  # and for the accept length: (verify rows, tokens they appended)

    # ----------------------------------------------------------------------------------- scheduler gauges

    def set_scheduler_stats(self, stats: dict[str, Any], now: float | None = None) -> None:
        """Set the gauges from the scheduler's ``get_stats`` answer; ``now`` (``time.monotonic()`` by default)
        is when it was taken, for the throughputs."""
        now = time.monotonic() if now is None else now
        total = stats["max_total_num_tokens"]
        self.num_running_reqs.set(stats["num_running_reqs"])
        self.num_queue_reqs.set(stats["num_queue_reqs"])
        self.num_waiting_reqs.set(stats["num_queue_reqs"])
        self.token_usage.set(stats["token_usage"])
        self.num_used_tokens.set(total - stats["available_kv_tokens"])
        self.max_total_num_tokens.set(total)
        self.cache_hit_rate.set(stats["cache_hit_rate"])
        verified, appended = stats.get("spec_verify_ct", 0), stats.get("spec_appended_tokens", 0)
        if verified > self._last_spec[0]:
            self.spec_accept_length.set((appended - self._last_spec[1]) / (verified - self._last_spec[0]))
        self._last_spec = (verified, appended)

        prefill, decode = stats["prefill_tokens"], stats["decode_tokens"]
        if self._last_counts is None:
            prefill_rate = decode_rate = 0.0
        else:
            t0, prefill0, decode0 = self._last_counts
            dt = now - t0
            if dt <= 0:
                return  # two scrapes at the same instant: keep the rates of the last real interval
            prefill_rate = max(prefill - prefill0, 0) / dt
            decode_rate = max(decode - decode0, 0) / dt
        self._last_counts = (now, prefill, decode)
        self.prefill_throughput.set(prefill_rate)
        self.gen_throughput.set(decode_rate)
        self.decode_throughput.set(decode_rate)

    # ------------------------------------------------------------------------------------------- requests

    def start(self, prompt_tokens: int, created: float | None = None) -> RequestTrack:
        """A request was handed to the scheduler: from now on it will be counted, exactly once, by :meth:`end`."""
        return RequestTrack(time.perf_counter() if created is None else created, prompt_tokens)

    def on_output(self, track: RequestTrack, new_tokens: int, cached_tokens: int, now: float | None = None) -> None:
        """Output rows arrived for ``track``: ``new_tokens`` more tokens (possibly 0), and the scheduler's count of
        its cached prompt tokens."""
        if track.ended:
            return
        now = time.perf_counter() if now is None else now
        track.cached_tokens = cached_tokens
        if new_tokens <= 0:
            return
        if track.first_token_time is None:
            track.first_token_time = now
            self.ttft.observe(now - track.created)
        else:
            gap = (now - track.last_token_time) / new_tokens  # type: ignore[operator]
            for _ in range(new_tokens):
                self.itl.observe(gap)
        track.completion_tokens += new_tokens
        track.last_token_time = now

    def end(self, track: RequestTrack, aborted: bool, now: float | None = None) -> bool:
        """The request ended (finished, aborted by the server, or left by its client). Counts it unless it was
        already counted; returns whether it counted it now."""
        if track.ended:
            return False
        track.ended = True
        now = time.perf_counter() if now is None else now
        self.num_requests.inc()
        if aborted:
            self.num_aborted_requests.inc()
        self.prompt_tokens.inc(track.prompt_tokens)
        self.generation_tokens.inc(track.completion_tokens)
        self.cached_tokens.inc(track.cached_tokens)
        self.e2e.observe(now - track.created)
        if track.completion_tokens >= 2:
            assert track.first_token_time is not None and track.last_token_time is not None
            self.tpot.observe((track.last_token_time - track.first_token_time) / (track.completion_tokens - 1))
        return True

    def render(self) -> bytes:
        return generate_latest(self.registry)
