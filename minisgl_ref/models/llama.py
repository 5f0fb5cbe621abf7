"""Llama in plain PyTorch (chapter 01). Qwen2 and Qwen3 are small variations and subclass it.

The model consumes a *flat* batch: ``input_ids`` and ``positions`` of shape [T] holding the new tokens of every
request back to back, never a padded [B, L] rectangle. Only attention needs to know where one request ends and
the next begins, and it reads that from the :class:`ForwardBatch`. Everything else (projections, norms, MLP) is
per-token and does not care.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from minisgl_ref.core.forward_batch import ForwardBatch
from minisgl_ref.layers.activation import SiluAndMul
from minisgl_ref.layers.attention import AttentionLayer
from minisgl_ref.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minisgl_ref.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from minisgl_ref.layers.norm import RMSNorm
from minisgl_ref.layers.rotary import RotaryEmbedding
from minisgl_ref.models.config import ModelConfig
from minisgl_ref.models.weights import checkpoint_shapes


class LlamaAttention(nn.Module):
    qkv_bias_default = False  # Qwen2 forces a bias on q/k/v
    use_qk_norm = False  # Qwen3 normalises each head of q and k before RoPE

    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        bias = config.attention_bias or self.qkv_bias_default
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads, bias=bias
        )
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        # o_proj reads exactly the query heads this rank owns (an uneven split when the heads do not divide).
        self.o_proj = RowParallelLinear(config.num_heads * config.head_dim, config.hidden_size, bias=False,
                                        shard=self.qkv_proj.q_shard)
        self.rotary = rotary  # one cos/sin table shared by every layer
        self.attn = AttentionLayer(layer_id, self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, config.head_dim)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if self.use_qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if self.use_qk_norm else None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.attn.num_heads, self.attn.head_dim)
        k = k.reshape(-1, self.attn.num_kv_heads, self.attn.head_dim)
        v = v.reshape(-1, self.attn.num_kv_heads, self.attn.head_dim)
        q, k = self.rotary.norm_and_rotate(positions, q, k, self.q_norm, self.k_norm)  # QK-norm: Qwen3 only
        return self.o_proj(self.attn(q, k, v, batch))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], bias=False)
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_id, rotary)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pre-norm block over the flat batch: ``x = x + attn(norm1(x))``, then ``x = x + mlp(norm2(x))``.

        The residual stream ``x`` arrives in two pieces, ``x = hidden + residual``, and leaves the same way, so
        that "add, then normalise" is one call: ``norm(hidden, residual)`` returns ``(norm(hidden + residual),
        hidden + residual)``. The first layer gets the embeddings as ``hidden`` and ``residual=None``: there is
        nothing to add yet, so the embeddings themselves are the residual stream and only ``norm(hidden)`` is
        taken. Use ``self.input_layernorm`` before attention (``self.self_attn(positions, h, batch)``) and
        ``self.post_attention_layernorm`` before ``self.mlp``; return ``(mlp output, residual)`` with
        ``residual`` the stream after the attention sub-block (the next layer, or the final norm, adds the two).
        All tensors are [T, hidden].
        """
        # BEGIN TASK 1.3: the pre-norm decoder layer
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual
        # END TASK 1.3


class LlamaForCausalLM(nn.Module):
    decoder_layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    # Checkpoints store q/k/v and gate/up separately; we keep each group as one fused matrix.
    # (name in our model, name in the checkpoint, which slice of the fused matrix)
    stacked_params: tuple[tuple[str, str, str | int], ...] = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(self.decoder_layer_cls(config, i, rotary) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            # Tied embeddings: the LM head *is* the embedding matrix, shared storage, loaded once.
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for every new token."""
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, batch)
        if residual is None:  # the stream is all in `hidden`: no layers, or chapter 11's folded ones (one piece)
            return self.norm(hidden)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    @classmethod
    def checkpoint_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """The tensor names and full shapes of an HF checkpoint of this class: what ``--load-format dummy``
        invents. A family whose checkpoints hold other tensors (chapter 14's experts) overrides it."""
        attn = cls.decoder_layer_cls.attention_cls
        return checkpoint_shapes(config, config.attention_bias or attn.qkv_bias_default, attn.use_qk_norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the full vocabulary for the rows of ``hidden`` given, in the model's dtype."""
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors into this rank's parameters, fusing and slicing as each parameter requires."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for ckpt_name, tensor in weights:
            name = ckpt_name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue  # the tied copy; embed_tokens.weight is loaded instead
            for fused, part, shard_id in self.stacked_params:
                if f".{part}." in name:
                    target = name.replace(f".{part}.", f".{fused}.")
                    params[target].weight_loader(params[target], tensor, shard_id)
                    loaded.add(target)
                    break
            else:
                if name not in params:
                    raise KeyError(f"checkpoint tensor {ckpt_name!r} has no parameter in {type(self).__name__}")
                param = params[name]
                loader = getattr(param, "weight_loader", None)
                if loader is None:
                    param.data.copy_(tensor)
                else:
                    loader(param, tensor)
                loaded.add(name)
        missing = {n for n in params if n not in loaded}
        if self.config.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} parameters, e.g. {sorted(missing)[:3]}")
