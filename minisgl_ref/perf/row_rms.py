"""The part of an RMSNorm that norm folding leaves behind: one number per token (chapter 11).

With the norm's weight folded into the next projection (:mod:`~minisgl_ref.perf.norm_folding`), what is left of
``norm(x) @ W.T`` is a division of each token's row of the projection by ``rms(x)``. The Triton kernels do it while
they read the projection; these are the plain versions, for where they do not run (the CPU, float32).
"""

from __future__ import annotations

import torch


def rms_reciprocal(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``1 / rms(x)`` per row of ``x`` [T, hidden], float32 [T, 1]: the part of RMSNorm that folding leaves."""
    x32 = x.float()
    return torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def divide_by_rms_(t: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    """Divide each token's row of ``t`` [T, ...] by the rms of its row of ``x`` [T, hidden], in place (the plain
    version of what the Triton kernels do while they read ``t``)."""
    r = rms_reciprocal(x, eps).view(-1, *([1] * (t.dim() - 1)))
    return t.copy_((t.float() * r).to(t.dtype))
