"""Who am I in the tensor-parallel group? (Chapter 01 uses it at tp=1; chapter 09 makes it real.)

Every parallel layer asks :func:`get_tp_info` for its rank and the group size when it is built, so the same model
code serves one process or many. At ``size == 1`` the collectives below return their input untouched, which is
why chapter 01 can ignore them entirely.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tp rank {self.rank} is not in a group of size {self.size}")


_TP_INFO = TPInfo()


def set_tp_info(rank: int, size: int) -> None:
    """Record this process's place in the tensor-parallel group (call before building the model)."""
    global _TP_INFO
    _TP_INFO = TPInfo(rank, size)


def get_tp_info() -> TPInfo:
    return _TP_INFO


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel group, in place. Row-parallel layers need this after their matmul."""
    if _TP_INFO.size == 1:
        return x
    dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's slice of the last dimension (the vocab-parallel LM head needs the full vocabulary)."""
    if _TP_INFO.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_INFO.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
