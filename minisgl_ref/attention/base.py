"""The attention backend interface (chapters 00, 03, 07 and 08).

A model's attention layer computes q, k, v for the step's new tokens and hands them to ``batch.attn_backend``.
:meth:`AttentionBackend.forward` stores the new K/V into the pool (the same for every backend, so it happens
here, once) and then calls the backend's attention for the step's mode. A backend is therefore one file of about
four methods:

- ``__init__(kv_pool, req_to_token, ...)``;
- :meth:`~AttentionBackend.init_forward_metadata`: whatever every layer of this step needs (index tensors, kernel
  plans), computed once per step;
- :meth:`~AttentionBackend.attend_extend`: prefill, chunks and mixed batches (the new tokens attend to the cached
  prefix and causally to each other);
- :meth:`~AttentionBackend.attend_decode`: one new token per request, over its whole context.

CUDA graphs (chapter 08) add three hooks. A captured decode graph replays the exact kernels it recorded, reading
their metadata from the *same addresses* every time, so a backend that supports graphs keeps its per-step
metadata in static buffers: :meth:`~AttentionBackend.init_graph_buffers` allocates them once,
:meth:`~AttentionBackend.prepare_capture` points the metadata at them before a batch size is captured and
:meth:`~AttentionBackend.prepare_replay` refills them in place before each replay. Both receive an ordinary decode
batch: the graph runner pads it with dummy rows itself. A backend without graph support (``torch_native``: its
Python loop over requests cannot be recorded) keeps ``supports_cuda_graph = False`` and the engine runs decode
eagerly.

More hooks are declared here, with defaults that say "not supported" (or "myself"), so that the engine calls them on
any backend without asking what it is:

- extend steps in CUDA graphs (chapter 11, :mod:`minisgl_ref.engine.extend_graph`): ``supports_extend_graph`` and
  :meth:`~AttentionBackend.init_extend_graph_buffers`, :meth:`~AttentionBackend.prepare_extend_capture`,
  :meth:`~AttentionBackend.prepare_extend_replay`, the extend counterparts of the three decode hooks;
- :meth:`~AttentionBackend.phase_backend`: which backend runs one phase's steps (a hybrid backend answers with
  one of its halves, every other backend with itself);
- :meth:`~AttentionBackend.use_decode_kernel`: a :class:`DecodeKernel` handed in from outside for large decode
  batches (chapter 11's split-KV kernel, which the FlashInfer backend accepts);
- ``supports_custom_mask``: whether an extend step may restrict, per row, which of its new tokens each new token
  sees (``ForwardBatch.extend_masks``; chapter 13's draft trees).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from minisgl_ref.core.forward_batch import ForwardBatch
    from minisgl_ref.kvcache.pool import KVPool
    from minisgl_ref.kvcache.req_to_token import ReqToTokenPool
    from minisgl_ref.layers.attention import AttentionLayer


class DecodeKernel(Protocol):
    """A decode attention kernel that a backend may run its large batches on instead of its own (chapter 11's
    split-KV kernel, :mod:`minisgl_ref.perf.split_decode`). It reads the context slots the backend has laid end
    to end (``kv_indices``, CSR order), so only a backend that builds them can take one."""

    def plan(self, seq_lens: Sequence[int], kv_indices: torch.Tensor) -> None:
        """Once per step: cut the work of contexts of ``seq_lens`` tokens; ``kv_indices`` holds their slots."""
        ...

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Once per layer: ``[B, heads, head_dim]`` attention of ``q`` over one layer's cache ``k``, ``v``."""
        ...


