"""The engine's seam (:mod:`minisgl_ref.engine.extension`): the core runs alone, and an extension's hooks are
called where the seam says, with effects that show in the outputs.

The core alone (no extension) must give the oracle's tokens. A test extension then uses every hook on a batch of
six requests, each singled out for one hook: a logits processor bans one token in one request's rows, a token
hook refuses a token, another ends a request or adds text, a readiness test holds a request back for a few
steps, a door check refuses a request. The untouched requests must still give the oracle's tokens, with overlap
scheduling on and off.
"""

from __future__ import annotations

import random

import pytest
import torch

from minisgl_ref import SamplingParams
from minisgl_ref.core.batch import ScheduledBatch
from minisgl_ref.core.request import Req
from minisgl_ref.engine.extension import EngineExtension, EngineView, LogitsProcessor, overrides
from minisgl_ref.engine.step import Launched, StepEvent
from tests.engine_fixtures import (
    assert_matches_oracle,
    assert_pool_accounting,
    drive,
    make_engine,
    make_reqs,
    oracle,
    tiny_engine_path,  # noqa: F401 - fixture
    tiny_llm,  # noqa: F401 - fixture
)

VOCAB = 320  # the tiny model's
PARAMS = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(8, 40))] for _ in range(n)]


@pytest.mark.parametrize("overlap", [False, True])
def test_the_core_alone_runs_requests_like_the_oracle(tiny_llm, overlap):
    """An engine given no extension: no hook to call, no readiness test for the scheduler, and the oracle's
    tokens."""
    engine = make_engine(tiny_llm, disable_overlap_schedule=not overlap)
    assert engine.extensions.all == [] and engine.scheduler.ready is None
    ps = prompts(1, 4)
    reqs = make_reqs(tiny_llm, ps, PARAMS)
    drive(engine, reqs)
    assert_matches_oracle(reqs, oracle(tiny_llm, ps, PARAMS))
    assert_pool_accounting(engine)


class Probe(EngineExtension):
    """Every hook, each acting on one request (set the requests before the run)."""

    def __init__(self) -> None:
        self.banned: tuple[Req, int] | None = None  # (request, token) the logits processor bans in its rows
        self.refused: Req | None = None  # its third token is refused
        self.ended: Req | None = None  # ended by after_token at its fifth token
        self.marked: Req | None = None  # after_token adds "+" to each of its tokens
        self.held: Req | None = None  # not ready before the third step
        self.bound: EngineView | None = None
        self.admitted: list[Req] = []
        self.before_steps = 0
        self.launched: list[tuple[int, list[Req], bool]] = []  # (before_steps then, the batch's requests, banned?)
        self.processed: list[tuple[Launched, list[StepEvent]]] = []

    def bind(self, engine: EngineView) -> None:
        self.bound = engine

    def check(self, req: Req) -> str | None:
        return "max_new_tokens=7 is not served here" if req.params.max_new_tokens == 7 else None

    def admit(self, req: Req) -> None:
        self.admitted.append(req)

    def ready(self, req: Req) -> bool:
        return req is not self.held or self.before_steps >= 3

    def before_step(self) -> None:
        self.before_steps += 1

    def logits_processor(self, batch: ScheduledBatch, inflight: Launched | None) -> LogitsProcessor | None:
        assert self.banned is not None
        req, token = self.banned
        rows = [i for i, row in enumerate(batch.rows) if row.req is req and row.emits]
        self.launched.append((self.before_steps, batch.reqs, bool(rows)))
        if not rows:
            return None

        def ban(logits: torch.Tensor) -> None:
            logits[rows, token] = float("-inf")

        return ban

    def before_token(self, launched: Launched, i: int, token: int) -> str | None:
        req = launched.batch.rows[i].req
        return "refused by the probe" if req is self.refused and len(req.output_ids) == 2 else None

    def after_token(self, launched: Launched, i: int, token: int) -> str:
        req = launched.batch.rows[i].req
        if req is self.ended and len(req.output_ids) == 5:
            return req.finish_by_stop_token(token)
        return "+" if req is self.marked else ""

    def after_step(self, launched: Launched, events: list[StepEvent]) -> None:
        self.processed.append((launched, events))


