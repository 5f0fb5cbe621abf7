"""Helpers for the engine-core tests (chapters 03-06): a context-sensitive tiny model, the chapter-00 oracle,
a step-by-step driver for the paged engine, and the KV bookkeeping invariants every run must end in.

Import the fixtures into a test module (``from tests.engine_fixtures import tiny_llm, ...``): pytest only sees
fixtures that are defined in, or imported into, the test module or a conftest.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import pytest
import torch

from minisgl_ref import LLM, SamplingParams
from minisgl_ref.core.batch import ScheduledBatch
from minisgl_ref.core.config import EngineConfig
from minisgl_ref.core.request import Req
from minisgl_ref.engine.engine import Engine, StepEvent
from minisgl_ref.engine.naive import NaiveEngine
from tests.conftest import TINY

# The tiny Llama of tests/conftest.py (TINY), with more positions and initializer_range=0.1 (HF's default is
# 0.02), which makes attention matter: with it, changing a single early prompt token flips the greedy next token
# for a large share of prompts, so a request that reads one wrong KV slot (aliased page, stale slot, wrong
# position) produces different greedy tokens than the oracle instead of silently agreeing with it. Greedy margins
# stay far above float32 noise (the smallest seen is ~1e-3).
TINY_ENGINE_MODEL = dict(TINY, max_position_embeddings=1024, initializer_range=0.1)
TINY_EOS = 2  # LlamaConfig's default eos_token_id; prompts below avoid relying on it (ignore_eos or own eos sets)


@pytest.fixture(scope="session")
def tiny_engine_path(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY_ENGINE_MODEL), dtype=torch.float32)
    folder = tmp_path_factory.mktemp("tiny_engine_llama")
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llm(tiny_engine_path) -> LLM:
    """The chapter-00 oracle on the tiny model (float32, CPU). Paged engines under test share its model."""
    return LLM(tiny_engine_path, device="cpu", engine="naive")


@pytest.fixture(scope="session")
def smol_llm() -> LLM:
    """The chapter-00 oracle on the embedded SmolLM2-135M (loaded once for all engine-core tests)."""
    return LLM(device="cpu", engine="naive")


# ------------------------------------------------------------------------------------------------ building


def make_engine(llm: LLM, **config) -> Engine:
    """A fresh paged engine (chapters 03-06) on ``llm``'s model: same weights as the oracle, new KV pool."""
    return Engine(llm.model, llm.config, EngineConfig(**config), device="cpu", context_length=llm.context_length)


def make_reqs(llm: LLM, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
              eos: frozenset[int] | None = None) -> list[Req]:
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    reqs = [llm.make_request(list(p), sp) for p, sp in zip(prompts, params)]
    if eos is not None:
        for r in reqs:
            r.eos_token_ids = eos
    for r in reqs:  # greedy runs need no seed, but keep both engines' requests identical anyway
        r.sampling_seed = 1234
    return reqs


class Expected(NamedTuple):
    ids: list[int]
    kind: str  # finish reason
    matched: object  # the stop token id or string, if any
    text: str


_ORACLE_CACHE: dict[object, list[Expected]] = {}


def oracle(llm: LLM, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
           eos: frozenset[int] | None = None) -> list[Expected]:
    """What the chapter-00 naive loop makes of each prompt (memoized: several tests share a workload)."""
    plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    key = (id(llm.model), tuple(tuple(p) for p in prompts), tuple(repr(p) for p in plist), eos)
    if key not in _ORACLE_CACHE:
        reqs = make_reqs(llm, prompts, plist, eos)
        NaiveEngine(llm.model, llm.config.vocab_size, "cpu").run(reqs)
        _ORACLE_CACHE[key] = [Expected(list(r.output_ids), r.finish_reason.kind, r.finish_reason.matched,
                                       r.output_text) for r in reqs]
    return _ORACLE_CACHE[key]


# ------------------------------------------------------------------------------------------------ driving


