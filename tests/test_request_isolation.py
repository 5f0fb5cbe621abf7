"""A failure inside one request aborts that request only (chapters 06 and 10).

A server runs many clients' requests in one batch. If one request's data breaks a step (an id outside the
vocabulary that slipped past a check, a detokenizer that throws), the engine must abort *that* request, keep
every other one going with exactly the tokens it would have produced anyway, and leave the KV pool as clean as
after any other run. Each test injects a failure into one request of a batch of several and checks just that,
with and without overlap scheduling.
"""

from __future__ import annotations

import random

import pytest

from minisgl_ref import SamplingParams
from minisgl_ref.core.request import Req
from tests.engine_fixtures import (
    assert_pool_accounting,
    drive,
    make_engine,
    make_reqs,
    oracle,
    tiny_engine_path,  # noqa: F401 - fixture
    tiny_llm,  # noqa: F401 - fixture
)

VOCAB = 320  # the tiny model's


def prompts_and_params(seed: int = 5, n: int = 4) -> tuple[list[list[int]], SamplingParams]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(8, 40))] for _ in range(n)]
    return prompts, SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)


def test_bad_token_ids_are_refused_at_the_door(tiny_llm):
    """The crash seen on the server (an out-of-vocabulary stop id plus min_new_tokens): refused before the
    request enters the engine, with a ValueError naming the field."""
    engine = make_engine(tiny_llm)
    bad = [
        ("stop_token_ids", SamplingParams(stop_token_ids=[VOCAB + 5], min_new_tokens=1)),
        ("stop_token_ids", SamplingParams(stop_token_ids=[VOCAB])),  # refused with or without min_new_tokens
        ("logit_bias", SamplingParams(logit_bias={str(VOCAB * 10): 5.0})),
    ]
    for field, params in bad:
        with pytest.raises(ValueError, match=field):  # the offline API refuses it ...
            tiny_llm.make_request([5, 6, 7], params)
        with pytest.raises(ValueError, match=field):  # ... and so does the engine, for any other caller
            engine.add_request(Req(input_ids=[5, 6, 7], params=params))
    assert not engine.has_work


