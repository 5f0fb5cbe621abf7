"""The ``triton`` attention backend: paged attention kernels written here in Triton (chapter 07).

What the backend does per step, and why it is split that way (the same split SGLang's backends use):

``init_forward_metadata(batch)``, once per step, builds everything the kernels need as device tensors:

- ``kv_indptr`` / ``kv_indices``: the batch's page-table rows flattened into CSR form (one small kernel, see
  :mod:`~minisgl_ref.attention.triton_kernels.kv_indices`). For decode they cover each request's whole context
  (the new token included); for extend only the cached prefix.
- extend: ``qo_indptr`` (where each request's new tokens sit in the flat ``[T]`` batch) and the longest extend
  length (the grid size, a host integer the scheduler already knows);
- decode: the split-KV scratch buffers and how many pieces to cut each context into at most.

``attend_extend`` / ``attend_decode``, once per layer (after the base class stored the new K/V): launch the
kernels with that metadata. Nothing per layer depends on the batch layout, so nothing is recomputed.

CUDA graphs (chapter 08) replay a recorded decode step, so its kernels must read metadata from buffers that
never move: :meth:`init_graph_buffers` allocates them once, :meth:`prepare_capture` points the metadata at slices
of them, and :meth:`prepare_replay` refills them in place (a cumsum and one kernel, no allocation, no
device-to-host copy).

The kernels run on the GPU, or on the CPU through Triton's interpreter when ``TRITON_INTERPRET=1`` is set before
this module is first imported (slow, for tests).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import triton

from minisgl_ref.attention.base import AttentionBackend
from minisgl_ref.attention.triton_kernels import (
    build_kv_indices,
    decode_attention_fwd,
    extend_attention_fwd,
    extend_launch_config,
)
from minisgl_ref.attention.triton_kernels.extend_attention import pack_extend_masks
from minisgl_ref.attention.utils import indptr

if TYPE_CHECKING:
    from minisgl_ref.core.forward_batch import ForwardBatch
    from minisgl_ref.kvcache.pool import KVPool
    from minisgl_ref.kvcache.req_to_token import ReqToTokenPool
    from minisgl_ref.layers.attention import AttentionLayer


def triton_interpret_mode() -> bool:
    """Whether ``triton.jit`` ran the kernels' definitions in interpreter mode (read when they were imported)."""
    from minisgl_ref.attention.triton_kernels import decode_attention

    return not isinstance(decode_attention._decode_stage1_kernel, triton.runtime.JITFunction)


@dataclass
class TritonMetadata:
    """Per-step metadata, shared by every layer of the step."""

    kv_indptr: torch.Tensor  # [B + 1] int32
    kv_indices: torch.Tensor  # [>= kv_indptr[B]] int32: pool slots (decode: whole context; extend: prefix only)
    # extend only
    qo_indptr: torch.Tensor | None = None  # [B + 1] int32
    max_extend_len: int = 0
    extend_config: dict[str, int] = field(default_factory=dict)  # tile sizes for this step's extend kernel
    # extend with ForwardBatch.extend_masks: the masks packed for the kernel (extend_attention.pack_extend_masks)
    custom_mask: torch.Tensor | None = None  # uint8, the masked requests' [E, E] masks back to back
    mask_offsets: torch.Tensor | None = None  # [B] int64: where each request's mask starts, -1 if causal
    # decode only: split-KV scratch, float32, [B, H, max_splits, D] and [B, H, max_splits]
    max_splits: int = 1
    mid_o: torch.Tensor | None = None
    mid_lse: torch.Tensor | None = None


