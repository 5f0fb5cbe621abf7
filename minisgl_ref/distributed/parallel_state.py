"""Who am I in the tensor-parallel group, and how do I talk to the others? (Chapters 01 and 09.)

Every parallel layer asks :func:`get_tp_info` for its rank and the group size when it is built, so the same model
code serves one process or many. At ``size == 1`` every collective below returns its input untouched and never
touches ``torch.distributed``, which is why chapter 01 can ignore this module and why the single-GPU engine pays
nothing for it.

The collectives are the only places where ranks talk during a forward pass:

* :func:`all_reduce` sums the partial outputs of row-parallel layers (twice per decoder layer) and of the
  vocabulary-parallel embedding (once per step);
* :func:`all_gather_last_dim` concatenates the vocabulary slices of the logits (once per step).

They call ``torch.distributed`` through this module's ``dist`` name and nothing else, so a measurement can count
and time every collective by standing in for ``dist`` while it runs (chapter 09's ``benchmarks/tp.py``), and the
collectives themselves carry no measuring code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1
    #: Into how many groups of ranks MoE layers split their experts (chapter 14): a divisor of ``size``; each group
    #: slices its experts over its ``size / ep_size`` ranks. The dense layers never read it; it rides here because
    #: it is decided with the group and read while building the model.
    ep_size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tp rank {self.rank} is not in a group of size {self.size}")
        if self.ep_size < 1 or self.size % self.ep_size:
            raise ValueError(f"ep_size ({self.ep_size}) must divide tp_size ({self.size})")

    @property
    def moe_tp_size(self) -> int:
        """Over how many ranks each expert is sliced (SGLang's ``moe_tp_size``)."""
        return self.size // self.ep_size

    @property
    def ep_rank(self) -> int:
        """Which group of experts this rank holds (ranks ``[g * moe_tp, (g + 1) * moe_tp)`` hold group ``g``)."""
        return self.rank // self.moe_tp_size

    @property
    def moe_tp_rank(self) -> int:
        """Which slice of each of its experts this rank holds."""
        return self.rank % self.moe_tp_size


_TP_INFO = TPInfo()


def set_tp_info(rank: int, size: int, ep_size: int = 1) -> None:
    """Record this process's place in the tensor-parallel group (call before building the model)."""
    global _TP_INFO
    _TP_INFO = TPInfo(rank, size, ep_size)


def get_tp_info() -> TPInfo:
    return _TP_INFO


# ------------------------------------------------------------------------------------------------ collectives


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
    x = x.contiguous()
    # all_gather_into_tensor stacks the slices along dim 0: [size * rows, cols]; move the rank axis last.
    out = torch.empty((_TP_INFO.size, *x.shape), dtype=x.dtype, device=x.device)
    if x.is_cuda:
        dist.all_gather_into_tensor(out, x)
    else:  # gloo has no all_gather_into_tensor
        dist.all_gather(list(out.unbind(0)), x)
    return out.movedim(0, -2).reshape(*x.shape[:-1], _TP_INFO.size * x.shape[-1])


def broadcast_tensor(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrite ``x`` on every rank with rank ``src``'s copy (the engine uses it for the sampled tokens)."""
    if _TP_INFO.size == 1:
        return x
    dist.broadcast(x, src)
    return x
