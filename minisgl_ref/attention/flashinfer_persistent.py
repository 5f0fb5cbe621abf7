"""Decode attention with a balanced split of the KV cache: FlashInfer's persistent ``BatchAttention`` (chapter 11).

FlashInfer's decode kernel gives each (request, KV head) pair one thread block. With 256 requests whose contexts
run from ~100 to ~1,000 tokens, the blocks are of very unequal length, and the kernel ends when the longest ones
do: in the first few hundred steps of the canonical workload it reads the KV cache ~9% slower than it does when
every context has the same length. ``BatchAttention`` cuts the work the other way round: it launches a fixed set of
blocks (two per SM), and its planner, on the host, deals out pieces of the contexts to them so that every block
gets about the same number of KV tokens; a request whose context is cut in several pieces gets its partial results
merged at the end. It reads the KV cache at the same speed whatever the spread of the lengths, but it has a
fixed cost (the merge, the larger plan) that makes it slower than the plain kernel on small batches. The backend
therefore uses it from a batch size up (``--persistent-decode-min-batch``).

Three things make it fit a CUDA graph and overlap scheduling:

* Its plan writes the pieces into fixed places of its workspace: the sizes of those places are fixed maxima, so
  the plan's offsets -- which a captured graph has baked into its kernel arguments -- are the same for every
  batch. :meth:`PersistentDecode.plan` checks that on every call rather than trusting it.
* The wrapper's ``plan`` synchronises the whole device (it first copies its inputs to the host). We hand the
  planner host tensors directly, so only the first plan (at start-up, before anything runs) pays that.
* Those fixed maxima make the plan several megabytes, which the planner uploads with one host-to-device copy.
  Queued on the engine's stream, that copy would wait for the step in flight and then hold the next step back
  for ~0.12 ms. So the planner uploads into a staging buffer on a side stream, while the step in flight runs,
  and the engine's stream only copies staging to workspace on the device (a few microseconds) before the graph.
"""

from __future__ import annotations

from typing import Any

import torch


def partial_bytes(num_kv_heads: int, head_dim: int, num_sms: int) -> int:
    """The float workspace FlashInfer's persistent planner reserves, whatever the batch: room for the partial
    outputs (16-bit) and log-sum-exps (float32) of its most pieces, 4 x (2 blocks per SM) x (its two query tiles,
    128 + 16 rows), for every KV head. Its wrapper allocates a fixed 384 MiB, too little from 16 KV heads of 128."""
    max_pieces = 4 * 2 * num_sms * (128 + 16)
    return max_pieces * num_kv_heads * (2 * head_dim + 4) + 1024  # + the two allocations' alignment


class PersistentDecode:
    """One ``flashinfer.BatchAttention`` shared by every decode batch of an engine (its 384 MiB workspace is
    allocated once). ``plan`` before each step, ``run`` once per layer."""

    def __init__(self, flashinfer: Any, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, sm_scale: float, device: torch.device) -> None:  # fmt: skip
        self.wrapper = flashinfer.BatchAttention("NHD", device=str(device))
        need = partial_bytes(num_kv_heads, head_dim, torch.cuda.get_device_properties(device).multi_processor_count)
        if need > self.wrapper.float_workspace_buffer.numel():  # e.g. 16 KV heads of 128: ~620 MB
            self.wrapper.float_workspace_buffer = torch.empty(need, dtype=torch.uint8, device=device)
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.dtype, self.sm_scale = dtype, sm_scale
        self.plan_info: list[int] | None = None
        # The upload path (module docstring): staging buffer, side stream, and the two events that order them.
        self.staging = torch.empty_like(self.wrapper.int_workspace_buffer)
        self.side = torch.cuda.Stream(device)
        self.uploaded = torch.cuda.Event()  # the side stream has filled ``staging``
        self.consumed = torch.cuda.Event()  # the engine's stream has copied ``staging`` into the workspace

    def plan(self, kv_indptr_cpu: torch.Tensor, kv_indices: torch.Tensor, seq_lens_cpu: list[int]) -> None:
        """Deal the batch's KV tokens out to the kernel's blocks. ``kv_indptr_cpu`` (host, int32) and
        ``seq_lens_cpu`` describe the contexts; ``kv_indices`` (device) holds their slots end to end and must stay
        the same tensor while a graph that read it is replayed."""
        bs = len(seq_lens_cpu)
        qo_indptr = torch.arange(bs + 1, dtype=torch.int32)  # one query token per request
        kv_lens = torch.tensor(seq_lens_cpu, dtype=torch.int32)
        H, KVH, D = self.num_q_heads, self.num_kv_heads, self.head_dim  # noqa: N806
        w = self.wrapper
        if self.plan_info is None:  # loads (or builds) the kernel module; synchronises the device once
            w.plan(qo_indptr, kv_indptr_cpu, kv_indices, kv_lens, H, KVH, D, D, 1, causal=False,
                   sm_scale=self.sm_scale, q_data_type=self.dtype, kv_data_type=self.dtype)  # fmt: skip
            self.plan_info = list(w._plan_info)
            return
        # The planner fills its pinned host buffer, then queues the upload on the current stream: the side one.
        # Before it writes that buffer again, the previous upload must have read it (long done in practice).
        self.uploaded.synchronize()
        main = torch.cuda.current_stream()
        self.side.wait_event(self.consumed)  # the previous plan is out of ``staging``
        with torch.cuda.stream(self.side):
            info = list(w.module.plan(w.float_workspace_buffer, self.staging, w.page_locked_int_workspace_buffer,
                                      qo_indptr, kv_indptr_cpu, kv_lens, bs, H, KVH, D, False))  # fmt: skip
            self.uploaded.record(self.side)
        main.wait_event(self.uploaded)
        w.int_workspace_buffer.copy_(self.staging)
        self.consumed.record(main)
        if info != self.plan_info:
            raise RuntimeError("FlashInfer's persistent attention moved its workspace layout between two plans; "
                               "captured CUDA graphs would read stale offsets")  # fmt: skip
        w._kv_indices = kv_indices

    def run(self, q: torch.Tensor, paged_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """One layer's decode attention, ``[B, H, D]`` (``q`` may be a strided view; the output is dense)."""
        out = torch.empty(q.shape[0], self.num_q_heads, self.head_dim, dtype=q.dtype, device=q.device)
        self.wrapper.run(q, paged_cache, out=out)
        return out
