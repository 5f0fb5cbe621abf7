"""Small helpers shared by the attention backends (chapter 07)."""

from __future__ import annotations

import torch


def indptr(lens: torch.Tensor | list[int], out: torch.Tensor | None = None) -> torch.Tensor:
    """``[0, l0, l0 + l1, ...]`` as int32: where each request's rows start in a flat (CSR) layout. A list gives a
    host tensor (planners that read lengths on the host); a tensor keeps its device. With ``out`` (whose first
    entry is already 0) nothing is allocated: what CUDA-graph replay needs."""
    if isinstance(lens, list):
        lens = torch.tensor(lens, dtype=torch.int32)
    if out is None:
        out = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=lens.device)
    torch.cumsum(lens, dim=0, dtype=torch.int32, out=out[1:])
    return out
