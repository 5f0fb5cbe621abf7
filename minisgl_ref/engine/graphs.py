"""The graph runners of a model runner: one interface for every kind of captured step (chapters 08 and 11).

A *graph runner* holds CUDA graphs captured for some kind of step and replays them: decode steps padded to a
batch size (:class:`~minisgl_ref.engine.cuda_graph.CudaGraphRunner`, chapter 08, one per decode attention backend)
and extend steps with few rows or a full prefill budget (:class:`~minisgl_ref.engine.extend_graph.ExtendGraphRunner`,
chapter 11). The model runner keeps them in one list and offers each step to them in order; the first whose
:meth:`GraphRunner.can_run` accepts the step replays it, and a step none accepts runs eagerly. Dropping the list
drops every graph (a tensor-parallel rank must, before it destroys the communicator its graphs captured).

:func:`capture_graphs` builds that list from :class:`GraphSettings`, the engine's CUDA-graph flags resolved for
one device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from minisgl_ref.engine.cuda_graph import CudaGraphRunner
from minisgl_ref.engine.extend_graph import ExtendGraphRunner

if TYPE_CHECKING:
    from torch import nn

    from minisgl_ref.core.config import EngineConfig
    from minisgl_ref.core.forward_batch import ForwardBatch
    from minisgl_ref.engine.attention_planner import AttentionPlanner

logger = logging.getLogger(__name__)


class GraphRunner(Protocol):
    """Captured graphs for some kind of step."""

    def can_run(self, fb: ForwardBatch) -> bool:
        """Whether a captured graph computes this step (its kind, its size, its attention backend)."""
        ...

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Copy the step's inputs into the static buffers, replay: the logits ``[B, V]`` of its sampled rows (a
        view of a buffer the next replay rewrites)."""
        ...

    def can_run_all_positions(self, fb: ForwardBatch) -> bool:
        """Whether a replay of this step also leaves the hidden states of every token (:meth:`hidden_states`):
        what a step that wants logits at more than each row's last token (``fb.extra_logit_indices``) needs."""
        ...

    def hidden_states(self, fb: ForwardBatch) -> torch.Tensor:
        """After :meth:`replay`: the final hidden states ``[T, H]`` of the step's tokens."""
        ...


@dataclass(frozen=True)
class GraphSettings:
    """Which graphs to capture; zeros capture nothing (every step on a CPU, or with ``--disable-cuda-graph``)."""

    decode_max_bs: int = 0  # decode graphs up to this batch size (chapter 08)
    extend_max_tokens: int = 0  # extend graphs up to this many tokens (chapter 11)
    extend_budget_tokens: int = 0  # and one for a step of exactly this many (a full prefill budget)

    @classmethod
    def of(cls, config: EngineConfig, device: torch.device) -> GraphSettings:
        """The engine's flags: graphs on CUDA unless disabled, decode up to ``--cuda-graph-max-bs`` (default: the
        running requests, at most 256)."""
        if config.disable_cuda_graph or device.type != "cuda":
            return cls()
        return cls(decode_max_bs=config.cuda_graph_max_bs or min(config.max_running_requests, 256),
                   extend_max_tokens=config.cuda_graph_max_extend_tokens,
                   extend_budget_tokens=0 if config.disable_budget_step_graph else config.max_prefill_tokens)


def capture_graphs(model: nn.Module, planner: AttentionPlanner, device: torch.device, settings: GraphSettings,
                   extend_token_multiple: int) -> list[GraphRunner]:
    """Capture every graph ``settings`` asks for: decode graphs for each of the planner's decode backends that
    has the graph hooks (skipped with a log line otherwise), then extend graphs when the backend of extend steps
    has the extend-graph hooks and extend steps are padded (``extend_token_multiple > 1``)."""
    runners: list[GraphRunner] = []
    if settings.decode_max_bs:
        if device.type != "cuda":
            logger.info("CUDA graphs need a CUDA device; running %s eagerly", device)
            return runners
        for backend in planner.decode_backends:
            if backend.supports_cuda_graph:
                runners.append(CudaGraphRunner(model, backend, device, settings.decode_max_bs))
            else:
                logger.info("attention backend %s has no CUDA-graph hooks; its decode steps run eagerly",
                            type(backend).__name__)
    multiple = extend_token_multiple
    if device.type != "cuda" or not settings.extend_max_tokens >= multiple > 1:
        return runners
    extend = planner.backend.phase_backend(decode=False)  # a hybrid backend's extend half
    if extend.supports_extend_graph:
        runners.append(ExtendGraphRunner(model, extend, planner.backend, device, max_tokens=settings.extend_max_tokens,
                                         multiple=multiple, budget_tokens=settings.extend_budget_tokens))
    return runners
