"""Prometheus metrics, named after SGLang's (``sglang:...`` there, ``minisgl:...`` here) (chapter 10).

Everything a client experiences is measured where the client experiences it: in the API server, as outputs
stream past (time to first token, inter-token latency, end-to-end latency, token counts). What only the
scheduler knows (running and queued requests, KV usage, cache hit rate) is fetched from it when ``/metrics`` is
scraped. A private ``CollectorRegistry`` keeps these apart from anything else in the process.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name}
        names = list(self.labels)
        r = self.registry

        def counter(name: str, doc: str) -> Any:
            return Counter(f"minisgl:{name}", doc, names, registry=r).labels(**self.labels)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(f"minisgl:{name}", doc, names, registry=r).labels(**self.labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(f"minisgl:{name}", doc, names, buckets=buckets, registry=r).labels(**self.labels)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests.")
        self.cached_tokens = counter("cached_tokens", "Prompt tokens served from the prefix cache.")
        self.num_requests = counter("num_requests", "Finished requests (any finish reason).")
        self.num_aborted_requests = counter("num_aborted_requests", "Requests aborted (by the client or server).")
        self.num_running_reqs = gauge("num_running_reqs", "Requests in the running batch.")
        self.num_queue_reqs = gauge("num_queue_reqs", "Requests waiting to be scheduled.")
        self.token_usage = gauge("token_usage", "Fraction of the KV pool in use by requests.")
        self.cache_hit_rate = gauge("cache_hit_rate", "Fraction of looked-up prompt tokens found in the cache.")
        self.max_total_num_tokens = gauge("max_total_num_tokens", "KV pool size in tokens.")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS)

    def set_scheduler_stats(self, stats: dict[str, Any]) -> None:
        self.num_running_reqs.set(stats["num_running_reqs"])
        self.num_queue_reqs.set(stats["num_queue_reqs"])
        self.token_usage.set(stats["token_usage"])
        self.cache_hit_rate.set(stats["cache_hit_rate"])
        self.max_total_num_tokens.set(stats["max_total_num_tokens"])

    def on_finish(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int, e2e: float,
                  aborted: bool) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.num_requests.inc()
        if aborted:
            self.num_aborted_requests.inc()
        self.e2e.observe(e2e)

    def render(self) -> bytes:
        return generate_latest(self.registry)
