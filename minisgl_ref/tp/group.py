"""This process's place in a tensor-parallel group: take a rank, start the node's other ranks, join, leave
(chapter 09).

Starting a group has an order that matters. Every rank loads its shard of the weights first (in parallel, that is
the slow part) and only then joins the process group, which blocks until all ranks have joined. So a rank that
fails to load must say so *before* the rendezvous, or the others would wait there for ever. A rank that started
the node's other ranks (:meth:`TPGroup.launch`) therefore waits for each one's "loaded" (or error) message on a
pipe before it joins; a rank started that way sends that message (:meth:`TPGroup.join`). Ranks started by
someone else (the server starts one scheduler process per rank and watches them itself) just join.
"""

from __future__ import annotations

import faulthandler
import gc
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from minisgl_ref import env
from minisgl_ref.core.config import TPArgs
from minisgl_ref.distributed import set_tp_info
from minisgl_ref.distributed.group import DistConfig, destroy_distributed, init_distributed, rank_device
from minisgl_ref.tp.launch import main_not_reimported

log = logging.getLogger("minisgl_ref.tp")


class TPGroup:
    """One rank's membership: its :class:`DistConfig`, the ranks it started (to wait for and to stop) and, for a
    rank started that way, the pipe on which it tells its launcher that its weights are loaded."""

    def __init__(self, cfg: DistConfig, procs: list | None = None, conns: list | None = None,
                 announce: Any = None) -> None:
        self.cfg, self.procs, self.conns, self.announce = cfg, procs or [], conns or [], announce
        self.engine: Any = None  # the rank's TPEngine, once built: the leader stops its followers through it

    @classmethod
    def member(cls, tp: TPArgs, rank: int, announce: Any = None) -> TPGroup:
        """Rank ``rank`` of a group whose ranks someone else starts (``announce``: the launcher's pipe)."""
        return cls(DistConfig.of(tp, rank), announce=announce)

    @classmethod
    def launch(cls, tp: TPArgs, worker: Callable[..., None], payload: Any) -> TPGroup:
        """Take this node's first rank and start its other ranks, each running
        ``worker(rank, cfg, payload, announce_pipe)`` in a fresh process (the *spawn* start method)."""
        import torch.multiprocessing as mp

        cfg = DistConfig.of(tp, 0)
        if cfg.nnodes == 1:
            cfg = cfg.with_free_port()
        cfg = cfg.with_rank(cfg.node_ranks()[0])
        ctx = mp.get_context("spawn")
        group = cls(cfg)
        for rank in cfg.node_ranks()[1:]:
            receiver, sender = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=worker, args=(rank, cfg, payload, sender), daemon=True, name=f"minisgl-tp{rank}")
            with main_not_reimported():
                proc.start()
            sender.close()
            group.procs.append(proc)
            group.conns.append(receiver)
        return group

    @property
    def rank(self) -> int:
        return self.cfg.tp_rank

    def device(self, requested: str | None) -> torch.device:
        """This rank's device (``cuda:{local rank}``, or the shared CPU), made current; records the rank for the
        layers, which read it while the model is built."""
        device = rank_device(self.cfg, requested)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:  # ranks on one CPU share its cores
            torch.set_num_threads(env.cpu_threads(ranks=self.cfg.ranks_per_node))
        set_tp_info(self.cfg.tp_rank, self.cfg.tp_size, self.cfg.ep_size)
        return device

    def join(self, device: torch.device) -> None:
        """After loading: tell the launcher (or hear from the started ranks) that the weights are in, then join
        the process group."""
        if self.announce is not None:
            self.announce.send({"ok": self.rank})
            self.announce.close()
            self.announce = None
        self._wait_loaded()
        init_distributed(self.cfg, device)

    def _wait_loaded(self) -> None:
        pending = dict(zip(self.conns, self.procs))
        while pending:
            for conn, proc in list(pending.items()):
                if conn.poll(0.1):
                    try:
                        msg = conn.recv()
                    except EOFError:
                        msg = {"error": f"{proc.name} exited with code {proc.exitcode} while loading"}
                    if "error" in msg:
                        raise RuntimeError(f"a tensor-parallel rank failed to start: {msg['error']}")
                    del pending[conn]
                elif not proc.is_alive():
                    raise RuntimeError(f"{proc.name} exited with code {proc.exitcode} while loading")

    def report_failure(self, error: BaseException) -> None:
        """A started rank that could not load tells its launcher why (the launcher raises it)."""
        if self.announce is not None:
            try:
                self.announce.send({"error": f"rank {self.rank}: {type(error).__name__}: {error}"})
            except (OSError, ValueError):
                pass

    def leave(self) -> None:
        """Before a rank leaves its process group: drop every CUDA graph of the engine (their captured all-reduces
        use the NCCL communicator about to be destroyed, whose teardown waits until no graph holds it), wait for
        the device, then leave.

        ``MINISGL_SHUTDOWN_TRACE_S=N`` prints every thread's Python stack if teardown still runs N seconds later:
        how to find out where a rank hangs on a machine without a debugger."""
        if env.shutdown_trace_s() > 0:
            faulthandler.dump_traceback_later(env.shutdown_trace_s(), exit=False)
        if self.engine is not None:
            self.engine.runner.release_graphs()
            gc.collect()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        destroy_distributed()
        faulthandler.cancel_dump_traceback_later()

    def close(self) -> None:
        """The leader's shutdown: stop the followers, leave the group, then wait for the ranks it started.

        Leave the group *before* waiting for the followers to exit: NCCL's teardown waits for every rank of the
        communicator, so a leader that joined its followers first would wait on them while they wait in their
        own teardown for it (gloo's teardown is local, which is why CPU runs never show it)."""
        connected = dist.is_initialized()
        if self.engine is not None and self.engine.is_leader and connected:
            try:
                self.engine.stop_followers()
            except Exception as e:  # noqa: BLE001 - a follower already gone: its reason was raised by the step
                log.warning("could not tell the followers to stop: %s", e)
                connected = False
        self.leave()
        for proc in self.procs:
            proc.join(30.0 if connected else 0.0)
            if proc.is_alive():
                log.warning("%s did not exit; terminating it", proc.name)
                proc.terminate()
                proc.join(5.0)
        self.procs, self.engine = [], None
