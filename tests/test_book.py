"""``minisgl_ref.book``: what the chapters show code, tables and long text with.

The chapter pages render ``text/markdown`` outputs as markdown, so each helper is checked on the markdown it
returns: a fenced block that holds the code, a table with one row per input row, text within the width.
"""

from __future__ import annotations

import pytest

from minisgl_ref.book import OUTPUT_COLUMNS, show_code, show_table, shorten, wrap
from minisgl_ref.course import task_source


def _markdown(obj) -> str:  # type: ignore[no-untyped-def]
    """The markdown a notebook stores for ``obj`` (its ``text/markdown`` output, which the site renders)."""
    from IPython.core.formatters import DisplayFormatter

    data, _ = DisplayFormatter().format(obj)
    return data["text/markdown"]


def test_wrap_breaks_long_lines_at_spaces_and_keeps_short_ones() -> None:
    words = " ".join(f"word{i}" for i in range(60))
    text = f"short line\n{words}\nanother short one"
    out = wrap(text)
    lines = out.splitlines()
    assert lines[0] == "short line" and lines[-1] == "another short one"
    assert max(map(len, lines)) <= OUTPUT_COLUMNS
    assert all(line.startswith("    ") for line in lines[2:-1])  # continuations are indented
    assert " ".join(" ".join(lines[1:-1]).split()) == words  # nothing lost, nothing added


def test_wrap_cuts_a_run_without_spaces() -> None:
    out = wrap("x" * 250, width=100)
    assert [len(line) for line in out.splitlines()] == [100, 100, 58]  # 100, then 96 + 4 of indent, then 54 + 4
    assert out.replace("\n", "").replace(" ", "") == "x" * 250


def test_shorten_keeps_short_text_and_cuts_long_text_on_one_line() -> None:
    assert shorten("a  b\nc") == "a b c"
    long = repr(list(range(200)))
    cut = shorten(long, width=60)
    assert len(cut) <= 60 and cut.endswith(" …") and long.startswith(cut[:-2])


def test_show_table_from_dicts_uses_the_keys_in_first_seen_order() -> None:
    md = _markdown(show_table([{"stage": "naive", "tok/s": 163.04}, {"stage": "paged", "hit": "0%", "tok/s": 495.2}]))
    assert md.splitlines() == [
        "| stage | tok/s | hit |",
        "|---|---|---|",
        "| naive | 163 |  |",
        "| paged | 495.2 | 0% |",
    ]


def test_show_table_from_sequences_with_headers_escapes_pipes() -> None:
    md = _markdown(show_table([("a|b", 1), ("c", 2.5)], headers=["name", "n"]))
    assert md.splitlines() == ["| name | n |", "|---|---|", "| a\\|b | 1 |", "| c | 2.5 |"]


def test_show_table_of_sequences_needs_headers() -> None:
    with pytest.raises(ValueError, match="need headers"):
        show_table([(1, 2), (3, 4)])


def test_show_code_fences_a_string_an_object_and_a_task() -> None:
    assert _markdown(show_code("x = 1")) == "```python\nx = 1\n```"
    assert _markdown(show_code('s = """```"""')).startswith("````python\n")  # a fence the code cannot close

    md = _markdown(show_code(wrap))
    assert md.startswith("```python\ndef wrap(") and md.endswith("\n```")

    from minisgl_ref.core.request import Req

    md = _markdown(show_code(Req.append_token, task="0.2"))
    assert md == f"```python\n{task_source(Req.append_token, '0.2').rstrip()}\n```"
    assert md.startswith("```python\ndef append_token(self, token_id: int) -> str:\n    ...\n")  # signature, then the task
    assert "# BEGIN TASK 0.2" in md and "# END TASK 0.2" in md and "def _flush" not in md
