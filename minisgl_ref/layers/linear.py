"""Linear layers that know how they are split across tensor-parallel ranks (chapters 01 and 09).

Megatron-style tensor parallelism needs only two kinds of split:

* **column-parallel**: each rank owns a slice of the *output* features (rows of the weight). Inputs are
  replicated; outputs stay split. Used for QKV and gate/up projections, whose split outputs feed per-head or
  per-channel work that needs nothing from other ranks.
* **row-parallel**: each rank owns a slice of the *input* features (columns of the weight) and produces a
  partial sum of the full output; an all-reduce adds the partial sums. Used for the attention output and MLP down
  projections, right after the column-parallel ones, so one all-reduce per block is enough.

At tp=1 both degenerate to ``nn.Linear``. Each parameter carries a ``weight_loader`` that knows how to cut its
slice out of a full checkpoint tensor, so loading is the same code at any tp size.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from minisgl_ref.distributed import all_reduce, get_tp_info


def _param(shape: tuple[int, ...], loader: Callable[..., None]) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


def _divide(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({parts})")
    return n // parts


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's output rows split over ranks; the output stays split."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        tp = get_tp_info()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.in_features = in_features
        self.out_per_rank = _divide(out_features, tp.size, "output features")
        self.weight = _param((self.out_per_rank, in_features), self.load_column_shard)
        self.bias = _param((self.out_per_rank,), self.load_column_shard) if bias else None

    def load_column_shard(self, param: nn.Parameter, full: torch.Tensor) -> None:
        param.data.copy_(full.narrow(0, self.tp_rank * self.out_per_rank, self.out_per_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (e.g. gate and up).

    The checkpoint stores them separately; each rank keeps *its* slice of each, side by side.
    """

    def __init__(self, in_features: int, out_features: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(out_features), bias)
        self.out_sizes = [_divide(n, self.tp_size, "output features") for n in out_features]
        self.weight.weight_loader = self.load_merged_shard  # type: ignore[attr-defined]
        if self.bias is not None:
            self.bias.weight_loader = self.load_merged_shard  # type: ignore[attr-defined]

    def load_merged_shard(self, param: nn.Parameter, full: torch.Tensor, shard_id: int) -> None:
        size = self.out_sizes[shard_id]
        offset = sum(self.out_sizes[:shard_id])
        param.data.narrow(0, offset, size).copy_(full.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections fused. Heads are split over ranks; with fewer KV heads than ranks, each KV head is
    replicated on ``tp_size / num_kv_heads`` ranks (every rank needs the KV heads its query heads attend with)."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        tp_size = get_tp_info().size
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp_size, "attention heads")
        if num_kv_heads >= tp_size:
            self.num_kv_heads = _divide(num_kv_heads, tp_size, "KV heads")
        else:
            _divide(tp_size, num_kv_heads, "tensor-parallel size over KV heads")
            self.num_kv_heads = 1
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, out, bias)
        self.total_kv_heads = num_kv_heads
        self.weight.weight_loader = self.load_qkv_shard  # type: ignore[attr-defined]
        if self.bias is not None:
            self.bias.weight_loader = self.load_qkv_shard  # type: ignore[attr-defined]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def load_qkv_shard(self, param: nn.Parameter, full: torch.Tensor, shard_id: str) -> None:
        if shard_id == "q":
            offset, size, head_start = 0, self.q_size, self.tp_rank * self.num_heads
        else:
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            size = self.kv_size
            # With replication, ranks r*k .. r*k+k-1 (k = tp / kv_heads) share KV head r.
            reps = max(1, self.tp_size // self.total_kv_heads)
            head_start = (self.tp_rank // reps) * self.num_kv_heads
        src = full.narrow(0, head_start * self.head_dim, size)
        param.data.narrow(0, offset, size).copy_(src)


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's input columns split; partial outputs are summed by an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        tp = get_tp_info()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.in_per_rank = _divide(in_features, tp.size, "input features")
        self.weight = _param((out_features, self.in_per_rank), self.load_row_shard)
        self.bias = _param((out_features,), self.load_replicated) if bias else None

    def load_row_shard(self, param: nn.Parameter, full: torch.Tensor) -> None:
        param.data.copy_(full.narrow(1, self.tp_rank * self.in_per_rank, self.in_per_rank))

    @staticmethod
    def load_replicated(param: nn.Parameter, full: torch.Tensor) -> None:
        param.data.copy_(full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(F.linear(x, self.weight))
        # The bias is added once, after the sum, not once per rank.
        return y if self.bias is None else y + self.bias
