"""The course pages' generated parts: tables and files built from the code, the tests, ``tasks.toml``, the
recorded measurements and the autograder's templates, written into the Markdown sources themselves.

A generated part sits between an opening comment that says what it is and ``<!-- /course -->``::

    <!-- course:assignment 3-4 -->
    | Task | What you write | ... |
    <!-- /course -->

so a handout reads complete wherever it is opened (a student copy on GitHub, an editor, the built site), and
``python -m minisgl_ref.course pages`` rewrites every part from its sources. An opening comment without its
closing one is *unfilled*; a part whose text differs from what its sources give now is *stale*; the tests
refuse both (:func:`problems`). The site's hook (``docs/hooks/course_tasks.py``) fills the parts again at every
build, so the site never shows a stale one.

What a part can be:

- ``tasks``: every task with its points, time, difficulty, dependencies, code and checks;
- ``assignment 3-4``: the tasks of chapters 3-4 for a handout, with hints and the measured CPU grading time;
- ``checks``: what each task's tests check (test names and the first paragraph of their docstrings);
- ``mutants``: the wrong answers kept per task and whether the grader caught each (a student copy has none);
- ``autograder setup.sh`` / ``autograder run_autograder``: the Gradescope script, as the zip of assignment
  :data:`EXAMPLE_ASSIGNMENT` holds it;
- ``gradescope``: the autograder's measured size, grading times and the time limit to set.
"""

from __future__ import annotations

import ast
import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from minisgl_ref.course import autograder, regions, table

OPEN = re.compile(r"^<!-- course:(?P<what>tasks|checks|mutants|gradescope|assignment [\d,\- ]+|"
                  r"autograder [\w.]+) -->$")
CLOSE = "<!-- /course -->"
ANY_MARKER = re.compile(r"^<!-- /?course\b")  # a line that starts like a part's comment
GRADING_TIMES = "docs/data/course_grading_cpu.json"
MUTANT_RESULTS = "docs/data/course_mutants_cpu.json"
GRADESCOPE_TIMES = "docs/data/course_gradescope_cpu.json"
EXAMPLE_ASSIGNMENT = 2  #: the assignment whose scripts the instructor guide shows


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


def scan_checks(root: Path) -> list[TestCheck]:
    """Every test function that grades a task (marks on the function, its class or the module's pytestmark)."""
    out = []
    for path in sorted((root / "tests").rglob("test_*.py")):
        rel = path.relative_to(root).as_posix()
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


def _json(path: Path) -> object:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def _needs(t: table.Table, ids: tuple[str, ...]) -> str:
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


def tasks_table(t: table.Table, checks: list[TestCheck]) -> str:
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


def weights_list(tasks: list[table.Task], checks: list[TestCheck]) -> str:
    """How each task's points are split over its checks: the checks that weigh more than 1, with their share.

    A student should know before starting that a bug in the correctness or safety of a task (a lost request, a
    leaked slot, a wrong token) costs most of its points, while a missed detail costs a little."""
    lines = []
    for x in tasks:
        mine = [c for c in checks if c.task == x.id]
        total = sum(c.weight for c in mine)
        heavy = [c for c in mine if c.weight != 1]
        if not mine:
            continue
        if not heavy:
            lines.append(f"- **{x.id}**: {len(mine)} checks of equal weight, {x.points / len(mine):.2g} points each.")
            continue
        parts = ", ".join(f"`{c.name}` weighs {c.weight} ({x.points * c.weight / total:.1f} points)" for c in heavy)
        rest = len(mine) - len(heavy)
        tail = f"; the other {rest} weigh 1 each ({x.points / total:.2g} points)" if rest else ""
        lines.append(f"- **{x.id}** ({x.points:g} points, weights adding up to {total}): {parts}{tail}.")
    return ("How a task's points are split over its checks (a check that finds a wrong token, a lost request, a "
            "leaked slot or a race weighs most; a GPU check that cannot run on the grading machine passes its share "
            "on to the task's other checks):\n\n" + "\n".join(lines))


