"""Attention backends (chapter 07). Chapter 00 needs only the no-cache oracle.

Backends by name (``--attention-backend``): ``torch_native`` (the oracle), ``triton`` (kernels written here),
``flashinfer`` and ``fa3`` (libraries). :func:`create_attention_backend` picks and builds them; the kernel
backends are imported only when asked for, so the CPU-only install never imports triton, flashinfer or
flash-attn unless it has to.
"""

from minisgl_ref.attention.base import AttentionBackend
from minisgl_ref.attention.registry import HybridAttnBackend, create_attention_backend
from minisgl_ref.attention.torch_native import NoCacheAttentionBackend, TorchNativeBackend, reference_attention

__all__ = ["AttentionBackend", "HybridAttnBackend", "NoCacheAttentionBackend",
           "TorchNativeBackend", "create_attention_backend", "reference_attention"]  # fmt: skip
