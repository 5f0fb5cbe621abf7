"""SwiGLU's gate (chapter 01): the MLP computes ``silu(gate) * up`` from one merged ``gate_up`` projection."""

from __future__ import annotations

import torch
from torch import nn

from minisgl_ref.layers.kernel_table import KERNELS


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` (the kernel table's ``silu_and_mul``: one kernel instead of three on a GPU)."""
        return KERNELS.silu_and_mul(gate_up)
