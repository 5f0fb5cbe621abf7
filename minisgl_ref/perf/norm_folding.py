"""Norm folding: two RMSNorm kernels fewer per decoder layer, by finishing each norm inside its neighbours (chapter 11).

A pre-norm decoder layer computes, twice per layer, ``residual += h`` and then ``y = norm(residual) @ W.T``, with
``norm(x) = x / rms(x) * g``. On a GPU that is two kernels: FlashInfer's fused add-and-norm, which reads the
residual stream and writes its normalised copy, and the matmul. In a decode step of a small model each of them is
a few microseconds of fixed cost for a few kilobytes of work, and a step has 56 of these norms.

Two identities take the norm kernel away:

* ``g`` scales the matmul's *input* columns, so it can be multiplied into the weight once, at load time:
  ``(x * g) @ W.T == x @ (W * g).T``;
* ``1 / rms(x)`` is one number per token, so it commutes with the matmul: ``(x / rms(x)) @ W.T ==
  (x @ W.T) / rms(x)``. It can be applied by whatever kernel reads the matmul's output next, if that kernel also
  reads the token's row of ``x`` to compute it (a few kilobytes).

And the residual add moves into the matmul before it: cuBLAS computes ``C = A @ B + C``, so ``o_proj`` and
``down_proj`` write ``residual + h`` straight into the residual stream (``torch.addmm_``, :func:`accumulate_`).
What was

    add+norm -> qkv matmul -> QK-norm/RoPE/KV store -> attention -> o_proj -> add+norm -> gate_up -> act -> down

becomes

    qkv matmul -> QK-norm/RoPE/KV store (divides q, k, v by rms) -> attention -> o_proj (+= residual)
               -> gate_up matmul -> act (divides gate, up by rms) -> down (+= residual)

nine kernels per layer become seven, and the kernels that absorb the division are ours already
(:func:`~minisgl_ref.perf.triton_ops.qk_norm_rope_`, :func:`~minisgl_ref.perf.triton_ops.silu_and_mul_rms`).
The arithmetic is the same to bf16 rounding: the projection of the unnormalised row is rounded to bf16 before
the division, where the original rounded the normalised row before the projection (``tests/test_norm_folding.py``
holds the two forwards to each other on the CPU in float32 and on a GPU in bf16).

When it applies (:func:`should_fold`): the Triton kernels run (CUDA, half precision, ``MINISGL_FUSED`` not ``0``,
``MINISGL_FOLD_NORMS`` not ``0``), one tensor-parallel rank (with several, ``o_proj``'s output is a partial sum
that an all-reduce completes, and adding it to the residual on every rank would count the residual once per rank),
and no bias on the projections (a bias would be divided by the rms too).

Folding is a transform of one built model, :func:`fold_`: it multiplies the norm weights into the projections and
replaces each decoder layer by a :class:`FoldedDecoderLayer`, which holds the same submodules and is called the
same way as chapter 01's layer, ``(positions, hidden, residual, batch) -> (hidden, residual)``. It keeps the
whole residual stream in ``hidden``, updated in place, and hands on ``residual=None``, so the model's one loop over
its layers and its final norm run unchanged. Once folded, the weights are no longer the checkpoint's: :func:`fold_`
marks the model (``norms_folded``), and the start-up warm-up reads the mark to run the accumulating matmuls.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl_ref import env
from minisgl_ref.core.forward_batch import ForwardBatch
from minisgl_ref.distributed import get_tp_info
from minisgl_ref.layers.linear import RowParallelLinear
from minisgl_ref.models.llama import LlamaDecoderLayer, LlamaMLP
from minisgl_ref.perf import triton_ops
from minisgl_ref.perf.rope_store import RopeStoreAttention
from minisgl_ref.perf.row_rms import divide_by_rms_


def accumulate_(linear: RowParallelLinear, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``out += x W^T`` in the matmul itself (cuBLAS's ``C = A B + C``): the residual add of a decoder layer
    without a kernel of its own. One rank, no bias: with several ranks each would add its partial sum *and* the
    residual, and the all-reduce would count the residual once per rank."""
    if linear.tp_size != 1 or linear.bias is not None:
        raise ValueError("accumulate_ needs tp_size 1 and no bias")
    return out.addmm_(x, linear.weight.t())


