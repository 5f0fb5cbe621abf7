"""Top-k routing: which experts each token goes to, and with what weights (chapter 14).

The router is one linear map from a token's hidden state to one logit per expert (``[T, E]``). Both model
families served here turn those logits into weights the same way: softmax over *all* experts (in float32, as
transformers does, so that 128 nearly equal logits do not lose their ordering to bfloat16 rounding), keep the
``k`` largest, and optionally rescale the kept ones to sum to 1.

* Qwen3-MoE renormalises when its config says ``norm_topk_prob`` (Qwen3-30B-A3B: true). Without it the ``k``
  weights sum to less than 1: a token whose router is unsure contributes a smaller MLP update.
* Mixtral is usually written as "softmax of the top-k logits". That is the same thing: softmax is monotone, so the
  top-k of the probabilities are the top-k of the logits, and ``exp(l_i) / sum_{j in topk} exp(l_j)`` equals
  ``p_i / sum_{j in topk} p_j`` because the full softmax's common denominator cancels. So Mixtral is
  ``route(..., renormalize=True)``; tests/test_moe_models.py checks the identity numerically.
"""

from __future__ import annotations

import torch


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights float32 [T, k], topk_ids int64 [T, k])`` for router logits ``[T, E]``, the largest weight
    first in each row (the order ``torch.topk`` gives; the expert computation does not depend on it).

    What to decide: where the softmax is taken (over all ``E`` logits, before choosing, so that an unnormalised
    weight says how much of the router's whole belief the chosen experts hold), in which precision (float32:
    128 logits within a few bf16 ulps of each other would otherwise tie and reorder), and what ``renormalize``
    divides by (the sum of the ``k`` kept weights, per token, so that they add up to 1)."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [tokens, experts], got {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be between 1 and the number of experts ({num_experts}), got {top_k}")
    # BEGIN TASK 14.2: the router's weights
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
    # END TASK 14.2
