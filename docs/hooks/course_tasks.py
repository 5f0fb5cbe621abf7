"""MkDocs hook: the course's tables, built from the code, the tests and ``tasks.toml`` at every build.

Placeholders it fills (HTML comments, so a page without the hook still renders):

- ``<!-- course:tasks -->``: every task with its points, time, difficulty, dependencies, code and checks;
- ``<!-- course:assignment 3-4 -->``: the tasks of chapters 3-4 for a handout, with hints and CPU grading time;
- ``<!-- course:checks -->``: what each task's tests check (test names and their docstrings' first lines);
- ``<!-- course:mutants -->``: the wrong answers kept per task and whether the grader caught each.

The regions come from :mod:`minisgl_ref.course.regions` (the same scanner the student copy uses), the points
from :mod:`minisgl_ref.course.table`. A marker that cannot be blanked, a task missing from the table or a task
without tests is logged as a warning, which fails ``mkdocs build --strict``.
"""

from __future__ import annotations

import ast
import json
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

log = logging.getLogger("mkdocs.hooks.course_tasks")

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from minisgl_ref.course import regions as course_regions  # noqa: E402
from minisgl_ref.course import table as course_table  # noqa: E402

TESTS_DIR = ROOT / "tests"
GRADING_TIMES = ROOT / "docs" / "data" / "course_grading_cpu.json"
MUTANT_RESULTS = ROOT / "docs" / "data" / "course_mutants_cpu.json"
PLACEHOLDER = re.compile(r"<!-- course:(?P<what>tasks|checks|mutants|assignment (?P<chapters>[\d,\- ]+)) -->")


@dataclass(frozen=True)
class TestCheck:
    task: str
    file: str
    name: str
    doc: str
    gpu: bool
    weight: int = 1  #: its share of the task, relative to the task's other checks (``mark.task(id, weight=n)``)


def _marks(node: ast.AST, attr: str) -> list[ast.Call | ast.Attribute]:
    """``pytest.mark.<attr>`` uses (calls or bare attributes) inside ``node``."""
    found: list[ast.Call | ast.Attribute] = []
    for sub in ast.walk(node):
        target = sub.func if isinstance(sub, ast.Call) else sub
        if (isinstance(target, ast.Attribute) and target.attr == attr and isinstance(target.value, ast.Attribute)
                and target.value.attr == "mark"):
            found.append(sub)  # type: ignore[arg-type]
    return found


def _task_ids(node: ast.AST) -> list[str]:
    return [c.args[0].value for c in _marks(node, "task") if isinstance(c, ast.Call) and c.args
            and isinstance(c.args[0], ast.Constant) and isinstance(c.args[0].value, str)]


def _weight(nodes: list[ast.expr]) -> int:
    """The ``weight=`` of the first task mark among ``nodes`` (1 without one)."""
    for c in (c for d in nodes for c in _marks(d, "task") if isinstance(c, ast.Call)):
        for kw in c.keywords:
            if kw.arg == "weight" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, int):
                return kw.value.value
        return 1
    return 1


def scan_checks(tests_dir: Path = TESTS_DIR) -> list[TestCheck]:
    """Every test function that grades a task (marks on the function, its class or the module's pytestmark)."""
    out = []
    for path in sorted(tests_dir.rglob("test_*.py")):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
        module_ids: list[str] = []
        module_gpu = False
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                    for t in node.targets):
                module_ids += _task_ids(node.value)
                module_gpu |= bool(_marks(node.value, "gpu"))

        def visit(fn: ast.FunctionDef | ast.AsyncFunctionDef, ids: list[str], gpu: bool) -> None:
            own = ids + [i for d in fn.decorator_list for i in _task_ids(d)]
            gpu = gpu or any(_marks(d, "gpu") for d in fn.decorator_list)
            if own:
                doc = (ast.get_docstring(fn) or "").strip().split("\n\n")[0].replace("\n", " ")
                out.append(TestCheck(own[0], rel, fn.name, doc, gpu, _weight(fn.decorator_list)))

        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                visit(node, module_ids, module_gpu)
            elif isinstance(node, ast.ClassDef):
                ids = module_ids + [i for d in node.decorator_list for i in _task_ids(d)]
                gpu = module_gpu or any(_marks(d, "gpu") for d in node.decorator_list)
                for m in node.body:
                    if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name.startswith("test"):
                        visit(m, ids, gpu)
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _load() -> tuple[course_table.Table, list[TestCheck]]:
    regions = course_regions.scan(ROOT)
    for problem in course_regions.problems(ROOT, regions):
        log.warning("course: %s", problem)
    return course_table.load(regions), scan_checks()


def _json(path: Path) -> object:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def _needs(t: course_table.Table, ids: tuple[str, ...]) -> str:
    """``0.1, 0.2, 0.3, 1.1, 3.1, 3.2`` as ``0.1-0.3, 1.1, 3.1-3.2``: runs of tasks next to each other in the
    table, within one chapter."""
    order = list(t.tasks)
    runs: list[list[str]] = []
    for task in sorted(ids, key=order.index):
        last = runs[-1][-1] if runs else None
        if last is not None and order.index(task) == order.index(last) + 1 \
                and t.tasks[task].chapter == t.tasks[last].chapter:
            runs[-1].append(task)
        else:
            runs.append([task])
    return ", ".join(r[0] if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs) or "—"


