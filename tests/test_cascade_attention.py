"""Cascade decode attention (chapter 11): shared prefixes read once per group, checked against torch_native.

On the CPU the Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest before triton is
imported), so shapes stay tiny: contexts of a few dozen tokens, head dims 16-32, small pieces so that every pass
cuts its keys into several pieces. What is covered: random groupings (groups of 1-5 rows, rows alone, prefixes at
and off page boundaries, empty suffixes) with page sizes 1 and 4 and GQA 1-4, against torch_native's decode
attention (the oracle); the grouping against the page table it reads; the KV-bytes report; whole engines
(torch_native and Triton) giving the same greedy tokens with the cascade on and off; and the attention-planner
seam itself: an engine built alone runs the core's default planner, one given chapter 11's planner factory the
cascade's, with the oracle's greedy tokens both ways.

``pytest -m gpu``: bf16 at the shared-prefix workload's shapes against FlashInfer / FA3 (the default decode path)
and torch_native, the CUDA-graph hooks, and the engine on a GPU.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import pytest
import torch

from minisgl_ref.attention.torch_native import TorchNativeBackend, reference_attention
from minisgl_ref.core.forward_batch import ForwardBatch, ForwardMode
from minisgl_ref.kvcache.allocator import PageAllocator
from minisgl_ref.kvcache.pool import KVPool
from minisgl_ref.kvcache.req_to_token import ReqToTokenPool
from minisgl_ref.layers.attention import AttentionLayer
from minisgl_ref.perf.cascade import (
    CascadeDecodeBackend,
    PrefixGroups,
    build_plan,
    decode_kv_bytes,
    find_prefix_groups,
    kv_tokens_read,
    merge_state,
    partial_attention,
)
from tests import engine_fixtures as ef
from tests.engine_fixtures import tiny_engine_path, tiny_llm  # noqa: F401 - fixtures

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


def triton_runs_here() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    from minisgl_ref.attention.triton_kernels.kv_indices import interpreted
    from minisgl_ref.perf.cascade_kernels import _cascade_prefix_kernel

    return HAS_CUDA or interpreted(_cascade_prefix_kernel)


# ---------------------------------------------------------------------------------------------------- batches


@dataclass
class Batch:
    """A decode batch laid out as the engine lays it out: pages from a PageAllocator in shuffled order, shared
    prefixes as the radix cache shares them (the same slots at the start of several page-table rows), the new
    token stored at the end of each row. ``groups`` is the grouping the batch was built with."""

    fb: ForwardBatch
    pool: KVPool
    table: ReqToTokenPool
    layer: AttentionLayer
    q: torch.Tensor
    rows: list[int]  # page-table row of each batch row
    groups: PrefixGroups | None
    layout_rows: list[tuple[int, ...]]  # the batch rows of each group of the layout, in the layout's order

    def backend(self, use_triton: bool, **attrs: int) -> CascadeDecodeBackend:
        b = CascadeDecodeBackend(self.pool, self.table, num_q_heads=self.layer.num_heads,
                                 page_size=1, use_triton=use_triton)  # fmt: skip
        for name, value in attrs.items():
            setattr(b, name, value)
        return b


def make_batch(
    groups: list[tuple[int, list[int]]],  # (shared tokens, suffix length of each member)
    alone: list[int],  # context lengths of rows that share nothing
    *,
    page_size: int,
    num_kv_heads: int = 2,
    gqa: int = 2,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str = DEVICE,
    shared_pages_of: list[int] | None = None,  # per group: how many tokens the members really share (default: all)
) -> Batch:
    """Members of a group share the slots of their first ``shared`` tokens *rounded up to whole pages* (when
    ``shared`` is off a page boundary the members copy the whole last page's slots too, as if they had all
    matched it), then each continues on its own pages. The returned ``groups`` use the given ``shared`` lengths."""
    rng = random.Random(seed)
    gen = torch.Generator(device).manual_seed(seed)
    ps = page_size
    total = sum(-(-p // ps) * ps + sum(s) + ps * len(s) for p, s in groups) + sum(alone) + ps * (len(alone) + 4)
    allocator = PageAllocator(total // ps + 8, ps, device)
    rng.shuffle(allocator._free)
    num_rows = sum(len(s) for _, s in groups) + len(alone)
    max_ctx = max([-(-p // ps) * ps + max(s) for p, s in groups] + alone + [1]) + 1
    table = ReqToTokenPool(2 * num_rows + 2, max_ctx, device)
    pool = KVPool(1, allocator.num_pages * ps, num_kv_heads, head_dim, dtype, device)
    pool.k[0].normal_(generator=gen)
    pool.v[0].normal_(generator=gen)
    members: list[tuple[int, torch.Tensor, int]] = []  # (group or -1, shared slots, suffix length)
    for g, (shared, suffixes) in enumerate(groups):
        pre = allocator.alloc_tokens(0, 0, -(-shared // ps) * ps)  # whole pages
        real = shared if shared_pages_of is None else shared_pages_of[g]
        members += [(g, pre[:shared] if real == shared else pre[:real], s) for s in suffixes]
    members += [(-1, torch.empty(0, dtype=torch.int64), n) for n in alone]
    order = list(range(num_rows))
    rng.shuffle(order)
    members = [members[i] for i in order]
    rows = rng.sample(range(1, table.max_requests), num_rows)
    lens, out_loc = [], []
    for row, (g, pre, suffix) in zip(rows, members):
        shared = groups[g][0] if g >= 0 else 0
        table.write(row, 0, pre)
        # The rest of the context on the row's own pages. When the shared part ends inside a page, the row's next
        # tokens start on a fresh page (a shared page is never written by a member).
        start = len(pre)
        if shared + suffix > start:
            table.write(row, start, allocator.alloc_tokens(start - start % ps, 0, shared + suffix - start))
        n = shared + suffix
        lens.append(n)
        out_loc.append(int(table.host[row, n - 1]) if n else 0)
    num_heads = num_kv_heads * gqa
    q = 2 * torch.randn(num_rows, num_heads, head_dim, generator=gen, device=device, dtype=dtype)
    fb = ForwardBatch(mode=ForwardMode.DECODE, input_ids=torch.zeros(num_rows, dtype=torch.int64, device=device),
                      positions=torch.tensor([max(n - 1, 0) for n in lens], device=device),
                      extend_lens_cpu=[1] * num_rows, prefix_lens_cpu=[n - 1 for n in lens],
                      attn_backend=None,  # type: ignore[arg-type]
                      req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=device),
                      out_cache_loc=torch.tensor(out_loc, dtype=torch.int64, device=device),
                      seq_lens=torch.tensor(lens, dtype=torch.int64, device=device))  # fmt: skip
    by_group: dict[int, list[int]] = {}
    for b, (g, _, _) in enumerate(members):
        if g >= 0:
            by_group.setdefault(g, []).append(b)
    kept = [(groups[g][0], tuple(rs)) for g, rs in sorted(by_group.items(), key=lambda kv: kv[1][0])]
    prefix_groups = PrefixGroups(tuple(n for n, _ in kept), tuple(r for _, r in kept)) if kept else None
    layout_rows = [tuple(by_group.get(g, ())) for g in range(len(groups))]
    return Batch(fb, pool, table, AttentionLayer(0, num_heads, num_kv_heads, head_dim), q, rows, prefix_groups,
                 layout_rows)


def oracle(batch: Batch) -> torch.Tensor:
    """torch_native's decode attention on a float32 copy of the pool: [B, H * D]."""
    pool = batch.pool
    ref_pool = KVPool(1, pool.num_slots, pool.k[0].shape[1], pool.k[0].shape[2], torch.float32, pool.k[0].device)
    ref_pool.k[0].copy_(pool.k[0])
    ref_pool.v[0].copy_(pool.v[0])
    backend = TorchNativeBackend(ref_pool, batch.table)
    fb = dataclasses.replace(batch.fb, attn_backend=backend)
    backend.init_forward_metadata(fb)
    return backend.attend_decode(batch.q.float(), batch.layer, fb)


