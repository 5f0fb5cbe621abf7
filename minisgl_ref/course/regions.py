"""Task regions: finding the marked parts of the engine, blanking them, and checking that blanking is possible.

A task's code sits inside one function body, after its docstring, between a comment line
``# BEGIN TASK 4.3: locking and LRU eviction`` and a comment line ``# END TASK 4.3`` indented like the body's
statements.

A student copy replaces the lines strictly between the markers by one ``raise NotImplementedError("Task 4.3:
...")`` at the marker's indentation. That is only valid Python if the region is a run of whole statements of one
function body, so :func:`problems` checks exactly that (with :mod:`ast`) for every region, and a task may have
several regions when its heart is spread over a few methods.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

BEGIN = re.compile(r"^(?P<indent>[ \t]*)# BEGIN TASK (?P<id>\d+\.\d+)\s*:\s*(?P<title>.*?)\s*$")
END = re.compile(r"^(?P<indent>[ \t]*)# END TASK (?P<id>\d+\.\d+)\s*$")
PACKAGE = "minisgl_ref"


def task_key(task_id: str) -> tuple[int, int]:
    """Sort key of a task id: ``"10.2"`` comes after ``"9.1"``."""
    chapter, n = task_id.split(".")
    return int(chapter), int(n)


def chapter_of(task_id: str) -> int:
    return task_key(task_id)[0]


@dataclass(frozen=True)
class Region:
    """One ``BEGIN``/``END`` pair: lines ``begin`` and ``end`` (0-based, the marker lines) of ``path``."""

    task: str
    title: str
    path: str  # relative to the repository root, with forward slashes
    begin: int
    end: int
    indent: str

    @property
    def where(self) -> str:
        return f"{self.path}:{self.begin + 1}-{self.end + 1}"

    def body(self, lines: list[str]) -> list[str]:
        """The reference lines between the markers."""
        return lines[self.begin + 1 : self.end]

    def stub(self) -> str:
        title = self.title.replace("\\", "\\\\").replace('"', '\\"')
        return f'{self.indent}raise NotImplementedError("Task {self.task}: {title}")'


class RegionError(ValueError):
    """Markers that cannot be paired (a BEGIN without its END, nested regions, a mismatched indentation)."""


def scan_text(text: str, path: str) -> list[Region]:
    """Every region of one file, in order; raises :class:`RegionError` on markers that do not pair up."""
    regions: list[Region] = []
    open_: tuple[int, re.Match[str]] | None = None
    for i, line in enumerate(text.splitlines()):
        if m := BEGIN.match(line):
            if open_ is not None:
                raise RegionError(f"{path}:{i + 1}: BEGIN TASK {m['id']} inside task {open_[1]['id']}'s region")
            open_ = (i, m)
        elif m := END.match(line):
            if open_ is None or open_[1]["id"] != m["id"]:
                raise RegionError(f"{path}:{i + 1}: END TASK {m['id']} without its BEGIN")
            start, b = open_
            if m["indent"] != b["indent"]:
                raise RegionError(f"{path}:{i + 1}: END TASK {m['id']} is not indented like its BEGIN")
            regions.append(Region(b["id"], b["title"], path, start, i, b["indent"]))
            open_ = None
    if open_ is not None:
        raise RegionError(f"{path}:{open_[0] + 1}: BEGIN TASK {open_[1]['id']} without its END")
    return regions


def package_files(root: Path) -> Iterator[Path]:
    yield from sorted((root / PACKAGE).rglob("*.py"))


def scan(root: Path) -> list[Region]:
    """Every region of the package under ``root`` (a repository checkout), sorted by task then place."""
    regions = []
    for path in package_files(root):
        text = path.read_text(encoding="utf-8")
        if "TASK" in text:
            regions += scan_text(text, path.relative_to(root).as_posix())
    return sorted(regions, key=lambda r: (task_key(r.task), r.path, r.begin))


def tasks_of(regions: Iterable[Region]) -> dict[str, str]:
    """task id -> title, in task order."""
    titles: dict[str, str] = {}
    for r in sorted(regions, key=lambda r: task_key(r.task)):
        titles.setdefault(r.task, r.title)
    return titles


def blank_text(text: str, regions: Iterable[Region]) -> str:
    """``text`` with the body of each region replaced by its ``raise NotImplementedError`` line."""
    lines = text.splitlines()
    for r in sorted(regions, key=lambda r: r.begin, reverse=True):
        lines[r.begin + 1 : r.end] = [r.stub()]
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")


def fill_text(text: str, regions: Iterable[Region], bodies: dict[tuple[str, int], list[str]]) -> str:
    """``text`` with each region's body replaced by ``bodies[(task, k)]`` (``k``: the region's rank among that
    task's regions in this file): how solutions are pasted back into a student's file."""
    lines = text.splitlines()
    ranked = sorted(regions, key=lambda r: r.begin)
    rank: dict[Region, int] = {}
    seen: dict[str, int] = {}
    for r in ranked:
        rank[r] = seen.get(r.task, 0)
        seen[r.task] = rank[r] + 1
    for r in reversed(ranked):
        key = (r.task, rank[r])
        if key in bodies:
            lines[r.begin + 1 : r.end] = bodies[key]
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")


def bodies_by_file(text: str, regions: Iterable[Region]) -> dict[tuple[str, int], list[str]]:
    """(task, rank within this file) -> reference body lines; the inverse of :func:`fill_text`."""
    lines = text.splitlines()
    out: dict[tuple[str, int], list[str]] = {}
    seen: dict[str, int] = {}
    for r in sorted(regions, key=lambda r: r.begin):
        k = seen.get(r.task, 0)
        seen[r.task] = k + 1
        out[(r.task, k)] = r.body(lines)
    return out


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def region_problems(text: str, regions: list[Region]) -> list[str]:
    """Why each region of one file could not be blanked by the rule, or ``[]``.

    A region must sit inside one function body, after the docstring, with its markers at the indentation of the
    body's statements; its lines must be whole statements of that body (no ``def`` wrapped, no statement cut in
    two); and the function must have a docstring (the student's only instructions)."""
    out: list[str] = []
    tree = ast.parse(text)
    for r in regions:
        first, last = r.begin + 2, r.end  # 1-based line numbers of the body's first and last lines
        owner = None
        for fn in _functions(tree):
            if fn.lineno < first and (fn.end_lineno or 0) >= last and (owner is None or fn.lineno > owner.lineno):
                owner = fn
        if owner is None:
            out.append(f"{r.where}: task {r.task}'s region is not inside a function")
            continue
        if ast.get_docstring(owner) is None:
            out.append(f"{r.where}: {owner.name}() holds task {r.task} but has no docstring")
        inner = [n for n in _functions(owner) if n is not owner and first <= n.lineno <= last]
        if inner:
            out.append(f"{r.where}: task {r.task}'s region wraps def {inner[0].name}; mark the body instead")
        blanked = blank_text(text, [r])
        try:
            ast.parse(blanked)
        except SyntaxError as e:
            out.append(f"{r.where}: blanking task {r.task} breaks the file ({e.msg}, line {e.lineno})")
    return out


def problems(root: Path, regions: list[Region] | None = None) -> list[str]:
    """Every reason the package under ``root`` could not be turned into a student copy, or ``[]``."""
    out: list[str] = []
    try:
        regions = scan(root) if regions is None else regions
    except RegionError as e:
        return [str(e)]
    by_path: dict[str, list[Region]] = {}
    for r in regions:
        by_path.setdefault(r.path, []).append(r)
    titles: dict[str, str] = {}
    for r in regions:
        if titles.setdefault(r.task, r.title) != r.title:
            out.append(f"{r.where}: task {r.task}'s regions have different titles")
    for path, rs in by_path.items():
        text = (root / path).read_text(encoding="utf-8")
        out += region_problems(text, rs)
        try:
            ast.parse(blank_text(text, rs))
        except SyntaxError as e:
            out.append(f"{path}: blanking every task of the file breaks it ({e.msg}, line {e.lineno})")
    return out