@dataclass
class Trace:
    """What happened during a run, step by step."""

    events: list[list[StepEvent]] = field(default_factory=list)  # per engine.step() call
    launched: list[ScheduledBatch] = field(default_factory=list)  # every batch the model runner ran, in order
    fed: list[tuple[Req, list[int], list[int]]] = field(default_factory=list)  # (req, positions, input ids) per row
    max_running: int = 0

    def tokens_per_step(self, req: Req) -> list[int]:
        return [sum(e.req is req for e in step) for step in self.events]


def drive(engine: Engine, reqs: Sequence[Req], *, check_every_step: bool = True,
          on_step: Callable[[Engine, Trace], None] | None = None, max_steps: int = 10_000) -> Trace:
    """Add ``reqs`` and step the engine until it has no work, recording events and launched batches. With
    ``check_every_step`` the KV invariants (:func:`check_live_invariants`) are asserted after every step."""
    trace = Trace()
    run = engine.runner.run

    def recording_run(batch: ScheduledBatch):
        trace.launched.append(batch)
        out = run(batch)
        fb = out.forward_batch
        ids, pos, start = fb.input_ids.tolist(), fb.positions.tolist(), 0
        for row in batch.rows:
            end = start + row.extend_len
            trace.fed.append((row.req, pos[start:end], ids[start:end]))
            start = end
        return out

    engine.runner.run = recording_run  # type: ignore[method-assign]
    try:
        for r in reqs:
            engine.add_request(r)
        steps = 0
        while engine.has_work:
            trace.events.append(engine.step())
            sched = engine.scheduler
            trace.max_running = max(trace.max_running, sched.num_running)
            if check_every_step:
                check_live_invariants(engine)
            if on_step is not None:
                on_step(engine, trace)
            steps += 1
            assert steps < max_steps, "the engine did not finish"
    finally:
        engine.runner.run = run  # type: ignore[method-assign]
    check_fed_tokens(trace)
    return trace


def check_fed_tokens(trace: Trace) -> None:
    """Every token the model was fed sat at its true position: row ids == the request's final all_ids there.

    This is ModelRunner.prepare's contract (task 3.3), including decode inputs that come from the device-side
    token buffer under overlap, and the extra row overlap computes for a request that has just finished."""
    for req, positions, ids in trace.fed:
        seq = req.all_ids
        assert positions == list(range(positions[0], positions[0] + len(positions))), positions
        assert positions[-1] < len(seq), f"{req.rid} was fed position {positions[-1]} beyond its {len(seq)} tokens"
        assert ids == [seq[p] for p in positions], f"{req.rid}: fed {ids} at {positions}, its tokens differ"


# ------------------------------------------------------------------------------------------------ invariants


