"""The ``fa3`` attention backend: FlashAttention's paged KV-cache kernel (chapter 07).

FlashAttention-3 (module ``flash_attn_interface``, Hopper only) reads a paged cache through a dense *page
table* ``[B, max_pages]`` instead of FlashInfer's CSR lists: row ``b`` lists request ``b``'s pages in order,
``cache_seqlens[b]`` says how many tokens of them count. One call, ``flash_attn_with_kvcache``, serves both modes:

- decode: ``q`` is ``[B, 1, H, D]`` (one new token per request);
- extend: ``q`` is the flat ``[T, H, D]`` of all new tokens with ``cu_seqlens_q`` (where each request's new
  tokens start) and ``max_seqlen_q``; ``causal=True`` aligns the mask to the bottom right, so new token ``i`` of
  ``n`` sees the whole cached prefix and new tokens ``0..i``. The base class has stored the new K/V into the
  pool already, so the kernel reads each whole context from the pool.

The page table is the batch's rows of our token-granular table, ``req_to_token[req_pool_indices, :max_len]``:
one gather per step. It treats the pool as pages of one token (``[num_slots, 1, kv_heads, head_dim]``, a view),
which FA3 supports for any page size; the table entries are then slots.

FlashAttention-2 (module ``flash_attn``, for GPUs before Hopper) has the same paged call but only for pages of a
multiple of 256 tokens and without ``cu_seqlens_q``: when only FA2 is installed this backend uses
``flash_attn_varlen_func`` with ``block_table`` = the real pages, and refuses to start unless ``--page-size`` is a
multiple of 256. (That path follows FA2's documented API but has not been run on a GPU: no FA2 build was at
hand to test it.)

Host cost: FA3's Python entry point wraps its operator in a ``torch.library.custom_op`` (so that
``torch.compile`` can trace it), and that layer costs ~80 us of host time per call on an H100 host. An eager
extend step calls attention once per layer, so for a 28-layer model the wrapper was ~2.4 ms of a ~20 ms launch
(chapter 11, section 7). The backend calls the registered operator ``torch.ops.flash_attn_3.fwd`` itself when its
signature is the one written for here, and the Python entry point otherwise.

CUDA graphs: decode, FA3 only. Static ``page_table`` ``[max_bs, max_context]`` and ``cache_seqlens`` buffers;
replay copies the new lengths and the first ``max(seq_lens_cpu)`` columns of the batch's page-table rows into them
(the host-side lengths: no sync).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from minisgl_ref.attention.base import AttentionBackend
from minisgl_ref.attention.utils import indptr

if TYPE_CHECKING:
    from minisgl_ref.core.forward_batch import ForwardBatch
    from minisgl_ref.kvcache.pool import KVPool
    from minisgl_ref.kvcache.req_to_token import ReqToTokenPool
    from minisgl_ref.layers.attention import AttentionLayer

FA2_PAGE_MULTIPLE = 256


def import_flash_attention(hopper: bool) -> tuple[str, Any]:
    """``("fa3", flash_attn_interface)`` on a Hopper GPU where FlashAttention-3 is importable, else
    ``("fa2", flash_attn)``; raises ImportError when the one needed is missing."""
    if hopper:
        try:
            import flash_attn_interface

            return "fa3", flash_attn_interface
        except ImportError:
            pass
    import flash_attn  # raises ImportError: the registry checks first and reports it in one line

    return "fa2", flash_attn


#: The arguments of FA3's operator, in order, as its Python entry point (``_flash_attn_forward``) passes them.
FA3_OP_ARGS = ("q", "k", "v", "k_new", "v_new", "qv", "out_", "cu_seqlens_q", "cu_seqlens_k", "cu_seqlens_k_new",
               "seqused_q", "seqused_k", "max_seqlen_q", "max_seqlen_k", "page_table", "kv_batch_idx", "leftpad_k",
               "rotary_cos", "rotary_sin", "seqlens_rotary", "q_descale", "k_descale", "v_descale",
               "softmax_scale", "causal", "window_size_left", "window_size_right", "attention_chunk", "softcap",
               "rotary_interleaved", "scheduler_metadata", "num_splits", "pack_gqa", "sm_margin", "sinks")


def fa3_operator(fa: Any) -> Any | None:
    """FA3's registered forward operator, when this build's entry point passes it exactly the arguments the direct
    call below is written for (same names, same order, as many as the operator takes); else None: another build
    of FlashAttention-3, called through its Python entry point."""
    import inspect

    op = getattr(getattr(fa, "flash_attn_3_gpu", None), "fwd", None)
    entry = getattr(getattr(fa, "_flash_attn_forward", None), "_init_fn", None)
    try:
        params = tuple(inspect.signature(entry).parameters)  # type: ignore[arg-type]
        n_op = len(op.default._schema.arguments)  # type: ignore[union-attr]
    except (AttributeError, TypeError, ValueError):
        return None
    return op if params == FA3_OP_ARGS and n_op == len(FA3_OP_ARGS) else None


@dataclass
class FlashAttentionMetadata:
    cache_seqlens: torch.Tensor  # [B] int32: whole context per request, new tokens included
    page_table: torch.Tensor  # [B, >= max pages] int32
    max_seqlen_k: int = 0  # host copy of max(cache_seqlens) (FA2's varlen call needs it)
    cu_seqlens_q: torch.Tensor | None = None  # extend (and FA2): [B + 1] int32
    cu_seqlens_k: torch.Tensor | None = None  # FA2 only: [B + 1] int32
    max_seqlen_q: int = 1


class FlashAttentionBackend(AttentionBackend):
    """Paged attention through FlashAttention's ``flash_attn_with_kvcache`` (FA3) or ``flash_attn_varlen_func``
    with a block table (FA2). ``page_size`` is the engine's page size (FA2 reads real pages)."""

    name = "fa3"
    #: FlashAttention's kernels mask causally or by a sliding window, never by an arbitrary per-token mask: a
    #: batch carrying ``ForwardBatch.extend_masks`` (draft trees) is refused, and runs on another backend.
    supports_custom_mask = False
    #: An FP8 cache (chapter 15) is not read here: FA3's FP8 kernels multiply FP8 queries by FP8 keys, so the
    #: queries would have to be quantized too (another rounding, per step, of every query), and FA2 has no FP8
    #: path. The engine's defaults give way to FlashInfer, whose kernels keep the queries in bf16.
    reads_quantized_kv = False

    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenPool, *, page_size: int = 1) -> None:
        super().__init__(kv_pool, req_to_token)
        if self.device.type != "cuda":
            raise ValueError("the fa3 attention backend needs a CUDA device")
        self.version, self.fa = import_flash_attention(torch.cuda.get_device_capability(self.device)[0] == 9)
        self.op = fa3_operator(self.fa) if self.version == "fa3" else None
        # CUDA graphs record FA3's decode call; FA2's varlen call is not captured here.
        self.supports_cuda_graph = self.version == "fa3"
        if self.version == "fa2" and page_size % FA2_PAGE_MULTIPLE:
            raise ValueError(
                f"only FlashAttention-2 (flash_attn) is installed, and its paged kernels need pages of a multiple "
                f"of {FA2_PAGE_MULTIPLE} tokens: use --page-size {FA2_PAGE_MULTIPLE} (got {page_size})"
            )
        # FA3 reads the pool as pages of one token; FA2 as real pages.
        self.page_size = page_size if self.version == "fa2" else 1
        self.forward_metadata: FlashAttentionMetadata | None = None
        self.graph_state: dict[str, torch.Tensor] | None = None
        # Extend steps with few rows in CUDA graphs too (chapter 11, minisgl_ref/engine/extend_graph.py).
        self.supports_extend_graph = self.version == "fa3"
        self.extend_graph: dict[str, torch.Tensor] | None = None

    # ------------------------------------------------------------------------------------------- metadata

    def _page_table(self, rows: torch.Tensor, max_len: int) -> torch.Tensor:
        """[B, pages] int32: the batch's page-table rows, cut to the longest context (one gather)."""
        table = self.req_to_token.table
        if self.page_size == 1:
            return table[rows, :max_len]
        # Token i of a request sits at offset i % page_size of its page, so every page_size-th slot names a page.
        return table[rows, : max_len : self.page_size] // self.page_size

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        assert batch.req_pool_indices is not None
        dev = self.device
        lens = batch.seq_lens_cpu
        # Host tensors are pinned: a copy from pageable memory would wait for the step in flight (chapter 08).
        md = FlashAttentionMetadata(
            cache_seqlens=torch.tensor(lens, dtype=torch.int32).pin_memory().to(dev, non_blocking=True),
            page_table=self._page_table(batch.req_pool_indices, max(lens)),
            max_seqlen_k=max(lens),
        )
        if not batch.mode.is_decode or self.version == "fa2":
            md.cu_seqlens_q = indptr(batch.extend_lens_cpu).pin_memory().to(dev, non_blocking=True)
            md.max_seqlen_q = max(batch.extend_lens_cpu)
        if self.version == "fa2":
            md.cu_seqlens_k = indptr(lens).pin_memory().to(dev, non_blocking=True)
        self.forward_metadata = md

    # -------------------------------------------------------------------------------------------- forward

    def _attend(self, q: torch.Tensor, layer: AttentionLayer, decode: bool) -> torch.Tensor:
        md = self.forward_metadata
        assert md is not None, "init_forward_metadata was not called for this step"
        lid, ps = layer.layer_id, self.page_size
        k_buf, v_buf = self.kv_pool.k[lid], self.kv_pool.v[lid]
        k_cache = k_buf.view(-1, ps, *k_buf.shape[1:])  # [pages, page_size, kv_heads, head_dim]
        v_cache = v_buf.view(-1, ps, *v_buf.shape[1:])
        if self.version == "fa2":
            return self.fa.flash_attn_varlen_func(
                q, k_cache, v_cache, md.cu_seqlens_q, md.cu_seqlens_k, md.max_seqlen_q, md.max_seqlen_k,
                softmax_scale=layer.scale, causal=True, block_table=md.page_table,
            )  # fmt: skip
        # decode: [B, 1, H, D], one query per request and no cu_seqlens (what a CUDA graph can record)
        q = q.unsqueeze(1) if decode else q
        cu_seqlens_q, max_seqlen_q = (None, None) if decode else (md.cu_seqlens_q, md.max_seqlen_q)
        if self.op is not None:
            # The operator's own argument list: new K/V, rotary, descales, windows and splits all off.
            out = self.op(q, k_cache, v_cache, None, None, None, None, cu_seqlens_q, None, None, None,
                          md.cache_seqlens, max_seqlen_q, None, md.page_table, None, None, None, None, None, None,
                          None, None, layer.scale, True, -1, -1, 0, 0.0, True, None, 1, None, 0, None)[0]
        else:
            out = self.fa.flash_attn_with_kvcache(
                q, k_cache, v_cache, cache_seqlens=md.cache_seqlens, page_table=md.page_table,
                cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, softmax_scale=layer.scale, causal=True,
            )  # fmt: skip
        return out.squeeze(1) if decode else out

    def attend_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        return self._attend(_last_dim_contiguous(q), layer, decode=False).reshape(q.shape[0], -1)

    def attend_decode(self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        return self._attend(_last_dim_contiguous(q), layer, decode=True).reshape(q.shape[0], -1)

    # ---------------------------------------------------------------------------------------- CUDA graphs

    def init_graph_buffers(self, max_bs: int) -> None:
        """A page table as wide as the page-table pool (any context fits) and a lengths buffer."""
        dev = self.device
        self.graph_state = {
            "page_table": torch.zeros(max_bs, self.req_to_token.max_context_len, dtype=torch.int32, device=dev),
            "cache_seqlens": torch.ones(max_bs, dtype=torch.int32, device=dev),
        }

    def prepare_capture(self, batch: ForwardBatch) -> None:
        assert self.graph_state is not None, "call init_graph_buffers first"
        g, bs = self.graph_state, batch.batch_size
        # The kernel sees the full-width table: its shape (hence FA3's launch heuristics) is fixed per bs.
        self.forward_metadata = FlashAttentionMetadata(cache_seqlens=g["cache_seqlens"][:bs],
                                                       page_table=g["page_table"][:bs])  # fmt: skip
        self._fill_graph(batch, width=self.req_to_token.max_context_len)

    def prepare_replay(self, batch: ForwardBatch) -> None:
        """Copy the lengths and the used columns of the page-table rows into the static buffers. Columns past a
        request's length are never read, so only ``max(seq_lens_cpu)`` columns need refreshing."""
        self._fill_graph(batch, width=max(batch.seq_lens_cpu))

    def _fill_graph(self, batch: ForwardBatch, width: int) -> None:
        assert self.graph_state is not None and batch.seq_lens is not None and batch.req_pool_indices is not None
        g, bs = self.graph_state, batch.batch_size
        g["cache_seqlens"][:bs].copy_(batch.seq_lens)
        g["page_table"][:bs, :width].copy_(self.req_to_token.table[batch.req_pool_indices, :width])

    # ------------------------------------------------------------------------------- extend-step CUDA graphs

    def init_extend_graph_buffers(self, max_rows: int) -> None:
        """Up to ``max_rows`` rows: a full-width page table, and one int32 buffer holding ``cache_seqlens``
        [max_rows] then ``cu_seqlens_q`` [max_rows + 1], refilled by one copy per replay. A graph of ``R`` rows
        reads the first ``R`` and ``R + 1`` entries of the two halves."""
        self.extend_graph = {
            "page_table": torch.zeros(max_rows, self.req_to_token.max_context_len, dtype=torch.int32,
                                      device=self.device),
            "lens": torch.zeros(2 * max_rows + 1, dtype=torch.int32, device=self.device),
        }

    def prepare_extend_capture(self, rows: int, tokens: int) -> None:
        """Point the metadata at the static buffers, at rest: the first row has all ``tokens`` tokens and nothing
        cached (reading page-table entries of 0, the reserved slot), the other rows none. The kernel is launched
        for ``tokens`` queries per row; each row computes only its own."""
        assert self.extend_graph is not None, "call init_extend_graph_buffers first"
        g = self.extend_graph
        m = g["page_table"].shape[0]
        g["lens"].copy_(self._extend_lens(m, [tokens] + [0] * (rows - 1), [tokens] + [0] * (rows - 1)))
        g["page_table"].zero_()
        self.forward_metadata = FlashAttentionMetadata(cache_seqlens=g["lens"][:rows], page_table=g["page_table"][:rows],
                                                       cu_seqlens_q=g["lens"][m : m + rows + 1], max_seqlen_q=tokens)

    @staticmethod
    def _extend_lens(max_rows: int, seq: list[int], extend: list[int]) -> torch.Tensor:
        """``[seq lens, zero-padded to max_rows | cumulative extend lens from 0, padded with the total]``."""
        cu = [0]
        for e in extend:
            cu.append(cu[-1] + e)
        return torch.tensor(seq + [0] * (max_rows - len(seq)) + cu + [cu[-1]] * (max_rows - len(extend)),
                            dtype=torch.int32)

    def prepare_extend_replay(self, rows: torch.Tensor, prefix_lens: list[int], extend_lens: list[int]) -> None:
        """Refill the lengths (one pinned copy) and the used columns of the page tables of ``rows``, the step's
        own rows; the lists cover the graph's rows, the empty ones included (length 0: their stale page-table
        rows are never read)."""
        assert self.extend_graph is not None
        g = self.extend_graph
        seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
        host = self._extend_lens(g["page_table"].shape[0], seq, extend_lens)
        g["lens"].copy_(host.pin_memory(), non_blocking=True)
        width = max(seq)
        g["page_table"][: rows.shape[0], :width].copy_(self.req_to_token.table[rows, :width])


def _last_dim_contiguous(q: torch.Tensor) -> torch.Tensor:
    """``q`` as FA3 takes it: any token and head strides, the head dim contiguous. The query is a view into the
    fused QKV output; copying it whole would cost a prefill step of 16,384 tokens ~70 us per layer on an H100."""
    return q if q.stride(-1) == 1 else q.contiguous()
