"""Chapter 15's ``bench perplexity``: the perplexity comes from the engine's own prompt log probabilities, and the
greedy answers are compared token by token with the first variant's."""

from __future__ import annotations

import math

from minisgl_ref.bench.perplexity import QUESTIONS, compare_answers, default_text, measure


def test_compare_answers_counts_identical_answers_and_the_shared_prefix():
    assert compare_answers([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]]) == (1, (1 + 1 / 3) / 2)
    assert compare_answers([[7, 2]], [[1, 2]]) == (0, 0.0)


def test_perplexity_of_the_first_variant_is_its_own_baseline():
    """Two variants on a short piece of the text: the baseline's ratio is 1 and its answers are its own; the
    perplexity is exp of the mean negative log probability; an FP8 cache changes it a little."""
    text = default_text()[:600]
    results = measure(["bf16", "fp8_kv"], dtype="bfloat16", device="cpu", text=text, chunked_prefill_size=32,
                      greedy_tokens=6)
    base, kv = results
    assert base.ratio_to_first == 1.0 and base.greedy_identical == len(QUESTIONS) and base.greedy_shared_prefix == 1
    assert math.isclose(base.perplexity, math.exp(base.nll)) and base.tokens > 100
    assert kv.kv_cache_dtype == "fp8_e4m3" and kv.tokens == base.tokens
    assert kv.perplexity != base.perplexity and abs(kv.ratio_to_first - 1) < 0.05
    assert 0 <= kv.greedy_identical <= len(QUESTIONS) and 0.0 <= kv.greedy_shared_prefix <= 1.0
