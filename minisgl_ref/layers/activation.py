"""SwiGLU's gate (chapter 01): the MLP computes ``silu(gate) * up`` from one merged ``gate_up`` projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl_ref.layers import fused, norm_folding, triton_fused


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor, rms_of: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
        """``silu(gate) * up``. With ``rms_of=(x, eps)`` (norm folding, chapter 11), ``gate_up`` is the projection
        of the unnormalised rows of ``x`` and is divided by their rms first."""
        if rms_of is not None:
            x, eps = rms_of
            if triton_fused.available(gate_up):  # one kernel, as without folding
                return triton_fused.silu_and_mul_rms(gate_up, x, eps)
            gate_up = norm_folding.divide_by_rms_(gate_up.clone(), x, eps)
        if fused.fused_available(gate_up):  # one kernel instead of three (chapter 08)
            return fused.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
