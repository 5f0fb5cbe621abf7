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
"$venv/bin/python" -m pytest --ignore=tests/test_site_browser.py "$@"
"$venv/bin/python" -m mkdocs build --strict --quiet --site-dir "$site_dir"
echo "docs: built into $site_dir/"
SITE_DIR="$site_dir" "$venv/bin/python" -m pytest tests/test_site_browser.py
