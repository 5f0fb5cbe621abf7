"""The engine core (chapters 03-06) against the chapter-00 oracle, and the pitfalls it must avoid.

Most tests here compare the paged engine's greedy tokens with ``LLM(engine="naive")`` (float32, CPU: they must be
*equal*, not close) and then check the KV bookkeeping the run leaves behind. The big configuration matrix runs on
a tiny random Llama (tests/engine_fixtures.py); a smaller one on the embedded SmolLM2-135M with chat prompts.

The graded tests of each task come first, each a few focused checks that run in seconds. They play the engine's
part by hand where they can (a scheduler without a model, a model runner fed hand-made rows, ``InflightFrees``
alone), and they run the engine only in the configurations the task's chapter has reached: chapter 03's tests
without the radix cache, chunking or overlap (``CH03``), chapter 05's without overlap, so that a task is graded
on its own code and on earlier chapters' only.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from minisgl_ref import LLM, SamplingParams
from minisgl_ref.attention.torch_native import TorchNativeBackend
from minisgl_ref.core.batch import Row, ScheduledBatch
from minisgl_ref.core.config import EngineConfig
from minisgl_ref.core.forward_batch import ForwardMode
from minisgl_ref.core.request import Req
from minisgl_ref.engine.engine import Engine, LaunchFailed, Launched
from minisgl_ref.engine.attention_planner import AttentionPlanner
from minisgl_ref.engine.model_runner import ModelRunner
from minisgl_ref.kvcache import KVPool, OutOfPages, PageAllocator, ReqToTokenPool
from minisgl_ref.kvcache.inflight import InflightFrees
from minisgl_ref.scheduler.cache_manager import NaiveCacheManager
from minisgl_ref.scheduler.scheduler import NEED_SYNC, Scheduler
from tests.engine_fixtures import (
    Trace,
    assert_matches_oracle,
    assert_pool_accounting,
    check_free_list,
    drive,
    make_engine,
    make_reqs,
    oracle,
    pages_of,
    shared_prefix_workload,
    smol_llm,  # noqa: F401  (fixture)
    tiny_engine_path,  # noqa: F401  (fixture)
    tiny_llm,  # noqa: F401  (fixture)
)

# A pool of 224 tokens makes the matrix workload retract in every configuration (it needs ~560 tokens of KV in
# all), yet holds any one request at its largest (108 tokens, <= 7 pages of 16) next to any other at its largest:
# so the scheduler never has a reason to abort a request. init/min_new_token_ratio = 0 makes admission reserve
# nothing for future output tokens, so decode growth must retract instead of being avoided by a cautious admission.
SMALL_POOL = dict(max_total_tokens=224, init_new_token_ratio=0.0, min_new_token_ratio=0.0)
# The engine as chapter 03 builds it: no radix cache (chapter 04), no chunked prefill (05), no overlap (06).
CH03 = dict(disable_radix_cache=True, chunked_prefill_size=-1, disable_overlap_schedule=True)
# What chapters 04 and 05 may use: everything but overlap (06) and the radix cache where it plays no part.
NO_OVERLAP = dict(disable_radix_cache=True, disable_overlap_schedule=True)


def rand_tokens(rng: random.Random, n: int, vocab: int = 320) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def greedy(max_new: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=max_new, **kw)


def emitting_rows(trace: Trace, req: Req) -> int:
    """How many launched rows were going to produce a token for ``req`` (the extra overlap rows included)."""
    return sum(row.emits for b in trace.launched for row in b.rows if row.req is req)


# ------------------------------------------------------------------------------------------------ 0. by hand
#
# The scheduler, the model runner and InflightFrees without an engine around them: each test plays the engine's
# part itself, so a wrong decode row, batch or free shows up as the exact value that is wrong.


def bare_scheduler(total_tokens: int, page_size: int = 1, **config) -> Scheduler:
    """A scheduler over a naive cache manager and no model. The configuration is chapter 03's (no radix cache, no
    chunking, no overlap) and admission reserves nothing for future output unless ``config`` says otherwise."""
    cfg = CH03 | dict(init_new_token_ratio=0.0, min_new_token_ratio=0.0) | config
    allocator = PageAllocator(total_tokens // page_size + 1, page_size)
    req_to_token = ReqToTokenPool(EngineConfig(**cfg).max_running_requests + 1, 256)
    return Scheduler(EngineConfig(**cfg), NaiveCacheManager(allocator, req_to_token))


def toy_req(n_prompt: int, max_new: int = 8, first: int = 3) -> Req:
    return Req(list(range(first, first + n_prompt)), greedy(max_new, ignore_eos=True))


def play(sched: Scheduler, batch: ScheduledBatch, token: int = 7) -> None:
    """What the engine does with a step's result when nothing overlaps: each row that emits appends a token to its
    request, and a request that is done leaves the scheduler."""
    for row in batch.rows:
        if row.emits and row.is_live:
            row.req.num_inflight -= 1
            row.req.append_token(token)
            if row.req.finished:
                sched.finish(row.req)


def run_scheduler(sched: Scheduler, reqs: list[Req], max_steps: int = 500) -> list[ScheduledBatch]:
    """Add ``reqs`` and schedule and play steps until nothing is left; the batches, in order."""
    for r in reqs:
        sched.add(r)
    batches = []
    while sched.has_work:
        batch = sched.schedule()
        assert batch is not None and batch is not NEED_SYNC, "the scheduler has work but scheduled nothing"
        batches.append(batch)
        play(sched, batch)
        assert len(batches) < max_steps, "the scheduler did not finish"
    return batches


def slot_rows(sched: Scheduler, reqs: list[Req]) -> list[list[int]]:
    table = sched.cache.req_to_token
    return [table.read(r.req_pool_idx, r.kv_allocated_len).tolist() for r in reqs if r.req_pool_idx is not None]


def check_own_slots(sched: Scheduler, reqs: list[Req]) -> None:
    """Every token of every request that holds KV has a slot of its own, not on the free list."""
    rows = slot_rows(sched, reqs)
    slots = [s for row in rows for s in row]
    assert len(slots) == len(set(slots)), "two tokens share a KV slot"
    ps = sched.cache.page_size
    assert not {s // ps for s in slots} & set(sched.cache.allocator._free), "a page in use is on the free list"


def row_tuple(row: Row) -> tuple:
    return row.req.rid, row.prefix_len, row.extend_len, row.is_decode, row.emits


# ---------------------------------------------------------------------------------------- task 3.2: decode rows


@pytest.mark.task("3.2")
@pytest.mark.parametrize("page_size", [1, 4])
def test_decode_rows_give_every_running_request_its_next_token(page_size):
    """After the prefill, each step has one decode row per running request, in admission order: prefix_len is the
    request's KV so far (its tokens minus the newest, whose KV this row computes), extend_len 1, a decode row
    that emits. Scheduling the row moves kv_scheduled_len on and allocates exactly one more slot."""
    sched = bare_scheduler(64, page_size)
    reqs = [toy_req(n) for n in (5, 7, 9)]
    for r in reqs:
        sched.add(r)
    prefill = sched.schedule()
    assert [row_tuple(row) for row in prefill.rows] == [(r.rid, 0, len(r.input_ids), False, True) for r in reqs]
    play(sched, prefill)
    for _ in range(3):
        before = {r.rid: (len(r.all_ids), r.kv_allocated_len) for r in reqs}
        batch = sched.schedule()
        assert batch is not None and batch.is_decode
        assert [row_tuple(row) for row in batch.rows] == [(r.rid, before[r.rid][0] - 1, 1, True, True) for r in reqs]
        for row in batch.rows:
            r = row.req
            assert row.epoch == r.epoch == 0
            assert r.kv_scheduled_len == before[r.rid][0], "scheduling the row must move kv_scheduled_len on"
            assert r.kv_allocated_len == before[r.rid][1] + 1, "one more slot, for the token this row computes"
            assert r.num_inflight == 1, "the row's token is in flight until the step is processed"
        check_own_slots(sched, reqs)
        play(sched, batch)
    assert sched.num_retractions == 0


@pytest.mark.task("3.2")
def test_decode_needs_no_page_while_last_pages_have_room():
    """Pages of 4 and a pool of 3 pages, all in use by three 2-token prompts: the next two decode tokens of each
    request still fit in its last page, so nobody is retracted although no page is free."""
    sched = bare_scheduler(12, page_size=4)
    reqs = [toy_req(2, max_new=10, first=3 + 10 * i) for i in range(3)]
    for r in reqs:
        sched.add(r)
    play(sched, sched.schedule())
    assert sched.cache.allocator.num_free_pages == 0
    for _ in range(2):
        batch = sched.schedule()
        assert [row.req for row in batch.rows] == reqs and sched.num_retractions == 0
        check_own_slots(sched, reqs)
        play(sched, batch)
    assert sched.cache.allocator.num_free_pages == 0
    batch = sched.schedule()  # every last page is full now: one free page for three, the two newest go
    assert [row.req for row in batch.rows] == reqs[:1] and sched.num_retractions == 2


@pytest.mark.task("3.2", weight=3)
@pytest.mark.parametrize("page_size", [1, 4])
def test_out_of_memory_retracts_the_newest_request(page_size):
    """Three requests fill a 6-page pool with their prompts (two pages each). Their first decode step needs a
    fresh page each: the newest request is retracted (back to the front of the queue, its KV freed, its tokens
    kept) and the two others decode. In the end every request has all its tokens and the pool is whole."""
    sched = bare_scheduler(6 * page_size, page_size)
    a, b, c = reqs = [toy_req(2 * page_size, max_new=3, first=3 + 20 * i) for i in range(3)]
    for r in reqs:
        sched.add(r)
    play(sched, sched.schedule())
    assert sched.cache.allocator.num_free_pages == 0
    ratio = sched.new_token_ratio
    batch = sched.schedule()
    assert [row.req for row in batch.rows] == [a, b], "the newest request must give way, and only it"
    assert sched.num_retractions == 1 and c.epoch == 1 and (a.epoch, b.epoch) == (0, 0)
    assert list(sched.waiting) == [c] and sched.running == [a, b]
    assert c.req_pool_idx is None and c.kv_allocated_len == c.kv_scheduled_len == 0 and c.num_inflight == 0
    assert c.output_ids == [7], "a retracted request keeps the tokens it has"
    assert sched.new_token_ratio > ratio, "a retraction makes the next admissions more careful"
    check_own_slots(sched, reqs)
    play(sched, batch)
    run_scheduler(sched, [])
    assert all(len(r.output_ids) == 3 and r.finish_reason.kind == "length" for r in reqs)
    assert sched.cache.allocator.num_free_pages == 6 and not sched.arrival


@pytest.mark.task("3.2")
def test_a_partially_prefilled_request_gives_way_first():
    """A request whose prompt is half-prefilled (chapter 05's chunked request, set up here by hand) holds KV and
    is the newest: when two decoding requests need room, it is the one retracted, not a decoding request."""
    sched = bare_scheduler(10)
    a, b = running = [toy_req(3, first=3), toy_req(3, first=30)]
    for r in running:
        sched.add(r)
    play(sched, sched.schedule())
    c = toy_req(8, first=60)
    sched.add(c)
    sched.waiting.remove(c)  # what a chunked prefill of its first 4 tokens leaves behind
    sched.cache.match(c)
    sched.cache.alloc(c, 4)
    c.kv_scheduled_len = 4
    sched.chunked = c
    assert sched.cache.allocator.num_free_pages == 0
    batch = sched._add_decode_rows([], [a, b], allow_retract=True)
    assert batch is None
    assert sched.chunked is None and list(sched.waiting) == [c] and c.req_pool_idx is None
    assert sched.running == [a, b] and a.epoch == b.epoch == 0 and c.epoch == 1
    assert [a.kv_allocated_len, b.kv_allocated_len] == [4, 4]


@pytest.mark.task("3.2", weight=3)
def test_a_lone_request_that_cannot_grow_is_aborted():
    """One request has the whole 4-slot pool and wants more: retracting it would free room only for itself
    again, forever. It is aborted with a message that says why, its KV is freed and the scheduler forgets it."""
    sched = bare_scheduler(4)
    req = toy_req(3, max_new=10)
    sched.add(req)
    play(sched, sched.schedule())
    play(sched, sched.schedule())  # the 4th slot
    assert sched.schedule() is None
    assert req.finish_reason.kind == "abort" and "too small" in req.finish_reason.message
    assert sched.take_aborted() == [req] and not sched.has_work and not sched.arrival
    assert req.req_pool_idx is None and sched.cache.allocator.num_free_pages == 4
    assert sched.num_retractions == 0


@pytest.mark.task("3.2", weight=6)
def test_after_a_lone_request_is_aborted_the_whole_pool_serves_the_next():
    """The abort must give the pool back. A request that cannot grow is aborted; the next request needs every
    slot of the pool (3 prompt tokens and 1 output) and must finish. A scheduler that aborts without freeing
    leaks the pages for good: every later request that needs them is refused or waits forever."""
    sched = bare_scheduler(4)
    first = toy_req(3, max_new=10)
    sched.add(first)
    play(sched, sched.schedule())
    play(sched, sched.schedule())
    assert sched.schedule() is None and first.finish_reason.kind == "abort"
    sched.take_aborted()
    second = toy_req(3, max_new=1, first=40)
    run_scheduler(sched, [second])
    assert second.finish_reason.kind == "length" and second.output_ids == [7], (
        "the next request must get the pages the aborted one held")
    assert sched.cache.allocator.num_free_pages == 4 and not sched.has_work


@pytest.mark.task("3.2", weight=3)
def test_no_retraction_while_a_step_is_in_flight_or_in_a_mixed_step():
    """While a step is in flight (overlap, chapter 06) retracting could free nothing: the scheduler answers
    NEED_SYNC and changes nothing. A mixed step (chapter 05) never retracts: its decode rows just wait. Once the
    step in flight has been processed, the scheduler, asked again, retracts."""
    sched = bare_scheduler(6)
    reqs = [toy_req(2, max_new=5, first=3 + 10 * i) for i in range(3)]
    for r in reqs:
        sched.add(r)
    play(sched, sched.schedule())
    state = [(r.kv_scheduled_len, r.kv_allocated_len, r.num_inflight) for r in reqs]
    rows: list[Row] = []
    assert sched._add_decode_rows(rows, list(reqs), allow_retract=False) is None
    assert rows == [] and sched.num_retractions == 0
    step = sched.cache.frees.launch()  # a step is in flight
    assert sched.schedule() is NEED_SYNC
    assert sched.num_retractions == 0 and sched.running == reqs
    assert [(r.kv_scheduled_len, r.kv_allocated_len, r.num_inflight) for r in reqs] == state
    sched.cache.frees.processed(step)
    batch = sched.schedule()
    assert [row.req for row in batch.rows] == reqs[:2] and sched.num_retractions == 1


# ---------------------------------------------------------------------------------------- task 3.3: the flat batch


def bare_runner(*, split_tables: bool = False, model=None, backend=None, max_requests: int = 4,
                context: int = 64) -> ModelRunner:
    """A model runner around a hand-filled page table. ``split_tables``: the device table is a tensor apart from
    the host copy, as on a GPU, so that the runner has to copy the step's slots into it."""
    req_to_token = ReqToTokenPool(max_requests, context)
    if split_tables:
        req_to_token.host = torch.zeros_like(req_to_token.table)
        req_to_token.host_np = req_to_token.host.numpy()
    return ModelRunner(model or torch.nn.Identity(), 320, req_to_token, AttentionPlanner(backend), torch.device("cpu"))


def placed(runner: ModelRunner, pool_row: int, prompt: list[int], output: list[int], slots: list[int]) -> Req:
    """A request in page-table row ``pool_row`` whose tokens 0.. sit in ``slots`` (on the host copy)."""
    req = Req(list(prompt), greedy(100))
    req.output_ids = list(output)
    req.req_pool_idx = pool_row
    runner.req_to_token.host[pool_row, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
    return req


@pytest.mark.task("3.3")
@pytest.mark.parametrize("split_tables", [False, True], ids=["cpu-table", "device-table"])
def test_prepare_flattens_prefill_chunks_and_decode_rows(split_tables):
    """A mixed step: a whole prompt, a middle chunk of another prompt (prefix 4, 3 new tokens, emits nothing) and
    a decode row whose input token is still on the device. Every field of the ForwardBatch, value by value."""
    runner = bare_runner(split_tables=split_tables)
    slots_a, slots_b, slots_c = [41, 7, 33, 18, 25, 9], [50, 51, 52, 53, 60, 61, 62, 63, 12], [5, 6, 90, 91, 92, 93, 94]
    a = placed(runner, 2, [10, 11, 12, 13, 14, 15], [], slots_a)
    b = placed(runner, 0, [20, 21, 22, 23, 24, 25, 26, 27, 28], [], slots_b)
    c = placed(runner, 3, [30, 31, 32, 33, 34], [35], slots_c)  # its token 6 was sampled on the device
    runner.token_buffer[3] = 99
    batch = ScheduledBatch([Row(a, 0, 6, False, True, 0), Row(b, 4, 3, False, False, 0), Row(c, 6, 1, True, True, 0)])
    fb = runner.prepare(batch)
    assert fb.mode is ForwardMode.EXTEND
    assert fb.input_ids.tolist() == [10, 11, 12, 13, 14, 15, 24, 25, 26, 99], "decode rows read token_buffer"
    assert fb.positions.tolist() == [0, 1, 2, 3, 4, 5, 4, 5, 6, 6], "positions continue each request's prefix"
    assert fb.out_cache_loc.tolist() == slots_a + slots_b[4:7] + [slots_c[6]], "the slots of the new tokens"
    assert fb.req_pool_indices.tolist() == [2, 0, 3]
    assert fb.seq_lens.tolist() == [6, 7, 7], "seq_lens = prefix + new tokens"
    assert fb.last_token_indices.tolist() == [5, 8, 9], "each row's last token in the flat [T] layout"
    assert fb.extend_lens_cpu == [6, 3, 1] and fb.prefix_lens_cpu == [0, 4, 6]
    table = runner.req_to_token.table
    assert table[2, :6].tolist() == slots_a and table[0, 4:7].tolist() == slots_b[4:7] and table[3, 6] == 94, (
        "the kernels read the device page table: the step's new slots must be there")


@pytest.mark.task("3.3")
@pytest.mark.parametrize("split_tables", [False, True], ids=["cpu-table", "device-table"])
def test_prepare_a_decode_step(split_tables):
    """A decode-only step: one token per request at position prefix_len, its input from token_buffer."""
    runner = bare_runner(split_tables=split_tables)
    a = placed(runner, 1, [10, 11, 12], [13, 14], [8, 9, 10, 11, 12, 13])
    b = placed(runner, 2, [20] * 9, [21], [30 + i for i in range(10)] + [77])
    runner.token_buffer[1], runner.token_buffer[2] = 14, 21
    batch = ScheduledBatch([Row(a, 4, 1, True, True, 0), Row(b, 10, 1, True, True, 0)])
    fb = runner.prepare(batch)
    assert fb.mode is ForwardMode.DECODE
    assert fb.input_ids.tolist() == [14, 21]
    assert fb.positions.tolist() == [4, 10]
    assert fb.out_cache_loc.tolist() == [12, 77]
    assert fb.req_pool_indices.tolist() == [1, 2]
    assert fb.seq_lens.tolist() == [5, 11]
    assert fb.last_token_indices.tolist() == [0, 1]
    assert fb.extend_lens_cpu == [1, 1] and fb.prefix_lens_cpu == [4, 10]
    assert runner.req_to_token.table[1, 4] == 12 and runner.req_to_token.table[2, 10] == 77


@pytest.mark.task("3.3", weight=3)
def test_prepared_steps_give_the_oracle_tokens(tiny_llm):
    """The tiny model through a model runner fed by hand, no scheduler: a 13-token prompt prefilled in two chunks
    (8 + 5), a 9-token prompt whole, then decode steps, in slots scattered over the pool. Greedy tokens equal the
    naive oracle's: positions, KV slots and last-token indices were right in every step."""
    cfg = tiny_llm.config
    pool = KVPool(cfg.num_layers, 128, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    runner = bare_runner(model=tiny_llm.model, max_requests=3)
    runner.attn_backend = TorchNativeBackend(pool, runner.req_to_token)
    rng = random.Random(9)
    prompts = [rand_tokens(rng, 13), rand_tokens(rng, 9)]
    free = list(range(1, 128))
    rng.shuffle(free)
    a, b = (placed(runner, i + 1, p, [], [free.pop() for _ in range(40)]) for i, p in enumerate(prompts))

    def run(rows: list[Row]) -> None:
        out = runner.run(ScheduledBatch(rows))
        for row, token in zip(rows, out.tokens()):
            if row.emits:
                row.req.output_ids.append(token)

    run([Row(a, 0, 8, False, False, 0), Row(b, 0, 9, False, True, 0)])
    run([Row(a, 8, 5, False, True, 0), Row(b, 9, 1, True, True, 0)])
    for _ in range(4):
        run([Row(r, len(r.all_ids) - 1, 1, True, True, 0) for r in (a, b)])
    expected = oracle(tiny_llm, prompts, greedy(len(b.output_ids), ignore_eos=True))
    assert a.output_ids == expected[0].ids[: len(a.output_ids)] and len(a.output_ids) == 5
    assert b.output_ids == expected[1].ids


# ---------------------------------------------------------------------------------------- task 5.1: admission


@pytest.mark.task("5.1", weight=2)
def test_chunks_respect_the_chunk_size_and_the_step_budget():
    """max_prefill_tokens=24, chunked_prefill_size=16, prompts of 10, 50, 30 and 5 tokens: the exact rows of the
    prefill steps (request, prefix, new tokens, emits). A partial chunk emits nothing and ends admission for the
    step; the chunked request comes first next step; every step stays within both budgets."""
    sched = bare_scheduler(1024, chunked_prefill_size=16, max_prefill_tokens=24)
    p1, p2, p3, p4 = reqs = [toy_req(n, max_new=2, first=3 + 60 * i) for i, n in enumerate((10, 50, 30, 5))]
    for r in reqs:
        sched.add(r)
    expected = [
        [(p1, 0, 10, True), (p2, 0, 14, False)],
        [(p2, 14, 16, False)],
        [(p2, 30, 16, False)],
        [(p2, 46, 4, True), (p3, 0, 16, False)],
        [(p3, 16, 14, True), (p4, 0, 5, True)],
    ]
    for i, rows in enumerate(expected):
        batch = sched.schedule()
        got = [(row.req, row.prefix_len, row.extend_len, row.emits) for row in batch.rows]
        assert [(r.rid, *rest) for r, *rest in got] == [(r.rid, *rest) for r, *rest in rows], f"prefill step {i}"
        assert sched.chunked is (rows[-1][0] if not rows[-1][3] else None)
        play(sched, batch)
    assert sched.schedule().is_decode and not sched.waiting


@pytest.mark.task("5.1", weight=2)
def test_admission_reserves_room_for_future_output():
    """A 64-slot pool, new_token_ratio 0.5: each request (10 prompt tokens, 40 new) takes 10 slots and reserves
    20 for its output, so two are admitted and the third waits, holding nothing, though its prompt would fit."""
    sched = bare_scheduler(64, chunked_prefill_size=64, init_new_token_ratio=0.5, min_new_token_ratio=0.5)
    reqs = [toy_req(10, max_new=40, first=3 + 20 * i) for i in range(3)]
    for r in reqs:
        sched.add(r)
    batch = sched.schedule()
    assert [row.req for row in batch.rows] == reqs[:2], "the third request's output would not fit"
    assert list(sched.waiting) == [reqs[2]] and reqs[2].req_pool_idx is None
    assert sched.cache.allocator.num_free_pages == 44


@pytest.mark.parametrize("max_running", [1, 4, 8])
def test_a_burst_fills_every_request_slot_in_one_step(max_running):
    """Ten short requests arrive together and the pool and budget hold them all: the first step admits exactly
    ``max_running_requests`` of them, not fewer. (Counting the requests admitted earlier in the step twice, once
    as running and once as rows of the step, used to admit a burst in halves: 4 then 2 then 1 then 1.) Once the
    first ones finish, the rest fill their slots in one step again."""
    sched = bare_scheduler(1024, chunked_prefill_size=512, max_running_requests=max_running)
    reqs = [toy_req(5, max_new=2, first=3 + 10 * i) for i in range(10)]
    for r in reqs:
        sched.add(r)
    batch = sched.schedule()
    assert [row.req for row in batch.rows] == reqs[:max_running]
    assert sched.num_running == max_running and len(sched.waiting) == 10 - max_running
    while sched.num_running:  # play the admitted requests to their end (a prefill, then a decode)
        play(sched, batch)
        if sched.num_running:
            batch = sched.schedule()
    batch = sched.schedule()
    assert [row.req for row in batch.rows] == reqs[max_running:2 * max_running]


@pytest.mark.task("5.1", weight=4)
def test_a_request_alone_starts_even_if_its_reserve_exceeds_the_pool():
    """A 32-slot pool and max_new_tokens=1000 (a reserve of 700 at the default ratio): alone, the request is
    admitted anyway (it is aborted later if it really outgrows the pool). A second such request that arrives
    while it runs is not alone and must wait."""
    sched = bare_scheduler(32, chunked_prefill_size=8192, init_new_token_ratio=0.7)
    first, second = toy_req(10, max_new=1000), toy_req(5, max_new=1000, first=50)
    sched.add(first)
    batch = sched.schedule()
    assert batch is not None and [row.req for row in batch.rows] == [first]
    play(sched, batch)
    sched.add(second)
    batch = sched.schedule()
    assert batch.is_decode and [row.req for row in batch.rows] == [first]
    assert list(sched.waiting) == [second] and second.req_pool_idx is None


@pytest.mark.task("5.1", weight=3)
def test_a_chunk_that_does_not_fit_waits_and_keeps_its_kv():
    """The chunked request's next chunk needs more memory than is free: the step has no prefill row for it, it
    keeps its KV and its place, and the running requests decode instead."""
    sched = bare_scheduler(24, chunked_prefill_size=8)
    short, long = toy_req(4, max_new=30), toy_req(22, max_new=2, first=40)
    for r in (short, long):
        sched.add(r)
    batch = sched.schedule()  # short whole (4), long's first chunk (8)
    assert [(row.req, row.extend_len, row.emits) for row in batch.rows] == [(short, 4, True), (long, 8, False)]
    play(sched, batch)
    batch = sched.schedule()  # long's second chunk: 8 more, 12 slots free
    assert [(row.req, row.prefix_len, row.extend_len) for row in batch.rows] == [(long, 8, 8)]
    play(sched, batch)
    held = long.kv_allocated_len
    batch = sched.schedule()  # its last 6 tokens do not fit in the 4 free slots: short decodes instead
    assert batch.is_decode and [row.req for row in batch.rows] == [short]
    assert sched.chunked is long and long.kv_allocated_len == held and long.req_pool_idx is not None


@pytest.mark.task("5.1", weight=24)
@pytest.mark.parametrize("ratio", [0.0, 1.0], ids=["retracting", "reserving-all"])
def test_chunked_admission_serves_every_request_and_keeps_its_promises(ratio):
    """The whole of chunked admission on a random workload (prompts of 3-40 tokens, 1-20 new, arriving in
    bursts; a 64-slot pool, chunks of 8, 16 tokens a step), played step by step without a model. Every step keeps
    both budgets; every request ends with all its tokens; the scheduler never stalls; the pool ends whole.
    ``retracting``: nothing is reserved for output (ratio 0), so decode growth must retract, and retracted
    requests come back and finish. ``reserving-all``: ratio 1 reserves each request's whole output, and since
    any one request fits the pool alone, nothing may ever be retracted: a request admitted into room promised
    to another is an overcommitted pool."""
    sched = bare_scheduler(64, chunked_prefill_size=8, max_prefill_tokens=16, init_new_token_ratio=ratio,
                           min_new_token_ratio=ratio)
    rng = random.Random(5)
    reqs = [toy_req(rng.randint(3, 40), max_new=rng.randint(1, 20), first=3 + 50 * i) for i in range(24)]
    arriving = list(reqs)
    for step in itertools.count():
        assert step < 600, "the scheduler did not finish"
        if step % 3 == 0:
            for _ in range(min(len(arriving), rng.randint(0, 4))):
                sched.add(arriving.pop(0))
        if not sched.has_work:
            if not arriving:
                break
            continue
        batch = sched.schedule()
        assert batch is not None, "the scheduler has work but scheduled nothing"
        prefill = [row for row in batch.rows if not row.is_decode]
        assert sum(row.extend_len for row in prefill) <= 16 and all(row.extend_len <= 8 for row in prefill)
        check_own_slots(sched, reqs)
        play(sched, batch)
    assert all(len(r.output_ids) == r.params.max_new_tokens and r.finish_reason.kind == "length" for r in reqs)
    assert sched.cache.allocator.num_free_pages == 64 and sched.chunked is None and not sched.arrival
    if ratio == 0.0:
        assert sched.num_retractions > 0, "the workload is meant to retract when nothing is reserved"
    else:
        assert sched.num_retractions == 0, "a request was admitted into room reserved for another's output"


@pytest.mark.task("5.1", weight=4)
@pytest.mark.parametrize("page_size", [1, 4])
def test_a_retracted_request_is_prefilled_again_with_its_output_and_finishes(page_size):
    """Chunked prefill (chunks of 2 pages) and a pool that three requests fill with their prompts: the first
    decode step retracts the newest one, which has one output token by then. Admitted again, what it must
    compute is its prompt *and* that output token (its KV was freed with it), so its last chunk ends at
    ``len(all_ids)``; counting from the prompt alone leaves it chunked forever with nothing left to compute, and
    the scheduler stalls. Every request ends with all its tokens and the pool whole."""
    sched = bare_scheduler(6 * page_size, page_size, chunked_prefill_size=2 * page_size)
    reqs = [toy_req(2 * page_size, max_new=3, first=3 + 20 * i) for i in range(3)]
    for r in reqs:
        sched.add(r)
    play(sched, sched.schedule())
    batch = sched.schedule()
    assert sched.num_retractions == 1 and list(sched.waiting) == [reqs[2]] and reqs[2].output_ids == [7]
    play(sched, batch)
    batches = run_scheduler(sched, [])
    again = [row for b in batches for row in b.rows if row.req is reqs[2] and not row.is_decode]
    assert again, "the retracted request was never prefilled again"
    assert again[-1].emits and again[-1].prefix_len + again[-1].extend_len == len(reqs[2].input_ids) + 1, (
        "its new prefill must cover the prompt and the output token it already had")
    assert all(len(r.output_ids) == 3 and r.finish_reason.kind == "length" for r in reqs)
    assert sched.chunked is None and sched.cache.allocator.num_free_pages == 6 and not sched.arrival


@pytest.mark.task("5.1", weight=3)
def test_a_second_request_whose_reserve_does_not_fit_waits():
    """A 56-slot pool, new_token_ratio 0.5, two requests of 10 prompt tokens and 40 new ones arriving together:
    each needs 10 slots and a reserve of 20. The first takes 30 and leaves 26: the second's 10 slots fit but its
    reserve does not, so it waits, holding nothing. Only a request that would run alone may start with less than
    its reserve; capping every request's reserve at what is left would admit the second and overcommit the
    pool. Once the first is done, the second starts."""
    sched = bare_scheduler(56, chunked_prefill_size=64, init_new_token_ratio=0.5, min_new_token_ratio=0.5)
    first, second = reqs = [toy_req(10, max_new=40, first=3 + 20 * i) for i in range(2)]
    for r in reqs:
        sched.add(r)
    batch = sched.schedule()
    assert [row.req for row in batch.rows] == [first], "the second request's reserve does not fit beside the first"
    assert list(sched.waiting) == [second] and second.req_pool_idx is None
    play(sched, batch)
    for _ in range(3):  # while the first runs, the second still does not fit
        batch = sched.schedule()
        assert [row.req for row in batch.rows] == [first]
        play(sched, batch)
    run_scheduler(sched, [])
    assert all(len(r.output_ids) == 40 for r in reqs) and sched.num_retractions == 0


@pytest.mark.task("5.1")
def test_a_partial_chunk_reserves_nothing_yet():
    """A 24-slot pool, ratio 0.5, chunks of 8. A short request (4 tokens, reserve 2) and a 16-token prompt
    with a reserve of 12 arrive together. The long prompt's first chunk takes 8 of the 18 slots left and reserves
    nothing: its output comes only after its last chunk, which is when the reserve is charged. Reserving with
    every chunk would keep it waiting for room it does not need yet (until the short request is gone)."""
    sched = bare_scheduler(24, chunked_prefill_size=8, init_new_token_ratio=0.5, min_new_token_ratio=0.5)
    short, long = toy_req(4, max_new=4), toy_req(16, max_new=24, first=40)
    for r in (short, long):
        sched.add(r)
    batch = sched.schedule()
    assert [(row.req, row.extend_len, row.emits) for row in batch.rows] == [(short, 4, True), (long, 8, False)]
    assert sched.chunked is long


# ---------------------------------------------------------------------------------------- task 6.1: overlap


@pytest.mark.task("6.1", weight=8)
def test_inflight_frees_wait_for_the_step_they_were_parked_under():
    """Frees with nothing in flight go back at once. Frees while steps 1 and 2 are in flight are parked under
    step 2 (the newest), so processing step 1 releases nothing; processing step 2 releases them, in order."""
    alloc = PageAllocator(num_pages=8)
    frees = InflightFrees(alloc)
    a, b, c = (torch.tensor(alloc.alloc_pages(2)) for _ in range(3))
    frees.free(a)
    assert set(a.tolist()) <= set(alloc._free) and not frees.in_flight
    s1 = frees.launch()
    frees.free(b)
    assert frees.num_parked == 1 and not set(b.tolist()) & set(alloc._free), "freed while step 1 may write it"
    s2 = frees.launch()
    frees.free(c)
    frees.processed(s1)
    assert set(b.tolist()) <= set(alloc._free), "step 1 was processed: what was parked under it is free"
    assert not set(c.tolist()) & set(alloc._free) and frees.in_flight, "step 2 may still write these"
    assert [t.tolist() for t in frees.parked_slots] == [c.tolist()]
    frees.processed(s2)
    assert sorted(alloc._free) == list(range(1, 8)) and frees.num_parked == 0 and not frees.in_flight


@pytest.mark.task("6.1", weight=8)
def test_parked_frees_keep_their_own_copy_of_the_slots():
    """The caller may reuse its tensor as soon as ``free`` returns (a row of the page table, refilled for the next
    request). What is parked is a copy: processing the step gives back the pages named when ``free`` was called,
    not whatever the caller's tensor holds by then, which belong to someone else."""
    alloc = PageAllocator(num_pages=8)
    frees = InflightFrees(alloc)
    mine, theirs = alloc.alloc_pages(3), alloc.alloc_pages(3)
    row = torch.tensor(mine)
    step = frees.launch()
    frees.free(row)
    row[:] = torch.tensor(theirs)  # the caller refills its row for another request
    frees.processed(step)
    assert set(mine) <= set(alloc._free) and not set(theirs) & set(alloc._free), (
        "the pages freed must be the ones named by free(), not the caller's reused tensor")


@pytest.mark.task("6.1", weight=4)
def test_deferred_acts_run_after_their_step_and_may_park_again():
    """``later(fn)`` runs fn at once with nothing in flight, else once the step is processed. A deferred release
    that frees slots while a later step is in flight parks them under that step: they are not lost, and go back
    when it is processed."""
    alloc = PageAllocator(num_pages=6)
    frees = InflightFrees(alloc)
    calls = []
    frees.later(lambda: calls.append("now"))
    assert calls == ["now"]
    slots = torch.tensor(alloc.alloc_pages(3))
    s1 = frees.launch()
    frees.later(lambda: (calls.append("release"), frees.free(slots)))
    assert calls == ["now"]
    s2 = frees.launch()
    frees.processed(s1)
    assert calls == ["now", "release"]
    assert frees.num_parked == 1 and not set(slots.tolist()) & set(alloc._free), "step 2 may still write them"
    frees.processed(s2)
    assert sorted(alloc._free) == list(range(1, 6)) and frees.num_parked == 0


class StandInEngine:
    """The overlapped step with stand-ins for everything it calls: scheduling and launching follow a script
    (``plans``: "launch", None for nothing to run, "need-sync", or an exception to raise), processing a step
    returns one event naming it, and every call is logged in order. The frees are real."""

    step = Engine._step_overlap
    _finish_inflight = Engine._finish_inflight

    def __init__(self, plans: list) -> None:
        self.plans, self.log, self.inflight = list(plans), [], None
        self.frees = InflightFrees(PageAllocator(num_pages=4))

    def _schedule_and_launch(self):
        plan = self.plans.pop(0)
        if isinstance(plan, Exception):
            self.log.append("launch fails")
            raise plan
        if plan is None or plan == "need-sync":
            self.log.append("nothing to run" if plan is None else "NEED_SYNC")
            return None if plan is None else NEED_SYNC
        step = self.frees.launch()
        self.log.append(f"launch {step}")
        return Launched(step, ScheduledBatch([]), None)

    def _process(self, launched: Launched) -> list:
        assert self.frees.processed_through < launched.step, "a step was marked processed before processing it"
        self.log.append(f"process {launched.step}")
        return [f"tokens of {launched.step}"]

    def _take_aborted(self) -> list:
        return []

    def _recover(self, failed: LaunchFailed) -> list:
        self.log.append(f"recover {failed.step}")
        return [f"rolled back {failed.step}"]


@pytest.mark.task("6.1")
def test_overlapped_step_launches_the_next_step_before_processing_the_last():
    """Call by call: launch step N+1, then process step N and tell the frees it is processed; keep N+1 in flight.
    NEED_SYNC: process the step in flight first, then schedule again."""
    eng = StandInEngine(["launch", "launch", None])
    assert eng.step() == [] and eng.log == ["launch 1"] and eng.inflight.step == 1
    assert eng.step() == ["tokens of 1"] and eng.log[1:] == ["launch 2", "process 1"]
    assert eng.inflight.step == 2 and eng.frees.processed_through == 1 and eng.frees.in_flight
    assert eng.step() == ["tokens of 2"] and eng.log[3:] == ["nothing to run", "process 2"]
    assert eng.inflight is None and eng.frees.processed_through == 2 and not eng.frees.in_flight

    eng = StandInEngine(["launch", "need-sync", "launch"])
    eng.step()
    assert eng.step() == ["tokens of 1"]
    assert eng.log == ["launch 1", "NEED_SYNC", "process 1", "launch 2"] and eng.inflight.step == 2



@pytest.mark.task("6.1", weight=8)
def test_a_failed_launch_first_processes_the_step_in_flight():
    """A launch that fails (out of memory in the forward, a kernel error) while step N is in flight: step N's
    tokens are real and what waits for it (parked frees) must be given back, so the engine processes step N first,
    then rolls the failed step back. Recovering first would lose N's tokens and leave its frees parked forever."""
    batch = ScheduledBatch([])
    eng = StandInEngine(["launch", LaunchFailed(batch, 2, RuntimeError("boom"))])
    eng.step()
    assert eng.step() == ["tokens of 1", "rolled back 2"], "step 1's tokens first, then the rollback"
    assert eng.log == ["launch 1", "launch fails", "process 1", "recover 2"] and eng.inflight is None
    assert eng.frees.processed_through == 1 and not eng.frees.in_flight


@pytest.mark.task("6.1")
def test_overlap_processes_each_step_one_call_late(tiny_llm):
    """With overlap, call k of ``step()`` launches step k and returns the tokens of step k-1: the first call
    returns nothing and leaves its step in flight; every later call's events are exactly the emitting rows of the
    step before. Tokens equal the oracle's, and once idle nothing is in flight or parked."""
    rng = random.Random(12)
    prompts = [rand_tokens(rng, n) for n in (11, 6, 17)]
    params = [greedy(n, ignore_eos=True) for n in (5, 3, 6)]
    engine = make_engine(tiny_llm, disable_radix_cache=True, chunked_prefill_size=-1)
    reqs = make_reqs(tiny_llm, prompts, params)

    def launched_step_stays_in_flight(eng, trace: Trace) -> None:
        if len(trace.launched) == len(trace.events):  # this call launched a step: it is the one in flight now
            assert eng.inflight is not None and eng.inflight.batch is trace.launched[-1]
            assert eng.frees.in_flight

    trace = drive(engine, reqs, on_step=launched_step_stays_in_flight)
    assert trace.events[0] == [], "the first call launches step 0 and processes nothing"
    assert len(trace.events) == len(trace.launched) + 1, "the last call processes the last step"
    for k, batch in enumerate(trace.launched):  # these requests end by length: no row is dropped
        assert [e.req for e in trace.events[k + 1]] == [row.req for row in batch.rows if row.emits], (
            f"call {k + 1} must return the tokens of step {k}")
    assert_matches_oracle(reqs, oracle(tiny_llm, prompts, params))
    assert engine.frees.launched == len(trace.launched) == engine.frees.processed_through
    assert_pool_accounting(engine)


@pytest.mark.task("6.1", weight=3)
def test_overlap_retracts_only_after_finishing_the_step_in_flight(tiny_llm):
    """A pool that forces retraction under overlap: the scheduler answers NEED_SYNC, the engine processes the step
    in flight and schedules again before ``step()`` returns. Tokens equal the oracle's, the pool is whole again."""
    rng = random.Random(21)
    prompts = [rand_tokens(rng, n) for n in (20, 24, 16, 28, 18, 22)]
    params = greedy(40, ignore_eos=True)
    engine = make_engine(tiny_llm, max_total_tokens=144, disable_radix_cache=True, chunked_prefill_size=-1,
                         init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    schedule, syncs = engine.scheduler.schedule, []

    def counting_schedule():
        plan = schedule()
        syncs.append(plan is NEED_SYNC)
        return plan

    engine.scheduler.schedule = counting_schedule
    reqs = make_reqs(tiny_llm, prompts, params)
    drive(engine, reqs)
    assert any(syncs) and engine.scheduler.num_retractions > 0
    assert_matches_oracle(reqs, oracle(tiny_llm, prompts, params))
    assert_pool_accounting(engine)


# ------------------------------------------------------------------------------------------------ 1. matrix

MATRIX = [
    pytest.param(radix, page, chunk, overlap, mixed, small,
                 id=f"radix{int(radix)}-page{page}-chunk{chunk}-overlap{int(overlap)}-mixed{int(mixed)}-"
                    f"{'smallpool' if small else 'bigpool'}")
    # chunk 7 is smaller than the shortest prompt (9 tokens), 24 is a medium chunk, -1 disables chunking
    for radix, page, chunk, overlap, mixed, small in itertools.product(
        [True, False], [1, 16], [-1, 7, 24], [True, False], [True, False], [False, True]
    )
]


@pytest.mark.parametrize("radix,page,chunk,overlap,mixed,small", MATRIX)
def test_oracle_matrix(tiny_llm, radix, page, chunk, overlap, mixed, small):
    """Eleven prompts (a 48-token shared prefix, a prompt that is a prefix of another, identical twins, lengths
    9..84, max_new_tokens 1..40) give the oracle's greedy tokens in every engine configuration. After the run
    the pool is whole again: free pages * page_size + evictable tokens == capacity, nothing pending, no slot
    leaked; after every step no free page is still used by a live request or by the tree."""
    prompts, params = shared_prefix_workload()
    expected = oracle(tiny_llm, prompts, params)
    engine = make_engine(tiny_llm, disable_radix_cache=not radix, page_size=page, chunked_prefill_size=chunk,
                         disable_overlap_schedule=not overlap, enable_mixed_chunk=mixed,
                         **(SMALL_POOL if small else {}))
    reqs = make_reqs(tiny_llm, prompts, params)
    drive(engine, reqs)
    assert_matches_oracle(reqs, expected)
    assert_pool_accounting(engine)
    if small:
        assert engine.scheduler.num_retractions > 0, "the small pool was meant to force retraction"
    else:
        assert engine.scheduler.num_retractions == 0
    if radix:  # the shared prefixes were really shared
        assert any(r.cached_tokens > 0 for r in reqs)
    else:
        assert all(r.cached_tokens == 0 for r in reqs)


@pytest.mark.parametrize("multiple", [7, 16])
@pytest.mark.parametrize("radix,page,chunk,overlap,mixed", [
    (True, 1, 24, True, True), (True, 16, 7, True, False), (False, 1, -1, False, True), (True, 16, -1, False, False),
])  # fmt: skip
def test_extend_padding_row_keeps_the_oracle_tokens(tiny_llm, multiple, radix, page, chunk, overlap, mixed):
    """With ``extend_token_multiple`` every extend step runs the model on a multiple of that many tokens (a padding
    row after the real ones), and the outputs are still the oracle's: the padding row reads page-table row 0
    (which a live request owns: the first one admitted gets it) but never writes it, and writes only the
    reserved slot 0. Decode steps are not padded."""
    prompts, params = shared_prefix_workload()
    expected = oracle(tiny_llm, prompts, params)
    engine = make_engine(tiny_llm, disable_radix_cache=not radix, page_size=page, chunked_prefill_size=chunk,
                         disable_overlap_schedule=not overlap, enable_mixed_chunk=mixed,
                         extend_token_multiple=multiple)
    seen: list[tuple[bool, int, int]] = []  # (decode?, tokens the model ran on, real tokens)
    pad = engine.runner.pad_extend

    def recording_pad(fb):
        real = fb.input_ids.shape[0]
        out = pad(fb)
        seen.append((out.mode.is_decode, out.input_ids.shape[0], real))
        return out

    engine.runner.pad_extend = recording_pad  # type: ignore[method-assign]
    reqs = make_reqs(tiny_llm, prompts, params)
    drive(engine, reqs)
    assert_matches_oracle(reqs, expected)
    assert_pool_accounting(engine)
    extend = [(t, real) for decode, t, real in seen if not decode]
    assert extend and all(t % multiple == 0 and 0 <= t - real < multiple for t, real in extend)
    assert any(t > real for t, real in extend), "no step needed padding: the test would not test it"
    assert all(t == real for decode, t, real in seen if decode)


@pytest.mark.parametrize("mode", ["one-request", "mixed", "burst"])
def test_extend_graphs_on_stand_ins_give_the_oracle_tokens(tiny_llm, mode):
    """The extend-step graphs of chapter 11 on a CPU, with stand-in graphs (``RerunGraphFactory``) and the
    ``torch_static`` backend, padded to multiples of 8 tokens, graphs up to 64 tokens and 2, 4 or 8 rows.

    * one-request: requests one at a time, chunked at 24 tokens, so every extend step has one request (some after
      a cached shared prefix) and replays a graph of 2 rows;
    * mixed: all requests at once with mixed chunks, so extend steps hold several prompts, or a chunk with the
      running requests' decode rows; each replays the smallest bucket that holds its rows, unless it has more
      than 8 rows or 64 tokens;
    * burst: all requests at once, no mixed chunks, a prefill budget of 96 tokens with its own graph (8 rows):
      every step but the last fills the budget exactly and replays that graph.

    The greedy tokens are the oracle's, and exactly the steps that fit replayed. A replay that failed to copy an
    input, a last token's index, a row or a length into the static buffers would compute with the capture-time
    values (or a previous step's) instead."""
    from minisgl_ref.attention.torch_native import TorchStaticBackend
    from minisgl_ref.engine.cuda_graph import RerunGraphFactory
    from minisgl_ref.engine.extend_graph import ExtendGraphRunner

    mixed, budget = mode == "mixed", 96 if mode == "burst" else 0
    engine = make_engine(tiny_llm, chunked_prefill_size=budget or 24, extend_token_multiple=8, enable_mixed_chunk=mixed,
                         max_prefill_tokens=budget or (24 if mixed else 16384))
    runner = engine.runner
    runner.attn_backend = static = TorchStaticBackend(engine.kv_pool, engine.req_to_token)
    graphs = ExtendGraphRunner(runner.model, static, static, torch.device("cpu"), max_tokens=64, multiple=8,
                               row_buckets=(2, 4, 8), budget_tokens=budget, graph_factory=RerunGraphFactory())
    assert sorted(graphs.graphs) == sorted([(r, t) for r in (2, 4, 8) for t in range(8, 65, 8)]
                                           + ([(8, budget)] if budget else []))
    runner.graph_runners = [graphs]
    assert engine.req_to_token.alloc() == 0  # keep row 0, the capture-time row: the requests' rows differ from it
    prompts, params = shared_prefix_workload()
    expected = oracle(tiny_llm, prompts, params)
    reqs = make_reqs(tiny_llm, prompts, params)
    launched = []
    for group in ([reqs] if mode != "one-request" else [[r] for r in reqs]):
        launched += drive(engine, group).launched
    assert_matches_oracle(reqs, expected)
    assert any(r.cached_tokens > 0 for r in reqs)  # some steps extended after a cached prefix
    fits: dict[int, int] = {}  # row bucket -> extend steps that fit it
    mixed_fits = 0  # ... of which with decode rows beside a prompt
    for batch in launched:
        tokens = sum(row.extend_len for row in batch.rows)
        rows = len(batch.rows) + (tokens % 8 != 0)  # the padding row
        bucket = next((r for r in (2, 4, 8) if r >= rows), None)
        if batch.is_decode or bucket is None:
            continue
        if -(-tokens // 8) * 8 <= 64:
            fits[bucket] = fits.get(bucket, 0) + 1
            mixed_fits += any(row.is_decode for row in batch.rows)
        elif tokens == budget:  # the budget step's graph has the most rows
            fits[8] = fits.get(8, 0) + 1
    replays = {r: sum(g.replays for (rows, _), g in graphs.graphs.items() if rows == r) for r in (2, 4, 8)}
    assert replays == {r: fits.get(r, 0) for r in (2, 4, 8)}
    if mixed:  # steps of several rows replayed, and many of them had decode rows beside a prompt
        assert replays[4] > 0 and replays[8] > 0 and mixed_fits >= 5, (replays, mixed_fits)
    elif budget:  # every full step replayed the budget graph
        full = sum(sum(row.extend_len for row in b.rows) == budget for b in launched)
        assert full >= 3 and graphs.graphs[8, budget].replays == full, (full, replays)
    else:
        assert replays[2] >= len(prompts) and replays[4] == replays[8] == 0


def test_a_budget_step_graph_that_does_not_fit_in_memory_is_skipped(tiny_llm):
    """Capturing the prefill budget step's graph needs a whole prefill step's activations; when the GPU has no room
    for them the runner keeps its other graphs and the budget step runs eagerly, the engine starts all the same."""
    from minisgl_ref.attention.torch_native import TorchStaticBackend
    from minisgl_ref.engine.cuda_graph import RerunGraphFactory
    from minisgl_ref.engine.extend_graph import ExtendGraphRunner

    class ShortOfMemory(RerunGraphFactory):
        def warm_up(self, forward, batch):  # type: ignore[no-untyped-def]
            if batch.input_ids.shape[0] == 96:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
            super().warm_up(forward, batch)

    engine = make_engine(tiny_llm, extend_token_multiple=8)
    static = TorchStaticBackend(engine.kv_pool, engine.req_to_token)
    graphs = ExtendGraphRunner(engine.runner.model, static, static, torch.device("cpu"), max_tokens=64, multiple=8,
                               row_buckets=(2, 4, 8), budget_tokens=96, graph_factory=ShortOfMemory())
    assert graphs.budget_tokens == 0
    assert sorted(graphs.graphs) == [(r, t) for r in (2, 4, 8) for t in range(8, 65, 8)]


def test_matmul_warmup_lists_every_extend_shape_once(tiny_llm):
    """The start-up matmul warm-up (engine/warmup.py) meets each projection weight shape once at every padded
    token count an extend step can have (up to the prefill budget, plus the decode rows of a mixed step), and
    the LM head at every row count of a step; without padding only the LM head, whose counts are few."""
    from minisgl_ref.engine import warmup
    from minisgl_ref.layers.embedding import ParallelLMHead

    model = tiny_llm.model
    lm_head = next(m for m in model.modules() if isinstance(m, ParallelLMHead)).weight
    shapes = warmup.matmul_shapes(model, EngineConfig(max_prefill_tokens=256, max_running_requests=4,
                                                      extend_token_multiple=64))
    by_weight = {tuple(w.shape): counts for w, _, counts, _ in shapes}
    layer = model.layers[0]
    projections = {tuple(m.weight.shape) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                   layer.mlp.gate_up_proj, layer.mlp.down_proj)}
    assert len(shapes) == len(by_weight) == len(projections | {tuple(lm_head.shape)})  # each shape once
    assert all(by_weight[s] == [64, 128, 192, 256] for s in projections)
    assert by_weight[tuple(lm_head.shape)] == [1, 2, 3, 4]
    mixed = warmup.matmul_shapes(model, EngineConfig(max_prefill_tokens=256, max_running_requests=4,
                                                     extend_token_multiple=64, enable_mixed_chunk=True))
    assert {tuple(w.shape): c for w, _, c, _ in mixed}[tuple(layer.mlp.down_proj.weight.shape)][-1] == 320
    off = warmup.matmul_shapes(model, EngineConfig(max_running_requests=4, extend_token_multiple=1))
    assert [(tuple(w.shape), c) for w, _, c, _ in off] == [(tuple(lm_head.shape), [1, 2, 3, 4])]
    assert not any(acc for *_, acc in shapes)  # unfolded norms: every matmul is a plain one
    warmup._matmuls(shapes)  # runs (on the CPU here: nothing to warm, but the calls are the real ones)
    # A model whose norms are folded accumulates its row-parallel projections into the residual stream.
    model.norms_folded = True
    try:
        folded = warmup.matmul_shapes(model, EngineConfig(max_prefill_tokens=256, max_running_requests=4,
                                                          extend_token_multiple=64))
    finally:
        del model.norms_folded
    accumulating = {tuple(w.shape) for w, _, _, acc in folded if acc}
    assert accumulating == {tuple(layer.self_attn.o_proj.weight.shape), tuple(layer.mlp.down_proj.weight.shape)}
    warmup._matmuls(folded)


def test_extend_token_multiple_is_validated():
    with pytest.raises(ValueError, match="extend_token_multiple must be >= 1, got 0"):
        EngineConfig(extend_token_multiple=0)


def test_split_decode_min_batch_is_validated():
    with pytest.raises(ValueError, match="split_decode_min_batch must be >= 0, got -2"):
        EngineConfig(split_decode_min_batch=-2)
    assert EngineConfig(split_decode_min_batch=0).split_decode_min_batch == 0  # 0 turns it off


SMOL_CONFIGS = [
    pytest.param(dict(), id="defaults"),
    pytest.param(dict(page_size=16, chunked_prefill_size=16, max_total_tokens=96, init_new_token_ratio=0.0,
                      min_new_token_ratio=0.0), id="radix-page16-chunk16-overlap-retract"),
    pytest.param(dict(disable_radix_cache=True, disable_overlap_schedule=True, enable_mixed_chunk=True,
                      chunked_prefill_size=8), id="noradix-nooverlap-mixed-chunk8"),
]
SMOL_SYSTEM = "You are a concise assistant. Answer in one short sentence."
SMOL_QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is two plus two?"]


@pytest.mark.slow
@pytest.mark.parametrize("config", SMOL_CONFIGS)
def test_oracle_matrix_smol_chat(smol_llm, config):
    """The real model with chat prompts that share a system prompt (EOS may end them): same tokens as the
    oracle, including with page 16 + chunked prefill + overlap + a pool small enough to retract."""
    prompts = [smol_llm.chat_prompt_ids([{"role": "system", "content": SMOL_SYSTEM},
                                         {"role": "user", "content": q}]) for q in SMOL_QUESTIONS]
    params = greedy(10)
    expected = oracle(smol_llm, prompts, params)
    engine = make_engine(smol_llm, **config)
    reqs = make_reqs(smol_llm, prompts, params)
    drive(engine, reqs)
    assert_matches_oracle(reqs, expected)  # token ids, finish reasons and the detokenized text
    assert all(r.output_text for r in reqs)
    assert_pool_accounting(engine)
    if config.get("max_total_tokens"):
        assert engine.scheduler.num_retractions > 0


@pytest.mark.parametrize("radix", [True, False])
@pytest.mark.parametrize("overlap", [True, False])
def test_lpm_policy_matches_oracle(tiny_llm, radix, overlap):
    prompts, params = shared_prefix_workload()
    expected = oracle(tiny_llm, prompts, params)
    engine = make_engine(tiny_llm, schedule_policy="lpm", disable_radix_cache=not radix,
                         disable_overlap_schedule=not overlap, chunked_prefill_size=24, max_prefill_tokens=64)
    reqs = make_reqs(tiny_llm, prompts, params)
    drive(engine, reqs)
    assert_matches_oracle(reqs, expected)
    assert_pool_accounting(engine)


@pytest.mark.parametrize("policy,first", [("lpm", "shares"), ("fcfs", "unrelated")])
def test_lpm_admits_the_longest_cached_prefix_first(tiny_llm, policy, first):
    """One request slot; the cache holds a 40-token prefix; an unrelated request arrives before one that shares
    the prefix. fcfs admits the unrelated one first, lpm the one that can reuse the cache."""
    rng = random.Random(7)
    system = rand_tokens(rng, 40)
    warm, unrelated, shares = system + rand_tokens(rng, 5), rand_tokens(rng, 30), system + rand_tokens(rng, 6)
    engine = make_engine(tiny_llm, schedule_policy=policy, max_running_requests=1, disable_overlap_schedule=True)
    drive(engine, make_reqs(tiny_llm, [warm], greedy(2, ignore_eos=True)))
    reqs = make_reqs(tiny_llm, [unrelated, shares], greedy(4, ignore_eos=True))
    trace = drive(engine, reqs)
    first_req = trace.launched[0].reqs[0]
    assert first_req is (reqs[1] if first == "shares" else reqs[0])
    assert reqs[1].cached_tokens == 40
    assert_matches_oracle(reqs, oracle(tiny_llm, [unrelated, shares], greedy(4, ignore_eos=True)))
    assert_pool_accounting(engine)


@pytest.mark.parametrize("radix", [True, False])
def test_requests_sharing_a_prefix_are_admitted_as_a_group(tiny_llm, radix):
    """Three groups of three requests behind 40-token system prompts arrive interleaved (A1 B1 C1 A2 ...) and only
    three fit at once. With the radix cache the scheduler admits them group by group (A1 A2 A3, then B, then C),
    the later members of a group reusing the first one's prefix; without it, in arrival order."""
    rng = random.Random(5)
    systems = [rand_tokens(rng, 40) for _ in range(3)]
    prompts = [systems[g] + rand_tokens(rng, 4 + m) for m in range(3) for g in range(3)]  # A1 B1 C1 A2 ...
    params = greedy(3, ignore_eos=True)
    engine = make_engine(tiny_llm, max_running_requests=3, cascade_min_prefix_len=16,
                         disable_radix_cache=not radix, disable_overlap_schedule=True)
    reqs = make_reqs(tiny_llm, prompts, params)
    trace = drive(engine, reqs)
    first_seen: list = []
    for batch in trace.launched:
        first_seen += [r for r in batch.reqs if r not in first_seen]
    order = [reqs.index(r) for r in first_seen]
    assert order == ([0, 3, 6, 1, 4, 7, 2, 5, 8] if radix else list(range(9)))
    if radix:
        assert [r.cached_tokens for r in reqs] == [0, 0, 0, 40, 40, 40, 40, 40, 40]
    assert_matches_oracle(reqs, oracle(tiny_llm, prompts, params))
    assert_pool_accounting(engine)


def test_group_by_prefix_keeps_first_come_order_between_groups():
    """Waiting b..h (x is running, in group 1, and arrived first): group 1 goes first, then by first arrival."""
    from minisgl_ref.scheduler.scheduler import group_by_prefix

    key = {"x": 1, "b": None, "c": 2, "d": 1, "e": None, "f": 2, "g": 3, "h": 1}
    arrival = {r: i for i, r in enumerate("xbcdefgh")}
    assert group_by_prefix(list("bcdefgh"), key, arrival) == list("dhbcfeg")
    del arrival["x"]  # once x has finished, group 1 ranks as its oldest waiting member, d
    assert group_by_prefix(list("bcdefgh"), key, arrival) == list("bcfdheg")


@pytest.mark.parametrize("extra", [dict(), dict(chunked_prefill_size=7, **SMALL_POOL)], ids=["plain", "chunk-retract"])
def test_max_running_requests_two(tiny_llm, extra):
    prompts, params = shared_prefix_workload()
    engine = make_engine(tiny_llm, max_running_requests=2, **extra)
    reqs = make_reqs(tiny_llm, prompts, params)
    trace = drive(engine, reqs)
    assert trace.max_running == 2, "never more (nor fewer at peak) than two requests hold a slot at once"
    assert max(len(set(b.reqs)) for b in trace.launched) <= 2
    assert_matches_oracle(reqs, oracle(tiny_llm, prompts, params))
    assert_pool_accounting(engine)


# ------------------------------------------------------------------------------------------------ 2. pitfalls


@pytest.mark.task("4.4")
@pytest.mark.parametrize("page_size", [1, 4])
def test_shared_new_prefix_in_one_prefill_batch(tiny_llm, page_size):
    check_shared_new_prefix_in_one_prefill_batch(tiny_llm, page_size, overlap=False)


@pytest.mark.parametrize("page_size", [1, 4])
def test_shared_new_prefix_in_one_prefill_batch_under_overlap(tiny_llm, page_size):
    check_shared_new_prefix_in_one_prefill_batch(tiny_llm, page_size, overlap=True)


def check_shared_new_prefix_in_one_prefill_batch(tiny_llm, page_size: int, overlap: bool) -> None:
    """Bug guarded against: two requests whose common prefix is not cached yet are prefilled in the *same* batch,
    so each computes the prefix into its own slots. When both commit, the tree keeps the first copy; the second
    request's copy must be freed exactly once and its page-table row repointed at the tree's slots. Getting this
    wrong frees pages that are still in use (the tree's or the request's: later requests then overwrite live
    KV), frees a page twice (two requests later get the same page), or leaks the duplicates.

    In-batch prefix caching (test_in_batch_prefix_caching_defers_the_second_request) would hold the second
    request back a step; it is switched off here so that the pitfall's code path runs. It still runs whenever
    the shared part is shorter than the threshold, or the requests arrive in the same step but the first is a
    continuing chunk."""
    rng = random.Random(11)
    shared = rand_tokens(rng, 42)  # with page 4 the shareable part is 40 tokens: 2 tokens stay private
    prompts = [shared + rand_tokens(rng, 9), shared + rand_tokens(rng, 14)]
    params = greedy(8, ignore_eos=True)
    engine = make_engine(tiny_llm, page_size=page_size, disable_overlap_schedule=not overlap,
                         in_batch_prefix_threshold=-1, chunked_prefill_size=-1)
    reqs = make_reqs(tiny_llm, prompts, params)
    a, b = reqs
    aligned = 42 - 42 % page_size
    rows_at_launch: dict[Req, torch.Tensor] = {}
    checked = []

    run = engine.runner.run

    def snapshot_rows_at_first_launch(batch):
        if not rows_at_launch:  # the first (prefill) step, before anything was committed
            assert set(batch.reqs) == {a, b} and not any(r.is_decode for r in batch.rows), "both prefilled"
            for r in (a, b):
                rows_at_launch[r] = engine.req_to_token.read(r.req_pool_idx, len(r.input_ids)).clone()
            # each computes the shared prefix into its own slots: nothing was cached
            assert not pages_of(rows_at_launch[a], page_size) & pages_of(rows_at_launch[b], page_size)
        return run(batch)

    engine.runner.run = snapshot_rows_at_first_launch

    def on_step(eng, trace: Trace) -> None:
        if checked or a.tree_len == 0 or b.tree_len == 0 or a.finished or b.finished:
            return
        # Both have committed: their rows point at the same tree slots for the shared part.
        row_a = eng.req_to_token.read(a.req_pool_idx, a.kv_allocated_len)
        row_b = eng.req_to_token.read(b.req_pool_idx, b.kv_allocated_len)
        tree_slots = eng.cache.tree.match_prefix(shared).slots
        assert len(tree_slots) == aligned
        assert torch.equal(row_a[:aligned], tree_slots) and torch.equal(row_b[:aligned], tree_slots)
        assert not pages_of(row_a[aligned:], page_size) & pages_of(row_b[aligned:], page_size)
        # b's duplicate copy is released: free now, or parked until the step that wrote it has been processed
        # (the step in flight, under overlap), exactly once
        dup_pages = pages_of(rows_at_launch[b][:aligned], page_size)
        parked = [p for s in eng.frees.parked_slots for p in pages_of(s, page_size)]
        released = list(eng.allocator._free) + parked
        assert all(released.count(p) == 1 for p in dup_pages), "a duplicate page was not freed exactly once"
        check_free_list(eng)
        checked.append(True)

    trace = drive(engine, reqs, on_step=on_step)
    assert checked, "the commit of both requests was never observed"
    assert len(trace.launched[0].reqs) == 2
    assert_matches_oracle(reqs, oracle(tiny_llm, prompts, params))
    assert_pool_accounting(engine)


@pytest.mark.task("6.1")
@pytest.mark.parametrize("page_size", [1, 4])
def test_finishing_requests_get_no_extra_token(tiny_llm, page_size):
    check_finishing_requests_get_no_extra_token(tiny_llm, page_size, overlap=True,
                                                disable_radix_cache=True, chunked_prefill_size=-1)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("overlap", [True, False])
def test_finishing_requests_get_no_extra_token_with_radix(tiny_llm, page_size, overlap):
    check_finishing_requests_get_no_extra_token(tiny_llm, page_size, overlap)


def check_finishing_requests_get_no_extra_token(tiny_llm, page_size: int, overlap: bool, **config) -> None:
    """Bug guarded against: under overlap, step N+1 is launched before step N's tokens are seen, so a request
    that finishes in step N (EOS, stop token, length) has one more token computed for it. Appending it would
    give one token too many (a duplicated stop token, completion_tokens off by one, text past the stop)."""
    rng = random.Random(3)
    prompts = [rand_tokens(rng, n) for n in (12, 20, 7, 15, 30)]
    base = oracle(tiny_llm, prompts, greedy(16, ignore_eos=True))
    eos_tok, stop_tok = base[0].ids[5], base[1].ids[3]
    params = [
        greedy(16),  # ends on its EOS token (eos set below; the others ignore EOS)
        greedy(16, stop_token_ids=[stop_tok], ignore_eos=True),
        greedy(3, ignore_eos=True),
        greedy(1, ignore_eos=True),  # finishes at prefill
        greedy(16, ignore_eos=True),
    ]
    eos = frozenset({eos_tok})
    expected = oracle(tiny_llm, prompts, params, eos=eos)
    assert [e.kind for e in expected] == ["stop", "stop", "length", "length", "length"]
    engine = make_engine(tiny_llm, page_size=page_size, disable_overlap_schedule=not overlap, **config)
    reqs = make_reqs(tiny_llm, prompts, params, eos=eos)
    trace = drive(engine, reqs)
    assert_matches_oracle(reqs, expected)
    for r, stop in ((reqs[0], eos_tok), (reqs[1], stop_tok)):
        assert r.output_ids[-1] == stop and stop not in r.output_ids[:-1], "stop token missing or duplicated"
        assert r.finish_reason.matched == stop
    for r in reqs:
        out = LLM._output(r)
        assert out.completion_tokens == len(out.output_ids) == len(r.output_ids)
        events = [e for step in trace.events for e in step if e.req is r]
        assert len(events) == len(r.output_ids), "one event per generated token, no more"
        assert [e.finished for e in events] == [False] * (len(events) - 1) + [True]
    extra = [emitting_rows(trace, r) - len(r.output_ids) for r in reqs]
    if overlap:  # the extra step was really computed for the stop-finished requests, and dropped
        assert extra[0] >= 1 and extra[1] >= 1
    else:
        assert extra == [0] * len(reqs)
    assert extra[2:] == [0, 0, 0], "a request that ends by length needs no step after its last token"
    assert_pool_accounting(engine)


@pytest.mark.slow
def test_stop_string_under_overlap_matches_oracle(smol_llm):
    """The same pitfall with a stop *string* (detokenizer-matched) on the real model: overlap must not append
    the token after the one that completed the stop string."""
    ids = smol_llm.tokenizer.encode("The numbers from one to ten are: one, two,")
    params = greedy(24, stop=["five"])
    expected = oracle(smol_llm, [ids], params)
    assert (expected[0].kind, expected[0].matched) == ("stop", "five")
    engine = make_engine(smol_llm)  # overlap is the default
    reqs = make_reqs(smol_llm, [ids], params)
    trace = drive(engine, reqs)
    assert_matches_oracle(reqs, expected)
    assert "five" not in reqs[0].output_text
    assert emitting_rows(trace, reqs[0]) > len(reqs[0].output_ids)  # the extra token existed and was dropped
    assert LLM._output(reqs[0]).completion_tokens == len(expected[0].ids)
    assert_pool_accounting(engine)


class ReuseLog:
    """Records, in order, launches, processing, releases and page allocations of an engine."""

    def __init__(self, engine) -> None:
        self.events: list[tuple] = []
        self.processing: object = None
        ps = engine.allocator.page_size
        run, process, alloc_pages, free = (engine.runner.run, engine._process, engine.allocator.alloc_pages,
                                           engine.frees.free)

        def run_(batch):
            out = run(batch)
            self.events.append(("launch", id(batch), pages_of(out.forward_batch.out_cache_loc, ps)))
            return out

        def process_(launched):
            self.processing = id(launched.batch)
            self.events.append(("process_start", id(launched.batch)))
            try:
                return process(launched)
            finally:
                self.events.append(("process_end", id(launched.batch)))
                self.processing = None

        def alloc_pages_(n):
            pages = alloc_pages(n)
            self.events.append(("alloc", set(pages)))
            return pages

        def free_(slots):
            if len(slots) and self.processing is not None:
                self.events.append(("release", self.processing, pages_of(slots, ps)))
            return free(slots)

        engine.runner.run, engine._process = run_, process_
        engine.allocator.alloc_pages, engine.frees.free = alloc_pages_, free_

    def violations(self) -> tuple[list[str], int, int]:
        """(problems, releases made while the next step was in flight, pages later reused)."""
        idx = {}
        for i, e in enumerate(self.events):
            if e[0] in ("launch", "process_start", "process_end"):
                idx[(e[0], e[1])] = i
        launches = [e[1] for e in self.events if e[0] == "launch"]
        problems, inflight_releases, reused = [], 0, 0
        for i, e in enumerate(self.events):
            if e[0] == "launch":
                # (a) pages a launched step writes are handed to nobody until that step has been processed
                end = idx.get(("process_end", e[1]), len(self.events))
                for j in range(i + 1, end):
                    if self.events[j][0] == "alloc" and self.events[j][1] & e[2]:
                        problems.append(f"pages {sorted(self.events[j][1] & e[2])} re-allocated while the step "
                                        f"writing them was in flight")
            if e[0] == "release":
                # (b) pages released while processing step N wait until step N+1 (if launched) is processed
                n = launches.index(e[1])
                if n + 1 >= len(launches) or idx[("launch", launches[n + 1])] > i:
                    continue  # nothing was in flight when they were released
                inflight_releases += 1
                until = idx.get(("process_end", launches[n + 1]), len(self.events))
                for j in range(i + 1, len(self.events)):
                    if self.events[j][0] == "alloc" and self.events[j][1] & e[2]:
                        if j < until:
                            problems.append(f"pages {sorted(self.events[j][1] & e[2])} released while processing "
                                            f"step {n} were handed out before step {n + 1} was processed")
                        else:
                            reused += 1
        return problems, inflight_releases, reused


def reuse_workload(tiny_llm):
    rng = random.Random(5)
    prompts = [rand_tokens(rng, n) for n in (9, 14, 6, 11, 17, 8, 12, 10)]
    # Pairs admitted together that share a not-yet-cached prefix: with the radix cache, the duplicate copy is
    # what commit frees while the next step is in flight (finished requests' pages go into the tree instead).
    prompts[1] = prompts[0] + prompts[1][:5]
    prompts[4] = prompts[3][:8] + prompts[4]
    prompts[7] = prompts[6] + prompts[7][:3]
    base = oracle(tiny_llm, prompts, greedy(12, ignore_eos=True))
    # half of them end on a stop token (so overlap computes an extra row for them), the others by length
    params = [greedy(12, stop_token_ids=[base[i].ids[2 + i % 3]], ignore_eos=True) if i % 2 == 0
              else greedy(3 + i, ignore_eos=True) for i in range(len(prompts))]
    return prompts, params


@pytest.mark.task("6.1", weight=8)
@pytest.mark.parametrize("page_size", [1, 4])
def test_freed_pages_wait_for_the_step_in_flight(tiny_llm, page_size):
    check_freed_pages_wait_for_the_step_in_flight(tiny_llm, page_size, radix=False)


@pytest.mark.parametrize("page_size", [1, 4])
def test_freed_pages_wait_for_the_step_in_flight_with_radix(tiny_llm, page_size):
    check_freed_pages_wait_for_the_step_in_flight(tiny_llm, page_size, radix=True)


def check_freed_pages_wait_for_the_step_in_flight(tiny_llm, page_size: int, radix: bool) -> None:
    """Bug guarded against: under overlap, the step launched before step N is processed (N+1) may still write
    the slots of a request that step N finished (its extra token). If those pages went back to the free list at
    once, the next schedule would hand them to a new request while N+1 is still writing them: two requests'
    KV in one page. The log shows every page released while processing step N is re-allocated only after step
    N+1 was processed, and no page a launched step writes is handed out before that step is processed."""
    prompts, params = reuse_workload(tiny_llm)
    engine = make_engine(tiny_llm, page_size=page_size, disable_radix_cache=not radix, max_running_requests=3,
                         chunked_prefill_size=-1)
    log = ReuseLog(engine)
    reqs = make_reqs(tiny_llm, prompts, params)
    drive(engine, reqs)
    problems, inflight_releases, reused = log.violations()
    assert not problems, problems[:3]
    assert inflight_releases > 0 and reused > 0, "the workload never freed pages under a step in flight"
    assert_matches_oracle(reqs, oracle(tiny_llm, prompts, params))
    assert_pool_accounting(engine)


def test_reuse_log_catches_immediate_frees(tiny_llm):
    """The checker above is not vacuous: an engine that frees at once, ignoring the step in flight, fails it."""
    prompts, params = reuse_workload(tiny_llm)
    engine = make_engine(tiny_llm, disable_radix_cache=True, max_running_requests=3)
    allocator = engine.allocator
    engine.frees.free = lambda slots: allocator.free_slots(slots) if len(slots) else None  # the bug
    log = ReuseLog(engine)
    drive(engine, make_reqs(tiny_llm, prompts, params), check_every_step=False)
    problems, _, _ = log.violations()
    assert problems


# ------------------------------------------------------------------------------------------------ 3. memory


@pytest.mark.parametrize("page_size", [1, 4])
def test_decode_retracts_under_memory_pressure(tiny_llm, page_size):
    check_decode_retracts_under_memory_pressure(tiny_llm, page_size, **CH03)


@pytest.mark.parametrize("radix,overlap", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("page_size", [1, 4])
def test_decode_retracts_under_memory_pressure_everywhere(tiny_llm, radix, page_size, overlap):
    check_decode_retracts_under_memory_pressure(tiny_llm, page_size, disable_radix_cache=not radix,
                                                disable_overlap_schedule=not overlap)


def check_decode_retracts_under_memory_pressure(tiny_llm, page_size: int, **config) -> None:
    """Six requests that together need ~3x the pool: decode retracts the newest ones, which later resume where
    they stopped; every request finishes with the oracle's tokens and the pool is whole again."""
    rng = random.Random(21)
    prompts = [rand_tokens(rng, n) for n in (20, 24, 16, 28, 18, 22)]
    params = greedy(40, ignore_eos=True)
    engine = make_engine(tiny_llm, max_total_tokens=144, page_size=page_size, init_new_token_ratio=0.0,
                         min_new_token_ratio=0.0, **config)
    reqs = make_reqs(tiny_llm, prompts, params)
    drive(engine, reqs)
    assert engine.scheduler.num_retractions > 0
    assert any(r.epoch for r in reqs)
    assert_matches_oracle(reqs, oracle(tiny_llm, prompts, params))
    assert_pool_accounting(engine)


@pytest.mark.parametrize("overlap", [True, False])
def test_prompt_larger_than_pool_is_aborted_alone(tiny_engine_path, tiny_llm, overlap):
    """A prompt that cannot fit even in an empty pool is aborted with a message that says why; the requests
    around it are unaffected."""
    rng = random.Random(4)
    prompts = [rand_tokens(rng, 20), rand_tokens(rng, 80), rand_tokens(rng, 25)]
    params = greedy(10, ignore_eos=True)
    llm = LLM(tiny_engine_path, device="cpu", max_total_tokens=64, disable_overlap_schedule=not overlap)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[1].finish_reason == "abort" and outs[1].output_ids == [] and outs[1].completion_tokens == 0
    expected = oracle(tiny_llm, [prompts[0], prompts[2]], params)
    assert [outs[0].output_ids, outs[2].output_ids] == [e.ids for e in expected]
    assert outs[0].finish_reason == outs[2].finish_reason == "length"
    assert_pool_accounting(llm.engine)
    # the message, at the engine level
    engine = make_engine(tiny_llm, max_total_tokens=64)
    big = make_reqs(tiny_llm, [prompts[1]], params)[0]
    events = drive(engine, [big]).events
    assert big.finish_reason.kind == "abort"
    assert "81 KV slots" in big.finish_reason.message and "64" in big.finish_reason.message
    assert [e.finished for step in events for e in step if e.req is big] == [True]
    assert_pool_accounting(engine)


def test_context_longer_than_pool_is_aborted_while_decoding(tiny_llm):
    """A request whose prompt fits but whose output would overflow the whole pool is aborted when it is the only
    one left: its tokens so far are the oracle's, and the other requests finish normally."""
    rng = random.Random(8)
    prompts = [rand_tokens(rng, 30), rand_tokens(rng, 10)]
    params = [greedy(60, ignore_eos=True), greedy(5, ignore_eos=True)]
    # ratio 0: admission reserves nothing for the output (the default reservation would never admit the long
    # request into this pool at all: see test_request_whose_reservation_exceeds_the_pool_is_admitted)
    engine = make_engine(tiny_llm, max_total_tokens=64, init_new_token_ratio=0.0, min_new_token_ratio=0.0, **CH03)
    reqs = make_reqs(tiny_llm, prompts, params)
    drive(engine, reqs)
    expected = oracle(tiny_llm, prompts, params)
    long, short = reqs
    assert long.finish_reason.kind == "abort" and "too small" in long.finish_reason.message
    assert 0 < len(long.output_ids) < 60 and long.output_ids == expected[0].ids[: len(long.output_ids)]
    assert short.output_ids == expected[1].ids and short.finish_reason.kind == "length"
    assert_pool_accounting(engine)


@pytest.mark.parametrize("how", ["decode-abort", "engine-abort-while-waiting"])
def test_aborted_requests_are_forgotten_by_the_scheduler(tiny_llm, how):
    """Every way out of the scheduler must drop the request from its bookkeeping, or a long-running server keeps
    every aborted request (and its token lists) alive forever."""
    engine = make_engine(tiny_llm, max_total_tokens=64, init_new_token_ratio=0.0, min_new_token_ratio=0.0,
                         max_running_requests=1, **CH03)
    rng = random.Random(8)
    first = make_reqs(tiny_llm, [rand_tokens(rng, 30)], greedy(60 if how == "decode-abort" else 3,
                                                               ignore_eos=True))[0]
    second = make_reqs(tiny_llm, [rand_tokens(rng, 10)], greedy(3, ignore_eos=True))[0]
    engine.add_request(first)
    engine.add_request(second)
    if how == "engine-abort-while-waiting":
        engine.abort(second, "client went away")
    engine.run_until_done()
    assert first.finished and second.finished
    assert (first if how == "decode-abort" else second).finish_reason.kind == "abort"
    assert_pool_accounting(engine)


@pytest.mark.task("5.1", weight=2)
def test_chunked_prefill_does_not_starve_a_request_that_fits(tiny_llm):
    check_chunked_prefill_does_not_starve_a_request_that_fits(tiny_llm, overlap=False)


def test_chunked_prefill_does_not_starve_a_request_that_fits_under_overlap(tiny_llm):
    check_chunked_prefill_does_not_starve_a_request_that_fits(tiny_llm, overlap=True)


def check_chunked_prefill_does_not_starve_a_request_that_fits(tiny_llm, overlap: bool) -> None:
    """Two requests of 60 + 30 tokens in a 100-token pool, chunked at 8: each fits alone, so both must finish
    with the oracle's tokens (the scheduler may retract or pause the chunked one, not abort the running one).
    The bug guarded against: the chunked request's KV grows chunk by chunk until the running request cannot
    get a slot; a scheduler that counts only *running* requests then sees one and aborts it as too big."""
    rng = random.Random(5)
    prompts = [rand_tokens(rng, 60), rand_tokens(rng, 60)]
    params = greedy(30, ignore_eos=True)
    engine = make_engine(tiny_llm, max_total_tokens=100, chunked_prefill_size=8, disable_overlap_schedule=not overlap,
                         disable_radix_cache=not overlap)
    reqs = make_reqs(tiny_llm, prompts, params)
    drive(engine, reqs)
    assert [r.finish_reason.kind for r in reqs] == ["length", "length"], [r.finish_reason for r in reqs]
    # the partially prefilled request is the one that gave way (retracted), not the decoding one
    assert reqs[1].epoch >= 1 and reqs[0].epoch == 0
    assert_matches_oracle(reqs, oracle(tiny_llm, prompts, params))
    assert_pool_accounting(engine)


@pytest.mark.task("5.1", weight=3)
@pytest.mark.parametrize("case", ["reservation-over-pool", "max-new-tokens-beyond-context"])
def test_request_whose_reservation_exceeds_the_pool_is_admitted(tiny_llm, case):
    """A lone request must always make progress. (a) 30 prompt tokens + 60 new in a 64-token pool: it fits at
    first and, alone, is aborted only when the pool really overflows (as in the test above); (b) with the default
    16384-token pool, max_new_tokens=30000 on a 48-token context window: the context ends it by length after 43
    tokens, exactly as in the oracle. The bug guarded against: the admission reservation (0.7 * max_new_tokens)
    alone exceeds what the pool could ever offer, so the request is never scheduled and the engine spins."""
    from minisgl_ref.engine.naive import NaiveEngine

    if case == "reservation-over-pool":
        engine = make_engine(tiny_llm, max_total_tokens=64, **NO_OVERLAP)
        make = lambda: Req(list(range(3, 33)), greedy(60, ignore_eos=True))  # noqa: E731
    else:
        engine = make_engine(tiny_llm, **NO_OVERLAP)
        make = lambda: Req(list(range(3, 8)), greedy(30000, ignore_eos=True), context_len=48)  # noqa: E731
    req = make()
    drive(engine, [req], max_steps=200)
    assert req.output_ids, "the request never ran"
    ref = make()
    NaiveEngine(tiny_llm.model, tiny_llm.config.vocab_size).run([ref])
    if case == "reservation-over-pool":
        assert req.finish_reason.kind == "abort" and req.output_ids == ref.output_ids[: len(req.output_ids)]
    else:
        assert req.output_ids == ref.output_ids and req.finish_reason.kind == "length"
    assert_pool_accounting(engine)


# ------------------------------------------------------------------------------------------------ 4. chunked + mixed


@pytest.mark.task("5.1", weight=2)
@pytest.mark.parametrize("mixed", [True, False])
def test_long_prompt_chunks_alongside_decoding_requests(tiny_llm, mixed):
    check_long_prompt_chunks_alongside_decoding_requests(tiny_llm, mixed, overlap=False)


@pytest.mark.parametrize("mixed", [True, False])
def test_long_prompt_chunks_alongside_decoding_requests_under_overlap(tiny_llm, mixed):
    check_long_prompt_chunks_alongside_decoding_requests(tiny_llm, mixed, overlap=True)


def check_long_prompt_chunks_alongside_decoding_requests(tiny_llm, mixed: bool, overlap: bool) -> None:
    """A 400-token prompt chunked at 16 arrives while three short requests decode. With enable_mixed_chunk each
    of the 25 chunk steps also carries a decode row for every short request (each gets a token per step);
    without it the short requests wait until the long prompt is prefilled. Tokens equal the oracle's."""
    rng = random.Random(13)
    shorts = [rand_tokens(rng, n) for n in (10, 14, 19)]
    long_prompt = rand_tokens(rng, 400)
    short_params, long_params = greedy(48, ignore_eos=True), greedy(4, ignore_eos=True)
    engine = make_engine(tiny_llm, chunked_prefill_size=16, enable_mixed_chunk=mixed,
                         disable_overlap_schedule=not overlap, disable_radix_cache=not overlap)
    short_reqs = make_reqs(tiny_llm, shorts, short_params)
    long_req = make_reqs(tiny_llm, [long_prompt], long_params)[0]

    def add_long_once_decoding(eng, trace):
        if long_req.req_pool_idx is None and not long_req.finished and all(r.output_ids for r in short_reqs):
            eng.add_request(long_req)

    trace = drive(engine, short_reqs, on_step=add_long_once_decoding)
    chunk_rows = [(b, row) for b in trace.launched for row in b.rows if row.req is long_req and not row.is_decode]
    chunk_batches = [b for b, _ in chunk_rows]
    assert [row.extend_len for _, row in chunk_rows] == [16] * 25
    for b in chunk_batches:
        decode_rows = [row.req for row in b.rows if row.is_decode]
        assert decode_rows == (short_reqs if mixed else []), "mixed steps carry every decoding request"
    if not overlap:  # tokens arrive in the same step: count them per step while the long prompt is prefilled
        first = next(i for i, b in enumerate(trace.launched) if b is chunk_batches[0])
        window = trace.events[first : first + 25]
        for r in short_reqs:
            assert [sum(e.req is r for e in step) for step in window] == [1 if mixed else 0] * 25
    assert_matches_oracle(short_reqs + [long_req], oracle(tiny_llm, shorts + [long_prompt],
                                                          [short_params] * 3 + [long_params]))
    assert_pool_accounting(engine)


# ------------------------------------------------------------------------------------------------ 5. radix effect


@pytest.mark.task("4.4")
def test_radix_cache_saves_prefill_of_shared_prefixes(tiny_llm):
    """Eight prompts share a 64-token prefix; one prompt is prefilled per step at first (max_prefill_tokens=72),
    so the later ones find the prefix committed: with the radix cache the engine computes 72 + 7 * 8 prompt
    tokens instead of 8 * 72, and every request after the first reports 64 cached tokens. (In-batch prefix
    caching, task 4.5, is off: one prompt per step leaves it nothing to do.)"""
    rng = random.Random(17)
    system = rand_tokens(rng, 64)
    prompts = [system + rand_tokens(rng, 8) for _ in range(8)]
    params = greedy(6, ignore_eos=True)
    expected = oracle(tiny_llm, prompts, params)
    runs = {}
    for radix in (True, False):
        engine = make_engine(tiny_llm, disable_radix_cache=not radix, max_prefill_tokens=72,
                             disable_overlap_schedule=True, chunked_prefill_size=-1, in_batch_prefix_threshold=-1)
        reqs = make_reqs(tiny_llm, prompts, params)
        drive(engine, reqs)
        assert_matches_oracle(reqs, expected)
        assert_pool_accounting(engine)
        runs[radix] = (engine, [LLM._output(r) for r in reqs])
    on, off = runs[True][0].stats.prefill_tokens, runs[False][0].stats.prefill_tokens
    assert off == 8 * 72 and on == 72 + 7 * 8
    assert [o.cached_tokens for o in runs[True][1]] == [0] + [64] * 7
    assert all(o.cached_tokens == 0 for o in runs[False][1])
    # the same batch again: everything but each prompt's last token is cached now
    engine = runs[True][0]
    again = make_reqs(tiny_llm, prompts, params)
    before = engine.stats.prefill_tokens
    drive(engine, again)
    assert_matches_oracle(again, expected)
    assert engine.stats.prefill_tokens - before == 8
    assert [r.cached_tokens for r in again] == [71] * 8
    assert engine.cache.hit_rate > 0.5


@pytest.mark.task("4.4")
def test_cached_tokens_never_exceed_prompt_tokens(tiny_llm):
    """cached_tokens means 'prompt tokens whose KV was found in a cache' (OpenAI's usage.prompt_tokens_details):
    it can never exceed prompt_tokens, also for a request that was retracted and re-matched its own output."""
    prompts, params = shared_prefix_workload()
    engine = make_engine(tiny_llm, disable_overlap_schedule=True, chunked_prefill_size=-1,
                         in_batch_prefix_threshold=-1, **SMALL_POOL)
    reqs = make_reqs(tiny_llm, prompts, params)
    drive(engine, reqs)
    assert engine.scheduler.num_retractions > 0
    outs = [LLM._output(r) for r in reqs]
    assert all(o.cached_tokens <= o.prompt_tokens for o in outs), [(o.prompt_tokens, o.cached_tokens) for o in outs]


# ------------------------------------------------------------------------------------------------ 6. scheduler fixes


@pytest.mark.task("4.5")
@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_in_batch_prefix_caching_defers_the_second_request(tiny_llm, policy, page_size):
    check_in_batch_prefix_caching_defers_the_second_request(tiny_llm, policy, page_size, overlap=False)


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_in_batch_prefix_caching_defers_the_second_request_under_overlap(tiny_llm, policy, page_size):
    check_in_batch_prefix_caching_defers_the_second_request(tiny_llm, policy, page_size, overlap=True)


def check_in_batch_prefix_caching_defers_the_second_request(tiny_llm, policy: str, page_size: int,
                                                            overlap: bool) -> None:
    """Two requests share a 42-token prefix that is not cached yet, a third is unrelated; all arrive together.
    With the default threshold (32) the second one waits a step and then finds the prefix in the tree, so the
    prefix is computed once; the unrelated one is not held back. With the check off, or a threshold above the
    overlap, both compute it in the first step."""
    rng = random.Random(11)
    shared = rand_tokens(rng, 42)
    prompts = [shared + rand_tokens(rng, 9), rand_tokens(rng, 20), shared + rand_tokens(rng, 14)]
    params = greedy(5, ignore_eos=True)
    expected = oracle(tiny_llm, prompts, params)
    aligned = 42 - 42 % page_size
    for threshold, deferred in ((None, True), (-1, False), (43, False)):
        extra = {} if threshold is None else {"in_batch_prefix_threshold": threshold}
        engine = make_engine(tiny_llm, schedule_policy=policy, page_size=page_size,
                             disable_overlap_schedule=not overlap, chunked_prefill_size=-1, **extra)
        a, c, b = reqs = make_reqs(tiny_llm, prompts, params)
        trace = drive(engine, reqs)
        assert_matches_oracle(reqs, expected)
        assert_pool_accounting(engine)
        first = trace.launched[0]
        if deferred:
            assert set(first.reqs) == {a, c}, "the request sharing a's new prefix waits one step"
            assert trace.launched[1].reqs[0] is b and not trace.launched[1].rows[0].is_decode
            assert b.cached_tokens == aligned
            assert engine.stats.prefill_tokens == sum(map(len, prompts)) - aligned
        else:
            assert set(first.reqs) == {a, b, c} and b.cached_tokens == 0
            assert engine.stats.prefill_tokens == sum(map(len, prompts))


@pytest.mark.task("5.1")
def test_without_chunking_an_oversized_prompt_is_prefilled_whole_and_alone(tiny_llm):
    check_without_chunking_an_oversized_prompt_is_prefilled_whole_and_alone(tiny_llm, overlap=False)


def test_without_chunking_an_oversized_prompt_is_prefilled_whole_and_alone_under_overlap(tiny_llm):
    check_without_chunking_an_oversized_prompt_is_prefilled_whole_and_alone(tiny_llm, overlap=True)


def check_without_chunking_an_oversized_prompt_is_prefilled_whole_and_alone(tiny_llm, overlap: bool) -> None:
    """chunked_prefill_size=-1 means no chunking, whatever max_prefill_tokens says: a 50-token prompt with a
    32-token budget goes through in one step of its own (as in SGLang), and the next step takes the two short
    prompts that fit the budget together. With chunking on, the same prompt is split at the budget."""
    rng = random.Random(2)
    prompts = [rand_tokens(rng, 50), rand_tokens(rng, 20), rand_tokens(rng, 10)]
    params = greedy(4, ignore_eos=True)
    expected = oracle(tiny_llm, prompts, params)
    for chunk in (-1, 16):
        engine = make_engine(tiny_llm, chunked_prefill_size=chunk, max_prefill_tokens=32,
                             disable_overlap_schedule=not overlap, disable_radix_cache=True)
        reqs = make_reqs(tiny_llm, prompts, params)
        trace = drive(engine, reqs)
        assert_matches_oracle(reqs, expected)
        assert_pool_accounting(engine)
        prefill_rows = [(row.req, row.extend_len) for b in trace.launched for row in b.rows if not row.is_decode]
        if chunk == -1:
            assert [(r, n) for r, n in prefill_rows] == [(reqs[0], 50), (reqs[1], 20), (reqs[2], 10)]
            assert trace.launched[0].reqs == [reqs[0]]
            assert trace.launched[1].reqs[:2] == [reqs[1], reqs[2]]
        else:
            assert [n for r, n in prefill_rows if r is reqs[0]] == [16, 16, 16, 2]
            assert all(n <= 32 for b in trace.launched for n in [b.num_prefill_tokens])


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("overlap", [True, False])
def test_prefix_is_shared_with_the_very_next_step(tiny_llm, page_size, overlap):
    """A request arrives while the prefill of another request with the same 64-token prefix is still in flight
    (overlap: launched, not processed). Its prefix must come from the tree anyway: the engine commits a prefill
    row's tokens when the step is launched, which is safe because every later step runs after it. Committing at
    processing time instead, one step late under overlap, would make the second request compute the prefix
    again."""
    rng = random.Random(23)
    system = rand_tokens(rng, 64)
    prompts = [system + rand_tokens(rng, 7), system + rand_tokens(rng, 11)]
    params = greedy(6, ignore_eos=True)
    engine = make_engine(tiny_llm, page_size=page_size, disable_overlap_schedule=not overlap)
    first, second = reqs = make_reqs(tiny_llm, prompts, params)
    seen_in_flight = []

    def add_second_after_first_step(eng, trace: Trace) -> None:
        if len(trace.events) == 1:
            if overlap:  # the first step is launched but not processed, and the tree holds its prompt already
                assert eng.inflight.batch is trace.launched[0] and not first.output_ids
                assert eng.cache.tree.match_prefix(system).length == 64
                seen_in_flight.append(True)
            eng.add_request(second)

    trace = drive(engine, [first], on_step=add_second_after_first_step)
    assert seen_in_flight == ([True] if overlap else [])
    assert trace.launched[1].reqs[0] is second and trace.launched[1].rows[0].prefix_len == 64
    assert second.cached_tokens == 64
    assert engine.stats.prefill_tokens == len(prompts[0]) + len(prompts[1]) - 64
    assert_matches_oracle(reqs, oracle(tiny_llm, prompts, params))
    assert_pool_accounting(engine)


@pytest.mark.task("6.1", weight=4)
def test_abort_while_a_step_is_in_flight_frees_after_that_step(tiny_llm):
    check_abort_while_a_step_is_in_flight_frees_after_that_step(tiny_llm, radix=False)


def test_abort_while_a_step_is_in_flight_frees_after_that_step_with_radix(tiny_llm):
    check_abort_while_a_step_is_in_flight_frees_after_that_step(tiny_llm, radix=True)


def check_abort_while_a_step_is_in_flight_frees_after_that_step(tiny_llm, radix: bool) -> None:
    """The server aborts a request between steps, while its decode row is in flight (overlap). Its pages must
    not be handed out before that step has been processed; afterwards they are free again, the aborted request
    gets no further token, and the other request still matches the oracle."""
    rng = random.Random(31)
    prompts = [rand_tokens(rng, 18), rand_tokens(rng, 25)]
    params = greedy(12, ignore_eos=True)
    engine = make_engine(tiny_llm, disable_radix_cache=not radix, chunked_prefill_size=-1)
    victim, other = reqs = make_reqs(tiny_llm, prompts, params)
    for r in reqs:
        engine.add_request(r)
    for _ in range(3):
        engine.step()
    assert engine.inflight is not None and victim in engine.inflight.batch.reqs
    own = engine.req_to_token.read(victim.req_pool_idx, victim.kv_allocated_len, start=victim.tree_len)
    assert len(own) > 0
    n_out = len(victim.output_ids)
    engine.abort(victim, "client went away")
    assert victim.finish_reason.kind == "abort"
    assert not pages_of(own, 1) & set(engine.allocator._free), "freed while the step in flight writes them"
    engine.step()  # processes the step in flight: now they are released (parked until the next step is done)
    parked = {p for s in engine.frees.parked_slots for p in pages_of(s, 1)}
    assert pages_of(own, 1) <= set(engine.allocator._free) | set(tree_pages_of(engine)) | parked
    assert victim.req_pool_idx is None and engine.frees.num_parked == len(engine.frees.parked_slots)
    engine.run_until_done()
    assert len(victim.output_ids) == n_out
    assert other.output_ids == oracle(tiny_llm, [prompts[1]], params)[0].ids
    assert_pool_accounting(engine)


def tree_pages_of(engine) -> list[int]:
    return [p for n in engine.cache.tree._all_nodes() for p in pages_of(n.value, engine.allocator.page_size)]


def test_kv_pool_sizing_returns_cached_cuda_memory_first(tiny_llm, monkeypatch):
    """mem_get_info counts memory that PyTorch's caching allocator keeps for reuse (a previous Engine's pool)
    as used, so kv_pool_tokens must call torch.cuda.empty_cache() before it (checked with stand-ins: no GPU)."""
    from minisgl_ref.core.config import EngineConfig
    from minisgl_ref.engine.engine import kv_pool_tokens

    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: calls.append("mem_get_info") or (6e9, 8e9))
    tokens = kv_pool_tokens(EngineConfig(mem_fraction_static=0.85), tiny_llm.config, torch.device("cuda"),
                            torch.float32)
    assert calls == ["empty_cache", "mem_get_info"]
    per_token = 2 * tiny_llm.config.num_layers * tiny_llm.config.num_kv_heads * tiny_llm.config.head_dim * 4
    assert tokens == int((8e9 * 0.85 - 2e9) // per_token)


@pytest.mark.parametrize("bad", [0, -2])
def test_in_batch_prefix_threshold_is_validated_and_on_the_cli(bad):
    from minisgl_ref.cli import build_parser, engine_kwargs
    from minisgl_ref.core.config import EngineConfig

    with pytest.raises(ValueError, match="in_batch_prefix_threshold"):
        EngineConfig(in_batch_prefix_threshold=bad)
    args = build_parser().parse_args(["generate", "--in-batch-prefix-threshold", "-1", "hi"])
    assert EngineConfig(**engine_kwargs(args)).in_batch_prefix_threshold == -1