def run_cascade(batch: Batch, groups: PrefixGroups | None, use_triton: bool, **attrs: int) -> torch.Tensor:
    backend = batch.backend(use_triton, **attrs)
    fb = dataclasses.replace(batch.fb, attn_backend=backend)
    backend.step_groups = groups  # what the planner's attach leaves for the step
    backend.init_forward_metadata(fb)
    return backend.attend_decode(batch.q, batch.layer, fb)


# Small pieces on the CPU: every pass cuts its keys into several pieces, so every merge runs.
CPU_TUNING = dict(piece_len=4, max_pieces=3, min_kv_split_len=3, block_m=32, small_block_m=16)
IMPLS = [False, True]  # the torch reference, the Triton kernels
IMPL_IDS = ["torch", "triton"]


def skip_unless(use_triton: bool) -> None:
    if use_triton and not triton_runs_here():
        pytest.skip("the Triton kernels need a GPU or TRITON_INTERPRET=1 before triton is imported")


# ------------------------------------------------------------------------------------------ the merge itself


def test_merge_state_is_softmax_attention_over_the_union():
    """Attention over keys A and B, computed as two partial states and merged, is attention over A + B; an empty
    part (log-sum-exp -inf) weighs nothing."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 8, generator=gen)
    k = torch.randn(20, 2, 8, generator=gen)
    v = torch.randn(20, 2, 8, generator=gen)
    want = torch.stack([reference_attention(q[i : i + 1], k, v, 0.3)[0] for i in range(3)])
    for cut in (0, 1, 7, 19, 20):
        o1, l1 = partial_attention(q, k[:cut], v[:cut], 0.3)
        o2, l2 = partial_attention(q, k[cut:], v[cut:], 0.3)
        out, lse = merge_state(o1, l1, o2, l2)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        full = torch.einsum("nhd,lhd->nhl", q, k.repeat_interleave(2, 1)) * 0.3
        torch.testing.assert_close(lse, torch.logsumexp(full, -1), rtol=1e-5, atol=1e-5)
    o_empty, l_empty = partial_attention(q, k[:0], v[:0], 0.3)
    assert torch.all(o_empty == 0) and torch.all(l_empty == float("-inf"))


# -------------------------------------------------------------------------------------- against the oracle


def random_layout(rng: random.Random, page_size: int) -> tuple[list[tuple[int, list[int]]], list[int]]:
    """1-3 groups of 1-5 rows, prefixes at and off page boundaries, suffixes of 0-9 tokens, 0-2 rows alone."""
    groups = []
    for _ in range(rng.randint(1, 3)):
        pages = rng.randint(1, 4)
        shared = pages * page_size - (rng.randint(0, page_size - 1) if rng.random() < 0.5 else 0)
        groups.append((shared, [rng.randint(0, 9) for _ in range(rng.randint(1, 5))]))
    groups = [(p, [s if p + s else 1 for s in sufs]) for p, sufs in groups]
    alone = [rng.randint(1, 20) for _ in range(rng.randint(0, 2))]
    return groups, alone


@pytest.mark.parametrize("use_triton", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("page_size,gqa,head_dim", [(1, 1, 16), (4, 2, 16), (1, 4, 32), (4, 3, 16)])
def test_cascade_matches_torch_native(use_triton, page_size, gqa, head_dim):
    """Random groupings (float32): the cascade computes torch_native's decode attention up to summation order."""
    skip_unless(use_triton)
    rng = random.Random(page_size * 100 + gqa * 10 + head_dim)
    for trial in range(2 if use_triton else 4):
        groups, alone = random_layout(rng, page_size)
        batch = make_batch(groups, alone, page_size=page_size, gqa=gqa, head_dim=head_dim, seed=trial)
        ref = oracle(batch)
        out = run_cascade(batch, batch.groups, use_triton, **CPU_TUNING)
        torch.testing.assert_close(out.float(), ref, rtol=1e-4, atol=1e-5)
        assert out.dtype == batch.q.dtype