class AttentionBackend:
    """Base class of every paged attention backend: it holds the KV pool and the page table and stores each
    layer's new K/V before the subclass attends."""

    #: The name users pass to ``--attention-backend`` (set by each subclass).
    name: str = "base"
    #: Whether the three CUDA-graph hooks are implemented (the engine falls back to eager decode if not).
    supports_cuda_graph: bool = False
    #: Whether the three extend-graph hooks are implemented (chapter 11; extend steps run eagerly if not).
    supports_extend_graph: bool = False
    #: Whether extend steps may carry ``ForwardBatch.extend_masks``: per-row masks over a row's new tokens that
    #: take visibility away from the causal mask (chapter 13 verifies a draft *tree* in one row, each node seeing
    #: only its ancestors). ``forward`` refuses a masked batch on a backend without it rather than attend causally
    #: and silently change the result, so the engine must pick a backend that has it for such steps (and run
    #: them eagerly: a captured extend graph replays without masks). ``torch_native`` (the oracle), ``triton``
    #: and ``flashinfer`` have it; ``fa3`` has not: FlashAttention's kernels take only causal or sliding-window
    #: masks, no arbitrary one.
    supports_custom_mask: bool = False
    #: Whether it reads a pool that stores keys and values in a smaller format than its compute dtype, each layer
    #: with its scales (``KVPool.quantized``, chapter 15's FP8 cache). Building a backend without it on such a pool
    #: is refused by name, never run on the raw bytes.
    reads_quantized_kv: bool = False

    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenPool) -> None:
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        k0 = kv_pool.k[0]
        self.device = k0.device
        self.num_kv_heads, self.head_dim = k0.shape[1], k0.shape[2]

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Compute whatever every layer of this step needs (index tensors, kernel plans). Called once per step."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch, *,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] for the T new tokens. Returns [T, heads * head_dim].

        The new K/V go into the pool first, so attention reads every request's whole context from one place (in
        decode, the new token is part of its own context); ``kv_stored=True`` says the model's RoPE kernel has
        written them already."""
        assert batch.out_cache_loc is not None
        if batch.extend_masks is not None and not self.supports_custom_mask and batch.has_custom_mask:
            raise ValueError(f"the {self.name} attention backend takes no custom attention mask, and this batch "
                             f"carries extend_masks: use a backend with supports_custom_mask (torch_native, "
                             f"triton or flashinfer)")
        decode = batch.mode.is_decode
        if not kv_stored:
            self.kv_pool.store(layer.layer_id, batch.out_cache_loc, k, v)
        return self.attend_decode(q, layer, batch) if decode else self.attend_extend(q, k, v, layer, batch)

    def phase_backend(self, decode: bool) -> AttentionBackend:
        """The backend that runs decode steps (``decode=True``) or extend steps: this one, except in a backend
        that sends the two phases to two backends (``HybridAttnBackend``)."""
        return self

    def use_decode_kernel(self, build: Callable[[], DecodeKernel], min_batch: int) -> bool:
        """Run decode batches of at least ``min_batch`` rows on the kernel ``build()`` makes (called on first
        use; if it raises, the backend keeps its own kernel). Returns whether this backend takes such a kernel:
        by default it does not."""
        return False

    def attend_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        """Attention of the new tokens (already stored) over their requests' contexts: [T, heads * head_dim].
        ``k`` / ``v`` are the new tokens' keys and values, for kernels that read them from registers."""
        raise NotImplementedError

    def attend_decode(self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        """Attention of each request's one new token (already stored) over its whole context: [B, heads * head_dim]."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------- CUDA graphs

    def init_graph_buffers(self, max_bs: int) -> None:
        """Allocate, once, every static buffer that captured decode graphs of up to ``max_bs`` requests will read
        metadata from. Sized for the worst case (any context the page table can hold), because nothing may be
        reallocated later: a graph holds raw addresses."""
        raise NotImplementedError(f"the {self.name} attention backend does not support CUDA graphs")

    def prepare_capture(self, batch: ForwardBatch) -> None:
        """Before capturing the graph for ``batch.batch_size`` requests: point the metadata at views of the
        static buffers and fill them for ``batch``. May allocate and sync (it runs once per batch size)."""
        raise NotImplementedError(f"the {self.name} attention backend does not support CUDA graphs")

    def prepare_replay(self, batch: ForwardBatch) -> None:
        """Before each replay: refill the static buffers *in place* for ``batch`` (its size is a captured one).
        This is the hot path of every graphed decode step: it must not allocate memory that the graph reads and
        should not wait for the device (the host-side lengths are in ``batch.seq_lens_cpu``)."""
        raise NotImplementedError(f"the {self.name} attention backend does not support CUDA graphs")

    # ------------------------------------------------------------------------------- extend-step CUDA graphs

    def init_extend_graph_buffers(self, max_rows: int) -> None:
        """Allocate, once, the static buffers that captured extend steps of up to ``max_rows`` rows read their
        lengths and page-table rows from."""
        raise NotImplementedError(f"the {self.name} attention backend does not capture extend steps")

    def prepare_extend_capture(self, rows: int, tokens: int) -> None:
        """Before capturing the extend step of ``rows`` rows and ``tokens`` tokens: point the metadata at the
        static buffers, filled with harmless lengths."""
        raise NotImplementedError(f"the {self.name} attention backend does not capture extend steps")

    def prepare_extend_replay(self, rows: torch.Tensor, prefix_lens: list[int], extend_lens: list[int]) -> None:
        """Before each replay: refill the static buffers for page-table ``rows`` with these lengths (one entry
        per row of the graph, the empty rows included)."""
        raise NotImplementedError(f"the {self.name} attention backend does not capture extend steps")
