"""Attention backends (chapter 07). Chapter 00 needs only the no-cache oracle."""

from minisgl_ref.attention.base import AttentionBackend
from minisgl_ref.attention.torch_native import NoCacheAttentionBackend, TorchNativeBackend, reference_attention

__all__ = ["AttentionBackend", "NoCacheAttentionBackend", "TorchNativeBackend", "reference_attention"]