def assignment_table(t: table.Table, chapters: str, root: Path, checks: list[TestCheck] | None = None) -> str:
    wanted = table.parse_chapters(chapters)
    times = _json(root / GRADING_TIMES) or {}
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
    if checks is not None:
        out += "\n\n" + weights_list(tasks, checks)
    return out


def checks_list(t: table.Table, checks: list[TestCheck]) -> str:
    out = []
    for task in t.tasks.values():
        out.append(f"**{task.id} {task.title}**\n")
        for c in (c for c in checks if c.task == task.id):
            gpu = " *(GPU)*" if c.gpu else ""
            weight = f" *(weight {c.weight})*" if c.weight != 1 else ""
            doc = c.doc or c.name.removeprefix("test_").replace("_", " ")
            out.append(f"- `{c.name}`{gpu}{weight}: {doc} (`{c.file}`)")
        out.append("")
    return "\n".join(out).rstrip("\n")


def mutants_table(root: Path) -> str:
    rows = ["| Task | Wrong answer | Why it is wrong | Caught by | Seconds |", "| --- | --- | --- | --- | ---: |"]
    results = {f"{r['task']}/{r['name']}": r for r in (_json(root / MUTANT_RESULTS) or [])}  # type: ignore[union-attr]
    for path in sorted((root / "course" / "mutants").glob("*.toml")):
        for m in tomllib.loads(path.read_text(encoding="utf-8")).get("mutant", []):
            r = results.get(f"{m['task']}/{m['name']}")
            caught = ("`" + r["detail"].split("::")[-1] + "`" if r["caught"] else "**missed**") if r else "not run"
            secs = f"{r['seconds']:.0f}" if r else ""
            rows.append(f"| {m['task']} | `{m['name']}` | {_cell(m.get('why', ''))} | {caught} | {secs} |")
    if len(rows) == 2:
        return "*No mutants in this copy (they stay with the instructor).*"
    return "\n".join(rows)


def autograder_file(name: str, root: Path) -> str:
    """One of the zip's scripts, filled for :data:`EXAMPLE_ASSIGNMENT`, as a code block."""
    chapters = autograder.assignments()[EXAMPLE_ASSIGNMENT]
    text = autograder.render(name, EXAMPLE_ASSIGNMENT, chapters, root)
    return f"```bash\n{text.rstrip()}\n```"


def time_limit_minutes(seconds: float) -> int:
    """The time limit to set for a grading run measured at ``seconds`` on a 2-core machine: four times as long
    (twice for a container with one CPU, twice again for a slow submission), in whole 5 minutes, 10 at least."""
    return max(10, 5 * math.ceil(4 * seconds / 60 / 5))