@pytest.mark.parametrize("overlap", [False, True])
def test_an_extensions_hooks_are_called_and_act(tiny_llm, overlap):
    ps = prompts(2, 6)
    expected = oracle(tiny_llm, ps, PARAMS)
    banned_req, refused, ended, marked, held, free = reqs = make_reqs(tiny_llm, ps, PARAMS)
    token = expected[0].ids[3]  # a token the oracle's greedy run of the first request samples
    first = expected[0].ids.index(token)
    probe = Probe()
    probe.banned, probe.refused, probe.ended = (banned_req, token), refused, ended
    probe.marked, probe.held = marked, held
    engine = make_engine(tiny_llm, disable_overlap_schedule=not overlap)
    engine.extensions.attach(probe)
    assert probe.bound is engine and engine.scheduler.ready is not None
    assert all(overrides(probe, hook) for hook in ("check", "ready", "logits_processor", "after_step"))

    with pytest.raises(ValueError, match="max_new_tokens=7 is not served here"):
        engine.add_request(make_reqs(tiny_llm, ps[:1], SamplingParams(temperature=0, max_new_tokens=7))[0])
    for r in reqs:
        engine.add_request(r)
    assert probe.admitted == reqs  # the refused request was never admitted
    returned: list[StepEvent] = []
    calls = 0
    while engine.has_work:
        returned += engine.step()
        calls += 1

    # logits_processor: the banned token never appears in that request's output, which follows the oracle up to
    # where the oracle sampled it; the other requests' rows were not touched.
    assert token not in banned_req.output_ids and banned_req.output_ids[:first] == expected[0].ids[:first]
    assert banned_req.output_ids != expected[0].ids
    assert any(was_banned for _, _, was_banned in probe.launched)
    # before_token: the refused token aborts its request, with the reason, and is not appended.
    assert refused.finish_reason.kind == "abort" and refused.finish_reason.message == "refused by the probe"
    assert refused.output_ids == expected[1].ids[:2]
    # after_token: one request ended at its fifth token; another got "+" with each token that left it running
    # (the last one ended it by length: nothing may follow).
    assert (ended.finish_reason.kind, ended.finish_reason.matched) == ("stop", expected[2].ids[4])
    assert ended.output_ids == expected[2].ids[:5]
    assert [e.delta for e in returned if e.req is marked] == ["+"] * (PARAMS.max_new_tokens - 1) + [""]
    # ready: the held request ran in no step launched before the third, and then ran like the others.
    assert all(held not in batch for seen, batch, _ in probe.launched if seen < 3)
    assert any(held in batch for _, batch, _ in probe.launched)
    assert_matches_oracle([marked, held, free], [expected[3], expected[4], expected[5]])
    # before_step: once per step() call; after_step: once per processed step, with exactly its events.
    assert probe.before_steps == calls
    assert [launched.batch.reqs for launched, _ in probe.processed] == [batch for _, batch, _ in probe.launched]
    assert len(probe.processed) == engine.stats.steps
    assert [id(e) for _, events in probe.processed for e in events] == [id(e) for e in returned]
    assert_pool_accounting(engine)

    engine.extensions.detach(probe)
    assert engine.scheduler.ready is None and engine.extensions.all == []
    calls_so_far = (probe.before_steps, len(probe.admitted), len(probe.launched), len(probe.processed))
    again = make_reqs(tiny_llm, ps[:1], PARAMS)
    drive(engine, again)
    assert_matches_oracle(again, expected[:1])  # nothing is banned any more
    assert (probe.before_steps, len(probe.admitted), len(probe.launched), len(probe.processed)) == calls_so_far


@pytest.mark.parametrize("field", ["json_schema", "regex", "ebnf"])
def test_a_field_no_extension_claims_is_refused_by_name(tiny_llm, field):
    """A core engine cannot honour a grammar by itself: without an extension that claims the field, the request is
    refused at the door with the field's name, never run as if the field were not there."""
    value = {"json_schema": '{"type": "object"}', "regex": "[ab]+", "ebnf": 'root ::= "a"'}[field]
    engine = make_engine(tiny_llm)
    req = Req(prompts(2, 1)[0], SamplingParams(max_new_tokens=4, **{field: value}))
    with pytest.raises(ValueError, match=f"^{field} is not supported by this engine"):
        engine.add_request(req)
    assert not engine.has_work

    class Claims(EngineExtension):
        claims = frozenset({field})

    claimed = make_engine(tiny_llm)
    claimed.extensions.attach(Claims())
    assert claimed.request_problem(req) is None


class Watcher(EngineExtension):
    """Counts its token hook calls; watches tokens only while ``on``."""

    def __init__(self) -> None:
        self.on, self.calls = False, 0

    def watches_tokens(self) -> bool:
        return self.on

    def before_token(self, launched: Launched, i: int, token: int) -> str | None:
        self.calls += 1
        return None


def test_token_hooks_run_only_in_steps_an_extension_watches(tiny_llm):
    engine = make_engine(tiny_llm)
    watcher = Watcher()
    engine.extensions.attach(watcher)
    drive(engine, make_reqs(tiny_llm, prompts(3, 2), PARAMS))
    assert watcher.calls == 0
    watcher.on = True
    reqs = make_reqs(tiny_llm, prompts(4, 2), PARAMS)
    drive(engine, reqs)
    assert watcher.calls == sum(len(r.output_ids) for r in reqs) == 2 * PARAMS.max_new_tokens
