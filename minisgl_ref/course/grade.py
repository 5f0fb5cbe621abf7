"""Grading: run the tests of some tasks where the submission cannot touch the result, turn them into points, and
write a report Gradescope reads as is.

**Points.** They come from ``tasks.toml``, not from test counts: a task's points are split over its *checks* (one
test function with all its parametrized cases; a check passes when every case passes), so partial credit means
"some of the task's checks pass". Each check has a weight (``@pytest.mark.task("4.3", weight=3)``; 1 by default)
and gets its weight's share of the task: a check that catches a severe bug (wrong tokens, a lost request, a
stall, a leak, a race, a locked node evicted) weighs more than one about a detail, so that such a bug costs most
of the task's points rather than one check's even share. The split is exact, in thousandths of a point (10
points over 3 checks of weight 1 are 3.334, 3.333 and 3.333), so the checks' scores add up to the task's and the
tasks' to the total. A check that
needs a GPU on a machine without one (or a package the machine lacks) is *blocked*: reported, worth nothing, and
its share goes to the task's other checks, so a task is worth its full points on any machine. A task whose every
check is blocked cannot be graded there: it is reported out of 0, and the total says so. A failure caused by
another task's ``NotImplementedError`` says "depends on task x.y".

**Where the submission runs, and what it can reach.** The student's code runs only in a child process. The
grader (this module, in the parent process) imports the grader, the task table and the region scanner, never
the engine, and it has measured the machine (:func:`environment`) before any student code runs. It then

1. reads every task region of the copy with :mod:`minisgl_ref.course.screen` and refuses the regions that reach
   for the process, the interpreter or the grader (a refused task scores 0, as if blank, with the reason);
2. copies the checkout to a fresh temporary folder and blanks the refused regions there, so that no test, of the
   refused task or another, runs their code;
3. runs pytest there as the leader of a new process group (``start_new_session``), with the grader's plugin reading
   a fresh random key from a pipe before any test module is imported; the plugin signs every record it sends back on
   a second pipe, and the parent keeps only lines whose signature and sequence number check out
   (:func:`read_channel`). Nothing is read back from a file the child could write, and the parent writes the report
   itself, after the child and any process left in its process group are gone.

What this stops: a submission that writes or rewrites a report file, fakes records on the pipe, calls
``os._exit(0)`` halfway (the tests without a signed record count as not run, hence failed), patches the plugin or
the assertions (refused statically), or imports the reference or the grader (refused statically). Where it stops:
the child runs with the grading user's rights, so code that slips past the static check could read the key out of
the plugin's memory, or write files that a process started later would read (which is why the Gradescope script
in docs/course/instructor.md ends by handing its place to the grader, and the grader writes a report even when it
fails: no process starts after the submission's code has run). Running the tests as a user who cannot write the
grader's files would close the second gap; the static check and a look at surprising scores cover the first.
"""

from __future__ import annotations

import hmac
import json
import os
import platform
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from minisgl_ref.course import regions, screen
from minisgl_ref.course.plugin import CHANNEL_ENV, KEY_BYTES, sign
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
    def weight(self) -> int:
        """Its weight in the task's split (every case of one test function carries the same)."""
        return max(int(c.get("weight", 1)) for c in self.cases) if self.cases else 1

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
    """The test files under ``root/tests`` that mark a test with one of ``task_ids`` (``pytest.mark.task("2.1"``
    written out, with or without a weight after it, as every graded test is), or ``["tests"]`` when ``task_ids``
    holds ``*`` or no file matches.

    Collecting only these files is what makes grading one task quick: importing every test module of the
    project takes pytest several seconds before the first test runs."""
    if "*" in task_ids:
        return ["tests"]
    marks = [f'mark.task("{task}"' for task in task_ids]  # the closing quote: "5.1" never matches "5.10"
    found = [path.relative_to(root).as_posix() for path in sorted((root / "tests").glob("test_*.py"))
             if any(mark in path.read_text(encoding="utf-8") for mark in marks)]
    return found or ["tests"]


@dataclass
class Run:
    """What one pytest child reported through the channel."""

    records: list[dict[str, Any]]
    forged: int = 0  # lines on the channel without a valid signature (written by the tested code), dropped
    exitstatus: int | None = None  # pytest's, as its plugin signed it; None when the test run never finished


