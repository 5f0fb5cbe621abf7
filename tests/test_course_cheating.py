"""Cheating does not pay: submissions that forge the grader's report, import the reference solution, or
hard-code an answer score what a blank submission scores, graded the way an instructor grades them on
Gradescope (the ``run_autograder`` script of docs/course/instructor.md, run as written on a copy whose chapter-00
tasks are blank). A run with the reference's code for one task, and a run of the same cheats without the static
check, show that these runs can give points: the cheats are real, and what stops them is the grader."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from minisgl_ref.course import grade, regions, screen, student, table

ROOT = Path(__file__).resolve().parents[1]
CHAPTER0 = ["0.1", "0.2", "0.3"]
FILES = {"0.1": "minisgl_ref/attention/torch_native.py", "0.2": "minisgl_ref/core/request.py",
         "0.3": "minisgl_ref/engine/naive.py"}


def run_autograder_script() -> str:
    """The ``run_autograder`` of the instructor's guide, as written there, set to grade chapter 00."""
    page = (ROOT / "docs/course/instructor.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", page, flags=re.S)
    script = next(b for b in blocks if "once per submission" in b)
    assert "CHAPTERS=3-4 " in script
    return script.replace("CHAPTERS=3-4 ", "CHAPTERS=0 ", 1)


@pytest.fixture(scope="module")
def handout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The autograder's copy: chapter 00's tasks blank, no git, the documented run_autograder beside it."""
    out = tmp_path_factory.mktemp("handout") / "source"
    student.make_copy(ROOT, out, CHAPTER0, commit=False)
    (out / "run_autograder").write_text(run_autograder_script(), encoding="utf-8")
    return out


def with_bodies(text: str, path: str, bodies: dict[str, list[str]]) -> str:
    """``text`` with the (single) region of each task in ``bodies`` replaced by those lines, indented."""
    rs = regions.scan_text(text, path)
    indent = {r.task: r.indent for r in rs}
    return regions.fill_text(text, rs, {(task, 0): [indent[task] + line if line else line for line in lines]
                                        for task, lines in bodies.items()})


def submit(handout: Path, bodies: dict[str, list[str]], where: Path) -> dict[str, Any]:
    """Run the documented run_autograder on a fresh copy of ``handout`` with a submission whose regions hold
    ``bodies`` (the other tasks as handed out); the results.json it wrote."""
    ag = where / "autograder"
    shutil.copytree(handout, ag / "source")
    sub = ag / "submission"
    sub.mkdir(parents=True)
    for task, path in FILES.items():
        if task in bodies:
            text = (handout / path).read_text(encoding="utf-8")
            (sub / path).parent.mkdir(parents=True, exist_ok=True)
            (sub / path).write_text(with_bodies(text, path, {task: bodies[task]}), encoding="utf-8")
    env = dict(os.environ, AUTOGRADER=str(ag), PY=sys.executable, PYTHONPATH=str(ag / "source"),
               PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run(["bash", str(ag / "source/run_autograder")], env=env, capture_output=True, text=True)
    results = ag / "results/results.json"
    assert results.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(results.read_text(encoding="utf-8"))
    assert "tests" in result, result.get("output", "")[-3000:]
    return result


def task_scores(result: dict[str, Any]) -> dict[str, float]:
    return {s["task"]: s["score"] for s in result["extra_data"]["tasks"]}


def reference_body(task: str) -> list[str]:
    path = FILES[task]
    text = (ROOT / path).read_text(encoding="utf-8")
    (r,) = [x for x in regions.scan_text(text, path) if x.task == task]
    return [line.removeprefix(r.indent) for line in r.body(text.splitlines())]


@pytest.fixture(scope="module")
def blank(handout: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What a submission that changes nothing scores."""
    return submit(handout, {}, tmp_path_factory.mktemp("blank"))


