"""Tensor-parallel process state and collectives (chapter 09; at tp=1 every helper here is a no-op).

``parallel_state`` holds this process's rank and the collectives the layers call; ``group`` starts and stops the
``torch.distributed`` process group. The lock-step engine and rank launching sit above the engine, in
``minisgl_ref.tp``.
"""

from minisgl_ref.distributed.parallel_state import (
    TPInfo,
    all_gather_last_dim,
    all_reduce,
    broadcast_tensor,
    get_tp_info,
    set_tp_info,
)

__all__ = [
    "TPInfo", "all_gather_last_dim", "all_reduce", "broadcast_tensor", "get_tp_info", "set_tp_info",
]
