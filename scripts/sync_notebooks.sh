#!/usr/bin/env bash
# Regenerate notebooks/NN_slug.ipynb from chapters/NN_slug.py, the chapters' source of truth.
#
#   scripts/sync_notebooks.sh                         every chapter
#   scripts/sync_notebooks.sh chapters/03_kv_cache.py   just these
#
# The notebooks are written without outputs (the repository stays small and diffs stay readable), and a
# notebook whose chapter no longer exists is deleted. tests/test_notebooks.py fails when a notebook's cells
# differ from its chapter's, so run this after editing a chapter. (Jupyter with jupytext installed keeps the pair
# in sync by itself, via jupytext.toml.)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${MINISGL_VENV:-.venv}
jupytext="$venv/bin/jupytext"
[ -x "$jupytext" ] || jupytext=jupytext  # e.g. a venv elsewhere, already activated

shopt -s nullglob
if [ $# -gt 0 ]; then chapters=("$@"); else chapters=(chapters/[0-9][0-9]_*.py); fi
mkdir -p notebooks
for py in "${chapters[@]}"; do
  nb="notebooks/$(basename "${py%.py}").ipynb"
  # --to ipynb without --update: the notebook is rebuilt from the script, so it carries no outputs.
  "$jupytext" --quiet --to ipynb --set-kernel python3 --output "$nb" "$py"
  echo "synced $py -> $nb"
done
if [ $# -eq 0 ]; then
  for nb in notebooks/*.ipynb; do
    if [ ! -f "chapters/$(basename "${nb%.ipynb}").py" ]; then
      rm -- "$nb"
      echo "removed $nb (its chapter is gone)"
    fi
  done
fi
