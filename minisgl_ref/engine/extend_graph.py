"""CUDA graphs for the extend step of one request: a prompt arriving while others decode (chapter 11).

Decode steps replay CUDA graphs (chapter 08); an extend step ran eagerly, and on an H100 host launching the eager
forward pass of a 28-layer model costs ~15-25 ms (~400 operator launches at ~30 us each, chapter 11, section 11)
while the GPU needs a few. Under overlap the running requests wait for that launch: it is the inter-token
latency tail of online serving. The common case is one new prompt (or one chunk of it) in a step of its own, and
that case can be captured like decode, with two things fixed per graph:

* **The token count.** Extend steps are already padded to a multiple of 64 tokens (``ModelRunner.pad_extend``),
  so a graph per multiple up to ``max_tokens`` covers every such step: ``max_tokens / 64`` graphs.
* **The rows.** Always two: the request, then the padding row (``extend_len`` 0 when the count needed no
  padding). Attention reads its metadata from static buffers the backend refills before each replay
  (``init_extend_graph_buffers``, ``prepare_extend_capture``, ``prepare_extend_replay``); the query length the
  kernel is launched for is the graph's token count, of which each row uses its own part.

The graph runs the whole forward pass and the LM head on the request's last token: a replay returns its logits
``[1, V]``. Steps with more than one real row, prompt log probabilities, or more than ``max_tokens`` tokens run
eagerly as before. Only a backend with the three hooks can be captured (``supports_extend_graph``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from minisgl_ref.core.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from torch import nn

    from minisgl_ref.attention.base import AttentionBackend
    from minisgl_ref.engine.cuda_graph import CudaGraphFactory, RerunGraphFactory

logger = logging.getLogger(__name__)

#: The static per-token inputs of a captured extend step.
TOKEN_INPUTS = ("input_ids", "positions", "out_cache_loc")


class ExtendGraphRunner:
    """Captures one-request extend steps at every multiple of ``multiple`` tokens up to ``max_tokens`` and replays
    them. ``backend`` is the attention backend of extend steps; ``attn_backend`` is what the model's layers call
    (the engine's backend, which may dispatch extend steps to ``backend``)."""

    def __init__(self, model: nn.Module, backend: AttentionBackend, attn_backend: Any, device: torch.device, *,
                 max_tokens: int, multiple: int,
                 graph_factory: CudaGraphFactory | RerunGraphFactory | None = None) -> None:
        from minisgl_ref.engine.cuda_graph import CudaGraphFactory

        self.model, self.backend, self.attn_backend = model, backend, attn_backend
        self.sizes = list(range(multiple, max_tokens + 1, multiple))
        self.max_tokens = self.sizes[-1]
        self.static = {name: torch.zeros(self.max_tokens, dtype=torch.int64, device=device) for name in TOKEN_INPUTS}
        self.rows = torch.zeros(2, dtype=torch.int64, device=device)  # page-table rows: the request, the padding
        self.last = torch.zeros(1, dtype=torch.int64, device=device)  # the request's last token in [T]
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        backend.init_extend_graph_buffers()
        self.graph_factory = graph_factory if graph_factory is not None else CudaGraphFactory(device)
        start = time.perf_counter()
        self.capture()
        self.graph_factory.finish()
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d extend CUDA graphs (%d..%d tokens, one request) in %.1f s", len(self.sizes),
                    self.sizes[0], self.max_tokens, self.capture_seconds)

    def _static_batch(self, t: int) -> ForwardBatch:
        """An extend batch of ``t`` tokens over two rows whose tensors are views of the static buffers. Its host
        lists are those of capture time (the request all ``t`` tokens, nothing cached): a replay never reads them,
        the backend's static buffers carry each step's real lengths."""
        return ForwardBatch(mode=ForwardMode.EXTEND, extend_lens_cpu=[t, 0], prefix_lens_cpu=[0, 0],
                            attn_backend=self.attn_backend, req_pool_indices=self.rows, last_token_indices=self.last,
                            **{name: buf[:t] for name, buf in self.static.items()})  # fmt: skip

    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        hidden = self.model(fb.input_ids, fb.positions, fb)
        return self.model.compute_logits(hidden[fb.last_token_indices])

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per token count, largest first (one shared memory pool, as for decode), each on the static
        buffers at rest: token 0 at position 0 writing slot 0, the request's last token at index 0."""
        for t in reversed(self.sizes):
            fb = self._static_batch(t)
            self.backend.prepare_extend_capture(t)
            for _ in range(2):
                self.graph_factory.warm_up(self._forward, fb)
            self.graphs[t], self.outputs[t] = self.graph_factory.capture(self._forward, fb)

    def can_run(self, fb: ForwardBatch) -> bool:
        """An extend step of one request (plus, maybe, the padding row) whose token count has a graph."""
        assert fb.last_token_indices is not None
        return (not fb.mode.is_decode and fb.last_token_indices.shape[0] == 1 and fb.batch_size <= 2
                and fb.input_ids.shape[0] in self.graphs)

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Copy the step's inputs into the static buffers, let the backend refill its metadata, replay: the
        request's logits ``[1, V]`` (a view of the graph's output, valid until its next replay)."""
        assert fb.req_pool_indices is not None and fb.last_token_indices is not None
        t = fb.input_ids.shape[0]
        for name in TOKEN_INPUTS:
            self.static[name][:t].copy_(getattr(fb, name))
        self.last.copy_(fb.last_token_indices)
        self.rows[: fb.batch_size].copy_(fb.req_pool_indices)
        if fb.batch_size == 1:
            self.rows[1:].fill_(0)
        prefix = fb.prefix_lens_cpu + [0] * (2 - fb.batch_size)
        extend = fb.extend_lens_cpu + [0] * (2 - fb.batch_size)
        self.backend.prepare_extend_replay(self.rows, prefix, extend)
        self.graphs[t].replay()
        return self.outputs[t]
