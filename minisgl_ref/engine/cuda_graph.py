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

The output (the logits ``[bs, V]``, in the model's dtype) is a static buffer too: the sampler reads it right after the replay,
before the next replay can overwrite it (both run in stream order).

The graphs themselves come from a *graph factory*: :class:`CudaGraphFactory` records real CUDA graphs (the
engine's), :class:`RerunGraphFactory` makes stand-ins that run the recorded forward again on replay, against the
same static buffers. With the stand-ins the runner's own logic (which sizes, which buffers, what a replay must
copy and pad) runs on a CPU, where a replay that forgets to copy an input or pads wrongly gives wrong logits.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from minisgl_ref.core.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from torch import nn

    from minisgl_ref.attention.base import AttentionBackend

logger = logging.getLogger(__name__)


def capture_batch_sizes(max_bs: int) -> list[int]:
    """SGLang's ladder, ascending and without duplicates: 1, 2, 4, 8, then every multiple of 8 up to ``max_bs``,
    and ``max_bs`` itself (always the last: a batch of ``max_bs`` requests must find a graph). Nothing above
    ``max_bs``: ``capture_batch_sizes(6) == [1, 2, 4, 6]``, ``capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]``.

    Small sizes are dense because decode at small batch is where graphs matter most and padding 3 requests up
    to 8 would waste most of the step; at large sizes a step is weight- and KV-bound anyway and 7 padding rows
    out of 200 cost little."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1, got {max_bs}")
    # BEGIN TASK 8.1: capture the decode step (the size ladder, then one graph per size)
    sizes = [bs for bs in (1, 2, 4) if bs < max_bs] + list(range(8, max_bs + 1, 8))
    if not sizes or sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sorted(set(sizes))
    # END TASK 8.1


def padded_batch_size(sizes: list[int], bs: int) -> int | None:
    """The smallest captured size that holds ``bs`` requests, or ``None`` if ``bs`` is too large."""
    i = bisect.bisect_left(sizes, bs)
    return sizes[i] if i < len(sizes) else None


#: The values of a dummy (padding) request in each static input: token 0 at position 0, writing the reserved slot
#: 0, reading page-table row 0 with a length of 1.
DUMMY_ROW = {"input_ids": 0, "positions": 0, "out_cache_loc": 0, "req_pool_indices": 0, "seq_lens": 1}

Forward = Callable[[ForwardBatch], torch.Tensor]


class CudaGraphFactory:
    """Real CUDA graphs: warm-up runs and captures on one side stream, every graph in one shared memory pool.

    Capturing on a side stream keeps the capture away from whatever else runs on the current stream; sharing
    one pool, and capturing the largest batch first, lets every smaller graph reuse the largest one's
    activation memory instead of holding its own."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.stream.wait_stream(torch.cuda.current_stream(device))
        self.pool = torch.cuda.graph_pool_handle()
        self.seconds = {"warm-up runs": 0.0, "captures": 0.0}  # where a start-up's capture time went

    def warm_up(self, forward: Forward, batch: ForwardBatch) -> None:
        """Run ``forward(batch)`` once outside any graph and wait for it: lazy initialisation (cuBLAS handles,
        Triton compilation and autotuning) must not happen while a graph is being recorded."""
        start = time.perf_counter()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the static buffers' latest refill
        with torch.cuda.stream(self.stream):
            forward(batch)
        self.stream.synchronize()
        self.seconds["warm-up runs"] += time.perf_counter() - start

    def capture(self, forward: Forward, batch: ForwardBatch) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Record ``forward(batch)``: returns the graph and its output, a tensor that every replay rewrites."""
        start = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = forward(batch)
        self.seconds["captures"] += time.perf_counter() - start
        return graph, out

    def finish(self) -> None:
        """After the last capture: the current stream waits for the side stream's work."""
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        torch.cuda.synchronize(self.device)


class RerunGraph:
    """A stand-in for a captured graph: :meth:`replay` runs the captured forward again on the *same* batch (views
    of the static buffers) and copies the result into the captured output, the tensor a real replay rewrites."""

    def __init__(self, forward: Forward, batch: ForwardBatch, output: torch.Tensor) -> None:
        self.forward, self.batch, self.output = forward, batch, output
        self.replays = 0

    @torch.inference_mode()
    def replay(self) -> None:
        self.output.copy_(self.forward(self.batch))
        self.replays += 1


class RerunGraphFactory:
    """Stand-in graphs, for the graph runner without a GPU (tests, chapter 08).

    What a replay depends on holds as with real graphs: the captured batch's tensors are the static buffers, so
    a replay sees exactly what was copied into them, its host-side values stay those of capture time, and it
    writes into the output tensor returned at capture. What a real graph would also forbid (allocating, reading
    device values on the host) goes unnoticed. ``log`` records ``("warm_up" | "capture", batch size)`` per call, in
    order."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []

    def warm_up(self, forward: Forward, batch: ForwardBatch) -> None:
        self.log.append(("warm_up", batch.batch_size))
        forward(batch)

    def capture(self, forward: Forward, batch: ForwardBatch) -> tuple[RerunGraph, torch.Tensor]:
        self.log.append(("capture", batch.batch_size))
        out = forward(batch)
        return RerunGraph(forward, batch, out), out

    def finish(self) -> None:
        pass


class CudaGraphRunner:
    """Captures decode steps of ``model`` (run with attention ``backend``) at padded batch sizes and replays them.

    ``can_run(fb)`` says whether a forward batch is a decode step on ``backend`` small enough for a captured graph;
    ``replay(fb)`` copies the batch, padded with dummy requests, into the static buffers, refills the backend's
    metadata, replays the graph and returns the real rows' logits ``[fb.batch_size, V]`` (a view into the static
    output). ``graph_factory`` makes the graphs: real CUDA graphs by default, :class:`RerunGraphFactory` to run
    the same code on a CPU.
    """

    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        device: torch.device,
        max_bs: int,
        *,
        graph_factory: CudaGraphFactory | RerunGraphFactory | None = None,
    ) -> None:
        self.model = model
        self.backend = backend
        self.device = device
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        # The static inputs, at rest all dummy rows; replay overwrites the first rows with the real batch.
        self.static = {name: torch.full((self.max_bs,), value, dtype=torch.int64, device=device)
                       for name, value in DUMMY_ROW.items()}  # fmt: skip
        self.static["seq_lens"] = self.static["seq_lens"].int()  # the backends' kernels read int32 lengths
        self.graphs: dict[int, Any] = {}  # batch size -> graph (anything with .replay())
        self.outputs: dict[int, torch.Tensor] = {}  # batch size -> the logits [bs, V] its replays rewrite
        self.backend.init_graph_buffers(self.max_bs)
        # Made after the static buffers so that the real factory's side stream starts behind their allocation.
        self.graph_factory = graph_factory if graph_factory is not None else CudaGraphFactory(device)
        start = time.perf_counter()
        self.capture()
        self.graph_factory.finish()
        self.capture_seconds = time.perf_counter() - start
        split = getattr(self.graph_factory, "seconds", {})
        logger.info("captured %d CUDA graphs (batch sizes %d..%d) for %s in %.1f s%s", len(self.batch_sizes),
                    self.batch_sizes[0], self.max_bs, type(backend).__name__, self.capture_seconds,
                    "".join(f", {k} {v:.1f} s" for k, v in split.items()))

    def _static_batch(self, prefix_lens: list[int]) -> ForwardBatch:
        """A decode ForwardBatch of ``len(prefix_lens)`` requests whose tensors are views of the static buffers
        (what the graph reads)."""
        views = {name: buf[: len(prefix_lens)] for name, buf in self.static.items()}
        return ForwardBatch(mode=ForwardMode.DECODE, extend_lens_cpu=[1] * len(prefix_lens),
                            prefix_lens_cpu=prefix_lens, attn_backend=self.backend, **views)  # fmt: skip

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per size of ``self.batch_sizes``, **largest first** (the graphs share one memory
        pool: the largest one's activations size it, and the smaller ones reuse that memory).

        For each size ``bs``:

        1. ``fb = self._static_batch([0] * bs)``: a decode batch of ``bs`` dummy requests whose tensors are
           *views of the static buffers* (which hold dummy rows at rest). A graph reads the addresses it recorded,
           so it must be recorded on these views: replay copies each step's inputs into them.
        2. ``self.backend.prepare_capture(fb)``: the backend points its metadata at its own static buffers.
        3. Warm up twice, outside the graph: ``self.graph_factory.warm_up(self._forward, fb)``. Lazy
           initialisation (library handles, kernel compilation) must not happen during capture.
        4. ``graph, out = self.graph_factory.capture(self._forward, fb)``; keep ``self.graphs[bs] = graph`` and
           ``self.outputs[bs] = out`` (the logits ``[bs, V]`` that every replay of this graph rewrites in place).
        """
        # BEGIN TASK 8.1: capture the decode step (the size ladder, then one graph per size)
        for bs in reversed(self.batch_sizes):
            fb = self._static_batch([0] * bs)  # dummy requests only
            self.backend.prepare_capture(fb)
            for _ in range(2):
                self.graph_factory.warm_up(self._forward, fb)
            self.graphs[bs], self.outputs[bs] = self.graph_factory.capture(self._forward, fb)
        # END TASK 8.1

    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        hidden = self.model(fb.input_ids, fb.positions, fb)
        return self.model.compute_logits(hidden)

    def can_run(self, fb: ForwardBatch) -> bool:
        """A decode step of at most ``max_bs`` rows whose attention runs on the backend these graphs were captured
        with (an engine may capture one set per decode backend: :mod:`~minisgl_ref.engine.attention_planner`)."""
        return fb.mode.is_decode and fb.batch_size <= self.max_bs and fb.attn_backend is self.backend

    def can_run_all_positions(self, fb: ForwardBatch) -> bool:
        """Never: a decode step has one token per row, whose logits :meth:`replay` returns already."""
        return False

    def hidden_states(self, fb: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError("decode graphs keep no hidden states")

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Run decode batch ``fb`` through the graph of the smallest captured size that holds it, and return the
        real rows' logits ``[fb.batch_size, V]`` (a view of the captured output, valid until the next replay).

        1. ``bs = padded_batch_size(self.batch_sizes, fb.batch_size)``: the graph to use.
        2. ``padded = self._static_batch(fb.prefix_lens_cpu + [0] * (bs - fb.batch_size))``: the padded batch,
           views of the static buffers (the dummy rows: prefix 0 plus one new token, a length of 1).
        3. For every field ``name`` of ``DUMMY_ROW``: copy ``fb``'s values into the first rows of
           ``getattr(padded, name)``, and fill the remaining rows with the dummy value. Refill them on every
           replay: a larger earlier batch left its real requests' slots and rows there, and a stale padding row
           would write its K/V into a slot that now belongs to someone else.
        4. ``self.backend.prepare_replay(padded)`` (the backend refills its metadata), then replay the graph.
        5. Return the first ``fb.batch_size`` rows of ``self.outputs[bs]``: the padding rows' logits are dropped.
        """
        # BEGIN TASK 8.2: replay a captured decode step
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