def read_channel(key: bytes, data: bytes) -> Run:
    """The records of the lines in ``data`` signed with ``key``, in order. A line that is unsigned, signed with
    another key, out of sequence, or about a test that was not collected is counted as forged and dropped; a
    test without a signed result stays "not run", which fails its check."""
    records: dict[str, dict[str, Any]] = {}
    forged, expected, exitstatus, collected = 0, 0, None, False
    for line in data.split(b"\n"):
        if not line:
            continue
        mac, _, body = line.partition(b" ")
        try:
            message = json.loads(body) if hmac.compare_digest(mac, sign(key, body)) else None
        except ValueError:
            message = None
        if not isinstance(message, dict) or message.get("seq") != expected:
            forged += 1
            continue
        expected += 1
        kind = message.get("kind")
        if kind == "collected" and not collected:
            collected = True
            records = {r["nodeid"]: r for r in message["records"]}
        elif kind == "result" and message["record"]["nodeid"] in records:
            records[message["record"]["nodeid"]] = message["record"]
        elif kind == "finished":
            exitstatus = int(message["exitstatus"])
    if not collected:
        raise RuntimeError("pytest stopped before it reported which tests it collected")
    return Run(list(records.values()), forged, exitstatus)


def _drain(fd: int, chunks: list[bytes]) -> None:
    with os.fdopen(fd, "rb", buffering=0) as pipe:
        while chunk := pipe.read(65536):
            chunks.append(chunk)


