"""``bench serving`` (chapter 10): the metric math on synthetic timings, the arrival schedule, the stream readers,
and one real run against ``python -m minisgl_ref serve`` on the embedded model."""

from __future__ import annotations

import json
import math
import random
import statistics

import numpy as np
import pytest

from minisgl_ref.bench.serving import (
    RequestOutput,
    ServingBenchConfig,
    _StreamReader,
    arrival_times,
    build_workload,
    compute_metrics,
    format_report,
    percentile,
)

# ------------------------------------------------------------------------------------------- metric math


def _req(prompt: int, output: int, ttft: float, itl: list[float], ok: bool = True) -> RequestOutput:
    """A request whose first token came at ``ttft`` and whose later chunks came ``itl`` apart."""
    return RequestOutput(success=ok, prompt_len=prompt, output_len=output, ttft=ttft, itl=list(itl),
                         latency=ttft + sum(itl), error="" if ok else "boom")


@pytest.mark.task("10.1")
def test_percentile_interpolates_between_the_sorted_values():
    """NumPy's default percentile: sort, then interpolate linearly at position q/100 * (n - 1). The values come
    unsorted, as requests finish in any order."""
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([30.0, 10.0, 20.0], 0) == 10.0 and percentile([30.0, 10.0, 20.0], 100) == 30.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([400.0, 100.0, 200.0], 90) == pytest.approx(200 + 0.8 * 200)  # position 1.8
    assert percentile([5.0, 1.0, 9.0, 3.0, 7.0], 25) == pytest.approx(3.0)  # position 1.0 exactly
    rng = random.Random(0)
    for n in (2, 3, 10, 101):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        for q in (1, 10, 50, 90, 95, 99):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12), (n, q)
    with pytest.raises(ValueError):
        percentile([], 50)


@pytest.mark.task("10.1")
def test_metrics_on_synthetic_timings():
    outs = [
        _req(100, 5, 0.2, [0.1, 0.1, 0.1, 0.1]),  # latency 0.6, tpot (0.6 - 0.2) / 4 = 0.1
        _req(50, 3, 0.4, [0.3, 0.5]),  # latency 1.2, tpot 0.8 / 2 = 0.4
        _req(10, 1, 0.1, []),  # one token: no TPOT, no ITL
        _req(999, 7, 9.0, [9.0], ok=False),  # a failure counts only as failed
    ]
    m = compute_metrics(outs, duration=2.0)
    assert m["completed"] == 3 and m["failed"] == 1 and m["duration"] == 2.0
    assert m["total_input_tokens"] == 160 and m["total_output_tokens"] == 9
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["input_throughput"] == pytest.approx(80.0)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_throughput"] == pytest.approx(84.5)
    assert m["concurrency"] == pytest.approx((0.6 + 1.2 + 0.1) / 2.0)

    assert m["mean_ttft_ms"] == pytest.approx(700 / 3)
    assert m["median_ttft_ms"] == pytest.approx(200)
    assert m["std_ttft_ms"] == pytest.approx(statistics.pstdev([200, 400, 100]))
    assert m["p99_ttft_ms"] == pytest.approx(200 + 0.98 * 200)  # linear interpolation between 200 and 400

    assert m["mean_tpot_ms"] == pytest.approx(250)
    assert m["median_tpot_ms"] == pytest.approx(250)

    itls = [100, 100, 100, 100, 300, 500]  # pooled over requests
    assert m["mean_itl_ms"] == pytest.approx(sum(itls) / 6)
    assert m["median_itl_ms"] == pytest.approx(100)
    assert m["max_itl_ms"] == pytest.approx(500)
    assert m["p95_itl_ms"] == pytest.approx(300 + 0.75 * 200)  # rank 0.95 * 5 = 4.75

    assert m["mean_e2e_latency_ms"] == pytest.approx(1900 / 3)
    assert m["median_e2e_latency_ms"] == pytest.approx(600)
    assert m["p99_e2e_latency_ms"] == pytest.approx(600 + 0.98 * 600)


