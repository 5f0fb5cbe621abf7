"""Which attention backend runs each step, and so which captured graphs may replay it (chapters 07, 08 and 11).

The engine builds one attention backend (chapter 07: ``--attention-backend`` and the device's defaults), and most
engines run every step on it. An extension may add decode backends that pay only on some batches (chapter 11's
cascade attention, for decode batches whose rows share a cached prefix). So the model runner asks an *attention
planner*, at every step, which backend the step uses:

* :attr:`AttentionPlanner.decode_backends` lists every backend a decode step may be given; the model runner
  captures one set of decode CUDA graphs per backend that supports graphs (chapter 08);
* :meth:`AttentionPlanner.plan` sees each step before it runs and may point ``fb.attn_backend`` at one of them.

A captured graph replays a step only if the step's backend is the one the graph was captured with
(:meth:`~minisgl_ref.engine.cuda_graph.CudaGraphRunner.can_run`), so choosing the backend also chooses the
graphs. The planner here runs every step on the engine's backend. The engine builds its planner with a
:data:`PlannerFactory` it is given (chapter 11's is :func:`minisgl_ref.perf.attention.attention_planner`, which
``build_runtime`` passes); without one it builds this default, and the core never imports the extensions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minisgl_ref.attention.base import AttentionBackend
    from minisgl_ref.core.batch import ScheduledBatch
    from minisgl_ref.core.config import EngineConfig
    from minisgl_ref.core.forward_batch import ForwardBatch
    from minisgl_ref.kvcache.pool import KVPool
    from minisgl_ref.kvcache.req_to_token import ReqToTokenPool


@dataclass(frozen=True)
class AttentionSetup:
    """What a planner factory may build on: the engine's settings, its KV memory and its attention backend."""

    config: EngineConfig
    kv_pool: KVPool
    req_to_token: ReqToTokenPool
    backend: AttentionBackend  # the engine's backend (chapter 07), maybe a hybrid of two
    num_q_heads: int  # query heads per rank


class AttentionPlanner:
    """Runs every step on the engine's attention backend (``backend``)."""

    def __init__(self, backend: AttentionBackend) -> None:
        self.backend = backend

    @property
    def decode_backends(self) -> tuple[AttentionBackend, ...]:
        """Every backend a decode step may run on, the engine's first: each gets its own decode graphs."""
        return (self.backend,)

    def plan(self, batch: ScheduledBatch, fb: ForwardBatch) -> None:
        """Choose the attention of one step (``batch``, prepared as ``fb``) before it runs. ``fb.attn_backend`` is
        the engine's backend until a planner points it at another of :attr:`decode_backends`."""


#: Builds the engine's planner once its backend exists (and before any graph is captured).
PlannerFactory = Callable[[AttentionSetup], AttentionPlanner]


def default_planner(setup: AttentionSetup) -> AttentionPlanner:
    """The core engine's planner: the engine's backend for every step."""
    return AttentionPlanner(setup.backend)
