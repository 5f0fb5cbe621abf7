"""The fused GPU kernels of ``minisgl_ref.layers.fused`` against the plain PyTorch ops they replace (chapter 08).

Each fused op must compute the same function as its plain reference on fresh random inputs, to bf16 rounding.
Also checked: the layers dispatch to the fused path on CUDA bf16 and keep the plain path on the CPU (so the CPU
oracle tests keep comparing exact arithmetic). GPU tests are skipped without CUDA (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minisgl_ref.layers import fused
from minisgl_ref.layers.activation import SiluAndMul
from minisgl_ref.layers.norm import RMSNorm
from minisgl_ref.layers.rotary import RotaryEmbedding, _rotate

needs_flashinfer = pytest.mark.skipif(
    not torch.cuda.is_available() or fused._flashinfer() is None, reason="needs CUDA and flashinfer"
)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def _plain_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def test_cpu_keeps_plain_ops() -> None:
    """On the CPU the layers never take the fused path: float32 results are exactly the reference formulas."""
    torch.manual_seed(0)
    x, r = torch.randn(5, 64), torch.randn(5, 64)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data.normal_()
    assert not fused.fused_available(x)
    out, summed = norm(x, r)
    assert torch.equal(summed, x + r)
    assert torch.equal(out, _plain_norm(x + r, norm.weight, 1e-6))
    gu = torch.randn(5, 32)
    assert torch.equal(SiluAndMul()(gu), F.silu(gu[:, :16]) * gu[:, 16:])


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("tokens", [1, 7, 256])
@pytest.mark.parametrize("hidden", [128, 1024])
def test_gpu_rmsnorm_matches_plain(tokens: int, hidden: int) -> None:
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    out = fused.rmsnorm(x, w, 1e-6)
    assert _rel_err(out, _plain_norm(x.double(), w.double(), 1e-6)) < 1e-2
    # 3-D input (Qwen3's per-head QK-norm): every head normalised on its own
    q = torch.randn(tokens, 4, 128, device="cuda", dtype=torch.bfloat16)
    wq = torch.randn(128, device="cuda", dtype=torch.bfloat16)
    assert _rel_err(fused.rmsnorm(q, wq, 1e-6), _plain_norm(q.double(), wq.double(), 1e-6)) < 1e-2


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
    out, summed = fused.fused_add_rmsnorm(x.clone(), r.clone(), w, 1e-6)
    assert _rel_err(summed, ref_sum) < 1e-2
    assert _rel_err(out, ref) < 1e-2
    # through the layer, as the decoder calls it
    norm = RMSNorm(hidden, 1e-6).to("cuda", torch.bfloat16)
    norm.weight.data.copy_(w)
    out2, summed2 = norm(x.clone(), r.clone())
    assert torch.equal(out2, out) and torch.equal(summed2, summed)


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("tokens", [1, 5, 256])
def test_gpu_silu_and_mul_matches_plain(tokens: int) -> None:
    gu = torch.randn(tokens, 2 * 3072, device="cuda", dtype=torch.bfloat16)
    gate, up = gu.double().chunk(2, dim=-1)
    ref = F.silu(gate) * up
    assert _rel_err(fused.silu_and_mul(gu), ref) < 1e-2
    assert _rel_err(SiluAndMul()(gu), ref) < 1e-2


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
    # a view with a row stride, like the q/k slices of the fused qkv projection
    qkv = torch.cat([q.flatten(1), k.flatten(1)], dim=1)
    q_view = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k_view = qkv[:, heads * head_dim :].view(tokens, kv_heads, head_dim)
    out_q, out_k = rope(positions, q_view, k_view)
    assert out_q.shape == q.shape and out_k.shape == k.shape
    assert _rel_err(out_q, ref_q) < 1e-2
    assert _rel_err(out_k, ref_k) < 1e-2
