"""FP8 linear layers (chapter 15): the weight stored in e4m3 with its scales, the product computed from it.

A layer becomes FP8 in place: its ``weight`` parameter is replaced by an e4m3 one of the same shape, a float32
scale parameter joins it, and its ``quant_method`` (the seam of :mod:`~minisgl_ref.layers.linear`) becomes an
:class:`Fp8LinearMethod`. The tensor-parallel split, the weight loaders and the all-reduce of a row-parallel layer
are untouched, so an FP8 layer shards and loads like chapter 09's.

Two ways in:

* :func:`quantize_layer_` quantizes a layer whose bf16 (or float32) weights are loaded: SGLang's
  ``--quantization fp8`` on an ordinary checkpoint (here one scale per output row and 128-column group, the form
  an FP8 checkpoint loads into), or ``--quantization w8a8_fp8`` (one scale per output channel).
* :func:`prepare_layer_` makes a layer ready to *load* an FP8 checkpoint in the layout DeepSeek-V3 and Qwen3-FP8
  publish and SGLang and vLLM read: ``weight`` in e4m3 and ``weight_scale_inv``, one float32 scale per 128 x 128
  block (the name says the stored number multiplies the FP8 values back). Each rank reads its blocks of the
  scales as it reads its rows or columns of the weight, so the shard boundaries must fall on block boundaries.

The product is W8A8: the activation is quantized too, per token (or per token and 128-feature group, matching the
weight's blocks), at run time from its own amax (SGLang's "dynamic" activation scheme). With both operands in FP8 a
Hopper GPU multiplies them in its FP8 tensor cores, through ``torch._scaled_mm`` for per-channel scales; anywhere
else (a CPU) :meth:`Fp8LinearMethod.reference`
computes the same numbers by dequantizing both and multiplying in float32. Group scales on a GPU go through a
Triton kernel of our own (:mod:`~minisgl_ref.quant.fp8_gemm`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from minisgl_ref.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from minisgl_ref.quant.fp8 import (
    E4M3,
    dequantize,
    dequantize_weight,
    expand_block_scale,
    quantize_activation,
    quantize_weight,
)


Linear = ColumnParallelLinear | RowParallelLinear


class Fp8LinearMethod:
    """``x W^T + b`` from an e4m3 weight and its scales (``block`` None: ``layer.weight_scale [out, 1]``; else
    ``layer.weight_scale_inv`` per ``block`` tile), with the activation quantized on the fly."""

    quantized = True

    def __init__(self, block: tuple[int, int] | None = None) -> None:
        self.block = block

    def __repr__(self) -> str:
        return f"Fp8LinearMethod(block={self.block})"

    def weight_scale(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight_scale if self.block is None else layer.weight_scale_inv

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda and scaled_mm_supported(x.device):
            return self.scaled_mm(layer, x, bias) if self.block is None else self.group_gemm(layer, x, bias)
        return self.reference(layer, x, bias)

    def reference(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The W8A8 product computed from dequantized operands in float32: what an FP8 kernel computes, up to the
        order of its additions."""
        k = x.shape[-1]
        flat = x.reshape(-1, k)
        group = None if self.block is None else self.block[1]
        qx, sx = quantize_activation(flat, group)
        if group is not None:
            sx = expand_block_scale(sx, (1, group), tuple(flat.shape))
        out = F.linear(dequantize(qx, sx), dequantize_weight(layer.weight, self.weight_scale(layer), self.block))
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)

    def scaled_mm(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Hopper's FP8 tensor cores through ``torch._scaled_mm`` with row-wise scales: the token's scale on the
        rows of the product, the channel's on its columns; the output in the activation's dtype."""
        from minisgl_ref.quant.activation_kernel import quantize_activation_fused  # imports triton

        k = x.shape[-1]
        qx, sx = quantize_activation_fused(x.reshape(-1, k).contiguous())
        out = torch._scaled_mm(qx, layer.weight.t(), scale_a=sx, scale_b=layer.weight_scale.t(),
                               out_dtype=x.dtype if x.dtype != torch.float32 else torch.bfloat16)
        if bias is not None:
            out = out + bias
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)


    def group_gemm(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Group scales (one per row and ``block[1]`` columns, both operands): the Triton kernel of
        :mod:`~minisgl_ref.quant.fp8_gemm`, which applies them group by group along K."""
        from minisgl_ref.quant.activation_kernel import quantize_activation_fused  # these import triton
        from minisgl_ref.quant.fp8_gemm import group_scaled_gemm

        assert self.block is not None
        group = self.block[1]
        k = x.shape[-1]
        qx, sx = quantize_activation_fused(x.reshape(-1, k).contiguous(), group)
        out_dtype = x.dtype if x.dtype != torch.float32 or not x.is_cuda else torch.float32
        out = group_scaled_gemm(qx, sx, layer.weight, layer.weight_scale_inv, group, out_dtype)
        if bias is not None:
            out = out + bias
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)