class FoldedDecoderLayer(nn.Module):
    """A decoder layer with both norms folded: the projections read the residual stream ``x`` itself, the kernels
    after them divide by its rms, and ``o_proj`` and ``down_proj`` add their outputs into ``x`` in the matmul. No
    norm kernel, no add kernel."""

    def __init__(self, layer: LlamaDecoderLayer) -> None:
        super().__init__()
        attn = layer.self_attn
        self.self_attn = attn if isinstance(attn, RopeStoreAttention) else RopeStoreAttention(attn)
        self.mlp = layer.mlp
        # Kept for their eps (and their parameters' names); their weights now live in the projections.
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.post_attention_layernorm

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, None]:
        """Chapter 01's call: the stream is ``hidden + residual`` (``hidden`` alone when ``residual`` is None, as
        from the embeddings or another folded layer). Returns ``(stream, None)``, the stream updated in place."""
        x = hidden if residual is None else hidden + residual
        attn, mlp = self.self_attn, self.mlp
        accumulate_(attn.o_proj, x, attn.attend(positions, x, batch, rms_eps=self.input_layernorm.eps))
        accumulate_(mlp.down_proj, x, self.activation(x))
        return x, None

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of the projection of the unnormalised rows of ``x``, each divided by its row's rms
        first: one Triton kernel where it runs, else the plain division and the kernel table's entry."""
        gate_up = self.mlp.gate_up_proj(x)
        eps = self.post_attention_layernorm.eps
        if triton_ops.available(gate_up):  # one kernel, as without folding
            return triton_ops.silu_and_mul_rms(gate_up, x, eps)
        return self.mlp.act(divide_by_rms_(gate_up, x, eps))


def should_fold(model: nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether folding pays on this device: the Triton kernels that finish the norm run there, and the model is
    one whose layers can be folded (see the module docstring)."""
    if not env.fold_norms_enabled() or get_tp_info().size != 1:
        return False
    probe = torch.empty(0, dtype=dtype, device=device)
    if not triton_ops.available(probe) or not hasattr(model, "layers"):
        return False
    return all(_foldable(layer) for layer in model.layers)  # type: ignore[union-attr]


def _foldable(layer: nn.Module) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or not isinstance(mlp, LlamaMLP):  # a mixture of experts (chapter 14) has no gate_up_proj
        return False
    projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if any(p.quant_method.quantized for p in projections):  # FP8 weights (chapter 15): not scalable in
        return False  # place, and the accumulating matmul reads a full-precision weight
    return (attn.qkv_proj.bias is None and attn.o_proj.bias is None and mlp.down_proj.bias is None
            and hasattr(layer, "input_layernorm") and hasattr(layer, "post_attention_layernorm"))


def is_folded(model: nn.Module) -> bool:
    return bool(getattr(model, "norms_folded", False))


@torch.no_grad()
def fold_(model: nn.Module) -> None:
    """Multiply each layer's two norm weights into the projections that read the norms' outputs (in float32,
    rounded once), and replace each layer by its :class:`FoldedDecoderLayer`. Call once, after the weights are
    loaded; it changes this model only (its class, and every other model of that class, stay as they were)."""
    if is_folded(model):
        raise ValueError("the model's norms are folded already")
    layers: nn.ModuleList = model.layers  # type: ignore[assignment]
    for layer in layers:
        if not _foldable(layer):
            raise ValueError(f"{type(layer).__name__} cannot be folded (a bias, or no pre-norms)")
    for i, layer in enumerate(layers):
        for norm, linear in ((layer.input_layernorm, layer.self_attn.qkv_proj),
                             (layer.post_attention_layernorm, layer.mlp.gate_up_proj)):
            w = linear.weight
            w.copy_((w.float() * norm.weight.float()).to(w.dtype))
        layers[i] = FoldedDecoderLayer(layer)
    model.norms_folded = True  # type: ignore[assignment]
