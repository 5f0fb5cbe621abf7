"""CUDA graphs for extend steps with few rows: a prompt arriving while others decode (chapter 11).

Decode steps replay CUDA graphs (chapter 08); an extend step ran eagerly, and on an H100 host launching the eager
forward pass of a 28-layer model costs ~15-25 ms (~400 operator launches at ~30 us each, chapter 11, section 7)
while the GPU needs a few. Under overlap the running requests wait for that launch: it is the inter-token
latency tail of online serving. The common cases are one new prompt (or one chunk of it) in a step of its own,
and, with mixed chunks, that prompt plus the running requests' decode rows (one token each). Both can be
captured like decode, with two things fixed per graph:

* **The token count.** Extend steps are already padded to a multiple of 64 tokens (``ModelRunner.pad_extend``),
  so a graph per multiple up to ``max_tokens`` covers every such step: ``max_tokens / 64`` graphs per row count.
* **The row count**, from a few buckets (:data:`ROW_BUCKETS`): 2 is one request and the padding row; 16 and 64
  take a prompt with up to 14 or 62 decode rows beside it. A step runs in the smallest bucket that holds its
  rows; the bucket's unused rows are empty (no tokens, no context). Attention reads its metadata from static
  buffers the backend refills before each replay (``init_extend_graph_buffers``, ``prepare_extend_capture``,
  ``prepare_extend_replay``); the query length the kernel is launched for is the graph's token count, of which
  each row uses its own part.

One more graph serves the opposite case, a burst of prompts (a benchmark's, or a crowd arriving at a server at
once): the scheduler fills every prefill step with exactly ``--max-prefill-tokens`` tokens (chunking the last
prompt of each step to fit), over a few dozen rows. Launched eagerly, such a step costs the host ~20 ms on top
of ~15 ms of scheduling and preparing, against ~30 ms of GPU work for 16,384 tokens: the host, not the GPU, set
the pace of a burst's prefill. ``budget_tokens`` adds a graph for exactly that token count, in the largest row
bucket only (chapter 11 measures what it bought).

The graph runs the whole forward pass and the LM head on each row's last token, and writes the logits into one
buffer per bucket, so that 96 graphs do not keep 96 logits tensors. It also copies the final hidden states of all
tokens into one shared buffer (a copy of ``T x hidden`` values, microseconds against the step): a verify step of
speculative decoding (chapter 13), which needs the logits at every drafted position, replays the graph and runs
the LM head on those positions alone, rather than the whole forward pass eagerly. Steps with more rows than the largest bucket,
prompt log probabilities, or more than ``max_tokens`` tokens run eagerly as before. Only a backend with the three
hooks can be captured (``supports_extend_graph``, declared with the hooks on
:class:`~minisgl_ref.attention.base.AttentionBackend`).
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

#: Row counts with graphs: one request and the padding row; a prompt with a few or with a few dozen decode rows.
ROW_BUCKETS = (2, 16, 64)


class ExtendGraphRunner:
    """Captures extend steps at every multiple of ``multiple`` tokens up to ``max_tokens``, for each row count of
    ``row_buckets``, and replays them. ``backend`` is the attention backend of extend steps; ``attn_backend`` is
    what the model's layers call (the engine's backend, which may dispatch extend steps to ``backend``)."""

    def __init__(self, model: nn.Module, backend: AttentionBackend, attn_backend: AttentionBackend,
                 device: torch.device, *,
                 max_tokens: int, multiple: int, row_buckets: tuple[int, ...] = ROW_BUCKETS, budget_tokens: int = 0,
                 graph_factory: CudaGraphFactory | RerunGraphFactory | None = None) -> None:
        from minisgl_ref.engine.cuda_graph import CudaGraphFactory

        if not row_buckets or min(row_buckets) < 2:
            raise ValueError(f"row buckets must be at least 2 (a request and the padding row), got {row_buckets}")
        self.model, self.backend, self.attn_backend = model, backend, attn_backend
        self.sizes = list(range(multiple, max_tokens + 1, multiple))
        self.row_buckets = sorted(row_buckets)
        # The budget step's token count as the step will have it: padded up to the multiple (pad_extend).
        budget = -(-budget_tokens // multiple) * multiple
        self.budget_tokens = budget if budget > self.sizes[-1] else 0  # 0: no graph of its own
        self.max_tokens = max(self.sizes[-1], self.budget_tokens)
        max_rows = self.row_buckets[-1]
        self.static = {name: torch.zeros(self.max_tokens, dtype=torch.int64, device=device) for name in TOKEN_INPUTS}
        self.rows = torch.zeros(max_rows, dtype=torch.int64, device=device)  # page-table rows (0: padding, empty)
        self.last = torch.zeros(max_rows, dtype=torch.int64, device=device)  # each row's last token in [T]
        head = model.lm_head
        self.logits = {r: torch.zeros(r, head.vocab_size, dtype=head.weight.dtype, device=device)
                       for r in self.row_buckets}
        self.hidden = torch.zeros(self.max_tokens, head.weight.shape[1], dtype=head.weight.dtype, device=device)
        self.graphs: dict[tuple[int, int], Any] = {}  # (rows, tokens) -> graph
        backend.init_extend_graph_buffers(max_rows)
        self.graph_factory = graph_factory if graph_factory is not None else CudaGraphFactory(device)
        start = time.perf_counter()
        self.capture()
        self.graph_factory.finish()
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d extend CUDA graphs (%d..%d tokens; %s rows%s) in %.1f s", len(self.graphs),
                    self.sizes[0], self.sizes[-1], "/".join(map(str, self.row_buckets)),
                    f"; and {self.budget_tokens} tokens, {self.row_buckets[-1]} rows" if self.budget_tokens else "",
                    self.capture_seconds)

    def sizes_of(self, rows: int) -> list[int]:
        """The token counts captured for ``rows`` rows, ascending: the budget step's only with the most rows."""
        extra = [self.budget_tokens] if self.budget_tokens and rows == self.row_buckets[-1] else []
        return self.sizes + extra

    def _static_batch(self, rows: int, t: int) -> ForwardBatch:
        """An extend batch of ``t`` tokens over ``rows`` rows whose tensors are views of the static buffers. Its
        host lists are those of capture time (the first row all ``t`` tokens, nothing cached, the other rows
        empty): a replay never reads them, the backend's static buffers carry each step's real lengths."""
        return ForwardBatch(mode=ForwardMode.EXTEND, extend_lens_cpu=[t] + [0] * (rows - 1), prefix_lens_cpu=[0] * rows,
                            attn_backend=self.attn_backend, req_pool_indices=self.rows[:rows],
                            last_token_indices=self.last[:rows],
                            **{name: buf[:t] for name, buf in self.static.items()})  # fmt: skip

    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        hidden = self.model(fb.input_ids, fb.positions, fb)
        self.hidden[: hidden.shape[0]].copy_(hidden)
        out = self.logits[fb.batch_size]
        out.copy_(self.model.compute_logits(hidden[fb.last_token_indices]))
        return out

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per (row count, token count), largest first (one shared memory pool, as for decode), each on
        the static buffers at rest: token 0 at position 0 writing slot 0, every row's last token at index 0.

        Only the first row count captured runs eager warm-ups (twice per token count): they exist so that lazy
        initialisation happens outside a capture, and the smaller row counts launch the same kernels at the same
        token counts (the LM head's few row counts are met by the start-up matmul warm-up). On an H100, warming
        every graph made this capture take 4.5 s and a warm start 17.3 s; warming the first row count only, 2.7 s
        and 14.1 s (``docs/data/canonical_startup_all_warmups_h100.json``, ``canonical_startup_multirow_graphs_h100.json``)."""
        for rows in reversed(self.row_buckets):
            for t in reversed(self.sizes_of(rows)):
                if t != self.budget_tokens:
                    self._capture_one(rows, t)
                    continue
                # The budget step's graph keeps the activations of a whole prefill step in the graphs' pool. Where
                # memory is short (a large model on a small GPU) that graph is skipped, not the engine: the step
                # then runs eagerly, as it would without the graph.
                try:
                    self._capture_one(rows, t)
                except torch.cuda.OutOfMemoryError:
                    logger.warning("not enough GPU memory to capture the %d-token prefill step; it runs eagerly", t)
                    self.graphs.pop((rows, t), None)
                    self.budget_tokens = 0
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()

    def _capture_one(self, rows: int, t: int) -> None:
        fb = self._static_batch(rows, t)
        self.backend.prepare_extend_capture(rows, t)
        if rows == self.row_buckets[-1]:
            for _ in range(2):
                self.graph_factory.warm_up(self._forward, fb)
        self.graphs[rows, t], _ = self.graph_factory.capture(self._forward, fb)

    def bucket(self, fb: ForwardBatch) -> tuple[int, int] | None:
        """The graph for an extend step (rows, tokens), or None: the smallest row bucket that holds the step's rows
        (the padding row included) and has a graph at the step's token count."""
        if fb.mode.is_decode:
            return None
        t = fb.input_ids.shape[0]
        return next(((r, t) for r in self.row_buckets if r >= fb.batch_size and (r, t) in self.graphs), None)

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.attn_backend is self.attn_backend and self.bucket(fb) is not None

    def can_run_all_positions(self, fb: ForwardBatch) -> bool:
        """A step whose rows only ever see their tokens causally (a tree mask is not in the static buffers)."""
        return fb.extend_masks is None and self.can_run(fb)

    def hidden_states(self, fb: ForwardBatch) -> torch.Tensor:
        return self.hidden[: fb.input_ids.shape[0]]

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Copy the step's inputs into the static buffers, let the backend refill its metadata, replay: the logits
        ``[R, V]`` of the step's ``R`` sampled rows (a view of the bucket's buffer, valid until its next replay).

        Rows past the step's own are empty: page-table row 0, no tokens, no context, and a last-token index of 0
        (an index left from a larger step could point past this graph's tokens)."""
        assert fb.req_pool_indices is not None and fb.last_token_indices is not None
        key = self.bucket(fb)
        assert key is not None, "no graph for this step: check can_run first"
        rows, t = key
        n, sampled = fb.batch_size, fb.last_token_indices.shape[0]
        for name in TOKEN_INPUTS:
            self.static[name][:t].copy_(getattr(fb, name))
        self.last[:sampled].copy_(fb.last_token_indices)
        self.last[sampled:rows].zero_()
        self.rows[:n].copy_(fb.req_pool_indices)
        self.rows[n:rows].zero_()
        empty = [0] * (rows - n)
        self.backend.prepare_extend_replay(self.rows[:n], fb.prefix_lens_cpu + empty, fb.extend_lens_cpu + empty)
        self.graphs[key].replay()
        return self.logits[rows][:sampled]
