"""Shared fixtures: the embedded model folder and tiny random checkpoints of each supported architecture."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU the Triton attention kernels (chapter 07) run in Triton's CPU interpreter. triton.jit reads this
    # variable when it decorates a function, so it must be set before anything imports triton: here, first.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _give_memory_back_after_each_file():  # type: ignore[no-untyped-def]
    """After each test file: collect the engines its tests left in reference cycles and hand the freed heap back to
    the OS. A test process runs many files one after another (``-n 2 --dist loadfile``); an engine on the CPU holds
    a KV pool of ~750 MB, and without this the freed pools of earlier files stayed in the process (one worker
    reached 6.7 GB and was killed for memory while the other ran servers)."""
    yield
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


@pytest.fixture(scope="session")
def embedded_path() -> Path:
    from minisgl_ref.models.embedded import embedded_model_path

    return embedded_model_path()


TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


def tiny_hf_config(arch: str, **overrides):  # type: ignore[no-untyped-def]
    """A small random config of a supported architecture (the same code paths as the real models)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    kw = dict(TINY) | overrides
    if arch == "llama":
        return LlamaConfig(**kw)
    if arch == "llama3_rope":
        return LlamaConfig(
            **kw,
            rope_parameters=dict(
                rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=64,
            ),
        )
    if arch == "qwen2":
        return Qwen2Config(**kw)
    if arch == "qwen3":
        return Qwen3Config(**kw, head_dim=32)
    raise ValueError(arch)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """HF checkpoints with random weights, saved the way real ones are (the Qwen3 one sharded in several files)."""
    from transformers import AutoModelForCausalLM

    out = {}
    for arch in ("llama", "llama3_rope", "qwen2", "qwen3"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_hf_config(arch), dtype=torch.float32)
        folder = tmp_path_factory.mktemp(arch)
        shard = "40KB" if arch == "qwen3" else "1GB"
        model.save_pretrained(folder, max_shard_size=shard)
        out[arch] = folder
    return out
