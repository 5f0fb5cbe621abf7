"""What the chapters use to show things to a reader: source code as code, rows as tables, long text wrapped.

A chapter that ``print``-s a function's source gets a grey block of unhighlighted text, and one that prints a
list of 200 token ids gets a line a reader scrolls sideways to follow. These helpers return IPython display
objects instead: the notebook and the site render them as a highlighted code block or a table (the site's
chapter renderer, ``docs/hooks/chapters.py``, passes ``text/markdown`` outputs through as markdown). Text a
chapter still prints stays within :data:`OUTPUT_COLUMNS` columns, which the site's browser test checks.

Nothing in the engine imports this module; it needs IPython, which the notebook kernel brings.
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from minisgl_ref.env import chapter_threads

#: The widest printed output line a chapter shows (characters): it fits the site's content column at 1440 px
#: and a notebook at its default width without scrolling sideways.
OUTPUT_COLUMNS = 100


def setup_chapter() -> Path:
    """What a chapter's setup cell does first: one torch thread, and the repository root returned.

    One thread (``MINISGL_THREADS`` sets more): on a small shared CPU, two threads that wait for each other at
    every matmul make the step times a chapter prints erratic. The root is where a chapter finds its committed
    measurements (``docs/data/``): a notebook runs from ``notebooks/`` and a script from anywhere, so it is looked
    for from the working directory upwards, and else taken as the folder above this package."""
    import torch  # imported when called, so that the display helpers do not need it

    torch.set_num_threads(chapter_threads())
    here = Path.cwd().resolve()
    for folder in [here, *here.parents]:
        if (folder / "docs" / "data").is_dir() and (folder / "minisgl_ref").is_dir():
            return folder
    return Path(__file__).resolve().parents[1]


def _markdown(text: str) -> Any:
    from IPython.display import Markdown  # the notebook kernel's; imported here so the package does not need it

    return Markdown(text)


def _fence(code: str, lang: str) -> str:
    ticks = "````" if "```" in code else "```"
    return f"{ticks}{lang}\n{code.rstrip()}\n{ticks}"


def show_code(source: Any, task: str | None = None, *, lang: str = "python") -> Any:
    """A highlighted code block of ``source``: a string as given, else the source of the function or class
    (with ``task``, only the regions of that course task, as :func:`minisgl_ref.course.task_source` cuts them)."""
    if task is not None:
        from minisgl_ref.course import task_source

        text = task_source(source, task)
    elif isinstance(source, str):
        text = source
    else:
        text = textwrap.dedent(inspect.getsource(source))
    return _markdown(_fence(text, lang))


def _cell(value: Any) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def show_table(rows: Sequence[Mapping[str, Any]] | Sequence[Sequence[Any]],
               headers: Sequence[str] | None = None) -> Any:
    """A table of ``rows``: dicts (their keys are the headers, in first-seen order) or sequences with
    ``headers``. Floats show four significant digits; pass strings to format them otherwise."""
    if rows and isinstance(rows[0], Mapping):
        keys: list[str] = list(headers) if headers else []
        if not headers:
            for row in rows:
                keys += [k for k in row if k not in keys]
        body = [[row.get(k, "") for k in keys] for row in rows]  # type: ignore[union-attr]
    else:
        if headers is None:
            raise ValueError("show_table: rows that are sequences need headers")
        keys, body = list(headers), [list(r) for r in rows]  # type: ignore[arg-type]
    lines = ["| " + " | ".join(_cell(k) for k in keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in body]
    return _markdown("\n".join(lines))


def wrap(text: str, width: int = OUTPUT_COLUMNS, indent: str = "    ") -> str:
    """``text`` with every line longer than ``width`` broken at spaces (continuations indented by ``indent``);
    a run with no space to break at is cut and continued on the next line."""
    out: list[str] = []
    for line in text.splitlines():
        if len(line) <= width:
            out.append(line)
            continue
        out += textwrap.wrap(line, width=width, subsequent_indent=indent, break_long_words=True,
                             break_on_hyphens=False, drop_whitespace=True) or [""]
    return "\n".join(out)


def shorten(text: str, width: int = OUTPUT_COLUMNS, placeholder: str = " …") -> str:
    """``text`` on one line of at most ``width`` characters (a long repr, say), cut with ``placeholder``."""
    one_line = " ".join(text.split())
    return one_line if len(one_line) <= width else one_line[: width - len(placeholder)].rstrip() + placeholder


__all__ = ["OUTPUT_COLUMNS", "setup_chapter", "show_code", "show_table", "shorten", "wrap"]