def scaled_mm_supported(device: torch.device) -> bool:
    """FP8 matmuls need compute capability 8.9 (Ada) or 9.0 (Hopper) and up."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)


def linear_layers(model: nn.Module) -> list[tuple[str, Linear]]:
    """The model's column- and row-parallel layers: every projection of attention and of the MLPs. The embedding
    and the LM head are not among them and stay in the model's dtype, as in SGLang's FP8 models."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


def _fp8_param(data: torch.Tensor, loader: Callable[..., None] | None = None) -> nn.Parameter:
    p = nn.Parameter(data, requires_grad=False)
    if loader is not None:
        p.weight_loader = loader  # type: ignore[attr-defined]
    return p


@torch.no_grad()
def quantize_layer_(layer: Linear, group: int | None = 128) -> None:
    """Quantize a loaded layer's weight to e4m3: one scale per output row and ``group`` consecutive input columns
    (``weight_scale_inv [out, ceil(in / group)]``, the form an FP8 checkpoint loads into), or per output channel
    (``group`` None: ``weight_scale [out, 1]``, which ``torch._scaled_mm`` takes)."""
    if layer.quant_method.quantized:
        raise ValueError(f"{type(layer).__name__} is already quantized ({layer.quant_method})")
    block = None if group is None else (1, group)
    q, scale = quantize_weight(layer.weight.data, block)
    layer.weight = _fp8_param(q)
    if block is None:
        layer.weight_scale = _fp8_param(scale)
    else:
        layer.weight_scale_inv = _fp8_param(scale)
    layer.quant_method = Fp8LinearMethod(block)


def prepare_layer_(layer: Linear, block: tuple[int, int]) -> None:
    """Make an unloaded layer take an FP8 checkpoint's ``weight`` (e4m3, loaded by the layer's own loader, which
    slices it as any weight) and ``weight_scale_inv`` (``block = (rows, cols)`` tiles, :func:`block_scale_loader`).

    The layer keeps the scales spread over its rows, ``[out, ceil(in / cols)]``: one scale per row and
    ``cols``-wide group, which is the checkpoint's ``rows x cols`` tiles repeated down each tile. A fused layer
    (q, k and v in one matrix) needs that: its parts start at rows that need not fall on a tile boundary
    (SmolLM2-135M's k rows start at 576 = 4.5 tiles), so its tiles are not the checkpoint's. It costs one float32
    per row and group, 1/32 of the weight's bytes at ``cols = 128``."""
    old = layer.weight
    layer.weight = _fp8_param(torch.empty(old.shape, dtype=E4M3, device=old.device), old.weight_loader)
    out, inp = old.shape
    layer.weight_scale_inv = _fp8_param(torch.empty(out, math.ceil(inp / block[1]), device=old.device),
                                        block_scale_loader(layer, block))
    layer.quant_method = Fp8LinearMethod((1, block[1]))


def block_scale_loader(layer: Linear, block: tuple[int, int]) -> Callable[..., None]:
    """The loader of a layer's ``weight_scale_inv``: from the checkpoint's ``[ceil(R / rows), ceil(C / cols)]``
    tiles of the full matrix, the scale of each of this rank's rows (the tile it lies in), for the columns this
    rank holds. A row-parallel split whose columns start inside a tile would share a scale group with another rank,
    so it is refused by name."""
    rows, cols = block

    def row_scales(full: Any, start: int, size: int) -> torch.Tensor:
        whole = full if isinstance(full, torch.Tensor) else full.narrow(0, 0, full.shape[0])  # small: read it all
        return whole[torch.arange(start, start + size) // rows]

    if isinstance(layer, RowParallelLinear):
        def load_row(param: nn.Parameter, full: Any) -> None:
            if layer.in_start % cols:
                raise ValueError(f"RowParallelLinear: this rank's input columns start at {layer.in_start}, inside "
                                 f"a {cols}-wide scale group of the checkpoint; this split cannot load FP8 scales")
            start, n = layer.in_start // cols, param.shape[1]
            param.data.copy_(row_scales(full, 0, param.shape[0])[:, start:start + n])
        return load_row
    if isinstance(layer, QKVParallelLinear):
        def load_qkv(param: nn.Parameter, full: Any, shard_id: str) -> None:
            if shard_id == "q":
                offset, size, head_start = 0, layer.q_size, layer.heads.q_start
            else:
                offset = layer.q_size + (0 if shard_id == "k" else layer.kv_size)
                size, head_start = layer.kv_size, layer.heads.kv_start
            param.data.narrow(0, offset, size).copy_(row_scales(full, head_start * layer.head_dim, size))
        return load_qkv
    if isinstance(layer, MergedColumnParallelLinear):
        def load_merged(param: nn.Parameter, full: Any, shard_id: int) -> None:
            size = layer.out_sizes[shard_id]
            offset = sum(layer.out_sizes[:shard_id])
            param.data.narrow(0, offset, size).copy_(row_scales(full, layer.tp_rank * size, size))
        return load_merged

    def load_column(param: nn.Parameter, full: Any) -> None:
        param.data.copy_(row_scales(full, layer.out_start, layer.out_per_rank))
    return load_column
