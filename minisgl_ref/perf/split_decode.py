"""Decode attention for large batches: our own split-KV CUDA kernel (chapter 11).

FlashInfer's decode kernel gives each (request, KV head) one thread block, all of them in about one wave of the
GPU, so a step lasts as long as the SMs holding the longest contexts: with the canonical workload's contexts of
~100 to ~1,000 tokens it reads the KV cache ~10% slower than on equal lengths. Its persistent ``BatchAttention``
balances the work but loses most of that gain between a layer's matrix multiplies. The kernel of
``cuda/split_decode.cu`` balances the other way round:

* **Small blocks, several waves.** One block of 128 threads per (piece, KV head), and a block keeps enough
  registers that only a few fit on an SM at once, so there are several waves of them: the GPU starts the next
  block on whichever SM frees up first, and the pieces are laid out longest first, so the last wave is made of
  the shortest.
* **A fixed number of blocks.** A captured CUDA graph keeps the grid it was captured with, so every batch of
  ``B`` requests has room for :func:`piece_count` ``(B)`` pieces, an eighth more than requests: one per context,
  then the longest piece cut in two while it is more than :data:`SPLIT_ABOVE` times the mean context and room is
  left (:func:`plan_pieces`). That keeps one very long context from holding up the step; blocks without a piece
  return at once. Contexts of similar lengths are not cut at all: the grid is several waves long, so the GPU
  balances whole contexts by itself, and a cut only adds a merge.
* **The merge inside the kernel.** The pieces of one context write partial results (output and log-sum-exp); the
  last of them to finish, found with one atomic counter per (request, KV head), merges them and resets the
  counter. No second kernel and no grid-wide barrier.

The plan is a few kilobytes (four numbers a piece), built on the host from the lengths the scheduler already has,
and uploaded with one asynchronous copy from pinned memory. The kernel is compiled at engine start with PyTorch's
extension builder (nvcc and ninja), once per machine: the build is cached on disk.

The core does not import this module. :mod:`minisgl_ref.perf.attention` hands a :class:`SplitDecode` to the
engine's attention backend through the backend's ``use_decode_kernel`` hook (the FlashInfer backend takes it for
decode batches of ``--split-decode-min-batch`` rows and more), and adds its build to the start-up compiles.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import heapq
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from minisgl_ref import env

#: Rows per half-warp in each register buffer, and threads per block: the variant the engine runs.
UNROLL, THREADS = 4, 128
#: From this many requests (and for one or two query heads per KV head), the kernel is the build that fits four
#: blocks on an SM instead of three (at most 128 registers a thread): more reads in flight pay when every SM has
#: several waves of blocks; with fewer requests the coarser waves cost more than they gain.
FOUR_BLOCKS_FROM = 224
#: A piece is cut in two only while it is longer than this many times the mean context of the batch.
SPLIT_ABOVE = 2.0
#: Query heads per KV head that the kernel is compiled for.
GROUPS = (1, 2, 4)
SOURCES = [Path(__file__).with_name("cuda") / name for name in ("split_decode.cu", "split_decode.cpp")]


def supports(num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel handles this attention shape (the backend falls back to FlashInfer's otherwise)."""
    return (head_dim == 128 and dtype == torch.bfloat16 and num_q_heads % num_kv_heads == 0
            and num_q_heads // num_kv_heads in GROUPS)  # fmt: skip


#: How long a start-up waits for another process that is building the same kernel before it gives up (the
#: backend then keeps FlashInfer's kernels). A build takes ~35 s on an H100 host.
BUILD_WAIT_S = 600.0


@functools.cache
def load_kernel() -> Any:
    """Build (or load from disk) the kernel module: the variants the engine launches (four rows per half-warp,
    128 threads, one or four blocks an SM).

    PyTorch's extension builder guards a build folder with a lock *file*, which a process killed in the middle of
    a build leaves behind, and every later start then waits for it forever. So each build folder here belongs to
    one source folder and set of flags (two checkouts do not rebuild each other's kernel), and the build runs
    under an ``flock`` of our own, which the operating system releases when its holder dies: whoever holds it
    knows that a lock file still there is stale, and removes it."""
    from torch.utils.cpp_extension import get_default_build_root, load

    name = "minisgl_split_decode"
    cuda_flags = ["-O3", "--use_fast_math"]
    key = "\n".join([*map(str, SOURCES), *cuda_flags, torch.__version__, str(torch.version.cuda)])
    root = Path(env.torch_extensions_dir() or get_default_build_root()) / "minisgl"
    folder = root / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    folder.mkdir(parents=True, exist_ok=True)
    with exclusive(folder.with_suffix(".flock"), BUILD_WAIT_S):
        (folder / "lock").unlink(missing_ok=True)  # a live builder would hold the flock: this one is stale
        return load(name=name, sources=[str(s) for s in SOURCES], extra_cuda_cflags=cuda_flags, extra_cflags=["-O2"],
                    build_directory=str(folder), verbose=False)  # fmt: skip


@contextlib.contextmanager
def exclusive(path: Path, timeout_s: float) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if need be); raise ``TimeoutError`` after ``timeout_s``."""
    with open(path, "a") as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has been building {path.stem} for over {timeout_s:.0f} s")
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def piece_count(batch_size: int) -> int:
    """Pieces per decode step of ``batch_size`` requests: one each and an eighth more for the longest contexts."""
    return batch_size + batch_size // 8


def plan_pieces(lens: Sequence[int], count: int,
                split_above: float | None = SPLIT_ABOVE) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """Cut contexts of ``lens`` tokens (their slots laid out request after request) into at most ``count`` pieces:
    one per context, then the longest piece in halves while it is longer than ``split_above`` times the mean
    context (``None``: until there are ``count`` pieces).

    Returns ``items`` ``[count, 4]`` (request, first slot index, end slot index, partial-result row) with the
    longest pieces first; ``parts``, each request's number of pieces; and ``first_row``, each request's first
    partial-result row (a request's rows are consecutive: the merge reads them in one range). The items after the
    last piece are empty and their blocks return at once."""
    if count < len(lens):
        raise ValueError(f"count must be at least the number of requests ({len(lens)}), got {count}")
    heap = [(-n, r, 0, n) for r, n in enumerate(lens)]  # (minus length, request, start, end) within the context
    heapq.heapify(heap)
    longest_kept = 1 if split_above is None or not lens else max(1.0, split_above * sum(lens) / len(lens))
    while len(heap) < count and -heap[0][0] > longest_kept:
        _, r, a, b = heapq.heappop(heap)
        mid = (a + b) // 2
        heapq.heappush(heap, (a - mid, r, a, mid))
        heapq.heappush(heap, (mid - b, r, mid, b))
    pieces = np.array(sorted((r, a, b) for _, r, a, b in heap), dtype=np.int64).reshape(-1, 3)
    starts = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=starts[1:])
    parts = np.bincount(pieces[:, 0], minlength=len(lens))
    first_row = np.zeros(len(lens), dtype=np.int64)
    np.cumsum(parts[:-1], out=first_row[1:])
    items = np.zeros((count, 4), dtype=np.int32)
    order = np.argsort(pieces[:, 1] - pieces[:, 2], kind="stable")  # longest first
    offset = starts[pieces[order, 0]]
    items[: len(pieces)] = np.stack([pieces[order, 0], offset + pieces[order, 1], offset + pieces[order, 2], order], 1)
    return items, parts.astype(np.int32), first_row.astype(np.int32)


class SplitDecode:
    """The kernel's buffers for batches of up to ``max_batch`` requests (the request pool's size, so that they
    never move: a captured graph reads them). :meth:`plan` once per step, :meth:`run` once per layer."""

    def __init__(self, *, num_q_heads: int, num_kv_heads: int, head_dim: int, sm_scale: float, max_batch: int,
                 device: torch.device) -> None:  # fmt: skip
        self.kernel = load_kernel()
        self.group = num_q_heads // num_kv_heads
        self.min_blocks = 1
        self.num_q_heads, self.head_dim, self.sm_scale = num_q_heads, head_dim, sm_scale
        self.max_batch = max_batch
        most = piece_count(max_batch)
        # One buffer for the whole plan (items, parts, first rows): one upload a step.
        self.plan_buffer = torch.zeros(most * 4 + 2 * max_batch, dtype=torch.int32, device=device)
        self.items = self.plan_buffer[: most * 4].view(most, 4)
        self.parts = self.plan_buffer[most * 4 : most * 4 + max_batch]
        self.first_row = self.plan_buffer[most * 4 + max_batch :]
        self.part_o = torch.empty(most, num_q_heads, head_dim, dtype=torch.float32, device=device)
        self.part_lse = torch.empty(most, num_q_heads, dtype=torch.float32, device=device)
        self.counters = torch.zeros(max_batch, num_kv_heads, dtype=torch.int32, device=device)  # the kernel resets
        # Two pinned host copies of the plan, used in turn: while one is being uploaded (the copy runs when the
        # stream reaches it, after the step in flight), the host fills the other. Allocating pinned memory every
        # step instead can stall the host for a driver call.
        pin = torch.device(device).type == "cuda"
        self.host = [torch.zeros(self.plan_buffer.numel(), dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self.uploaded = [torch.cuda.Event() if pin else None for _ in range(2)]  # that copy has read it
        self.turn = 0
        self.count = 0
        self.kv_indices: torch.Tensor | None = None

    def plan(self, lens: Sequence[int], kv_indices: torch.Tensor) -> None:
        """Cut this step's contexts into pieces and upload the plan (queued on the current stream, from pinned
        memory: the host does not wait). ``kv_indices`` (device) holds their slots end to end and must stay the
        same tensor while a graph that read it is replayed."""
        bs = len(lens)
        if bs > self.max_batch:
            raise ValueError(f"a decode batch of {bs} requests is larger than the request pool ({self.max_batch})")
        self.count = piece_count(bs)
        self.min_blocks = 4 if bs >= FOUR_BLOCKS_FROM and self.group <= 2 else 1
        items, parts, first_row = plan_pieces(lens, self.count)
        turn, self.turn = self.turn, 1 - self.turn
        done = self.uploaded[turn]
        if done is not None:
            done.synchronize()  # its upload two steps ago (long finished in practice)
        host = self.host[turn].numpy()
        most = self.items.numel()
        host[: items.size] = items.ravel()
        host[most : most + bs] = parts
        host[most + self.max_batch : most + self.max_batch + bs] = first_row
        self.plan_buffer.copy_(self.host[turn], non_blocking=True)
        if done is not None:
            done.record()
        self.kv_indices = kv_indices

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One layer's decode attention ``[B, H, D]`` over its cache ``k``, ``v`` (``[slots, KV heads, D]``);
        ``q`` may be a strided view (only the head dimension must be contiguous)."""
        assert self.kv_indices is not None, "plan before run"
        out = torch.empty(q.shape[0], self.num_q_heads, self.head_dim, dtype=q.dtype, device=q.device)
        self.kernel.split_decode(q, k, v, self.kv_indices, self.items[: self.count], self.parts, self.first_row,
                                 self.part_o, self.part_lse, self.counters, out, self.sm_scale, UNROLL, THREADS,
                                 self.min_blocks)  # fmt: skip
        return out
