"""Qwen3 (chapter 01): Llama plus an RMSNorm on every query and key head before RoPE ("QK-norm").

QK-norm bounds the size of attention logits, which keeps training stable; at inference it is two more small norms.
"""

from __future__ import annotations

from minisgl_ref.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    use_qk_norm = True


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Qwen3DecoderLayer
