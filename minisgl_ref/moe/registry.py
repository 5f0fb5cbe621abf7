"""Chapter 14's models, added to the loader's registry through its seam (:func:`register_architecture`).

The loader (chapter 01, a core floor) never imports this package; :func:`~minisgl_ref.runtime.build_runtime`
calls :func:`register_moe_models` before it loads a model, so the offline ``LLM``, the server's scheduler
processes and the benchmarks (which all build through it) know these architectures. Code that calls
``load_model`` directly calls it first.
"""

from __future__ import annotations

from minisgl_ref.models.loader import register_architecture
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
