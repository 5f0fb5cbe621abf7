"""Small helpers every server process uses: logging, signals, noticing that the parent is gone, keeping the
garbage collector out of the token stream (chapter 10)."""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
from typing import Any


def configure_logging(level: str, process_name: str) -> logging.Logger:
    logging.basicConfig(
        level=level.upper(),
        format=f"[%(asctime)s {process_name}] %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
    return logging.getLogger(f"minisgl_ref.{process_name}")


def child_process_setup(level: str, process_name: str) -> logging.Logger:
    """Children leave Ctrl-C to the parent: a terminal sends SIGINT to the whole process group, and the parent
    stops the children in order (a child that died first would look like a crash). SIGTERM keeps its default
    action, which is how the parent stops them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return configure_logging(level, process_name)


def freeze_startup_objects() -> None:
    """Exempt everything built at start-up from the garbage collector's full passes.

    CPython's cycle collector walks every tracked container object in a full (generation-2) pass, and a process
    that has imported torch and transformers and built a model holds a few hundred thousand of them. A full
    pass then stops the process for tens of milliseconds (~35 ms on an H100 host's core, ~160 ms on a small
    laptop-class one), and the collector starts one whenever enough new objects have piled up, every few seconds
    in a busy server. In the scheduler each pause lands between two steps: every running request sees one
    inter-token gap ten times longer than a step, which is what a P99 inter-token latency measures.
    ``gc.freeze()`` moves every object alive now into a permanent generation that the collector no longer scans,
    so full passes only walk what was created since (requests, their lists); reference counting still frees
    frozen objects as usual. Call it once, at the end of start-up."""
    gc.collect()
    gc.freeze()


class ParentWatch:
    """``alive()`` turns False once the process that started us has exited (we were re-parented), so an orphaned
    child stops instead of holding the model in memory forever when the parent was killed with SIGKILL."""

    def __init__(self) -> None:
        self.parent = os.getppid()

    def alive(self) -> bool:
        return os.getppid() == self.parent


def report_ready(conn: Any, payload: dict[str, Any], *, close: bool = True) -> None:
    """Tell the parent over the startup pipe that we are ready (``{"ok": info}``) or why not (``{"error": ...}``).
    ``close=False`` keeps the pipe for last words: why the process stopped later (see ``Launcher.dead_child``)."""
    try:
        conn.send(payload)
    finally:
        if close:
            conn.close()