# The forger: code that passes the static check (numpy and json are all it uses) and, when a test of
# task 0.3 calls it, finds the grader's pipe in the process's environment and writes records of passed tests
# on it, writes a full-marks results.json where Gradescope reads it, and then fails like the blank answer.
FORGER = """\
import json
import numpy as np
environ = np.fromfile("/proc/self/environ", dtype=np.uint8, count=1 << 20).tobytes().split(b"\\0")
spec = [e for e in environ if e.startswith(b"MINISGL_COURSE_CHANNEL=")][0].split(b"=", 1)[1]
channel = "/proc/self/fd/" + spec.split(b",")[1].decode()
lines = b""
for seq, name in enumerate(NAMES):
    record = {"nodeid": name, "check": name, "task": "0.3", "marks": ["0.3"], "gpu": False,
              "outcome": "passed", "message": "", "seconds": 0.1}
    body = json.dumps({"kind": "result", "record": record, "seq": seq}).encode()
    lines += b"0" * 64 + b" " + body + b"\\n"
files = np.lib.npyio.DataSource(None)  # a file object without open()
with files.open(channel, "wb") as pipe:
    pipe.write(lines)
forged = json.dumps({"score": 25, "max_score": 25, "output": "all good", "tests": []})
np.savetxt(RESULTS, [forged], fmt="%s")  # a new file without open()
np.savetxt(MARKER, ["ran"], fmt="%s")
raise NotImplementedError("Task 0.3: one step of the naive generation loop")
"""

# A hard-coded answer: the pattern test_reference_attention_consecutive_query_heads_share_a_kv_head looks for
# (heads 0-3 read values of 1, heads 4-7 values of 7), whatever the inputs.
CONSTANT = ["out = torch.ones_like(q)", "out[:, q.shape[1] // 2:] = 7.0", "return out"]

# Six lines in a task body that replace what the grader's plugin sends, so that every later test reports passed.
PLUGIN_PATCH = """\
import minisgl_ref.course.plugin as plugin
send = plugin._SEND["send"]
def passed(message):
    record = message.get("record")
    send({**message, "record": {**record, "outcome": "passed"}} if record else message)
plugin._SEND["send"] = passed
raise NotImplementedError("Task 0.1: causal attention with grouped-query heads")
"""

# Task 0.2 from the reference checkout on disk: load its module and run its function's code in this module.
IMPORT_REFERENCE = f"""\
import importlib.util, types
spec = importlib.util.spec_from_file_location(__name__, {str(ROOT / FILES["0.2"])!r})
reference = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reference)
self.output_ids.pop()
return types.FunctionType(reference.Req.append_token.__code__, globals())(self, token_id)
"""

# Task 0.3 from the reference's git objects: `git show` the file, run it in this module's namespace, call its method.
GIT_REFERENCE = f"""\
import subprocess
source = subprocess.run(["git", "-C", {str(ROOT)!r}, "show", "HEAD:{FILES["0.3"]}"], capture_output=True,
                        text=True, check=True).stdout
namespace = dict(globals())
exec(compile(source, "reference_naive.py", "exec"), namespace)
return namespace["NaiveEngine"].step(self, reqs)
"""


