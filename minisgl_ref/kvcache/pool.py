"""The KV pool: one key and one value buffer per layer, indexed by slot (chapter 03).

Shape per layer: [num_slots, kv_heads, head_dim]. How many slots fit is the most important number of a serving
engine: it bounds how many tokens of context all running requests can hold at once. On a GPU it is sized from
what is left after the weights (``--mem-fraction-static``); anywhere it can be given directly
(``--max-total-tokens``).
"""

from __future__ import annotations

from typing import Callable

import torch

from minisgl_ref.layers.kernel_table import KERNELS


class KVPool:
    """Keys and values of every layer, kept in the model's dtype.

    A later chapter may keep them in fewer bytes (chapter 15's FP8 pool): then the buffers' dtype
    (:attr:`storage_dtype`) differs from :attr:`dtype`, the one attention computes in, and every stored number
    stands for itself times the layer's scale (:meth:`scales`). Attention backends that read the buffers directly
    apply the scales; the reference backend reads through :meth:`gather`, which returns values in :attr:`dtype`."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_slots = num_slots
        self.dtype = dtype  # what attention computes in, and what gather returns
        shape = (num_slots, num_kv_heads, head_dim)
        store = self.storage_dtype_for(dtype)
        self.k = [torch.zeros(shape, dtype=store, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=store, device=device) for _ in range(num_layers)]

    @classmethod
    def storage_dtype_for(cls, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the buffers for a model computing in ``dtype``: the same one here."""
        return dtype

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def quantized(self) -> bool:
        """Whether the buffers hold something other than the values themselves (a scaled, smaller format)."""
        return self.storage_dtype != self.dtype

    def scales(self, layer_id: int) -> tuple[float, float]:
        """``(k_scale, v_scale)``: stored number times scale = value. 1 for a pool that keeps the values."""
        return 1.0, 1.0

    @classmethod
    def bytes_per_slot(cls, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one token's KV takes in every layer, for a model computing in ``dtype``."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(cls.storage_dtype_for(dtype)).bits // 8

    def gather(self, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of ``slots`` (any shape) in layer ``layer_id``, as values in :attr:`dtype`."""
        return self.k[layer_id][slots], self.v[layer_id][slots]

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the new tokens' keys and values [T, kv_heads, head_dim] into their slots [T].

        Plain indexing, through the kernel table's ``store_kv`` (:mod:`~minisgl_ref.layers.kernel_table`): on a GPU,
        chapter 11 installs one Triton kernel there that writes K and V together, one kernel instead of two and a
        copy of whole rows instead of PyTorch's general indexing, which took ~4x the bandwidth's time on the
        prompts of a prefill step."""
        KERNELS.store_kv(self.k[layer_id], self.v[layer_id], slots, k, v)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the keys and values of slots ``src`` [N] into slots ``dst`` [N], in every layer.

        For KV that was computed in one place and belongs in another: a tree of guessed tokens (chapter 13) is
        computed in slot order, and the accepted path's tokens must end up at their positions' slots. The
        sources are read before anything is written, so the two may overlap."""
        for k, v in zip(self.k, self.v):
            k[dst] = k[src]
            v[dst] = v[src]


#: ``--kv-cache-dtype`` -> the pool class that stores that way. The core knows ``auto``; chapter 15 registers the
#: FP8 formats with :func:`register_kv_cache_dtype`.
KV_CACHE_DTYPES: dict[str, Callable[..., KVPool]] = {"auto": KVPool}


def register_kv_cache_dtype(name: str, pool_cls: Callable[..., KVPool]) -> None:
    """The seam through which a later chapter adds a way of storing the KV cache."""
    KV_CACHE_DTYPES[name] = pool_cls


def kv_pool_class(name: str) -> type[KVPool]:
    """The pool class of ``--kv-cache-dtype name``, refused by name when nothing registered it."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r} is not available (available: {', '.join(sorted(KV_CACHE_DTYPES))}"
                         f"; the FP8 formats are registered by minisgl_ref.quant, as build_runtime does)")
    return KV_CACHE_DTYPES[name]  # type: ignore[return-value]
