"""Qwen3-MoE (chapter 14): Qwen3's attention (QK-norm, no bias) with MoE MLPs.

Which layers carry experts is configurable: layer ``i`` is sparse when ``(i + 1) % decoder_sparse_step == 0`` and
``i`` is not in ``mlp_only_layers``; the others keep a dense MLP of width ``intermediate_size``. The released
models (Qwen3-30B-A3B, Qwen3-235B-A22B) make every layer sparse: 128 experts of width ``moe_intermediate_size``,
8 per token, weights renormalised (``norm_topk_prob``).
"""

from __future__ import annotations

from minisgl_ref.layers.rotary import RotaryEmbedding
from minisgl_ref.models.config import ModelConfig
from minisgl_ref.models.qwen3 import Qwen3DecoderLayer
from minisgl_ref.moe.config import MoEConfig
from minisgl_ref.moe.layer import MoEBlock
from minisgl_ref.moe.model import MoEForCausalLM


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__(config, layer_id, rotary)
        moe = MoEConfig.qwen3_moe(config)
        if moe.is_sparse(layer_id):
            # Replaces the dense MLP the parent built (allocated, never filled: it costs no loading).
            self.mlp = MoEBlock(config.hidden_size, moe)


class Qwen3MoeForCausalLM(MoEForCausalLM):
    decoder_layer_cls = Qwen3MoeDecoderLayer

    @classmethod
    def moe_config(cls, config: ModelConfig) -> MoEConfig:
        return MoEConfig.qwen3_moe(config)
