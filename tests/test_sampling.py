"""Chapter 02, sampling half: sampling parameters, penalties (task 2.2), filtering (task 2.3), seeded draws (2.4).

Everything runs on synthetic logits over small vocabularies, so each expectation can be computed by hand or by
brute force. Statistical tests use fixed seeds: they are deterministic for a given implementation, and their
thresholds (chi-square at p = 0.001) are loose enough for any correct implementation and tight enough to catch a
wrong temperature or a filter that leaks.

Each task's tests call its own function (``apply_penalties``, ``top_k_top_p_min_p_filter``, ``seeded_uniform``) or
drive the sampler with only that stage switched on, so they grade one task at a time. The tests without a task
mark run the sampler with every knob at once.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl_ref.sampling import Sampler, SamplingBatchInfo, SamplingParams
from minisgl_ref.sampling.params import GREEDY_TEMPERATURE_EPS, MAX_TEMPERATURE
from minisgl_ref.sampling.sampler import (
    PENALISED_LOGIT_LIMIT,
    apply_penalties,
    sample_from_probs,
    seeded_uniform,
    top_k_top_p_min_p_filter,
)

# Chi-square critical values at p = 0.001, by degrees of freedom (from the standard table).
CHI2_CRIT_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88}

sampler = Sampler()


# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------


def build(params: list[SamplingParams], vocab: int, prompts=None, outputs=None, eos=None) -> SamplingBatchInfo:
    prompts = prompts if prompts is not None else [[] for _ in params]
    return SamplingBatchInfo.build(params, prompts, outputs, eos, vocab, "cpu")


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's statistic; tokens of probability 0 must never be drawn at all."""
    assert counts[probs == 0].sum() == 0, "sampled a token of probability 0"
    expected = counts.sum() * probs
    nz = probs > 0
    return float(((counts[nz] - expected[nz]) ** 2 / expected[nz]).sum())


def draw_many(logits_row: torch.Tensor, params: SamplingParams, n: int) -> np.ndarray:
    """``n`` independent draws for one distribution: ``n`` rows, seeds 0..n-1. Returns counts per token."""
    vocab = logits_row.shape[-1]
    rows = [SamplingParams(**{**params.to_dict(), "seed": s}) for s in range(n)]
    info = build(rows, vocab)
    tokens = sampler(logits_row.expand(n, vocab).clone(), info)
    return np.bincount(tokens.numpy(), minlength=vocab)


