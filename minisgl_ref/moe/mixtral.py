"""Mixtral (chapter 14): Llama's attention with an MoE MLP in every layer.

Mixtral-8x7B has 8 experts of width ``intermediate_size`` (14336) and routes each token to 2, with the softmax of
the two chosen logits as weights (= the renormalised top-2 of the full softmax, :mod:`~minisgl_ref.moe.router`).
Its checkpoints name the block ``block_sparse_moe`` and an expert's matrices ``w1`` (gate), ``w3`` (up) and
``w2`` (down). A ``sliding_window`` in its config is enforced like Mistral's, by
:meth:`~minisgl_ref.models.config.ModelConfig.usable_context` (Mixtral-8x7B's is null: full attention).
"""

from __future__ import annotations

from minisgl_ref.layers.rotary import RotaryEmbedding
from minisgl_ref.models.config import ModelConfig
from minisgl_ref.models.llama import LlamaDecoderLayer
from minisgl_ref.moe.config import MoEConfig
from minisgl_ref.moe.layer import MoEBlock
from minisgl_ref.moe.model import MoEForCausalLM


class MixtralDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__(config, layer_id, rotary)
        # Replaces the dense MLP the parent built (allocated, never filled: it costs no loading).
        self.mlp = MoEBlock(config.hidden_size, MoEConfig.mixtral(config))


class MixtralForCausalLM(MoEForCausalLM):
    decoder_layer_cls = MixtralDecoderLayer
    moe_module = "block_sparse_moe"
    expert_names = {"w1": "gate", "w3": "up", "w2": "down"}

    @classmethod
    def moe_config(cls, config: ModelConfig) -> MoEConfig:
        return MoEConfig.mixtral(config)
