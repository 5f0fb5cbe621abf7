"""Gradescope autograders: ``python -m minisgl_ref.course gradescope --assignment N OUT.zip`` writes the upload
Gradescope takes for assignment N (its chapters are in ``tasks.toml``'s ``[assignments]``):

- a student copy of the reference (:func:`minisgl_ref.course.student.make_copy`, no git) with the assignment's
  chapters **and every later one** blank: a submission runs arbitrary code in the container, so the zip holds
  nothing that is not published to students; earlier chapters keep the reference's code, which the tasks that
  depend on them run;
- ``setup.sh``, run once to build the image: a virtual environment with the pinned packages of
  ``requirements.txt``, PyTorch's CPU build at the pin of ``scripts/setup.sh``, and the embedded model, but no
  ``minisgl_ref``: the grader and the tests import the package from the copy (the working directory, and
  ``PYTHONPATH`` in the grader's child), so the only engine a submission can import is the copy with its own
  regions pasted in;
- ``run_autograder``, run for every submission: it pastes the submitted task regions into the copy and ends by
  handing its place to the grader (``exec``), which writes ``/autograder/results/results.json``;
- ``requirements.txt``.

The scripts come from :mod:`minisgl_ref.course.autograder`'s templates.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minisgl_ref.course import regions, student, table
from minisgl_ref.course.autograder import REQUIREMENTS, SCRIPTS, TEMPLATES, assignments, render


def blanked_chapters(t: table.Table, chapters: str) -> list[str]:
    """The tasks a zip for ``chapters`` blanks: theirs and every later chapter's."""
    first = min(table.parse_chapters(chapters))
    return [task.id for task in t.tasks.values() if task.chapter >= first]


def build(root: Path, assignment: int, out: Path) -> dict[str, object]:
    """Write the autograder zip of ``assignment`` to ``out``; returns what it holds (chapters, blank tasks, files)."""
    chosen = assignments()
    if assignment not in chosen:
        raise ValueError(f"no assignment {assignment} in tasks.toml (assignments: {sorted(chosen)})")
    chapters = chosen[assignment]
    t = table.load(regions.scan(root))
    blank = blanked_chapters(t, chapters)
    with tempfile.TemporaryDirectory(prefix="minisgl-autograder-") as tmp:
        src = Path(tmp) / "source"
        manifest = student.make_copy(root, src, blank, commit=False)
        for name in (*SCRIPTS, REQUIREMENTS):
            if (src / name).exists():
                raise ValueError(f"the student copy already has a file {name} at its root: the autograder needs it")
        for name in SCRIPTS:
            (src / name).write_text(render(name, assignment, chapters, root), encoding="utf-8")
        shutil.copyfile(TEMPLATES / REQUIREMENTS, src / REQUIREMENTS)
        out.parent.mkdir(parents=True, exist_ok=True)
        files = sorted(p for p in src.rglob("*") if p.is_file())
        with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as z:
            for path in files:
                rel = path.relative_to(src).as_posix()
                info = zipfile.ZipInfo(rel, date_time=(2020, 1, 1, 0, 0, 0))  # the same bytes for the same copy
                info.compress_type = zipfile.ZIP_DEFLATED
                info.external_attr = (0o755 if rel in SCRIPTS else 0o644) << 16
                z.writestr(info, path.read_bytes())
    return {"assignment": assignment, "chapters": chapters, "blank_tasks": manifest["blank_tasks"],
            "files": len(files), "bytes": out.stat().st_size}


# Trying an autograder on this machine, as Gradescope would run it: /autograder becomes any folder ``ag``.

@dataclass
class Run:
    """One ``run_autograder`` run: Gradescope's report, the wall time, and the largest process's peak memory."""

    results: dict[str, Any]
    seconds: float
    peak_rss_mb: float
    log: str


def unpack(zip_path: Path, ag: Path) -> Path:
    """Unzip the autograder into ``ag/source`` as Gradescope does (the scripts executable), over an earlier
    unpacking: the copy's files come back as handed out, and an installed ``.venv`` stays. Returns the source."""
    source = ag / "source"
    with zipfile.ZipFile(zip_path) as z:
        z.extractall(source)
        for info in z.infolist():
            mode = info.external_attr >> 16
            if mode:
                (source / info.filename).chmod(mode)
    return source


