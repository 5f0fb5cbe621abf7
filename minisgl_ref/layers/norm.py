"""RMSNorm, optionally fused with the residual add (chapter 01).

Why fuse? Every decoder layer does ``residual = x + residual; x = norm(residual)`` twice. Doing both in one call
lets a later chapter swap in a single kernel that reads the activations once instead of three times.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl_ref.layers import fused


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in float32 even for bf16 activations: the mean of squares of 4096 bf16 numbers loses digits.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``, or with a residual: ``(norm(x + residual), x + residual)``."""
        if fused.fused_available(x):  # one FlashInfer kernel on the GPU (chapter 08); the code below elsewhere
            if residual is None:
                return fused.rmsnorm(x, self.weight, self.eps)
            return fused.fused_add_rmsnorm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        summed = x + residual
        return self._norm(summed), summed
