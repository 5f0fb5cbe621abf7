"""Linear layers that know how they are split across tensor-parallel ranks (chapters 01 and 09).

Megatron-style tensor parallelism needs only two kinds of split:

* **column-parallel**: each rank owns a slice of the *output* features (rows of the weight). Inputs are
  replicated; outputs stay split. Used for QKV and gate/up projections, whose split outputs feed per-head or
  per-channel work that needs nothing from other ranks.
* **row-parallel**: each rank owns a slice of the *input* features (columns of the weight) and produces a
  partial sum of the full output; an all-reduce adds the partial sums. Used for the attention output and MLP down
  projections, right after the column-parallel ones, so one all-reduce per block is enough.

At tp=1 both degenerate to ``nn.Linear``. How the product itself is computed is a seam: each layer calls its
``quant_method`` (:class:`LinearMethod`), chapter 01's plain matmul unless chapter 15 stores the weight in FP8 and
installs a method that reads it. Each parameter carries a ``weight_loader`` that knows how to cut its
slice out of a full checkpoint tensor, so loading is the same code at any tp size. The loaders only ever call
``full.narrow(dim, start, length)`` on what they are given, so the checkpoint reader can hand them a lazy
tensor that reads just that slice from disk (:class:`~minisgl_ref.models.weights.CheckpointTensor`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from minisgl_ref.distributed import all_reduce, get_tp_info


class LinearMethod(Protocol):
    """How a linear layer computes ``x W^T + b`` from the parameters it holds (the seam of chapter 15's FP8
    weights). ``bias`` is what the layer wants added here: a row-parallel layer adds its bias after the all-reduce
    and passes None. ``quantized`` says whether the layer's weight is stored in another format than the model's
    dtype (a flag, not an identity check: a deep copy of a model copies its methods too)."""

    quantized: bool

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


class UnquantizedMethod:
    """Chapter 01's matmul: ``layer.weight`` in the model's dtype."""

    quantized = False

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


UNQUANTIZED = UnquantizedMethod()


def _param(shape: tuple[int, ...], loader: Callable[..., None]) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    return p


def _divide(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({parts})")
    return n // parts


def _whole(full: Any) -> torch.Tensor:
    """A checkpoint tensor in full (a lazy one is read now)."""
    return full if isinstance(full, torch.Tensor) else full.narrow(0, 0, full.shape[0])


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank owns: query heads ``[q_start, q_start + num_q)`` and KV heads
    ``[kv_start, kv_start + num_kv)`` of the full model."""

    q_start: int
    num_q: int
    kv_start: int
    num_kv: int


