"""MkDocs hook: the table of course tasks, built from the code at every build.

A course task is a region of ``minisgl_ref`` between two comment lines::

    # BEGIN TASK 2.3: top-k / top-p / min-p filtering
    ...the reference solution...
    # END TASK 2.3

and the tests that grade it carry the same id: ``@pytest.mark.task("2.3")``. This hook scans both, pairs them
by id, and replaces the placeholder ``<!-- course:tasks -->`` on a page (``docs/course.md``) with a table. An id
found on one side only is shown with what is missing, so the table doubles as a checklist for authors.

A ``BEGIN`` without its ``END`` (or the reverse) would break the tool that makes the student copy, so it is
logged as a warning, which fails ``mkdocs build --strict``.
"""

from __future__ import annotations

import ast
import logging
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.course_tasks")

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = ROOT / "minisgl_ref"
TESTS_DIR = ROOT / "tests"
PLACEHOLDER = "<!-- course:tasks -->"

BEGIN = re.compile(r"^\s*# BEGIN TASK (?P<id>\d+\.\d+)\s*:\s*(?P<title>.*?)\s*$")
END = re.compile(r"^\s*# END TASK (?P<id>\d+\.\d+)\s*$")


@dataclass
class Task:
    id: str
    title: str = ""
    where: str = ""  # "minisgl_ref/x/y.py:12-30"
    problems: list[str] = field(default_factory=list)
    tests: dict[str, int] = field(default_factory=dict)  # test file -> number of test functions marked

    @property
    def sort_key(self) -> tuple[int, ...]:
        return tuple(int(part) for part in self.id.split("."))


def scan_markers(package_dir: Path = PACKAGE_DIR) -> dict[str, Task]:
    """Every ``BEGIN TASK``/``END TASK`` pair in the package, by task id."""
    tasks: dict[str, Task] = {}
    for path in sorted(package_dir.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        open_tasks: dict[str, int] = {}
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if m := BEGIN.match(line):
                task = tasks.setdefault(m["id"], Task(m["id"]))
                if task.where:
                    task.problems.append(f"second BEGIN in {rel}:{lineno}")
                task.title, task.where = m["title"], f"{rel}:{lineno}"
                open_tasks[m["id"]] = lineno
            elif m := END.match(line):
                start = open_tasks.pop(m["id"], None)
                if start is None:
                    tasks.setdefault(m["id"], Task(m["id"])).problems.append(f"END without BEGIN in {rel}:{lineno}")
                else:
                    tasks[m["id"]].where = f"{rel}:{start}-{lineno}"
        for task_id, lineno in open_tasks.items():
            tasks[task_id].problems.append(f"BEGIN without END in {rel}:{lineno}")
    return tasks


def _task_ids_in(node: ast.AST) -> set[str]:
    """Ids of every ``<anything>.mark.task("c.n")`` call inside ``node``."""
    ids = set()
    for sub in ast.walk(node):
        if (
            isinstance(sub, ast.Call)
            and isinstance(sub.func, ast.Attribute)
            and sub.func.attr == "task"
            and isinstance(sub.func.value, ast.Attribute)
            and sub.func.value.attr == "mark"
            and sub.args
            and isinstance(sub.args[0], ast.Constant)
            and isinstance(sub.args[0].value, str)
        ):
            ids.add(sub.args[0].value)
    return ids


def scan_test_marks(tests_dir: Path = TESTS_DIR) -> dict[str, dict[str, int]]:
    """task id -> {test file: number of test functions that carry the mark}.

    Marks are found on test functions and classes (decorators, including ``pytest.param(..., marks=...)``
    inside ``parametrize``) and in a module-level ``pytestmark``, which marks every test in the file.
    """
    found: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for path in sorted(tests_dir.rglob("test_*.py")):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
        module_ids: set[str] = set()
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
            ):
                module_ids |= _task_ids_in(node.value)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                ids = set(module_ids)
                for deco in node.decorator_list:
                    ids |= _task_ids_in(deco)
                for task_id in ids:
                    found[task_id][rel] += 1
            elif isinstance(node, ast.ClassDef):
                class_ids = set().union(*(_task_ids_in(d) for d in node.decorator_list))
                n_tests = sum(
                    isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name.startswith("test")
                    for m in node.body
                )
                for task_id in class_ids:
                    found[task_id][rel] += n_tests
    return {task_id: dict(files) for task_id, files in found.items()}


def collect_tasks() -> list[Task]:
    tasks = scan_markers()
    for task_id, files in scan_test_marks().items():
        tasks.setdefault(task_id, Task(task_id)).tests = files
    return sorted(tasks.values(), key=lambda t: t.sort_key)


def task_table(tasks: list[Task]) -> str:
    if not tasks:
        return "*No task markers in `minisgl_ref/` yet.*"
    rows = ["| Task | Title | Reference solution | Graded by |", "| --- | --- | --- | --- |"]
    for t in tasks:
        where = f"`{t.where}`" if t.where else "**no marker in the code yet**"
        if t.tests:
            graded = "<br>".join(
                f"`{f}` ({n} test{'s' if n != 1 else ''})" for f, n in sorted(t.tests.items())
            )
        else:
            graded = "**no tests yet**"
        title = (t.title or "—").replace("|", "\\|")
        if t.problems:
            title += " ⚠ " + "; ".join(t.problems)
        rows.append(f"| {t.id} | {title} | {where} | {graded} |")
    n_tests = sum(sum(t.tests.values()) for t in tasks)
    chapters = sorted({t.sort_key[0] for t in tasks})
    summary = (
        f"{len(tasks)} tasks over {len(chapters)} chapter{'s' if len(chapters) != 1 else ''}, "
        f"graded by {n_tests} test functions (parametrized tests count once)."
    )
    return "\n".join(rows) + "\n\n" + summary


def on_page_markdown(markdown, page, config, files):  # type: ignore[no-untyped-def]
    if PLACEHOLDER not in markdown:
        return markdown
    tasks = collect_tasks()
    for t in tasks:
        for problem in t.problems:
            log.warning("course task %s: %s", t.id, problem)
    return markdown.replace(PLACEHOLDER, task_table(tasks))


def on_serve(server, config, builder):  # type: ignore[no-untyped-def]
    """``mkdocs serve``: rebuild when the package or the tests change (task markers, docstrings)."""
    for folder in (PACKAGE_DIR, TESTS_DIR):
        if folder.is_dir():
            server.watch(str(folder))
    return server
