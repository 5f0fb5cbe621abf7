"""The ``flashinfer`` attention backend: FlashInfer's paged prefill and decode kernels (chapter 07).

FlashInfer splits every attention call into two halves, and this backend maps them onto our interface:

- ``wrapper.plan(...)`` looks at the batch's *shape* (how many requests, how long each context is, how many new
  tokens each has) and decides how to cut the work over the GPU's SMs: which requests get their KV split into
  pieces, how big the tiles are, where partial results go in the workspace buffer. That decision is the same
  for every layer, so it runs once per step, in :meth:`FlashInferBackend.init_forward_metadata`.
- ``wrapper.run(q, (k_cache, v_cache))`` executes the plan for one layer's tensors: once per layer, in
  ``attend_extend`` / ``attend_decode``.

How our pool is shown to FlashInfer. FlashInfer reads a paged cache in CSR form: ``kv_indptr`` [B + 1],
``kv_indices`` (page ids) and ``kv_last_page_len`` [B]. Our page table is token-granular (entry ``[r, i]`` is the
*slot* of token ``i``), and a slot is ``page * page_size + offset``, so the simplest exact view is "pages of one
token": the pool ``[num_slots, kv_heads, head_dim]`` becomes ``[num_slots, 1, kv_heads, head_dim]`` (a free
``unsqueeze``), ``kv_indices`` are the slots themselves (built by the same small Triton kernel the ``triton``
backend uses) and every last page holds exactly 1 token. That is also what SGLang does with page size 1; the
cost is a 4-byte index per token instead of per page, small next to the 2 x kv_heads x head_dim x 2 bytes of KV
each token carries.

Extend (prefill, with or without a cached prefix, chunks of a chunked prefill) is done the simplest correct way:
the new tokens' K/V are already in the pool (the base class stores them first), so FlashInfer's paged prefill
runs over each request's whole context with a causal mask. FlashInfer aligns the causal mask to the bottom right (query ``i`` of ``n`` new tokens
sits at position ``ctx - n + i``), which is exactly "the prefix is fully visible, the new tokens causally".

Host syncs. ``plan`` needs the lengths on the host: we hand it CPU tensors built from the scheduler's Python
lists (``kv_indptr``, ``qo_indptr``, ``last_page_len``), so nothing is copied back from the GPU. ``kv_indices``
stays on the GPU. FlashInfer's planner still copies its small plan (a few KB) from pinned host memory into its
int workspace and, in the versions we use, waits for that copy: a short host sync per step, not per layer.

Large decode batches: a decode kernel handed in from outside (:meth:`FlashInferBackend.use_decode_kernel`, the
hook of :class:`~minisgl_ref.attention.base.AttentionBackend`) runs every decode batch of at least a given number
of rows instead of the decode wrapper. Chapter 11's split-KV CUDA kernel (:mod:`minisgl_ref.perf.split_decode`,
from ``--split-decode-min-batch`` rows, 48 by default) is installed that way: it keeps every SM busy when the
contexts' lengths differ. The kernel reads the same ``kv_indices`` this backend builds for FlashInfer.

CUDA graphs: decode only. For each captured batch size a separate wrapper is created with ``use_cuda_graph=True``
and fixed ``kv_indptr`` / ``kv_indices`` / ``last_page_len`` buffers (FlashInfer's requirement: a graph wrapper's
batch size never changes and its kernels read those buffers); replay re-plans into the same buffers. Planning is
host work, so replay reads the batch's lengths on the host (``seq_lens_cpu``, the scheduler's numbers: no sync).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from minisgl_ref.attention.base import AttentionBackend, DecodeKernel
from minisgl_ref.attention.utils import indptr

if TYPE_CHECKING:
    from minisgl_ref.core.forward_batch import ForwardBatch
    from minisgl_ref.kvcache.pool import KVPool
    from minisgl_ref.kvcache.req_to_token import ReqToTokenPool
    from minisgl_ref.layers.attention import AttentionLayer

log = logging.getLogger(__name__)

#: FlashInfer's recommended float workspace (split-KV partial outputs live there).
WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferBackend(AttentionBackend):
    """Paged attention through flashinfer-python's ``BatchPrefillWithPagedKVCacheWrapper`` (extend) and
    ``BatchDecodeWithPagedKVCacheWrapper`` (decode). ``num_q_heads`` is the query heads per rank: the plan needs
    it before the first layer runs."""

    name = "flashinfer"
    supports_cuda_graph = True
    supports_custom_mask = True  # extend: the prefill plan's custom_mask (see init_forward_metadata)
    # An FP8 cache (chapter 15): planned with the stored dtype as kv_data_type, FlashInfer's kernels convert each
    # stored number as they load it; the layer's key scale goes into the softmax scale and its value scale onto
    # the output (run's k_scale / v_scale). Extend steps then take FlashInfer's FA2 kernels, whose queries stay
    # in bf16 while the keys are FP8 (its SM90 kernels want both in the same type).
    reads_quantized_kv = True

    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenPool, *, num_q_heads: int) -> None:
        import flashinfer  # the registry turns an ImportError into one clear line

        super().__init__(kv_pool, req_to_token)
        self.flashinfer = flashinfer
        if self.device.type != "cuda":
            raise ValueError("the flashinfer attention backend needs a CUDA device")
        self.dtype = kv_pool.dtype  # the queries' and the output's
        self.kv_dtype = kv_pool.storage_dtype  # the cache's numbers: the same, or FP8 (chapter 15)
        self.num_q_heads = num_q_heads
        self.sm_scale = self.head_dim**-0.5
        # FlashInfer recommends its tensor-core (prefill-style) decode kernel once several query heads share a
        # KV head: with GQA >= 4 the per-KV-head query block is tall enough for the MMA units to pay off.
        self.use_tensor_cores = num_q_heads // self.num_kv_heads >= 4
        # One workspace shared by both wrappers: a step is either an extend or a decode, never both at once.
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        # Masked extend steps (a draft tree, chapter 13) need FlashInfer's FA2 kernels: on Hopper its default, the
        # SM90 kernels, take no custom mask ("operation not supported"). Built on first use.
        self.masked_prefill_wrapper: Any = None
        self.active_prefill_wrapper: Any = self.prefill_wrapper
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores
        )
        self.active_decode_wrapper: Any = self.decode_wrapper
        # Decode batches of at least this many rows go to a kernel handed in from outside (0: never), built on
        # first use by split_build (see use_decode_kernel).
        self.split_min_batch = 0
        self.split_build: Callable[[], DecodeKernel] | None = None
        self.split: DecodeKernel | None = None
        self.decode_split = False  # this step's choice
        self.graph_state: dict[str, torch.Tensor] | None = None
        self.graph_wrappers: dict[int, Any] = {}

    # ------------------------------------------------------------------------------------------- metadata

    def _kv_indices(self, rows: torch.Tensor, lens_cpu: list[int], kv_indptr_cpu: torch.Tensor) -> torch.Tensor:
        """The batch's context slots laid end to end (device int32), by the Triton kv_indices kernel."""
        from minisgl_ref.attention.triton_kernels import build_kv_indices

        lens = torch.tensor(lens_cpu, dtype=torch.int32).to(self.device, non_blocking=True)
        kv_indptr = kv_indptr_cpu.to(self.device, non_blocking=True)
        kv_indices = torch.empty(max(1, int(kv_indptr_cpu[-1])), dtype=torch.int32, device=self.device)
        build_kv_indices(self.req_to_token.table, rows, lens, kv_indptr, kv_indices)
        return kv_indices

    def _plan_kwargs(self) -> dict[str, Any]:
        return dict(q_data_type=self.dtype, kv_data_type=self.kv_dtype, sm_scale=self.sm_scale)

    def _scales(self, layer_id: int) -> dict[str, float]:
        """run()'s ``k_scale`` / ``v_scale`` for a layer of an FP8 cache (none for a cache of the values)."""
        k_scale, v_scale = self.kv_pool.scales(layer_id)
        return {} if (k_scale, v_scale) == (1.0, 1.0) else {"k_scale": k_scale, "v_scale": v_scale}

    def use_decode_kernel(self, build: Callable[[], DecodeKernel], min_batch: int) -> bool:
        """Decode batches of at least ``min_batch`` rows run on ``build()``'s kernel (built on first use)."""
        self.split_build, self.split_min_batch = build, min_batch
        return True

    def _use_split(self, batch_size: int) -> bool:
        """Whether a decode batch of ``batch_size`` rows goes to the outside kernel (building it if so)."""
        if self.split_build is None or not 0 < self.split_min_batch <= batch_size:
            return False
        if self.split is None:
            try:
                self.split = self.split_build()
            except Exception as e:  # noqa: BLE001 - no nvcc or ninja here: FlashInfer's kernels do the job instead
                log.warning("split-KV decode kernel unavailable (%s: %s); large decode batches use FlashInfer's",
                            type(e).__name__, str(e).splitlines()[0] if str(e) else "")  # fmt: skip
                self.split_min_batch = 0
                return False
        return True

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        assert batch.req_pool_indices is not None
        lens = batch.seq_lens_cpu  # whole contexts, new tokens included: they are stored before attention runs
        kv_indptr = indptr(lens)  # on the host: FlashInfer's planner reads indptrs there
        kv_indices = self._kv_indices(batch.req_pool_indices, lens, kv_indptr)
        last_page_len = torch.ones(batch.batch_size, dtype=torch.int32)  # pages of one token
        H, KVH, D = self.num_q_heads, self.num_kv_heads, self.head_dim  # noqa: N806
        if batch.mode.is_decode:
            self.decode_split = self._use_split(batch.batch_size)
            if self.decode_split:
                assert self.split is not None
                self.split.plan(lens, kv_indices)
                return
            self.decode_wrapper.plan(kv_indptr, kv_indices, last_page_len, H, KVH, D, 1, **self._plan_kwargs())
            self.active_decode_wrapper = self.decode_wrapper
        else:
            qo_indptr = indptr(batch.extend_lens_cpu)
            # A masked step (ForwardBatch.extend_masks) hands FlashInfer every row's whole [new, context] mask
            # instead of causal=True (its custom mask replaces the causal one for the whole batch).
            mask = self._custom_mask(batch) if batch.has_custom_mask else None
            if mask is None:
                self.active_prefill_wrapper = self.prefill_wrapper
            else:
                if self.masked_prefill_wrapper is None:
                    self.masked_prefill_wrapper = self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                        self.workspace, "NHD", backend="fa2")
                self.active_prefill_wrapper = self.masked_prefill_wrapper
            self.active_prefill_wrapper.plan(qo_indptr, kv_indptr, kv_indices, last_page_len, H, KVH, D, 1,
                                             causal=mask is None, custom_mask=mask, **self._plan_kwargs())

    def _custom_mask(self, batch: ForwardBatch) -> torch.Tensor:
        """FlashInfer's ``custom_mask``: for each row, its ``[extend_len, prefix_len + extend_len]`` bool mask
        (query i, key j: may i see j), flattened row-major, the rows back to back, on the device. The prefix
        columns are all True; the new-token columns are the row's extend mask, or the causal triangle for a row
        without one. FlashInfer packs it to bits itself (``segment_packbits``) with offsets it derives from
        ``qo_indptr`` and ``kv_indptr``: a long causal row of a mixed step costs ``E x (P + E)`` bools here."""
        batch.check_extend_masks()
        assert batch.extend_masks is not None
        parts = []
        for m, p, e in zip(batch.extend_masks, batch.prefix_lens_cpu, batch.extend_lens_cpu):
            new = torch.ones(e, e, dtype=torch.bool).tril() if m is None else m.to("cpu", torch.bool)
            parts.append(torch.cat([torch.ones(e, p, dtype=torch.bool), new], dim=1).reshape(-1))
        return torch.cat(parts).to(self.device, non_blocking=True)

    # -------------------------------------------------------------------------------------------- forward

    def _paged_cache(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's pool as FlashInfer's NHD paged cache with pages of one token (a view, no copy)."""
        return self.kv_pool.k[layer_id].unsqueeze(1), self.kv_pool.v[layer_id].unsqueeze(1)

    def _check_layer(self, q: torch.Tensor, layer: AttentionLayer) -> None:
        if layer.scale != self.sm_scale or q.shape[1] != self.num_q_heads:
            raise ValueError(
                f"flashinfer was planned for {self.num_q_heads} heads with scale {self.sm_scale}; layer "
                f"{layer.layer_id} has {q.shape[1]} heads and scale {layer.scale}"
            )

    def attend_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        self._check_layer(q, layer)
        o = self.active_prefill_wrapper.run(q.contiguous(), self._paged_cache(layer.layer_id),
                                            **self._scales(layer.layer_id))
        return o.view(q.shape[0], -1)

    def attend_decode(self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        self._check_layer(q, layer)
        # The kernel takes q's token and head strides: the view into the fused QKV output needs no copy (a
        # kernel fewer per layer; only the head dim must be contiguous).
        q = q if q.stride(-1) == 1 else q.contiguous()
        if self.decode_split:
            assert self.split is not None
            pool = self.kv_pool
            return self.split.run(q, pool.k[layer.layer_id], pool.v[layer.layer_id]).view(q.shape[0], -1)
        o = self.active_decode_wrapper.run(q, self._paged_cache(layer.layer_id), **self._scales(layer.layer_id))
        return o.view(q.shape[0], -1)

    # ---------------------------------------------------------------------------------------- CUDA graphs

    def init_graph_buffers(self, max_bs: int) -> None:
        """Static CSR buffers for every captured batch size: ``kv_indices`` must hold ``max_bs`` whole contexts
        of the page table's width (the worst case; a graph cannot grow it later)."""
        dev = self.device
        self.graph_state = {
            "kv_indptr": torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
            "kv_indptr_dev": torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),  # for the indices kernel
            "kv_indices": torch.zeros(max_bs * self.req_to_token.max_context_len, dtype=torch.int32, device=dev),
            "last_page_len": torch.ones(max_bs, dtype=torch.int32, device=dev),
        }

    def prepare_capture(self, batch: ForwardBatch) -> None:
        """A graph wrapper per batch size, reading the static buffers (FlashInfer's rule: its size never changes)."""
        assert self.graph_state is not None, "call init_graph_buffers first"
        g, bs = self.graph_state, batch.batch_size
        if bs not in self.graph_wrappers and not self._use_split(bs):
            self.graph_wrappers[bs] = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=g["kv_indptr"][: bs + 1], paged_kv_indices_buffer=g["kv_indices"],
                paged_kv_last_page_len_buffer=g["last_page_len"][:bs],
            )  # fmt: skip
        self.prepare_replay(batch)

    def prepare_replay(self, batch: ForwardBatch) -> None:
        """Re-plan the captured wrapper for the new lengths. The indices are written straight into the static
        buffer on the GPU; the plan itself is host work and reads the host-side lengths."""
        from minisgl_ref.attention.triton_kernels import build_kv_indices

        assert self.graph_state is not None and batch.seq_lens is not None and batch.req_pool_indices is not None
        g, bs = self.graph_state, batch.batch_size
        self.decode_split = self._use_split(bs)
        dev_indptr = indptr(batch.seq_lens, out=g["kv_indptr_dev"][: bs + 1])
        build_kv_indices(self.req_to_token.table, batch.req_pool_indices, batch.seq_lens.to(torch.int32),
                         dev_indptr, g["kv_indices"])  # fmt: skip
        if self.decode_split:  # its plan is built from the lengths alone
            assert self.split is not None
            self.split.plan(batch.seq_lens_cpu, g["kv_indices"])
            return
        # Pinned host tensors: FlashInfer copies them to the GPU with non_blocking=True, and a copy from pageable
        # memory waits for the GPU to finish the step in flight, which would undo overlap scheduling (G2).
        pin = self.device.type == "cuda"
        kv_indptr_cpu = indptr(batch.seq_lens_cpu, out=torch.zeros(bs + 1, dtype=torch.int32, pin_memory=pin))
        self.active_decode_wrapper = self.graph_wrappers[bs]
        total = int(kv_indptr_cpu[-1])
        self.active_decode_wrapper.plan(
            kv_indptr_cpu, g["kv_indices"][:total], torch.ones(bs, dtype=torch.int32, pin_memory=pin), self.num_q_heads,
            self.num_kv_heads, self.head_dim, 1, **self._plan_kwargs(),
        )  # fmt: skip