@pytest.mark.parametrize("use_triton", IMPLS, ids=IMPL_IDS)
def test_empty_suffix_and_rows_alone(use_triton):
    """A row whose whole context is the shared prefix (empty suffix: its suffix state weighs nothing), a group of
    one row, rows alone, and no groups at all."""
    skip_unless(use_triton)
    batch = make_batch([(8, [0, 3, 5]), (5, [2])], [7, 1], page_size=4, gqa=2, seed=3)
    ref = oracle(batch)
    torch.testing.assert_close(run_cascade(batch, batch.groups, use_triton, **CPU_TUNING).float(), ref,
                               rtol=1e-4, atol=1e-5)  # fmt: skip
    torch.testing.assert_close(run_cascade(batch, None, use_triton, **CPU_TUNING).float(), ref, rtol=1e-4, atol=1e-5)


def test_triton_bfloat16_within_tolerance():
    skip_unless(True)
    batch = make_batch([(12, [3, 1, 6]), (16, [4, 2])], [9], page_size=4, gqa=2, head_dim=32, dtype=torch.bfloat16,
                       seed=5)  # fmt: skip
    out = run_cascade(batch, batch.groups, True, **CPU_TUNING)
    ref = oracle(batch)
    assert out.dtype == torch.bfloat16
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


