#!/usr/bin/env bash
# The test command: set up .venv with the dev tools, then run the tests (which also execute the chapter
# notebooks on CPU), build the documentation site strictly, and open it in headless Chromium with the
# network blocked (tests/test_site_browser.py; screenshots land in build/screenshots/).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev
venv=${MINISGL_VENV:-.venv}
export PYTHONUNBUFFERED=1 NO_MKDOCS_2_WARNING=1
site_dir=${SITE_DIR:-site}
# Two pytest processes, each file's tests in one of them (module fixtures load a model or start a server once),
# each with one OpenMP thread: most of the suite is single-threaded Python, so two processes keep two cores busy,
# while two processes of two threads each would fight over them.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"$venv/bin/python" -m pytest -n "${MINISGL_TEST_WORKERS:-2}" --dist loadfile --ignore=tests/test_site_browser.py "$@"
"$venv/bin/python" -m mkdocs build --strict --quiet --site-dir "$site_dir"
echo "docs: built into $site_dir/"
SITE_DIR="$site_dir" "$venv/bin/python" -m pytest tests/test_site_browser.py
