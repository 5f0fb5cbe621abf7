"""The fused MoE (``minisgl_ref.moe.fused_moe``) against the reference loop over experts (chapter 14).

On the CPU the grouped-GEMM kernel runs in Triton's interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1``
before anything imports triton), on small layers (H and I of 24-64) so the file stays within seconds. In float32
the kernel makes the same products as the reference; only the order of the sums differs (K in BLOCK_K steps, the
k choices of a token in slot order rather than expert order), so it is held to 1e-5. In bfloat16 the kernel
rounds the activation to bf16 before the second GEMM, where the reference stays in float32, and the CPU
interpreter truncates that rounding instead of rounding to nearest: two units in the last place of bf16
(2 x 2^-7 relative for values in [1, 2)), with the outputs of order one. On the GPU (``-m gpu``): bfloat16 at
Qwen3-30B-A3B's layer shape, and a CUDA graph captured once and replayed with another routing.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton")

from minisgl_ref.moe import fused_moe  # noqa: E402
from minisgl_ref.moe.experts import reference_experts  # noqa: E402
from minisgl_ref.moe.fused_moe import align_by_expert, default_block_m, fused_experts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_compiled = pytest.mark.skipif(DEVICE == "cpu" and type(triton.language.cdiv).__name__ == "JITFunction",
                                    reason="triton was imported before TRITON_INTERPRET=1 was set")

F32_TOL = dict(rtol=1e-5, atol=1e-5)
BF16_TOL = dict(rtol=1.6e-2, atol=1.6e-2)  # two bf16 ulps at 1-2; the outputs are of order one


def routing(tokens: int, top_k: int, num_experts: int, kind: str, g: torch.Generator) -> torch.Tensor:
    """topk_ids [tokens, k], k distinct experts per token as a router picks them.

    ``random``: uniform. ``overloaded``: expert 3 is every token's first choice. ``sparse``: only the even
    experts are ever chosen; the odd ones get nothing."""
    if kind == "sparse":
        pool = torch.arange(0, num_experts, 2)
        assert top_k <= len(pool)
        return torch.stack([pool[torch.randperm(len(pool), generator=g)[:top_k]] for _ in range(tokens)])
    scores = torch.rand(tokens, num_experts, generator=g)
    if kind == "overloaded":
        scores[:, 3] = 2.0  # above every other score: always chosen, first
    return scores.topk(top_k, dim=1).indices


def make_layer(tokens: int, hidden: int, inter: int, num_experts: int, top_k: int, kind: str,
               dtype: torch.dtype = torch.float32, seed: int = 0):
    """A random layer's inputs, scaled so that gate, up and the output are of order one, weights summing to 1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    ids = routing(tokens, top_k, num_experts, kind, g)
    weights = torch.rand(tokens, top_k, generator=g) + 0.1
    weights = weights / weights.sum(dim=1, keepdim=True)
    return (x.to(DEVICE, dtype), w13.to(DEVICE, dtype), w2.to(DEVICE, dtype), weights.to(DEVICE),
            ids.to(DEVICE))


# (tokens, k, experts, H, I, routing, block sizes): decode, k = 1 / 2 / 8, hundreds of tokens, token counts that
# are not multiples of BLOCK_M, H and I that are not multiples of BLOCK_N / BLOCK_K (masked last tiles), experts
# left empty, one expert taking every token, and BLOCK_M = 64.
CASES = [
    (1, 1, 8, 64, 32, "random", {}),
    (1, 8, 16, 64, 32, "random", {}),
    (37, 2, 8, 40, 24, "random", dict(block_n=16, block_k=16)),
    (200, 2, 8, 32, 32, "overloaded", {}),
    (130, 8, 16, 32, 32, "sparse", {}),
    (301, 1, 4, 48, 40, "overloaded", dict(block_m=64, block_n=32, block_k=16)),
    (23, 8, 8, 32, 24, "random", dict(block_m=32, block_n=16)),
]


@pytest.mark.task("14.1", weight=2)
@needs_compiled
@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}-k{c[1]}-E{c[2]}-H{c[3]}-I{c[4]}-{c[5]}" for c in CASES])
def test_fused_experts_matches_the_reference_fp32(case) -> None:
    tokens, top_k, num_experts, hidden, inter, kind, blocks = case
    args = make_layer(tokens, hidden, inter, num_experts, top_k, kind)
    ids = args[4]
    if kind == "sparse":
        assert not bool((ids % 2).any())  # the odd experts get no token
    if kind == "overloaded":
        assert bool((ids == 3).any(dim=1).all())  # every token reaches expert 3
    out = fused_experts(*args, **blocks)
    ref = reference_experts(*args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, **F32_TOL)
    assert ref.abs().mean() > 0.1  # a real signal, not zeros compared with zeros
    # deterministic: no atomics, so a second call is bit for bit the first
    assert torch.equal(fused_experts(*args, **blocks), out)


