"""The course kit: regions blank by the rule, a student copy holds no solution and runs, the grader's report is
what Gradescope reads, a copy of chapters 03-06 fails on exactly those tasks and gets full marks once the
reference is pasted back, and every kept wrong answer (mutant) is caught by its task's tests."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minisgl_ref.course import grade, mutants, regions, screen, student, table

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
DEPENDS = grade.DEPENDS


def course(*args: str, cwd: Path = ROOT, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(cwd), PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([PY, "-m", "minisgl_ref.course", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def task_table() -> table.Table:
    return table.load(regions.scan(ROOT))


def test_every_region_blanks_by_the_rule_and_the_table_matches_the_code(task_table: table.Table) -> None:
    assert regions.problems(ROOT) == []
    assert list(task_table.tasks) == sorted(task_table.tasks, key=regions.task_key)
    for task in task_table.tasks.values():
        assert task.points > 0 and task.minutes > 0 and task.hint, task.id
        assert all(regions.task_key(d) < regions.task_key(task.id) for d in task.depends), task.id


def test_blank_and_fill_are_inverse() -> None:
    for path in sorted({r.path for r in regions.scan(ROOT)}):
        text = (ROOT / path).read_text(encoding="utf-8")
        rs = regions.scan_text(text, path)
        blanked = regions.blank_text(text, rs)
        assert "NotImplementedError(\"Task" in blanked
        assert regions.fill_text(blanked, regions.scan_text(blanked, path), regions.bodies_by_file(text, rs)) == text


def test_every_graded_test_has_one_task_and_every_task_a_cpu_check(tmp_path: Path, task_table: table.Table) -> None:
    out = tmp_path / "records.json"
    proc = subprocess.run(
        [PY, "-m", "pytest", "--collect-only", "-q", "-p", "minisgl_ref.course.plugin", "--course-tasks=*",
         f"--course-report={out}", "--ignore=tests/test_site_browser.py", "-p", "no:cacheprovider", "tests"],
        cwd=ROOT, capture_output=True, text=True)
    assert out.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    records = json.loads(out.read_text())
    several = sorted({r["nodeid"] for r in records if len(r["marks"]) != 1})
    assert not several, f"tests credited to several tasks: {several[:5]}"
    for task in task_table.tasks:
        mine = [r for r in records if r["task"] == task]
        assert any(not r["gpu"] for r in mine), f"task {task} has no CPU check"
        # grading one task collects only the files that mark its tests: they must hold every one of them
        files = grade.task_test_files(ROOT, [task])
        assert files != ["tests"], f"no test file marks task {task} literally"
        assert {r["nodeid"].split("::")[0] for r in mine} <= set(files), task


def _import_everything(root: Path) -> subprocess.CompletedProcess[str]:
    code = (
        "import importlib, pkgutil, sys, minisgl_ref\n"
        "bad = []\n"
        "for m in pkgutil.walk_packages(minisgl_ref.__path__, 'minisgl_ref.', onerror=lambda n: bad.append(n)):\n"
        "    if m.name.endswith('__main__'): continue  # a command line: importing it runs it\n"
        "    try: importlib.import_module(m.name)\n"
        "    except ModuleNotFoundError as e:\n"
        "        if not (e.name or '').startswith('minisgl_ref'): continue  # an optional GPU package\n"
        "        bad.append(f'{m.name}: {e!r}')\n"
        "    except Exception as e: bad.append(f'{m.name}: {e!r}')\n"
        "print('\\n'.join(bad)); sys.exit(1 if bad else 0)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([PY, "-c", code], cwd=root, env=env, capture_output=True, text=True)


@pytest.fixture(scope="module")
def copy_3_to_6(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("student") / "copy"
    course("student", str(out), "--chapters", "3-6")
    return out


def test_student_copy_is_a_fresh_repository_without_solutions(copy_3_to_6: Path, task_table: table.Table) -> None:
    out = copy_3_to_6
    log = subprocess.run(["git", "log", "--oneline"], cwd=out, capture_output=True, text=True, check=True).stdout
    assert len(log.splitlines()) == 1
    assert subprocess.run(["git", "status", "--porcelain"], cwd=out, capture_output=True, text=True).stdout == ""
    assert not (out / "course").exists(), "the mutants are near-solutions"
    assert not list(out.rglob("*.pyc")) and not list(out.rglob("__pycache__"))
    for nb in (out / "notebooks").glob("*.ipynb"):
        cells = json.loads(nb.read_text())["cells"]
        assert all(not c.get("outputs") for c in cells if c["cell_type"] == "code"), nb.name
    blank = {t.id for t in task_table.tasks.values() if 3 <= t.chapter <= 6}
    assert json.loads((out / "COURSE.json").read_text())["blank_tasks"] == sorted(blank, key=regions.task_key)
    copy_regions = regions.scan(out)
    for r in copy_regions:
        body = r.body((out / r.path).read_text().splitlines())
        if r.task in blank:
            assert body == [r.stub()], r.where
        else:
            assert body != [r.stub()], r.where
    ref = [r for r in regions.scan(ROOT) if r.task in blank]
    assert student.leaks(out, student.solution_lines(ROOT, ref)) == []
    assert regions.problems(out) == []


def test_student_copy_installs_and_imports(copy_3_to_6: Path, tmp_path: Path) -> None:
    proc = _import_everything(copy_3_to_6)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wheel = subprocess.run([PY, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                            str(tmp_path), str(copy_3_to_6)], capture_output=True, text=True)
    assert wheel.returncode == 0, wheel.stderr[-2000:]
    built = list(tmp_path.glob("minisgl_ref-*.whl"))
    assert built
    import zipfile

    names = zipfile.ZipFile(built[0]).namelist()
    assert "minisgl_ref/course/tasks.toml" in names


def test_a_copy_with_every_task_blank_still_imports(tmp_path: Path) -> None:
    out = tmp_path / "all"
    student.make_copy(ROOT, out, [r.task for r in regions.scan(ROOT)], commit=False)
    proc = _import_everything(out)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_grader_report_is_gradescopes_format(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    course("grade", "--task", "0.1", "--json", str(out))
    result = json.loads(out.read_text())
    assert result["score"] == result["max_score"] > 0
    assert {"score", "tests", "output", "execution_time", "extra_data"} <= set(result)
    for t in result["tests"]:
        assert {"name", "score", "max_score", "status", "output", "visibility"} <= set(t)
        assert t["status"] in ("passed", "failed")
    env = result["extra_data"]["environment"]
    assert env["python"] and env["torch"] and "gpu" in env


@pytest.mark.slow
def test_copy_of_chapters_3_to_6_fails_on_those_tasks_only_and_the_reference_gets_full_marks(
    copy_3_to_6: Path, task_table: table.Table, tmp_path: Path
) -> None:
    blank = {t for t, x in task_table.tasks.items() if 3 <= x.chapter <= 6}
    out = tmp_path / "blank.json"
    course("grade", "--json", str(out), cwd=copy_3_to_6)
    result = json.loads(out.read_text())
    summary = {s["task"]: s for s in result["extra_data"]["tasks"]}
    for task, s in summary.items():
        failing = [t for t in result["tests"] if t["extra_data"]["task"] == task and t.get("status") == "failed"]
        named = {n for t in failing for n in DEPENDS.findall(t["output"])}
        if task in blank:
            assert s["score"] == 0 and named and named <= blank, (task, [t["output"][:300] for t in failing])
        else:
            # an unchosen task passes, or fails only because it runs a blank task (and says which)
            assert all(DEPENDS.findall(t["output"]) for t in failing), (task, [t["output"][:300] for t in failing])
            assert named <= blank, (task, named)
    for task in (t for t, x in task_table.tasks.items() if x.chapter < 3):
        assert summary[task]["score"] == summary[task]["max_score"] > 0, task

    course("solutions", str(copy_3_to_6), "--chapters", "3-6")
    full = tmp_path / "full.json"
    course("grade", "--chapters", "3-6", "--json", str(full), cwd=copy_3_to_6)
    result = json.loads(full.read_text())
    assert result["score"] == result["max_score"] > 0, [t["output"][:300] for t in result["tests"]
                                                        if t.get("status") == "failed"]
    assert {s["task"] for s in result["extra_data"]["tasks"]} == blank


def test_the_recorded_mutant_run_is_current_and_caught_them_all() -> None:
    """The site's mutant table comes from a full run (``scripts/course_data.py``, about 15 minutes on two cores);
    it must cover every mutant as it is written now, and every one must have been caught within 90 seconds."""
    known = mutants.load(ROOT)
    assert known, "no mutants under course/mutants"
    found = regions.scan(ROOT)
    for m in known:  # each still applies: its find text occurs exactly once in its task's regions
        mutants.locate(ROOT, m, found)
    t = table.load(found)
    without = sorted(set(t.tasks) - {m.task for m in known}, key=regions.task_key)
    assert not without, f"tasks without mutants: {without}"
    recorded = {(r["task"], r["name"]): r for r in json.loads((ROOT / "docs/data/course_mutants_cpu.json").read_text())}
    stale = [m.id for m in known if recorded.get((m.task, m.name), {}).get("digest") != m.digest]
    assert not stale, f"mutants changed since the recorded run (run scripts/course_data.py): {stale}"
    missed = [f"{r['task']}/{r['name']}" for r in recorded.values() if not r["caught"] or r["seconds"] > 90]
    assert not missed, missed


ROTATION = 5  # a fresh run covers every task at least once in this many days


def fresh_run_tasks(known: list[mutants.Mutant], recorded: dict, today: int) -> tuple[set[str], set[str]]:
    """(tasks whose test code changed since the recorded run, a rotating fifth of the other tasks, by day)."""
    tasks = sorted({m.task for m in known}, key=regions.task_key)
    changed = mutants.stale_tasks(ROOT, known, list(recorded.values()))
    rotating = {t for i, t in enumerate(tasks) if i % ROTATION == today % ROTATION} - changed
    return changed, rotating


@pytest.mark.slow
def test_one_mutant_of_every_changed_task_and_of_a_rotating_fifth_is_caught_here() -> None:
    """A fresh run on this machine of one mutant (the first by name) per task: the recorded full run above is only
    as good as the tests it ran. Every task whose test code changed since that run is checked (a weakened test
    shows up here at once); the others, whose recorded result still stands for their tests, take turns, a fifth
    of them a day, which catches a test weakened by a change elsewhere (an engine change that makes a check
    vacuous) within a few days without paying for all of them on every run."""
    known = mutants.load(ROOT)
    recorded = {(r["task"], r["name"]): r for r in json.loads((ROOT / "docs/data/course_mutants_cpu.json").read_text())}
    changed, rotating = fresh_run_tasks(known, recorded, datetime.date.today().toordinal())
    assert rotating or changed, "the rotation picked no task"
    first: dict[str, mutants.Mutant] = {}
    for m in known:
        if m.task in changed | rotating:
            first.setdefault(m.task, m)
    print(f"\nfresh mutant run: tests changed for {sorted(changed, key=regions.task_key)}, "
          f"rotation {sorted(rotating, key=regions.task_key)}")
    outcomes = mutants.run(ROOT, first.values(), jobs=2, timeout_s=60)
    missed = [f"{o.mutant.id}: {o.detail}" for o in outcomes if not o.caught]
    assert not missed, missed
    slow = [f"{o.mutant.id}: {o.seconds:.0f} s" for o in outcomes if o.seconds > 90]
    assert not slow, slow


def test_the_rotation_covers_every_task_and_a_changed_test_file_is_noticed(tmp_path: Path) -> None:
    known = mutants.load(ROOT)
    tasks = {m.task for m in known}
    recorded = {(m.task, m.name): {"task": m.task, "name": m.name, "digest": m.digest,
                                   "tests_digest": mutants.tests_digest(ROOT, m.task)} for m in known}
    covered: set[str] = set()
    for day in range(ROTATION):
        changed, rotating = fresh_run_tasks(known, recorded, day)
        assert not changed and rotating
        covered |= rotating
    assert covered == tasks
    first = known[0]  # a mutant edited since the recorded run makes its task stale too
    edited = {**recorded, (first.task, first.name): {**recorded[first.task, first.name], "digest": "0" * 12}}
    assert mutants.stale_tasks(ROOT, known, list(edited.values())) == {first.task}
    # the digest follows the test files: a copy with one task's test file edited gives that task a new digest
    task = sorted(tasks, key=regions.task_key)[0]
    files = grade.task_test_files(ROOT, [task])
    for rel in (*files, *mutants.SHARED_TEST_FILES):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes((ROOT / rel).read_bytes())
    assert mutants.tests_digest(tmp_path, task) == mutants.tests_digest(ROOT, task)
    (tmp_path / files[0]).write_text((ROOT / files[0]).read_text() + "\n# weakened\n")
    assert mutants.tests_digest(tmp_path, task) != mutants.tests_digest(ROOT, task)


def test_updating_a_copy_commits_on_top_and_never_unblanks_by_accident(tmp_path: Path) -> None:
    out = tmp_path / "course"
    student.make_copy(ROOT, out, ["0.1"])
    with pytest.raises(ValueError, match="publish the solutions of tasks 0.1"):
        student.make_copy(ROOT, out, ["0.2"])
    student.make_copy(ROOT, out, ["0.1", "0.2"])
    log = subprocess.run(["git", "log", "--format=%s"], cwd=out, capture_output=True, text=True).stdout.splitlines()
    assert len(log) == 2 and log[0].startswith("Reference update")
    student.make_copy(ROOT, out, ["0.2"], unblank=True)
    assert 'NotImplementedError("Task 0.1' not in (out / "minisgl_ref/attention/torch_native.py").read_text()


# ------------------------------------------------------------------------------ the report's numbers and names


def _record(task: str, check: str, outcome: str, case: str = "") -> dict:
    return {"nodeid": check + case, "check": check, "task": task, "marks": [task], "gpu": False,
            "outcome": outcome, "message": "" if outcome == "passed" else "AssertionError", "seconds": 0.1}


def _exact(result: dict) -> dict:
    """The report as Gradescope reads it, its numbers as the exact decimals written."""
    from decimal import Decimal

    return json.loads(json.dumps(result), parse_float=Decimal)


def test_report_scores_add_up_exactly_and_check_names_are_unique() -> None:
    """Points that do not divide evenly (10 over 3 checks, 5 over 7, 2.5 over 6) still add up to the last digit:
    the per-check scores to the total score, their maximums to the total maximum; and two checks with one test
    function name (in two files) get two names."""
    tasks = [table.Task("1.1", "one", 10), table.Task("1.2", "two", 5), table.Task("1.3", "three", 2.5)]
    records = [_record("1.1", f"tests/test_a.py::test_{i}", "passed") for i in range(3)]
    records += [_record("1.2", f"tests/test_b.py::test_{i}", "passed" if i % 2 else "failed") for i in range(6)]
    records += [_record("1.2", "tests/test_c.py::test_0", "passed")]  # the same function name as test_b's
    records += [_record("1.3", f"tests/test_d.py::test_{i}", "passed", f"[{c}]") for i in range(6) for c in "xy"]
    result = _exact(grade.report(tasks, records, 1.0, machine={}))
    assert result["max_score"] == 17.5 and sum(t["max_score"] for t in result["tests"]) == result["max_score"]
    assert sum(t["score"] for t in result["tests"]) == result["score"]
    assert {str(t["max_score"]) for t in result["tests"] if t["extra_data"]["task"] == "1.1"} == {"3.334", "3.333"}
    for s in result["extra_data"]["tasks"]:
        mine = [t for t in result["tests"] if t["extra_data"]["task"] == s["task"]]
        assert sum(t["score"] for t in mine) == s["score"] and sum(t["max_score"] for t in mine) == s["max_score"]
    names = [t["name"] for t in result["tests"]]
    assert len(names) == len(set(names)) == 3 + 7 + 6
    assert sum("tests/test_c.py::test_0" in n or "tests/test_b.py::test_0" in n for n in names) == 2


def test_weights_split_a_task_in_proportion_and_the_scores_still_add_up_exactly() -> None:
    """Task 5.1-like: 15 points over checks of weights 16, 4, 3 and 1 (24 in all) are 10, 2.5, 1.875 and 0.625;
    10 points over weights 2, 1, 1, 1, 1, 1 (7 in all) do not divide: the thousandths left over by rounding down
    go to the shares that lost most, and every total is exact. A failed heavy check costs its weight's share."""
    assert grade.split_weighted(15000, [16, 4, 3, 1]) == [10000, 2500, 1875, 625]
    shares = grade.split_weighted(10000, [2, 1, 1, 1, 1, 1])
    assert sum(shares) == 10000 and shares == [2857, 1429, 1429, 1429, 1428, 1428]
    assert grade.split(10000, 3) == grade.split_weighted(10000, [1, 1, 1]) == [3334, 3333, 3333]
    with pytest.raises(ValueError):
        grade.split_weighted(1000, [0, 0])
    tasks = [table.Task("5.1", "admission", 15)]
    weights = {"heavy": 16, "a": 4, "b": 3, "c": 1}
    records = [{**_record("5.1", f"tests/test_e.py::test_{name}", "failed" if name == "heavy" else "passed"),
                "weight": w} for name, w in weights.items()]
    result = _exact(grade.report(tasks, records, 1.0, machine={}))
    assert result["score"] == 5 and result["max_score"] == 15
    assert sum(t["max_score"] for t in result["tests"]) == 15
    (heavy,) = [t for t in result["tests"] if t["extra_data"]["weight"] == 16]
    assert heavy["max_score"] == 10 and heavy["score"] == 0


