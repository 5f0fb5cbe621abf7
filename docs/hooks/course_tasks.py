"""MkDocs hook: the course pages' generated parts (tables built from the code, the tests and ``tasks.toml``; the
autograder's scripts), written again from their sources at every build.

The parts live in the Markdown sources themselves, between ``<!-- course:... -->`` and ``<!-- /course -->``, so a
handout reads complete outside the site too; :mod:`minisgl_ref.course.pages` renders them (and
``python -m minisgl_ref.course pages`` rewrites the sources). A marker that cannot be blanked, a task missing
from the table or a task without tests (or without a CPU check) is logged as a warning, which fails
``mkdocs build --strict``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.course_tasks")

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from minisgl_ref.course import pages as course_pages  # noqa: E402
from minisgl_ref.course import regions as course_regions  # noqa: E402
from minisgl_ref.course import table as course_table  # noqa: E402

TESTS_DIR = ROOT / "tests"


def on_page_markdown(markdown, page, config, files):  # type: ignore[no-untyped-def]
    if "<!-- course:" not in markdown:
        return markdown
    for problem in course_regions.problems(ROOT):
        log.warning("course: %s", problem)
    t = course_table.load(course_regions.scan(ROOT))
    checks = course_pages.scan_checks(ROOT)
    for task in t.tasks.values():
        mine = [c for c in checks if c.task == task.id]
        if not mine:
            log.warning("course task %s has no tests", task.id)
        elif all(c.gpu for c in mine):
            log.warning("course task %s has no CPU check", task.id)
    for problem in course_pages.unfilled(markdown):
        log.warning("course: %s: %s", page.file.src_path, problem)
    return course_pages.fill(markdown, ROOT)


def on_serve(server, config, builder):  # type: ignore[no-untyped-def]
    """``mkdocs serve``: rebuild when the package, the tests or the mutants change."""
    for folder in (ROOT / "minisgl_ref", TESTS_DIR, ROOT / "course"):
        if folder.is_dir():
            server.watch(str(folder))
    return server
