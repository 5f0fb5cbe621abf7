"""CUDA graphs for decode: record a decode step once per batch size, then replay it (chapter 08).

Why: a decode step of a small model is hundreds of tiny kernels (Qwen3-0.6B: 28 layers x ~15 kernels). Each
launch costs the CPU a few microseconds, and at batch 1 the GPU finishes most kernels faster than the CPU can
launch the next one, so the GPU idles between kernels. A CUDA graph records the whole sequence of launches with
their arguments (raw device addresses included) and replays it with one call: the launch overhead is paid once
per step instead of once per kernel.

What that demands:

* **Static buffers.** A replay uses the addresses recorded at capture time, so every input lives in a buffer
  allocated once (``input_ids``, ``positions``, ``out_cache_loc``, ``req_pool_indices``, ``seq_lens``) and each
  step copies its values *into* them. The attention backend does the same for its metadata through three hooks:
  ``init_graph_buffers`` (allocate), ``prepare_capture`` (point the metadata at the buffers before capture) and
  ``prepare_replay`` (refill them in place before replay).
* **Fixed shapes.** A graph is captured for one batch size. We capture a ladder of sizes (1, 2, 4, 8, 16, 24,
  32, ... up to ``max_bs``, SGLang's list) and run a batch of ``n`` requests in the smallest captured size
  ``>= n``. **Padding is data**: the missing rows are dummy requests appended to the batch itself, so the
  backend sees an ordinary decode batch and needs no special case. A dummy request must be harmless: its token
  0 at position 0 writes its K/V to slot 0 (page 0 is reserved by the allocator for exactly this), it reads
  page-table row 0 with a length of 1 (a valid slot), and its logits row is dropped.
* **No host work inside.** Anything that reads a device value on the host, allocates, or branches on data
  would be frozen at capture time. The eager decode path was written with that rule already.
* **One memory pool.** The graphs share one private memory pool, captured largest first, so the activations
  of all batch sizes reuse the largest one's memory.

The output (float32 logits ``[bs, V]``) is a static buffer too: the sampler reads it right after the replay,
before the next replay can overwrite it (both run in stream order).
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

import torch

from minisgl_ref.core.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from torch import nn

    from minisgl_ref.attention.base import AttentionBackend

logger = logging.getLogger(__name__)


# BEGIN TASK 8.1: which batch sizes to capture, and the padded size of a batch
def capture_batch_sizes(max_bs: int) -> list[int]:
    """SGLang's ladder: 1, 2, 4, 8, then every multiple of 8 up to ``max_bs`` (and ``max_bs`` itself).

    Small sizes are dense because decode at small batch is where graphs matter most and padding 3 requests up
    to 8 would waste most of the step; at large sizes a step is weight- and KV-bound anyway and 7 padding rows
    out of 200 cost little."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1, got {max_bs}")
    sizes = [bs for bs in (1, 2, 4) if bs < max_bs] + list(range(8, max_bs + 1, 8))
    if not sizes or sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sorted(set(sizes))


def padded_batch_size(sizes: list[int], bs: int) -> int | None:
    """The smallest captured size that holds ``bs`` requests, or ``None`` if ``bs`` is too large."""
    i = bisect.bisect_left(sizes, bs)
    return sizes[i] if i < len(sizes) else None
# END TASK 8.1


#: The values of a dummy (padding) request in each static input: token 0 at position 0, writing the reserved slot
#: 0, reading page-table row 0 with a length of 1.
DUMMY_ROW = {"input_ids": 0, "positions": 0, "out_cache_loc": 0, "req_pool_indices": 0, "seq_lens": 1}


class CudaGraphRunner:
    """Captures decode steps of ``model`` (run with attention ``backend``) at padded batch sizes and replays them.

    ``can_run(fb)`` says whether a forward batch is a decode step small enough for a captured graph;
    ``replay(fb)`` copies the batch, padded with dummy requests, into the static buffers, refills the backend's
    metadata, replays the graph and returns the real rows' logits ``[fb.batch_size, V]`` (a view into the static
    output).
    """

    def __init__(self, model: nn.Module, backend: AttentionBackend, device: torch.device, max_bs: int) -> None:
        self.model = model
        self.backend = backend
        self.device = device
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        # The static inputs, at rest all dummy rows; replay overwrites the first rows with the real batch.
        self.static = {name: torch.full((self.max_bs,), value, dtype=torch.int64, device=device)
                       for name, value in DUMMY_ROW.items()}  # fmt: skip
        self.static["seq_lens"] = self.static["seq_lens"].int()  # the backends' kernels read int32 lengths
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.backend.init_graph_buffers(self.max_bs)
        start = time.perf_counter()
        self.capture()
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d CUDA graphs (batch sizes %d..%d) in %.1f s", len(self.batch_sizes),
                    self.batch_sizes[0], self.max_bs, self.capture_seconds)

    def _static_batch(self, prefix_lens: list[int]) -> ForwardBatch:
        """A decode ForwardBatch of ``len(prefix_lens)`` requests whose tensors are views of the static buffers
        (what the graph reads)."""
        views = {name: buf[: len(prefix_lens)] for name, buf in self.static.items()}
        return ForwardBatch(mode=ForwardMode.DECODE, extend_lens_cpu=[1] * len(prefix_lens),
                            prefix_lens_cpu=prefix_lens, attn_backend=self.backend, **views)  # fmt: skip

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per batch size, largest first, all in one shared memory pool."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        self.pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.batch_sizes):
            fb = self._static_batch([0] * bs)  # dummy requests only
            self.backend.prepare_capture(fb)
            with torch.cuda.stream(stream):
                # Warm-up runs outside the graph: lazy initialisation (cuBLAS handles, Triton autotuning and
                # compilation) must not happen during capture.
                for _ in range(2):
                    self._forward(fb)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                out = self._forward(fb)
            self.graphs[bs] = graph
            self.outputs[bs] = out
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        hidden = self.model(fb.input_ids, fb.positions, fb)
        return self.model.compute_logits(hidden)

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.mode.is_decode and fb.batch_size <= self.max_bs

    # BEGIN TASK 8.2: replay a captured decode step
    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Run decode batch ``fb`` through the graph of the smallest captured size that holds it."""
        raw_bs = fb.batch_size
        bs = padded_batch_size(self.batch_sizes, raw_bs)
        assert bs is not None
        # The padded batch: the real requests, then dummy ones (prefix 0 + 1 new token = length 1).
        padded = self._static_batch(fb.prefix_lens_cpu + [0] * (bs - raw_bs))
        for name, value in DUMMY_ROW.items():
            static = getattr(padded, name)
            static[:raw_bs].copy_(getattr(fb, name))
            if bs > raw_bs:  # a bigger earlier batch may have left real slots in the dummy rows
                static[raw_bs:].fill_(value)
        self.backend.prepare_replay(padded)
        self.graphs[bs].replay()
        return self.outputs[bs][:raw_bs]
    # END TASK 8.2