@pytest.mark.task("10.1")
def test_metrics_when_everything_failed_or_nothing_streamed():
    m = compute_metrics([_req(10, 0, 0.0, [], ok=False)], duration=1.0)
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["output_throughput"] == 0 and m["mean_ttft_ms"] == 0 and m["max_itl_ms"] == 0
    with pytest.raises(ValueError, match="duration"):
        compute_metrics([], duration=0.0)


def test_report_names_every_metric():
    m = compute_metrics([_req(10, 4, 0.1, [0.05, 0.05, 0.05])], duration=1.0)
    text = format_report({**m, "backend": "minisgl", "request_rate": "inf", "max_concurrency": None, "errors": []})
    for label in ("Successful requests:", "Output token throughput (tok/s):", "Mean TTFT (ms):", "P99 ITL (ms):",
                  "Median TPOT (ms):", "Mean E2E Latency (ms):"):
        assert label in text


# ---------------------------------------------------------------------------------------- arrivals, config


def test_poisson_arrivals_are_seeded_and_have_the_right_rate():
    a = arrival_times(4000, request_rate=8.0, seed=3)
    assert a == arrival_times(4000, request_rate=8.0, seed=3)
    assert a != arrival_times(4000, request_rate=8.0, seed=4)
    gaps = [y - x for x, y in zip([0.0, *a], a)]
    assert all(g > 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / 8, rel=0.05)  # 4000 draws: within 5% (~3 sigma)
    # exponential gaps: the standard deviation equals the mean
    assert statistics.pstdev(gaps) == pytest.approx(1 / 8, rel=0.08)
    assert arrival_times(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="request_rate"):
        arrival_times(3, 0.0, seed=0)


def test_workloads_and_validation():
    cfg = ServingBenchConfig(num_prompts=6, random_input_len=20, random_output_len=8, random_range_ratio=0.5)
    wl = build_workload(cfg)
    assert wl.name == "random" and wl.num_requests == 6
    assert all(10 <= len(p) <= 20 for p in wl.prompts)
    assert all(4 <= p["max_new_tokens"] <= 8 and p["ignore_eos"] and p["temperature"] == 0.0
               for p in wl.sampling_params)
    assert build_workload(cfg).prompts == wl.prompts  # seeded

    fixed = build_workload(ServingBenchConfig(num_prompts=3, random_input_len=7, random_output_len=2,
                                              random_range_ratio=1.0))
    assert [len(p) for p in fixed.prompts] == [7, 7, 7]

    gsp = build_workload(ServingBenchConfig(dataset_name="shared-prefix", gsp_num_groups=2,
                                            gsp_prompts_per_group=3, gsp_system_prompt_len=12,
                                            gsp_question_len=4, gsp_output_len=5))
    assert gsp.num_requests == 6 and len({tuple(p[:12]) for p in gsp.prompts}) == 2

    for bad, match in ((dict(backend="vllm"), "backend"), (dict(num_prompts=0), "num_prompts"),
                       (dict(request_rate=-1.0), "request_rate"), (dict(max_concurrency=0), "max_concurrency"),
                       (dict(random_range_ratio=1.5), "random_range_ratio"), (dict(base_url="localhost"),
                                                                              "base_url")):
        with pytest.raises(ValueError, match=match):
            ServingBenchConfig(**bad).validate()


# ------------------------------------------------------------------------------------------- stream readers


@pytest.mark.task("10.1")
def test_native_stream_reader_counts_tokens_not_events():
    r = _StreamReader("minisgl", start=10.0, prompt_len=5)
    meta = {"prompt_tokens": 6, "finish_reason": None}
    r.event({"text": "", "meta_info": {**meta, "completion_tokens": 0}}, 10.1)  # no token yet: not a TTFT
    r.event({"text": "a", "meta_info": {**meta, "completion_tokens": 1}}, 10.5)
    r.event({"text": "ab", "meta_info": {**meta, "completion_tokens": 3}}, 10.7)
    r.event({"text": "abc", "meta_info": {**meta, "completion_tokens": 4, "finish_reason": {"type": "length"}}},
            11.0)
    out = r.finish(11.1)
    assert out.success and out.prompt_len == 6 and out.output_len == 4
    assert out.ttft == pytest.approx(0.5) and out.itl == pytest.approx([0.2, 0.3])
    assert out.latency == pytest.approx(1.1)

    aborted = _StreamReader("sglang", start=0.0, prompt_len=5)
    with pytest.raises(RuntimeError, match="aborted"):
        aborted.event({"text": "", "meta_info": {"completion_tokens": 0,
                                                 "finish_reason": {"type": "abort", "message": "x"}}}, 1.0)


