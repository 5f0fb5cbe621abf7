"""Which experts the router actually picks, counted on the device (chapter 14; SGLang's expert distribution record).

A dense decode step reads every weight. An MoE decode step reads the attention and the router whole, but of each
layer's ``E`` experts only those that at least one token of the batch picked: the *active* experts. At batch 1
that is ``k`` of ``E`` (8 of 128 in Qwen3-30B-A3B); at batch 64 with 8 picks each it is most of them. So the floor
of an MoE step (the least time it can take when memory is the limit) depends on the routing, and only counting the
routing of a real run gives it. :class:`ExpertDistribution` counts, per sparse layer:

* ``pairs[l, e]``: the (token, choice) pairs routed to expert ``e``: how loaded each expert was;
* ``active[l]``: the sum over the recorded steps of the number of distinct experts picked in that step: the expert
  weights the step had to read, in experts.

Everything is counted by tensor operations on fixed-size buffers, with no host synchronisation, so the counting
runs inside the decode steps' CUDA graphs (chapter 08) and costs a few small kernels per layer. Two details make it
exact there:

* A graph replays a batch padded to a captured size with dummy requests, which route like any token. A dummy row
  writes its KV to the reserved slot 0, which no real token uses (:data:`~minisgl_ref.engine.cuda_graph.DUMMY_ROW`),
  so ``out_cache_loc != 0`` marks the real tokens and only they are counted.
* The counting is captured into the graphs at start-up, so it cannot be switched off afterwards by skipping it.
  Instead every count is multiplied by a device flag: :meth:`start` sets it (and clears the counts), :meth:`stop`
  clears it, as SGLang's ``start_expert_distribution_record`` and ``stop_expert_distribution_record`` do.

Under expert parallelism every rank routes every token (:mod:`~minisgl_ref.moe.ep`), so rank 0's record is the
whole model's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from minisgl_ref.core.forward_batch import ForwardBatch
from minisgl_ref.moe.layer import MoEBlock
from minisgl_ref.moe.model import MoEForCausalLM


class ExpertDistribution:
    """Device counters of the routing of ``num_layers`` sparse layers of ``num_experts`` experts each."""

    def __init__(self, layer_ids: list[int], num_experts: int, top_k: int, device: torch.device) -> None:
        self.layer_ids, self.num_experts, self.top_k = list(layer_ids), num_experts, top_k
        n = len(self.layer_ids)
        self.pairs = torch.zeros(n, num_experts, dtype=torch.int64, device=device)
        self.active = torch.zeros(n, dtype=torch.int64, device=device)
        self.steps = torch.zeros((), dtype=torch.int64, device=device)  # forward steps with at least one token
        self.tokens = torch.zeros((), dtype=torch.int64, device=device)
        self.recording = torch.zeros((), dtype=torch.int64, device=device)  # 1 between start() and stop()
        # The current step's real-token mask times the flag, [T] int64; set by begin_step for the layers.
        self._weight: torch.Tensor | None = None

    # ------------------------------------------------------------------------------------ inside the forward

    def begin_step(self, batch: ForwardBatch, num_tokens: int) -> None:
        """Called once per forward, before the layers: which of the ``num_tokens`` rows are real tokens."""
        if batch.out_cache_loc is None:  # an engine without a KV pool (the chapter-00 oracle) never pads
            real = torch.ones(num_tokens, dtype=torch.int64, device=self.steps.device)
        else:
            real = (batch.out_cache_loc != 0).to(torch.int64)
        self._weight = real * self.recording
        self.tokens += self._weight.sum()
        self.steps += self._weight.amax(dim=0, keepdim=False) if num_tokens else 0

    def record(self, index: int, topk_ids: torch.Tensor) -> None:
        """Count one sparse layer's routing (``index``: its position in :attr:`layer_ids`; ``topk_ids [T, k]``,
        global expert ids)."""
        weight = self._weight
        if weight is None or weight.shape[0] != topk_ids.shape[0]:
            raise RuntimeError("ExpertDistribution.record before begin_step of this batch")
        per_pair = weight[:, None].expand_as(topk_ids).reshape(-1)
        hits = torch.zeros(self.num_experts, dtype=torch.int64, device=topk_ids.device)
        hits.index_add_(0, topk_ids.reshape(-1), per_pair)
        self.pairs[index] += hits
        self.active[index] += (hits > 0).sum()

    # -------------------------------------------------------------------------------------- from the host

    def start(self) -> None:
        """Clear the counts and count from the next step on."""
        for t in (self.pairs, self.active, self.steps, self.tokens):
            t.zero_()
        self.recording.fill_(1)

    def stop(self) -> None:
        """Stop counting (the counts stay until the next :meth:`start`)."""
        self.recording.fill_(0)

    def dump(self) -> dict[str, Any]:
        """The counts so far, as plain numbers: ``steps`` and ``tokens`` recorded, and per sparse layer
        ``pairs`` (per expert) and ``active_experts_per_step`` (the mean number of distinct experts a step read)."""
        steps = int(self.steps.item())
        return {
            "num_experts": self.num_experts, "top_k": self.top_k, "layer_ids": self.layer_ids,
            "steps": steps, "tokens": int(self.tokens.item()),
            "active_expert_steps": self.active.tolist(),
            "active_experts_per_step": [a / steps if steps else 0.0 for a in self.active.tolist()],
            "pairs": self.pairs.tolist(),
        }


def attach_distribution(model: nn.Module, device: torch.device) -> ExpertDistribution | None:
    """Give every :class:`~minisgl_ref.moe.layer.MoEBlock` of a built MoE model one shared recorder, before its
    CUDA graphs are captured; ``None`` for a model without experts. Counting starts at :meth:`~ExpertDistribution.
    start`."""
    if not isinstance(model, MoEForCausalLM):
        return None
    blocks = [(n, layer.mlp) for n, layer in enumerate(model.layers) if isinstance(layer.mlp, MoEBlock)]
    if not blocks:
        return None
    first = blocks[0][1]
    dist = ExpertDistribution([n for n, _ in blocks], first.num_experts, first.top_k, device)
    for index, (_, block) in enumerate(blocks):
        block.distribution, block.distribution_index = dist, index
    model.distribution = dist
    return dist
