"""Chapter 15's formats, added through the core's seams: FP8 weights to the loader (:func:`register_quantization`),
FP8 KV caches to the pool's table (:func:`register_kv_cache_dtype`).

The loader (chapter 01) never imports this package; :func:`~minisgl_ref.runtime.build_runtime` calls
:func:`register_quantizations` before it loads a model, as it registers chapter 14's architectures.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from minisgl_ref.kvcache.pool import register_kv_cache_dtype
from minisgl_ref.models.config import ModelConfig
from minisgl_ref.models.loader import register_quantization
from minisgl_ref.quant.kv_cache import Fp8E5M2KVPool, Fp8KVPool
from minisgl_ref.quant.linear import linear_layers, prepare_layer_, quantize_layer_


class Fp8Quantization:
    """``quant_method: fp8``: e4m3 weights of every attention and MLP projection, activations quantized per
    token at run time.

    * An FP8 checkpoint (DeepSeek-V3's and Qwen3-FP8's layout: ``weight_block_size``, ``weight_scale_inv``,
      ``activation_scheme: dynamic``) loads as it is stored. Layers named in ``modules_to_not_convert`` (or
      ``ignored_layers``) stay in full precision.
    * ``--quantization fp8`` on a bf16 checkpoint quantizes each projection once loaded, one scale per output row
      and 128-column group (``w8a8_fp8``: per output channel, :class:`W8A8Fp8Quantization`).

    What the engine cannot honour is refused by name: a static activation scheme (checkpoint ``input_scale``\\ s),
    a per-tensor checkpoint without block sizes, e5m2 weights, and models whose experts are stacked 3-D tensors
    (chapter 14's), which no FP8 expert kernel here reads."""

    def prepare_checkpoint(self, model: nn.Module, config: ModelConfig, qconfig: dict[str, Any]) -> None:
        self._check_model(model)
        scheme = qconfig.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(f"FP8 checkpoint with activation_scheme={scheme!r}: only 'dynamic' (activations "
                             f"scaled per token at run time) is supported")
        fmt = qconfig.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"FP8 checkpoint in format {fmt!r}: only e4m3 weights are supported")
        block = qconfig.get("weight_block_size")
        if not block or len(block) != 2:
            raise ValueError("FP8 checkpoint without weight_block_size: only block-scaled checkpoints (one scale "
                             "per [rows, cols] tile, stored as weight_scale_inv) are supported")
        skip = list(qconfig.get("modules_to_not_convert") or qconfig.get("ignored_layers") or [])
        for name, layer in linear_layers(model):
            if not any(s and s in name for s in skip):
                prepare_layer_(layer, (int(block[0]), int(block[1])))

    #: Input columns per weight scale when quantizing an ordinary checkpoint (None: a whole row).
    group: int | None = 128

    def quantize(self, model: nn.Module, config: ModelConfig) -> None:
        self._check_model(model)
        for _, layer in linear_layers(model):
            quantize_layer_(layer, self.group)

    @staticmethod
    def _check_model(model: nn.Module) -> None:
        stacked = [n for n, p in model.named_parameters() if p.dim() > 2]
        if stacked:
            raise ValueError(f"{type(model).__name__} keeps weights as stacked 3-D tensors (e.g. {stacked[0]}, "
                             f"a mixture of experts), which FP8 quantization does not cover")


class W8A8Fp8Quantization(Fp8Quantization):
    """SGLang's ``w8a8_fp8``: one weight scale per output channel, one activation scale per token, the layout of
    ``torch._scaled_mm``'s row-wise scaling. Only for ordinary checkpoints (an FP8 checkpoint says ``fp8``)."""

    group = None

    def prepare_checkpoint(self, model: nn.Module, config: ModelConfig, qconfig: dict[str, Any]) -> None:
        raise ValueError("w8a8_fp8 quantizes an ordinary checkpoint at load; an FP8 checkpoint loads as 'fp8'")


FP8 = Fp8Quantization()
W8A8_FP8 = W8A8Fp8Quantization()


def register_quantizations() -> None:
    """Register FP8 weights with the loader and the FP8 KV caches with the pool's table (idempotent)."""
    register_quantization("fp8", FP8)
    register_quantization("w8a8_fp8", W8A8_FP8)
    register_kv_cache_dtype("fp8_e4m3", Fp8KVPool)
    register_kv_cache_dtype("fp8_e5m2", Fp8E5M2KVPool)
