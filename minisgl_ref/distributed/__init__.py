"""Tensor-parallel process state (chapter 09; at tp=1 every helper here is a no-op)."""

from minisgl_ref.distributed.parallel_state import (
    TPInfo,
    all_gather_last_dim,
    all_reduce,
    get_tp_info,
    set_tp_info,
)

__all__ = ["TPInfo", "all_gather_last_dim", "all_reduce", "get_tp_info", "set_tp_info"]