def brute_force_allowed(probs: np.ndarray, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The kept set, computed the slow, obvious way in float64 (no ties in the inputs this is used with)."""
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    k = len(probs) if top_k == -1 else top_k
    candidates = order[:k]
    total = sum(probs[t] for t in candidates)
    nucleus, mass = [], 0.0
    for t in candidates:  # smallest prefix whose renormalised mass reaches top_p
        nucleus.append(t)
        mass += probs[t] / total
        if mass >= top_p:
            break
    top = probs[order[0]]
    return {t for t in nucleus if probs[t] >= min_p * top} | {order[0]}


def softmax64(logits: torch.Tensor, temperature: float = 1.0) -> np.ndarray:
    return torch.softmax(logits.double() / temperature, dim=-1).numpy()


@st.composite
def _rows_and_params(draw: st.DrawFn) -> tuple[list[float], SamplingParams]:
    vocab = draw(st.integers(2, 40))
    logits = draw(st.lists(st.floats(-8, 8, allow_nan=False, width=32), min_size=vocab, max_size=vocab))
    params = SamplingParams(
        temperature=draw(st.floats(0.05, 3.0)),
        top_k=draw(st.one_of(st.just(-1), st.integers(1, vocab + 3))),
        top_p=draw(st.floats(0.01, 1.0)),
        min_p=draw(st.floats(0.0, 1.0)),
        seed=draw(st.integers(0, 2**64 - 1)),
    )
    return logits, params


# ---------------------------------------------------------------------------------------------------------------
# SamplingParams
# ---------------------------------------------------------------------------------------------------------------


def test_params_defaults_match_sglang() -> None:
    p = SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_k, p.top_p, p.min_p) == (128, 1.0, -1, 1.0, 0.0)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.min_new_tokens, p.n, p.seed) == ([], [], False, 0, 1, None)
    assert p.skip_special_tokens is True


def test_params_normalisation() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, np.int64(4))).stop_token_ids == [3, 4]
    assert type(SamplingParams(stop_token_ids=[np.int64(4)]).stop_token_ids[0]) is int
    p = SamplingParams(temperature=1, top_p=1, seed=np.int32(5))
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float) and type(p.seed) is int


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0),
        dict(temperature=50.0),
        dict(top_k=1),
        dict(top_k=100_000),
        dict(top_p=1e-6),
        dict(min_p=0.0),
        dict(min_p=1.0),
        dict(frequency_penalty=-2.0, presence_penalty=2.0),
        dict(repetition_penalty=2.0),
        dict(repetition_penalty=0.01),
        dict(max_new_tokens=0),
        dict(max_new_tokens=5, min_new_tokens=5),
        dict(seed=-1),
        dict(seed=2**70),
        dict(stop=["a", "\n\n"], stop_token_ids=[0, 7]),
    ],
)
def test_params_accept_boundary_values(kwargs: dict) -> None:
    SamplingParams(**kwargs)


INVALID = [
    ("max_new_tokens", -1),
    ("max_new_tokens", None),
    ("max_new_tokens", 1.5),
    ("max_new_tokens", "10"),
    ("max_new_tokens", True),
    ("temperature", -1.0),
    ("temperature", -1e-9),
    ("temperature", "hot"),
    ("temperature", None),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", True),
    ("top_k", 0),
    ("top_k", -2),
    ("top_k", 2.5),
    ("top_k", 5.0),
    ("top_k", "5"),
    ("top_k", False),
    ("top_p", 0.0),
    ("top_p", -0.1),
    ("top_p", 1.0001),
    ("top_p", "0.9"),
    ("top_p", float("nan")),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("min_p", "0"),
    ("frequency_penalty", 2.01),
    ("frequency_penalty", -2.5),
    ("frequency_penalty", "1"),
    ("presence_penalty", 3),
    ("presence_penalty", -2.01),
    ("presence_penalty", None),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", 2.5),
    ("repetition_penalty", "1.1"),
    ("stop", ""),
    ("stop", [""]),
    ("stop", ["ok", 3]),
    ("stop", 5),
    ("stop", {"a": 1}),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["a"]),
    ("stop_token_ids", [1.5]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", "12"),
    ("stop_token_ids", 3),
    ("ignore_eos", 1),
    ("ignore_eos", "yes"),
    ("min_new_tokens", -1),
    ("min_new_tokens", 1.5),
    ("min_new_tokens", 129),  # above the default max_new_tokens = 128
    ("n", 0),
    ("n", -3),
    ("n", True),
    ("n", 2.0),
    ("seed", True),
    ("seed", 1.5),
    ("seed", "42"),
    ("skip_special_tokens", None),
    ("skip_special_tokens", 0),
]


@pytest.mark.parametrize("field,value", INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_params_reject_invalid_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field) as excinfo:
        SamplingParams(**{field: value})
    message = str(excinfo.value)
    if not isinstance(value, (list, dict)):
        assert repr(value) in message or str(value) in message, f"message does not show the value: {message}"


def test_params_is_greedy() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.7, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy
    assert not SamplingParams(temperature=1e-3, top_k=2).is_greedy


def test_params_dict_round_trip_and_unknown_keys() -> None:
    p = SamplingParams(temperature=0.3, top_k=7, stop="x", stop_token_ids=[2], seed=9, min_new_tokens=2)
    d = p.to_dict()
    assert d["stop"] == ["x"] and d["top_k"] == 7
    assert SamplingParams.from_dict(d) == p
    assert SamplingParams.from_dict({}) == SamplingParams()
    with pytest.raises(ValueError, match="top-p"):
        SamplingParams.from_dict({"top-p": 0.5})
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams.from_dict({"max_tokens": 5})
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_dict({"top_p": 0})
    with pytest.raises(ValueError):
        SamplingParams.from_dict([("top_p", 0.5)])  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------------------
# Greedy and temperature
# ---------------------------------------------------------------------------------------------------------------


def test_greedy_is_argmax_and_untouched_by_sampled_neighbours() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 37, generator=g) * 3
    params = [SamplingParams(temperature=0)] * 3 + [SamplingParams(top_k=1, temperature=0.9)]
    assert torch.equal(sampler(logits[:4], build(params, 37)), logits[:4].argmax(-1))
    # In a mixed batch the greedy rows still take the argmax, whatever the other rows do.
    mixed = [SamplingParams(temperature=0), SamplingParams(temperature=1.5, seed=1)] * 3
    tokens = sampler(logits, build(mixed, 37))
    assert torch.equal(tokens[0::2], logits[0::2].argmax(-1))
    assert tokens.dtype == torch.int64 and tokens.shape == (6,)


def test_sampler_accepts_bf16_and_checks_shapes() -> None:
    logits = torch.randn(2, 16).bfloat16()
    info = build([SamplingParams(seed=0), SamplingParams(temperature=0)], 16)
    assert sampler(logits, info).dtype == torch.int64
    with pytest.raises(ValueError, match="logits"):
        sampler(torch.randn(2, 17), info)
    with pytest.raises(ValueError, match="logits"):
        sampler(torch.randn(3, 16), info)


@pytest.mark.task("2.4")
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax_distribution(temperature: float) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, -2.0])
    counts = draw_many(logits, SamplingParams(temperature=temperature), 4000)
    stat = chi_square(counts, softmax64(logits, temperature))
    assert stat < CHI2_CRIT_001[7], f"chi2 = {stat:.1f}: draws do not follow softmax(logits / {temperature})"
    # The test has teeth: the same draws are far from the distribution at a different temperature.
    wrong = softmax64(logits, temperature * 1.5)
    assert chi_square(counts, wrong) > 2 * CHI2_CRIT_001[7]


@pytest.mark.task("2.4")
def test_one_request_over_many_steps_follows_the_distribution() -> None:
    """Same seed, successive steps: the per-step noise must behave like fresh independent draws."""
    vocab, n = 8, 4000
    logits = torch.tensor([1.0, 0.0, 0.3, -0.7, 0.9, -1.5, 0.2, 0.6])
    info = build([SamplingParams(seed=12345, temperature=1.0)] * n, vocab)
    info.steps = torch.arange(n)
    tokens = sampler(logits.expand(n, vocab).clone(), info).numpy()
    assert chi_square(np.bincount(tokens, minlength=vocab), softmax64(logits)) < CHI2_CRIT_001[7]
    # Consecutive tokens are independent: the transition counts match the product of the marginals.
    pairs = np.zeros((vocab, vocab))
    np.add.at(pairs, (tokens[:-1], tokens[1:]), 1)
    p = softmax64(logits)
    big = np.outer(p, p) * (n - 1) > 40  # only cells with enough expected counts
    expected = np.outer(p, p)[big] * (n - 1)
    stat = float(((pairs[big] - expected) ** 2 / expected).sum())
    assert stat < 3 * big.sum(), f"consecutive draws look correlated (chi2 {stat:.0f} over {big.sum()} cells)"


def test_low_temperature_concentrates_on_the_argmax() -> None:
    logits = torch.tensor([0.0, 1.0, 0.9, -3.0, 0.95])
    share = {}
    for temperature in (1.0, 0.1, 0.02, 1e-3):
        counts = draw_many(logits, SamplingParams(temperature=temperature), 1000)
        share[temperature] = counts[1] / 1000
        assert share[temperature] == pytest.approx(softmax64(logits, temperature)[1], abs=0.05)
    assert share[1.0] < share[0.1] < share[0.02] < share[1e-3] == 1.0


# ---------------------------------------------------------------------------------------------------------------
# top-k / top-p / min-p (task 2.3)
# ---------------------------------------------------------------------------------------------------------------


def test_sampler_top_k_draws_only_the_k_best_with_renormalised_probabilities() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(32, generator=g)
    k = 5
    counts = draw_many(logits, SamplingParams(top_k=k), 3000)
    best = set(torch.topk(logits, k).indices.tolist())
    assert set(np.flatnonzero(counts)) == best
    p = softmax64(logits)
    renorm = np.where(np.isin(np.arange(32), list(best)), p, 0.0)
    assert chi_square(counts, renorm / renorm.sum()) < CHI2_CRIT_001[k - 1]


def _random_rows(seed: int, rows: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g, dtype=torch.float64).float() * 2


@pytest.mark.task("2.3", weight=2)
@pytest.mark.parametrize(
    "top_k,top_p,min_p",
    [(-1, 0.9, 0.0), (-1, 0.5, 0.0), (-1, 0.05, 0.0), (10, 0.8, 0.0), (-1, 1.0, 0.1), (-1, 1.0, 0.5),
     (-1, 0.7, 0.2), (6, 0.6, 0.3), (3, 1.0, 0.0), (-1, 1.0, 0.0)],
)
def test_filter_keeps_exactly_the_brute_force_set(top_k: int, top_p: float, min_p: float) -> None:
    vocab, rows = 40, 16
    logits = _random_rows(7, rows, vocab)
    probs = torch.softmax(logits, dim=-1)
    out = top_k_top_p_min_p_filter(
        probs,
        torch.full((rows,), vocab if top_k == -1 else top_k),
        torch.full((rows,), top_p),
        torch.full((rows,), min_p),
    )
    for i in range(rows):
        p64 = probs[i].double().numpy()
        allowed = brute_force_allowed(p64, top_k, top_p, min_p)
        assert set(torch.nonzero(out[i]).flatten().tolist()) == allowed, f"row {i}"
        expected = np.zeros(vocab)
        expected[list(allowed)] = p64[list(allowed)] / p64[list(allowed)].sum()
        np.testing.assert_allclose(out[i].double().numpy(), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.task("2.3")
def test_filter_handles_mixed_rows_and_always_keeps_the_top_token() -> None:
    vocab = 30
    logits = _random_rows(3, 4, vocab)
    probs = torch.softmax(logits, -1)
    out = top_k_top_p_min_p_filter(
        probs,
        top_ks=torch.tensor([vocab, 2, vocab, vocab]),
        top_ps=torch.tensor([1.0, 1.0, 1e-6, 1.0]),
        min_ps=torch.tensor([0.0, 0.0, 0.0, 1.0]),
    )
    torch.testing.assert_close(out[0], probs[0])  # all off: unchanged (renormalisation is a no-op)
    assert (out[1] > 0).sum() == 2
    for i in (2, 3):  # tiny top_p / min_p = 1: only the best token
        assert torch.nonzero(out[i]).flatten().tolist() == [int(probs[i].argmax())]
        assert out[i].max() == 1.0


@pytest.mark.task("2.3")
@pytest.mark.parametrize(
    "top_p,min_p,kept",
    [(0.5, 0.0, [0]), (0.50001, 0.0, [0, 1]), (0.75, 0.0, [0, 1]), (0.8, 0.0, [0, 1, 2]), (0.875, 0.0, [0, 1, 2]),
     (0.87501, 0.0, [0, 1, 2, 3]), (1.0, 0.5, [0, 1]), (1.0, 0.25, [0, 1, 2]), (1.0, 0.2501, [0, 1]),
     (1.0, 0.09375, [0, 1, 2, 3, 4])],
)
def test_filter_boundaries_are_exact(top_p: float, min_p: float, kept: list[int]) -> None:
    """Binary fractions make every sum exact, so the boundary cases are unambiguous.

    top-p keeps the smallest set whose mass *reaches* top_p (0.5 is reached by token 0 alone); min-p drops only
    tokens *below* min_p * max (0.125 = 0.25 * 0.5 stays).
    """
    probs = torch.tensor([[0.5, 0.25, 0.125, 5 / 64, 3 / 64]])
    out = top_k_top_p_min_p_filter(probs, torch.tensor([5]), torch.tensor([top_p]), torch.tensor([min_p]))
    assert torch.nonzero(out[0]).flatten().tolist() == kept


@pytest.mark.task("2.3", weight=8)
@pytest.mark.parametrize("vocab", [32000, 49152])
def test_rows_with_every_filter_off_keep_every_token_of_a_large_vocabulary(vocab: int) -> None:
    """The filter runs on the whole batch as soon as one row asks for it, so rows with the filters off pass
    through it too: top_k=-1 (stored as ``vocab``), top_p=1 and min_p=0, as ``SamplingBatchInfo.build`` writes
    them for ``SamplingParams()``, beside rows with top-p 0.9 or min-p 0.9. Over tens of thousands of float32
    probabilities the running sum rounds, and a plain ``mass_above < top_p * total`` test then drops the tail
    (some 17,000 of 32,000 tokens): an off row must come out as it went in, every token kept."""
    g = torch.Generator().manual_seed(11)
    probs = torch.softmax(torch.randn(4, vocab, generator=g) * 4, dim=-1)  # a peaked row with a long, tiny tail
    params = [SamplingParams(), SamplingParams(top_p=0.9), SamplingParams(top_k=-1, top_p=1.0, min_p=0.0),
              SamplingParams(min_p=0.9)]
    info = build(params, vocab)
    assert info.top_ks.tolist() == [vocab] * 4 and info.top_ps[[0, 2]].tolist() == [1.0, 1.0]
    assert info.min_ps[[0, 2]].tolist() == [0.0, 0.0]
    out = top_k_top_p_min_p_filter(probs, info.top_ks, info.top_ps, info.min_ps)
    for i in (0, 2):
        assert int((out[i] > 0).sum()) == vocab, f"row {i} has its filters off but lost tokens"
        torch.testing.assert_close(out[i], probs[i], rtol=1e-5, atol=0)
    assert 0 < int((out[1] > 0).sum()) < vocab and 0 < int((out[3] > 0).sum()) < vocab


@pytest.mark.task("2.3")
def test_top_k_keeps_exactly_k_among_ties() -> None:
    """Three tokens share the 2nd-highest probability: top-k = 2 keeps the best and exactly one of them."""
    probs = torch.tensor([[0.1, 0.2, 0.4, 0.2, 0.1, 0.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25, 0.0, 0.0, 0.0, 0.0]])
    out = top_k_top_p_min_p_filter(probs, torch.tensor([2, 3]), torch.ones(2), torch.zeros(2))
    kept = [torch.nonzero(row).flatten().tolist() for row in out]
    assert 2 in kept[0] and len(kept[0]) == 2 and set(kept[0]) <= {1, 2, 3}
    assert len(kept[1]) == 3 and set(kept[1]) <= {0, 1, 2, 3}
    torch.testing.assert_close(out.sum(-1), torch.ones(2))
    torch.testing.assert_close(out[0, 2], torch.tensor(2 / 3))  # renormalised over the two that are kept


@pytest.mark.task("2.3", weight=2)
@settings(max_examples=100, deadline=None)
@given(_rows_and_params())
def test_property_filter_keeps_a_valid_nucleus(case: tuple[list[float], SamplingParams]) -> None:
    """For any logits and knobs, the kept set is no larger than top-k, top-p and min-p allow, and no smaller."""
    logits_list, params = case
    vocab = len(logits_list)
    probs = torch.softmax(torch.tensor([logits_list]) / params.temperature, dim=-1)
    k = vocab if params.top_k == -1 else min(params.top_k, vocab)
    out = top_k_top_p_min_p_filter(
        probs, torch.tensor([k]), torch.tensor([params.top_p]), torch.tensor([params.min_p])
    )[0].double().numpy()
    p = probs[0].double().numpy()
    kept = np.flatnonzero(out)
    assert out.sum() == pytest.approx(1.0, abs=1e-5)
    assert p.argmax() in kept or p[kept].max() == p.max()  # the best token (up to ties) survives
    np.testing.assert_allclose(out[kept], p[kept] / p[kept].sum(), rtol=1e-4, atol=1e-7)
    tol = 1e-5
    desc = np.sort(p)[::-1]
    assert len(kept) <= k
    assert p[kept].min() >= params.min_p * p.max() * (1 - tol) - 1e-12
    top_k_mass = desc[:k].sum()
    # The kept set minus its smallest member must fall short of top_p (otherwise the set is not the smallest)...
    if len(kept) > 1:
        short = np.sort(p[kept])[::-1][:-1].sum() / top_k_mass
        assert short < params.top_p + tol
    # ...every token above the smallest kept one is kept too (the kept set is a prefix of the sorted order)...
    assert (p > p[kept].min() * (1 + tol)).sum() <= len(kept)
    # ...and if fewer than k survive, either the nucleus reached top_p or min-p removed the next candidate.
    dropped = np.setdiff1d(np.arange(vocab), kept)
    if len(kept) < k and dropped.size:
        reached = p[kept].sum() / top_k_mass >= params.top_p - tol
        next_below_min_p = p[dropped].max() < params.min_p * p.max() * (1 + tol) + 1e-12
        assert reached or next_below_min_p


def test_sampler_top_p_and_min_p_draws_stay_in_the_nucleus() -> None:
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0, 2.2, 0.5, -0.5, 1.7])
    p = softmax64(logits)
    for params in (SamplingParams(top_p=0.8), SamplingParams(min_p=0.3), SamplingParams(top_k=4, top_p=0.7)):
        counts = draw_many(logits, params, 2000)
        allowed = brute_force_allowed(p, params.top_k, params.top_p, params.min_p)
        assert set(np.flatnonzero(counts)) == allowed, params
        renorm = np.where(np.isin(np.arange(10), list(allowed)), p, 0.0)
        assert chi_square(counts, renorm / renorm.sum()) < CHI2_CRIT_001[len(allowed) - 1], params


@settings(max_examples=100, deadline=None)
@given(_rows_and_params())
def test_property_sampled_tokens_lie_in_the_allowed_set(case: tuple[list[float], SamplingParams]) -> None:
    logits_list, params = case
    vocab, rows = len(logits_list), 8
    logits = torch.tensor(logits_list)
    info = build([params] * rows, vocab)
    info.steps = torch.arange(rows)  # 8 different draws of the same request
    tokens = sampler(logits.expand(rows, vocab).clone(), info).tolist()

    # Allowed set with a little slack for float32 rounding and ties (the order among equal probabilities is free).
    p = softmax64(logits, params.temperature) if not params.is_greedy else None
    for t in tokens:
        if params.is_greedy:
            assert logits[t] == logits.max()
            continue
        k = vocab if params.top_k == -1 else min(params.top_k, vocab)
        kth = np.sort(p)[::-1][k - 1]
        assert p[t] >= kth * (1 - 1e-5) - 1e-12, "outside top-k"
        in_top_k = np.sort(p)[::-1][:k]
        mass_above = in_top_k[in_top_k > p[t] * (1 + 1e-5)].sum() / in_top_k.sum()
        assert mass_above < params.top_p + 1e-5 or p[t] >= p.max() * (1 - 1e-5), "outside the nucleus"
        assert p[t] >= params.min_p * p.max() * (1 - 1e-5) - 1e-12, "below min-p"


@st.composite
def _masked_rows_and_extreme_params(draw: st.DrawFn) -> tuple:
    """Rows that a grammar has masked (at least one id left finite), and any valid parameters, the extreme ones
    favoured: values that are 0 or infinite in float32, and every rule that bans ids."""
    vocab, rows = draw(st.integers(2, 24)), draw(st.integers(1, 4))
    extreme = st.sampled_from
    logits, params, prompts, outputs, eos = [], [], [], [], []
    for _ in range(rows):
        allowed = draw(st.lists(st.booleans(), min_size=vocab, max_size=vocab).filter(any))
        values = draw(st.lists(st.floats(-30, 30, width=32), min_size=vocab, max_size=vocab))
        logits.append([x if ok else -math.inf for x, ok in zip(values, allowed)])
        ids = st.integers(0, vocab - 1)
        params.append(SamplingParams(
            temperature=draw(extreme([0.0, 5e-324, GREEDY_TEMPERATURE_EPS, 0.7, 2.0, 1e30, 1e39, 1e300])),
            top_k=draw(extreme([-1, 1, 2, vocab])), top_p=draw(extreme([5e-324, 0.3, 1.0])),
            min_p=draw(extreme([0.0, 5e-324, 0.5, 1.0])),
            repetition_penalty=draw(extreme([5e-324, 1e-40, 1e-35, 0.5, 1.0, 2.0])),
            frequency_penalty=draw(extreme([-2.0, 0.0, 2.0])), presence_penalty=draw(extreme([-2.0, 0.0, 2.0])),
            min_new_tokens=draw(extreme([0, 3])), stop_token_ids=draw(st.lists(ids, max_size=vocab)),
            logit_bias={str(k): v for k, v in draw(st.dictionaries(ids, extreme([-100.0, 100.0]), max_size=3)).items()},
            seed=draw(st.integers(0, 2**32))))
        prompts.append(draw(st.lists(ids, max_size=6)))
        outputs.append(draw(st.lists(ids, max_size=2)))
        eos.append(draw(st.lists(ids, min_size=1, max_size=2)))
    return torch.tensor(logits), params, prompts, outputs, eos


def check_no_masked_token_and_no_nan(case: tuple, device: str) -> None:
    logits, params, prompts, outputs, eos = case
    info = SamplingBatchInfo.build(params, prompts, outputs, eos, logits.shape[1], device)
    for top_logprobs in (-1, 2):  # without logprobs, a GPU takes its one-pass kernel where it can
        tokens, logprobs = sampler.sample(logits.to(device), info, top_logprobs=top_logprobs)
        for row, token in enumerate(tokens.tolist()):
            assert math.isfinite(logits[row, token]), (row, token, params[row])
        if logprobs is not None:
            assert torch.isfinite(logprobs.chosen).all(), params
            assert not torch.isnan(logprobs.top_values).any()


@settings(max_examples=300, deadline=None)
@given(_masked_rows_and_extreme_params())
def test_property_no_valid_request_draws_a_masked_token_or_a_nan(case: tuple) -> None:
    """Whatever valid numbers a request brings, the token drawn is one its grammar allowed, and its log probability
    is a number: no rule may leave a row with no finite logit, and no float32 overflow may turn one into NaN."""
    check_no_masked_token_and_no_nan(case, "cpu")


@pytest.mark.gpu
@settings(max_examples=300, deadline=None)
@given(_masked_rows_and_extreme_params())
def test_property_no_valid_request_draws_a_masked_token_or_a_nan_on_the_gpu(case: tuple) -> None:
    """The same on a GPU, whose draws are Triton kernels that read the logits in log space."""
    check_no_masked_token_and_no_nan(case, "cuda")


# ---------------------------------------------------------------------------------------------------------------
# Penalties and min_new_tokens (task 2.2)
# ---------------------------------------------------------------------------------------------------------------


def penalties_by_hand(
    logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]], outputs: list[list[int]]
) -> torch.Tensor:
    """The reference: one Python loop per (row, token), straight from the definitions."""
    out = logits.clone().double()
    for i, p in enumerate(params):
        for v in range(logits.shape[1]):
            x = float(logits[i, v])
            count = outputs[i].count(v)
            if v in prompts[i] or count > 0:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            x -= p.frequency_penalty * count
            x -= p.presence_penalty * (1 if count > 0 else 0)
            out[i, v] = x
    return out.float()


PENALTY_CASES = {
    "frequency": SamplingParams(frequency_penalty=0.7),
    "presence": SamplingParams(presence_penalty=1.3),
    "negative_frequency_presence": SamplingParams(frequency_penalty=-0.5, presence_penalty=-2.0),
    "repetition": SamplingParams(repetition_penalty=1.8),
    "repetition_below_one": SamplingParams(repetition_penalty=0.5),
    "all_three": SamplingParams(frequency_penalty=0.4, presence_penalty=0.6, repetition_penalty=1.3),
}


@pytest.mark.task("2.2")
@pytest.mark.parametrize("case", sorted(PENALTY_CASES))
def test_penalties_match_a_hand_written_loop(case: str) -> None:
    vocab = 20
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, vocab, generator=g) * 2
    prompts = [[1, 2, 3, 3, 9], [0, 19], [4]]
    outputs = [[2, 5, 5, 5, 7], [0, 0, 11], []]
    # Row 1 has no penalties at all: it must come out bit-identical even though its neighbours are penalised.
    params = [PENALTY_CASES[case], SamplingParams(), PENALTY_CASES[case]]
    info = build(params, vocab, prompts, outputs)
    got = apply_penalties(logits, info)
    expected = penalties_by_hand(logits, params, prompts, outputs)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert torch.equal(got[1], logits[1])
    # Only the ids that are in scope may change, and every one of them must.
    for i in (0, 2):
        scope = set(outputs[i])
        if params[i].repetition_penalty != 1.0:
            scope |= set(prompts[i])
        changed = set(torch.nonzero(got[i] != logits[i]).flatten().tolist())
        assert changed == scope, (case, i, changed, scope)


@pytest.mark.task("2.2", weight=3)
def test_neutral_penalties_leave_every_logit_bit_identical() -> None:
    """repetition_penalty=1, frequency_penalty=0 and presence_penalty=0 are the penalties turned off. A batch
    where another row turns each of them on runs every stage over all rows: the neutral rows, whose prompt and
    output repeat tokens, must come out bit for bit as they went in (greedy decoding compares them exactly)."""
    vocab = 16
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, vocab, generator=g) * 3
    params = [SamplingParams(), SamplingParams(repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0),
              SamplingParams(repetition_penalty=1.4), SamplingParams(frequency_penalty=0.5, presence_penalty=0.3)]
    prompts = [[1, 2, 2, 3], [4, 5, 5], [1, 6], [7]]
    outputs = [[2, 2, 8, 9], [5, 10, 10], [6, 6], [7, 7]]
    info = build(params, vocab, prompts, outputs)
    assert info.need_repetition and info.need_frequency_presence
    got = apply_penalties(logits, info)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[1], logits[1])
    assert not torch.equal(got[2], logits[2]) and not torch.equal(got[3], logits[3])


@pytest.mark.task("2.2")
def test_frequency_and_presence_ignore_the_prompt_and_have_exact_amounts() -> None:
    vocab = 10
    logits = torch.zeros(1, vocab)
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)]
    info = build(params, vocab, prompts=[[1, 1, 2]], outputs=[[3, 3, 3, 4]])
    got = apply_penalties(logits, info)[0]
    assert got[3].item() == pytest.approx(-(0.5 * 3 + 0.25))
    assert got[4].item() == pytest.approx(-(0.5 + 0.25))
    assert got[1] == 0 and got[2] == 0  # prompt tokens: untouched


@pytest.mark.task("2.2")
def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 4.0, -1.0]])
    info = build([SamplingParams(repetition_penalty=2.0)], 4, prompts=[[0, 1]], outputs=[[2]])
    assert apply_penalties(logits, info).tolist() == [[1.0, -4.0, 2.0, -1.0]]


@pytest.mark.task("2.2")
@pytest.mark.parametrize("penalty", [5e-324, 1e-40, 1e-35])
@pytest.mark.parametrize("temperature", [1.0, GREEDY_TEMPERATURE_EPS])
def test_a_tiny_repetition_penalty_leaves_the_logits_finite(penalty: float, temperature: float) -> None:
    """r near 0 (5e-324 is even 0 in float32) would divide a seen positive logit to +inf, and two of them made the
    softmax NaN. The capped logits stay finite; the seen positive ids tie at the cap and share the draws."""
    inf = float("inf")
    logits = torch.tensor([[2.0, -2.0, 4.0, -1.0, 3.0, -inf]])  # id 5: masked out by a grammar, and seen
    params = SamplingParams(repetition_penalty=penalty, temperature=temperature)
    info = build([params], 6, prompts=[[0, 1, 5]], outputs=[[2]])
    got = apply_penalties(logits, info)[0]
    assert torch.isfinite(got[:5]).all() and got[5] == -inf  # no NaN, and the masked id stays masked
    assert got[0] == got[2] == PENALISED_LOGIT_LIMIT  # the seen positive ids, tied at the cap
    assert got[1] <= 0 and got[3] == -1.0 and got[4] == 3.0  # seen negative: towards 0; unseen: as it was
    n = 400
    rows = [SamplingParams(**{**params.to_dict(), "seed": s}) for s in range(n)]
    tokens = sampler(logits.expand(n, 6).clone(), build(rows, 6, prompts=[[0, 1, 5]] * n, outputs=[[2]] * n))
    counts = np.bincount(tokens.numpy(), minlength=6)
    assert counts[0] + counts[2] == n and min(counts[0], counts[2]) > n // 4, counts


@pytest.mark.parametrize("temperature", [1e30, 1e39, 1e300])
def test_a_huge_temperature_samples_uniformly_without_nan(temperature: float) -> None:
    """1e300 is a valid temperature but inf in float32: a grammar's -inf divided by it was NaN, in the draw and in
    the log probabilities. It is sampled at MAX_TEMPERATURE: uniform over the allowed ids, finite logprobs."""
    inf = float("inf")
    logits = torch.tensor([2.0, -inf, 4.0, -1.0, -inf])
    n = 600
    rows = [SamplingParams(temperature=temperature, seed=s) for s in range(n)]
    tokens, logprobs = sampler.sample(logits.expand(n, 5).clone(), build(rows, 5), top_logprobs=2)
    counts = np.bincount(tokens.numpy(), minlength=5)
    assert counts[1] == counts[4] == 0
    assert chi_square(counts, np.array([1, 0, 1, 1, 0]) / 3) < CHI2_CRIT_001[2], counts
    assert logprobs is not None
    assert torch.allclose(logprobs.chosen, torch.full((n,), -math.log(3)))
    assert torch.isfinite(logprobs.top_values).all()


@pytest.mark.task("2.2")
def test_update_accumulates_counts_like_building_from_scratch() -> None:
    vocab = 12
    params = [SamplingParams(frequency_penalty=0.3, presence_penalty=0.2, repetition_penalty=1.5), SamplingParams()]
    prompts = [[1, 2], [3]]
    info = build(params, vocab, prompts)
    history = [[4, 5], [4, 4], [1, 0], [9, 4]]
    for step in history:
        info.update(torch.tensor(step))
    outputs = [[s[0] for s in history], [s[1] for s in history]]
    fresh = build(params, vocab, prompts, outputs)
    assert torch.equal(info.output_counts, fresh.output_counts)
    assert torch.equal(info.steps, fresh.steps) and info.steps.tolist() == [4, 4]
    logits = torch.randn(2, vocab)
    torch.testing.assert_close(apply_penalties(logits, info), penalties_by_hand(logits, params, prompts, outputs))


@pytest.mark.task("2.2")
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_new_tokens_masks_eos_and_stop_ids_until_reached(ignore_eos: bool) -> None:
    vocab, eos, stop_id = 16, 5, 9
    logits = torch.zeros(2, vocab)
    logits[:, eos] = 50.0  # the model badly wants to stop
    logits[:, stop_id] = 40.0
    params = [
        SamplingParams(temperature=0, min_new_tokens=3, stop_token_ids=[stop_id], ignore_eos=ignore_eos),
        SamplingParams(temperature=0, stop_token_ids=[stop_id]),  # no minimum: free to stop at once
    ]
    info = build(params, vocab, eos=[[eos], eos])
    for step in range(5):
        masked = apply_penalties(logits, info)
        tokens = sampler(logits, info)
        if step < 3:
            assert masked[0, eos] == -math.inf and masked[0, stop_id] == -math.inf
            assert tokens[0] not in (eos, stop_id)
            other = [v for v in range(vocab) if v not in (eos, stop_id)]
            assert torch.equal(masked[0, other], logits[0, other])
        else:
            assert torch.equal(masked[0], logits[0])
            assert tokens[0] == eos
        assert tokens[1] == eos and torch.equal(masked[1], logits[1])
        info.update(tokens)


@pytest.mark.task("2.2")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_new_tokens_yields_to_a_grammar_that_allows_only_stop_ids(temperature: float) -> None:
    """A grammar whose answer is complete leaves only EOS (or a stop id) finite. Banning those too left a row of
    -inf: a NaN softmax, and a draw of a token the grammar forbids. That row keeps its stop ids; the others in the
    batch are still masked."""
    vocab, eos, stop_id, inf = 8, 7, 3, float("inf")
    logits = torch.full((3, vocab), -inf)
    logits[0, eos] = logits[0, stop_id] = 1.0  # only stop ids allowed: the grammar wins
    logits[1] = torch.arange(vocab, dtype=torch.float32)  # free row: still masked
    logits[2, [eos, 2]] = 1.0  # the grammar allows EOS and token 2: EOS is masked, 2 is drawn
    params = [SamplingParams(temperature=temperature, seed=1, min_new_tokens=4, stop_token_ids=[stop_id])] * 3
    info = build(params, vocab, eos=[[eos]] * 3)
    got = apply_penalties(logits, info)
    assert torch.equal(got[0], logits[0])
    assert got[1, eos] == got[1, stop_id] == -inf and got[1, 6] == 6.0
    assert got[2, eos] == -inf and got[2, 2] == 1.0
    tokens = sampler(logits, info)
    assert tokens[0] in (eos, stop_id) and tokens[1] not in (eos, stop_id) and tokens[2] == 2


@pytest.mark.task("2.2")
def test_min_new_tokens_counts_tokens_already_generated() -> None:
    """A resumed request with 2 outputs and min_new_tokens=3 is masked for exactly one more step."""
    vocab = 8
    info = build([SamplingParams(min_new_tokens=3)], vocab, outputs=[[1, 2]], eos=[[7]])
    assert apply_penalties(torch.zeros(1, vocab), info)[0, 7] == -math.inf
    info.update(torch.tensor([3]))
    assert apply_penalties(torch.zeros(1, vocab), info)[0, 7] == 0


# ---------------------------------------------------------------------------------------------------------------
# Seeded, batch-independent sampling (task 2.4)
# ---------------------------------------------------------------------------------------------------------------


def request_logits(request: int, step: int, vocab: int) -> torch.Tensor:
    """A deterministic stand-in for the model: the logits of request ``request`` at its step ``step``."""
    g = torch.Generator().manual_seed(1000 * request + step)
    return torch.randn(vocab, generator=g) * 1.5


class Running:
    """A tiny continuous-batching loop: requests join and leave the batch between steps. As in the engine, a batch
    whose rows changed gets its sampling state built afresh from each request's parameters, prompt and output so
    far (the state must not depend on which batch a request was in before)."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.ids, self.info, self.tokens = vocab, [], None, {}
        self.requests: dict[int, tuple[SamplingParams, list[int]]] = {}

    def _rebuild(self) -> None:
        reqs = [self.requests[r] for r in self.ids]
        self.info = SamplingBatchInfo.build([p for p, _ in reqs], [prompt for _, prompt in reqs],
                                            [self.tokens[r] for r in self.ids], [[0]] * len(reqs), self.vocab, "cpu")

    def join(self, rid: int, params: SamplingParams, prompt: list[int]) -> None:
        self.requests[rid] = (params, prompt)
        self.ids.append(rid)
        self.tokens[rid] = []
        self._rebuild()

    def leave(self, rid: int) -> None:
        keep = [i for i, r in enumerate(self.ids) if r != rid]
        self.info.filter(keep)
        self.ids = [self.ids[i] for i in keep]

    def step(self) -> None:
        logits = torch.stack([request_logits(r, len(self.tokens[r]), self.vocab) for r in self.ids])
        new = sampler(logits, self.info)
        self.info.update(new)
        for r, t in zip(self.ids, new.tolist()):
            self.tokens[r].append(t)


TRACKED = SamplingParams(seed=1234, temperature=0.9, top_p=0.95, frequency_penalty=0.5, repetition_penalty=1.2)


def tracked_alone(steps: int, vocab: int) -> list[int]:
    run = Running(vocab)
    run.join(0, TRACKED, [1, 2, 3])
    for _ in range(steps):
        run.step()
    return run.tokens[0]


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    vocab, steps = 48, 12
    alone = tracked_alone(steps, vocab)
    assert len(set(alone)) > 3  # it really samples

    # Same request at another row, with other requests around it: some seeded, some not, some greedy.
    run = Running(vocab)
    run.join(7, SamplingParams(), [5])
    run.join(8, SamplingParams(temperature=0), [6])
    run.join(0, TRACKED, [1, 2, 3])
    run.join(9, SamplingParams(seed=1234, top_k=3), [7])  # same seed, different request: no interference
    for _ in range(steps):
        run.step()
    assert run.tokens[0] == alone

    # Requests leave and join around it mid-flight (filter and merge), and its row index moves.
    run = Running(vocab)
    run.join(3, SamplingParams(presence_penalty=1.0, min_p=0.1), [4])
    run.join(0, TRACKED, [1, 2, 3])
    for step in range(steps):
        if step == 3:
            run.leave(3)  # the tracked request moves from row 1 to row 0
        if step == 5:
            run.join(4, SamplingParams(temperature=0.5, seed=4), [2])
        if step == 8:
            run.join(5, SamplingParams(min_new_tokens=2, repetition_penalty=1.5), [2, 2])
            run.leave(4)
        run.step()
    assert run.tokens[0] == alone


PLAIN = SamplingParams(seed=1234, temperature=0.9)


@pytest.mark.task("2.4", weight=3)
def test_seeded_request_ignores_its_row_and_its_neighbours() -> None:
    """Temperature sampling only: the tracked request draws the same tokens alone, at another row among other
    requests (one with the same seed), and while requests leave and join around it."""
    vocab, steps = 48, 12
    run = Running(vocab)
    run.join(0, PLAIN, [1, 2, 3])
    for _ in range(steps):
        run.step()
    alone = run.tokens[0]
    assert len(set(alone)) > 3  # it really samples

    run = Running(vocab)
    run.join(7, SamplingParams(), [5])
    run.join(8, SamplingParams(temperature=0), [6])
    run.join(0, PLAIN, [1, 2, 3])
    run.join(9, SamplingParams(seed=1234, temperature=1.4), [7])  # same seed, different request
    for _ in range(steps):
        run.step()
    assert run.tokens[0] == alone

    run = Running(vocab)
    run.join(3, SamplingParams(seed=3), [4])
    run.join(0, PLAIN, [1, 2, 3])
    for step in range(steps):
        if step == 3:
            run.leave(3)  # the tracked request moves from row 1 to row 0
        if step == 5:
            run.join(4, SamplingParams(temperature=0.5, seed=4), [2])
        if step == 8:
            run.join(5, SamplingParams(temperature=2.0), [2, 2])
            run.leave(4)
        run.step()
    assert run.tokens[0] == alone


@pytest.mark.task("2.4")
def test_seed_and_step_are_separate_coordinates() -> None:
    """A request's noise at step s is not another request's at step s + 1: seeds 5 and 6 must not share one
    stream shifted by a step, and (seed a, step b) is not (seed b, step a)."""
    u = seeded_uniform(torch.tensor([5, 6, 3, 9]), torch.tensor([1, 0, 9, 3]), 256)
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[2], u[3])
    # Not merely different: unrelated (no row is a reordering of the other).
    assert not torch.equal(u[0].sort().values, u[1].sort().values)
    same = seeded_uniform(torch.tensor([5, 5]), torch.tensor([1, 1]), 256)
    assert torch.equal(same[0], same[1]) and torch.equal(same[0], u[0])  # same coordinates, same numbers


