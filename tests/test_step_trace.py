"""The per-step trace (``--step-log``): one line per processed step that agrees with the engine's own counters,
and the decode-to-decode gaps a request sees, with the prompt tokens computed in between."""

from __future__ import annotations

import json

import pytest

from minisgl_ref.bench import offline
from minisgl_ref.bench.workloads import canonical_workload
from minisgl_ref.bench.step_trace import StepTrace, summarize, token_gaps


def _line(t: float, gap: float, decode: int, prefill: int) -> dict:
    return {"t": t, "gap_ms": gap, "rows": decode + (1 if prefill else 0), "decode_rows": decode,
            "prefill_tokens": prefill}


def test_a_prefill_only_step_is_charged_to_the_next_decode_gap():
    lines = [_line(0, 0.0, 0, 500),  # first step of a busy period: nothing to measure from
             _line(1, 3.0, 4, 0),  # the first decode step: its gap includes waiting for the prefill
             _line(2, 3.0, 4, 0),
             _line(3, 20.0, 0, 900),  # a prefill-only step: no token for the decoding requests...
             _line(4, 3.0, 5, 0),  # ...so they see 23 ms here, with 900 prompt tokens in it
             _line(5, 6.0, 5, 300),  # a mixed step
             _line(9, 0.0, 0, 100),  # idle in between: a new busy period
             _line(10, 4.0, 1, 0)]
    assert token_gaps(lines) == [(3.0, 0), (23.0, 900), (6.0, 300)]
    s = summarize(lines)
    assert s["gaps"] == 3 and s["gaps_with_prefill"] == 2
    assert s["with_prefill_max_ms"] == 23.0 and s["decode_only_p50_ms"] == 3.0
    assert summarize(lines, since=3.5)["gaps"] == 1  # only the steps inside the window


def test_the_trace_of_a_run_matches_the_engine_counters(tmp_path):
    wl = canonical_workload(num_prompts=6, input_len=(20, 60), output_len=(4, 12))
    model = offline.quick_model("cpu")
    llm = offline.build_llm(model, "paged", dict(offline.QUICK_BUDGETS, max_prefill_tokens=128,
                                                 chunked_prefill_size=64))
    steps0, decode0 = llm.engine.stats.steps, llm.engine.stats.decode_tokens
    path = tmp_path / "steps.jsonl"
    _, _, counters = offline.time_generate(llm, wl, step_log=str(path))
    assert llm.engine.extensions.find(StepTrace) is None  # detached after the timed run
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == llm.engine.stats.steps - steps0
    assert sum(x["prefill_tokens"] for x in lines) == counters.prefill_tokens == wl.input_tokens
    assert sum(x["decode_rows"] for x in lines) == llm.engine.stats.decode_tokens - decode0
    assert lines[0]["gap_ms"] == 0 and all(x["gap_ms"] > 0 for x in lines[1:])
    prefill = [x["prefill_tokens"] for x in lines if x["prefill_tokens"]]
    assert max(prefill) <= 128 and len(prefill) >= -(-wl.input_tokens // 128)  # the step budget held


def test_step_log_with_a_ladder_of_stages_is_refused():
    import argparse

    with pytest.raises(ValueError, match="--step-log"):
        offline.main(argparse.Namespace(step_log="steps.jsonl", stage=["paged", "radix"]), {})
