"""``ServerMetrics`` on its own (chapter 10): SGLang's metric names, the throughput gauges computed between two
scrapes, and the rule that every request is counted exactly once however it ends. No server, no model."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from minisgl_ref.server.metrics import ServerMetrics

MODEL = "SmolLM2-135M-Instruct"

GAUGES = ("num_running_reqs", "num_queue_reqs", "num_waiting_reqs", "token_usage", "cache_hit_rate",
          "gen_throughput", "decode_throughput", "prefill_throughput", "num_used_tokens", "max_total_num_tokens")
HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds", "time_per_output_token_seconds",
              "e2e_request_latency_seconds")
COUNTERS = ("prompt_tokens_total", "generation_tokens_total", "cached_tokens_total", "num_requests_total",
            "num_aborted_requests_total")


def scrape(m: ServerMetrics) -> dict[str, float]:
    """Every sample but the buckets, by name; and check that each carries exactly the ``model_name`` label."""
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            if not s.name.endswith("_bucket"):
                assert s.labels == {"model_name": MODEL}, s
                out[s.name] = s.value
    return out


def stats(prefill: int = 0, decode: int = 0, **kw) -> dict:
    base = {"num_running_reqs": 2, "num_queue_reqs": 3, "max_total_num_tokens": 1000, "available_kv_tokens": 750,
            "token_usage": 0.25, "cache_hit_rate": 0.5, "prefill_tokens": prefill, "decode_tokens": decode,
            "engine_steps": 0}
    return {**base, **kw}


def test_sglang_names_and_label():
    values = scrape(ServerMetrics(MODEL))
    names = ([f"sglang:{g}" for g in GAUGES] + [f"sglang:{c}" for c in COUNTERS]
             + [f"sglang:{h}_{part}" for h in HISTOGRAMS for part in ("count", "sum")])
    missing = [n for n in names if n not in values]
    assert not missing
    assert not [n for n in values if not n.startswith("sglang:")]


def test_scheduler_gauges_and_throughputs():
    m = ServerMetrics(MODEL)
    m.set_scheduler_stats(stats(prefill=500, decode=40), now=100.0)
    v = scrape(m)
    assert v["sglang:num_running_reqs"] == 2
    assert v["sglang:num_queue_reqs"] == v["sglang:num_waiting_reqs"] == 3
    assert v["sglang:num_used_tokens"] == 250 and v["sglang:max_total_num_tokens"] == 1000
    assert v["sglang:token_usage"] == 0.25 and v["sglang:cache_hit_rate"] == 0.5
    # First scrape: no interval yet, so no rate.
    assert v["sglang:prefill_throughput"] == v["sglang:gen_throughput"] == v["sglang:decode_throughput"] == 0

    m.set_scheduler_stats(stats(prefill=1500, decode=240), now=102.0)  # 1000 and 200 tokens in 2 s
    v = scrape(m)
    assert v["sglang:prefill_throughput"] == pytest.approx(500.0)
    assert v["sglang:gen_throughput"] == v["sglang:decode_throughput"] == pytest.approx(100.0)

    m.set_scheduler_stats(stats(prefill=1500, decode=240), now=102.0)  # same instant: rates kept
    assert scrape(m)["sglang:gen_throughput"] == pytest.approx(100.0)

    m.set_scheduler_stats(stats(prefill=1500, decode=290, available_kv_tokens=1000), now=112.0)  # idle prefill
    v = scrape(m)
    assert v["sglang:prefill_throughput"] == 0.0
    assert v["sglang:gen_throughput"] == pytest.approx(5.0)  # 50 tokens over the 10 s since the last scrape
    assert v["sglang:num_used_tokens"] == 0


def test_every_request_counts_once_however_it_ends():
    m = ServerMetrics(MODEL)
    t = 1000.0

    # Finished normally: 10 prompt tokens (4 cached), 3 output tokens at 0.5 s, 0.7 s, 1.0 s.
    done = m.start(10, created=t)
    m.on_output(done, 1, 4, now=t + 0.5)
    m.on_output(done, 1, 4, now=t + 0.7)
    m.on_output(done, 1, 4, now=t + 1.0)
    assert m.end(done, aborted=False, now=t + 1.0)

    # The client left after two tokens: the API server's cleanup ends it as aborted.
    left = m.start(20, created=t)
    m.on_output(left, 1, 0, now=t + 0.2)
    m.on_output(left, 1, 0, now=t + 0.6)
    assert m.end(left, aborted=True, now=t + 2.0)

    # Aborted by the server before any output (the final row carries no token).
    refused = m.start(5, created=t)
    m.on_output(refused, 0, 0, now=t + 0.1)
    assert m.end(refused, aborted=True, now=t + 0.1)

    # A request's end is seen twice (it finished, then its handler's cleanup ran): counted once, as it finished.
    twice = m.start(7, created=t)
    m.on_output(twice, 2, 0, now=t + 0.3)
    assert m.end(twice, aborted=False, now=t + 0.3)
    assert not m.end(twice, aborted=True, now=t + 5.0)
    m.on_output(twice, 1, 0, now=t + 6.0)  # a late row after the end changes nothing

    v = scrape(m)
    assert v["sglang:num_requests_total"] == 4
    assert v["sglang:num_aborted_requests_total"] == 2
    assert v["sglang:prompt_tokens_total"] == 10 + 20 + 5 + 7
    assert v["sglang:generation_tokens_total"] == 3 + 2 + 0 + 2
    assert v["sglang:cached_tokens_total"] == 4
    assert v["sglang:e2e_request_latency_seconds_count"] == 4
    assert v["sglang:e2e_request_latency_seconds_sum"] == pytest.approx(1.0 + 2.0 + 0.1 + 0.3)
    # TTFT: once per request that got a token (not `refused`).
    assert v["sglang:time_to_first_token_seconds_count"] == 3
    assert v["sglang:time_to_first_token_seconds_sum"] == pytest.approx(0.5 + 0.2 + 0.3)
    # ITL: one observation per token after the first output: 2 (done) + 1 (left).
    assert v["sglang:inter_token_latency_seconds_count"] == 3
    assert v["sglang:inter_token_latency_seconds_sum"] == pytest.approx(0.2 + 0.3 + 0.4)
    # TPOT: per request with two tokens or more, (last token - first token) / (tokens - 1); for `twice` both
    # tokens came together.
    assert v["sglang:time_per_output_token_seconds_count"] == 3
    assert v["sglang:time_per_output_token_seconds_sum"] == pytest.approx(0.25 + 0.4 + 0.0)


def test_two_servers_do_not_share_a_registry():
    a, b = ServerMetrics(MODEL), ServerMetrics(MODEL)
    a.end(a.start(3, created=0.0), aborted=False, now=1.0)
    assert scrape(a)["sglang:num_requests_total"] == 1
    assert scrape(b)["sglang:num_requests_total"] == 0
