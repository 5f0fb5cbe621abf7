"""Course tasks: the marked regions of the engine that a course asks its students to write (every chapter).

The heart of each chapter's algorithm sits between a ``# BEGIN TASK c.n: title`` line and a ``# END TASK c.n``
line in the module that implements it, and the tests that grade it carry ``@pytest.mark.task("c.n")``. Each
chapter prints its tasks with :func:`task_source`, so the page shows exactly the code that a student rewrites.
"""

from __future__ import annotations

import inspect
import re
from typing import Any


def task_source(obj: Any, task_id: str) -> str:
    """The lines of ``obj``'s module between ``# BEGIN TASK <id>`` and ``# END TASK <id>``, markers included,
    dedented. The whole module is searched because a region may start just outside a function."""
    lines = inspect.getsource(inspect.getmodule(obj)).splitlines()

    def find(kind: str) -> int:
        pattern = re.compile(rf"# {kind} TASK {re.escape(task_id)}\b")
        return next(i for i, line in enumerate(lines) if pattern.search(line))

    body = lines[find("BEGIN") : find("END") + 1]
    indent = min(len(line) - len(line.lstrip()) for line in body if line.strip())
    return "\n".join(line[indent:] for line in body)
