"""The ``triton`` attention backend against the torch_native oracle (chapter 07).

Without a GPU the Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set below before the kernels
are imported): every program of the grid is executed in numpy, one after another, so these CPU tests keep shapes
small (contexts up to ~100 tokens) and still cover what matters: batch sizes 1-4, GQA ratios 1/2/4, head dims
64/128 (and the tiny models' 16), page sizes 1 and 16 through the engine's own allocator and page table, extend
with and without a cached prefix, decode with several KV splits (and empty ones), float32 / bf16 / fp16, the
CUDA-graph hooks, and a whole engine generating the same greedy tokens as with torch_native.

``pytest -m gpu`` runs the large shape grid of the GPU issue on a CUDA device (batch 1-256, context 1-8192, GQA
1/2/4/8, head dims 64/128, page sizes 1/16/64, bf16/fp16, relative error below 1e-2) and the engine on the GPU.
"""

from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # triton.jit reads TRITON_INTERPRET when it decorates a function: triton's own library functions when triton
    # is first imported, our kernels when their modules are. So this must happen before the first `import triton`.
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")
# If something imported triton earlier in this process (without the variable), its library was compiled-mode
# decorated and the interpreter cannot call it: the CPU tests then run in a fresh interpreter (see the last CPU test).
NEEDS_SUBPROCESS = not HAS_CUDA and type(triton.language.cdiv).__name__ == "JITFunction"

from minisgl_ref.attention.torch_native import TorchNativeBackend, reference_attention  # noqa: E402
from minisgl_ref.attention.triton_backend import TritonAttnBackend  # noqa: E402
from minisgl_ref.attention.triton_kernels import build_kv_indices  # noqa: E402
from minisgl_ref.engine.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from minisgl_ref.kvcache.allocator import PageAllocator  # noqa: E402
from minisgl_ref.kvcache.pool import KVPool  # noqa: E402
from minisgl_ref.kvcache.req_to_token import ReqToTokenPool  # noqa: E402
from minisgl_ref.layers.attention import AttentionLayer  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(autouse=True)
def _interpreted_kernels(request: pytest.FixtureRequest) -> None:
    if NEEDS_SUBPROCESS and request.node.originalname != "test_cpu_tests_in_a_fresh_interpreter":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; covered by the subprocess test")
# Small splits on the CPU so that contexts of ~100 tokens are cut into several pieces and the reduction runs.
CPU_SPLITS = dict(max_kv_splits=4, min_kv_split_len=16)


# ---------------------------------------------------------------------------------------------------- helpers


@dataclass
class Case:
    """One attention call laid out exactly as the engine lays it out: pages from a PageAllocator (handed out in
    shuffled order, so a request's pages are scattered over the pool), slots in a ReqToTokenPool row per request,
    the new tokens' slots in ``out_cache_loc``. The pool starts full of random values, so reading a wrong slot
    shows up as a wrong result."""

    batch: ForwardBatch
    pool: KVPool
    table: ReqToTokenPool
    layer: AttentionLayer
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def make_case(
    specs: list[tuple[int, int]],  # (prefix_len, extend_len) per request; decode: extend_len 1
    *,
    num_kv_heads: int,
    gqa: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype = torch.float32,
    decode: bool = False,
    seed: int = 0,
    device: str = DEVICE,
) -> Case:
    rng = random.Random(seed)
    gen = torch.Generator(device).manual_seed(seed)  # random values made on the device (GPU pools are large)
    num_heads = num_kv_heads * gqa
    total = sum(p + e for p, e in specs)
    num_pages = total // page_size + 2 * len(specs) + 2
    allocator = PageAllocator(num_pages, page_size, device)
    rng.shuffle(allocator._free)  # scatter: consecutive allocations get non-adjacent pages
    max_ctx = max(p + e for p, e in specs) + 1
    table = ReqToTokenPool(2 * len(specs) + 1, max_ctx, device)
    pool = KVPool(1, num_pages * page_size, num_kv_heads, head_dim, dtype, device)
    pool.k[0].normal_(generator=gen)
    pool.v[0].normal_(generator=gen)
    rows = rng.sample(range(table.max_requests), len(specs))  # page-table rows in no particular order
    new_slots = []
    for row, (prefix, extend) in zip(rows, specs):
        # Prefix then new tokens, each through alloc_tokens: the new tokens first fill the prefix's last page.
        pre = allocator.alloc_tokens(0, 0, prefix)
        table.write(row, 0, pre)
        new = allocator.alloc_tokens(prefix, int(pre[-1]) if prefix else 0, extend)
        table.write(row, prefix, new)
        new_slots.append(new)
    num_tokens = sum(e for _, e in specs)
    q = 2 * torch.randn(num_tokens, num_heads, head_dim, generator=gen, device=device, dtype=dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
    positions = [p + i for p, e in specs for i in range(e)]
    batch = ForwardBatch(
        mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        extend_lens_cpu=[e for _, e in specs],
        prefix_lens_cpu=[p for p, _ in specs],
        attn_backend=None,  # type: ignore[arg-type]
        req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=device),
        out_cache_loc=torch.cat(new_slots).to(device),
    )
    return Case(batch, pool, table, AttentionLayer(0, num_heads, num_kv_heads, head_dim), q, k, v)


