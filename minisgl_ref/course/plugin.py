"""The grader's pytest plugin: runs only the tests of the chosen tasks and records what happened to each.

Loaded with ``pytest -p minisgl_ref.course.plugin --course-tasks 4.1,4.2 --course-report out.json``. It keeps the
tests whose ``@pytest.mark.task`` id is chosen, makes hypothesis derandomized (the same examples on every run, so
a grade never depends on luck), and writes one record per test: its task, its check (the test function, all
parametrized cases together), the check's weight (``@pytest.mark.task("4.3", weight=3)``, 1 when not given),
whether it needs a GPU, the outcome and the line of the error a student needs.

The grader reads those records through a *channel*, not a file (see :mod:`minisgl_ref.course.grade`): it starts
pytest with ``MINISGL_COURSE_CHANNEL=KEY_FD,OUT_FD`` and two inherited pipe ends. When pytest loads it, before any
conftest or test module is imported, this plugin reads a fresh random key from ``KEY_FD``, closes it, and from then on writes each
message to ``OUT_FD`` as one line ``HMAC-SHA256(key, body) body``, with a sequence number inside the body: the
collected tests, then each test's record as soon as the test is over, then the end of the run. The key exists
only in the grader and in this plugin's closure, so a line the tested code writes on the same pipe does not carry
a valid signature, and the grader drops it. ``--course-report FILE`` still writes the records to a file, for
tools that only collect (it is not what grading trusts).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

CHANNEL_ENV = "MINISGL_COURSE_CHANNEL"
KEY_BYTES = 32


def sign(key: bytes, body: bytes) -> bytes:
    """The hex HMAC-SHA256 of one message body: what makes a line the plugin's."""
    return hmac.new(key, body, hashlib.sha256).hexdigest().encode()


def _open_channel() -> Callable[[dict[str, Any]], None] | None:
    """Read the key and return the function that sends a message, or ``None`` when no grader asked for one."""
    spec = os.environ.pop(CHANNEL_ENV, "")
    if not spec:
        return None
    key_fd, out_fd = (int(x) for x in spec.split(","))
    key = b""
    while len(key) < KEY_BYTES:
        chunk = os.read(key_fd, KEY_BYTES - len(key))
        if not chunk:
            break
        key += chunk
    os.close(key_fd)
    os.set_inheritable(out_fd, False)  # the tests' own subprocesses (a server) get no copy
    counter = itertools.count()

    def send(message: dict[str, Any]) -> None:
        body = json.dumps({**message, "seq": next(counter)}, separators=(",", ":")).encode()
        view = memoryview(sign(key, body) + b" " + body + b"\n")
        while view:
            view = view[os.write(out_fd, view):]

    return send


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("course")
    group.addoption("--course-tasks", default="", help="comma-separated task ids to run (e.g. 4.1,4.2); * for all")
    group.addoption("--course-report", default="", help="write one JSON record per test here")


def pytest_configure(config: pytest.Config) -> None:
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:  # pragma: no cover - hypothesis is a dev dependency
        return
    settings.register_profile(
        "course", derandomize=True, deadline=None, print_blob=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    settings.load_profile("course")
    config.stash[_RECORDS] = {}


_RECORDS = pytest.StashKey[dict[str, dict[str, Any]]]()
# Opened when pytest imports this plugin (``-p``), before it loads a conftest or a test module: no tested code
# has run yet when the key is read and its pipe closed.
_SEND: dict[str, Callable[[dict[str, Any]], None]] = {}
if (_sender := _open_channel()) is not None:
    _SEND["send"] = _sender
del _sender


# Fixtures that load a model: the checks using them run after the plain unit checks of the same selection.
MODEL_FIXTURES = frozenset({"tiny_llm", "smol_llm", "tiny_engine_path", "tiny_checkpoints", "embedded_path"})


def task_of(item: pytest.Item) -> str | None:
    marks = [m.args[0] for m in item.iter_markers("task") if m.args]
    return marks[0] if marks else None


def weight_of(item: pytest.Item) -> int:
    """The check's weight within its task: ``@pytest.mark.task("4.3", weight=3)`` makes it worth three times a
    check of weight 1 (the default). A check that catches lost requests, wrong tokens, stalls, leaks or races
    weighs more than one about a detail, so such a bug costs most of its task's points."""
    marks = [m for m in item.iter_markers("task") if m.args]
    weight = marks[0].kwargs.get("weight", 1) if marks else 1
    if not isinstance(weight, int) or isinstance(weight, bool) or weight < 1:
        raise pytest.UsageError(f"{item.nodeid}: a task's weight is a whole number >= 1, not {weight!r}")
    return weight


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = {t.strip() for t in config.getoption("--course-tasks").split(",") if t.strip()}
    if not wanted:
        return
    keep, drop = [], []
    for item in items:
        task = task_of(item)
        (keep if task is not None and ("*" in wanted or task in wanted) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    # Unit checks first, model-backed ones after (a stable sort: file order otherwise kept). Most mistakes are
    # caught by a unit check in seconds, so a grade that stops at the first failure (-x) answers quickly.
    keep.sort(key=lambda item: bool(MODEL_FIXTURES & set(getattr(item, "fixturenames", ()))))
    items[:] = keep
    records = config.stash[_RECORDS]
    for item in keep:
        records[item.nodeid] = {
            "nodeid": item.nodeid,
            "check": item.nodeid.split("[", 1)[0],
            "task": task_of(item),
            "marks": [m.args[0] for m in item.iter_markers("task") if m.args],
            "weight": weight_of(item),
            "gpu": "gpu" in item.keywords,
            "outcome": "not run",
            "message": "",
            "seconds": 0.0,
        }
    _send({"kind": "collected", "records": list(records.values())})


def _send(message: dict[str, Any]) -> None:
    send = _SEND.get("send")
    if send is not None:
        send(message)


def _message(report: pytest.TestReport) -> str:
    """The error line a student needs: the exception (for a failure) or the reason (for a skip)."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (file, line, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    text = report.longreprtext
    if crash is not None and crash.message:
        head = crash.message
        # the whole text too, for errors raised in another process and re-raised here with their message inside
        return head if "Task " in head or "Task " not in text else head + "\n" + _task_lines(text)
    return text[-2000:]


def _task_lines(text: str) -> str:
    return "\n".join(line.strip() for line in text.splitlines() if "NotImplementedError: Task " in line)[:2000]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    config = _CONFIG.get("config")
    if config is None:
        return
    record = config.stash[_RECORDS].get(report.nodeid)
    if record is None:
        return
    record["seconds"] += report.duration
    if report.failed:
        if record["outcome"] != "failed":
            record["message"] = _message(report)
        record["outcome"] = "failed"
    elif report.skipped and record["outcome"] != "failed":
        record["outcome"] = "skipped"
        record["message"] = _message(report)
    elif report.when == "call" and report.passed and record["outcome"] == "not run":
        record["outcome"] = "passed"
    if report.when == "teardown":  # the test is over: its record is final
        _send({"kind": "result", "record": record})


_CONFIG: dict[str, pytest.Config] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    _CONFIG["config"] = session.config


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _send({"kind": "finished", "exitstatus": int(exitstatus)})
    path = session.config.getoption("--course-report")
    if path:
        records = list(session.config.stash.get(_RECORDS, {}).values())
        Path(path).write_text(json.dumps(records, indent=1), encoding="utf-8")