@pytest.mark.task("2.4")
def test_different_seeds_give_different_sequences() -> None:
    vocab, steps, n = 50, 20, 8
    info = build([SamplingParams(seed=s) for s in range(n)], vocab)
    logits = torch.zeros(n, vocab)  # uniform: every difference comes from the noise
    seqs = []
    for _ in range(steps):
        t = sampler(logits, info)
        info.update(t)
        seqs.append(t)
    seqs = torch.stack(seqs, dim=1)  # [n, steps]
    assert len({tuple(s) for s in seqs.tolist()}) == n
    # ...and within a sequence the steps differ too (the step feeds the noise).
    assert all(len(set(s)) > 10 for s in seqs.tolist())
    # Seeds that differ only in their high 32 bits, or by sign, are different seeds.
    u = seeded_uniform(torch.tensor([5, 5 + (1 << 32), -5]), torch.zeros(3, dtype=torch.int64), 64)
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])


@pytest.mark.task("2.4")
def test_seeded_noise_is_uniform_and_depends_only_on_its_coordinates() -> None:
    seeds = torch.tensor([0, 1, 2**62 + 3, -(2**63), 42])
    steps = torch.tensor([0, 5, 1, 7, 1_000_000])
    u = seeded_uniform(seeds, steps, 20_000)
    assert u.dtype == torch.float32 and u.shape == (5, 20_000)
    assert (u > 0).all() and (u < 1).all()
    # Each row is the same when computed on its own or in another order (no hidden stream state).
    for i in range(5):
        torch.testing.assert_close(seeded_uniform(seeds[i : i + 1], steps[i : i + 1], 20_000)[0], u[i], rtol=0, atol=0)
    torch.testing.assert_close(seeded_uniform(seeds.flip(0), steps.flip(0), 20_000), u.flip(0), rtol=0, atol=0)
    # And a wider vocabulary extends the row rather than changing it.
    torch.testing.assert_close(seeded_uniform(seeds, steps, 20_100)[:, :20_000], u, rtol=0, atol=0)
    # Uniform: 20 equal bins over 100k numbers.
    counts = np.histogram(u.numpy().ravel(), bins=20, range=(0, 1))[0]
    expected = u.numel() / 20
    stat = float(((counts - expected) ** 2 / expected).sum())
    assert stat < 43.8  # chi-square, 19 degrees of freedom, p = 0.001
    assert abs(float(u.mean()) - 0.5) < 0.005


