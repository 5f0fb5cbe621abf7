"""The expert computation of an MoE layer, given the router's choice (chapter 14).

Every implementation here computes the same function, the reference's: for each token ``t`` and each of its
``k`` chosen experts ``e = topk_ids[t, j]`` with weight ``w = topk_weights[t, j]``,

    out[t] += w * W2[e] @ (silu(W1[e] @ x[t]) * (W3[e] @ x[t]))

with the gate and up projections stacked as ``w13[e] = [W1[e]; W3[e]]`` (``[E, 2I, H]``: gate rows first) and
the down projection ``w2[e]`` (``[E, H, I]``), the layout SGLang's and vLLM's fused MoE kernels use.

An id below 0 is a pair this call does not compute (it adds nothing, whatever its weight): under expert
parallelism (:mod:`~minisgl_ref.moe.ep`) a rank holds only some experts and marks the pairs routed elsewhere so,
as SGLang's ``expert_map`` does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

#: ``(hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k], topk_ids [T, k]) -> [T, H]``.
ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def check_expert_inputs(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> None:
    """Refuse, by name, shapes that do not describe one MoE layer's call."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [tokens, hidden], got {tuple(hidden.shape)}")
    num_experts, two_inter, h = w13.shape
    if h != hidden.shape[1] or two_inter % 2:
        raise ValueError(f"w13 must be [experts, 2 * intermediate, {hidden.shape[1]}], got {tuple(w13.shape)}")
    if tuple(w2.shape) != (num_experts, h, two_inter // 2):
        raise ValueError(f"w2 must be [{num_experts}, {h}, {two_inter // 2}], got {tuple(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"topk_ids and topk_weights must both be [tokens, k], got {tuple(topk_ids.shape)} and "
                         f"{tuple(topk_weights.shape)}")


def reference_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> torch.Tensor:
    """The oracle: a loop over experts, each applied to the tokens routed to it, in float32, summed in the order of
    the tokens' choices. Slow (one small matmul pair per expert) and obviously right."""
    check_expert_inputs(hidden, w13, w2, topk_weights, topk_ids)
    x = hidden.float()
    out = torch.zeros_like(x)
    inter = w13.shape[1] // 2
    for e in topk_ids.unique().tolist():
        if e < 0:  # routed to an expert this rank does not hold
            continue
        rows, slot = (topk_ids == e).nonzero(as_tuple=True)
        gate_up = x[rows] @ w13[e].float().t()
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, rows, (act @ w2[e].float().t()) * topk_weights[rows, slot].float().unsqueeze(1))
    return out.to(hidden.dtype)
