"""Grading: run the tests of some tasks, turn them into points, and write a report Gradescope reads as is.

Points come from ``tasks.toml``, not from test counts: a task's points are split evenly over its *checks* (one
test function with all its parametrized cases; a check passes when every case passes), so partial credit means
"some of the task's checks pass". A check that needs a GPU on a machine without one is *blocked*: reported, but
counted in neither the score nor the maximum. A failure caused by another task's ``NotImplementedError`` says
"depends on task x.y", so a student sees which unfinished task stands in the way.

The report follows Gradescope's autograder format (``score``, ``tests[]`` with ``name``, ``score``,
``max_score``, ``status``, ``output``, ``visibility``), with versions and the GPU name in ``extra_data``.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minisgl_ref.course.table import Task

# "NotImplementedError: Task 4.1" in a traceback, or NotImplementedError('Task 4.1: ...') in the repr of an error
# passed on from another process (a server's scheduler reports an aborted request that way).
DEPENDS = re.compile(r"NotImplementedError(?::\s*|\(\s*['\"])Task (\d+\.\d+)")
DEFAULT_TIMEOUT_S = 120


@dataclass
class Check:
    """One test function of a task, all its parametrized cases together."""

    name: str
    task: str
    cases: list[dict[str, Any]] = field(default_factory=list)

    @property
    def outcome(self) -> str:
        outcomes = {c["outcome"] for c in self.cases}
        if outcomes & {"failed", "not run"}:
            return "failed"
        if "passed" in outcomes:
            return "passed"
        return "blocked"  # every case skipped: needs a GPU (or a package) this machine lacks

    @property
    def message(self) -> str:
        bad = [c for c in self.cases if c["outcome"] in ("failed", "not run")]
        if bad:
            c = bad[0]
            more = f" (and {len(bad) - 1} more of its {len(self.cases)} cases)" if len(bad) > 1 else ""
            return f"{c['nodeid']}{more}:\n{c['message'] or 'did not run (a time limit or a crash stopped it)'}"
        if self.outcome == "blocked":
            return "blocked: " + (self.cases[0]["message"] or "skipped on this machine")
        return ""


def task_test_files(root: Path, task_ids: Sequence[str]) -> list[str]:
    """The test files under ``root/tests`` that mark a test with one of ``task_ids`` (``pytest.mark.task("2.1")``
    written out, as every graded test is), or ``["tests"]`` when ``task_ids`` holds ``*`` or no file matches.

    Collecting only these files is what makes grading one task quick: importing every test module of the
    project takes pytest several seconds before the first test runs."""
    if "*" in task_ids:
        return ["tests"]
    marks = [f'mark.task("{task}")' for task in task_ids]
    found = [path.relative_to(root).as_posix() for path in sorted((root / "tests").glob("test_*.py"))
             if any(mark in path.read_text(encoding="utf-8") for mark in marks)]
    return found or ["tests"]


def run_tests(
    root: Path, task_ids: Sequence[str], *, files: Sequence[str] | None = None, fail_fast: bool = False,
    timeout_s: int = DEFAULT_TIMEOUT_S, quiet: bool = True, env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Run the tests of ``task_ids`` under ``root`` in a fresh pytest process; one record per test case. Only
    ``files`` are collected (default: the files that hold those tests, :func:`task_test_files`)."""
    if files is None:
        files = task_test_files(root, task_ids)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "records.json"
        cmd = [
            sys.executable, "-m", "pytest", "-p", "minisgl_ref.course.plugin", "-p", "no:cacheprovider",
            f"--course-tasks={','.join(task_ids)}", f"--course-report={report}", f"--timeout={timeout_s}",
            "--ignore=tests/test_site_browser.py", "-o", "addopts=", "-q" if quiet else "-v", "-rN",
            *(["-x"] if fail_fast else []), *files,
        ]
        run_env = dict(os.environ if env is None else env)
        run_env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [run_env.get("PYTHONPATH")])])
        run_env.setdefault("PYTHONDONTWRITEBYTECODE", "1")
        proc = subprocess.run(cmd, cwd=root, env=run_env, capture_output=quiet, text=True)
        if not report.exists():
            out = (proc.stdout or "")[-3000:] + (proc.stderr or "")[-3000:] if quiet else ""
            raise RuntimeError(f"pytest stopped before it could report (exit {proc.returncode}):\n{out}")
        return json.loads(report.read_text(encoding="utf-8"))