def test_plan_cuts_tiles_and_pieces():
    """Pass 1's work items cover every (tile, piece) of every group exactly once, without empty pieces: a group
    whose queries fit a small tile in the small list, the others in large tiles."""
    groups = PrefixGroups(prefix_lens=(10, 4), rows=((0, 2, 5), (1, 3)))
    plan = build_plan(groups, 8, gqa=4, block_m=16, small_block_m=8, piece_len=4, max_pieces=3)
    b, h = 8, 2
    assert plan[:h].tolist() == [1, 3]  # group 1: 2 rows x GQA 4 = 8 queries, one small tile; group 0: 12, large
    row_prefix, row_pieces, row_list = plan[h : h + b], plan[h + b : h + 2 * b], plan[h + 2 * b : h + 3 * b]
    assert row_prefix.tolist() == [10, 4, 10, 4, 0, 10, 0, 0] and row_pieces.tolist() == [3, 1, 3, 1, 0, 3, 0, 0]
    assert row_list[:5].tolist() == [0, 2, 5, 1, 3]
    work = plan[h + 3 * b :].reshape(-1, 7)
    assert len(work) == 4
    assert work[0].tolist() == [3, 2, 0, 1, 0, 4, 0]  # the small list first: rows 1, 3 through row 1's table
    # group 0: 10 tokens in 3 pieces of 4, 4, 2, one tile of 16 queries, read through row 0's page table
    assert [w.tolist() for w in work[1:]] == [[0, 3, 0, 0, lo, hi, s] for s, (lo, hi) in enumerate([(0, 4), (4, 8),
                                                                                                    (8, 10)])]
    big = build_plan(groups, 8, gqa=4, block_m=8, small_block_m=8, piece_len=4, max_pieces=3)
    assert sorted(int(w[2]) for w in big[h + 3 * b :].reshape(-1, 7) if w[0] == 0) == [0, 0, 0, 8, 8, 8]


# ---------------------------------------------------------------------------------------------- the grouping


@pytest.mark.parametrize("page_size", [1, 4])
def test_grouping_finds_exactly_the_shared_whole_pages(page_size):
    """Rows that hold the same slots for a prefix form a group with that prefix rounded down to whole pages; rows
    that share less than the threshold, or share with nobody, stay alone."""
    ps = page_size
    rng = random.Random(ps)
    for trial in range(6):
        layout = [(rng.randint(2, 6) * ps, [rng.randint(0, 7) for _ in range(rng.randint(2, 4))]) for _ in range(3)]
        layout.append((ps, [3, 4]))  # shares one page only: below the threshold of 2 pages
        real = [p - (rng.randint(0, ps - 1) if trial % 2 else 0) for p, _ in layout]  # really shared tokens
        batch = make_batch(layout, [5, 9], page_size=ps, seed=trial, shared_pages_of=real)
        found = find_prefix_groups(batch.table.host_np, batch.rows, batch.fb.seq_lens_cpu, ps, 2 * ps)
        want = {(r - r % ps, rows) for r, rows in zip(real, batch.layout_rows) if r - r % ps >= 2 * ps}
        assert found is not None
        assert set(zip(found.prefix_lens, found.rows)) == want
        # the cascade with the found groups is exact
        torch.testing.assert_close(run_cascade(batch, found, False).float(), oracle(batch), rtol=1e-4, atol=1e-5)


