"""Where weights come from (chapter 01): safetensors checkpoints, or random numbers shaped like one.

A checkpoint is a flat mapping from names (``model.layers.3.self_attn.q_proj.weight``) to tensors. Large models
split it over several files and ship ``model.safetensors.index.json`` to say which file holds which name. We
stream tensors one at a time with ``safe_open`` so peak memory stays near one tensor, not the whole checkpoint.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from minisgl_ref.models.config import ModelConfig


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint files of an HF folder, sharded (via the index) or single."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors checkpoint in {folder} (use --load-format dummy for random weights)")
    return files


class CheckpointTensor:
    """A matrix in a safetensors file that is read only when, and only as far as, a loader asks for it.

    With tensor parallelism each rank needs one slice of most matrices (a block of rows for column-parallel
    layers, of columns for row-parallel ones). The weight loaders of :mod:`minisgl_ref.layers.linear` only call
    ``full.narrow(dim, start, length)``, and here that reads just those bytes through safetensors' ``get_slice``,
    so a rank of a tp=8 model reads about an eighth of each file instead of all of it.
    """

    def __init__(self, handle: Any, name: str) -> None:
        self._slice = handle.get_slice(name)
        self.name = name
        self.shape = torch.Size(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._slice[index]

    def __repr__(self) -> str:
        return f"CheckpointTensor({self.name!r}, shape={tuple(self.shape)})"


def iter_safetensors(folder: Path, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of a checkpoint, one at a time. With ``lazy`` the matrices come as
    :class:`CheckpointTensor` (read slice by slice by the loaders); vectors (norms, biases) are always read whole."""
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if lazy:
                    t = CheckpointTensor(f, name)
                    if len(t.shape) >= 2:
                        yield name, t  # type: ignore[misc]
                        continue
                yield name, f.get_tensor(name)


def checkpoint_shapes(config: ModelConfig, qkv_bias: bool, qk_norm: bool) -> dict[str, tuple[int, ...]]:
    """The names and full (unsharded) shapes an HF checkpoint of this architecture would contain."""
    h, hd, i = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,), p + "self_attn.v_proj.bias": (kv,)}
        if qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def iter_dummy_weights(
    shapes: dict[str, tuple[int, ...]], device: torch.device | str, seed: int = 0, scale: float = 0.02
) -> Iterator[tuple[str, torch.Tensor]]:
    """Random weights in checkpoint form, for benchmarking models whose real weights we do not have.

    Each tensor's random stream is seeded by its name, so every tensor-parallel rank generates the same full tensor
    and slices its own part, exactly as it would from a real checkpoint. Norm weights are ones (as freshly
    initialised models have them) so activations keep a sensible scale through the layers.
    """
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, device=device)
            continue
        gen = torch.Generator(device=device).manual_seed(seed ^ zlib.crc32(name.encode()))
        yield name, torch.empty(shape, device=device).uniform_(-scale, scale, generator=gen)