def oracle(case: Case) -> torch.Tensor:
    """torch_native on a float32 copy of the same pool and inputs: [T, H * D] float32."""
    pool = case.pool
    ref_pool = KVPool(1, pool.num_slots, pool.k[0].shape[1], pool.k[0].shape[2], torch.float32, pool.k[0].device)
    ref_pool.k[0].copy_(pool.k[0])
    ref_pool.v[0].copy_(pool.v[0])
    backend = TorchNativeBackend(ref_pool, case.table)
    case.batch.attn_backend = backend
    backend.init_forward_metadata(case.batch)
    return backend.forward(case.q.float(), case.k.float(), case.v.float(), case.layer, case.batch)


def run_triton(case: Case, **backend_kw: int) -> torch.Tensor:
    backend = TritonAttnBackend(case.pool, case.table, **backend_kw)
    case.batch.attn_backend = backend
    backend.init_forward_metadata(case.batch)
    return backend.forward(case.q, case.k, case.v, case.layer, case.batch)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def check(case: Case, tol: float | None = None, **backend_kw: int) -> float:
    ref = oracle(case)
    out = run_triton(case, **backend_kw)
    assert out.shape == ref.shape and out.dtype == case.q.dtype
    # The new K/V went into the pool at out_cache_loc (what later steps read).
    loc = case.batch.out_cache_loc
    assert torch.equal(case.pool.k[0][loc], case.k) and torch.equal(case.pool.v[0][loc], case.v)
    err = rel_error(out, ref)
    if tol is None:  # float32: the kernels compute exactly what the oracle computes, up to summation order
        torch.testing.assert_close(out.float(), ref, rtol=1e-4, atol=1e-5)
    else:
        assert err < tol, f"relative error {err:.2e} >= {tol}"
    return err


# ---------------------------------------------------------------------------------------------- CPU (or GPU)

DECODE_CASES = [
    # context lengths (new token included), KV heads, GQA, head dim, page size
    ([1], 2, 1, 64, 1),
    ([17, 100], 2, 2, 128, 16),
    ([1, 33, 64, 97], 1, 4, 64, 16),
    ([100, 5, 63], 2, 1, 128, 1),
    ([65, 2, 99, 16], 2, 2, 64, 1),
]


@pytest.mark.parametrize("ctx,kvh,gqa,head_dim,page", DECODE_CASES)
def test_decode_matches_torch_native(ctx, kvh, gqa, head_dim, page):
    case = make_case([(n - 1, 1) for n in ctx], num_kv_heads=kvh, gqa=gqa, head_dim=head_dim, page_size=page,
                     decode=True, seed=len(ctx) * 100 + head_dim)  # fmt: skip
    check(case, **CPU_SPLITS)


def test_decode_with_empty_kv_splits():
    """min_kv_split_len=1: a context of 5 cut into 4 pieces of 2 leaves the 4th piece empty; stage 1 skips it
    and stage 2 must not read it. One piece only (max_kv_splits=1) must agree too."""
    case = make_case([(4, 1), (9, 1), (0, 1), (6, 1)], num_kv_heads=2, gqa=2, head_dim=64, page_size=1, decode=True)
    check(case, max_kv_splits=4, min_kv_split_len=1)
    case = make_case([(4, 1), (9, 1), (0, 1), (6, 1)], num_kv_heads=2, gqa=2, head_dim=64, page_size=1, decode=True)
    check(case, max_kv_splits=1)


EXTEND_CASES = [
    # (prefix, extend) per request, KV heads, GQA, head dim, page size
    ([(0, 1)], 2, 1, 64, 1),
    ([(0, 100)], 1, 2, 128, 16),  # plain prefill, several query and key blocks
    ([(32, 40), (17, 83)], 1, 4, 64, 16),  # page-aligned and unaligned prefixes (a chunked prefill's)
    ([(0, 7), (50, 1), (3, 70), (64, 33)], 2, 2, 64, 1),  # mixed: a decode-like row rides along
    ([(99, 1), (0, 65), (10, 10)], 2, 1, 128, 16),
]