def _timed(cmd: list[str], env: dict[str, str], cwd: Path, timeout_s: float) -> tuple[int, float, float, str]:
    """Run ``cmd``; (exit status, seconds, the peak RSS of its largest process in MB, its output). The peak comes
    from a wrapper process's ``RUSAGE_CHILDREN``, which covers every process below it that was waited for."""
    wrapper = ("import resource, subprocess, sys\n"
               "rc = subprocess.call(sys.argv[1:])\n"
               "print(f'\\n@peak_kb {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}')\n"
               "sys.exit(rc)\n")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", wrapper, *cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    seconds = time.perf_counter() - start
    out = proc.stdout + proc.stderr
    peaks = re.findall(r"^@peak_kb (\d+)$", out, flags=re.M)
    return proc.returncode, seconds, int(peaks[-1]) / 1024 if peaks else float("nan"), out


def setup(ag: Path, env: dict[str, str] | None = None, timeout_s: float = 1800) -> tuple[float, str]:
    """Run the unpacked autograder's ``setup.sh`` (``AUTOGRADER=ag``); (seconds, output). Raises on failure."""
    run_env = {**(os.environ if env is None else env), "AUTOGRADER": str(ag)}
    rc, seconds, _, out = _timed(["bash", str(ag / "source" / "setup.sh")], run_env, ag / "source", timeout_s)
    if rc != 0:
        raise RuntimeError(f"setup.sh failed (exit {rc}):\n{out[-4000:]}")
    return seconds, out


def grade_submission(ag: Path, submission: Path | None, env: dict[str, str] | None = None,
                     timeout_s: float = 1800) -> Run:
    """Run ``run_autograder`` on ``submission`` (a folder laid out like the repository, copied to
    ``ag/submission``; ``None``: an empty submission) and read ``ag/results/results.json``."""
    shutil.rmtree(ag / "submission", ignore_errors=True)
    shutil.rmtree(ag / "results", ignore_errors=True)
    if submission is None:
        (ag / "submission").mkdir(parents=True)
    else:
        shutil.copytree(submission, ag / "submission")
    run_env = {**(os.environ if env is None else env), "AUTOGRADER": str(ag)}
    rc, seconds, peak, out = _timed(["bash", str(ag / "source" / "run_autograder")], run_env, ag / "source",
                                    timeout_s)
    report = ag / "results" / "results.json"
    if not report.exists():
        raise RuntimeError(f"run_autograder wrote no results.json (exit {rc}):\n{out[-4000:]}")
    return Run(json.loads(report.read_text(encoding="utf-8")), seconds, peak, out)


def reference_submission(root: Path, chapters: str, dest: Path) -> Path:
    """A correct submission of ``chapters``: the reference's files that hold their task regions, at their places
    in the repository, under ``dest``."""
    wanted = table.parse_chapters(chapters)
    for rel in sorted({r.path for r in regions.scan(root) if regions.chapter_of(r.task) in wanted}):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / rel, dest / rel)
    return dest


def handed_out_submission(source: Path, chapters: str, dest: Path) -> Path:
    """A blank submission of ``chapters``: the files that hold their task regions as the copy hands them out."""
    return reference_submission(source, chapters, dest)


def folder_mb(path: Path) -> float:
    """What the files under ``path`` take on disk (allocated blocks, links not followed), in MB."""
    total = 0
    for p in path.rglob("*"):
        if p.is_file() and not p.is_symlink():
            total += p.lstat().st_blocks * 512
    return total / 1e6


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without what would lead to another engine: ``PYTHONPATH``, ``PYTHONHOME``, an
    active virtual environment (and its ``bin`` on ``PATH``); plus ``extra``."""
    env = dict(os.environ)
    active = env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONHOME", None)
    venvs = {Path(sys.prefix) / "bin", *([Path(active) / "bin"] if active else [])}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and Path(p) not in venvs)
    env.update(extra)
    return env