def test_prompt_ids_are_checked_whole(tiny_llm):
    """The prompt checks (run over every id of a burst, so done in C rather than id by id) refuse the same
    prompts as the id-by-id rule: a bool, a float, a ``str``, an id on either side of the vocabulary,
    at the start, the middle or the end of a long prompt; an ``int`` subclass other than bool passes."""
    from enum import IntEnum

    from minisgl_ref.core.request import are_token_ids, first_outside

    class Tok(IntEnum):
        A = 7

    params = SamplingParams(max_new_tokens=1)
    long = list(range(3, VOCAB)) * 2  # within the tiny model's context of 1,024
    for where in (0, len(long) // 2, len(long) - 1):
        for bad, err in ((True, "non-empty list of token ids"), (5.0, "non-empty list of token ids"),
                         ("5", "non-empty list of token ids"), (-1, r"\[0, 320\)"), (VOCAB, r"\[0, 320\)")):
            prompt = long[:where] + [bad] + long[where + 1 :]
            with pytest.raises(ValueError, match=err):
                tiny_llm.make_request(prompt, params)
            assert not are_token_ids(prompt) or first_outside(prompt, VOCAB) == bad
    assert are_token_ids([Tok.A, 5]) and not are_token_ids([False])
    assert first_outside([0, VOCAB - 1], VOCAB) is None and first_outside([4, VOCAB + 3, -2], VOCAB) == VOCAB + 3
    assert tiny_llm.make_request(long + [Tok.A], params).input_ids[-1] == 7


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_a_request_that_breaks_its_step_is_aborted_alone(tiny_llm, overlap):
    """One request's stop ids are corrupted while it waits for a slot (so the door check is bypassed). When it
    is admitted, its prefill rides in one step with the others' decode rows (mixed chunk), and building that
    step's sampling state fails for the whole batch. The engine rolls the step back, aborts that request with a
    message naming the problem, and the others finish with the oracle's tokens."""
    prompts, _ = prompts_and_params()
    params = [SamplingParams(temperature=0, max_new_tokens=m, ignore_eos=True) for m in (3, 12, 12, 12)]
    engine = make_engine(tiny_llm, disable_overlap_schedule=not overlap, max_running_requests=3,
                         enable_mixed_chunk=True)
    expected = oracle(tiny_llm, prompts, params)
    reqs = make_reqs(tiny_llm, prompts, params)
    victim = reqs[3]
    victim.params = SamplingParams(**{**params[3].to_dict()})  # its own copy, to corrupt

    def corrupt_while_waiting(eng, trace) -> None:
        if victim in eng.scheduler.waiting and not victim.params.stop_token_ids:
            victim.params.stop_token_ids = [VOCAB + 7]
            victim.params.min_new_tokens = 5

    trace = drive(engine, reqs, on_step=corrupt_while_waiting)
    assert victim.finish_reason.kind == "abort" and victim.output_ids == []
    assert "stop_token_ids" in victim.finish_reason.message and str(VOCAB + 7) in victim.finish_reason.message
    for i in range(3):
        assert reqs[i].output_ids == expected[i].ids, f"request {i} was disturbed"
        assert reqs[i].finish_reason.kind == "length"
    assert any(victim in [e.req for e in step] for step in trace.events), "the abort was never reported"
    assert engine.scheduler.num_retractions >= 1  # the others were sent back and prefilled again
    assert_pool_accounting(engine)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_a_failure_while_appending_a_token_aborts_that_request(tiny_llm, overlap):
    """The detokenizer of one request throws on its 4th token: that request ends with an abort (its output so
    far kept), the others are untouched."""
    prompts, params = prompts_and_params(seed=9)
    engine = make_engine(tiny_llm, disable_overlap_schedule=not overlap)
    reqs = make_reqs(tiny_llm, prompts, params)
    victim = reqs[1]

    class FlakyDetokenizer:  # the tiny model has no tokenizer: a stand-in that fails on the 4th token
        matched_stop, output_text = None, ""

        def step(self, ids: list[int]) -> str:
            if len(victim.output_ids) == 4:
                raise RuntimeError("injected detokenizer failure")
            return ""

        def finish(self) -> str:
            return ""

    victim.detokenizer = FlakyDetokenizer()
    drive(engine, reqs)
    assert victim.finish_reason.kind == "abort" and "injected detokenizer failure" in victim.finish_reason.message
    assert len(victim.output_ids) == 4
    expected = oracle(tiny_llm, prompts, params)
    assert victim.output_ids == expected[1].ids[:4]
    for i in (0, 2, 3):
        assert reqs[i].output_ids == expected[i].ids
    assert_pool_accounting(engine)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_a_step_failure_nobody_can_be_blamed_for_aborts_that_step_only(tiny_llm, overlap):
    """The model runner fails once for a reason no request's check explains (think: out of device memory): the
    requests of that step are aborted with the error, and the engine goes on serving a request that arrives
    afterwards, with the oracle's tokens."""
    prompts, params = prompts_and_params(seed=11, n=3)
    engine = make_engine(tiny_llm, disable_overlap_schedule=not overlap)
    reqs = make_reqs(tiny_llm, prompts, params)
    real_run = engine.runner.run
    calls = 0

    def failing_run(batch):
        nonlocal calls
        calls += 1
        if calls == 4:
            raise RuntimeError("injected device failure")
        return real_run(batch)

    engine.runner.run = failing_run
    drive(engine, reqs)
    assert all(r.finish_reason.kind == "abort" and "injected device failure" in r.finish_reason.message
               for r in reqs)
    assert_pool_accounting(engine)

    later = make_reqs(tiny_llm, prompts[:1], params)
    drive(engine, later)
    assert later[0].output_ids == oracle(tiny_llm, prompts[:1], params)[0].ids
    assert_pool_accounting(engine)


def test_abort_all_leaves_a_clean_engine(tiny_llm):
    """The scheduler process's last resort: every request aborted, nothing half-written left in the cache."""
    prompts, params = prompts_and_params(seed=13)
    engine = make_engine(tiny_llm)
    reqs = make_reqs(tiny_llm, prompts, params)
    for r in reqs:
        engine.add_request(r)
    for _ in range(3):
        engine.step()
    events = engine.abort_all("injected")
    assert {id(e.req) for e in events} == {id(r) for r in reqs}
    assert all(r.finish_reason.kind == "abort" for r in reqs)
    assert_pool_accounting(engine)
    later = make_reqs(tiny_llm, prompts[:1], params)
    drive(engine, later)
    assert later[0].output_ids == oracle(tiny_llm, prompts[:1], params)[0].ids