@pytest.mark.parametrize("specs,kvh,gqa,head_dim,page", EXTEND_CASES)
def test_extend_matches_torch_native(specs, kvh, gqa, head_dim, page):
    case = make_case(specs, num_kv_heads=kvh, gqa=gqa, head_dim=head_dim, page_size=page, seed=len(specs) + head_dim)
    check(case)


def test_extend_long_prefix_uses_the_large_tiles():
    """A prefix of >= 512 tokens switches the extend kernel to 128-query tiles with 2 pipeline stages."""
    case = make_case([(600, 20), (0, 5)], num_kv_heads=1, gqa=2, head_dim=64, page_size=16, seed=3)
    check(case)
    backend = case.batch.attn_backend
    assert isinstance(backend, TritonAttnBackend) and backend.forward_metadata.extend_config["block_m"] == 128


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "extend"])
def test_half_precision_within_tolerance(dtype, decode):
    specs = [(40, 1), (99, 1), (0, 1)] if decode else [(0, 37), (48, 20), (5, 1)]
    case = make_case(specs, num_kv_heads=2, gqa=2, head_dim=128, page_size=16, dtype=dtype, decode=decode, seed=7)
    check(case, tol=1e-2, **CPU_SPLITS)


def test_head_dim_not_a_power_of_two():
    """Head dims are padded to a power of two inside the kernels (masked loads): e.g. 80 or 96 in real models."""
    case = make_case([(20, 5), (0, 9)], num_kv_heads=1, gqa=2, head_dim=80, page_size=16)
    check(case)
    case = make_case([(20, 1), (8, 1)], num_kv_heads=1, gqa=2, head_dim=80, page_size=16, decode=True)
    check(case, **CPU_SPLITS)


def test_kv_indices_flatten_the_page_table():
    table = ReqToTokenPool(4, 10, DEVICE)
    table.table.copy_(torch.arange(40, dtype=torch.int32).view(4, 10) + 100)
    rows = torch.tensor([2, 0, 3], device=DEVICE)
    lens = torch.tensor([3, 0, 5], dtype=torch.int32, device=DEVICE)
    indptr = torch.tensor([0, 3, 3, 8], dtype=torch.int32, device=DEVICE)
    out = torch.full((8,), -1, dtype=torch.int32, device=DEVICE)
    build_kv_indices(table.table, rows, lens, indptr, out)
    assert out.tolist() == [120, 121, 122, 130, 131, 132, 133, 134]


def test_cuda_graph_hooks_refill_static_buffers_in_place():
    """The capture hook points the metadata at static buffers; the replay hook refills them for a new batch (here
    a different context per request, a padding row with length 1) without allocating: same storage, new contents.
    On the CPU nothing is captured, but the decode kernels read exactly what a replayed graph would."""
    case = make_case([(30, 1), (70, 1), (3, 1)], num_kv_heads=2, gqa=2, head_dim=64, page_size=16, decode=True)
    backend = TritonAttnBackend(case.pool, case.table, num_q_heads=4, **CPU_SPLITS)
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    bs = 4  # padded: the 4th row is a dummy (page-table row of request 0, length 1); its output is ignored
    rows = torch.cat([case.batch.req_pool_indices, case.batch.req_pool_indices[:1]])
    seq_lens = torch.tensor([1, 1, 1, 1], device=DEVICE)
    backend.init_forward_metadata_capture_cuda_graph(bs, bs, rows, seq_lens, ForwardMode.DECODE)
    md = backend.forward_metadata
    buffers = [md.kv_indptr, md.kv_indices, md.mid_o, md.mid_lse]
    ptrs = [t.data_ptr() for t in buffers]

    real = torch.tensor(case.batch.seq_lens_cpu + [1], device=DEVICE)
    backend.init_forward_metadata_replay_cuda_graph(bs, rows, real, forward_mode=ForwardMode.DECODE)
    assert backend.forward_metadata is md and [t.data_ptr() for t in buffers] == ptrs
    assert md.kv_indptr.tolist() == [0, 31, 102, 106, 107]

    pad = lambda t: torch.cat([t, t[:1]])  # noqa: E731
    padded = ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=pad(case.batch.input_ids), positions=pad(case.batch.positions),
        extend_lens_cpu=[1] * 4, prefix_lens_cpu=[30, 70, 3, 0], attn_backend=backend, req_pool_indices=rows,
        out_cache_loc=torch.cat([case.batch.out_cache_loc, torch.zeros(1, dtype=torch.int64, device=DEVICE)]),
    )  # fmt: skip
    ref = oracle(case)  # stores the real rows' new K/V into the pool
    out = backend.forward(pad(case.q), pad(case.k), pad(case.v), case.layer, padded)[:3]
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_extend_is_not_captured():
    case = make_case([(3, 1)], num_kv_heads=1, gqa=1, head_dim=64, page_size=1, decode=True)
    backend = TritonAttnBackend(case.pool, case.table, num_q_heads=1)
    backend.init_cuda_graph_state(max_bs=1, max_num_tokens=1)
    with pytest.raises(NotImplementedError):
        backend.init_forward_metadata_capture_cuda_graph(1, 1, case.batch.req_pool_indices,
                                                         torch.tensor([4], device=DEVICE), ForwardMode.EXTEND)


