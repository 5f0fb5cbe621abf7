"""Who am I in the tensor-parallel group, and how do I talk to the others? (Chapters 01 and 09.)

Every parallel layer asks :func:`get_tp_info` for its rank and the group size when it is built, so the same model
code serves one process or many. At ``size == 1`` every collective below returns its input untouched and never
touches ``torch.distributed``, which is why chapter 01 can ignore this module and why the single-GPU engine pays
nothing for it.

The collectives are the only places where ranks talk during a forward pass:

* :func:`all_reduce` sums the partial outputs of row-parallel layers (twice per decoder layer) and of the
  vocabulary-parallel embedding (once per step);
* :func:`all_gather_last_dim` concatenates the vocabulary slices of the logits (once per step).

Chapter 09 counts their bytes by installing a :class:`CommCounter` with :func:`count_communication`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

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


# ------------------------------------------------------------------------------------- counting (chapter 09)


@dataclass
class CommCounter:
    """Bytes each rank *contributes* to each kind of collective, and the wall time spent inside them.

    For an all-reduce that is the size of the tensor being summed; for an all-gather, the size of this rank's
    slice. (How many bytes actually cross the wire depends on the algorithm: a ring all-reduce of ``n`` bytes
    over ``p`` ranks sends ``2 n (p - 1) / p`` from every rank.)
    """

    calls: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def record(self, kind: str, tensor: torch.Tensor, seconds: float) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + tensor.numel() * tensor.element_size()
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds


_COUNTER: CommCounter | None = None


@contextmanager
def count_communication(sync: bool = True) -> Iterator[CommCounter]:
    """Count (and time) every collective issued inside the ``with`` block. ``sync`` waits for the device
    before and after each collective so the time is the collective's own (only for measuring: it serialises)."""
    global _COUNTER
    counter, previous = CommCounter(), _COUNTER
    _COUNTER = counter
    _SYNC[0] = sync
    try:
        yield counter
    finally:
        _COUNTER = previous


_SYNC = [True]


def _sync(x: torch.Tensor) -> None:
    if _SYNC[0] and x.is_cuda:
        torch.cuda.synchronize(x.device)


# ------------------------------------------------------------------------------------------------ collectives


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel group, in place. Row-parallel layers need this after their matmul."""
    if _TP_INFO.size == 1:
        return x
    if _COUNTER is None:
        dist.all_reduce(x)
        return x
    _sync(x)
    t0 = time.perf_counter()
    dist.all_reduce(x)
    _sync(x)
    _COUNTER.record("all_reduce", x, time.perf_counter() - t0)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's slice of the last dimension (the vocab-parallel LM head needs the full vocabulary)."""
    if _TP_INFO.size == 1:
        return x
    x = x.contiguous()
    t0 = time.perf_counter()
    if _COUNTER is not None:
        _sync(x)
    # all_gather_into_tensor stacks the slices along dim 0: [size * rows, cols]; move the rank axis last.
    out = torch.empty((_TP_INFO.size, *x.shape), dtype=x.dtype, device=x.device)
    if x.is_cuda:
        dist.all_gather_into_tensor(out, x)
    else:  # gloo has no all_gather_into_tensor
        dist.all_gather(list(out.unbind(0)), x)
    if _COUNTER is not None:
        _sync(x)
        _COUNTER.record("all_gather", x, time.perf_counter() - t0)
    return out.movedim(0, -2).reshape(*x.shape[:-1], _TP_INFO.size * x.shape[-1])


def broadcast_tensor(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrite ``x`` on every rank with rank ``src``'s copy (the engine uses it for the sampled tokens)."""
    if _TP_INFO.size == 1:
        return x
    if _COUNTER is None:
        dist.broadcast(x, src)
        return x
    _sync(x)
    t0 = time.perf_counter()
    dist.broadcast(x, src)
    _sync(x)
    _COUNTER.record("broadcast", x, time.perf_counter() - t0)
    return x
