#!/usr/bin/env bash
# The test command: set up .venv with the dev tools, then run the tests (which also execute the chapter
# notebooks on CPU) and build the documentation site strictly.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev
venv=${MINISGL_VENV:-.venv}
export PYTHONUNBUFFERED=1 NO_MKDOCS_2_WARNING=1
"$venv/bin/python" -m pytest "$@"
"$venv/bin/python" -m mkdocs build --strict --quiet --site-dir "${SITE_DIR:-site}"
echo "docs: built into ${SITE_DIR:-site}/"