def tasks_table(t: course_table.Table, checks: list[TestCheck]) -> str:
    rows = ["| Task | Title | Points | Time | Difficulty | Needs | Code | Checks (CPU + GPU) |",
            "| --- | --- | ---: | ---: | :---: | --- | --- | --- |"]
    for task in t.tasks.values():
        mine = [c for c in checks if c.task == task.id]
        cpu, gpu = sum(not c.gpu for c in mine), sum(c.gpu for c in mine)
        files = sorted({c.file for c in mine})
        where = "<br>".join(f"`{r.where}`" for r in task.regions)
        needs = _needs(t, task.depends)
        rows.append(f"| {task.id} | {_cell(task.title)} | {task.points:g} | {task.minutes} min | "
                    f"{'★' * task.difficulty} | {needs} | {where} | {cpu} + {gpu} in "
                    f"{', '.join(f'`{f}`' for f in files) or '**none**'} |")
    total = sum(x.points for x in t.tasks.values())
    hours = sum(x.minutes for x in t.tasks.values()) / 60
    return "\n".join(rows) + (f"\n\n{len(t.tasks)} tasks in {len({x.chapter for x in t.tasks.values()})} "
                              f"chapters, {total:g} points, about {hours:.0f} hours of work.")


def assignment_table(t: course_table.Table, chapters: str) -> str:
    wanted = course_table.parse_chapters(chapters)
    times = _json(GRADING_TIMES) or {}
    tasks = [x for x in t.tasks.values() if x.chapter in wanted]
    rows = ["| Task | What you write | Points | Time | Difficulty | Needs | Hint |",
            "| --- | --- | ---: | ---: | :---: | --- | --- |"]
    for x in tasks:
        rows.append(f"| {x.id} | {_cell(x.title)} | {x.points:g} | {x.minutes} min | {'★' * x.difficulty} | "
                    f"{_needs(t, x.depends)} | {_cell(x.hint)} |")
    out = "\n".join(rows)
    out += f"\n\nTotal: **{sum(x.points for x in tasks):g} points**, about {sum(x.minutes for x in tasks) / 60:.1f} " \
           f"hours of work."
    measured = [(c, times["chapters"][str(c)]) for c in sorted(wanted)
                if isinstance(times, dict) and str(c) in times.get("chapters", {})]
    if measured:
        where = times.get("machine", "a CPU machine")
        parts = ", ".join(f"chapter {c:02d} in {s['seconds']:.0f} s" for c, s in measured)
        out += f" Grading the reference on {where} takes: {parts}."
    return out


def checks_list(t: course_table.Table, checks: list[TestCheck]) -> str:
    out = []
    for task in t.tasks.values():
        out.append(f"**{task.id} {task.title}**\n")
        for c in (c for c in checks if c.task == task.id):
            gpu = " *(GPU)*" if c.gpu else ""
            weight = f" *(weight {c.weight})*" if c.weight != 1 else ""
            doc = c.doc or c.name.removeprefix("test_").replace("_", " ")
            out.append(f"- `{c.name}`{gpu}{weight}: {doc} (`{c.file}`)")
        out.append("")
    return "\n".join(out)


def mutants_table(t: course_table.Table) -> str:
    rows = ["| Task | Wrong answer | Why it is wrong | Caught by | Seconds |", "| --- | --- | --- | --- | ---: |"]
    results = {f"{r['task']}/{r['name']}": r for r in (_json(MUTANT_RESULTS) or [])}
    for path in sorted((ROOT / "course" / "mutants").glob("*.toml")):
        for m in tomllib.loads(path.read_text(encoding="utf-8")).get("mutant", []):
            r = results.get(f"{m['task']}/{m['name']}")
            caught = ("`" + r["detail"].split("::")[-1] + "`" if r["caught"] else "**missed**") if r else "not run"
            secs = f"{r['seconds']:.0f}" if r else ""
            rows.append(f"| {m['task']} | `{m['name']}` | {_cell(m.get('why', ''))} | {caught} | {secs} |")
    if len(rows) == 2:
        return "*No mutants in this copy (they stay with the instructor).*"
    return "\n".join(rows)


def on_page_markdown(markdown, page, config, files):  # type: ignore[no-untyped-def]
    if "<!-- course:" not in markdown:
        return markdown
    t, checks = _load()
    for task in t.tasks.values():
        mine = [c for c in checks if c.task == task.id]
        if not mine:
            log.warning("course task %s has no tests", task.id)
        elif all(c.gpu for c in mine):
            log.warning("course task %s has no CPU check", task.id)

    def fill(m: re.Match[str]) -> str:
        what = m["what"]
        if what == "tasks":
            return tasks_table(t, checks)
        if what == "checks":
            return checks_list(t, checks)
        if what == "mutants":
            return mutants_table(t)
        return assignment_table(t, m["chapters"])

    return PLACEHOLDER.sub(fill, markdown)


def on_serve(server, config, builder):  # type: ignore[no-untyped-def]
    """``mkdocs serve``: rebuild when the package, the tests or the mutants change."""
    for folder in (ROOT / "minisgl_ref", TESTS_DIR, ROOT / "course"):
        if folder.is_dir():
            server.watch(str(folder))
    return server
