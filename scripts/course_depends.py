"""Which tasks' code does each task's tests run? Suggests the ``depends`` column of minisgl_ref/course/tasks.toml.

    python scripts/course_depends.py          # about 5 minutes on 2 cores

Runs every graded test once under line coverage (the ``coverage`` package, in the dev extras), with one coverage
context per test, and reports, for each task, the other tasks whose regions those tests executed. Only earlier
tasks may appear in ``depends`` (a course is taken in order), so a later one is reported apart: it means a test
of an early task leans on a later task's code, and that test should be moved or cut differently. Code run in
child processes (tensor-parallel followers, server processes) is not traced: add what they run by hand.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from minisgl_ref.course import regions, table

    found = regions.scan(ROOT)
    t = table.load(found)
    with tempfile.TemporaryDirectory() as tmp:
        data, records, rc = Path(tmp) / "cov", Path(tmp) / "records.json", Path(tmp) / "coveragerc"
        rc.write_text("[run]\nsource = minisgl_ref\ndynamic_context = test_function\n")
        subprocess.run(
            [sys.executable, "-m", "coverage", "run", f"--rcfile={rc}", f"--data-file={data}",
             "-m", "pytest", "-p", "minisgl_ref.course.plugin", "-p", "no:cacheprovider", "--course-tasks=*",
             f"--course-report={records}", "--ignore=tests/test_site_browser.py", "-o", "addopts=", "-q", "tests"],
            cwd=ROOT, check=False)
        import coverage

        cov = coverage.Coverage(data_file=str(data))
        cov.load()
        cdata = cov.get_data()
        task_of_test = {r["check"].split("::")[-1]: r["task"] for r in json.loads(records.read_text())}
        runs: dict[str, set[str]] = defaultdict(set)
        later_by: dict[str, set[str]] = defaultdict(set)  # task -> "test runs task y" for later tasks y
        for region in found:
            path = str(ROOT / region.path)
            contexts = cdata.contexts_by_lineno(path) if path in cdata.measured_files() else {}
            for line in range(region.begin + 2, region.end + 1):  # 1-based lines strictly between the markers
                for ctx in contexts.get(line, []):
                    test = ctx.rsplit(".", 1)[-1]
                    if test in task_of_test and task_of_test[test] != region.task:
                        runs[task_of_test[test]].add(region.task)
                        if regions.task_key(region.task) > regions.task_key(task_of_test[test]):
                            later_by[task_of_test[test]].add(f"{test} runs {region.task}")
    for task in t.tasks:
        deps = sorted(runs[task], key=regions.task_key)
        earlier = [d for d in deps if regions.task_key(d) < regions.task_key(task)]
        later = [d for d in deps if regions.task_key(d) > regions.task_key(task)]
        print(f"{task:<6} depends = {json.dumps(earlier)}" + (f"   (runs later tasks: {', '.join(later)})" if later else ""))
        for line in sorted(later_by[task]):
            print(f"         {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
