"""The MoE block that takes the place of a dense MLP (chapter 14): route, then run the chosen experts.

A dense SwiGLU MLP applies one ``(W1, W3, W2)`` triple to every token. An MoE block holds ``E`` such triples (the
experts) and a router; each token runs through only the ``k`` experts its router picks, and their outputs are
summed with the router's weights. Qwen3-30B-A3B has 128 experts and picks 8, so a token touches ~3 B of the 30 B
parameters: the compute of a small model with the capacity of a large one.

The weights are kept stacked, ``w13 [E, 2I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]``, the layout the
fused kernels of SGLang and vLLM read, so that any experts function can take them as they are. Which function runs
is a hook (:attr:`MoEBlock.experts`, set with :func:`use_experts`): the default is the float32 reference loop of
:mod:`~minisgl_ref.moe.experts`, and a fused kernel with the same signature replaces it on a GPU.

Under expert parallelism (``ep_size > 1``, :mod:`~minisgl_ref.moe.ep`) the block reads its place in the group when
it is built, as the parallel linear layers do: it holds only its rank's ``E / ep`` experts in the stacks, keeps the
router whole, computes the pairs routed to its experts and all-reduces the partial output.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl_ref.distributed import all_reduce, get_tp_info
from minisgl_ref.moe.config import MoEConfig
from minisgl_ref.moe.ep import local_experts, localize_routing
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
        self.ep_rank, self.ep_size = (tp.rank, tp.ep_size) if tp.ep_size > 1 else (0, 1)
        #: The global ids of the experts this rank holds, in the order of the stacks (all of them at ep_size 1).
        self.local = local_experts(self.ep_rank, self.ep_size, e)
        self.gate = nn.Linear(h, e, bias=False)  # the router, named as in both families' checkpoints; whole
        self.gate.weight.requires_grad_(False)
        self.gate.weight.weight_loader = _load_whole  # type: ignore[attr-defined]
        self.w13 = nn.Parameter(torch.empty(len(self.local), 2 * i, h), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(len(self.local), h, i), requires_grad=False)
        self.experts = experts

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, H] -> [T, H]``: route every token, then let :attr:`experts` compute the weighted sum."""
        topk_weights, topk_ids = route(self.gate(hidden), self.top_k, self.renormalize)
        if self.experts is reference_experts and hidden.is_cuda and torch.cuda.is_current_stream_capturing():
            # The loop asks the host which experts were chosen, which a CUDA graph cannot record.
            raise RuntimeError("the reference expert loop cannot run inside a CUDA graph: set disable_cuda_graph, "
                               "or install a fused experts function with minisgl_ref.moe.layer.use_experts")
        if self.ep_size == 1:
            return self.experts(hidden, self.w13, self.w2, topk_weights, topk_ids)
        # Expert parallelism: this rank's pairs only, then the sum over the ranks (moe/ep.py says why it is exact).
        partial = self.experts(hidden, self.w13, self.w2, *localize_routing(topk_weights, topk_ids, self.local))
        return all_reduce(partial)

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
        slot = expert - self.local.start
        if part == "down":
            target = self.w2.data[slot]
        else:
            target = self.w13.data[slot, :i] if part == "gate" else self.w13.data[slot, i:]
        target.copy_(tensor.narrow(0, 0, tensor.shape[0]))  # a lazy checkpoint tensor is read here, not before
        return True

    def load_stacked(self, which: str, tensor: torch.Tensor) -> None:
        """Copy a checkpoint's already stacked ``gate_up_proj`` ([E, 2I, H]) or ``down_proj`` ([E, H, I]) of all
        experts: this rank's block of ``E / ep`` rows of it."""
        target = self.w13 if which == "gate_up_proj" else self.w2
        expected = (self.num_experts, *target.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"the stacked {which} has shape {tuple(tensor.shape)}, expected {expected}")
        target.data.copy_(tensor.narrow(0, self.local.start, len(self.local)))


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