@pytest.mark.task("2.4", weight=3)
def test_noise_rows_are_never_permutations_of_each_other() -> None:
    """60,000 steps of one request over a 16-token vocabulary: no two steps may see the same 16 numbers reordered.

    A weak construction such as a single ``hash(v ^ key)`` fails this: two keys that differ only in their low 4 bits
    turn one row into a permutation of the other, which happens about N**2 / 2**29 ~ 7 times here.
    """
    n, vocab = 60_000, 16
    u = seeded_uniform(torch.full((n,), 99), torch.arange(n), vocab)
    distinct_rows = torch.unique(u.sort(dim=-1).values, dim=0).shape[0]
    assert distinct_rows == n


@pytest.mark.task("2.4")
def test_exponential_race_ignores_zero_probability_tokens() -> None:
    probs = torch.zeros(1000, 10)
    probs[:, 3] = 1e-30
    probs[:, 7] = 2e-30  # unnormalised and tiny: only the ratio matters
    tokens = sample_from_probs(probs, torch.arange(1000), torch.zeros(1000, dtype=torch.int64))
    counts = np.bincount(tokens.numpy(), minlength=10)
    assert counts.sum() == counts[3] + counts[7]
    assert abs(counts[7] / 1000 - 2 / 3) < 0.06


def test_unseeded_requests_get_fresh_seeds() -> None:
    a = build([SamplingParams(), SamplingParams()], 8)
    b = build([SamplingParams()], 8)
    assert len({*a.seeds.tolist(), *b.seeds.tolist()}) == 3
    torch.manual_seed(0)
    c = build([SamplingParams()], 8).seeds
    torch.manual_seed(0)
    assert torch.equal(build([SamplingParams()], 8).seeds, c)  # torch.manual_seed makes them reproducible
    assert build([SamplingParams(seed=2**64 + 7)], 8).seeds.item() == 7  # seeds are taken modulo 2**64