@pytest.mark.skipif(not NEEDS_SUBPROCESS, reason="the CPU tests ran in this process")
def test_cpu_tests_in_a_fresh_interpreter():
    import subprocess

    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", __file__]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


# ------------------------------------------------------------------------------------------------ the engine

# The engine tests' tiny Llama (GQA 2, head dim 16). initializer_range=0.1 makes attention decisive for the greedy
# token, so a backend that reads a wrong slot or masks wrongly changes the output instead of agreeing by chance.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=320, max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.1)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY), dtype=torch.float32)
    folder = tmp_path_factory.mktemp("tiny_attn_llama")
    model.save_pretrained(folder)
    return folder


def generate_tokens(path, backend: str, device: str, **engine_kw) -> tuple[list[list[int]], int]:
    """Two rounds of greedy generation (the second round's prompts share prefixes with the first's, so the radix
    cache serves cached prefixes); returns the tokens and the number of cached prompt tokens."""
    from minisgl_ref import LLM, SamplingParams

    llm = LLM(path, device=device, max_total_tokens=4096, **engine_kw)  # not "85% of the GPU" per engine
    if backend == "triton":
        engine = llm.engine
        engine.runner.attn_backend = TritonAttnBackend(engine.kv_pool, engine.req_to_token, max_kv_splits=3,
                                                       min_kv_split_len=8)  # fmt: skip
    rng = random.Random(1)
    base = [[rng.randrange(3, 320) for _ in range(n)] for n in (40, 23, 9)]
    follow = [base[0][:37] + [5, 6, 7], base[1] + [11] * 12, [rng.randrange(3, 320) for _ in range(30)]]
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    out = llm.generate(base, params, use_tqdm=False) + llm.generate(follow, params, use_tqdm=False)
    return [o.output_ids for o in out], sum(o.cached_tokens for o in out)


# Chunked prefill (extend rows with a prefix that is not page aligned), mixed prefill + decode steps, radix hits.
ENGINE_CONFIG = dict(page_size=16, chunked_prefill_size=16, enable_mixed_chunk=True)


def test_engine_greedy_tokens_match_torch_native(tiny_path):
    ref, ref_cached = generate_tokens(tiny_path, "torch_native", DEVICE, **ENGINE_CONFIG)
    ours, cached = generate_tokens(tiny_path, "triton", DEVICE, **ENGINE_CONFIG)
    assert cached == ref_cached and cached > 0  # the prefix path of the extend kernel ran
    assert ours == ref


# --------------------------------------------------------------------------------------------------- GPU grid

GPU_DTYPES = [torch.bfloat16, torch.float16]
GQA = [1, 2, 4, 8]
HEAD_DIMS = [64, 128]
PAGES = [1, 16, 64]
NUM_HEADS = 16  # KV heads = 16 / GQA: 16, 8, 4, 2

# (batch size, longest context): the longest request has exactly that context, the others a random one below.
GPU_DECODE_SHAPES = [(1, 1), (1, 8192), (3, 777), (16, 2048), (64, 2048), (128, 4096), (256, 1), (256, 1024),
                     (256, 8192)]  # fmt: skip
# (batch size, longest prefix, longest extend)
GPU_EXTEND_SHAPES = [(1, 0, 1), (1, 0, 4096), (1, 4096, 4096), (4, 2048, 512), (16, 1000, 100), (64, 100, 64),
                     (256, 32, 8), (256, 0, 1)]  # fmt: skip


def random_specs(rng: random.Random, bs: int, max_prefix: int, max_extend: int) -> list[tuple[int, int]]:
    specs = [(max_prefix, max_extend)]
    specs += [(rng.randint(0, max_prefix), rng.randint(1, max_extend)) for _ in range(bs - 1)]
    return specs


