"""The new keys and values written into the KV pool by the RoPE kernel itself (chapter 11).

Chapter 01's attention rotates q and k and hands q, k and v to the attention backend, which first stores k and v
into the pool (:meth:`~minisgl_ref.kvcache.pool.KVPool.store`) and then attends. On a GPU that store is one more
kernel per layer, which reads back the keys the RoPE kernel has just written. Our Triton QK-norm/RoPE kernel holds
each rotated key head in registers anyway: given ``store=``, it also writes it, and the token's value heads,
straight into the token's KV slot, and the backend is told ``kv_stored=True`` and only attends. One kernel fewer
per layer in every step: 274 kernels per decode step at 256 running requests instead of 302, and the small kernels'
time there from 0.68 to 0.56 ms on an H100 (chapter 11).

:class:`RopeStoreAttention` is chapter 01's attention with that step, and :func:`store_kv_in_rope_` swaps it into
a built model: the same submodules, so the same parameters and state-dict names, and the model class untouched.
It stores in the RoPE kernel only where that kernel runs and the step has a KV pool of the activations' dtype
behind its backend (:meth:`RopeStoreAttention.can_store_kv`); anywhere else it computes exactly what chapter 01's
attention does. It also finishes a folded input norm (``rms_eps``, :mod:`~minisgl_ref.perf.norm_folding`) in the
same kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl_ref.core.forward_batch import ForwardBatch
from minisgl_ref.models.llama import LlamaAttention
from minisgl_ref.perf import triton_ops
from minisgl_ref.perf.row_rms import divide_by_rms_


class RopeStoreAttention(nn.Module):
    """:class:`~minisgl_ref.models.llama.LlamaAttention` (and its Qwen variants) whose RoPE kernel stores K/V."""

    def __init__(self, attn: LlamaAttention) -> None:
        super().__init__()
        # The attention's own submodules, registered under the same names: the parameters are shared, not copied.
        self.qkv_proj, self.o_proj, self.rotary, self.attn = attn.qkv_proj, attn.o_proj, attn.rotary, attn.attn
        self.q_norm, self.k_norm = attn.q_norm, attn.k_norm
        self.q_size, self.kv_size = attn.q_size, attn.kv_size

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.o_proj(self.attend(positions, hidden, batch))

    def attend(self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,
               rms_eps: float | None = None) -> torch.Tensor:
        """Attention up to ``o_proj``. With ``rms_eps`` (norm folding) ``hidden`` is the residual stream itself,
        not its normalised copy: the input norm's weight is folded into ``qkv_proj``, and q, k and v are divided
        by each row's rms here (by the QK-norm/RoPE kernel, where it runs)."""
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.attn.num_heads, self.attn.head_dim)
        k = k.reshape(-1, self.attn.num_kv_heads, self.attn.head_dim)
        v = v.reshape(-1, self.attn.num_kv_heads, self.attn.head_dim)
        stored = self.can_store_kv(q, v, batch)
        rotary = self.rotary
        if triton_ops.available(q) and q.shape[-1] == rotary.head_dim:
            norm = ((self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
                    if self.q_norm is not None and self.k_norm is not None else ())
            kv = None
            if stored:
                pool = batch.attn_backend.kv_pool  # type: ignore[attr-defined]
                kv = (v, pool.k[self.attn.layer_id], pool.v[self.attn.layer_id], batch.out_cache_loc)
            q, k = triton_ops.qk_norm_rope_(positions, q, k, rotary.cos_cache, rotary.sin_cache, *norm, store=kv,
                                            row_rms=None if rms_eps is None else (hidden, v, rms_eps))
        else:  # chapter 01's path (the kernel table's entries), after the plain end of a folded norm
            if rms_eps is not None:
                q, k = (divide_by_rms_(t, hidden, rms_eps) for t in (q, k))
                divide_by_rms_(v, hidden, rms_eps)
            q, k = rotary.norm_and_rotate(positions, q, k, self.q_norm, self.k_norm)
        return self.attn(q, k, v, batch, kv_stored=stored)

    def can_store_kv(self, q: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> bool:
        """Whether the RoPE kernel can write this step's K/V into the pool itself: the Triton kernel runs, and a
        KV pool of ``q``'s and ``v``'s dtype is behind the batch's attention backend (the chapter-00 backend
        without a cache has none)."""
        pool = getattr(batch.attn_backend, "kv_pool", None)
        return (triton_ops.available(q) and q.shape[-1] == self.rotary.head_dim
                and pool is not None and batch.out_cache_loc is not None
                and pool.k[0].dtype == q.dtype and pool.v[0].dtype == v.dtype)


def store_kv_in_rope_(model: nn.Module) -> None:
    """Give every decoder layer of ``model`` a :class:`RopeStoreAttention` in place of its chapter-01 attention
    (layers that have one already keep it)."""
    for layer in model.layers:  # type: ignore[union-attr]
        if isinstance(layer.self_attn, LlamaAttention):
            layer.self_attn = RopeStoreAttention(layer.self_attn)
