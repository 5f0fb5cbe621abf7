"""Measure the Gradescope autograders on this machine: build each assignment's zip, run its ``setup.sh`` once in
a fresh folder (a new virtual environment holding nothing but the pinned packages), and run its
``run_autograder`` on the reference's code (a correct submission) and on the copy as handed out (a blank one).
Writes ``docs/data/course_gradescope_cpu.json``; the instructor guide's "Size and time" table is generated from
it (``python -m minisgl_ref.course pages``).

    python scripts/course_gradescope.py                 every assignment
    python scripts/course_gradescope.py 6 7             some of them (the others keep their recorded numbers)
    TORCH_INDEX= python scripts/course_gradescope.py    torch from pip's own index (a machine with local wheels)

Run it alone on the machine: the times are wall-clock times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from minisgl_ref.course import autograder, gradescope  # noqa: E402
from minisgl_ref.models import embedded  # noqa: E402

OUT = ROOT / "docs" / "data" / "course_gradescope_cpu.json"


def machine() -> str:
    return f"{os.cpu_count()} CPU cores ({platform.machine()}, Python {platform.python_version()})"


def save(data: dict) -> None:
    data["assignments"] = dict(sorted(data["assignments"].items(), key=lambda kv: int(kv[0])))
    OUT.write_text(json.dumps(data, indent=1) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("assignments", nargs="*", type=int, help="default: every assignment")
    parser.add_argument("--python", default=sys._base_executable,  # type: ignore[attr-defined]
                        help="the interpreter setup.sh builds the environment from (default: this one's base)")
    args = parser.parse_args()
    chosen = args.assignments or sorted(autograder.assignments())
    data = json.loads(OUT.read_text()) if OUT.exists() else {}
    data.setdefault("assignments", {})
    with tempfile.TemporaryDirectory(prefix="minisgl-gradescope-") as tmp:
        base = Path(tmp)
        first = base / f"a{chosen[0]}"
        zip_path = base / f"autograder-a{chosen[0]}.zip"
        gradescope.build(ROOT, chosen[0], zip_path)
        gradescope.unpack(zip_path, first)
        index = os.environ.get("TORCH_INDEX", "https://download.pytorch.org/whl/cpu")
        env = gradescope.clean_env(PYTHON=args.python, TORCH_INDEX=index)
        seconds, _ = gradescope.setup(first, env)
        venv = first / "source" / ".venv"
        print(f"setup.sh: {seconds:.0f} s; .venv {gradescope.folder_mb(venv):,.0f} MB", flush=True)
        data.update({
            "machine": machine(), "when": time.strftime("%Y-%m-%d"),
            "setup_seconds": round(seconds, 1),
            "size_mb": {"venv": round(gradescope.folder_mb(venv)),
                        "model_cache": round(gradescope.folder_mb(embedded.cache_root() / embedded.EMBEDDED_NAME)),
                        "zip": round(zip_path.stat().st_size / 1e6, 1)},
        })
        save(data)
        run_env = gradescope.clean_env(PY=str(venv / "bin" / "python"))
        for n in chosen:
            chapters = autograder.assignments()[n]
            ag = base / f"a{n}"
            zip_n = base / f"autograder-a{n}.zip"
            if n != chosen[0]:
                gradescope.build(ROOT, n, zip_n)
            source = gradescope.unpack(zip_n, ag)
            blank_files = gradescope.handed_out_submission(source, chapters, base / f"blank{n}")
            right = gradescope.grade_submission(ag, gradescope.reference_submission(ROOT, chapters,
                                                                                    base / f"right{n}"), run_env)
            gradescope.unpack(zip_n, ag)  # the run pasted the submission in: hand the copy out again
            blank = gradescope.grade_submission(ag, blank_files, run_env)
            r = right.results
            print(f"assignment {n} (chapters {chapters}): reference {r['score']} / {r.get('max_score')} in "
                  f"{right.seconds:.0f} s (peak {right.peak_rss_mb:.0f} MB); blank {blank.results['score']} in "
                  f"{blank.seconds:.0f} s", flush=True)
            data["assignments"][str(n)] = {
                "chapters": chapters, "score": r["score"], "max_score": r.get("max_score"),
                "seconds": round(right.seconds, 1), "peak_rss_mb": round(right.peak_rss_mb),
                "blank_score": blank.results["score"], "blank_seconds": round(blank.seconds, 1),
            }
            if n != chosen[0]:  # its copy is no longer needed (the first one holds the environment)
                shutil.rmtree(ag, ignore_errors=True)
            save(data)  # after each assignment: an interrupted run keeps what it measured
    print(f"wrote {OUT.relative_to(ROOT)}; now run: python -m minisgl_ref.course pages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
