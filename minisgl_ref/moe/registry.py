"""Chapter 14's models, added to the loader's registry through its seam (:func:`register_architecture`).

The loader (chapter 01, a core floor) never imports this package; :func:`~minisgl_ref.runtime.build_runtime`
calls :func:`register_moe_models` before it loads a model, so the offline ``LLM``, the server's scheduler
processes and the benchmarks (which all build through it) know these architectures. Code that calls
``load_model`` directly calls it first.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl_ref.models.loader import register_architecture
from minisgl_ref.moe.fused_moe import fused_experts
from minisgl_ref.moe.layer import use_experts
from minisgl_ref.moe.mixtral import MixtralForCausalLM
from minisgl_ref.moe.model import MoEForCausalLM
from minisgl_ref.moe.qwen3_moe import Qwen3MoeForCausalLM

MOE_ARCHITECTURES: dict[str, type[MoEForCausalLM]] = {
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}


def register_moe_models() -> None:
    """Register every MoE architecture (idempotent: each process that builds a runtime calls it)."""
    for name, cls in MOE_ARCHITECTURES.items():
        register_architecture(name, cls)


def install_moe_kernels(model: nn.Module, device: torch.device) -> int:
    """On a GPU, make every MoE block of ``model`` compute its experts with the fused Triton kernel
    (:func:`~minisgl_ref.moe.fused_moe.fused_experts`): the reference loop asks the host which experts were
    chosen, so it can neither keep up with a GPU nor be captured in a CUDA graph. Returns how many blocks changed
    (0 for a dense model, and on a CPU, where the reference stays)."""
    if device.type != "cuda":
        return 0
    return use_experts(model, fused_experts)
