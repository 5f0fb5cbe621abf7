"""Expert parallelism (chapter 14, SGLang's ``--ep-size``): each rank holds some experts whole, not every expert.

Under tensor parallelism (chapter 09) a dense MLP is sliced along its width: every rank holds ``1/tp`` of every
matrix. An MoE layer could be sliced the same way, every expert's ``I`` split over the ranks, but then each rank
reads a thin slice of *every* chosen expert (Qwen3-30B-A3B at tp = 8: 128 experts of width 768, so 96 columns
each, tiles too thin to keep a GPU busy) and the router's choices are spread evenly for nothing. Expert
parallelism splits the *experts* instead: with ``E`` experts over ``ep`` ranks, rank ``r`` holds experts
``[r * E/ep, (r + 1) * E/ep)`` whole, ``w13 [E/ep, 2I, H]`` and ``w2 [E/ep, H, I]``, and computes only the
(token, choice) pairs routed to them.

What SGLang's real EP does. With data-parallel attention each rank holds *different* tokens, so a token must
travel to the ranks that own its experts and its results must travel back: an all-to-all *dispatch* after the
router and an all-to-all *combine* after the experts (DeepEP's kernels, which also overlap the transfer with
compute and send each token to a node once). Each rank then computes on just the tokens it received, and the
bytes moved are the tokens' hidden states, ``k`` copies at most, not the whole batch.

What this engine does, and why it is the same function. Here attention stays tensor-parallel: after the
attention's all-reduce *every* rank holds *every* token's hidden state, and every rank runs the whole router (its
``gate`` is small and kept whole), so every rank already knows every pair. Nothing has to be dispatched. Each
rank computes, for all tokens, only the pairs whose expert it holds (:func:`localize_routing` renumbers them to
its local stacks and marks the others with id ``-1``, weight 0, which both expert functions skip), giving a
partial ``[T, H]``; the sum over ranks of the partials is the full layer's output, because every pair is
computed on exactly one rank and the output is a sum over pairs. One all-reduce (sum) over the group combines
them, exactly where a row-parallel dense MLP all-reduces. The cost, against the MoE with every expert on every
rank: that all-reduce of ``T x H`` per MoE layer (the same as tensor parallelism's), and, per rank, ``E/ep``
experts' weights in memory and read (Qwen3-30B-A3B in bf16 at ep = 8: 16 of 128 experts per layer, 7.2 GB of its
58 GB of experts). With ``ep_size < tp_size`` the ranks form ``ep_size`` groups of ``tp / ep``: a group holds a block of experts and
slices each one's width over its ranks (:class:`~minisgl_ref.moe.layer.MoEBlock`), and ``ep_size = 1`` is MoE
tensor parallelism, every rank a ``1/tp`` slice of every expert. The same all-reduce combines the slices. What
it does not do is spread the *compute* of a batch evenly: a rank whose experts are
popular does more, and the all-reduce waits for the slowest (SGLang's EPLB replicates hot experts for that).
"""

from __future__ import annotations

import torch

from minisgl_ref.moe.experts import ExpertsFn


def local_experts(rank: int, ep_size: int, num_experts: int) -> range:
    """The global ids of the experts rank ``rank`` of ``ep_size`` holds: a contiguous block of ``E / ep_size``."""
    if ep_size < 1 or not 0 <= rank < ep_size:
        raise ValueError(f"ep rank {rank} is not in a group of ep_size {ep_size}")
    if num_experts % ep_size:
        raise ValueError(f"num_experts ({num_experts}) is not divisible by ep_size ({ep_size}): every rank holds "
                         f"the same number of whole experts")
    per_rank = num_experts // ep_size
    return range(rank * per_rank, (rank + 1) * per_rank)


def local_width(intermediate_size: int, moe_tp_size: int) -> int:
    """The width of each expert a rank holds when a group of ``moe_tp_size`` ranks (``tp_size / ep_size``) shares
    its experts, each rank a slice of the width: ``I / moe_tp_size``."""
    if intermediate_size % moe_tp_size:
        raise ValueError(f"the experts' intermediate size ({intermediate_size}) is not divisible by tp_size / "
                         f"ep_size ({moe_tp_size}): each rank holds an equal slice of every expert it has")
    return intermediate_size // moe_tp_size


def localize_routing(topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     local: range) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice as one rank sees it: ids of the experts in ``local`` renumbered from 0 (their rows in
    the local stacks); every other pair gets id ``-1`` and weight 0, so no expert function computes it. Elementwise
    on the device: no host synchronisation, so it runs inside a CUDA graph."""
    mine = (topk_ids >= local.start) & (topk_ids < local.stop)
    ids = torch.where(mine, topk_ids - local.start, torch.full_like(topk_ids, -1))
    weights = torch.where(mine, topk_weights, torch.zeros_like(topk_weights))
    return weights, ids


def expert_parallel_experts(experts_fn: ExpertsFn, rank: int, ep_size: int, num_experts: int) -> ExpertsFn:
    """``experts_fn`` (the reference loop or the fused kernel) as rank ``rank`` of ``ep_size`` runs it: it takes
    the *global* routing and this rank's local stacks (``w13 [E/ep, 2I, H]``, ``w2 [E/ep, H, I]``) and returns
    this rank's partial output. The sum of the partials over the ranks is ``experts_fn`` on all experts; the
    caller sums them (:class:`~minisgl_ref.moe.layer.MoEBlock` all-reduces)."""
    local = local_experts(rank, ep_size, num_experts)

    def partial(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        if w13.shape[0] != len(local):
            raise ValueError(f"rank {rank} of ep_size {ep_size} holds {len(local)} experts, got stacks of "
                             f"{w13.shape[0]}")
        return experts_fn(hidden, w13, w2, *localize_routing(topk_weights, topk_ids, local))

    return partial
