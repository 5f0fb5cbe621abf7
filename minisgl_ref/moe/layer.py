"""The MoE block that takes the place of a dense MLP (chapter 14): route, then run the chosen experts.

A dense SwiGLU MLP applies one ``(W1, W3, W2)`` triple to every token. An MoE block holds ``E`` such triples (the
experts) and a router; each token runs through only the ``k`` experts its router picks, and their outputs are
summed with the router's weights. Qwen3-30B-A3B has 128 experts and picks 8, so a token touches ~3 B of the 30 B
parameters: the compute of a small model with the capacity of a large one.

The weights are kept stacked, ``w13 [E, 2I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]``, the layout the
fused kernels of SGLang and vLLM read, so that any experts function can take them as they are. Which function runs
is a hook (:attr:`MoEBlock.experts`, set with :func:`use_experts`): the default is the float32 reference loop of
:mod:`~minisgl_ref.moe.experts`, and a fused kernel with the same signature replaces it on a GPU.

Under tensor parallelism the block reads its place in the group when it is built, as the parallel linear layers
do. The ``tp`` ranks form ``ep_size`` groups (:mod:`~minisgl_ref.moe.ep`): a rank holds only its group's ``E / ep``
experts, and of each of them only its slice of the width ``I`` (``I / moe_tp`` of the gate and up rows and of the
down columns, with ``moe_tp = tp / ep``), exactly as chapter 09 slices a dense MLP. It keeps the router whole,
computes its slice of the pairs routed to its experts, and all-reduces the partial output: every (pair, slice) is
computed on exactly one rank, and the layer's output is their sum. ``ep_size = 1`` is SGLang's default MoE tensor
parallelism (every rank a thin slice of every expert); ``ep_size = tp`` keeps every expert whole on one rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from minisgl_ref.distributed import all_reduce, get_tp_info
from minisgl_ref.moe.config import MoEConfig
from minisgl_ref.moe.ep import local_experts, local_width, localize_routing
from minisgl_ref.moe.experts import ExpertsFn, reference_experts
from minisgl_ref.moe.router import route

#: The names a checkpoint gives the three matrices of one expert, mapped to their place in the stacks.
EXPERT_PARTS = ("gate", "up", "down")


class MoEBlock(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig, experts: ExpertsFn = reference_experts) -> None:
        super().__init__()
        e, i, h = moe.num_experts, moe.intermediate_size, hidden_size
        self.num_experts, self.intermediate_size, self.hidden_size = e, i, h
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        tp = get_tp_info()
        self.tp_size, self.ep_rank, self.ep_size = tp.size, tp.ep_rank, tp.ep_size
        self.moe_tp_rank, self.moe_tp_size = tp.moe_tp_rank, tp.moe_tp_size
        #: The global ids of the experts this rank holds, in the order of the stacks (all of them at ep_size 1).
        self.local = local_experts(self.ep_rank, self.ep_size, e)
        #: This rank's slice of each expert's width: columns ``[slice_start, slice_start + local_width)`` of I.
        self.local_width = local_width(i, self.moe_tp_size)
        self.slice_start = self.moe_tp_rank * self.local_width
        self.gate = nn.Linear(h, e, bias=False)  # the router, named as in both families' checkpoints; whole
        self.gate.weight.requires_grad_(False)
        self.gate.weight.weight_loader = _load_whole  # type: ignore[attr-defined]
        self.w13 = nn.Parameter(torch.empty(len(self.local), 2 * self.local_width, h), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(len(self.local), h, self.local_width), requires_grad=False)
        self.experts = experts
        #: Chapter 14's routing counter (:mod:`~minisgl_ref.moe.distribution`), shared by the model's blocks when
        #: attached, and this block's row in it.
        self.distribution: Any = None
        self.distribution_index = 0

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, H] -> [T, H]``: route every token, then let :attr:`experts` compute the weighted sum."""
        topk_weights, topk_ids = route(self.gate(hidden), self.top_k, self.renormalize)
        if self.distribution is not None:
            self.distribution.record(self.distribution_index, topk_ids)
        if self.experts is reference_experts and hidden.is_cuda and torch.cuda.is_current_stream_capturing():
            # The loop asks the host which experts were chosen, which a CUDA graph cannot record.
            raise RuntimeError("the reference expert loop cannot run inside a CUDA graph: set disable_cuda_graph, "
                               "or install a fused experts function with minisgl_ref.moe.layer.use_experts")
        if self.tp_size == 1:
            return self.experts(hidden, self.w13, self.w2, topk_weights, topk_ids)
        if self.ep_size > 1:  # this rank's pairs only (moe/ep.py says why the sum over the ranks is exact)
            topk_weights, topk_ids = localize_routing(topk_weights, topk_ids, self.local)
        # SwiGLU is elementwise along I, so a slice of the width gives a slice of the activation, and the slices'
        # down projections sum to the whole: the same argument as a dense MLP's under chapter 09.
        return all_reduce(self.experts(hidden, self.w13, self.w2, topk_weights, topk_ids))

    def load_expert(self, expert: int, part: str, tensor: torch.Tensor) -> bool:
        """Copy one expert's ``gate`` ([I, H]: rows 0..I-1 of ``w13[expert]``), ``up`` (rows I..2I-1) or
        ``down`` ([H, I]: ``w2[expert]``) matrix from a checkpoint (``expert``: its global id). Under expert
        parallelism another rank's expert is left unread; returns whether it was this rank's."""
        if not 0 <= expert < self.num_experts:
            raise KeyError(f"expert {expert} is out of range: this layer has {self.num_experts} experts")
        if part not in EXPERT_PARTS:
            raise KeyError(f"an expert has parts {EXPERT_PARTS}, not {part!r}")
        i, h = self.intermediate_size, self.hidden_size
        expected = (h, i) if part == "down" else (i, h)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"expert {expert}'s {part} matrix has shape {tuple(tensor.shape)}, expected {expected}")
        if expert not in self.local:
            return False
        slot, w, start = expert - self.local.start, self.local_width, self.slice_start
        if part == "down":  # this rank's columns of the width
            self.w2.data[slot].copy_(tensor.narrow(1, start, w))  # a lazy checkpoint tensor is read here
        else:  # its rows: gate rows first in the stack, then up rows
            target = self.w13.data[slot, :w] if part == "gate" else self.w13.data[slot, w:]
            target.copy_(tensor.narrow(0, start, w))
        return True

    def load_stacked(self, which: str, tensor: torch.Tensor) -> None:
        """Copy a checkpoint's already stacked ``gate_up_proj`` ([E, 2I, H]) or ``down_proj`` ([E, H, I]) of all
        experts: this rank's block of ``E / ep`` experts, and its slice of each one's width."""
        e, i, h = self.num_experts, self.intermediate_size, self.hidden_size
        expected = (e, 2 * i, h) if which == "gate_up_proj" else (e, h, i)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"the stacked {which} has shape {tuple(tensor.shape)}, expected {expected}")
        mine, w, start = tensor.narrow(0, self.local.start, len(self.local)), self.local_width, self.slice_start
        if which == "down_proj":
            self.w2.data.copy_(mine.narrow(2, start, w))
        else:
            self.w13.data[:, :w].copy_(mine.narrow(1, start, w))  # gate rows
            self.w13.data[:, w:].copy_(mine.narrow(1, i + start, w))  # up rows


def _load_whole(param: torch.Tensor, full: torch.Tensor) -> None:
    """The router on every rank: all of it (every rank routes every token), read now if the tensor is lazy."""
    param.data.copy_(full.narrow(0, 0, full.shape[0]))


def use_experts(model: nn.Module, experts: ExpertsFn) -> int:
    """Make every :class:`MoEBlock` of a built model compute its experts with ``experts`` (a fused kernel, say);
    return how many blocks changed. The weights stay where they are: every experts function reads the same
    stacks."""
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    for block in blocks:
        block.experts = experts
    return len(blocks)
