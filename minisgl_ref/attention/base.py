"""The attention backend interface (chapters 00, 03 and 07).

A model's attention layer computes q, k, v and hands them to ``batch.attn_backend``. The backend decides where k
and v are stored and how attention over everything the request has seen is computed. Its shape follows SGLang's
backends: metadata is prepared once per step (shared by all layers) and each layer then calls ``forward``, which
dispatches on the batch's mode.

CUDA graphs (chapter 08) add three hooks, again in SGLang's shape. A captured decode graph replays the exact
kernels it recorded, reading their metadata from the *same addresses* every time, so a backend that supports
graphs keeps its per-step metadata in static buffers: :meth:`AttentionBackend.init_cuda_graph_state` allocates
them once, :meth:`AttentionBackend.init_forward_metadata_capture_cuda_graph` points the metadata at them before a
batch size is captured, and :meth:`AttentionBackend.init_forward_metadata_replay_cuda_graph` refills them in
place before each replay. A backend without graph support (``torch_native``: its Python loop over requests and
host-side lengths cannot be recorded) keeps the defaults, which raise; the engine then runs decode eagerly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from minisgl_ref.core.forward_batch import ForwardBatch, ForwardMode
    from minisgl_ref.layers.attention import AttentionLayer


class AttentionBackend:
    """Base class of every attention backend. Subclasses implement ``forward_extend`` / ``forward_decode`` and
    usually ``init_forward_metadata``; graph-capable ones also the three CUDA-graph hooks."""

    #: The name users pass to ``--attention-backend`` (set by each subclass).
    name: str = "base"

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Compute whatever every layer of this step needs (index tensors, kernel plans). Called once per step."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] for the T new tokens. Returns [T, heads * head_dim]."""
        if batch.mode.is_decode:
            return self.forward_decode(q, k, v, layer, batch)
        return self.forward_extend(q, k, v, layer, batch)

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        raise NotImplementedError

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------- CUDA graphs

    @property
    def supports_cuda_graph(self) -> bool:
        """Whether this backend overrides the CUDA-graph hooks (the engine falls back to eager decode if not)."""
        return type(self).init_cuda_graph_state is not AttentionBackend.init_cuda_graph_state

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate, once, every static buffer that captured graphs of up to ``max_bs`` requests
        (``max_num_tokens`` new tokens) will read metadata from. Called before the first capture. Must size the
        buffers for the worst case, because nothing may be reallocated later (a graph holds raw addresses)."""
        raise NotImplementedError(f"the {self.name} attention backend does not support CUDA graphs")

    def init_forward_metadata_capture_cuda_graph(
        self,
        bs: int,
        num_tokens: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        forward_mode: ForwardMode | None = None,
    ) -> None:
        """Before capturing the graph for batch size ``bs``: set ``self``'s forward metadata to views of the
        static buffers (filled for the dummy batch ``req_pool_indices`` / ``seq_lens``, device tensors of
        ``bs`` rows). Everything the kernels read during capture must live in those buffers. May allocate and
        sync (it runs once per batch size, outside the graph)."""
        raise NotImplementedError(f"the {self.name} attention backend does not support CUDA graphs")

    def init_forward_metadata_replay_cuda_graph(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        forward_mode: ForwardMode | None = None,
        seq_lens_sum: int | None = None,
        seq_lens_cpu: torch.Tensor | None = None,
    ) -> None:
        """Before each replay of the graph captured for ``bs``: refill the static buffers *in place* for the
        real (padded) batch. This is the hot path of every decode step, so it must not allocate device memory
        that the graph reads and should not wait for the device (no ``.item()``, no ``.cpu()``); the host-side
        ``seq_lens_sum`` / ``seq_lens_cpu``, when given, are there so that no sync is needed. Padding rows have
        a valid page-table row and a length of at least 1; their outputs are discarded."""
        raise NotImplementedError(f"the {self.name} attention backend does not support CUDA graphs")

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """The sequence length given to padding rows of a replayed batch (SGLang's name). 1 works for every
        backend here: a padding row then reads one (valid, ignored) KV slot."""
        return 1
