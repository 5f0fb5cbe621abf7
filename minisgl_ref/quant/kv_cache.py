"""An FP8 KV cache (chapter 15, SGLang's ``--kv-cache-dtype fp8_e4m3``): one byte per key and value element.

Decode at a large batch reads more KV than weights (chapter 11), so halving the KV's bytes halves most of what a
long-context step moves, and doubles the tokens a pool of the same memory holds. The pool keeps e4m3 (or e5m2)
numbers and one float32 scale per layer for the keys and one for the values: ``value = stored * scale``.

The scale is *static*: it is fixed before the first key is written, because a key written at step 10 must still
decode to the same value at step 10,000, when the pool holds many requests' keys under the same scale. SGLang
takes the scales from the checkpoint (``k_scale`` / ``v_scale``) and uses 1.0 when there are none; this pool does
the same (:meth:`Fp8KVPool.set_scales` is the place to put calibrated ones). With a scale of 1, e4m3 keeps values
from 2^-6 = 0.016 up to 448 at its full precision (a relative step of 2^-3), and smaller ones with fewer bits, down
to 2^-9 = 0.002; anything smaller is stored as zero. Chapter 15 measures what that costs in perplexity.

Writing quantizes (:meth:`store`); the reference attention reads through :meth:`gather`, which dequantizes. The
raw buffers stay ``k[layer]`` / ``v[layer]``, so moving KV between slots (chapter 13) and the radix cache's page
bookkeeping (chapter 04) are unchanged: they move bytes, never values.
"""

from __future__ import annotations

import torch

from minisgl_ref.kvcache.pool import KVPool
from minisgl_ref.layers.kernel_table import KERNELS
from minisgl_ref.quant.fp8 import E4M3, E5M2, quantize


class Fp8KVPool(KVPool):
    """A KV pool of ``fp8`` numbers (e4m3 by default) with a per-layer key scale and value scale (1.0 until set)."""

    fp8: torch.dtype = E4M3

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(num_layers, num_slots, num_kv_heads, head_dim, dtype, device)
        self.k_scale = [1.0] * num_layers
        self.v_scale = [1.0] * num_layers
        self.written = False  # once a key is stored (or a CUDA graph captured a step) the scales are fixed

    @classmethod
    def storage_dtype_for(cls, dtype: torch.dtype) -> torch.dtype:
        return cls.fp8

    def scales(self, layer_id: int) -> tuple[float, float]:
        return self.k_scale[layer_id], self.v_scale[layer_id]

    def set_scales(self, k_scale: list[float], v_scale: list[float]) -> None:
        """Per-layer scales (from a checkpoint, or a calibration run), before anything is stored. Refused after:
        stored keys would decode with the new scale, and the engine's CUDA graphs (captured by running steps,
        which store) hold the old ones as constants."""
        if self.written:
            raise ValueError("set the KV cache scales before anything is stored: this pool already holds keys (or "
                             "CUDA graphs captured with the current scales); build the engine with "
                             "disable_cuda_graph=True and set them before the first request")
        if len(k_scale) != len(self.k) or len(v_scale) != len(self.v):
            raise ValueError(f"need {len(self.k)} key and value scales, got {len(k_scale)} and {len(v_scale)}")
        if min(k_scale + v_scale) <= 0:
            raise ValueError("KV cache scales must be positive")
        self.k_scale, self.v_scale = [float(s) for s in k_scale], [float(s) for s in v_scale]

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize the new keys and values with the layer's scales, then store the bytes as any pool does."""
        ks, vs = self.scales(layer_id)
        self.written = True
        KERNELS.store_kv(self.k[layer_id], self.v[layer_id], slots, quantize(k, ks, self.fp8),
                         quantize(v, vs, self.fp8))

    def gather(self, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ks, vs = self.scales(layer_id)
        k, v = self.k[layer_id][slots], self.v[layer_id][slots]
        return (k.to(torch.float32) * ks).to(self.dtype), (v.to(torch.float32) * vs).to(self.dtype)


class Fp8E5M2KVPool(Fp8KVPool):
    """The same with e5m2 numbers: a wider range (up to 57,344), half the precision."""

    fp8 = E5M2
