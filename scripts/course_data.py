"""Measure the course kit on this machine and commit the numbers the site shows.

    python scripts/course_data.py            # every chapter, then every mutant (about 15 minutes on 2 cores)

Writes docs/data/course_grading_cpu.json (the reference's score and grading time per chapter: the handouts'
"expected CPU run time") and docs/data/course_mutants_cpu.json (each mutant, caught or not, and in how long).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data"


def machine() -> str:
    return f"{os.cpu_count()} CPU cores ({platform.machine()}, Python {platform.python_version()})"


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from minisgl_ref.course import regions, table

    chapters = sorted({t.chapter for t in table.load(regions.scan(ROOT)).tasks.values()})
    out: dict[str, object] = {"machine": machine(), "command": "python -m minisgl_ref.course grade --chapter N",
                              "chapters": {}}
    for chapter in chapters:
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "r.json"
            subprocess.run([sys.executable, "-m", "minisgl_ref.course", "grade", "--chapter", str(chapter),
                            "--json", str(report)], cwd=ROOT, check=True)
            r = json.loads(report.read_text())
        out["chapters"][str(chapter)] = {"seconds": r["execution_time"], "score": r["score"],
                                         "max_score": r["max_score"]}
    (DATA / "course_grading_cpu.json").write_text(json.dumps(out, indent=1) + "\n")
    subprocess.run([sys.executable, "-m", "minisgl_ref.course", "mutants", "--json",
                    str(DATA / "course_mutants_cpu.json")], cwd=ROOT, check=False)


if __name__ == "__main__":
    main()
