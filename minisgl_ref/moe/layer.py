"""The MoE block that takes the place of a dense MLP (chapter 14): route, then run the chosen experts.

A dense SwiGLU MLP applies one ``(W1, W3, W2)`` triple to every token. An MoE block holds ``E`` such triples (the
experts) and a router; each token runs through only the ``k`` experts its router picks, and their outputs are
summed with the router's weights. Qwen3-30B-A3B has 128 experts and picks 8, so a token touches ~3 B of the 30 B
parameters: the compute of a small model with the capacity of a large one.

The weights are kept stacked, ``w13 [E, 2I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]``, the layout the
fused kernels of SGLang and vLLM read, so that any experts function can take them as they are. Which function runs
is a hook (:attr:`MoEBlock.experts`, set with :func:`use_experts`): the default is the float32 reference loop of
:mod:`~minisgl_ref.moe.experts`, and a fused kernel with the same signature replaces it on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from minisgl_ref.moe.config import MoEConfig
from minisgl_ref.moe.experts import reference_experts
from minisgl_ref.moe.router import route

#: ``(hidden [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k], topk_ids [T, k]) -> [T, H]``.
ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

#: The names a checkpoint gives the three matrices of one expert, mapped to their place in the stacks.
EXPERT_PARTS = ("gate", "up", "down")


class MoEBlock(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig, experts: ExpertsFn = reference_experts) -> None:
        super().__init__()
        e, i, h = moe.num_experts, moe.intermediate_size, hidden_size
        self.num_experts, self.intermediate_size, self.hidden_size = e, i, h
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.gate = nn.Linear(h, e, bias=False)  # the router, named as in both families' checkpoints
        self.gate.weight.requires_grad_(False)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        self.experts = experts

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, H] -> [T, H]``: route every token, then let :attr:`experts` compute the weighted sum."""
        topk_weights, topk_ids = route(self.gate(hidden), self.top_k, self.renormalize)
        if self.experts is reference_experts and hidden.is_cuda and torch.cuda.is_current_stream_capturing():
            # The loop asks the host which experts were chosen, which a CUDA graph cannot record.
            raise RuntimeError("the reference expert loop cannot run inside a CUDA graph: set disable_cuda_graph, "
                               "or install a fused experts function with minisgl_ref.moe.layer.use_experts")
        return self.experts(hidden, self.w13, self.w2, topk_weights, topk_ids)

    def load_expert(self, expert: int, part: str, tensor: torch.Tensor) -> None:
        """Copy one expert's ``gate`` ([I, H]: rows 0..I-1 of ``w13[expert]``), ``up`` (rows I..2I-1) or
        ``down`` ([H, I]: ``w2[expert]``) matrix from a checkpoint."""
        if not 0 <= expert < self.num_experts:
            raise KeyError(f"expert {expert} is out of range: this layer has {self.num_experts} experts")
        i = self.intermediate_size
        if part == "down":
            target = self.w2.data[expert]
        elif part in ("gate", "up"):
            target = self.w13.data[expert, :i] if part == "gate" else self.w13.data[expert, i:]
        else:
            raise KeyError(f"an expert has parts {EXPERT_PARTS}, not {part!r}")
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"expert {expert}'s {part} matrix has shape {tuple(tensor.shape)}, expected "
                             f"{tuple(target.shape)}")
        target.copy_(tensor)


def use_experts(model: nn.Module, experts: ExpertsFn) -> int:
    """Make every :class:`MoEBlock` of a built model compute its experts with ``experts`` (a fused kernel, say);
    return how many blocks changed. The weights stay where they are: every experts function reads the same
    stacks."""
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    for block in blocks:
        block.experts = experts
    return len(blocks)