def test_the_plugin_records_each_checks_weight(tmp_path: Path) -> None:
    """``@pytest.mark.task("5.1", weight=24)`` reaches the records; a check without one weighs 1; a weight that
    is not a whole number >= 1 stops the collection with the test's name."""
    out = tmp_path / "records.json"
    proc = subprocess.run(
        [PY, "-m", "pytest", "--collect-only", "-q", "-p", "minisgl_ref.course.plugin", "--course-tasks=5.1",
         f"--course-report={out}", "-p", "no:cacheprovider", "tests/test_engine_core.py"],
        cwd=ROOT, capture_output=True, text=True)
    assert out.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    weights = {r["check"].split("::")[-1]: r["weight"] for r in json.loads(out.read_text())}
    assert weights["test_chunked_admission_serves_every_request_and_keeps_its_promises"] == 24
    assert weights["test_a_partial_chunk_reserves_nothing_yet"] == 1
    bad = tmp_path / "test_bad_weight.py"
    bad.write_text('import pytest\n\n@pytest.mark.task("5.1", weight=0.5)\ndef test_x():\n    pass\n')
    proc = subprocess.run(
        [PY, "-m", "pytest", "--collect-only", "-q", "-p", "minisgl_ref.course.plugin", "--course-tasks=5.1",
         "-p", "no:cacheprovider", "-o", "addopts=", str(bad)], cwd=tmp_path, capture_output=True, text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode != 0 and "weight is a whole number" in proc.stdout + proc.stderr


def test_a_blocked_check_leaves_its_task_worth_all_its_points() -> None:
    """Task 2.4-like: eight CPU checks pass, one GPU check is blocked. The task is worth its 5 points (the blocked
    share went to the other checks), and the report's total is the sum of the points. A task whose every check is
    blocked is out of 0, and the report says so with the full total."""
    tasks = [table.Task("2.4", "noise", 5), table.Task("7.1", "kernel", 5)]
    records = [_record("2.4", f"tests/test_s.py::test_{i}", "passed") for i in range(8)]
    records += [{**_record("2.4", "tests/test_s.py::test_gpu", "skipped"), "gpu": True, "message": "needs CUDA"}]
    result = _exact(grade.report(tasks[:1], records, 1.0, machine={}))
    assert result["score"] == result["max_score"] == 5
    blocked = [t for t in result["tests"] if t["extra_data"]["outcome"] == "blocked"]
    assert len(blocked) == 1 and blocked[0]["max_score"] == 0 and "other checks" in blocked[0]["output"]
    assert sum(t["score"] for t in result["tests"]) == 5
    only_gpu = [{**_record("7.1", "tests/test_k.py::test_gpu", "skipped"), "gpu": True}]
    result = _exact(grade.report(tasks, records + only_gpu, 1.0, machine={}))
    assert result["score"] == result["max_score"] == 5
    assert "7.1 could not be graded here" in result["output"] and "full total is 10" in result["output"]


def test_a_refused_task_scores_zero_out_of_its_points_with_the_reason() -> None:
    tasks = [table.Task("0.1", "attention", 10), table.Task("0.2", "stops", 10)]
    records = [_record("0.2", "tests/test_x.py::test_stop", "passed")]
    result = grade.report(tasks, records, 1.0, refused={"0.1": ["x.py:3-9: line 4: imports os"]}, machine={})
    (entry,) = [t for t in result["tests"] if t["extra_data"]["task"] == "0.1"]
    assert entry["score"] == 0 and entry["max_score"] == 10 and entry["status"] == "failed"
    assert "imports os" in entry["output"] and entry["extra_data"]["outcome"] == "refused"
    assert result["score"] == 10 and result["max_score"] == 20


def test_the_channel_keeps_only_lines_signed_with_the_runs_key() -> None:
    """Records reach the grader only signed with the key of this run and in sequence: an unsigned line, one
    signed with another key, a replay, and a result for a test that was not collected are dropped and counted."""
    from minisgl_ref.course import plugin

    key, other = b"k" * plugin.KEY_BYTES, b"o" * plugin.KEY_BYTES
    collected = [_record("0.1", "tests/t.py::test_a", "not run"), _record("0.1", "tests/t.py::test_b", "not run")]

    def line(message: dict, seq: int, k: bytes = key) -> bytes:
        body = json.dumps({**message, "seq": seq}).encode()
        return plugin.sign(k, body) + b" " + body + b"\n"

    passed_b = {"kind": "result", "record": {**collected[1], "outcome": "passed"}}
    data = line({"kind": "collected", "records": collected}, 0)
    data += b"0" * 64 + b" " + json.dumps({**passed_b, "seq": 1}).encode() + b"\n"  # unsigned
    data += line(passed_b, 1, other)  # another key
    data += line({"kind": "result", "record": {**collected[0], "outcome": "failed"}}, 1)
    data += line(passed_b, 1)  # a replayed sequence number
    data += line({"kind": "result", "record": _record("0.1", "tests/t.py::test_new", "passed")}, 2)
    data += line({"kind": "finished", "exitstatus": 1}, 3)
    run = grade.read_channel(key, data)
    assert run.forged == 3 and run.exitstatus == 1
    assert {r["nodeid"]: r["outcome"] for r in run.records} == {"tests/t.py::test_a": "failed",
                                                                "tests/t.py::test_b": "not run"}
    with pytest.raises(RuntimeError, match="collected"):
        grade.read_channel(key, line({"kind": "collected", "records": collected}, 0, other))


# ---------------------------------------------------------------------------- the static check of submissions


def test_no_reference_region_is_refused() -> None:
    assert screen.screen_tree(ROOT) == {}


@pytest.mark.parametrize("body,construct", [
    (["import os", "os._exit(0)"], "imports os"),
    (["from minisgl_ref.course import plugin", "return q"], "imports from minisgl_ref.course"),
    (["from ..course import grade", "return q"], "imports from minisgl_ref.course"),
    (["import pytest", "return q"], "imports pytest"),
    (["import _pytest.runner", "return q"], "imports _pytest.runner"),
    (["import conftest", "return q"], "imports conftest"),
    (["import __editable___minisgl_ref_finder", "return q"], "imports __editable___minisgl_ref_finder"),
    (["import ctypes", "return q"], "imports ctypes"),
    (["import subprocess", "return q"], "imports subprocess"),
    (["m = __import__('o' + 's')", "return q"], "uses __import__"),
    (["exec('x = 1')", "return q"], "uses exec"),
    (["f = open('/autograder/results/results.json', 'w')", "return q"], "uses open"),
    (["x = torch.sys.modules", "return q"], "uses the attribute .sys"),
    (["torch.os._exit(0)"], "uses the attribute ._exit"),
    (["b = getattr(torch, 'o' + 's')", "return q"], "getattr with a computed name"),
    (["torch.testing.assert_close = lambda *a, **k: None", "return q"], "monkeypatching the module-level torch"),
    (["global reference_attention", "return q"], "declares global reference_attention"),
    (["return q", "<import os", "<def _after():", "pass"], "code outside the function"),
    (["return (q"], "does not parse"),
])
def test_the_static_check_refuses_escapes_naming_the_task_and_the_construct(body: list[str], construct: str) -> None:
    path = "minisgl_ref/attention/torch_native.py"
    text = (ROOT / path).read_text(encoding="utf-8")
    rs = regions.scan_text(text, path)
    lines = [line[1:] if line.startswith("<") else "    " + line for line in body]  # "<": at column 0
    submitted = regions.fill_text(text, rs, {("0.1", 0): lines})
    refused = screen.screen_text(submitted, path)
    assert list(refused) == ["0.1"], refused
    assert any(construct in why and why.startswith(path) for why in refused["0.1"]), refused


def test_a_grade_that_cannot_run_still_writes_a_report_with_the_reason(tmp_path: Path) -> None:
    """Gradescope's script hands its place to the grader, so the grader itself must leave a results.json when it
    cannot grade: here a syntax error outside every task region."""
    out = tmp_path / "copy"
    student.make_copy(ROOT, out, ["0.1"], commit=False)
    path = out / "minisgl_ref/attention/torch_native.py"
    path.write_text(path.read_text(encoding="utf-8") + "\ndef broken(:\n", encoding="utf-8")
    results = tmp_path / "results.json"
    proc = course("grade", "--task", "0.1", "--json", str(results), cwd=out, check=False)
    assert proc.returncode == 2
    report = json.loads(results.read_text(encoding="utf-8"))
    assert report["score"] == 0 and "syntax error outside every task region" in report["output"]
