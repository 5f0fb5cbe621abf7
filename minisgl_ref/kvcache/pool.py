"""The KV pool: one key and one value buffer per layer, indexed by slot (chapter 03).

Shape per layer: [num_slots, kv_heads, head_dim]. How many slots fit is the most important number of a serving
engine: it bounds how many tokens of context all running requests can hold at once. On a GPU it is sized from
what is left after the weights (``--mem-fraction-static``); anywhere it can be given directly
(``--max-total-tokens``).
"""

from __future__ import annotations

import torch

from minisgl_ref.layers.kernel_table import KERNELS


class KVPool:
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
        shape = (num_slots, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

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
