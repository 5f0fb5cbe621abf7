"""Our two Triton per-token kernels (``minisgl_ref.perf.triton_ops``) against the plain ops they replace.

On the CPU the kernels run in Triton's interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1``), in float32 and
float16, where the interpreter rounds like the GPU, and in bfloat16, where it truncates instead of rounding to
nearest at each of the kernel's three roundings (so bf16 is allowed three units in the last place there). On the GPU (``-m gpu``) bfloat16 is checked
against the plain ops on the GPU, and the full Qwen3 layer with and without the K/V store in the RoPE kernel
(``minisgl_ref.perf.rope_store``), which on the CPU computes exactly chapter 01's attention.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from minisgl_ref.layers import kernel_table  # noqa: E402
from minisgl_ref.layers.norm import RMSNorm  # noqa: E402
from minisgl_ref.perf import triton_ops  # noqa: E402
from minisgl_ref.layers.rotary import RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_compiled = pytest.mark.skipif(DEVICE == "cpu" and type(triton.language.cdiv).__name__ == "JITFunction",
                                    reason="triton was imported before TRITON_INTERPRET=1 was set")

# (rtol, atol) per dtype: float32 exact up to the order of the sum of squares; float16 one or two units in the last
# place (the normalised value is rounded before the weight multiply, like the reference, so a one-ulp difference
# there can show up as one ulp of the output); bfloat16 three, for the interpreter's truncation (the GPU test below
# holds bf16 to one).
TOL = {torch.float32: (1e-5, 1e-6), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2.4e-2, 2.4e-2)}


def qkv_views(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    """q, k, v as the model makes them: strided views into one fused QKV output row per token."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(DEVICE, dtype)
    q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
    return (qkv[:, :q_end].view(tokens, heads, head_dim), qkv[:, q_end:k_end].view(tokens, kv_heads, head_dim),
            qkv[:, k_end:].view(tokens, kv_heads, head_dim))


def plain_norm_rope(rope, positions, q, k, q_norm=None, k_norm=None):
    if q_norm is not None:
        q, k = (kernel_table.rms_norm(t, n.weight, n.eps) for t, n in ((q, q_norm), (k, k_norm)))  # plain, anywhere
    cos = rope.cos_cache[positions].unsqueeze(1)
    sin = rope.sin_cache[positions].unsqueeze(1)
    from minisgl_ref.layers.rotary import _rotate

    return _rotate(q, cos, sin), _rotate(k, cos, sin)


@needs_compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_norm", [True, False], ids=["qwen3", "llama"])
@pytest.mark.parametrize("shape", [(5, 4, 2, 64), (3, 16, 8, 128), (2, 8, 1, 128)], ids=["gqa2", "qwen3", "mqa"])
def test_qk_norm_rope_matches_plain(dtype, with_norm, shape) -> None:
    tokens, heads, kv_heads, head_dim = shape
    q, k, _ = qkv_views(*shape, dtype)
    rope = RotaryEmbedding(head_dim, 4096, 1e6).to(DEVICE)
    positions = torch.tensor([0, 4095, 17, 1000, 3][:tokens], device=DEVICE)
    norms = (None, None)
    if with_norm:
        norms = tuple(RMSNorm(head_dim, 1e-6).to(DEVICE, dtype) for _ in range(2))
        for i, n in enumerate(norms):
            n.weight.data = torch.randn(head_dim, generator=torch.Generator().manual_seed(9 + i)).to(DEVICE, dtype)
    ref_q, ref_k = plain_norm_rope(rope, positions, q.clone(), k.clone(), *norms)
    weights = (norms[0].weight.data, norms[1].weight.data, 1e-6) if with_norm else ()
    before = q.untyped_storage().data_ptr()
    out_q, out_k = triton_ops.qk_norm_rope_(positions, q, k, rope.cos_cache, rope.sin_cache, *weights)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out_q, ref_q, rtol=rtol, atol=atol)
    torch.testing.assert_close(out_k, ref_k, rtol=rtol, atol=atol)
    # in place: the views of the QKV output now hold the result (no copy was made)
    assert out_q.untyped_storage().data_ptr() == before and torch.equal(q, out_q) and torch.equal(k, out_k)
    if dtype == torch.float32:  # the bulk matches exactly; only the sum-of-squares order may differ
        assert (out_q == ref_q).float().mean() > 0.5


