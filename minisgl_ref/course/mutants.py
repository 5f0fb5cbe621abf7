"""Mutants: realistic wrong answers to each task, kept to prove the tests catch them.

``course/mutants/chNN.toml`` lists, per task, edits a student could plausibly make (an update forgotten, an
off-by-one, the wrong end of a queue). Each is an exact ``find`` text inside the task's regions and its
``replace``ment. :func:`run` applies one mutant at a time to a scratch copy of the package and its tests, grades
the task there with the first failure stopping the run, and reports whether the task lost points and how long it
took: a task's tests are strong enough when every one of its mutants is caught within seconds. :func:`cost`
grades a mutant in full instead, to show what that wrong answer costs a student in points.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from minisgl_ref.course.grade import checks_of, report, run_tests, task_test_files
from minisgl_ref.course.regions import Region, scan
from minisgl_ref.course.table import Task

MUTANTS_DIR = Path("course") / "mutants"
SCRATCH = ("minisgl_ref", "tests", "benchmarks", "pyproject.toml")  # what a task's tests need to run
#: Files besides a task's own test files that decide what its tests check: the shared fixtures and the plugin
#: that turns test outcomes into a grade.
SHARED_TEST_FILES = ("tests/conftest.py", "minisgl_ref/course/plugin.py")


@dataclass(frozen=True)
class Mutant:
    task: str
    name: str
    why: str
    find: str
    replace: str
    source: str  # the TOML file it came from

    @property
    def id(self) -> str:
        return f"{self.task}/{self.name}"

    @property
    def digest(self) -> str:
        """A fingerprint of the edit, so that a recorded run can be told apart from one of an older mutant."""
        return hashlib.sha1(f"{self.find}\0{self.replace}".encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Outcome:
    mutant: Mutant
    caught: bool
    seconds: float
    detail: str  # the failing check, or why it was not caught


def load(root: Path) -> list[Mutant]:
    """Every mutant under ``root/course/mutants``, sorted by task."""
    out = []
    for path in sorted((root / MUTANTS_DIR).glob("*.toml")):
        for row in tomllib.loads(path.read_text(encoding="utf-8")).get("mutant", []):
            missing = {"task", "name", "find", "replace"} - set(row)
            if missing:
                raise ValueError(f"{path.name}: a mutant lacks {sorted(missing)}: {row}")
            out.append(Mutant(str(row["task"]), row["name"], row.get("why", ""), row["find"], row["replace"],
                              path.name))
    ids = [m.id for m in out]
    duplicates = {i for i in ids if ids.count(i) > 1}
    if duplicates:
        raise ValueError(f"mutant names used twice: {sorted(duplicates)}")
    return sorted(out, key=lambda m: (tuple(int(x) for x in m.task.split(".")), m.name))


def tests_digest(root: Path, task: str) -> str:
    """A fingerprint of the test code that grades ``task``: its test files and the shared ones. A recorded
    mutant run stays valid for a task while this is unchanged; when it changes, the task's tests may have
    lost the power to catch a mutant, and only a fresh run can tell."""
    h = hashlib.sha1()
    for rel in (*task_test_files(root, [task]), *SHARED_TEST_FILES):
        path = root / rel
        if path.is_file():
            h.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def stale_tasks(root: Path, known: Iterable[Mutant], records: list[dict]) -> set[str]:
    """The tasks a recorded run no longer speaks for: a mutant added or edited since, or test code changed."""
    by_id = {(r["task"], r["name"]): r for r in records}
    digests = {r["task"]: r.get("tests_digest") for r in records}
    stale = {m.task for m in known if by_id.get((m.task, m.name), {}).get("digest") != m.digest}
    return stale | {m.task for m in known if digests.get(m.task) != tests_digest(root, m.task)}


def locate(root: Path, mutant: Mutant, regions: list[Region]) -> tuple[str, str]:
    """(file, mutated text of that file); raises ``ValueError`` unless ``find`` occurs exactly once inside the
    task's regions."""
    hits = []
    for path in sorted({r.path for r in regions if r.task == mutant.task}):
        text = (root / path).read_text(encoding="utf-8")
        lines = text.splitlines(keepends=True)
        for r in (r for r in regions if r.task == mutant.task and r.path == path):
            start = sum(len(line) for line in lines[: r.begin + 1])
            stop = sum(len(line) for line in lines[: r.end])
            body = text[start:stop]
            n = body.count(mutant.find)
            if n:
                hits += [(path, text[:start] + body.replace(mutant.find, mutant.replace) + text[stop:])] * n
    if len(hits) != 1:
        raise ValueError(f"mutant {mutant.id} ({mutant.source}): its find text occurs {len(hits)} times in task "
                         f"{mutant.task}'s regions (it must occur exactly once)")
    return hits[0]


def scratch_copy(root: Path, dest: Path) -> None:
    for name in SCRATCH:
        src = root / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif src.exists():
            shutil.copy2(src, dest / name)


def run_one(root: Path, mutant: Mutant, regions: list[Region], *, timeout_s: int) -> Outcome:
    path, mutated = locate(root, mutant, regions)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mutant-") as tmp:
        scratch = Path(tmp)
        scratch_copy(root, scratch)
        (scratch / path).write_text(mutated, encoding="utf-8")
        try:
            records = run_tests(scratch, [mutant.task], fail_fast=True, timeout_s=timeout_s)
        except RuntimeError as e:  # the mutant broke pytest itself (an import error, say): caught, loudly
            return Outcome(mutant, True, time.perf_counter() - start, f"pytest could not run: {e}"[:500])
    seconds = time.perf_counter() - start
    failed = [c for c in checks_of(records).get(mutant.task, []) if c.outcome == "failed"]
    if failed:
        return Outcome(mutant, True, seconds, failed[0].name)
    if not records:
        return Outcome(mutant, False, seconds, "the task has no tests")
    return Outcome(mutant, False, seconds, f"all {len(records)} test cases of task {mutant.task} passed")


def cost(root: Path, mutant: Mutant, task: Task, *, timeout_s: int = 120) -> tuple[float, float]:
    """What the wrong answer ``mutant`` costs a student: (points its task still scores, the task's points), with
    every check of the task run to its end (no stopping at the first failure) and split by the checks' weights,
    exactly as :func:`minisgl_ref.course.grade.report` scores a submission."""
    path, mutated = locate(root, mutant, scan(root))
    with tempfile.TemporaryDirectory(prefix="mutant-cost-") as tmp:
        scratch = Path(tmp)
        scratch_copy(root, scratch)
        (scratch / path).write_text(mutated, encoding="utf-8")
        records = run_tests(scratch, [mutant.task], timeout_s=timeout_s)
    summary = report([task], records, 0.0, machine={})["extra_data"]["tasks"][0]
    return float(summary["score"]), float(summary["max_score"])


def run(root: Path, mutants: Iterable[Mutant], *, jobs: int = 2, timeout_s: int = 60,
        progress: Callable[[Outcome], None] | None = None) -> list[Outcome]:
    """Apply each mutant alone and grade its task; ``jobs`` mutants at a time."""
    regions = scan(root)
    mutants = list(mutants)
    for m in mutants:  # fail on a stale find text before spending minutes on the others
        locate(root, m, regions)

    def one(m: Mutant) -> Outcome:
        outcome = run_one(root, m, regions, timeout_s=timeout_s)
        if progress is not None:
            progress(outcome)
        return outcome

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(one, mutants))