def gradescope_table(root: Path) -> str:
    """The autograder's measured footprint and grading times (``docs/data/course_gradescope_cpu.json``, written
    by ``scripts/course_gradescope.py``)."""
    data = _json(root / GRADESCOPE_TIMES)
    known = autograder.assignments()
    if not isinstance(data, dict):
        return "*Not measured yet: run `python scripts/course_gradescope.py`.*"
    rows = ["| assignment | chapters | the reference's code | the copy as handed out | peak memory | "
            "time limit to set |", "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for n, chapters in sorted(known.items()):
        m = data.get("assignments", {}).get(str(n))
        if m is None:
            rows.append(f"| {n} | {chapters} | not measured | | | |")
            continue
        rows.append(f"| {n} | {chapters} | {m['score']:g} / {m['max_score']:g} in {m['seconds']:.0f} s | "
                    f"{m['blank_score']:g} in {m['blank_seconds']:.0f} s | {m['peak_rss_mb']:,.0f} MB | "
                    f"{time_limit_minutes(max(m['seconds'], m['blank_seconds']))} min |")
    size = data["size_mb"]
    disk = size["venv"] + size["model_cache"]
    peaks = [m["peak_rss_mb"] for m in data.get("assignments", {}).values()]
    memory = f" and at least {math.ceil(1.5 * max(peaks) / 512) / 2:g} GB of memory (1.5 times the largest " \
             f"peak below)" if peaks else ""
    return (
        f"Measured on {data['machine']}, {data['when']}: `setup.sh` took {data['setup_seconds']:.0f} s (pip "
        f"downloading the pinned wheels) and left **{disk:,.0f} MB** on disk: {size['venv']:,.0f} MB of virtual "
        f"environment and {size['model_cache']:,.0f} MB of converted model (`~/.cache/minisgl_ref`), beside a "
        f"{size['zip']:.1f} MB zip. Give the container room for that plus the operating system's Python"
        f"{memory}. Per assignment, the score and the time of `run_autograder` on the reference's code and on the "
        "copy as handed out, and the peak memory of its largest process:\n\n" + "\n".join(rows)
    )


def _renderers(root: Path) -> Callable[[str], str]:
    t = table.load(regions.scan(root))
    checks = scan_checks(root)

    def render(what: str) -> str:
        if what == "tasks":
            return tasks_table(t, checks)
        if what == "checks":
            return checks_list(t, checks)
        if what == "mutants":
            return mutants_table(root)
        if what == "gradescope":
            return gradescope_table(root)
        kind, arg = what.split(" ", 1)
        if kind == "autograder":
            return autograder_file(arg, root)
        return assignment_table(t, arg, root, checks)

    return render


def unfilled(text: str) -> list[str]:
    """Problems of the markers in ``text``: an opening comment without its ``<!-- /course -->``, a closing one
    without an opening, or a comment that is neither (a misspelt part)."""
    out, open_at = [], None
    for i, line in enumerate(text.splitlines(), 1):
        if OPEN.match(line.strip()):
            if open_at is not None:
                out.append(f"line {open_at[0]}: {open_at[1]} is never closed")
            open_at = (i, line.strip())
        elif line.strip() == CLOSE:
            if open_at is None:
                out.append(f"line {i}: {CLOSE} without an opening comment")
            open_at = None
        elif ANY_MARKER.match(line.strip()):
            out.append(f"line {i}: {line.strip()[:60]} is not a part this tool knows")
    if open_at is not None:
        out.append(f"line {open_at[0]}: {open_at[1]} is never closed")
    return out


def fill(text: str, root: Path, render: Callable[[str], str] | None = None) -> str:
    """``text`` with every part (filled or not) written from its sources."""
    if "<!-- course:" not in text:
        return text
    render = render or _renderers(root)
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    i = 0
    while i < len(lines):
        m = OPEN.match(lines[i].strip())
        if m is None:
            out.append(lines[i])
            i += 1
            continue
        # the part runs to its closing comment, or (unfilled) is the opening comment alone
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == CLOSE
                    or OPEN.match(lines[j].strip())), None)
        closed = end is not None and lines[end].strip() == CLOSE
        out.append(f"{lines[i].strip()}\n\n{render(m['what'])}\n\n{CLOSE}\n")
        i = end + 1 if closed else i + 1
    return "".join(out)


def pages(root: Path) -> list[Path]:
    """The Markdown pages under ``docs/`` that hold generated parts."""
    return [p for p in sorted((root / "docs").rglob("*.md")) if "<!-- course:" in p.read_text(encoding="utf-8")]


def problems(root: Path) -> list[str]:
    """``page: problem`` for every unfilled, misspelt or stale part of the pages under ``root/docs``."""
    render = _renderers(root)
    out = []
    for page in pages(root):
        rel = page.relative_to(root).as_posix()
        text = page.read_text(encoding="utf-8")
        out += [f"{rel}: {p}" for p in unfilled(text)]
        if fill(text, root, render) != text:
            out.append(f"{rel}: a generated part is stale (run `python -m minisgl_ref.course pages`)")
    return out


def write(root: Path) -> list[str]:
    """Write every page's parts from their sources; returns the pages that changed."""
    render = _renderers(root)
    changed = []
    for page in pages(root):
        text = page.read_text(encoding="utf-8")
        new = fill(text, root, render)
        if new != text:
            page.write_text(new, encoding="utf-8")
            changed.append(page.relative_to(root).as_posix())
    return changed