def checks_of(records: list[dict[str, Any]]) -> dict[str, list[Check]]:
    """task id -> its checks, in the order pytest ran them."""
    by_task: dict[str, dict[str, Check]] = {}
    for rec in records:
        checks = by_task.setdefault(rec["task"], {})
        checks.setdefault(rec["check"], Check(rec["check"], rec["task"])).cases.append(rec)
    return {task: list(checks.values()) for task, checks in by_task.items()}


def explain(check: Check, task: Task) -> str:
    """The check's message, led by what a student should do about it."""
    if check.outcome != "failed":
        return check.message
    found = DEPENDS.findall(check.message)
    if task.id in found:
        return f"Task {task.id} is not implemented yet.\n{check.message}"
    if found:
        return f"depends on task {found[0]}, which is not implemented yet.\n{check.message}"
    return check.message


def environment() -> dict[str, Any]:
    """Versions and the GPU: what a grade was measured on."""
    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:  # pragma: no cover
        info["torch"], info["gpu"] = None, None
    import minisgl_ref

    info["minisgl_ref"] = minisgl_ref.__version__
    for name in ("transformers", "triton", "pytest", "hypothesis"):
        try:
            info[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - a missing optional package is just not reported
            info[name] = None
    return info


def report(tasks: Sequence[Task], records: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """The Gradescope-format report of ``tasks`` from the test ``records``."""
    checks = checks_of(records)
    tests, summary = [], []
    for task in tasks:
        mine = checks.get(task.id, [])
        share = task.points / len(mine) if mine else 0.0
        earned = possible = 0.0
        for check in mine:
            counted = check.outcome != "blocked"
            score = share if check.outcome == "passed" else 0.0
            earned, possible = earned + score, possible + (share if counted else 0.0)
            entry: dict[str, Any] = {
                "name": f"Task {task.id} ({task.title}): {check.name.split('::')[-1]}",
                "score": round(score, 3), "max_score": round(share if counted else 0.0, 3),
                "output": explain(check, task), "visibility": task.visibility,
                "extra_data": {"task": task.id, "check": check.name, "outcome": check.outcome},
            }
            if counted:
                entry["status"] = "passed" if check.outcome == "passed" else "failed"
            tests.append(entry)
        if not mine:
            tests.append({"name": f"Task {task.id} ({task.title})", "score": 0.0, "max_score": task.points,
                          "status": "failed", "output": "no tests of this task were found",
                          "visibility": task.visibility, "extra_data": {"task": task.id, "outcome": "failed"}})
            possible = task.points
        outcomes = [c.outcome for c in mine]
        summary.append({
            "task": task.id, "title": task.title, "score": round(earned, 3), "max_score": round(possible, 3),
            "points": task.points, "checks": len(mine), "passed": outcomes.count("passed"),
            "failed": outcomes.count("failed") + (0 if mine else 1), "blocked": outcomes.count("blocked"),
        })
    score = round(sum(s["score"] for s in summary), 3)
    max_score = round(sum(s["max_score"] for s in summary), 3)
    blocked = sum(s["blocked"] for s in summary)
    output = f"{score:g} / {max_score:g} points over {len(tasks)} task(s)."
    if blocked:
        output += f" {blocked} GPU-only check(s) blocked on this machine (not counted)."
    return {
        "score": score, "max_score": max_score, "execution_time": round(seconds, 1), "output": output,
        "tests": tests,
        "extra_data": {"tasks": summary, "environment": environment(), "time": time.strftime("%Y-%m-%d %H:%M")},
    }


def render(result: dict[str, Any]) -> str:
    """The report as a student reads it in a terminal."""
    lines = []
    by_task: dict[str, list[dict[str, Any]]] = {}
    for t in result["tests"]:
        by_task.setdefault(t["extra_data"]["task"], []).append(t)
    for s in result["extra_data"]["tasks"]:
        note = f", {s['blocked']} blocked" if s["blocked"] else ""
        lines.append(f"Task {s['task']:>5}  {s['title'][:48]:<48} {s['score']:>6g} / {s['max_score']:<6g}"
                     f" ({s['passed']} of {s['checks']} checks passed{note})")
        for t in by_task.get(s["task"], []):
            if t.get("status") == "failed":
                first = "\n".join(t["output"].splitlines()[:3])
                lines.append("        x " + first.replace("\n", "\n          "))
    env = result["extra_data"]["environment"]
    lines.append(f"Total: {result['output']}  (GPU: {env.get('gpu') or 'none'}; {result['execution_time']:g} s)")
    return "\n".join(lines)