def chunked_oracle(case: Case, chunk: int = 1024) -> torch.Tensor:
    """torch_native's math (reference_attention, float32) one request and one query chunk at a time, so that an
    8192 x 8192 prefill does not need the whole score matrix at once."""
    k_all, v_all = case.pool.k[0], case.pool.v[0]
    table, rows = case.table.table, case.batch.req_pool_indices.tolist()
    outs, start = [], 0
    for row, prefix, extend in zip(rows, case.batch.prefix_lens_cpu, case.batch.extend_lens_cpu):
        slots = table[row, : prefix + extend].long()
        for i in range(0, extend, chunk):
            j = min(extend, i + chunk)
            s = slots[: prefix + j]
            q = case.q[start + i : start + j].float()
            outs.append(reference_attention(q, k_all[s], v_all[s], case.layer.scale))
        start += extend
    return torch.cat(outs).flatten(1)


def gpu_check(case: Case, tol: float = 1e-2) -> float:
    backend = TritonAttnBackend(case.pool, case.table)
    case.batch.attn_backend = backend
    backend.init_forward_metadata(case.batch)
    out = backend.forward(case.q, case.k, case.v, case.layer, case.batch)
    err = rel_error(out, chunked_oracle(case))
    assert err < tol, f"relative error {err:.2e}"
    return err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("gqa", GQA)
def test_gpu_decode_grid(gqa, head_dim, page, dtype):
    rng = random.Random(gqa * 1000 + head_dim * 10 + page)
    for bs, ctx in GPU_DECODE_SHAPES:
        specs = [(n - 1, 1) for n in [ctx] + [rng.randint(1, ctx) for _ in range(bs - 1)]]
        case = make_case(specs, num_kv_heads=NUM_HEADS // gqa, gqa=gqa, head_dim=head_dim, page_size=page,
                         dtype=dtype, decode=True, seed=bs + ctx, device="cuda")  # fmt: skip
        gpu_check(case)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("gqa", GQA)
def test_gpu_extend_grid(gqa, head_dim, page, dtype):
    rng = random.Random(gqa * 1000 + head_dim * 10 + page)
    for bs, max_prefix, max_extend in GPU_EXTEND_SHAPES:
        specs = random_specs(rng, bs, max_prefix, max_extend)
        case = make_case(specs, num_kv_heads=NUM_HEADS // gqa, gqa=gqa, head_dim=head_dim, page_size=page,
                         dtype=dtype, seed=bs + max_extend, device="cuda")  # fmt: skip
        gpu_check(case)


@pytest.mark.gpu
def test_gpu_decode_cuda_graph_replay_matches_eager():
    """Capture one layer's decode attention for bs=8, replay it for new contexts: identical to eager."""
    rng = random.Random(0)
    specs = [(rng.randint(0, 3000), 1) for _ in range(8)]
    case = make_case(specs, num_kv_heads=8, gqa=2, head_dim=128, page_size=16, dtype=torch.bfloat16, decode=True,
                     device="cuda")  # fmt: skip
    backend = TritonAttnBackend(case.pool, case.table, num_q_heads=16)
    backend.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    rows = case.batch.req_pool_indices
    real = torch.tensor(case.batch.seq_lens_cpu, device="cuda")
    q, k, v = case.q.clone(), case.k.clone(), case.v.clone()
    case.batch.attn_backend = backend
    backend.init_forward_metadata_capture_cuda_graph(8, 8, rows, torch.ones_like(real), ForwardMode.DECODE)
    backend.forward(q, k, v, case.layer, case.batch)  # warm up (compiles) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, case.layer, case.batch)
    backend.init_forward_metadata_replay_cuda_graph(8, rows, real, forward_mode=ForwardMode.DECODE)
    graph.replay()
    eager_backend = TritonAttnBackend(case.pool, case.table)
    case.batch.attn_backend = eager_backend
    eager_backend.init_forward_metadata(case.batch)
    eager = eager_backend.forward(q, k, v, case.layer, case.batch)
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert rel_error(out, chunked_oracle(case)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("engine_kw", [dict(page_size=1, chunked_prefill_size=16, enable_mixed_chunk=True),
                                       dict(page_size=16, chunked_prefill_size=32),
                                       dict(page_size=64, chunked_prefill_size=64)],
                         ids=["page1-chunk16-mixed", "page16-chunk32", "page64-chunk64"])  # fmt: skip
def test_gpu_engine_greedy_tokens_match_torch_native(tiny_path, engine_kw):
    ref, _ = generate_tokens(tiny_path, "torch_native", "cuda", **engine_kw)
    ours, _ = generate_tokens(tiny_path, "triton", "cuda", **engine_kw)
    assert ours == ref