# ---------------------------------------------------------------------------------------------------------------
# Batch bookkeeping
# ---------------------------------------------------------------------------------------------------------------


def test_flags_let_cheap_batches_skip_work() -> None:
    info = build([SamplingParams(temperature=0), SamplingParams(top_k=1)], 8)
    assert info.all_greedy and not info.need_penalties and not info.need_filtering
    assert info.output_counts is None and info.prompt_mask is None and info.stop_token_mask is None
    info = build([SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(top_p=0.5,
                                                                                      presence_penalty=0.5)], 8)
    assert not info.all_greedy and info.any_greedy and info.need_top_p and not info.need_top_k
    assert info.need_frequency_presence and info.output_counts.shape == (3, 8) and info.prompt_mask is None
    info.filter([0, 1])
    assert info.all_greedy and info.output_counts is None  # state nobody needs is freed
    # top_k >= vocab is no filter at all.
    assert not build([SamplingParams(top_k=8)], 8).need_top_k


def test_filter_equals_a_fresh_build() -> None:
    vocab = 10
    params = [
        SamplingParams(seed=1, repetition_penalty=1.4),
        SamplingParams(seed=2, min_new_tokens=4, stop_token_ids=[3]),
        SamplingParams(seed=3, frequency_penalty=1.0, top_k=4),
    ]
    prompts = [[1, 1, 2], [3, 4], [5]]
    outputs = [[6], [7, 7], []]
    eos = [[0], [0], [0]]
    a = build(params, vocab, prompts, outputs, eos)
    a.filter([2, 0])
    b = build([params[2], params[0]], vocab, [prompts[2], prompts[0]], [outputs[2], outputs[0]], eos[:2])
    for name in ("temperatures", "top_ks", "top_ps", "min_ps", "frequency_penalties", "presence_penalties",
                 "repetition_penalties", "seeds", "steps", "min_new_tokens", "row_flags", "output_counts"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    # [B, V] state need only be right in rows that use it: the prompt mask matters for row 1 (repetition) only.
    assert torch.equal(a.prompt_mask[1], b.prompt_mask[1])
    assert a.stop_token_mask is None and b.stop_token_mask is None
    a.filter([])
    assert len(a) == 0 and sampler(torch.zeros(0, vocab), a).shape == (0,)


def test_build_rejects_out_of_range_token_ids() -> None:
    with pytest.raises(ValueError, match="prompt"):
        build([SamplingParams(repetition_penalty=1.1)], 8, prompts=[[8]])
    with pytest.raises(ValueError, match="length"):
        SamplingBatchInfo.build([SamplingParams()], [[1], [2]], None, None, 8, "cpu")


# ---------------------------------------------------------------------------------------------------------------
# GPU: the same request gives the same tokens on CPU and GPU
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.task("2.4")
def test_cpu_and_gpu_draw_the_same_noise_and_tokens() -> None:
    seeds = torch.tensor([0, 7, -(2**63), 2**62 + 1])
    steps = torch.tensor([0, 3, 9, 100])
    u_cpu = seeded_uniform(seeds, steps, 50_000)
    u_gpu = seeded_uniform(seeds.cuda(), steps.cuda(), 50_000).cpu()
    # The integer hash is exact; the float conversion is a single rounding on both devices.
    assert torch.equal(u_cpu, u_gpu)
    params = [SamplingParams(seed=s, temperature=0.8) for s in range(4)]
    logits = torch.randn(4, 1000, dtype=torch.float64).float()
    t_cpu = sampler(logits, SamplingBatchInfo.build(params, [[]] * 4, None, None, 1000, "cpu"))
    gpu_info = SamplingBatchInfo.build(params, [[]] * 4, None, None, 1000, "cuda")
    t_eager = Sampler(fuse_on_cuda=False)(logits.cuda(), gpu_info)
    t_fused = Sampler(fuse_on_cuda=True)(logits.cuda(), gpu_info)
    assert torch.equal(t_cpu, t_eager.cpu()) and torch.equal(t_cpu, t_fused.cpu())


# ------------------------------------------------------------------------------------------ the fused draw (GPU)


def _fused_draw_and_device():  # type: ignore[no-untyped-def]
    """The fused-draw module and where to run it: the GPU, else the CPU through Triton's interpreter."""
    pytest.importorskip("triton")
    from minisgl_ref.sampling import fused_draw

    if not torch.cuda.is_available() and type(__import__("triton").language.cdiv).__name__ == "JITFunction":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")
    return fused_draw, "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("vocab", [1000, 4099])
def test_fused_draw_picks_the_eager_token(vocab: int) -> None:
    """The Triton race (one pass, noise in registers; on the CPU through Triton's interpreter) draws the same token
    as the eager functions for every row: plain temperatures in log space, filtered probabilities as ``p / E``.
    Seeds cover negative and > 2**32 values, steps differ per row, and the vocabulary is not a multiple of the
    kernel's block."""
    from minisgl_ref.sampling.sampler import sample_from_probs, temperature_sample

    fused_draw, device = _fused_draw_and_device()
    g = torch.Generator().manual_seed(vocab)
    rows = 12
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(device)
    temperatures = torch.tensor([0.3, 0.7, 1.0, 1.5] * 3, device=device)
    seeds = torch.tensor([0, 1, -1, 2**40 + 7, -(2**50), 12345, 2**33, 99, -7, 2**62, 5, 6], device=device)
    steps = torch.arange(rows, device=device) * 17
    want = temperature_sample(logits, temperatures, seeds, steps)
    got = fused_draw.temperature_sample(logits, temperatures, seeds, steps)
    assert got.tolist() == want.tolist()
    probs = torch.softmax(logits / temperatures[:, None], dim=-1)
    probs[:, ::3] = 0.0  # filtered out: a zero probability must never win
    want = sample_from_probs(probs, seeds, steps)
    got = fused_draw.sample_from_probs(probs, seeds, steps)
    assert got.tolist() == want.tolist()
    assert all(t % 3 != 0 for t in got.tolist())
    # different seeds give different draws: the test would not pass with constant noise
    assert len(set(fused_draw.temperature_sample(logits[:1].expand(rows, -1), torch.ones(rows, device=device),
                                                 seeds, steps).tolist())) > 3


def test_fused_draw_never_picks_a_masked_id_at_the_extremes() -> None:
    """The fused race reads the penalised logits in log space, ``l / T - log E``: at the cap on the penalised
    logits and the smallest sampled temperature, and at MAX_TEMPERATURE, a grammar's -inf must stay the loser."""
    fused_draw, device = _fused_draw_and_device()
    vocab, inf = 300, float("inf")
    logits = torch.full((4, vocab), -inf)
    logits[:, 7] = logits[:, 150] = PENALISED_LOGIT_LIMIT  # a tiny repetition penalty's tie
    logits[:, 290] = 3.0
    temperatures = torch.tensor([GREEDY_TEMPERATURE_EPS, 1.0, MAX_TEMPERATURE, MAX_TEMPERATURE])
    seeds, steps = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 5, 9, 11])
    logits, temperatures, seeds, steps = (x.to(device) for x in (logits, temperatures, seeds, steps))
    got = fused_draw.temperature_sample(logits, temperatures, seeds, steps).tolist()
    assert got[:2] in ([7, 7], [7, 150], [150, 7], [150, 150]) and set(got[2:]) <= {7, 150, 290}, got
    probs = torch.softmax(logits / temperatures[:, None], dim=-1)
    assert torch.isfinite(probs).all()
    assert set(fused_draw.sample_from_probs(probs, seeds, steps).tolist()) <= {7, 150, 290}