@pytest.mark.task("10.1")
def test_openai_stream_reader_uses_usage_for_counts():
    r = _StreamReader("openai-chat", start=0.0, prompt_len=3)
    r.event({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, 0.1)  # the role chunk: no token
    r.event({"choices": [{"delta": {"content": "Hi"}}]}, 0.3)
    r.event({"choices": [{"delta": {"content": " there"}}]}, 0.4)
    r.event({"choices": [{"delta": {}, "finish_reason": "stop"}]}, 0.45)
    r.event({"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 3}}, 0.5)
    out = r.finish(0.5)
    assert out.ttft == pytest.approx(0.3) and out.itl == pytest.approx([0.1])
    assert out.prompt_len == 30 and out.output_len == 3

    with pytest.raises(RuntimeError, match="overloaded"):
        _StreamReader("openai", 0.0, 1).event({"error": {"message": "overloaded"}}, 0.1)
    empty = _StreamReader("openai", 0.0, 1)
    with pytest.raises(RuntimeError, match="without any token"):
        empty.finish(1.0)


# ----------------------------------------------------------------------------------- against a real server


@pytest.fixture(scope="module")
def server():
    from tests.server_utils import ServerProcess

    srv = ServerProcess("--log-level", "warning", "--max-total-tokens", "4096")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.kill_all()


@pytest.mark.slow
def test_bench_serving_against_the_real_server(server, tmp_path):
    """The CLI end to end, on every backend: 8 Poisson requests of few tokens each, all complete, the token
    counts are the workload's, and the JSON file holds the metrics and the provenance."""
    from minisgl_ref.cli import main

    for backend in ("minisgl", "openai", "openai-chat"):
        out = tmp_path / f"{backend}.json"
        argv = ["bench", "serving", "--backend", backend, "--port", str(server.port), "--num-prompts", "8",
                "--random-input-len", "24", "--random-output-len", "6", "--random-range-ratio", "1.0",
                "--request-rate", "20", "--max-concurrency", "4", "--output-file", str(out)]
        assert main(argv) == 0
        res = json.loads(out.read_text())
        assert res["backend"] == backend and res["completed"] == 8 and res["failed"] == 0, res["errors"]
        assert res["total_output_tokens"] == 8 * 6
        if backend != "openai-chat":  # chat adds its template to the (decoded, re-tokenized) prompt
            assert res["total_input_tokens"] == 8 * 24
        assert res["requests"]["output_lens"] == [6] * 8
        assert all(len(itl) >= 1 for itl in res["requests"]["itls"])
        assert 0 < res["mean_ttft_ms"] <= res["mean_e2e_latency_ms"]
        assert res["output_throughput"] == pytest.approx(48 / res["duration"])
        assert res["provenance"]["command"] and res["provenance"]["hardware"]["cpu"]

    # SGLang's generated-shared-prefix dataset, everything at once, through the sglang (native) backend
    out = tmp_path / "gsp.json"
    argv = ["bench", "serving", "--backend", "sglang", "--port", str(server.port), "--dataset-name",
            "shared-prefix", "--gsp-num-groups", "2", "--gsp-prompts-per-group", "4", "--gsp-system-prompt-len",
            "16", "--gsp-question-len", "8", "--gsp-output-len", "4", "--output-file", str(out)]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    assert res["completed"] == 8 and res["request_rate"] == "inf"
    assert res["total_input_tokens"] == 8 * 24 and res["total_output_tokens"] == 8 * 4


def test_bench_serving_reports_an_unreachable_server(capsys):
    from tests.server_utils import free_port

    from minisgl_ref.cli import main

    code = main(["bench", "serving", "--port", str(free_port()), "--num-prompts", "1"])
    assert code == 2
    assert "warm-up request" in capsys.readouterr().err