@needs_compiled
def test_fused_experts_bf16_on_the_interpreter() -> None:
    """bfloat16 inputs (the interpreter's dot runs in float32 on bf16 values): within two bf16 ulps."""
    args = make_layer(45, 64, 48, 8, 2, "random", dtype=torch.bfloat16, seed=3)
    out = fused_experts(*args)
    ref = reference_experts(*args)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), **BF16_TOL)


@needs_compiled
def test_fused_experts_reads_nothing_past_a_row() -> None:
    """Strided views whose gaps hold NaN: the hidden rows and the weight rows are followed by NaN columns, so a
    load past H or I in the last (partial) K tile, or a stride taken as the row length, would put NaN into the
    output. The kernel masks both operands of every partial tile and follows the given strides."""
    x, w13, w2, weights, ids = make_layer(29, 40, 24, 8, 2, "random", seed=11)

    def with_nan_gap(t: torch.Tensor) -> torch.Tensor:
        wide = torch.full((*t.shape[:-1], t.shape[-1] + 8), float("nan"), device=DEVICE)
        wide[..., : t.shape[-1]] = t
        return wide[..., : t.shape[-1]]
    gx, g13, g2 = with_nan_gap(x), with_nan_gap(w13), with_nan_gap(w2)
    assert not gx.is_contiguous() and not g13.is_contiguous() and not g2.is_contiguous()
    out = fused_experts(gx, g13, g2, weights, ids, block_n=16, block_k=16)
    assert not out.isnan().any()
    torch.testing.assert_close(out, reference_experts(x, w13, w2, weights, ids), **F32_TOL)


@needs_compiled
def test_fused_experts_takes_the_routing_weight_once_per_pair() -> None:
    """Doubling one token's routing weights doubles that token's output and no other's."""
    x, w13, w2, weights, ids = make_layer(20, 32, 32, 8, 2, "random", seed=7)
    out = fused_experts(x, w13, w2, weights, ids)
    doubled = weights.clone()
    doubled[5] *= 2
    out2 = fused_experts(x, w13, w2, doubled, ids)
    torch.testing.assert_close(out2[5], 2 * out[5], **F32_TOL)
    others = torch.arange(20, device=DEVICE) != 5
    assert torch.equal(out2[others], out[others])


def test_fused_experts_refuses_bad_input() -> None:
    x, w13, w2, weights, ids = make_layer(3, 32, 16, 4, 2, "random")
    with pytest.raises(ValueError, match="w2 must be"):
        fused_experts(x, w13, w2[:, :, :8], weights, ids)
    with pytest.raises(ValueError, match="at least 16"):
        fused_experts(x, w13, w2, weights, ids, block_k=8)
    empty = fused_experts(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, 32)


@needs_compiled
def test_available_where_the_kernel_runs() -> None:
    """On a GPU, or on the CPU under the interpreter (this file's CPU runs): the layer may take the kernel."""
    assert fused_moe.available(torch.zeros(1, device=DEVICE))


def test_default_block_m_follows_the_load() -> None:
    """16 rows while experts average fewer than 64 pairs, 64 from there (Qwen3-30B-A3B: E = 128, k = 8)."""
    assert [default_block_m(t * 8, 128) for t in (1, 64, 512, 1023, 1024, 4096)] == [16, 16, 16, 16, 64, 64]


# ------------------------------------------------------------------------------------------------------------------
# align_by_expert: the layout's invariants
# ------------------------------------------------------------------------------------------------------------------