def pages_of(slots: torch.Tensor | Sequence[int], page_size: int) -> set[int]:
    return set((torch.as_tensor(slots, dtype=torch.int64).flatten() // page_size).tolist())


def tree_nodes(engine: Engine) -> list:
    return engine.cache.tree._all_nodes()


def tree_pages(engine: Engine) -> list[int]:
    """Every page the radix tree owns, with repeats if two nodes claim the same page (which is a bug)."""
    ps = engine.allocator.page_size
    out: list[int] = []
    for node in tree_nodes(engine):
        out.extend(sorted(pages_of(node.value, ps)))
    return out


def check_free_list(engine: Engine) -> None:
    free = list(engine.allocator._free)
    assert len(free) == len(set(free)), f"a page is on the free list twice: {sorted(free)}"
    assert 0 not in free, "the reserved dummy page 0 was freed"
    assert all(0 < p < engine.allocator.num_pages for p in free), "a page id outside the pool was freed"


def live_request_pages(engine: Engine) -> dict[int, Req]:
    """Pages referenced by any request that holds a page-table row (slots 0 .. kv_allocated_len)."""
    ps = engine.allocator.page_size
    owners: dict[int, Req] = {}
    sched = engine.scheduler
    reqs = list(sched.running) + list(sched.waiting) + ([sched.chunked] if sched.chunked else [])
    if engine.inflight is not None:
        reqs += engine.inflight.batch.reqs
    for r in reqs:
        if r.req_pool_idx is None or r.finished:
            continue
        row = engine.req_to_token.read(r.req_pool_idx, r.kv_allocated_len)
        for p in pages_of(row, ps):
            owners[p] = r
    return owners


def check_live_invariants(engine: Engine) -> None:
    """After any step: the free list is sane, and no page that a live request or the tree uses is free."""
    check_free_list(engine)
    free = set(engine.allocator._free)
    in_tree = tree_pages(engine)
    assert len(in_tree) == len(set(in_tree)), "two radix nodes own the same page"
    assert not free & set(in_tree), f"pages both free and cached in the tree: {sorted(free & set(in_tree))}"
    live = live_request_pages(engine)
    both = free & set(live)
    assert not both, f"pages both free and in a live request's page-table row: {sorted(both)}"
    assert 0 not in live, "a request's page-table row points at the dummy page 0"


def assert_pool_accounting(engine: Engine) -> None:
    """After a run: nothing pending, no request slot leaked, the scheduler forgot every finished request, and
    free pages + evictable tokens == capacity."""
    sched = engine.scheduler
    assert engine.inflight is None and not engine.has_work
    assert not sched.waiting and not sched.running and sched.chunked is None and not sched.aborted
    assert not sched.arrival, "the scheduler still tracks finished requests"
    assert not engine.frees.in_flight and engine.frees.num_parked == 0, "frees still pending"
    assert engine.req_to_token.num_free == engine.req_to_token.max_requests, "a request slot leaked"
    assert sorted(engine.req_to_token._free) == list(range(engine.req_to_token.max_requests))
    check_free_list(engine)
    tree = engine.cache.tree
    assert tree.protected_size == 0, "a finished request still pins radix nodes"
    assert all(n.lock_ref == 0 for n in tree_nodes(engine))
    ps = engine.allocator.page_size
    assert engine.allocator.num_free_pages * ps + engine.cache.evictable_tokens == engine.max_total_tokens
    if engine.cache.shares_prefixes:
        assert tree.evictable_size == tree.total_size
        in_tree = tree_pages(engine)
        assert len(in_tree) * ps == tree.total_size, "tree nodes hold partial pages"
        assert not set(in_tree) & set(engine.allocator._free)
        assert set(in_tree) | set(engine.allocator._free) == set(range(1, engine.allocator.num_pages))
    else:
        assert tree.total_size == 0


def assert_matches_oracle(reqs: Sequence[Req], expected: Sequence[Expected]) -> None:
    assert len(reqs) == len(expected)
    for i, (r, exp) in enumerate(zip(reqs, expected)):
        assert r.output_ids == exp.ids, f"request {i}: paged {r.output_ids} != oracle {exp.ids}"
        assert r.finish_reason is not None and r.finish_reason.kind == exp.kind, (i, r.finish_reason, exp.kind)
        assert r.finish_reason.matched == exp.matched, (i, r.finish_reason, exp.matched)
        assert r.output_text == exp.text, (i, r.output_text, exp.text)


# ------------------------------------------------------------------------------------------------ workloads


def shared_prefix_workload(seed: int = 0, vocab: int = 320) -> tuple[list[list[int]], list[SamplingParams]]:
    """Ten prompts: four share a 48-token prefix, one is a strict prefix of another, two are identical, the rest
    are unrelated; lengths 9..84; max_new_tokens 1..20; ignore_eos so every length is exercised."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    system = toks(48)
    a = toks(30)
    prompts = [
        system + toks(5),
        system + toks(17),
        system + toks(1),
        system + toks(36),
        a,  # a strict prefix of the next prompt
        a + toks(22),
        toks(9),  # the shortest prompt
        toks(61),
        toks(13),
        toks(13),
    ]
    prompts.append(list(prompts[-1]))  # an identical twin
    max_new = [7, 40, 1, 24, 33, 5, 38, 9, 2, 30, 30]
    params = [SamplingParams(temperature=0, max_new_tokens=m, ignore_eos=True) for m in max_new]
    return prompts, params
