"""Starting and stopping the tensor-parallel process group with ``torch.distributed`` (chapter 09).

One process per rank. Every process calls :func:`init_distributed` with its rank; they meet at a rendezvous
address (``--dist-init-addr host:port``, rank 0's machine) and from then on talk through two groups:

* the **device group** (NCCL on GPUs, gloo on CPUs) carries the model's collectives: the all-reduces of the
  row-parallel layers and the all-gather of the logits;
* the **control group** (always gloo, on the CPU) carries Python objects: rank 0's new requests and aborts,
  broadcast at the top of every step. Keeping those off NCCL means a follower waiting for the next step blocks in
  a CPU socket read instead of occupying the GPU stream, and it can wait for a long time (an idle server) without
  tripping NCCL's watchdog.

Ranks are numbered node by node: with ``tp_size = 8`` over ``nnodes = 2``, node 0 holds ranks 0-3 and node 1
ranks 4-7, and each process uses GPU ``cuda:{rank % ranks_per_node}`` of its node (SGLang's flags and layout).
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from minisgl_ref.core.config import TPArgs, check_ep_size
from minisgl_ref.distributed.parallel_state import get_tp_info, set_tp_info

#: The control group waits as long as a server may sit idle: a follower blocks in it between requests.
CONTROL_TIMEOUT = datetime.timedelta(days=30)


@dataclass(frozen=True)
class DistConfig:
    """Where this process sits: its tensor-parallel rank, the group size and how the nodes find each other."""

    tp_size: int = 1
    tp_rank: int = 0
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # "host:port" of the rendezvous (rank 0's node); None: a free local port
    ep_size: int = 1  # MoE layers split their experts into this many groups of ranks: divides tp_size (chapter 14)

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.nnodes < 1:
            raise ValueError(f"nnodes must be >= 1, got {self.nnodes}")
        if self.tp_size % self.nnodes:
            raise ValueError(f"tp_size ({self.tp_size}) must be a multiple of nnodes ({self.nnodes})")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, {self.tp_size}), got {self.tp_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("dist_init_addr (host:port of node 0) is required when nnodes > 1")
        if self.dist_init_addr is not None:
            parse_addr(self.dist_init_addr)
        check_ep_size(self.ep_size, self.tp_size)

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def local_rank(self) -> int:
        return self.tp_rank % self.ranks_per_node

    def node_ranks(self) -> range:
        """The tensor-parallel ranks that run on this node."""
        return range(self.node_rank * self.ranks_per_node, (self.node_rank + 1) * self.ranks_per_node)

    @classmethod
    def of(cls, tp: TPArgs, tp_rank: int = 0) -> DistConfig:
        """Rank ``tp_rank`` of the group the ``--tp-size``/``--nnodes``/... flags describe (checks them)."""
        return cls(tp.tp_size, tp_rank, tp.nnodes, tp.node_rank, tp.dist_init_addr, tp.ep_size)

    def with_rank(self, tp_rank: int) -> DistConfig:
        return replace(self, tp_rank=tp_rank)

    def with_free_port(self) -> DistConfig:
        """This config with a rendezvous on a free local port, if none was given (single node only)."""
        if self.dist_init_addr is not None:
            return self
        return replace(self, dist_init_addr=f"127.0.0.1:{free_port()}")


def parse_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"dist_init_addr must be host:port, got {addr!r}")
    return host.strip("[]"), int(port)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(cfg: DistConfig, device: str | torch.device | None) -> torch.device:
    """One GPU per rank: ``cuda`` becomes ``cuda:{local_rank}``; CPU ranks all share the CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and cfg.tp_size > 1:
        return torch.device("cuda", cfg.local_rank)
    return device


_CONTROL_GROUP: Any = None


def init_distributed(cfg: DistConfig, device: torch.device) -> None:
    """Join the process group (blocks until every rank has joined) and record the rank for the layers.

    At ``tp_size == 1`` nothing is started: the layers see a group of one and skip every collective.
    """
    global _CONTROL_GROUP
    set_tp_info(cfg.tp_rank, cfg.tp_size, cfg.ep_size)
    if cfg.tp_size == 1:
        return
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group already exists in this process; "
                           "shut the previous tensor-parallel LLM down first")
    assert cfg.dist_init_addr is not None
    host, port = parse_addr(cfg.dist_init_addr)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend=backend, init_method=f"tcp://{host}:{port}", world_size=cfg.tp_size, rank=cfg.tp_rank,
        timeout=CONTROL_TIMEOUT if backend == "gloo" else None,
        **({"device_id": device} if backend == "nccl" else {}),
    )
    _CONTROL_GROUP = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT) if backend == "nccl" else None


def destroy_distributed() -> None:
    """Leave the process group (every rank should call it) and go back to a group of one."""
    global _CONTROL_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _CONTROL_GROUP = None
    set_tp_info(0, 1)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s Python object, on every rank (pickled, sent over the CPU control group).

    Two messages: the length, then the bytes, so a follower learns how much to receive. An empty message
    (``obj is None``) costs only the length.
    """
    if get_tp_info().size == 1:
        return obj
    group = _CONTROL_GROUP
    rank = dist.get_rank()
    if rank == src:
        payload = b"" if obj is None else pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        length = torch.tensor([len(payload)], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(length, src, group=group)
    n = int(length.item())
    if n == 0:
        return None
    buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if rank == src else torch.empty(n, dtype=torch.uint8)
    dist.broadcast(buf, src, group=group)
    return obj if rank == src else pickle.loads(buf.numpy().tobytes())


def _default_store() -> Any:
    """The key-value store the ranks met through (hosted by rank 0's process), or None outside a group."""
    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError):
        return None


def _failure_key(rank: int) -> str:
    return f"minisgl/failed/{rank}"


def report_failure(error: BaseException) -> None:
    """On a rank whose work failed: leave the reason in the group's store, where rank 0 looks when its next
    collective fails (:func:`peer_failures`). Call it *before* leaving the group.

    Without it, rank 0 only learns that a peer's socket closed ("connection closed by peer") and the reason is
    buried in another process's stderr. The store is the one channel that survives a dead peer: rank 0's process
    hosts it, and a set is acknowledged before this rank goes on to exit, so by the time rank 0's collective
    fails, the reason is there. Best effort: it never raises."""
    store = _default_store()
    if store is None:
        return
    try:
        store.set(_failure_key(dist.get_rank()), f"{type(error).__name__}: {error}")
    except Exception:  # noqa: BLE001 - the group may be half torn down already
        pass


def peer_failures() -> list[str]:
    """What other ranks reported with :func:`report_failure`, as ``"rank r: Type: message"`` (empty if none)."""
    store = _default_store()
    if store is None:
        return []
    out = []
    try:
        for rank in range(dist.get_world_size()):
            key = _failure_key(rank)
            if rank != dist.get_rank() and store.check([key]):
                out.append(f"rank {rank}: {store.get(key).decode(errors='replace')}")
    except Exception:  # noqa: BLE001 - asked while failing: never hide the original error behind this one
        pass
    return out


def exit_with_parent() -> None:
    """Make a spawned rank exit when the process that started it dies. A rank blocked in a collective would
    otherwise wait forever, holding its GPU memory, after its launcher was killed (e.g. by a time limit)."""
    import threading
    import time

    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def min_over_ranks(value: int) -> int:
    """The smallest of every rank's ``value`` (used so that every rank sizes its KV pool alike)."""
    if get_tp_info().size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_CONTROL_GROUP)
    return int(t.item())
