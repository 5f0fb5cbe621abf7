"""What every MoE model shares (chapter 14): a dense model whose MLPs are (some of them) :class:`MoEBlock`\\ s.

Attention, norms, embeddings and the decoder layer's forward are the chapter-01 classes, inherited unchanged; a
family's decoder layer only swaps its ``mlp``. What differs is the checkpoint: an MoE checkpoint stores every expert's
three matrices separately (``model.layers.N.mlp.experts.E.gate_proj.weight``, ...), and this model keeps them
stacked. :meth:`MoEForCausalLM.load_weights` writes each expert tensor into its slot of the stacks as the tensors
stream by, and hands every other tensor to the chapter-01 loader, which fuses and checks them as for a dense model.

At ``tp_size > 1`` the attention and dense layers are tensor-parallel as in chapter 09, and the experts are split
by expert over ``ep_size`` groups of ranks and by width inside a group (:class:`~minisgl_ref.moe.layer.MoEBlock`):
a rank keeps its own part of the expert tensors and drops the rest unread (a lazy checkpoint tensor is never read;
dummy weights are generated whole, seeded by name, and sliced, so every rank's part is the very one a single
process would have).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from minisgl_ref.core.forward_batch import ForwardBatch
from minisgl_ref.distributed import get_tp_info
from minisgl_ref.models.config import ModelConfig
from minisgl_ref.models.llama import LlamaForCausalLM
from minisgl_ref.moe.config import MoEConfig
from minisgl_ref.moe.ep import local_experts, local_width
from minisgl_ref.moe.layer import EXPERT_PARTS, MoEBlock

# model.layers.3.mlp.experts.17.gate_proj.weight (Qwen3-MoE), model.layers.3.block_sparse_moe.experts.5.w1.weight
_EXPERT = re.compile(r"^(?:model\.)?layers\.(?P<layer>\d+)\.(?P<module>\w+)\.experts\.(?P<expert>\d+)\."
                     r"(?P<leaf>\w+)\.weight$")
# transformers 5 holds the experts already stacked (gate rows first), and a checkpoint saved from its state dict
# keeps that form: model.layers.3.mlp.experts.gate_up_proj [E, 2I, H] and ...experts.down_proj [E, H, I].
_STACKED = re.compile(r"^(?:model\.)?layers\.(?P<layer>\d+)\.(?P<module>\w+)\.experts\."
                      r"(?P<which>gate_up_proj|down_proj)$")


class MoEForCausalLM(LlamaForCausalLM):
    #: The name of the MoE block inside each decoder layer of the checkpoint (ours is always ``mlp``).
    moe_module = "mlp"
    #: Checkpoint name of each expert matrix -> its part (``gate``, ``up``, ``down``).
    expert_names: dict[str, str] = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    #: Chapter 14's routing counter, when one is attached (:func:`~minisgl_ref.moe.distribution.attach_distribution`).
    distribution: Any = None

    @classmethod
    def moe_config(cls, config: ModelConfig) -> MoEConfig:
        raise NotImplementedError

    def __init__(self, config: ModelConfig) -> None:
        tp = get_tp_info()
        moe = type(self).moe_config(config)
        # An uneven split is refused by name here, before the dense layers (which slice other widths) are built.
        local_experts(0, tp.ep_size, moe.num_experts)
        local_width(moe.intermediate_size, tp.moe_tp_size)
        super().__init__(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The dense model's forward; with a routing counter attached, it first learns which rows are real."""
        if self.distribution is not None:
            self.distribution.begin_step(batch, input_ids.shape[0])
        return super().forward(input_ids, positions, batch)

    @classmethod
    def checkpoint_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """The dense model's tensors, with every sparse layer's MLP replaced by the router and the experts,
        named as the family's checkpoints name them (so dummy weights go through the real loading path)."""
        shapes = super().checkpoint_shapes(config)
        moe = cls.moe_config(config)
        h, i = config.hidden_size, moe.intermediate_size
        leaf = {part: name for name, part in cls.expert_names.items()}
        for n in range(config.num_layers):
            if not moe.is_sparse(n):
                continue
            for dense in ("gate_proj", "up_proj", "down_proj"):
                del shapes[f"model.layers.{n}.mlp.{dense}.weight"]
            prefix = f"model.layers.{n}.{cls.moe_module}."
            shapes[prefix + "gate.weight"] = (moe.num_experts, h)
            for e in range(moe.num_experts):
                shapes[f"{prefix}experts.{e}.{leaf['gate']}.weight"] = (i, h)
                shapes[f"{prefix}experts.{e}.{leaf['up']}.weight"] = (i, h)
                shapes[f"{prefix}experts.{e}.{leaf['down']}.weight"] = (h, i)
        return shapes

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Expert tensors into the stacks; everything else (the routers included) to the chapter-01 loader."""
        super().load_weights(self._load_experts(weights))

    def _load_experts(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        blocks = {n: layer.mlp for n, layer in enumerate(self.layers) if isinstance(layer.mlp, MoEBlock)}
        seen: set[tuple[int, int, str]] = set()

        def block_of(name: str, layer: int) -> MoEBlock:
            if layer not in blocks:
                raise KeyError(f"checkpoint tensor {name!r} is an expert, but layer {layer} of "
                               f"{type(self).__name__} is dense")
            return blocks[layer]

        for name, tensor in weights:
            m = _EXPERT.match(name)
            if m and m["module"] == self.moe_module:
                n, expert = int(m["layer"]), int(m["expert"])
                if m["leaf"] not in self.expert_names:
                    raise KeyError(f"checkpoint tensor {name!r}: an expert's matrices are {sorted(self.expert_names)}")
                part = self.expert_names[m["leaf"]]
                block_of(name, n).load_expert(expert, part, tensor)  # another rank's: left unread
                seen.add((n, expert, part))
                continue
            m = _STACKED.match(name)
            if m and m["module"] == self.moe_module:
                n = int(m["layer"])
                block = block_of(name, n)
                block.load_stacked(m["which"], tensor)  # this rank's block of experts
                parts = ("gate", "up") if m["which"] == "gate_up_proj" else ("down",)
                seen |= {(n, e, p) for e in range(block.num_experts) for p in parts}
                continue
            yield name.replace(f".{self.moe_module}.", ".mlp."), tensor
        for n, block in blocks.items():
            lacking = [(e, p) for e in range(block.num_experts) for p in EXPERT_PARTS if (n, e, p) not in seen]
            if lacking:
                raise KeyError(f"checkpoint lacks {len(lacking)} expert matrices of layer {n}, e.g. expert "
                               f"{lacking[0][0]}'s {lacking[0][1]}")
            # The stacks are full. Handing them to the dense loader as they are (a copy onto itself changes
            # nothing) lets its check that every parameter was loaded cover them too.
            yield f"model.layers.{n}.mlp.w13", block.w13.data
            yield f"model.layers.{n}.mlp.w2", block.w2.data