def test_grouping_prefers_the_deeper_groups_that_save_more():
    """Everyone shares a short template, subsets share long system prompts behind it: one group per system prompt
    (saves (rows - 1) x long prompt each), not one group over the short template; a lone row that shares only the
    template stays alone. With a threshold above the template, the same."""
    ps, template, system = 1, 6, 30
    allocator = PageAllocator(512, ps)
    table = ReqToTokenPool(16, 64)
    shared_template = allocator.alloc_tokens(0, 0, template)
    rows, lens = [], []
    for g, members in enumerate([3, 2]):
        sys_slots = allocator.alloc_tokens(template, 0, system)
        for m in range(members):
            row = len(rows) + 1
            own = allocator.alloc_tokens(template + system, 0, 5 + m)
            table.write(row, 0, torch.cat([shared_template, sys_slots, own]))
            rows.append(row)
            lens.append(template + system + 5 + m)
    lone = len(rows) + 1
    table.write(lone, 0, torch.cat([shared_template, allocator.alloc_tokens(template, 0, 20)]))
    rows.append(lone)
    lens.append(template + 20)
    for threshold in (4, 10):
        found = find_prefix_groups(table.host_np, rows, lens, ps, threshold)
        assert found is not None
        assert list(zip(found.prefix_lens, found.rows)) == [(template + system, (0, 1, 2)), (template + system, (3, 4))]
    # A template worth more than the subsets: 6 rows on a 6-token template with a threshold of 4, no subsets.
    assert find_prefix_groups(table.host_np, rows, [template + 1] * len(rows), ps, 4).rows == ((0, 1, 2, 3, 4, 5),)
    assert find_prefix_groups(table.host_np, rows, lens, ps, 100) is None


def test_kv_bytes_per_step_with_and_without_the_cascade():
    groups = PrefixGroups(prefix_lens=(2048, 512), rows=((0, 1, 2, 3), (5, 6)))
    lens = [2200, 2100, 2300, 2049, 40, 600, 700]
    plain, cascade = kv_tokens_read(lens, groups)
    assert plain == sum(lens)
    assert cascade == 2048 + (152 + 52 + 252 + 1) + 40 + 512 + (88 + 188)
    assert decode_kv_bytes(lens, groups, 1000) == (plain * 1000, cascade * 1000)
    assert decode_kv_bytes(lens, None, 7) == (plain * 7, plain * 7)


# -------------------------------------------------------------------------------------------------- the engine

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=320, max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.1)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY), dtype=torch.float32)
    folder = tmp_path_factory.mktemp("tiny_cascade_llama")
    model.save_pretrained(folder)
    return folder


def shared_prefix_tokens(path, backend: str, **engine_kw):  # type: ignore[no-untyped-def]
    """A small shared-prefix workload (2 system prompts x 3 questions, shuffled) through the engine with the radix
    cache on: the greedy tokens, and the cascade's counters (``bench offline``'s, None without a cascade). With
    an FP8 cache, its layers' key and value scales are set to 0.6 and 0.2 (not 1, so that they are exercised)."""
    from minisgl_ref import LLM, SamplingParams
    from minisgl_ref.bench.cascade_stats import cascade_stats
    from minisgl_ref.bench.workloads import shared_prefix_workload

    wl = shared_prefix_workload(num_groups=2, prompts_per_group=3, system_len=37, question_len=5, output_len=5)
    prompts = [[t % 300 + 3 for t in p] for p in wl.prompts]
    llm = LLM(path, device=DEVICE, attention_backend=backend, max_total_tokens=2048, page_size=4,
              cascade_min_prefix_len=8, **engine_kw)  # fmt: skip
    if llm.engine.kv_pool.quantized:
        layers = len(llm.engine.kv_pool.k)
        llm.engine.kv_pool.set_scales([0.6] * layers, [0.2] * layers)
    stats = cascade_stats(llm)  # counting starts here
    out = llm.generate(prompts, SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True), use_tqdm=False)
    return [o.output_ids for o in out], stats


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_engine_same_greedy_tokens_with_the_cascade_on_and_off(tiny_path, backend, kv):
    """Greedy tokens are the same with the cascade on and off; with an FP8 KV cache too (chapter 15: the cascade
    reads the stored numbers with the layer's scales, as the engine's own backend does)."""
    skip_unless(backend == "triton")
    on, stats = shared_prefix_tokens(tiny_path, backend, kv_cache_dtype=kv)
    off, no_stats = shared_prefix_tokens(tiny_path, backend, disable_cascade_attention=True, kv_cache_dtype=kv)
    assert no_stats is None and stats is not None
    assert stats.cascade_steps > 0 and stats.kv_tokens_cascade < stats.kv_tokens_plain  # the cascade really ran
    assert on == off
    radix_off, none = shared_prefix_tokens(tiny_path, backend, disable_radix_cache=True, kv_cache_dtype=kv)
    assert none is None and radix_off == on  # no radix cache: nothing is shared, no cascade