class TritonAttnBackend(AttentionBackend):
    """Paged attention through this project's Triton kernels, for any page size and GQA ratio.

    ``num_q_heads`` (query heads per rank) is only needed up front for CUDA graphs, whose split-KV scratch must
    be allocated before capture; in eager mode the scratch is sized from the first layer of each step.
    ``max_kv_splits`` caps how many pieces a decode context is cut into, ``min_kv_split_len`` is the shortest
    piece worth a program of its own.
    """

    name = "triton"
    supports_cuda_graph = True
    supports_custom_mask = True  # the extend kernel reads ForwardBatch.extend_masks (chapter 13)
    reads_quantized_kv = True  # FP8 cache numbers cast in the kernels, scales folded outside (chapter 15)

    def __init__(
        self,
        kv_pool: KVPool,
        req_to_token: ReqToTokenPool,
        *,
        num_q_heads: int | None = None,
        max_kv_splits: int = 64,
        min_kv_split_len: int = 128,
    ) -> None:
        super().__init__(kv_pool, req_to_token)
        self.num_q_heads = num_q_heads
        self.max_kv_splits = max_kv_splits
        self.min_kv_split_len = min_kv_split_len
        if self.device.type == "cpu" and not triton_interpret_mode():
            raise RuntimeError(
                "the triton attention backend needs a GPU, or TRITON_INTERPRET=1 set before triton kernels are "
                "imported (CPU interpreter, for tests)"
            )
        if self.device.type == "cuda":
            self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        else:
            self.num_sms = 0
        self.forward_metadata: TritonMetadata | None = None
        self.cuda_graph: dict[str, torch.Tensor] | None = None

    # ------------------------------------------------------------------------------------------- metadata

    def num_kv_splits(self, batch_size: int) -> int:
        """The most pieces a decode context is cut into for this batch size. Enough programs to give every SM a
        few (``(B x KV heads x splits) >= 4 x SMs``), never more than ``max_kv_splits``; each request then uses
        ``min(this, cdiv(seq_len, min_kv_split_len))`` pieces (decided inside the kernels). A function of the
        batch size alone, so a CUDA graph captured for ``bs`` replays with the same value."""
        if self.num_sms == 0:  # interpreter: programs run one by one; a few pieces exercise the reduction
            return min(self.max_kv_splits, 4)
        want = triton.cdiv(4 * self.num_sms, batch_size * self.num_kv_heads)
        return max(1, min(self.max_kv_splits, want))

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Build this step's :class:`TritonMetadata` into ``self.forward_metadata`` (every layer reuses it).

        Which context the kernels read through the page table: in decode each request's *whole* context, its new
        token included (``batch.seq_lens_cpu``: the base class stores the new K/V before attending); in extend only
        the cached *prefix* (``batch.prefix_lens_cpu``: the extend kernel reads the new tokens from ``k``/``v``).
        With those lengths ``lens`` (int32, on ``self.device``):

        - ``kv_indptr`` [B + 1] int32: ``[0, l0, l0 + l1, ...]``, the running sum (``utils.indptr``);
        - ``kv_indices``: an int32 device buffer of ``max(1, sum(lens))`` entries (never empty), filled by
          ``build_kv_indices(self.req_to_token.table, batch.req_pool_indices, lens, kv_indptr, kv_indices)``. Size
          it from the host lengths: reading ``kv_indptr[-1]`` back would wait for the device.
        - decode: ``max_splits = self.num_kv_splits(B)``, and when ``self.num_q_heads`` is known the split-KV
          scratch ``mid_o, mid_lse = self._split_scratch(B, self.num_q_heads, max_splits)`` (else the first layer
          allocates it); ``qo_indptr`` stays ``None``.
        - extend: ``qo_indptr`` [B + 1] int32 over the *new* tokens (``batch.extend_lens_cpu``), ``max_extend_len``
          their maximum (the grid), and ``extend_config = extend_launch_config(longest prefix)`` (tile sizes)."""
        # BEGIN TASK 7.2: per-step metadata of the Triton kernels (CSR kv_indptr / kv_indices, qo_indptr, splits)
        assert batch.req_pool_indices is not None
        dev = self.device
        rows = batch.req_pool_indices
        if batch.mode.is_decode:
            lens_cpu = batch.seq_lens_cpu
        else:
            lens_cpu = batch.prefix_lens_cpu
        lens = torch.tensor(lens_cpu, dtype=torch.int32).to(dev, non_blocking=True)
        kv_indptr = indptr(lens)
        # The total is known on the host (the scheduler's lengths), so sizing kv_indices needs no sync.
        kv_indices = torch.empty(max(1, sum(lens_cpu)), dtype=torch.int32, device=dev)
        build_kv_indices(self.req_to_token.table, rows, lens, kv_indptr, kv_indices)
        md = TritonMetadata(kv_indptr=kv_indptr, kv_indices=kv_indices)
        if batch.mode.is_decode:
            md.max_splits = self.num_kv_splits(batch.batch_size)
            if self.num_q_heads is not None:
                md.mid_o, md.mid_lse = self._split_scratch(batch.batch_size, self.num_q_heads, md.max_splits)
        else:
            ext = torch.tensor(batch.extend_lens_cpu, dtype=torch.int32).to(dev, non_blocking=True)
            md.qo_indptr = indptr(ext)
            md.max_extend_len = max(batch.extend_lens_cpu)
            md.extend_config = extend_launch_config(max(batch.prefix_lens_cpu))
        self.forward_metadata = md
        # END TASK 7.2
        if batch.has_custom_mask:  # draft trees (chapter 13): packed once per step, read by every layer
            batch.check_extend_masks()
            assert batch.extend_masks is not None
            meta = self.forward_metadata
            assert meta is not None
            meta.custom_mask, meta.mask_offsets = pack_extend_masks(batch.extend_masks, self.device)

    def _split_scratch(self, bs: int, num_heads: int, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        mid_o = torch.empty(bs, num_heads, splits, self.head_dim, dtype=torch.float32, device=self.device)
        mid_lse = torch.empty(bs, num_heads, splits, dtype=torch.float32, device=self.device)
        return mid_o, mid_lse

    # -------------------------------------------------------------------------------------------- forward

    def attend_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        md = self.forward_metadata
        assert md is not None and md.qo_indptr is not None, "init_forward_metadata was not called for this step"
        lid = layer.layer_id
        k_buf, v_buf = self.kv_pool.k[lid], self.kv_pool.v[lid]
        k_scale, v_scale = self.kv_pool.scales(lid)
        if self.kv_pool.quantized:
            # An FP8 cache (chapter 15): the new tokens too are read as the cache stores them (their stored
            # numbers, exact in the query's dtype), so that every key and value is rounded alike, in every backend.
            slots = batch.out_cache_loc
            assert slots is not None
            k, v = k_buf[slots].to(q.dtype), v_buf[slots].to(q.dtype)
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        extend_attention_fwd(
            _last_dim_contiguous(q), _last_dim_contiguous(k.to(q.dtype)), _last_dim_contiguous(v.to(q.dtype)),
            o, k_buf, v_buf, md.qo_indptr, md.kv_indptr, md.kv_indices, md.max_extend_len, layer.scale * k_scale,
            **md.extend_config, custom_mask=md.custom_mask, mask_offsets=md.mask_offsets,
        )  # fmt: skip
        return _scaled(o, v_scale).flatten(1)

    def attend_decode(self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        md = self.forward_metadata
        assert md is not None and md.qo_indptr is None, "init_forward_metadata was not called for this step"
        lid = layer.layer_id
        bs, num_heads = q.shape[0], q.shape[1]
        if md.mid_o is None or md.mid_o.shape[1] != num_heads:  # eager, head count not given: first layer
            md.mid_o, md.mid_lse = self._split_scratch(bs, num_heads, md.max_splits)
        assert md.mid_lse is not None
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        k_scale, v_scale = self.kv_pool.scales(lid)  # 1, 1 unless the cache is FP8 (chapter 15)
        decode_attention_fwd(
            _last_dim_contiguous(q), self.kv_pool.k[lid], self.kv_pool.v[lid], o, md.kv_indptr, md.kv_indices,
            md.mid_o, md.mid_lse, layer.scale * k_scale, md.max_splits, min_split_len=self.min_kv_split_len,
        )  # fmt: skip
        return _scaled(o, v_scale).flatten(1)

    # ---------------------------------------------------------------------------------------- CUDA graphs

    def init_graph_buffers(self, max_bs: int) -> None:
        """Allocate the static buffers every captured decode graph reads its metadata from. The split-KV scratch
        is one flat buffer that each batch size views as ``[bs, H, num_kv_splits(bs), D]``: small batches use
        many pieces, large ones few, so the largest ``bs x splits`` (not ``max_bs x max_kv_splits``) sizes it."""
        if self.num_q_heads is None:
            raise ValueError("TritonAttnBackend(num_q_heads=...) is required for CUDA graphs")
        max_ctx = self.req_to_token.max_context_len
        dev = self.device
        rows = max(bs * self.num_kv_splits(bs) for bs in range(1, max_bs + 1))
        self.cuda_graph = {
            "kv_indptr": torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
            "kv_indices": torch.zeros(max_bs * max_ctx, dtype=torch.int32, device=dev),
            "mid_o": torch.empty(rows * self.num_q_heads * self.head_dim, dtype=torch.float32, device=dev),
            "mid_lse": torch.empty(rows * self.num_q_heads, dtype=torch.float32, device=dev),
        }

    def prepare_capture(self, batch: ForwardBatch) -> None:
        """Metadata that lives in the static buffers, viewed for this batch size."""
        assert self.cuda_graph is not None, "call init_graph_buffers first"
        g, heads, bs = self.cuda_graph, self.num_q_heads, batch.batch_size
        splits = self.num_kv_splits(bs)
        assert heads is not None
        self.forward_metadata = TritonMetadata(
            kv_indptr=g["kv_indptr"][: bs + 1],
            kv_indices=g["kv_indices"],
            max_splits=splits,
            mid_o=g["mid_o"][: bs * heads * splits * self.head_dim].view(bs, heads, splits, self.head_dim),
            mid_lse=g["mid_lse"][: bs * heads * splits].view(bs, heads, splits),
        )
        self.prepare_replay(batch)

    def prepare_replay(self, batch: ForwardBatch) -> None:
        """Refill ``kv_indptr`` / ``kv_indices`` in place, all on the device from ``batch.seq_lens``: a cumsum and
        one kernel."""
        assert self.cuda_graph is not None and batch.seq_lens is not None and batch.req_pool_indices is not None
        kv_indptr = self.cuda_graph["kv_indptr"][: batch.batch_size + 1]
        indptr(batch.seq_lens, out=kv_indptr)  # kv_indptr[0] stays 0 from allocation
        build_kv_indices(self.req_to_token.table, batch.req_pool_indices, batch.seq_lens, kv_indptr,
                         self.cuda_graph["kv_indices"])  # fmt: skip


def _scaled(o: torch.Tensor, v_scale: float) -> torch.Tensor:
    """The output of attention over values stored divided by ``v_scale``: it is linear in the values, so one
    multiplication at the end applies the scale (none for a cache that stores the values themselves)."""
    return o if v_scale == 1.0 else o.mul_(v_scale)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()