@needs_compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 4, 2, 64), (4, 16, 8, 128), (3, 8, 1, 128)], ids=["gqa2", "qwen3", "mqa"])
def test_qk_norm_rope_store_writes_the_rotated_kv_into_the_slots(dtype, shape) -> None:
    """With ``store``, the kernel also does the KV store: the slots receive exactly the rotated keys and the
    values, every other slot stays untouched, and q / k come out as without it."""
    tokens, heads, kv_heads, head_dim = shape
    q, k, v = qkv_views(*shape, dtype, seed=5)
    rope = RotaryEmbedding(head_dim, 4096, 1e6).to(DEVICE)
    positions = torch.tensor([3, 4095, 17, 1000, 0][:tokens], device=DEVICE)
    norms = [torch.randn(head_dim, generator=torch.Generator().manual_seed(i)).to(DEVICE, dtype) for i in (1, 2)]
    q2, k2 = q.clone(), k.clone()
    ref_q, ref_k = triton_ops.qk_norm_rope_(positions, q2, k2, rope.cos_cache, rope.sin_cache, *norms, 1e-6)
    k_pool = torch.zeros(32, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v_pool = torch.zeros_like(k_pool)
    slots = torch.tensor([9, 0, 31, 12, 5][:tokens], device=DEVICE)
    out_q, out_k = triton_ops.qk_norm_rope_(positions, q, k, rope.cos_cache, rope.sin_cache, *norms, 1e-6,
                                              store=(v, k_pool, v_pool, slots))
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    assert torch.equal(k_pool[slots], ref_k) and torch.equal(v_pool[slots], v)
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert k_pool[untouched.to(DEVICE)].abs().sum() == 0 and v_pool[untouched.to(DEVICE)].abs().sum() == 0


@needs_compiled
def test_qk_norm_rope_rejects_bad_input() -> None:
    q, k, _ = qkv_views(2, 2, 1, 64, torch.float32)
    rope = RotaryEmbedding(64, 16, 1e4).to(DEVICE)
    pos = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    w = torch.ones(64, device=DEVICE)
    with pytest.raises(ValueError, match="both q_weight and k_weight"):
        triton_ops.qk_norm_rope_(pos, q, k, rope.cos_cache, rope.sin_cache, w, None)
    pool = torch.zeros(8, 1, 64, device=DEVICE)
    with pytest.raises(ValueError, match="store needs v shaped like k"):
        triton_ops.qk_norm_rope_(pos, q, k, rope.cos_cache, rope.sin_cache,
                                   store=(k, pool, pool.clone(), torch.arange(3, device=DEVICE)))
    half = RotaryEmbedding(32, 16, 1e4).to(DEVICE)  # partial rotary: not what the kernel does
    with pytest.raises(ValueError, match="full rotary table"):
        triton_ops.qk_norm_rope_(pos, q, k, half.cos_cache, half.sin_cache)


@needs_compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_store_kv_writes_exactly_the_slots(dtype, kv_heads) -> None:
    _, k, v = qkv_views(6, 4, kv_heads, 64, dtype, seed=3)
    k_pool = torch.zeros(40, kv_heads, 64, dtype=dtype, device=DEVICE)
    v_pool = torch.zeros_like(k_pool)
    slots = torch.tensor([7, 0, 39, 12, 13, 5], device=DEVICE)
    triton_ops.store_kv_(k_pool, v_pool, slots, k, v)
    assert torch.equal(k_pool[slots], k) and torch.equal(v_pool[slots], v)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert k_pool[untouched.to(DEVICE)].abs().sum() == 0 and v_pool[untouched.to(DEVICE)].abs().sum() == 0


@needs_compiled
def test_store_kv_rejects_mismatched_rows() -> None:
    _, k, v = qkv_views(3, 4, 2, 64, torch.float32)
    pool = torch.zeros(8, 4, 32, device=DEVICE)
    with pytest.raises(ValueError, match="rows must be"):
        triton_ops.store_kv_(pool, pool.clone(), torch.arange(3, device=DEVICE), k, v)


def test_index_tensors_reach_the_kernels_aligned() -> None:
    """A view that starts 8 bytes into its tensor is copied to an address that is a multiple of 16 bytes (so
    Triton meets one pattern of alignment only); an aligned tensor is passed as it is, not copied."""
    from minisgl_ref.perf.triton_ops import _aligned

    base = torch.arange(9, dtype=torch.int64)
    assert base.data_ptr() % 16 == 0
    assert _aligned(base) is base
    view = base[1:]
    assert view.data_ptr() % 16 == 8
    moved = _aligned(view)
    assert moved.data_ptr() % 16 == 0 and torch.equal(moved, view)


def test_cpu_keeps_the_plain_path() -> None:
    """The model takes the kernels only on CUDA in half precision: on the CPU the oracle tests compare plain ops."""
    assert not triton_ops.available(torch.zeros(2, 2, dtype=torch.bfloat16))
    assert not triton_ops.available(torch.zeros(2, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_gpu_qk_norm_rope_bf16_matches_plain(tokens) -> None:
    q, k, _ = qkv_views(tokens, 16, 8, 128, torch.bfloat16)
    rope = RotaryEmbedding(128, 40960, 1e6).to(DEVICE)
    positions = torch.randint(0, 40960, (tokens,), device=DEVICE)
    norms = [RMSNorm(128, 1e-6).to(DEVICE, torch.bfloat16) for _ in range(2)]
    for n in norms:
        n.weight.data.normal_()
    ref_q, ref_k = plain_norm_rope(rope, positions, q.clone(), k.clone(), *norms)
    out_q, out_k = triton_ops.qk_norm_rope_(positions, q, k, rope.cos_cache, rope.sin_cache,
                                              norms[0].weight.data, norms[1].weight.data, 1e-6)
    # on the GPU bf16 rounds to nearest like torch: one ulp at most, and almost everywhere identical
    torch.testing.assert_close(out_q, ref_q, rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(out_k, ref_k, rtol=8e-3, atol=8e-3)
    assert (out_q == ref_q).float().mean() > 0.95


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_gpu_qwen3_attention_stores_kv_in_the_rope_kernel(mode) -> None:
    """A Qwen3 attention layer in a decode step and in an extend step (parts of four prompts, after cached
    prefixes) on the GPU, with the fused kernels installed: with the store in the RoPE kernel
    (:class:`RopeStoreAttention`) the RoPE kernel writes K/V into the pool itself, and the layer's output and the
    pool's contents are exactly those of chapter 01's attention, where the backend stores them. The extend step's
    positions are a view at an address that is not a multiple of 16 bytes (the kernel gets an aligned copy)."""
    from minisgl_ref.attention.torch_native import TorchNativeBackend
    from minisgl_ref.core.forward_batch import ForwardBatch, ForwardMode
    from minisgl_ref.kvcache.pool import KVPool
    from minisgl_ref.kvcache.req_to_token import ReqToTokenPool
    from minisgl_ref.models.config import ModelConfig
    from minisgl_ref.models.loader import SHIPPED_CONFIGS
    from minisgl_ref.models.qwen3 import Qwen3Attention
    from minisgl_ref.perf import kernels
    from minisgl_ref.perf.rope_store import RopeStoreAttention

    cfg = ModelConfig.from_file(SHIPPED_CONFIGS / "qwen3-0.6b.json")
    torch.manual_seed(0)
    rope = RotaryEmbedding(cfg.head_dim, 4096, cfg.rope_theta).to(DEVICE)
    layer = Qwen3Attention(cfg, 3, rope).to(DEVICE, torch.bfloat16)
    for p in layer.parameters():
        p.data.normal_(0, 0.05)
    lens = [5, 300, 17, 1000]
    table = ReqToTokenPool(len(lens), 1024, DEVICE)
    slots = torch.randperm(4000, device=DEVICE)
    start = 0
    for row, n in enumerate(lens):
        table.write(row, 0, slots[start:start + n].cpu())
        start += n
    pools = [KVPool(cfg.num_layers, 4000, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, DEVICE) for _ in range(2)]
    for a, b in zip(pools[0].k + pools[0].v, pools[1].k + pools[1].v):
        b.copy_(a.normal_())  # the same random cache in both
    new = [1] * len(lens) if mode == "decode" else [5, 40, 17, 64]  # new tokens per request, at the end
    starts = [sum(lens[:i]) for i in range(len(lens))]
    idx = torch.tensor([s + p for s, n, e in zip(starts, lens, new) for p in range(n - e, n)], device=DEVICE)
    hidden = torch.randn(len(idx), cfg.hidden_size, device=DEVICE, dtype=torch.bfloat16)
    noise = pools[0].k[3][slots[idx]].clone()
    spare = torch.tensor([0] + [p for n, e in zip(lens, new) for p in range(n - e, n)], device=DEVICE)
    outs = []
    storing = RopeStoreAttention(layer)
    for pool, fused in zip(pools, (True, False)):  # the new tokens' slots hold noise until they are written
        backend = TorchNativeBackend(pool, table)
        batch = ForwardBatch(mode=ForwardMode.DECODE if mode == "decode" else ForwardMode.EXTEND,
                             input_ids=torch.zeros(len(idx), dtype=torch.int64, device=DEVICE),
                             positions=spare[1:],  # 8 bytes into its tensor
                             extend_lens_cpu=new, prefix_lens_cpu=[n - e for n, e in zip(lens, new)],
                             attn_backend=backend, req_pool_indices=torch.arange(len(lens), device=DEVICE),
                             out_cache_loc=slots[idx], seq_lens=torch.tensor(lens, device=DEVICE))
        backend.init_forward_metadata(batch)
        assert storing.can_store_kv(torch.empty(1, 1, cfg.head_dim, device=DEVICE, dtype=torch.bfloat16),
                                    torch.empty(1, device=DEVICE, dtype=torch.bfloat16), batch)
        with kernels.installed():
            outs.append((storing if fused else layer)(batch.positions, hidden, batch))
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(a, b) for a, b in zip(pools[0].k + pools[0].v, pools[1].k + pools[1].v))
    assert not torch.equal(pools[0].k[3][slots[idx]], noise)  # the new keys were written


# The decode step's kernels compiled for an H100 (sm_90) in a process without Triton's interpreter: Triton compiles
# for a GPU it does not have. Prints, per kernel, the global loads before its first barrier and in all.
_PTX_LOADS = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minisgl_ref.perf.triton_ops import ACT_BLOCK, _kernels

qk, _, silu = _kernels()
ptrs = ["q", "k", "v", "q_weight", "k_weight", "cos", "sin", "positions", "k_pool", "v_pool", "slots", "x"]
types = ["*bf16"] * 5 + ["*fp32"] * 2 + ["*i64", "*bf16", "*bf16", "*i64", "*bf16"]
sig = dict(zip(ptrs, types))
strides = ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_xt")
sig.update({n: "i64" for n in strides})
sig.update(eps="fp32", x_eps="fp32")
qk_consts = dict(NUM_Q=16, NUM_KV=8, BLOCK_H=32, BLOCK_KV=8, HAS_NORM=True, STORE=True, HALF=64, ROW_RMS=True,
                 HIDDEN=1024, BLOCK_X=1024)
silu_sig = {"gate_up": "*bf16", "x": "*bf16", "out": "*bf16", "stride_gt": "i64", "stride_xt": "i64",
            "stride_ot": "i64", "x_eps": "fp32"}
silu_consts = dict(I=3072, HIDDEN=1024, BLOCK_X=1024, BLOCK=ACT_BLOCK)
counts = {}
for name, fn, s, c in (("qk_norm_rope", qk, sig, qk_consts), ("silu_and_mul_rms", silu, silu_sig, silu_consts)):
    s = {**s, **{k: "constexpr" for k in c}}
    ptx = triton.compile(ASTSource(fn=fn, signature=s, constexprs=c), target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    lines = [line.strip() for line in ptx.splitlines()]
    barrier = next(i for i, line in enumerate(lines) if "bar.sync" in line)
    counts[name] = [sum("ld.global" in line for line in lines[:barrier]), sum("ld.global" in line for line in lines)]
print(json.dumps(counts))
"""


def test_decode_kernels_issue_every_load_before_their_first_barrier() -> None:
    """Chapter 11: with one program per token, a decode step gives these kernels too few programs to hide memory
    latency, so each program must not wait for one load before issuing the next. In the code Triton generates for
    an H100, for the decode step's shapes, every global load of the QK-norm/RoPE/store kernel and of the activation
    comes before the first barrier (a reduction across warps): a load after a barrier cannot be issued before it."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _PTX_LOADS], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    counts = json.loads(run.stdout.strip().splitlines()[-1])
    for name, (before, total) in counts.items():
        assert before == total > 0, f"{name}: {before} of its {total} global loads before the first barrier"