def test_engine_runs_the_default_planner_alone_and_the_cascade_planner_when_given(tiny_llm):
    """The attention-planner seam on a CPU. ``Engine(...)`` alone plans every step on its own backend and captures
    nothing for a cascade; given chapter 11's planner factory, its decode batches whose rows share a cached prefix
    run on the cascade (its plain-PyTorch path). The greedy tokens are the chapter-00 oracle's both ways, and the
    cascade really ran: the planner showed its observers decode steps with groups, and every such step's attention
    backend was the cascade."""
    from minisgl_ref.engine.attention_planner import AttentionPlanner
    from minisgl_ref.engine.engine import Engine
    from minisgl_ref.perf.attention import attention_planner
    from minisgl_ref.perf.cascade import CascadePlanner

    prompts, params = ef.shared_prefix_workload()
    expected = ef.oracle(tiny_llm, prompts, params)
    from minisgl_ref.core.config import EngineConfig

    config = EngineConfig(page_size=4, cascade_min_prefix_len=16)
    outputs = {}
    for name, factory in (("default", None), ("cascade", attention_planner)):
        engine = Engine(tiny_llm.model, tiny_llm.config, config, device="cpu", context_length=tiny_llm.context_length,
                        attention_planner=factory)
        planner = engine.runner.planner
        steps: list[tuple[PrefixGroups | None, object]] = []  # per decode step: its groups and its backend
        if name == "default":
            assert type(planner) is AttentionPlanner and planner.decode_backends == (engine.runner.attn_backend,)
        else:
            assert isinstance(planner, CascadePlanner) and planner.decode_backends[1] is planner.cascade
            forward = engine.runner.forward

            def recording_forward(fb, prompt_plan=None):  # type: ignore[no-untyped-def]
                if fb.mode.is_decode:
                    steps.append((planner.cascade.step_groups, fb.attn_backend))
                return forward(fb, prompt_plan)

            engine.runner.forward = recording_forward  # type: ignore[method-assign]
            observed: list[PrefixGroups | None] = []
            planner.observers.append(lambda lens, groups: observed.append(groups))
        reqs = ef.make_reqs(tiny_llm, prompts, params)
        ef.drive(engine, reqs)
        ef.assert_matches_oracle(reqs, expected)
        ef.assert_pool_accounting(engine)
        outputs[name] = [r.output_ids for r in reqs]
        if name == "cascade":
            assert [g for g, _ in steps] == observed and any(g is not None for g in observed)
            assert all((backend is planner.cascade) == (g is not None) for g, backend in steps)
    assert outputs["default"] == outputs["cascade"]


def test_bench_reports_kv_bytes_per_decode_step():
    """``bench offline`` (quick shared-prefix workload, one run) records the cascade's counters in its results."""
    from minisgl_ref.bench import offline as bo
    from minisgl_ref.bench.workloads import shared_prefix_workload

    wl = shared_prefix_workload(num_groups=2, prompts_per_group=4, system_len=300, question_len=8, output_len=3)
    model = bo.quick_model("cpu")
    kw = dict(bo.QUICK_BUDGETS, max_total_tokens=4096)
    on = bo.run_stage("overlap", wl, model, kw)
    assert on.decode_steps and on.cascade_decode_steps and on.cascade_decode_steps <= on.decode_steps
    assert on.kv_bytes_per_decode_step < on.kv_bytes_per_decode_step_plain
    off = bo.run_stage("overlap", wl, model, dict(kw, disable_cascade_attention=True))
    assert off.kv_bytes_per_decode_step is None and off.decode_steps is None
    report = bo.make_report([on, off], wl, model, bandwidth=bo.H100_MEASURED_BANDWIDTH)
    assert report["results"][0]["kv_bytes_per_decode_step_plain"] > report["results"][0]["kv_bytes_per_decode_step"]


