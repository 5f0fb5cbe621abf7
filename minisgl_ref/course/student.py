"""Student copies: the repository with the chosen chapters' task regions blanked, and solutions pasted back.

A copy is made from the files git tracks (so no build output, caches or bytecode come along), without the
instructor's ``course/`` folder (its mutants are near-solutions) and with every notebook's outputs cleared (a
chapter prints its task's code); the generated parts of its pages are written again from the copy's own
sources, so the instructor guide's table of wrong answers becomes a note. It becomes a fresh git repository with
one commit, so no history leads back to the reference. Before it is committed, :func:`leaks` looks for every
distinctive line of a blanked region in every file of the copy and refuses to finish if one is found.

Making a copy into a folder that already holds one adds a commit on top ("the reference moved on"), which is how a
running course is updated: students pull it and git merges it with their work.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

from minisgl_ref.course import pages
from minisgl_ref.course.regions import Region, blank_text, bodies_by_file, fill_text, scan, scan_text, task_key

INSTRUCTOR_ONLY = ("course/",)  # never copied: realistic wrong answers are close to the right ones
MANIFEST = "COURSE.json"
MIN_LEAK_CHARS = 24  # shorter lines (``return out``, ``i += 1``) are not evidence of a leak


def tracked_files(root: Path) -> list[str]:
    """The files of the reference that a copy starts from: what git tracks, minus the instructor's folder."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise RuntimeError(f"{root} is not a git checkout of the reference (git ls-files failed: {e})") from e
    files = [f for f in out.decode().split("\0") if f]
    return [f for f in files if not f.startswith(INSTRUCTOR_ONLY) and (root / f).is_file()]