def _end_session(pid: int) -> None:
    """Kill whatever the child left running in its process group (a server it started, a process it forked)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_checked(
    root: Path, task_ids: Sequence[str], *, files: Sequence[str] | None = None, fail_fast: bool = False,
    timeout_s: int = DEFAULT_TIMEOUT_S, quiet: bool = True, env: dict[str, str] | None = None,
) -> Run:
    """Run the tests of ``task_ids`` under ``root`` in a fresh pytest process and read its signed records (one
    per test case). Only ``files`` are collected (default: the files that hold those tests,
    :func:`task_test_files`)."""
    if not task_ids:
        return Run([])
    if files is None:
        files = task_test_files(root, task_ids)
    cmd = [
        sys.executable, "-m", "pytest", "-p", "minisgl_ref.course.plugin", "-p", "no:cacheprovider",
        f"--course-tasks={','.join(task_ids)}", f"--timeout={timeout_s}",
        "--ignore=tests/test_site_browser.py", "-o", "addopts=", "-q" if quiet else "-v", "-rN",
        *(["-x"] if fail_fast else []), *files,
    ]
    run_env = dict(os.environ if env is None else env)
    run_env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [run_env.get("PYTHONPATH")])])
    run_env.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    key = secrets.token_bytes(KEY_BYTES)
    key_r, key_w = os.pipe()
    os.write(key_w, key)  # 32 bytes: always fits in the pipe, which the child reads before anything else
    os.close(key_w)
    out_r, out_w = os.pipe()
    run_env[CHANNEL_ENV] = f"{key_r},{out_w}"
    chunks: list[bytes] = []
    reader = threading.Thread(target=_drain, args=(out_r, chunks), daemon=True)
    reader.start()
    pipe = subprocess.PIPE if quiet else None
    try:
        proc = subprocess.Popen(cmd, cwd=root, env=run_env, stdout=pipe, stderr=pipe, text=True,
                                errors="replace", pass_fds=(key_r, out_w), start_new_session=True)
    finally:
        os.close(key_r)
        os.close(out_w)
    try:
        stdout, stderr = proc.communicate()
    finally:
        _end_session(proc.pid)
    reader.join(timeout=30)  # a process that left the group may still hold the pipe: stop waiting for it
    try:
        return read_channel(key, b"".join(chunks))
    except RuntimeError as e:
        out = (stdout or "")[-3000:] + (stderr or "")[-3000:] if quiet else ""
        raise RuntimeError(f"{e} (exit {proc.returncode}):\n{out}") from None


def run_tests(root: Path, task_ids: Sequence[str], **kwargs: Any) -> list[dict[str, Any]]:
    """The records of :func:`run_checked` alone."""
    return run_checked(root, task_ids, **kwargs).records


#: What a grading copy leaves out: version control, environments, build output and caches.
NOT_COPIED = (".git", ".venv", "venv", "build", "site", "node_modules", "__pycache__", "*.pyc", ".pytest_cache",
              ".mypy_cache", ".ruff_cache", ".hypothesis", "*.egg-info", ".ipynb_checkpoints")


def grading_copy(root: Path, dest: Path) -> None:
    """Copy the checkout at ``root`` (a student copy or the reference) to ``dest`` for one grading run."""
    shutil.copytree(root, dest, symlinks=True, ignore=shutil.ignore_patterns(*NOT_COPIED))


def grade(root: Path, tasks: Sequence[Task], *, timeout_s: int = DEFAULT_TIMEOUT_S, quiet: bool = True,
          env: dict[str, str] | None = None) -> dict[str, Any]:
    """Grade ``tasks`` of the checkout at ``root``: screen its regions, run the tests of the tasks not refused in
    a child process on a scratch copy, and return the report (:func:`report`). See the module's docstring for
    what each step guards against."""
    start = time.perf_counter()
    refused_all = screen.screen_tree(root)
    machine = environment()  # before any submitted code runs
    refused = {t.id: refused_all[t.id] for t in tasks if t.id in refused_all}
    with tempfile.TemporaryDirectory(prefix="minisgl-grade-", ignore_cleanup_errors=True) as tmp:
        scratch = Path(tmp) / "copy"
        grading_copy(root, scratch)
        screen.blank_refused(scratch, refused_all)
        run = run_checked(scratch, [t.id for t in tasks if t.id not in refused], timeout_s=timeout_s,
                          quiet=quiet, env=env)
    result = report(tasks, run.records, time.perf_counter() - start, refused=refused, forged=run.forged,
                    machine=machine)
    elsewhere = sorted(set(refused_all) - set(refused), key=regions.task_key)
    if elsewhere:  # not graded now, but blanked: a check that runs their code says "depends on" them
        result["output"] += (f" The regions of task(s) {', '.join(elsewhere)}, not graded here, were refused by "
                             "the static check and ran blank.")
        result["extra_data"]["refused_elsewhere"] = {t: refused_all[t] for t in elsewhere}
    return result


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
    for name in ("transformers", "triton", "pytest", "hypothesis"):  # from their metadata: importing is slow
        try:
            info[name] = metadata.version(name)
        except metadata.PackageNotFoundError:  # a missing optional package is just not reported
            info[name] = None
    return info


UNITS = 1000  #: a point in the report's unit: scores are whole thousandths of a point, so their sums are exact


def split(units: int, n: int) -> list[int]:
    """``units`` split over ``n`` shares as evenly as whole units allow, the larger shares first."""
    return split_weighted(units, [1] * n)


def split_weighted(units: int, weights: Sequence[int]) -> list[int]:
    """``units`` split in proportion to ``weights``, in whole units that add up to ``units`` exactly: each share
    is rounded down, and the units left over go one each to the shares that lost the most by rounding (the
    earlier first among equals)."""
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"weights must add up to more than 0: {list(weights)}")
    shares = [units * w // total for w in weights]
    lost = sorted(range(len(weights)), key=lambda i: (-(units * weights[i] % total), i))
    for i in lost[: units - sum(shares)]:
        shares[i] += 1
    return shares


def points(units: int) -> float | int:
    """A score in the report: an int when whole, else thousandths (whose decimal text is exact)."""
    return units // UNITS if units % UNITS == 0 else round(units / UNITS, 3)


def check_names(tasks: Sequence[Task], checks: dict[str, list[Check]]) -> dict[tuple[str, str], str]:
    """(task, check) -> its name in the report, unique over the report: the test function's name, qualified by
    its file (and class) where two checks of one report share a function name."""
    short = {(task.id, c.name): f"Task {task.id} ({task.title}): {c.name.split('::')[-1]}"
             for task in tasks for c in checks.get(task.id, [])}
    counts: dict[str, int] = {}
    for name in short.values():
        counts[name] = counts.get(name, 0) + 1
    names: dict[tuple[str, str], str] = {}
    used: set[str] = set()
    for (task_id, check), name in short.items():
        if counts[name] > 1:
            name = f"{name.rsplit(': ', 1)[0]}: {check}"
        unique, n = name, 2
        while unique in used:
            unique, n = f"{name} #{n}", n + 1
        used.add(unique)
        names[(task_id, check)] = unique
    return names


def report(tasks: Sequence[Task], records: list[dict[str, Any]], seconds: float, *,
           refused: dict[str, list[str]] | None = None, forged: int = 0,
           machine: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Gradescope-format report of ``tasks`` from the test ``records``; ``refused`` tasks (task id -> why,
    from the static check) score 0 without their tests; ``forged`` counts the unsigned lines the run dropped."""
    refused = refused or {}
    checks = checks_of(records)
    names = check_names(tasks, checks)
    tests, summary = [], []
    total = total_max = 0
    for task in tasks:
        units = round(task.points * UNITS)
        mine = [] if task.id in refused else checks.get(task.id, [])
        counted = [c for c in mine if c.outcome != "blocked"]
        shares = (dict(zip((c.name for c in counted), split_weighted(units, [c.weight for c in counted])))
                  if counted else {})
        earned = 0
        for check in mine:
            share = shares.get(check.name, 0)
            score = share if check.outcome == "passed" else 0
            earned += score
            cases = [c["outcome"] for c in check.cases]
            entry: dict[str, Any] = {
                "name": names[(task.id, check.name)], "score": points(score), "max_score": points(share),
                "output": explain(check, task), "visibility": task.visibility,
                "extra_data": {"task": task.id, "check": check.name, "outcome": check.outcome,
                               "weight": check.weight, "cases": len(cases), "cases_passed": cases.count("passed")},
            }
            if check.outcome == "blocked":
                entry["output"] += ("\nIts share goes to the task's other checks." if counted else
                                    "\nEvery check of this task is blocked here: grade it on a machine that can "
                                    "run them.")
            else:
                entry["status"] = "passed" if check.outcome == "passed" else "failed"
            tests.append(entry)
        possible = sum(shares.values())
        if task.id in refused or not mine:
            why = ("Refused by the grader's check of the submitted code (scored as if blank):\n"
                   + "\n".join(refused[task.id]) if task.id in refused else "no tests of this task were found")
            tests.append({"name": f"Task {task.id} ({task.title})", "score": 0, "max_score": points(units),
                          "status": "failed", "output": why, "visibility": task.visibility,
                          "extra_data": {"task": task.id, "outcome": "refused" if task.id in refused else "failed"}})
            possible = units
        outcomes = [c.outcome for c in mine]
        total, total_max = total + earned, total_max + possible
        summary.append({
            "task": task.id, "title": task.title, "score": points(earned), "max_score": points(possible),
            "points": task.points, "checks": len(mine), "passed": outcomes.count("passed"),
            "failed": outcomes.count("failed") + (0 if mine else 1), "blocked": outcomes.count("blocked"),
            "refused": refused.get(task.id, []),
        })
    blocked = sum(s["blocked"] for s in summary)
    ungraded = [s["task"] for s in summary if s["checks"] and s["checks"] == s["blocked"]]
    output = f"{points(total):g} / {points(total_max):g} points over {len(tasks)} task(s)."
    if blocked:
        output += (f" {blocked} check(s) blocked on this machine (a GPU or a package it lacks); their shares went "
                   "to their tasks' other checks.")
    if ungraded:
        output += (f" Task(s) {', '.join(ungraded)} could not be graded here (every check blocked) and count 0 of "
                   f"0: the full total is {points(sum(round(t.points * UNITS) for t in tasks)):g}.")
    if refused:
        output += f" Refused by the static check: task(s) {', '.join(refused)}."
    if forged:
        output += f" {forged} unsigned line(s) on the grader's channel were ignored."
    return {
        "score": points(total), "max_score": points(total_max), "execution_time": round(seconds, 1),
        "output": output, "tests": tests,
        "extra_data": {"tasks": summary, "forged_lines": forged,
                       "environment": machine if machine is not None else environment(),
                       "time": time.strftime("%Y-%m-%d %H:%M")},
    }


def failure_report(reason: str) -> dict[str, Any]:
    """The report of a grading that could not happen (the code does not parse outside a task region, a task
    marker was removed, pytest could not start): 0 points and the reason."""
    return {"score": 0, "output": "The grader could not run (a syntax error outside the task regions, an import "
            f"error, a task marker removed?):\n{reason[-6000:]}", "tests": []}


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