def test_config_flag_turns_the_cascade_off():
    import argparse

    from minisgl_ref.core.config import EngineConfig, add_flags, from_flags, to_argv

    p = argparse.ArgumentParser()
    add_flags(p, EngineConfig)
    cfg = from_flags(EngineConfig, p.parse_args(["--disable-cascade-attention", "--cascade-min-prefix-len", "64"]))
    assert cfg.disable_cascade_attention and cfg.cascade_min_prefix_len == 64
    assert "--disable-cascade-attention" in to_argv(cfg)
    assert not EngineConfig().disable_cascade_attention
    with pytest.raises(ValueError, match="cascade_min_prefix_len"):
        EngineConfig(cascade_min_prefix_len=0)


# ------------------------------------------------------------------------------------------------------ GPU


def gpu_backend(name: str, batch: Batch):  # type: ignore[no-untyped-def]
    from minisgl_ref.attention.registry import build_backend, check_backend_can_run

    try:
        check_backend_can_run(name, torch.device("cuda"))
    except ValueError:
        pytest.skip(f"{name} cannot run here")
    return build_backend(name, batch.pool, batch.table, num_q_heads=batch.layer.num_heads, page_size=1,
                         device=torch.device("cuda"))  # fmt: skip


def run_plain(name: str, batch: Batch) -> torch.Tensor:
    backend = gpu_backend(name, batch)
    fb = dataclasses.replace(batch.fb, attn_backend=backend)
    backend.init_forward_metadata(fb)
    return backend.attend_decode(batch.q, batch.layer, fb)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


GPU_LAYOUTS = [  # (groups x rows per group, shared prefix, longest suffix, rows alone)
    (64, 4, 2048, 384, 0),  # the shared-prefix workload, shuffled arrivals: ~4 rows of each group running
    (16, 16, 2048, 384, 0),  # the same, whole groups running together
    (8, 2, 4096, 64, 16),  # long prefixes, short suffixes, some rows alone
    (2, 5, 513, 3000, 3),  # a prefix off the page boundary of 16, long suffixes
]


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", GPU_LAYOUTS, ids=[f"{g}x{n}-p{p}-s{s}-a{a}" for g, n, p, s, a in GPU_LAYOUTS])
def test_gpu_cascade_matches_the_default_decode_path(layout, page_size):
    """bf16, Qwen3-0.6B's heads (16 query, 8 KV, head dim 128): the cascade against FlashInfer and FA3 (the
    default decode path on an H100) and torch_native's math: relative error below 1e-2, like every backend."""
    num_groups, per_group, prefix, suffix, alone = layout
    rng = random.Random(num_groups * 7 + page_size)
    groups = [(prefix, [rng.randint(1, suffix) for _ in range(per_group)]) for _ in range(num_groups)]
    batch = make_batch(groups, [rng.randint(1, prefix + suffix) for _ in range(alone)], page_size=page_size,
                       num_kv_heads=8, gqa=2, head_dim=128, dtype=torch.bfloat16, seed=num_groups,
                       device="cuda")  # fmt: skip
    found = find_prefix_groups(batch.table.host_np, batch.rows, batch.fb.seq_lens_cpu, page_size, 256)
    assert found is not None and found.num_groups == num_groups
    out = run_cascade(batch, found, True)
    assert rel(out, oracle(batch)) < 1e-2
    for name in ("flashinfer", "fa3"):
        assert rel(out, run_plain(name, batch)) < 1e-2, name


