"""Run a function on every rank of a fresh tensor-parallel group (chapter 09's experiments and the tests).

``run_on_ranks(fn, tp_size, *args)`` spawns ``tp_size`` processes (the *spawn* start method: a fresh interpreter,
safe with CUDA), makes each one rank of a new process group (gloo on CPU, NCCL on GPUs, ``cuda:{rank}`` each),
calls ``fn(*args)`` in each, and returns every rank's result, rank 0 first. It is the smallest way to ask
"what does rank r compute?", e.g. the logits of a sharded model, or the bytes its collectives move.
``fn`` must be importable by name (defined at module level), and its result picklable.
"""

from __future__ import annotations

import io
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import torch

from minisgl_ref import env
from minisgl_ref.distributed.group import (
    DistConfig,
    destroy_distributed,
    exit_with_parent,
    init_distributed,
    rank_device,
)


@contextmanager
def main_not_reimported() -> Iterator[None]:
    """Start spawned processes without re-running the parent's ``__main__`` script in them.

    The *spawn* start method normally re-imports the script that started the parent (``python my_script.py``),
    which is why multiprocessing code must hide behind ``if __name__ == "__main__":``. Our ranks need nothing
    from that script (their entry points live in this package), so while they start we hide the script's path
    from multiprocessing: ``LLM(tp_size=2)`` then works in a plain script, and a chapter run as a script does not
    re-run itself in every rank.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    hide = main is not None and path is not None and getattr(main, "__spec__", None) is None
    if hide:
        del main.__file__  # type: ignore[union-attr]
    try:
        yield
    finally:
        if hide:
            main.__file__ = path  # type: ignore[union-attr]


def _rank_main(rank: int, cfg: DistConfig, device: str, threads: int, fn: Callable[..., Any], args: tuple,
               queue: Any) -> None:
    exit_with_parent()
    try:
        torch.set_num_threads(threads)
        cfg = cfg.with_rank(rank)
        dev = rank_device(cfg, device)
        init_distributed(cfg, dev)
        result = fn(*args)
        # As bytes: a tensor put on a torch.multiprocessing queue travels as a shared-memory handle that dies
        # with this process, which may exit before the parent reads it.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException as e:  # noqa: BLE001 - sent to the parent, which raises it
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        destroy_distributed()


def run_on_ranks(fn: Callable[..., Any], tp_size: int, *args: Any, device: str = "cpu",
                 threads: int | None = None, timeout_s: float = 600.0, ep_size: int = 1) -> list[Any]:
    """``[fn(*args) on rank 0, ..., on rank tp_size - 1]``, each computed in its own process of one group
    (``ep_size``: ``tp_size`` to split MoE layers' experts over the ranks too, chapter 14)."""
    import torch.multiprocessing as mp

    if threads is None:
        threads = env.cpu_threads(ranks=tp_size)
    cfg = DistConfig(tp_size=tp_size, ep_size=ep_size).with_free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank_main, args=(r, cfg, device, threads, fn, args, queue), daemon=True)
             for r in range(tp_size)]
    with main_not_reimported():
        for p in procs:
            p.start()
    results: dict[int, Any] = {}
    try:
        import time

        deadline = time.monotonic() + timeout_s
        while len(results) < tp_size:
            if not queue.empty():
                rank, status, value = queue.get()
                if status == "error":
                    raise RuntimeError(f"rank {rank} failed: {value}")
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
                continue
            if any(p.exitcode not in (None, 0) for p in procs):
                dead = [p.exitcode for p in procs]
                raise RuntimeError(f"a rank died (exit codes {dead})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks did not finish in {timeout_s} s")
            time.sleep(0.02)
    finally:
        for p in procs:
            p.join(10.0 if not results or len(results) == tp_size else 0.1)
            if p.is_alive():
                p.terminate()
                p.join(5.0)
    return [results[r] for r in range(tp_size)]


def call_each(calls: list[tuple[Callable[..., Any], tuple]]) -> list[Any]:
    """``[fn(*args) for fn, args in calls]``: several experiments in one start of the ranks
    (``run_on_ranks(call_each, 2, [(f, (...)), (g, (...))])``), since starting processes is the slow part."""
    return [fn(*args) for fn, args in calls]

