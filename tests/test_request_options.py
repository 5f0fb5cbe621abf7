"""Per-request options that change what the engine does: ``cache_salt`` (chapter 04) and ``stop_regex``
(chapter 02), end to end through the paged engine."""

from __future__ import annotations

import random

import pytest

from minisgl_ref import LLM, SamplingParams
from tests.engine_fixtures import (
    assert_pool_accounting,
    drive,
    make_engine,
    make_reqs,
    oracle,
    tiny_engine_path,  # noqa: F401 - fixture
    tiny_llm,  # noqa: F401 - fixture
)


@pytest.mark.parametrize("page_size", [1, 4])
def test_requests_with_different_salts_never_share_a_prefix(tiny_llm, page_size):
    """Same prompt, four salts: a request reuses cached KV only from an earlier request with its own salt (as
    SGLang's ``cache_salt``), and every output is still the oracle's."""
    rng = random.Random(2)
    prompt = [rng.randrange(3, 320) for _ in range(37)]
    params = SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True)
    engine = make_engine(tiny_llm, page_size=page_size)
    expected = oracle(tiny_llm, [prompt], params)[0].ids
    cached = {}
    for name, salt in (("a", "tenant-a"), ("b", "tenant-b"), ("a again", "tenant-a"), ("none", None),
                       ("none again", None)):
        req = make_reqs(tiny_llm, [prompt], params)[0]
        req.cache_salt = salt
        drive(engine, [req])
        assert req.output_ids == expected, name
        cached[name] = req.cached_tokens
    full = (len(prompt) - 1) // page_size * page_size
    assert cached == {"a": 0, "b": 0, "a again": full, "none": 0, "none again": full}
    assert set(engine.cache.tree.salted_roots) == {"tenant-a", "tenant-b"}
    assert_pool_accounting(engine)
    # Eviction drops a salt's root once its last prefix goes; a flush drops them all.
    engine.cache.evict(engine.max_total_tokens)
    assert engine.cache.tree.salted_roots == {} and engine.cache.tree.total_size == 0
    assert_pool_accounting(engine)


@pytest.fixture(scope="module")
def smol() -> LLM:
    return LLM(device="cpu")


def test_a_stop_regex_that_backtracks_forever_fails_its_own_request_only(smol):
    r"""``((.|\s)*\s)*\d`` takes exponential time to fail on text without a digit: the search's time limit ends
    that request with an error naming stop_regex, at once, while the request beside it in the same batch is
    untouched."""
    import time

    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    prompts = ["Once upon a time", "The capital of France is"]
    alone = smol.generate(prompts[1], params, use_tqdm=False)[0]
    t0 = time.perf_counter()
    bad, good = smol.generate(prompts, [{**params, "stop_regex": r"((.|\s)*\s)*\d"}, params], use_tqdm=False)
    assert bad.finish_reason == "abort" and good.output_ids == alone.output_ids, (bad, good)
    assert time.perf_counter() - t0 < 60


def test_stop_regex_through_the_engine(smol):
    prompt = "Count from 1 to 20, separated by commas:"
    params = dict(temperature=0, max_new_tokens=60)
    free = smol.generate(prompt, params, use_tqdm=False)[0]
    import re

    m = re.search(r"1[0-9]", free.text)
    assert m is not None, free.text  # the model counts past 9
    out = smol.generate(prompt, {**params, "stop_regex": r"1[0-9]"}, use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.matched_stop == r"1[0-9]"
    assert out.text == free.text[: m.end()]
    assert out.output_ids == free.output_ids[: len(out.output_ids)]
