"""The handful of numbers that define a decoder-only transformer (chapter 01).

Hugging Face ``config.json`` files spell the same idea several ways: older files carry ``rope_theta`` and
``rope_scaling``, transformers 5 writes ``rope_parameters``; Llama-style files may omit ``head_dim``. We read them
once, here, into one flat, typed record so that the model code never has to guess.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ModelConfig:
    architecture: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    dtype: torch.dtype
    eos_token_ids: list[int] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    #: Each token attends only to the last ``sliding_window`` tokens (Mistral-7B-v0.1: 4096), or None for full
    #: causal attention. Qwen configs carry a window that is off unless ``use_sliding_window`` says otherwise.
    sliding_window: int | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer: the unit in which KV-cache memory is budgeted (chapter 11's roofline uses it)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    def usable_context(self, requested: int | None = None) -> int:
        """The longest sequence this engine may serve: ``requested``, else ``max_position_embeddings``.

        Our attention is full causal attention. With a sliding window, that is the model's own attention only
        while a sequence fits in the window (every token then sees all earlier ones either way), so a context
        longer than the window would silently compute something else. Asked for more, we refuse by name; by
        default the context is capped at the window, and the log says why (Mistral-7B-v0.1: 32768 -> 4096)."""
        window = self.sliding_window
        if requested is not None:
            if window is not None and requested > window:
                raise ValueError(
                    f"context_length={requested} exceeds the model's sliding_window={window}: its attention "
                    f"would differ from the full causal attention implemented here (use a context_length of at "
                    f"most {window})")
            return requested
        if window is not None and window < self.max_position_embeddings:
            log.warning("context length capped at the model's sliding_window=%d (from max_position_embeddings="
                        "%d): beyond the window its attention differs from full causal attention", window,
                        self.max_position_embeddings)
            return window
        return self.max_position_embeddings

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        archs = d.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry, so the model class is unknown")
        num_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        theta, scaling = _rope_from_config(d)
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        dtype_name = d.get("torch_dtype") or d.get("dtype") or "float32"
        return cls(
            architecture=archs[0],
            model_type=d.get("model_type", ""),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or hidden // num_heads),
            vocab_size=int(d["vocab_size"]),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            dtype=_DTYPES.get(str(dtype_name).replace("torch.", ""), torch.float32),
            eos_token_ids=eos_ids,
            raw=dict(d),
            sliding_window=_sliding_window(d),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        with open(path) as f:
            return cls.from_dict(json.load(f))


def _sliding_window(d: dict[str, Any]) -> int | None:
    """The attention window the model was trained with, or None. Mistral and Mixtral files set
    ``sliding_window`` (null for full attention); Qwen files always carry a number but use it only with
    ``use_sliding_window: true``."""
    window = d.get("sliding_window")
    if window is None or d.get("use_sliding_window", True) is False:
        return None
    return int(window)


def _rope_from_config(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Return (theta, scaling) whichever of the two config spellings the file uses.

    ``scaling`` is None for plain RoPE, else a dict with at least ``rope_type`` (only ``default`` and ``llama3``
    are implemented; others are rejected loudly rather than silently computed wrong).
    """
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(d.get("rope_theta", 10000.0))
        scaling = dict(d["rope_scaling"]) if d.get("rope_scaling") else None
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        scaling["rope_type"] = kind
        if kind == "default":
            scaling = None
        elif kind != "llama3":
            raise ValueError(f"rope scaling type {kind!r} is not supported (supported: default, llama3)")
    return theta, scaling
