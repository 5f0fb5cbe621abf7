"""RMSNorm, optionally fused with the residual add (chapter 01).

Why fuse? Every decoder layer does ``residual = x + residual; x = norm(residual)`` twice. Doing both in one call
lets a later chapter swap in a single kernel that reads the activations once instead of three times: the
arithmetic is an entry of the kernel table (:mod:`~minisgl_ref.layers.kernel_table`), plain PyTorch until
chapter 11 installs FlashInfer's fused kernels there.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl_ref.layers.kernel_table import KERNELS


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``, or with a residual: ``(norm(x + residual), x + residual)``."""
        if residual is None:
            return KERNELS.rms_norm(x, self.weight, self.eps)
        return KERNELS.add_rms_norm(x, residual, self.weight, self.eps)
