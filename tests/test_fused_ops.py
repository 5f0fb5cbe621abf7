"""The kernel table of the layers (``minisgl_ref.layers.kernel_table``) and the fused GPU kernels that chapter 11
installs there (``minisgl_ref.perf.kernels``, FlashInfer's in ``minisgl_ref.perf.fused_ops``), against the plain
PyTorch ops they replace (chapters 01, 08 and 11).

The table starts with the plain ops and the layers call through it. Installed, each fused op must compute the
same function as its plain reference on fresh random inputs, to bf16 rounding, and the layers must reach it on
CUDA bf16, while on the CPU the installed table still computes the plain ops exactly (so the CPU oracle tests keep
comparing exact arithmetic). GPU tests are skipped without CUDA (tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from minisgl_ref.layers import kernel_table
from minisgl_ref.layers.activation import SiluAndMul
from minisgl_ref.layers.kernel_table import KERNELS, KernelTable
from minisgl_ref.layers.norm import RMSNorm
from minisgl_ref.layers.rotary import RotaryEmbedding, _rotate
from minisgl_ref.perf import fused_ops, kernels

needs_flashinfer = pytest.mark.skipif(
    not torch.cuda.is_available() or fused_ops._flashinfer() is None, reason="needs CUDA and flashinfer"
)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def _plain_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def test_cpu_keeps_plain_ops() -> None:
    """On the CPU the layers never take a fused path, installed or not: float32 results are exactly the reference
    formulas."""
    torch.manual_seed(0)
    x, r = torch.randn(5, 64), torch.randn(5, 64)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data.normal_()
    assert not fused_ops.fused_available(x)
    gu = torch.randn(5, 32)
    for table in ("as it is", "installed"):
        with kernels.installed() if table == "installed" else contextlib.nullcontext():
            out, summed = norm(x, r)
            assert torch.equal(summed, x + r), table
            assert torch.equal(out, _plain_norm(x + r, norm.weight, 1e-6)), table
            assert torch.equal(SiluAndMul()(gu), F.silu(gu[:, :16]) * gu[:, 16:]), table


PLAIN_ENTRIES = {"rms_norm": kernel_table.rms_norm, "add_rms_norm": kernel_table.add_rms_norm,
                 "silu_and_mul": kernel_table.silu_and_mul, "qk_norm_rope": kernel_table.qk_norm_rope,
                 "store_kv": kernel_table.store_kv}

_FRESH_PROCESS = """
from minisgl_ref.layers.kernel_table import KERNELS
import minisgl_ref.runtime  # every extension imported, none applied
from minisgl_ref.perf import kernels
assert KERNELS.is_plain() and not kernels.is_installed(), "installed by an import"
kernels.install()
assert kernels.is_installed() and not KERNELS.is_plain()
kernels.uninstall()
assert KERNELS.is_plain()
print("ok")
"""


def test_the_kernel_table_holds_the_plain_ops_until_perf_installs_its_own() -> None:
    """Every entry of a table starts as the plain reference; importing the extensions installs nothing (checked in
    a fresh process, where no other test has run); ``install`` replaces every entry and ``uninstall`` puts the
    plain ones back."""
    fresh = KernelTable()
    assert {name: getattr(fresh, name) for name in PLAIN_ENTRIES} == PLAIN_ENTRIES and fresh.is_plain()
    run = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
    before = {name: getattr(KERNELS, name) for name in PLAIN_ENTRIES}
    with kernels.installed():
        assert kernels.is_installed()
        assert all(getattr(KERNELS, name) is not op for name, op in PLAIN_ENTRIES.items())
    assert {name: getattr(KERNELS, name) for name in PLAIN_ENTRIES} == before


def test_the_layers_and_the_pool_call_through_the_table(tiny_checkpoints, monkeypatch) -> None:
    """The seam is where the work happens: a forward pass of a Qwen3 model reaches each norm, activation and
    QK-norm/RoPE through the table (one plain norm for the first layer's input, add+norm for every other), and the
    KV pool's store reaches ``store_kv``."""
    from minisgl_ref.attention import NoCacheAttentionBackend
    from minisgl_ref.core.forward_batch import ForwardBatch
    from minisgl_ref.kvcache.pool import KVPool
    from minisgl_ref.models import load_model

    calls: dict[str, int] = {}
    for name, op in PLAIN_ENTRIES.items():
        def counted(*args, _name=name, _op=op):  # type: ignore[no-untyped-def]
            calls[_name] = calls.get(_name, 0) + 1
            return _op(*args)

        monkeypatch.setattr(KERNELS, name, counted)
    model, config, _ = load_model(str(tiny_checkpoints["qwen3"]), dtype="float32")
    batch = ForwardBatch.for_full_sequences([[1, 2, 3], [4, 5]], NoCacheAttentionBackend())
    with torch.inference_mode():
        model(batch.input_ids, batch.positions, batch)
    layers = config.num_layers
    # QK-norm runs inside qk_norm_rope (the plain entry calls the norm layers, which call the table again)
    assert calls == {"rms_norm": 1 + 2 * layers, "add_rms_norm": 2 * layers, "silu_and_mul": layers,
                     "qk_norm_rope": layers}
    pool = KVPool(1, 8, 2, 4, torch.float32)
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    pool.store(0, torch.tensor([5, 0, 7]), k, v)
    assert calls["store_kv"] == 1
    assert torch.equal(pool.k[0][[5, 0, 7]], k) and torch.equal(pool.v[0][[5, 0, 7]], v)


def test_installed_entries_compute_the_plain_ops_exactly_off_the_gpu() -> None:
    """The fused entries check each call's tensors: on the CPU, in float32 and in bfloat16, every one of them
    returns exactly what the plain entry returns (and the pool receives exactly the same values)."""
    g = torch.Generator().manual_seed(3)
    rope = RotaryEmbedding(16, 64, 1e4)
    norms = [RMSNorm(16, 1e-6) for _ in range(2)]
    for n in norms:
        n.weight.data = 1 + torch.randn(16, generator=g)
    positions = torch.tensor([0, 63, 5])
    for dtype in (torch.float32, torch.bfloat16):
        x, r, w = (torch.randn(3, 32, generator=g).to(dtype) for _ in range(3))
        q = torch.randn(3, 4, 16, generator=g).to(dtype)
        k, v = (torch.randn(3, 2, 16, generator=g).to(dtype) for _ in range(2))
        args = {"rms_norm": (x, w[0], 1e-6), "add_rms_norm": (x, r, w[0], 1e-6), "silu_and_mul": (x,),
                "qk_norm_rope": (positions, q, k, rope, *norms)}
        for name, a in args.items():
            ref = PLAIN_ENTRIES[name](*(t.clone() if isinstance(t, torch.Tensor) else t for t in a))
            ours = getattr(kernels, name)(*(t.clone() if isinstance(t, torch.Tensor) else t for t in a))
            ref, ours = (t if isinstance(t, tuple) else (t,) for t in (ref, ours))
            assert all(torch.equal(a_, b_) for a_, b_ in zip(ours, ref, strict=True)), (name, dtype)
        pools = [torch.zeros(2, 8, 2, 16, dtype=dtype) for _ in range(2)]
        kernel_table.store_kv(pools[0][0], pools[0][1], torch.tensor([1, 6, 3]), k, v)
        kernels.store_kv(pools[1][0], pools[1][1], torch.tensor([1, 6, 3]), k, v)
        assert torch.equal(pools[0], pools[1]) and pools[0].any()


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("tokens", [1, 7, 256])
@pytest.mark.parametrize("hidden", [128, 1024])
def test_gpu_rmsnorm_matches_plain(tokens: int, hidden: int) -> None:
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    out = fused_ops.rmsnorm(x, w, 1e-6)
    assert _rel_err(out, _plain_norm(x.double(), w.double(), 1e-6)) < 1e-2
    # 3-D input (Qwen3's per-head QK-norm): every head normalised on its own
    q = torch.randn(tokens, 4, 128, device="cuda", dtype=torch.bfloat16)
    wq = torch.randn(128, device="cuda", dtype=torch.bfloat16)
    assert _rel_err(fused_ops.rmsnorm(q, wq, 1e-6), _plain_norm(q.double(), wq.double(), 1e-6)) < 1e-2


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("tokens", [1, 33, 256])
def test_gpu_fused_add_rmsnorm_matches_plain(tokens: int) -> None:
    hidden = 1024
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    ref_sum = x.double() + r.double()
    ref = _plain_norm(ref_sum, w.double(), 1e-6)
    out, summed = fused_ops.fused_add_rmsnorm(x.clone(), r.clone(), w, 1e-6)
    assert _rel_err(summed, ref_sum) < 1e-2
    assert _rel_err(out, ref) < 1e-2
    # through the layer, as the decoder calls it, once the fused kernels are installed
    norm = RMSNorm(hidden, 1e-6).to("cuda", torch.bfloat16)
    norm.weight.data.copy_(w)
    with kernels.installed():
        out2, summed2 = norm(x.clone(), r.clone())
    assert torch.equal(out2, out) and torch.equal(summed2, summed)


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("tokens", [1, 5, 256])
def test_gpu_silu_and_mul_matches_plain(tokens: int) -> None:
    gu = torch.randn(tokens, 2 * 3072, device="cuda", dtype=torch.bfloat16)
    gate, up = gu.double().chunk(2, dim=-1)
    ref = F.silu(gate) * up
    out = fused_ops.silu_and_mul(gu)
    assert _rel_err(out, ref) < 1e-2
    with kernels.installed():
        assert torch.equal(SiluAndMul()(gu), out)  # the layer reaches the fused kernel through the table


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("tokens", [1, 9, 256])
def test_gpu_rope_matches_plain(tokens: int) -> None:
    head_dim, heads, kv_heads = 128, 16, 8
    rope = RotaryEmbedding(head_dim, 4096, 1_000_000.0).to("cuda")
    positions = torch.randint(0, 4096, (tokens,), device="cuda")
    q = torch.randn(tokens, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    cos = rope.cos_cache[positions].unsqueeze(1).double()
    sin = rope.sin_cache[positions].unsqueeze(1).double()
    ref_q, ref_k = _rotate(q.double(), cos, sin), _rotate(k.double(), cos, sin)
    # views with a row stride, like the q/k slices of the fused qkv projection
    def views() -> tuple[torch.Tensor, torch.Tensor]:
        qkv = torch.cat([q.flatten(1), k.flatten(1)], dim=1)
        return (qkv[:, : heads * head_dim].view(tokens, heads, head_dim),
                qkv[:, heads * head_dim :].view(tokens, kv_heads, head_dim))

    out_q, out_k = fused_ops.rope_inplace(positions, *views(), kernels.cos_sin_cache(rope, positions.device))
    assert out_q.shape == q.shape and out_k.shape == k.shape
    assert _rel_err(out_q, ref_q) < 1e-2
    assert _rel_err(out_k, ref_k) < 1e-2
    # the layer's path with the kernels installed (our Triton kernel where Triton runs, else FlashInfer's RoPE)
    with kernels.installed():
        layer_q, layer_k = rope.norm_and_rotate(positions, *views())
    assert _rel_err(layer_q, ref_q) < 1e-2
    assert _rel_err(layer_k, ref_k) < 1e-2
