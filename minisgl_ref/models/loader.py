"""From a ``--model-path`` to a ready model (chapter 01)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from minisgl_ref.distributed import get_tp_info
from minisgl_ref.models.config import ModelConfig
from minisgl_ref.models.embedded import EMBEDDED_NAME, embedded_model_path
from minisgl_ref.models.llama import LlamaForCausalLM
from minisgl_ref.models.qwen2 import Qwen2ForCausalLM
from minisgl_ref.models.qwen3 import Qwen3ForCausalLM
from minisgl_ref.models.weights import iter_dummy_weights, iter_safetensors

#: config.json's ``architectures[0]`` -> the class that builds it. Mistral is Llama's architecture (its sliding
#: window is enforced through :meth:`ModelConfig.usable_context`). Later chapters add theirs with
#: :func:`register_architecture`.
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def register_architecture(name: str, cls: type[LlamaForCausalLM]) -> None:
    """The seam through which a later chapter adds a model family (chapter 14's mixture-of-experts models) without
    the loader importing it: ``cls`` builds every config whose ``architectures[0]`` is ``name``.

    ``cls`` offers what :func:`load_model` calls on a model class: ``cls(config)``, ``load_weights`` and the
    classmethod ``checkpoint_shapes`` (for dummy weights). Registering the same class twice is harmless (each
    process that builds a runtime registers); a second class under a taken name is refused, so a plug-in can never
    silently replace a model that already has a meaning."""
    known = MODEL_REGISTRY.get(name)
    if known is not None and known is not cls:
        raise ValueError(f"architecture {name!r} is already served by {known.__name__}, not {cls.__name__}")
    MODEL_REGISTRY[name] = cls


class Quantization(Protocol):
    """A way of storing weights in fewer bits (chapter 15's FP8), as the loader uses it: before a quantized
    checkpoint's tensors arrive, the built model's layers are made ready to take them; or, asked for a checkpoint
    that is not quantized (SGLang's ``--quantization``), the loaded weights are quantized."""

    def prepare_checkpoint(self, model: nn.Module, config: ModelConfig, qconfig: dict[str, Any]) -> None: ...

    def quantize(self, model: nn.Module, config: ModelConfig) -> None: ...


#: ``quant_method`` of a checkpoint's ``quantization_config`` (or a ``--quantization`` name) -> how to load it.
#: Empty in the core; chapter 15 adds FP8 with :func:`register_quantization`.
QUANTIZATIONS: dict[str, Quantization] = {}


def register_quantization(name: str, method: Quantization) -> None:
    """The seam through which a later chapter adds a weight format without the loader importing it (as
    :func:`register_architecture` adds a model family)."""
    QUANTIZATIONS[name] = method


def _quantization_of(config: ModelConfig, quantization: str | None) -> tuple[str | None, dict[str, Any] | None]:
    """Which quantization applies, and the checkpoint's ``quantization_config`` if the checkpoint itself is
    quantized. A format nobody registered is refused by name, never loaded as if it were bf16."""
    qconfig = config.raw.get("quantization_config")
    if qconfig is not None:
        name = qconfig.get("quant_method")
        if name not in QUANTIZATIONS:
            raise ModelPathError(f"the checkpoint is quantized with quant_method {name!r}, which is not supported "
                                 f"(supported: {', '.join(sorted(QUANTIZATIONS)) or 'none'})")
        if quantization not in (None, name):
            raise ValueError(f"quantization={quantization!r} asked for a checkpoint already quantized with {name!r}")
        return name, qconfig
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(sorted(QUANTIZATIONS)) or 'none'} (or unset), "
                         f"got {quantization!r}")
    return quantization, None


SHIPPED_CONFIGS = Path(__file__).parent / "configs"
LOAD_FORMATS = ("auto", "dummy")


class ModelPathError(ValueError):
    """A model path that cannot be used; the message is one line meant for the user."""


@dataclass(frozen=True)
class ResolvedModel:
    path: Path | None  # the HF folder, or None for a shipped config without weights
    config_file: Path


def shipped_config_names() -> list[str]:
    return sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.json"))


def resolve_model_path(model_path: str | None, load_format: str = "auto") -> ResolvedModel:
    """Turn what the user typed into a folder (or a shipped config for dummy weights), or explain why not."""
    if load_format not in LOAD_FORMATS:
        raise ModelPathError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if model_path is None or model_path in ("", EMBEDDED_NAME, f"HuggingFaceTB/{EMBEDDED_NAME}"):
        folder = embedded_model_path()
        return ResolvedModel(folder, folder / "config.json")
    path = Path(model_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelPathError(f"model path {model_path!r} has no config.json, so it is not an HF model folder")
        return ResolvedModel(path, path / "config.json")
    short = model_path.split("/")[-1].lower()
    if (SHIPPED_CONFIGS / f"{short}.json").is_file():
        if load_format != "dummy":
            raise ModelPathError(
                f"{model_path!r} is not a local folder and weights cannot be downloaded here; "
                f"add --load-format dummy to build it from its shipped config with random weights"
            )
        return ResolvedModel(None, SHIPPED_CONFIGS / f"{short}.json")
    if path.exists():
        raise ModelPathError(f"model path {model_path!r} is a file, not an HF model folder")
    raise ModelPathError(
        f"model path {model_path!r} does not exist (shipped configs for --load-format dummy: "
        f"{', '.join(shipped_config_names())})"
    )


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig, device: torch.device) -> torch.dtype:
    """``auto`` means the checkpoint's dtype, with two exceptions. On the CPU, where half precision is slow, it
    is float32. On a GPU, a float32 checkpoint runs in bfloat16 (vLLM's ``auto`` likewise serves float32
    checkpoints in 16 bits): the fast attention kernels (FlashAttention, FlashInfer) and our fused kernels
    compute in 16 bits only, and in float32 a GPU falls back to exact-product Triton kernels many times slower.
    bfloat16 keeps float32's exponent range, so no activation that fitted before overflows. The embedded
    SmolLM2 is such a checkpoint: its de-quantised weights are stored in float32. ``--dtype float32`` keeps
    float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "float16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16}
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.bfloat16 if config.dtype == torch.float32 else config.dtype
    if dtype not in names:
        raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {dtype!r}")
    return names[dtype]


def load_model(
    model_path: str | None = None,
    *,
    load_format: str = "auto",
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    quantization: str | None = None,
) -> tuple[nn.Module, ModelConfig, Path | None]:
    """Build the model class named by the config, fill in its weights, return (model, config, folder). The model
    is the chapter-01 model as built; :func:`~minisgl_ref.runtime.build_runtime` applies chapter 11's speed-ups
    (fused kernels, folded norms) to it when it will serve on a GPU.

    A quantized checkpoint (its config's ``quantization_config``) loads through the registered
    :class:`Quantization` of its ``quant_method``; ``quantization`` quantizes an ordinary checkpoint as it loads
    (chapter 15). Dummy weights of a quantized config are drawn in full precision and quantized."""
    resolved = resolve_model_path(model_path, load_format)
    try:
        config = ModelConfig.from_file(resolved.config_file)
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise ModelPathError(f"cannot read {resolved.config_file}: {e}") from e
    if config.architecture not in MODEL_REGISTRY:
        raise ModelPathError(
            f"architecture {config.architecture!r} is not supported (supported: {', '.join(MODEL_REGISTRY)})"
        )
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, config, device)
    config.dtype = torch_dtype
    model_cls = MODEL_REGISTRY[config.architecture]
    method, qconfig = _quantization_of(config, quantization)
    with torch.device(device), _default_dtype(torch_dtype):
        model = model_cls(config)
    if method is not None and qconfig is not None and load_format != "dummy":
        QUANTIZATIONS[method].prepare_checkpoint(model, config, qconfig)
    if load_format == "dummy":
        model.load_weights(iter_dummy_weights(model_cls.checkpoint_shapes(config), device))
    else:
        assert resolved.path is not None
        try:
            # At tp > 1 each rank reads only its slices (lazily, through safetensors' get_slice).
            model.load_weights(iter_safetensors(resolved.path, lazy=get_tp_info().size > 1))
        except FileNotFoundError as e:
            raise ModelPathError(str(e)) from e
    if method is not None and (qconfig is None or load_format == "dummy"):
        QUANTIZATIONS[method].quantize(model, config)
    return model.eval(), config, resolved.path


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create parameters directly in the target dtype: building in float32 and converting would briefly need
    twice the memory. (RoPE tables ask for float32 explicitly and are unaffected.)"""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
