"""The course kit: task regions, student copies, the grader and its mutants (``python -m minisgl_ref.course``).

The heart of each chapter's algorithm sits between a ``# BEGIN TASK c.n: title`` line and a ``# END TASK c.n``
line inside a function of the engine, and the tests that grade it carry ``@pytest.mark.task("c.n")``. The
subcommands (see :mod:`minisgl_ref.course.__main__`) make a student copy with those regions blanked, grade a copy
with points from ``tasks.toml``, paste solutions back, and check that the tests catch known wrong answers.
Each chapter prints its tasks with :func:`task_source`, so the page shows exactly the code a student rewrites.
"""

from __future__ import annotations

import ast
import inspect
from typing import Any

from minisgl_ref.course.regions import scan_text


def task_source(obj: Any, task_id: str) -> str:
    """The regions of task ``task_id`` in ``obj``'s module as a reader should see them: each region under the
    signature of the function that holds it, with ``...`` standing for the docstring and any code around it,
    dedented. Several regions of one task (a task spread over a few methods) follow one another."""
    module = inspect.getmodule(obj)
    text = inspect.getsource(module)
    lines = text.splitlines()
    regions = [r for r in scan_text(text, getattr(module, "__file__", "?")) if r.task == task_id]
    if not regions:
        raise LookupError(f"no region of task {task_id} in {module.__name__}")
    functions = [n for n in ast.walk(ast.parse(text)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    parts = []
    for r in regions:
        owner = max((f for f in functions if f.lineno <= r.begin and (f.end_lineno or 0) >= r.end),
                    key=lambda f: f.lineno, default=None)
        shown: list[str] = []
        if owner is not None:
            first_body = owner.body[0].lineno - 1  # 0-based index of the docstring (or first statement)
            shown += lines[owner.lineno - 1 : first_body]
            if any(line.strip() for line in lines[first_body : r.begin]):
                shown.append(r.indent + "...")
        shown += lines[r.begin : r.end + 1]
        if owner is not None and any(line.strip() for line in lines[r.end + 1 : owner.end_lineno]):
            shown.append(r.indent + "...")
        indent = min(len(line) - len(line.lstrip()) for line in shown if line.strip())
        parts.append("\n".join(line[indent:] for line in shown))
    return "\n\n".join(parts)


__all__ = ["task_source"]