@pytest.mark.gpu
def test_gpu_cascade_cuda_graph_replay_matches_eager():
    """Capture the cascade for bs=16 with no groups (what the graph runner captures), then replay it with two
    different groupings: bit-identical to eager (same kernels, same plan) and within bf16 tolerance of FlashInfer."""
    batch = make_batch([(1024, [5, 70, 200]), (512, [1, 9]), (2048, [300, 2, 17, 40])], [100, 3000, 7],
                       page_size=16, num_kv_heads=8, gqa=2, head_dim=128, dtype=torch.bfloat16,
                       device="cuda")  # fmt: skip
    found = find_prefix_groups(batch.table.host_np, batch.rows, batch.fb.seq_lens_cpu, 16, 256)
    assert found is not None and found.num_groups == 3
    backend = batch.backend(True)
    backend.init_graph_buffers(max_bs=16)
    bs = len(batch.rows)
    fb = dataclasses.replace(batch.fb, attn_backend=backend)
    backend.prepare_capture(fb)
    q = batch.q.clone()
    backend.attend_decode(q, batch.layer, fb)  # warm up (compiles) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.attend_decode(q, batch.layer, fb)
    one_group = PrefixGroups(found.prefix_lens[:1], found.rows[:1])
    for groups in (found, one_group, None):
        backend.step_groups = groups
        backend.prepare_replay(fb)
        graph.replay()
        eager = run_cascade(batch, groups, True)
        torch.cuda.synchronize()
        assert torch.equal(out, eager), groups
        assert rel(out, run_plain("flashinfer", batch)) < 1e-2
    assert bs <= 16


@pytest.mark.gpu
def test_gpu_engine_cascade_on_and_off(tmp_path):
    """Qwen3-0.6B's shape cut to 4 layers (dummy weights, bf16), a shared-prefix workload through the default
    engine (CUDA graphs on): the cascade's graphs run, and every step's logits stay within bf16 rounding of the
    engine without the cascade. Greedy tokens are compared as in test_attention_backends: equal wherever the
    reference's top-1 beats its top-2 by more than twice the largest logit difference, until a legitimate
    near-tie flip makes a request's later steps incomparable."""
    import json
    from importlib import resources

    from minisgl_ref import LLM, SamplingParams
    from minisgl_ref.bench.cascade_stats import cascade_stats
    from minisgl_ref.bench.workloads import shared_prefix_workload
    from minisgl_ref.engine.cuda_graph import CudaGraphRunner
    from minisgl_ref.perf.cascade import CascadePlanner

    cfg = json.loads(resources.files("minisgl_ref.models").joinpath("configs/qwen3-0.6b.json").read_text())
    cfg["num_hidden_layers"] = 4
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    wl = shared_prefix_workload(num_groups=4, prompts_per_group=6, system_len=600, question_len=20, output_len=6)

    def logits(**kw):  # type: ignore[no-untyped-def]
        llm = LLM(str(tmp_path), load_format="dummy", dtype="bfloat16", device="cuda", max_total_tokens=65536,
                  cuda_graph_max_bs=32, **kw)  # fmt: skip
        runner = llm.engine.runner
        forward, run = runner.forward, runner.run
        seen: list[torch.Tensor] = []
        rows: dict[tuple[int, ...], list[torch.Tensor]] = {}

        def forward_recording(fb, prompt_plan=None):  # type: ignore[no-untyped-def]
            out, prompt_logprobs = forward(fb, prompt_plan)
            seen.append(out.float().cpu())
            return out, prompt_logprobs

        def run_recording(batch):  # type: ignore[no-untyped-def]
            out = run(batch)
            step = seen.pop()
            for i, req in enumerate(batch.reqs):
                rows.setdefault(tuple(req.input_ids), []).append(step[i])
            return out

        runner.forward, runner.run = forward_recording, run_recording
        stats = cascade_stats(llm)
        llm.generate(wl.prompts, SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True), use_tqdm=False)
        return rows, runner, stats

    on, runner, stats = logits()
    planner = runner.planner
    assert isinstance(planner, CascadePlanner)
    assert any(isinstance(g, CudaGraphRunner) and g.backend is planner.cascade for g in runner.graph_runners)
    assert stats is not None and stats.cascade_steps > 0
    off, runner_off, no_stats = logits(disable_cascade_attention=True)
    assert no_stats is None and not isinstance(runner_off.planner, CascadePlanner) and on.keys() == off.keys()
    compared = 0
    for key in off:
        assert len(off[key]) == len(on[key])
        for a, b in zip(off[key], on[key]):
            assert rel(b, a) < 2e-2
            compared += 1
            if int(a.argmax()) != int(b.argmax()):
                top2 = a.topk(2).values
                margin = (top2[0] - top2[1]).item()
                assert margin <= 2 * (b - a).abs().max().item(), "argmax flipped with a clear margin"
                break
    assert compared >= 24 * 3