@pytest.mark.parametrize("scale", [0.01, 1.0, 3.0, 40.0], ids=["flat", "unit", "spread", "peaked"])
def test_pruned_race_draws_the_tokens_of_the_full_race(scale: float) -> None:
    """The race skips the exact noise of blocks whose bound ``l / T - log(u)`` cannot beat the best score so far
    (``PRUNE``, chapter 11). It must draw the same token as the race without skipping and as the eager sampler:
    on flat and on peaked rows (where almost every block is skipped), with grammar-masked stretches (-inf), a row
    whose winner sits in the last, partial block, exact ties of huge logits across blocks (the lowest id), and
    the extreme temperatures."""
    from minisgl_ref.sampling.sampler import temperature_sample

    fused_draw, device = _fused_draw_and_device()
    vocab, block, rows = 3000, 128, 8  # 24 blocks, the last partial: each program walks many blocks
    g = torch.Generator().manual_seed(int(scale * 100))
    logits = torch.randn(rows, vocab, generator=g) * scale
    logits[1, :2500] = -float("inf")  # a grammar allows only the tail of the row
    logits[2, 2990] += 50 * max(scale, 1.0)  # the winner in the last, partial block
    logits[3, [100, 1500, 2999]] = 1e38  # exact ties in three blocks: the lowest id wins
    logits[4, ::2] = -float("inf")
    temperatures = torch.tensor([0.6, 1.0, 0.3, 1.0, 1.7, GREEDY_TEMPERATURE_EPS, MAX_TEMPERATURE, 0.6])
    seeds = torch.tensor([0, 1, -1, 2**40 + 7, -(2**50), 2**62, 12345, 2**33])
    steps = torch.arange(rows) * 1009
    want = temperature_sample(logits, temperatures, seeds, steps).tolist()
    args = [t.to(device) for t in (logits, temperatures, seeds, steps)]
    want[3] = 100  # the eager sampler's softmax makes no ties of 1e38 (each is 1/3): the race ties, lowest id wins
    for chunks in (1, 3):
        pruned = fused_draw.temperature_sample(*args, block=block, chunks=chunks).tolist()
        full = fused_draw.temperature_sample(*args, block=block, chunks=chunks, prune=False).tolist()
        assert pruned == full == want, (chunks, pruned, full, want)
    assert want[1] >= 2500 and want[4] % 2 == 1
    assert len(set(want)) > 3  # the rows really sample


