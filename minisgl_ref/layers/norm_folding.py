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
``down_proj`` write ``residual + h`` straight into the residual stream (``torch.addmm_``, :meth:`~minisgl_ref.
layers.linear.RowParallelLinear.accumulate_`). What was

    add+norm -> qkv matmul -> QK-norm/RoPE/KV store -> attention -> o_proj -> add+norm -> gate_up -> act -> down

becomes

    qkv matmul -> QK-norm/RoPE/KV store (divides q, k, v by rms) -> attention -> o_proj (+= residual)
               -> gate_up matmul -> act (divides gate, up by rms) -> down (+= residual)

nine kernels per layer become seven, and the kernels that absorb the division are ours already
(:func:`~minisgl_ref.layers.triton_fused.qk_norm_rope_`, :func:`~minisgl_ref.layers.triton_fused.silu_and_mul_rms`).
The arithmetic is the same to bf16 rounding: the projection of the unnormalised row is rounded to bf16 before
the division, where the original rounded the normalised row before the projection (``tests/test_norm_folding.py``
holds the two forwards to each other on the CPU in float32 and on a GPU in bf16).

When it applies (:func:`should_fold`): the Triton kernels run (CUDA, half precision, ``MINISGL_FUSED`` not ``0``,
``MINISGL_FOLD_NORMS`` not ``0``), one tensor-parallel rank (with several, ``o_proj``'s output is a partial sum
that an all-reduce completes, and adding it to the residual on every rank would count the residual once per rank),
and no bias on the projections (a bias would be divided by the rms too). Once folded, the weights are no longer
the checkpoint's: :func:`fold_` marks the model, and the model's forward takes the folded path from then on.
"""

from __future__ import annotations

from minisgl_ref import env

import torch
from torch import nn

from minisgl_ref.distributed import get_tp_info
from minisgl_ref.layers import triton_fused


def rms_reciprocal(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``1 / rms(x)`` per row of ``x`` [T, hidden], float32 [T, 1]: the part of RMSNorm that folding leaves."""
    x32 = x.float()
    return torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def divide_by_rms_(t: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    """Divide each token's row of ``t`` [T, ...] by the rms of its row of ``x`` [T, hidden], in place (the plain
    version of what the Triton kernels do while they read ``t``)."""
    r = rms_reciprocal(x, eps).view(-1, *([1] * (t.dim() - 1)))
    return t.copy_((t.float() * r).to(t.dtype))


def should_fold(model: nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether folding pays on this device: the Triton kernels that finish the norm run there, and the model is
    one whose layers can be folded (see the module docstring)."""
    if not env.fold_norms_enabled() or get_tp_info().size != 1:
        return False
    probe = torch.empty(0, dtype=dtype, device=device)
    if not triton_fused.available(probe) or not hasattr(model, "layers"):
        return False
    return all(_foldable(layer) for layer in model.layers)  # type: ignore[union-attr]


def _foldable(layer: nn.Module) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        return False
    return (attn.qkv_proj.bias is None and attn.o_proj.bias is None and mlp.down_proj.bias is None
            and hasattr(layer, "input_layernorm") and hasattr(layer, "post_attention_layernorm"))


@torch.no_grad()
def fold_(model: nn.Module) -> None:
    """Multiply each layer's two norm weights into the projections that read the norms' outputs (in float32,
    rounded once), and switch the model to its folded forward. Call once, after the weights are loaded."""
    if getattr(model, "norms_folded", False):
        raise ValueError("the model's norms are folded already")
    for layer in model.layers:  # type: ignore[union-attr]
        if not _foldable(layer):
            raise ValueError(f"{type(layer).__name__} cannot be folded (a bias, or no pre-norms)")
        for norm, linear in ((layer.input_layernorm, layer.self_attn.qkv_proj),
                             (layer.post_attention_layernorm, layer.mlp.gate_up_proj)):
            w = linear.weight
            w.copy_((w.float() * norm.weight.float()).to(w.dtype))
    model.norms_folded = True  # type: ignore[assignment]