def shard_heads(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadShard:
    """Split the heads over ``size`` ranks so that every rank holds whole GQA groups (a KV head and the query
    heads that read it) and attention needs no communication.

    * ``num_kv_heads >= size``: each rank takes a contiguous run of KV heads with their query heads. When the
      division is not even, the first ``num_kv_heads % size`` ranks take one group more (SmolLM2-135M's 3 KV
      heads on 2 ranks: 2 + 1 groups, 6 + 3 query heads).
    * ``num_kv_heads < size``: every KV head is *replicated* on ``size / num_kv_heads`` ranks, which split its
      query heads between them (Qwen3-0.6B's 8 KV heads at tp=16; 1 KV head at tp=2). Replica ``k`` of a KV head
      (``k = rank % (size / num_kv_heads)``) takes the ``k``-th equal run of that head's query heads.

    Query heads ``g * group .. (g + 1) * group - 1`` read KV head ``g`` (``group = num_heads // num_kv_heads``).
    A split that cannot give every rank whole query heads raises ``ValueError``: ``size`` must be a multiple of
    ``num_kv_heads`` when it is larger ("... multiple of the KV heads ..."), and each KV head's query heads must
    divide over its replicas ("... not divisible ..."). ``size == 1`` (and a model whose query heads are not a
    multiple of its KV heads) is handled before the split, so a single-rank model never runs it.
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"attention heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if size == 1:  # one rank holds every head: nothing to split
        return HeadShard(0, num_heads, 0, num_kv_heads)
    # BEGIN TASK 9.1: split the attention heads over ranks
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        base, extra = divmod(num_kv_heads, size)
        kv_start = rank * base + min(rank, extra)
        num_kv = base + (rank < extra)
        return HeadShard(kv_start * group, num_kv * group, kv_start, num_kv)
    if size % num_kv_heads:
        raise ValueError(
            f"the tensor-parallel size ({size}) must be a multiple of the KV heads ({num_kv_heads}) "
            "when there are fewer KV heads than ranks"
        )
    reps = size // num_kv_heads
    if group % reps:
        raise ValueError(f"attention heads ({num_heads}) are not divisible by the tensor-parallel size ({size})")
    kv = rank // reps
    num_q = group // reps
    return HeadShard(kv * group + (rank % reps) * num_q, num_q, kv, 1)
    # END TASK 9.1


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's output rows split over ranks; the output stays split.

    ``shard = (start, size)`` picks this rank's rows explicitly; by default the rows are divided evenly."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, *, shard: tuple[int, int] | None = None
    ) -> None:
        super().__init__()
        tp = get_tp_info()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.in_features = in_features
        if shard is None:
            size = _divide(out_features, tp.size, "output features")
            shard = (tp.rank * size, size)
        self.out_start, self.out_per_rank = shard
        self.weight = _param((self.out_per_rank, in_features), self.load_column_shard)
        self.bias = _param((self.out_per_rank,), self.load_column_shard) if bias else None
        self.quant_method: LinearMethod = UNQUANTIZED

    def load_column_shard(self, param: nn.Parameter, full: torch.Tensor) -> None:
        param.data.copy_(full.narrow(0, self.out_start, self.out_per_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


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
    """Q, K and V projections fused. Heads are split over ranks by :func:`shard_heads` (whole GQA groups per
    rank; with fewer KV heads than ranks, each KV head is replicated on ``tp_size / num_kv_heads`` ranks)."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        tp = get_tp_info()
        self.head_dim = head_dim
        self.heads = shard_heads(num_heads, num_kv_heads, tp.rank, tp.size)
        self.num_heads = self.heads.num_q
        self.num_kv_heads = self.heads.num_kv
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden_size, out, bias, shard=(0, out))  # rows are placed by load_qkv_shard
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

    @property
    def q_shard(self) -> tuple[int, int]:
        """(first feature, features) of the query heads this rank owns: the input slice of ``o_proj``."""
        return self.heads.q_start * self.head_dim, self.q_size

    def load_qkv_shard(self, param: nn.Parameter, full: torch.Tensor, shard_id: str) -> None:
        if shard_id == "q":
            offset, size, head_start = 0, self.q_size, self.heads.q_start
        else:
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            size, head_start = self.kv_size, self.heads.kv_start
        src = full.narrow(0, head_start * self.head_dim, size)
        param.data.narrow(0, offset, size).copy_(src)


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's input columns split; partial outputs are summed by an all-reduce.

    ``shard = (start, size)`` picks this rank's input columns explicitly (``o_proj`` takes the query heads its
    rank owns, see :attr:`QKVParallelLinear.q_shard`); by default the columns are divided evenly."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, *, shard: tuple[int, int] | None = None
    ) -> None:
        super().__init__()
        tp = get_tp_info()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        if shard is None:
            size = _divide(in_features, tp.size, "input features")
            shard = (tp.rank * size, size)
        self.in_start, self.in_per_rank = shard
        self.weight = _param((out_features, self.in_per_rank), self.load_row_shard)
        self.bias = _param((out_features,), self.load_replicated) if bias else None
        self.quant_method: LinearMethod = UNQUANTIZED

    def load_row_shard(self, param: nn.Parameter, full: torch.Tensor) -> None:
        param.data.copy_(full.narrow(1, self.in_start, self.in_per_rank))

    @staticmethod
    def load_replicated(param: nn.Parameter, full: torch.Tensor) -> None:
        param.data.copy_(_whole(full))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(self.quant_method.apply(self, x, None))
        # The bias is added once, after the sum, not once per rank.
        return y if self.bias is None else y + self.bias
