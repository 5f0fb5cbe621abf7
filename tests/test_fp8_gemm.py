"""Chapter 15: the Triton FP8 matmul with group scales (Triton's interpreter without a GPU) equals the product of
the dequantized operands, for shapes with partial tiles and a partial last group."""

from __future__ import annotations

import pytest
import torch

from minisgl_ref.layers.linear import RowParallelLinear
from minisgl_ref.quant.fp8 import dequantize_weight, expand_block_scale, quantize_activation, quantize_weight
from minisgl_ref.quant.fp8_gemm import group_scaled_gemm
from minisgl_ref.quant.linear import quantize_layer_

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("m, n, k", [(1, 64, 128), (5, 70, 300), (40, 130, 256), (17, 16, 129)])
def test_group_scaled_gemm_equals_the_dequantized_product(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, k)  # features of very different ranges
    w = torch.randn(n, k, generator=g)
    qx, sx = quantize_activation(x, 128)
    qw, sw = quantize_weight(w, (1, 128))
    expected = (qx.float() * expand_block_scale(sx, (1, 128), (m, k))) @ dequantize_weight(qw, sw, (1, 128)).t()
    got = group_scaled_gemm(qx.to(DEVICE), sx.to(DEVICE), qw.to(DEVICE), sw.to(DEVICE), 128, torch.float32)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_group_scaled_gemm_refuses_mismatched_scales():
    qx, sx = quantize_activation(torch.randn(3, 256), 128)
    qw, sw = quantize_weight(torch.randn(8, 256), (1, 128))
    with pytest.raises(ValueError, match="shapes do not match"):
        group_scaled_gemm(qx, sx[:, :1], qw, sw, 128, torch.float32)
    with pytest.raises(ValueError, match="power of two of at least 16"):
        group_scaled_gemm(qx, sx, qw, sw, 100, torch.float32)


def test_the_layer_takes_the_kernel_on_a_gpu_and_the_reference_elsewhere(monkeypatch):
    """The FP8 layer's two paths compute the same numbers: the Triton kernel (forced here, interpreted on a
    CPU) and the dequantizing reference."""
    layer = RowParallelLinear(256, 48)
    layer.weight.data.copy_(torch.randn(48, 256, generator=torch.Generator().manual_seed(1)))
    quantize_layer_(layer)
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(2))
    ref = layer.quant_method.reference(layer, x, None)
    got = layer.quant_method.group_gemm(layer, x, None)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k, group", [(300, None), (256, 128), (300, 128), (64, None)])
def test_the_fused_activation_quantization_equals_the_reference_bit_for_bit(dtype, k, group):
    """One kernel per projection input (Triton's interpreter without a GPU) gives exactly the FP8 numbers and
    scales of the PyTorch reference: an all-zero token, an outlier, a partial last group, values rounding up to
    the next power of two included."""
    from minisgl_ref.quant.activation_kernel import quantize_activation_fused

    g = torch.Generator().manual_seed(k)
    x = torch.randn(6, k, generator=g) * 3
    x[2] = 0
    x[1, 7] = 1e4
    x = x.to(dtype)
    q, s = quantize_activation_fused(x.to(DEVICE), group)
    q_ref, s_ref = quantize_activation(x, group)
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))