def compile_kernels(phase: str, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                    device: torch.device, kv_dtype: torch.dtype | None = None) -> None:
    """Make FlashInfer build (or load from its disk cache) the ``phase`` ("decode" or "prefill") kernels for this
    attention shape, by planning and running one tiny batch: the same kernel choice as :class:`FlashInferBackend`
    (tensor-core decode from GQA 4), so the engine's first real step finds it ready. ``kv_dtype``: the cache's
    numbers when they differ from ``dtype`` (an FP8 cache)."""
    import flashinfer

    workspace = torch.zeros(16 * 1024 * 1024, dtype=torch.uint8, device=device)
    kv_dtype = kv_dtype or dtype
    kv = torch.zeros(4, 1, num_kv_heads, head_dim, dtype=kv_dtype, device=device)  # 4 one-token pages
    q = torch.zeros(1 if phase == "decode" else 2, num_q_heads, head_dim, dtype=dtype, device=device)
    kv_indptr = torch.tensor([0, 2], dtype=torch.int32)
    kv_indices = torch.tensor([0, 1], dtype=torch.int32, device=device)
    last_page_len = torch.ones(1, dtype=torch.int32)
    kwargs: dict[str, Any] = dict(q_data_type=dtype, kv_data_type=kv_dtype, sm_scale=head_dim**-0.5)
    if phase == "decode":
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=num_q_heads // num_kv_heads >= 4)
        wrapper.plan(kv_indptr, kv_indices, last_page_len, num_q_heads, num_kv_heads, head_dim, 1, **kwargs)
    else:
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(torch.tensor([0, 2], dtype=torch.int32), kv_indptr, kv_indices, last_page_len, num_q_heads,
                     num_kv_heads, head_dim, 1, causal=True, **kwargs)
    wrapper.run(q, (kv, kv))