def test_start_up_compiles_every_race_variant_a_decode_step_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chapter 11: kernels compile at engine start, not inside the first requests. Triton compiles one variant per
    dtype and constexpr (``LOG_SPACE``, ``PRUNE``); ``compile_kernels`` must launch every variant that a decode
    step of any batch size will, with one block a program (small batches) and several (large ones)."""
    pytest.importorskip("triton")
    from minisgl_ref.sampling import fused_draw

    launched: set[tuple] = set()

    class Spy:  # stands in for the jitted kernel: records what each launch would compile
        def __getitem__(self, grid):  # type: ignore[no-untyped-def]
            def launch(x, *args, **constexprs):  # type: ignore[no-untyped-def]
                launched.add((x.dtype, constexprs["LOG_SPACE"], constexprs["PRUNE"], constexprs["BLOCK"]))
            return launch

    monkeypatch.setattr(fused_draw, "_kernel", lambda: Spy())
    vocab = 151_936
    fused_draw.compile_kernels(vocab, torch.device("cpu"))
    compiled, launched = launched, set()
    for rows in (1, 3, 8, 64, 128, 256):
        temps, seeds = torch.full((rows,), 0.6), torch.arange(rows)
        for dtype in (torch.bfloat16, torch.float32):
            fused_draw.temperature_sample(torch.zeros(rows, vocab, dtype=dtype), temps, seeds, seeds)
        fused_draw.sample_from_probs(torch.zeros(rows, vocab), seeds, seeds)
    assert {v[2] for v in launched} == {False, True}  # both paths occur
    assert launched <= compiled, launched - compiled


def test_fused_draw_chunk_count_fills_the_gpu_and_never_exceeds_the_blocks() -> None:
    from minisgl_ref.sampling.fused_draw import TARGET_PROGRAMS, num_chunks

    vocab, block = 151_936, 2048  # 75 blocks
    for rows in (1, 8, 64, 256, 1000, 5000):
        chunks = num_chunks(rows, vocab, block)
        assert 1 <= chunks <= 75
        assert chunks == 75 or rows * chunks >= TARGET_PROGRAMS  # fewer only when the row has no more blocks
        assert chunks == 1 or rows * (chunks - 1) < TARGET_PROGRAMS  # and no more than needed
    assert num_chunks(0, vocab, block) >= 1 and num_chunks(3, 100, block) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_split_fused_draw_picks_the_eager_token_whatever_the_split(rows: int, dtype: torch.dtype) -> None:
    """Each row's vocabulary split over several programs (the default split, one block each, and three chunks of
    up to two blocks) draws the eager functions' token; bf16 logits go to the kernel as they are and give the
    tokens of their exact float32 copy; exact ties, within a chunk and across chunks, go to the lowest id."""
    from minisgl_ref.sampling.sampler import sample_from_probs, temperature_sample

    fused_draw, device = _fused_draw_and_device()
    vocab, block = 5000, 1024  # 5 blocks, the last one partial (the interpreter pays per program and block)
    assert fused_draw.num_chunks(rows, vocab, block) == 5  # the default split is finer than chunks=3
    g = torch.Generator().manual_seed(rows)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    temperatures = torch.linspace(0.3, 1.7, rows)
    seeds = torch.tensor([0, 1, -1, 2**40 + 7, -(2**50), 2**62, -(2**63), 12345, 2**33] * 2)[:rows]
    steps = torch.arange(rows) * 1009
    on_device = [t.to(device) for t in (temperatures, seeds, steps)]

    def fused(x: torch.Tensor, chunks: int | None = None) -> list[int]:
        return fused_draw.temperature_sample(x.to(device), *on_device, block=block, chunks=chunks).tolist()

    def fused_probs(p: torch.Tensor, chunks: int | None = None) -> list[int]:
        return fused_draw.sample_from_probs(p.to(device), *on_device[1:], block=block, chunks=chunks).tolist()

    want = temperature_sample(logits.float(), temperatures, seeds, steps).tolist()
    assert rows == 1 or len(set(want)) > 1  # the rows really sample
    assert fused(logits) == want and fused(logits, chunks=3) == want
    # Exact ties: a logit so large that ``l / T - log E`` rounds to it whatever the noise, at ids in three
    # chunks (the last in the partial block); the lowest must win.
    tied = [4999, 2100, 301, 300]
    big = logits.clone()
    big[:, tied] = 1e38
    assert fused(big, chunks=3) == [300] * rows
    if dtype != torch.float32:
        return  # probabilities are float32 whatever the logits were
    probs = torch.softmax(logits / temperatures[:, None], dim=-1)
    probs[:, ::3] = 0.0  # filtered out: a zero probability must never win
    assert fused_probs(probs) == sample_from_probs(probs, seeds, steps).tolist()
    probs[:, tied[:2]] = float("inf")  # an infinite score in two chunks
    assert fused_probs(probs, chunks=3) == [2100] * rows
    assert fused_probs(torch.zeros(rows, vocab), chunks=3) == [0] * rows  # every score is 0: the first id wins


def test_sampler_hands_bf16_logits_to_the_fused_draw_on_the_plain_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain temperature sampling passes bf16 logits to the kernel as they are (no float32 copy), greedy rows
    beside it take the argmax of the bf16 logits, and the tokens are those of the eager sampler on the float32
    copy; a path with penalties still converts first."""
    fused_draw, device = _fused_draw_and_device()
    if device == "cpu":
        monkeypatch.setattr(fused_draw, "available", lambda x: True)  # the interpreter stands in for the GPU
    dtypes = []
    real = fused_draw.temperature_sample

    def spy(logits: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # type: ignore[no-untyped-def]
        dtypes.append(logits.dtype)
        return real(logits, *args, **kwargs)

    monkeypatch.setattr(fused_draw, "temperature_sample", spy)
    vocab = 3000
    logits = (torch.randn(4, vocab, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    logits[1] = 0.5  # a greedy row of equal logits: the lowest id
    params = [SamplingParams(seed=1, temperature=0.8), SamplingParams(temperature=0),
              SamplingParams(seed=3, temperature=1.3), SamplingParams(top_k=1, seed=4)]
    info = SamplingBatchInfo.build(params, [[]] * 4, None, None, vocab, device)
    want = Sampler(fuse_on_cuda=False)(logits.float().to(device), info).tolist()
    assert Sampler()(logits.to(device), info).tolist() == want and dtypes == [torch.bfloat16]
    assert want[1] == 0 and want[3] == int(logits[3].float().argmax())
    params[0] = SamplingParams(seed=1, temperature=0.8, presence_penalty=0.5)
    info = SamplingBatchInfo.build(params, [[]] * 4, None, None, vocab, device)
    assert Sampler()(logits.to(device), info).tolist() == want and dtypes[-1] == torch.float32


# The race kernel compiled for an H100 (sm_90) in a process without Triton's interpreter: Triton compiles for a GPU
# it does not have. Prints, per (FAST_LOG, PRUNE), the PTX's lines and its lg2.approx instructions.
_RACE_PTX = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minisgl_ref.sampling.race_kernel import race_kernel

sig = {"x": "*bf16", "stride_x": "i64", "inv_temperatures": "*fp32", "seeds": "*i64", "steps": "*i64",
       "chunk_scores": "*fp32", "chunk_ids": "*i64", "vocab_size": "i32", "chunk_size": "i32",
       "LOG_SPACE": "constexpr", "BLOCK": "constexpr", "FAST_LOG": "constexpr", "PRUNE": "constexpr"}
counts = {}
for fast in (False, True):
    for prune in (False, True):
        consts = {"LOG_SPACE": True, "BLOCK": 2048, "FAST_LOG": fast, "PRUNE": prune}
        ptx = triton.compile(ASTSource(fn=race_kernel, signature=sig, constexprs=consts),
                             target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
        counts[f"{fast},{prune}"] = [ptx.count("\n"), ptx.count("lg2.approx")]
print(json.dumps(counts))
"""


def test_race_kernel_takes_the_approximate_logarithm_for_the_score_and_the_bound_only() -> None:
    """Chapter 11: compiled for an H100 with FAST_LOG, each of a thread's 8 entries per block (2,048 entries, 256
    threads) gets exactly one lg2.approx for its score and, when the kernel prunes, one more for its bound, while
    the logarithm inside log1p stays the exact routine; without FAST_LOG (what Triton's interpreter runs) there is
    none, and the kernel is longer."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _RACE_PTX], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    counts = json.loads(run.stdout.strip().splitlines()[-1])
    per_thread = 2048 // 256
    for prune in (False, True):
        (exact_lines, exact_lg2), (fast_lines, fast_lg2) = counts[f"False,{prune}"], counts[f"True,{prune}"]
        assert exact_lg2 == 0 and fast_lg2 == per_thread * (2 if prune else 1)
        assert fast_lines < 0.9 * exact_lines
