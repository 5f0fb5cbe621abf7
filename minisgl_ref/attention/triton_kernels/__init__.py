"""Attention kernels written in Triton for the ``triton`` backend (chapter 07).

Small kernels, each in its own module so it can be read on its own:

- :mod:`.kv_indices`: flatten the page table rows of a batch into one ``kv_indices`` array (CSR layout with
  ``kv_indptr``), the per-step metadata every paged kernel reads;
- :mod:`.decode_attention`: one new query per request over its whole paged context, split along the context
  ("split-KV" / flash-decoding) and reduced with a log-sum-exp merge;
- :mod:`.extend_attention`: several new queries per request over the cached prefix (paged) plus the new tokens
  themselves (contiguous, causal).

Chapter 11's cascade kernels (:mod:`minisgl_ref.perf.cascade_kernels`) build on :mod:`.decode_attention`'s stage 1.

Conventions shared by the kernels:

- index arithmetic is int64 from the first line (program ids and loaded offsets are cast): a pool of a few
  million slots times ``heads x head_dim`` overflows int32, and the CPU interpreter checks every int32 add and
  multiply for overflow, which would otherwise dominate its run time;
- no calls to helper ``@triton.jit`` functions (``tl.cdiv``, ``tl.zeros``) in the kernels: the interpreter pays
  milliseconds per such call, the compiler nothing for writing the arithmetic inline;
- exponentials are base 2 (``exp2`` with the scale multiplied by ``log2(e)`` once).

Importing this package imports ``triton``. Whether the kernels are compiled for the GPU or run by Triton's
interpreter on the CPU is decided by ``TRITON_INTERPRET=1`` *at import time* (``triton.jit`` reads it when it
decorates a function), so set it before the first import when testing on a machine without a GPU.
"""

from minisgl_ref.attention.triton_kernels.decode_attention import decode_attention_fwd, merge_kv_splits
from minisgl_ref.attention.triton_kernels.extend_attention import extend_attention_fwd, extend_launch_config
from minisgl_ref.attention.triton_kernels.kv_indices import build_kv_indices

__all__ = ["build_kv_indices", "decode_attention_fwd", "extend_attention_fwd", "extend_launch_config",
           "merge_kv_splits"]  # fmt: skip