def test_a_forged_report_scores_as_blank_and_a_genuine_answer_still_counts(
        handout: Path, blank: dict[str, Any], tmp_path: Path) -> None:
    """Task 0.3's body forges signed-looking records on the grader's pipe and a results.json; task 0.1 returns a
    hard-coded pattern; task 0.2 is the reference's own code. Only task 0.2 earns points."""
    names = [f"tests/test_engine_oracle.py::{n}" for n in (
        "test_naive_step_appends_one_token_to_each_running_request", "test_naive_loop_generates_the_known_continuation",
        "test_naive_step_feeds_every_whole_sequence", "test_naive_step_returns_each_token_text_and_applies_stop_rules")]
    marker = tmp_path / "forger-ran"
    forger = (f"NAMES = {names!r}\nRESULTS = {str(tmp_path / 'autograder/results/results.json')!r}\n"
              f"MARKER = {str(marker)!r}\n" + FORGER)
    assert screen.screen_text(with_bodies((handout / FILES["0.3"]).read_text(), FILES["0.3"],
                                          {"0.3": forger.splitlines()}), FILES["0.3"]) == {}, "not refused"
    result = submit(handout, {"0.3": forger.splitlines(), "0.1": CONSTANT, "0.2": reference_body("0.2")},
                    tmp_path)
    scores, before = task_scores(result), task_scores(blank)
    assert marker.exists(), "the forger never ran, so this test shows nothing"
    forged = result["extra_data"]["forged_lines"]  # each call wrote one line per name; the grader dropped them
    assert forged > 0 and forged % len(names) == 0 and f"{forged} unsigned line(s)" in result["output"]
    assert scores["0.3"] == before["0.3"] == 0
    assert scores["0.1"] == before["0.1"] == 0  # the hard-coded answer
    assert scores["0.2"] == 10 and before["0.2"] == 0  # a genuine answer counts through the same path
    assert result["score"] == 10 and result["max_score"] == blank["max_score"] == 25


def test_the_hard_coded_answer_is_what_one_test_looks_for_and_the_checks_still_fail_it() -> None:
    """The constant reproduces exactly what the first half of one check asserts; the check's second half (the
    output must follow the inputs) is what fails it, and no other check of task 0.1 passes it (the run above)."""
    q = torch.randn(4, 8, 16)
    namespace: dict[str, Any] = {"torch": torch, "q": q}
    exec("def answer(q):\n" + "".join(f"    {line}\n" for line in CONSTANT), namespace)  # noqa: S102 - test data
    out = namespace["answer"](q)
    assert out[..., 0].round().tolist() == [[1.0] * 4 + [7.0] * 4] * 4


def test_imports_of_the_grader_or_the_reference_are_refused_and_score_as_blank(
        handout: Path, blank: dict[str, Any], tmp_path: Path) -> None:
    result = submit(handout, {"0.1": PLUGIN_PATCH.splitlines(), "0.2": IMPORT_REFERENCE.splitlines(),
                              "0.3": GIT_REFERENCE.splitlines()}, tmp_path)
    assert task_scores(result) == task_scores(blank) and result["score"] == blank["score"] == 0
    refused = {t["extra_data"]["task"]: t["output"] for t in result["tests"]
               if t["extra_data"].get("outcome") == "refused"}
    assert set(refused) == set(CHAPTER0)
    assert "imports minisgl_ref.course.plugin" in refused["0.1"] and FILES["0.1"] in refused["0.1"]
    assert "imports importlib.util" in refused["0.2"] and "uses the attribute .__code__" in refused["0.2"]
    assert "imports subprocess" in refused["0.3"] and "uses exec" in refused["0.3"]
    summary = {s["task"]: s for s in result["extra_data"]["tasks"]}
    assert all(summary[t]["refused"] and summary[t]["max_score"] > 0 for t in CHAPTER0)


def test_without_the_static_check_the_reference_imports_would_earn_full_marks(handout: Path) -> None:
    """The same reference-importing bodies, run by the grader's child process without screening: they work,
    which is why the static check refuses them."""
    t = table.load(regions.scan(handout))
    tasks = [t.tasks[task] for task in CHAPTER0]
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "copy"
        grade.grading_copy(handout, copy)
        for task, body in (("0.2", IMPORT_REFERENCE), ("0.3", GIT_REFERENCE)):
            path = copy / FILES[task]
            path.write_text(with_bodies(path.read_text(), FILES[task], {task: body.splitlines()}))
        run = grade.run_checked(copy, CHAPTER0)
    result = grade.report(tasks, run.records, 0.0, machine={})
    assert task_scores(result) == {"0.1": 0, "0.2": 10, "0.3": 5}
