"""The course kit: task regions, student copies, the grader and its mutants (``python -m minisgl_ref.course``).

The heart of each chapter's algorithm sits between a ``# BEGIN TASK c.n: title`` line and a ``# END TASK c.n``
line inside a function of the engine, and the tests that grade it carry ``@pytest.mark.task("c.n")``. The
subcommands (see :mod:`minisgl_ref.course.__main__`) make a student copy with those regions blanked, grade a copy
with points from ``tasks.toml``, paste solutions back, and check that the tests catch known wrong answers.
Each chapter prints its tasks with :func:`task_source`, so the page shows exactly the code a student rewrites.
"""

from __future__ import annotations

import inspect
from typing import Any

from minisgl_ref.course.regions import scan_text


def task_source(obj: Any, task_id: str) -> str:
    """The regions of task ``task_id`` in ``obj``'s module, markers included, each dedented; several regions of
    one task (a task spread over a few methods) are shown one after the other, separated by a blank line."""
    module = inspect.getmodule(obj)
    text = inspect.getsource(module)
    lines = text.splitlines()
    regions = [r for r in scan_text(text, getattr(module, "__file__", "?")) if r.task == task_id]
    if not regions:
        raise LookupError(f"no region of task {task_id} in {module.__name__}")
    parts = []
    for r in regions:
        body = lines[r.begin : r.end + 1]
        indent = min(len(line) - len(line.lstrip()) for line in body if line.strip())
        parts.append("\n".join(line[indent:] for line in body))
    return "\n\n".join(parts)


__all__ = ["task_source"]
