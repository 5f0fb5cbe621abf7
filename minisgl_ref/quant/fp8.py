"""FP8 numbers and their scales (chapter 15): what a tensor becomes when each value is stored in one byte.

Two FP8 formats exist on current GPUs, both one sign bit and seven others:

* **e4m3** (``torch.float8_e4m3fn``): 4 exponent bits, 3 mantissa bits. Largest value 448, about two significant
  decimal digits (a relative step of 2^-3 = 12.5% between neighbours at worst, 6.25% on average); no infinities.
  Weights, activations and the KV cache use it.
* **e5m2** (``torch.float8_e5m2``): 5 exponent bits, 2 mantissa bits. Largest value 57,344, a wider range at half
  the precision; training uses it for gradients.

bfloat16 has the same 8 exponent bits as float32 and 7 mantissa bits. So FP8 loses most of its range as well as
precision, and a tensor must be *scaled* into e4m3's range before it is cast: store ``q = fp8(x / s)`` and the
scale ``s`` (float32) beside it; ``x ~ q * s``. The choice is how many values share one scale:

* **per tensor**: one ``s = amax(|x|) / 448``. One outlier shrinks every other value towards the coarse bottom
  of the format (or below it, to zero).
* **per channel** (one scale per output row of a weight, or per token of an activation): each row keeps its own
  range. The scale of a weight row multiplies the whole output column it produces, and the scale of a token the
  whole output row, so ``(x W^T)[t, o] = s_x[t] * s_w[o] * (q_x q_w^T)[t, o]`` and the matmul itself runs on FP8.
* **per block** (DeepSeek-V3's and Qwen3-FP8's checkpoints: 128 x 128 tiles of a weight, 1 x 128 groups of an
  activation): finer still, but the scales now change *inside* a dot product, so the kernel must apply them
  block by block along the reduced dimension.

Every function here is plain PyTorch and runs on a CPU (casting to and from FP8 does; FP8 *matmuls* need a
Hopper-class GPU), so they are the reference the GPU paths are checked against.
"""

from __future__ import annotations

import math

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
E4M3_MAX = torch.finfo(E4M3).max  # 448.0
#: The smallest scale a zero row gets: any positive number works (the row is all zeros either way); this one
#: keeps ``x / s`` finite.
MIN_SCALE = 1e-12


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = E4M3) -> torch.Tensor:
    """``fp8(x / scale)``, clamped to the format's range first: e4m3 has no infinity, and a cast is not promised to
    saturate (PyTorch's CPU cast does, its encoding of e4m3 keeps NaN for what lies beyond). ``scale`` broadcasts
    against ``x``."""
    limit = torch.finfo(dtype).max
    # BEGIN TASK 15.1: scale into e4m3
    return (x.float() / scale).clamp(-limit, limit).to(dtype)
    # END TASK 15.1


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` in ``dtype``: the values a quantized tensor stands for."""
    return (q.float() * scale).to(dtype)


def scale_per_tensor(x: torch.Tensor, dtype: torch.dtype = E4M3) -> torch.Tensor:
    """One scale, ``amax(|x|) / max``, as a 0-d float32 tensor."""
    return (x.abs().amax().float() / torch.finfo(dtype).max).clamp(min=MIN_SCALE)


def scale_per_row(x: torch.Tensor, dtype: torch.dtype = E4M3) -> torch.Tensor:
    """One scale per row of a 2-D ``x`` (a weight's output channel, or an activation's token): ``[rows, 1]``, the
    row's largest magnitude over the format's largest number (at least :data:`MIN_SCALE`)."""
    # BEGIN TASK 15.1: scale into e4m3
    return (x.abs().amax(dim=-1, keepdim=True).float() / torch.finfo(dtype).max).clamp(min=MIN_SCALE)
    # END TASK 15.1


def scale_per_block(w: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = E4M3) -> torch.Tensor:
    """One scale per ``block = (rows, cols)`` tile of a 2-D ``w``: ``[ceil(R / rows), ceil(C / cols)]`` (the
    last tiles may be partial, as in the checkpoints). :func:`_tiles` views ``w`` as ``[R / rows, rows, C / cols,
    cols]``, padded with zeros."""
    # BEGIN TASK 15.1: scale into e4m3
    tiles = _tiles(w.float().abs(), block)
    return (tiles.amax(dim=(1, 3)) / torch.finfo(dtype).max).clamp(min=MIN_SCALE)
    # END TASK 15.1


def expand_block_scale(scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """A ``[ceil(R / rows), ceil(C / cols)]`` block scale spread over the ``[R, C]`` tensor it belongs to."""
    rows, cols = block
    return scale.repeat_interleave(rows, dim=0)[: shape[0]].repeat_interleave(cols, dim=1)[:, : shape[1]]


def quantize_weight(w: torch.Tensor, block: tuple[int, int] | None = None,
                    dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D weight ``[out, in]`` as ``(fp8 values, float32 scale)``: per output channel (scale ``[out, 1]``)
    when ``block`` is None, else per ``block`` tile (scale ``[ceil(out / rows), ceil(in / cols)]``)."""
    if w.dim() != 2:
        raise ValueError(f"a weight to quantize must be 2-D [out, in], got shape {tuple(w.shape)}")
    if block is None:
        scale = scale_per_row(w, dtype)
        return quantize(w, scale, dtype), scale
    scale = scale_per_block(w, block, dtype)
    return quantize(w, expand_block_scale(scale, block, tuple(w.shape)), dtype), scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of :func:`quantize_weight` (up to its rounding)."""
    full = scale if block is None else expand_block_scale(scale, block, tuple(q.shape))
    return dequantize(q, full, dtype)


def quantize_activation(x: torch.Tensor, group: int | None = None,
                        dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """An activation ``[T, K]`` quantized on the fly, one scale per token (``group`` None: scale ``[T, 1]``) or
    per ``group`` consecutive features of a token (scale ``[T, ceil(K / group)]``), as the weights' blocks need."""
    if group is None:
        scale = scale_per_row(x, dtype)
        return quantize(x, scale, dtype), scale
    scale = scale_per_block(x, (1, group), dtype)
    return quantize(x, expand_block_scale(scale, (1, group), tuple(x.shape)), dtype), scale


def _tiles(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``x [R, C]`` padded with zeros to whole tiles and viewed as ``[R / rows, rows, C / cols, cols]``."""
    rows, cols = block
    r, c = x.shape
    pr, pc = math.ceil(r / rows) * rows, math.ceil(c / cols) * cols
    if (pr, pc) != (r, c):
        x = torch.nn.functional.pad(x, (0, pc - c, 0, pr - r))
    return x.view(pr // rows, rows, pc // cols, cols)