def check_alignment(ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    """Every pair once, every block one expert, padding only with the sentinel and only at the end of an expert's
    last block, empty experts no block, nothing used past ``num_tokens_post_padded``."""
    rows, expert_of_block, post = align_by_expert(ids, num_experts, block_m)
    flat = ids.reshape(-1).tolist()
    sentinel = len(flat)
    rows, expert_of_block, used = rows.tolist(), expert_of_block.tolist(), int(post.item())
    assert used % block_m == 0 and used <= len(rows) and len(rows) == len(expert_of_block) * block_m
    # the worst case fits: each used expert one row short of a block
    assert len(rows) >= len(flat) + len(set(flat)) * (block_m - 1)
    real = [r for r in rows[:used] if r != sentinel]
    assert sorted(real) == list(range(len(flat)))  # every pair exactly once
    assert all(r == sentinel for r in rows[used:]) and all(e == -1 for e in expert_of_block[used // block_m:])
    counts = {e: flat.count(e) for e in range(num_experts)}
    blocks_of = {e: 0 for e in range(num_experts)}
    for b in range(used // block_m):
        e = expert_of_block[b]
        blocks_of[e] += 1
        block = rows[b * block_m:(b + 1) * block_m]
        members = [r for r in block if r != sentinel]
        assert members and all(flat[r] == e for r in members)  # one expert, never a block of padding only
        assert block == members + [sentinel] * (block_m - len(members))  # padding only after the pairs
        assert members == sorted(members)  # pairs keep their order within an expert
    for e in range(num_experts):  # empty experts get no block; the others just enough
        assert blocks_of[e] == -(-counts[e] // block_m)
    used_experts = expert_of_block[: used // block_m]
    assert used_experts == sorted(used_experts)  # grouped, in expert order


@pytest.mark.task("14.1", weight=3)
@pytest.mark.parametrize("kind", ["random", "overloaded", "sparse"])
@pytest.mark.parametrize("tokens,top_k,block_m", [(1, 8, 16), (1, 1, 16), (37, 2, 16), (200, 8, 64), (5, 2, 1)])
def test_align_by_expert_invariants(kind, tokens, top_k, block_m) -> None:
    g = torch.Generator().manual_seed(tokens * 10 + top_k)
    check_alignment(routing(tokens, top_k, 16, kind, g), 16, block_m)


@pytest.mark.task("14.1")
def test_align_by_expert_example() -> None:
    """Three tokens, k = 2, four experts, blocks of 2: expert 1 is empty and gets no block."""
    ids = torch.tensor([[2, 0], [0, 3], [2, 0]])  # pairs 0..5 -> experts 2, 0, 0, 3, 2, 0
    rows, expert_of_block, post = align_by_expert(ids, 4, 2)
    s = 6  # the sentinel
    assert int(post.item()) == 8
    assert rows.tolist()[:8] == [1, 2, 5, s, 0, 4, 3, s]
    assert expert_of_block.tolist()[:4] == [0, 0, 2, 3]
    assert all(r == s for r in rows.tolist()[8:]) and all(e == -1 for e in expert_of_block.tolist()[4:])


@pytest.mark.task("14.1", weight=3)
@settings(max_examples=60, deadline=None)
@given(data=st.data(), tokens=st.integers(1, 40), top_k=st.integers(1, 4),
                  num_experts=st.integers(1, 12), block_m=st.sampled_from([1, 2, 3, 16, 64]))
def test_align_by_expert_invariants_hypothesis(data, tokens, top_k, num_experts, block_m) -> None:
    """Any routing, repeated experts within a token included (the layout does not need them distinct)."""
    flat = data.draw(st.lists(st.integers(0, num_experts - 1), min_size=tokens * top_k, max_size=tokens * top_k))
    check_alignment(torch.tensor(flat).view(tokens, top_k), num_experts, block_m)


# ------------------------------------------------------------------------------------------------------------------
# GPU: bf16 at Qwen3-30B-A3B's shape, CUDA graphs
# ------------------------------------------------------------------------------------------------------------------

QWEN3_30B_A3B = dict(hidden=2048, inter=768, num_experts=128, top_k=8)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 512])
def test_gpu_bf16_qwen3_moe_shape_matches_the_reference(tokens) -> None:
    s = QWEN3_30B_A3B
    args = make_layer(tokens, s["hidden"], s["inter"], s["num_experts"], s["top_k"], "random", torch.bfloat16,
                      seed=tokens)
    out = fused_experts(*args)
    ref = reference_experts(*args)
    torch.testing.assert_close(out.float(), ref.float(), **BF16_TOL)
    assert ref.float().abs().mean() > 0.1


@pytest.mark.task("14.1", weight=2)
@pytest.mark.gpu
def test_gpu_cuda_graph_replay_equals_eager() -> None:
    """Captured once, replayed after the routing (and the tokens) changed in place: the layout is computed on
    the device into buffers sized for the worst case, so the replay follows the new routing, including an
    expert that takes every token, and equals an eager call bit for bit."""
    s = QWEN3_30B_A3B
    tokens = 64
    x, w13, w2, weights, ids = make_layer(tokens, s["hidden"], s["inter"], s["num_experts"], s["top_k"],
                                          "random", torch.bfloat16, seed=1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        for _ in range(2):
            fused_experts(x, w13, w2, weights, ids)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, w13, w2, weights, ids)

    x2, _, _, weights2, ids2 = make_layer(tokens, s["hidden"], s["inter"], s["num_experts"], s["top_k"],
                                          "overloaded", torch.bfloat16, seed=2)
    x.copy_(x2)
    weights.copy_(weights2)
    ids.copy_(ids2)
    graph.replay()
    torch.cuda.synchronize()
    eager = fused_experts(x, w13, w2, weights, ids)
    assert torch.equal(out, eager)
    torch.testing.assert_close(out.float(), reference_experts(x, w13, w2, weights, ids).float(), **BF16_TOL)
