"""Small helpers every server process uses: logging, signals, noticing that the parent is gone (chapter 10)."""

from __future__ import annotations

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
