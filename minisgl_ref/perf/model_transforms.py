"""Chapter 11's speed-ups of the model itself, applied to a built model before the engine is built around it.

Three of them, each behind a seam of the core, so that the model classes of chapter 01 stay as the chapter wrote
them and the CPU, where none of these kernels runs, computes exactly chapter 01's arithmetic:

* the fused per-token kernels go into the layers' kernel table (:mod:`~minisgl_ref.perf.kernels`);
* each attention gets a RoPE kernel that also stores the new K/V (:mod:`~minisgl_ref.perf.rope_store`);
* where the Triton kernels run on one rank, the norms are folded into the projections around them, and every
  decoder layer is replaced by its folded version (:mod:`~minisgl_ref.perf.norm_folding`).

:func:`~minisgl_ref.runtime.build_runtime` calls :func:`apply_` right after loading the weights, on every rank.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from minisgl_ref.perf import kernels, norm_folding, rope_store

log = logging.getLogger(__name__)


def apply_(model: nn.Module, device: torch.device, dtype: torch.dtype) -> list[str]:
    """Apply the speed-ups that can run on ``device`` to ``model`` (in place) and name them. On a CPU none can:
    the model and the kernel table are left as they are."""
    if device.type != "cuda":
        return []
    kernels.install()
    rope_store.store_kv_in_rope_(model)
    applied = ["fused per-token kernels", "K/V store in the RoPE kernel"]
    if norm_folding.should_fold(model, device, dtype):  # two norm kernels fewer per layer
        norm_folding.fold_(model)
        applied.append("folded norms")
    log.info("model speed-ups: %s", ", ".join(applied))
    return applied