def clear_outputs(text: str) -> str:
    """A notebook's JSON with every output and execution count removed."""
    nb = json.loads(text)
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"], cell["execution_count"] = [], None
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def solution_lines(root: Path, regions: Iterable[Region]) -> set[str]:
    """Distinctive lines of the regions' reference bodies: long enough, and found nowhere else in the package or
    the tests (a line that also appears outside every region, such as a call a test makes, gives nothing away;
    one that appears in a chapter, a page or a notebook output does)."""
    outside: set[str] = set()
    for path in sorted((root / "minisgl_ref").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8")
        outside |= {line.strip() for line in blank_text(text, scan_text(text, rel)).splitlines()}
    for folder in ("tests", "benchmarks"):
        for path in sorted((root / folder).rglob("*.py")):
            outside |= {line.strip() for line in path.read_text(encoding="utf-8").splitlines()}
    found = set()
    for r in regions:
        for line in r.body((root / r.path).read_text(encoding="utf-8").splitlines()):
            s = line.strip()
            if len(s) >= MIN_LEAK_CHARS and not s.startswith("#") and s not in outside:
                found.add(s)
    return found


def _lines_of(path: Path) -> set[str]:
    """The stripped lines of a file as a reader sees them (a notebook's cell sources and text outputs)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        text = path.read_bytes().decode("latin-1")
    if path.suffix == ".ipynb":
        try:
            nb = json.loads(text)
        except ValueError:
            pass
        else:
            parts = []
            for cell in nb.get("cells", []):
                parts.append("".join(cell.get("source", [])))
                for output in cell.get("outputs", []):
                    parts.append("".join(output.get("text", [])))
                    parts.append("".join(output.get("data", {}).get("text/plain", [])))
            text = "\n".join(parts)
    return {line.strip() for line in text.splitlines()}


def leaks(copy: Path, lines: set[str]) -> list[str]:
    """``path: line`` for each solution line found as a line of a file of ``copy`` (``.git`` excluded)."""
    out = []
    for path in sorted(copy.rglob("*")):
        if path.is_file() and ".git" not in path.relative_to(copy).parts:
            out += [f"{path.relative_to(copy).as_posix()}: {line}" for line in sorted(lines & _lines_of(path))]
    return out


def _git(copy: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=course", "-c", "user.email=course@localhost", *args],
                   cwd=copy, check=True, capture_output=True)


def _reference_commit(root: Path) -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, check=True, capture_output=True,
                              text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def make_copy(root: Path, out: Path, task_ids: Iterable[str], *, commit: bool = True,
              unblank: bool = False) -> dict[str, object]:
    """Write a student copy of the reference at ``root`` into ``out`` with ``task_ids`` blanked.

    ``out`` must be empty, missing, or an earlier copy (then its tracked files are replaced and the change is
    committed on top of its history). An update that would un-blank a task the earlier copy had blank publishes
    its solution, so it is refused unless ``unblank`` says that is the intent. Returns the manifest written to
    ``out/COURSE.json``."""
    root, out = root.resolve(), out.resolve()
    task_ids = sorted(set(task_ids), key=task_key)
    regions = [r for r in scan(root) if r.task in task_ids]
    unknown = set(task_ids) - {r.task for r in regions}
    if unknown:
        raise ValueError(f"no regions for tasks {sorted(unknown)}")
    update = (out / MANIFEST).exists() and (out / ".git").exists()
    if out.exists() and any(out.iterdir()) and not update:
        raise ValueError(f"{out} is not empty and holds no student copy: choose a new folder")
    if update and not unblank:
        before = set(json.loads((out / MANIFEST).read_text(encoding="utf-8")).get("blank_tasks", []))
        dropped = sorted(before - set(task_ids), key=task_key)
        if dropped:
            raise ValueError(f"this update would publish the solutions of tasks {', '.join(dropped)}, blank in "
                             f"the copy at {out}: add them to the selection, or pass --unblank if that is the "
                             "intent")
    if update:  # replace what the previous copy tracked; the student's own files stay
        for f in subprocess.run(["git", "ls-files", "-z"], cwd=out, check=True, capture_output=True
                                ).stdout.decode().split("\0"):
            if f and (out / f).is_file():
                (out / f).unlink()
    by_path: dict[str, list[Region]] = {}
    for r in regions:
        by_path.setdefault(r.path, []).append(r)
    for rel in tracked_files(root):
        src, dst = root / rel, out / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if rel in by_path:
            dst.write_text(blank_text(src.read_text(encoding="utf-8"), by_path[rel]), encoding="utf-8")
        elif rel.endswith(".ipynb"):
            dst.write_text(clear_outputs(src.read_text(encoding="utf-8")), encoding="utf-8")
        else:
            shutil.copy2(src, dst)
    # the pages' generated parts, written again from the copy's own sources: the mutants table, which lists the
    # instructor's wrong answers, becomes a note (the copy has no course/ folder)
    pages.write(out)
    manifest: dict[str, object] = {
        "blank_tasks": task_ids,
        "reference_commit": _reference_commit(root),
        "grade": "python -m minisgl_ref.course grade --task " + ",".join(task_ids),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    found = leaks(out, solution_lines(root, regions))
    if found:
        raise RuntimeError("solution text found in the student copy:\n" + "\n".join(found[:20]))
    if commit:
        if not update:
            _git(out, "init", "-q", "-b", "main")
        _git(out, "add", "-A")
        message = "Reference update" if update else "Course starting point"
        _git(out, "commit", "-q", "--allow-empty", "-m", f"{message}: tasks {', '.join(task_ids)} to write")
    return manifest


def fill_solutions(root: Path, copy: Path, task_ids: Iterable[str]) -> list[str]:
    """Paste the reference's code for ``task_ids`` into the copy at ``copy`` (releasing solutions, or checking
    that the copy's tests give full marks to the reference). Returns the files changed."""
    task_ids = set(task_ids)
    reference = [r for r in scan(root) if r.task in task_ids]
    changed = []
    for rel in sorted({r.path for r in reference}):
        ref_text = (root / rel).read_text(encoding="utf-8")
        bodies = {k: v for k, v in bodies_by_file(ref_text, scan_text(ref_text, rel)).items() if k[0] in task_ids}
        target = copy / rel
        text = target.read_text(encoding="utf-8")
        new = fill_text(text, scan_text(text, rel), bodies)
        if new != text:
            target.write_text(new, encoding="utf-8")
            changed.append(rel)
    return changed
