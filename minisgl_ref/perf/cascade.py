"""Cascade decode attention: requests that share a cached prefix read its KV once per step (chapter 11).

The radix cache (chapter 04) stores a shared system prompt once, and every request that matched it points its
page-table row at the same slots. Plain decode attention still reads those slots once *per request*: on SGLang's
shared-prefix workload (groups of 16 requests behind a 2,048-token system prompt, 128-token questions) over 80%
of the KV bytes a decode step reads are copies of the same prefix pages. Decode is bound by those bytes
(chapter 11), so this module reads them once per group:

1. **Grouping** (:func:`find_prefix_groups`, host side, once per distinct decode batch): compare the batch's
   page-table rows and find sets of rows whose first whole pages are the same slots. A set is a
   :class:`PrefixGroups` entry only if it has at least two rows and shares at least ``min_prefix_len`` tokens
   (``--cascade-min-prefix-len``, default 256): below that the prefix pass and the merge cost about what they
   save (a few hundred bytes of partial results per row and head against ``shared_len x kv_bytes`` per extra
   row), and a step without groups stays on the backend's normal decode.
2. **Three passes** (:mod:`minisgl_ref.perf.cascade_kernels` on the GPU, :func:`cascade_attention_reference`
   in plain PyTorch for the CPU and the book): attention of every group's queries over its prefix (read once),
   attention of every row over its own suffix, and :func:`merge_state` of the two partial results by their
   log-sum-exp.
3. **Choice per step** (:class:`CascadePlanner`, the engine's attention planner, which calls
   :meth:`CascadeDecodeBackend.attach` for every decode batch): a batch with groups runs its attention through
   this backend, any other through the engine's own decode backend, whatever it is (``triton``, ``flashinfer``,
   ``fa3``, ``torch_native``).

Why a backend of its own rather than a branch inside each backend: the cascade reads the KV pool and the page
table directly, so one implementation serves every decode backend (including the FlashInfer default on an H100),
and its CUDA graphs are separate ones. The planner lists it among its decode backends, so the model runner
captures the cascade decode step with its own :class:`~minisgl_ref.engine.cuda_graph.CudaGraphRunner` (a second
set of graphs, one per batch size): on an H100 an eager decode step of Qwen3-0.6B costs 11-19 ms of host time
against 1.4-9 ms replayed (chapter 08), which would eat most of what the cascade saves. The price is paid once, at
start-up: the capture takes twice as long, and the second set of graphs keeps its own logits buffer per captured
batch size (~1.3 GB of bf16 logits for a 151,936-token vocabulary up to batch 256). The plan a graph reads is one
int32 buffer whose layout depends only on the batch size (see the kernels' module), so a replay only copies the
new plan into it.

:func:`kv_tokens_read` / :func:`decode_kv_bytes` say what a step reads with and without the cascade; the planner
shows every decode step's lengths and groups to its ``observers``, which is where ``bench offline`` counts them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from minisgl_ref.attention.base import AttentionBackend
from minisgl_ref.engine.attention_planner import AttentionPlanner

if TYPE_CHECKING:
    from minisgl_ref.core.batch import ScheduledBatch
    from minisgl_ref.core.config import EngineConfig
    from minisgl_ref.core.forward_batch import ForwardBatch
    from minisgl_ref.kvcache.pool import KVPool
    from minisgl_ref.kvcache.req_to_token import ReqToTokenPool
    from minisgl_ref.layers.attention import AttentionLayer

#: Pass 1 cuts a shared prefix into pieces of at least this many tokens (parallelism when groups are few; on an
#: H100, 512 beat 256 and 128 by 5-30%: a piece's fixed cost (its queries, its partial results) is paid less often) ...
PREFIX_PIECE_LEN = 512
#: ... and into at most this many (each piece costs every row of the group a partial result in the scratch).
MAX_PREFIX_PIECES = 32
#: Flattened (row, query head) pairs per large pass-1 tile (a group with more queries than a small tile holds);
#: small tiles hold 16 (``SMALL_BLOCK_M`` of the kernels: see their module on why two sizes).
PREFIX_BLOCK_M = 64


# --------------------------------------------------------------------------------------------------- grouping


@dataclass(frozen=True, eq=False)
class PrefixGroups:
    """Rows of a decode batch whose page-table rows point at the same KV slots for a leading run of whole pages:
    a prefix they share through the radix cache (chapter 04). The cascade reads each group's prefix once per step
    instead of once per row. Rows in no group share nothing worth it and are attended alone.

    Compared by identity: :meth:`CascadeDecodeBackend.groups_for` reuses the same object for as long as the
    decode batch is the same, so whatever is planned from it can be cached by it."""

    prefix_lens: tuple[int, ...]  # per group: the shared tokens, a multiple of the page size
    rows: tuple[tuple[int, ...], ...]  # per group: its rows (indices into the batch), at least two, ascending

    @property
    def num_groups(self) -> int:
        return len(self.prefix_lens)

    def row_prefix_lens(self, batch_size: int) -> list[int]:
        """The shared prefix length of every row of the batch (0 for a row in no group)."""
        out = [0] * batch_size
        for length, rows in zip(self.prefix_lens, self.rows):
            for r in rows:
                out[r] = length
        return out


def find_prefix_groups(
    table: np.ndarray,
    rows: Sequence[int],
    seq_lens: Sequence[int],
    page_size: int,
    min_prefix_len: int,
) -> PrefixGroups | None:
    """The groups of a decode batch: rows (indices into ``rows``) whose page-table rows hold the same slots for
    their first ``L`` tokens, ``L`` a whole number of pages and at least ``min_prefix_len``; ``None`` if none.

    ``table`` is the host page table (``ReqToTokenPool.host_np``), ``rows`` each batch row's page-table row and
    ``seq_lens`` its context length. Only whole pages inside a row's context count (its last, partly filled page
    is its own). The comparison is of slots, not token ids: equal slots *are* the same KV.

    Sharing is hierarchical (a chat template shared by everyone, then system prompts shared by some), and a row
    reads one shared prefix here, so for each set of rows that agree on their first slot the choice is made
    bottom-up: either one group over their longest common prefix, or the best groups among the subsets that
    agree further, whichever saves more prefix reads (``(rows - 1) x L`` tokens). On SGLang's shared-prefix
    workload that gives one group per system prompt; with a short common template in front, the same.

    Cost: numpy over the candidate rows' contexts, run only when the batch's rows change
    (:meth:`CascadeDecodeBackend.groups_for` keeps the result while a decode batch stays the same)."""
    rows_a = np.asarray(rows, dtype=np.int64)
    whole = (np.asarray(seq_lens, dtype=np.int64) // page_size) * page_size  # tokens in whole pages
    candidates = np.flatnonzero(whole >= min_prefix_len)
    if len(candidates) < 2:
        return None
    found: list[tuple[int, np.ndarray]] = []

    def best(idx: np.ndarray, lo: int) -> tuple[int, list[tuple[int, np.ndarray]]]:
        """The best grouping of batch rows ``idx``, which share their first ``lo`` tokens: (saving, groups)."""
        end = int(whole[idx].min())
        block = table[:, lo:end][rows_a[idx]]  # [rows, tokens lo..end) of the page table, one gather
        differs = (block != block[:1]).any(axis=0)
        lcp = lo + (int(differs.argmax()) if differs.any() else end - lo)  # tokens all of idx share
        shared = lcp - lcp % page_size
        own = (len(idx) - 1) * shared if shared >= min_prefix_len else 0
        # Subsets that share more: they agree on token `lcp` too (rows whose whole pages reach past it).
        deeper, sub = 0, []
        longer = idx[whole[idx] > lcp]
        if len(longer) >= 2:
            keys = table[rows_a[longer], lcp]
            order = np.argsort(keys, kind="stable")
            sorted_keys = keys[order]
            starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
            for s, e in zip(starts, np.r_[starts[1:], len(order)]):
                if e - s >= 2:
                    saving, groups = best(longer[order[s:e]], lcp + 1)
                    deeper += saving
                    sub += groups
        if own > 0 and own >= deeper:
            return own, [(shared, idx)]
        return deeper, sub

    first = table[rows_a[candidates], 0]
    order = np.argsort(first, kind="stable")
    sorted_first = first[order]
    starts = np.flatnonzero(np.r_[True, sorted_first[1:] != sorted_first[:-1]])
    for s, e in zip(starts, np.r_[starts[1:], len(order)]):
        if e - s >= 2:
            found += best(candidates[order[s:e]], 1)[1]
    if not found:
        return None
    found.sort(key=lambda g: int(g[1].min()))
    return PrefixGroups(prefix_lens=tuple(int(n) for n, _ in found),
                        rows=tuple(tuple(sorted(int(r) for r in idx)) for _, idx in found))  # fmt: skip


def kv_tokens_read(seq_lens: Sequence[int], groups: PrefixGroups | None) -> tuple[int, int]:
    """Tokens of K/V a decode step reads per layer: ``(plain, cascade)``. Plain decode reads every row's whole
    context; the cascade reads each group's prefix once and every row's suffix."""
    plain = int(sum(seq_lens))
    if groups is None:
        return plain, plain
    saved = sum((len(rows) - 1) * length for length, rows in zip(groups.prefix_lens, groups.rows))
    return plain, plain - saved


def decode_kv_bytes(seq_lens: Sequence[int], groups: PrefixGroups | None, kv_bytes_per_token: int) -> tuple[int, int]:
    """KV bytes one decode step reads, all layers (``ModelConfig.kv_bytes_per_token``): ``(plain, cascade)``.
    The roofline of chapter 11 counts the plain number; the difference is what cascade attention saves."""
    plain, cascade = kv_tokens_read(seq_lens, groups)
    return plain * kv_bytes_per_token, cascade * kv_bytes_per_token


# ---------------------------------------------------------------------------------------- the three passes


def partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries ``q`` [N, H, D] over keys/values [L, KVH, D] (no mask: all of them visible), as a
    *partial state*: the normalised output [N, H, D] and the log-sum-exp of the scores [N, H], float32 (natural
    log). With ``L == 0`` the output is 0 and the log-sum-exp ``-inf`` (a state that weighs nothing)."""
    n, num_heads, head_dim = q.shape
    if k.shape[0] == 0:
        return (torch.zeros(n, num_heads, head_dim, dtype=torch.float32, device=q.device),
                torch.full((n, num_heads), float("-inf"), dtype=torch.float32, device=q.device))  # fmt: skip
    group = num_heads // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)  # [L, H, D]
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->nhl", q.float(), k) * scale
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("nhl,lhd->nhd", torch.exp(scores - lse[..., None]), v)
    return out, lse


def merge_state(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention states over disjoint key sets into the state over their union.

    ``m = max(lse1, lse2)``, ``w_i = exp(lse_i - m)``: ``o = (o1 w1 + o2 w2) / (w1 + w2)`` and
    ``lse = m + log(w1 + w2)``. Each part's weight is its share of the total softmax mass, so the result is exactly
    softmax attention over both key sets. An empty part (``lse = -inf``) has weight 0; ``o`` [..., D], ``lse`` [...]."""
    m = torch.maximum(lse1, lse2)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # both empty: keep the arithmetic finite
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    total = w1 + w2
    out = (o1 * w1[..., None] + o2 * w2[..., None]) / total.clamp_min(torch.finfo(total.dtype).tiny)[..., None]
    return out, m + torch.log(total)


def cascade_attention_reference(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    context_slots: Sequence[torch.Tensor],
    groups: PrefixGroups | None,
    scale: float,
) -> torch.Tensor:
    """The three passes in plain PyTorch: decode attention of ``q`` [B, H, D] where row ``b``'s context is pool
    slots ``context_slots[b]`` (its new token included). Returns [B, H, D] in q's dtype.

    Pass 1 gathers each group's prefix K/V once and attends all of the group's queries to it; pass 2 attends each
    row to the rest of its context; pass 3 merges the two states. Rows in no group have an empty prefix state."""
    batch = q.shape[0]
    prefix = [0] * batch if groups is None else groups.row_prefix_lens(batch)
    o1 = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse1 = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    if groups is not None:
        for length, rows in zip(groups.prefix_lens, groups.rows):  # pass 1: one read of the prefix per group
            slots = context_slots[rows[0]][:length]
            idx = list(rows)
            o1[idx], lse1[idx] = partial_attention(q[idx], k_buffer[slots], v_buffer[slots], scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for b in range(batch):  # pass 2: each row's own suffix; pass 3: merge
        slots = context_slots[b][prefix[b] :]
        o2, lse2 = partial_attention(q[b : b + 1], k_buffer[slots], v_buffer[slots], scale)
        merged, _ = merge_state(o1[b : b + 1], lse1[b : b + 1], o2, lse2)
        out[b] = merged[0].to(q.dtype)
    return out


# ------------------------------------------------------------------------------------------------- planning


def plan_size(batch_size: int, num_work: int) -> int:
    """int32 entries of a plan for ``batch_size`` rows and ``num_work`` pass-1 work items."""
    from minisgl_ref.perf.cascade_kernels import HEADER, WORK_FIELDS

    return HEADER + 3 * batch_size + WORK_FIELDS * num_work


def max_prefix_work(batch_size: int, max_pieces: int = MAX_PREFIX_PIECES) -> int:
    """The most pass-1 work items a batch can need: a group of ``n`` rows makes ``cdiv(n x GQA, tile) <= n``
    tiles (a tile holds at least one GQA group), so at most ``batch_size`` tiles, each in ``max_pieces``."""
    return batch_size * max_pieces


def build_plan(
    groups: PrefixGroups | None,
    batch_size: int,
    gqa: int,
    *,
    block_m: int = PREFIX_BLOCK_M,
    small_block_m: int = 16,
    piece_len: int = PREFIX_PIECE_LEN,
    max_pieces: int = MAX_PREFIX_PIECES,
) -> np.ndarray:
    """The int32 plan the kernels read (layout: :mod:`minisgl_ref.perf.cascade_kernels`) for a batch
    of ``batch_size`` rows (a CUDA graph's padded size: rows past the real ones are in no group). Each group's
    prefix is cut into ``cdiv(L, piece_len)`` pieces (at most ``max_pieces``); its ``rows x gqa`` queries make one
    tile of the small list if they fit ``small_block_m``, else tiles of ``block_m`` in the large list. A work item
    is one (tile, piece)."""
    from minisgl_ref.perf.cascade_kernels import HEADER, WORK_FIELDS

    b = batch_size
    row_prefix = np.zeros(b, dtype=np.int32)
    row_pieces = np.zeros(b, dtype=np.int32)
    row_list = np.zeros(b, dtype=np.int32)
    lists: tuple[list[tuple[int, ...]], list[tuple[int, ...]]] = ([], [])  # small tiles, large tiles
    pos = 0
    for length, rows in zip(groups.prefix_lens if groups else (), groups.rows if groups else ()):
        n = len(rows)
        row_list[pos : pos + n] = rows
        pieces = min(max_pieces, -(-length // piece_len))
        split = -(-length // pieces)
        pieces = -(-length // split)  # no empty piece at the end
        row_prefix[list(rows)] = length
        row_pieces[list(rows)] = pieces
        large = n * gqa > small_block_m
        for m0 in range(0, n * gqa, block_m if large else small_block_m):
            pieces_of_tile = [(pos, n, m0, rows[0], s * split, min(length, (s + 1) * split), s) for s in range(pieces)]
            lists[large].extend(pieces_of_tile)
        pos += n
    work = lists[0] + lists[1]
    plan = np.empty(plan_size(b, len(work)), dtype=np.int32)
    plan[:HEADER] = [len(lists[0]), len(lists[1])]
    plan[HEADER : HEADER + 3 * b] = np.concatenate([row_prefix, row_pieces, row_list])
    if work:
        plan[HEADER + 3 * b :] = np.asarray(work, dtype=np.int32).reshape(-1)
    assert len(work) <= max_prefix_work(b, max_pieces) and WORK_FIELDS == 7
    return plan


# -------------------------------------------------------------------------------------------------- backend


class CascadeDecodeBackend(AttentionBackend):
    """Decode attention with shared prefixes read once per group; used only for decode steps that have groups.

    ``use_triton``: the Triton kernels (GPU, or Triton's CPU interpreter), else :func:`cascade_attention_reference`
    (plain PyTorch, what the CPU's ``torch_native`` engine uses). CUDA graphs: with the Triton kernels on a GPU;
    the model runner then captures a second set of decode graphs with this backend (module docstring).

    Tuning attributes (set before the first step): ``piece_len`` / ``max_pieces`` (pass 1), ``max_kv_splits`` /
    ``min_kv_split_len`` (pass 2, as in the ``triton`` backend), ``prefix_programs`` (pass 1's persistent grid).
    """

    name = "cascade"

    def __init__(
        self,
        kv_pool: KVPool,
        req_to_token: ReqToTokenPool,
        *,
        num_q_heads: int,
        page_size: int,
        min_prefix_len: int = 256,
        use_triton: bool = True,
    ) -> None:
        super().__init__(kv_pool, req_to_token)
        self.num_q_heads = num_q_heads
        self.gqa = num_q_heads // self.num_kv_heads
        self.page_size = page_size
        self.min_prefix_len = min_prefix_len
        self.use_triton = use_triton
        self.supports_cuda_graph = use_triton and self.device.type == "cuda"
        on_gpu = self.device.type == "cuda"
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count if on_gpu else 0
        group_rows = 1 << (self.gqa - 1).bit_length()  # a tile holds at least one GQA group
        self.block_m, self.small_block_m = max(PREFIX_BLOCK_M, group_rows), max(16, group_rows)
        self.piece_len, self.max_pieces = PREFIX_PIECE_LEN, MAX_PREFIX_PIECES
        self.max_kv_splits, self.min_kv_split_len = 16, 128
        # Pass 1: enough programs per KV head to give every SM a few; the interpreter runs them one by one.
        self.prefix_programs = max(1, 4 * self.num_sms // self.num_kv_heads) if self.num_sms else 2
        self.step_groups: PrefixGroups | None = None  # the groups of the decode step being launched
        self._cached: tuple[tuple[int, ...], PrefixGroups | None] | None = None
        # Plans by (groups, batch size): the host array and, once uploaded for eager steps, its device copy.
        self._plans: dict[tuple[PrefixGroups | None, int], tuple[np.ndarray, torch.Tensor | None]] = {}
        self._uploaded: tuple[PrefixGroups | None, int] | None = None  # which plan the graph buffer holds
        self.graph: dict[str, torch.Tensor] | None = None
        self.md: dict | None = None

    # ------------------------------------------------------------------------------------ choosing the step

    def forget_groups(self) -> None:
        """Drop the cached grouping: an extend step may give page-table rows new requests and new prefixes."""
        self._cached = None
        self._plans.clear()

    def groups_for(self, rows: Sequence[int], seq_lens: Sequence[int]) -> PrefixGroups | None:
        """The groups of a decode batch over page-table ``rows``. While the rows stay the same (decode after
        decode, no extend step in between) their shared prefixes cannot change, so the last answer is reused."""
        key = tuple(rows)
        if self._cached is None or self._cached[0] != key:
            groups = find_prefix_groups(self.req_to_token.host_np, rows, seq_lens, self.page_size,
                                        self.min_prefix_len)  # fmt: skip
            self._cached = (key, groups)
            self._plans.clear()
        return self._cached[1]

    def attach(self, batch: ForwardBatch, rows: Sequence[int]) -> PrefixGroups | None:
        """Called for every decode batch before it runs: find its groups (kept as :attr:`step_groups`, which the
        step's metadata and a graph replay's plan are made from) and when there are groups, make this backend the
        batch's attention (``batch.attn_backend``)."""
        groups = self.groups_for(rows, batch.seq_lens_cpu)
        self.step_groups = groups
        if groups is not None:
            batch.attn_backend = self
        return groups

    # ----------------------------------------------------------------------------------------------- plans

    def num_kv_splits(self, batch_size: int) -> int:
        """Pass-2 pieces per row at most, a function of the batch size alone (as in the ``triton`` backend)."""
        if self.num_sms == 0:
            return min(self.max_kv_splits, 4)
        want = -(-4 * self.num_sms // (batch_size * self.num_kv_heads))
        return max(1, min(self.max_kv_splits, want))

    def _plan(self, groups: PrefixGroups | None, batch_size: int) -> tuple[np.ndarray, tuple[PrefixGroups | None, int]]:
        key = (groups, batch_size)  # PrefixGroups compare by identity; the key keeps the object alive
        if key not in self._plans:
            host = build_plan(groups, batch_size, self.gqa, block_m=self.block_m, small_block_m=self.small_block_m,
                              piece_len=self.piece_len, max_pieces=self.max_pieces)  # fmt: skip
            self._plans[key] = (host, None)
        return self._plans[key][0], key

    def _device_plan(self, groups: PrefixGroups | None, batch_size: int) -> torch.Tensor:
        """The plan as a device tensor, uploaded once per distinct (groups, batch size) while they last."""
        host, key = self._plan(groups, batch_size)
        dev = self._plans[key][1]
        if dev is None:
            t = torch.from_numpy(host)
            dev = t if self.device.type == "cpu" else t.pin_memory().to(self.device, non_blocking=True)
            self._plans[key] = (host, dev)
        return dev

    def _scratch(self, batch_size: int, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        pieces = self.max_pieces + splits
        shape = (batch_size, self.num_q_heads, pieces)
        mid_o = torch.empty(*shape, self.head_dim, dtype=torch.float32, device=self.device)
        mid_lse = torch.empty(shape, dtype=torch.float32, device=self.device)
        return mid_o, mid_lse

    # ------------------------------------------------------------------------------------------- the step

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        assert batch.mode.is_decode, "cascade attention runs decode steps only"
        groups = self.step_groups
        if not self.use_triton:
            assert batch.req_pool_indices is not None
            table = self.req_to_token.table
            rows = batch.req_pool_indices.tolist()
            slots = [table[r, :n].to(torch.int64) for r, n in zip(rows, batch.seq_lens_cpu)]
            self.md = {"groups": groups, "slots": slots}
            return
        bs = batch.batch_size
        splits = self.num_kv_splits(bs)
        mid_o, mid_lse = self._scratch(bs, splits)
        self.md = {"plan": self._device_plan(groups, bs), "splits": splits, "mid_o": mid_o, "mid_lse": mid_lse,
                   "seq_lens": batch.seq_lens, "rows": batch.req_pool_indices}  # fmt: skip

    def attend_decode(self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        md = self.md
        assert md is not None, "init_forward_metadata was not called for this step"
        lid = layer.layer_id
        # An FP8 cache (chapter 15) is read as its stored numbers, the key scale folded into the softmax scale and
        # the value scale applied to the output, as the engine's Triton backend does (both 1 otherwise).
        k_scale, v_scale = self.kv_pool.scales(lid)
        k_buf, v_buf = self.kv_pool.k[lid], self.kv_pool.v[lid]
        if not self.use_triton:
            if self.kv_pool.quantized:
                k_buf, v_buf = k_buf.to(q.dtype), v_buf.to(q.dtype)
            out = cascade_attention_reference(q, k_buf, v_buf, md["slots"], md["groups"], layer.scale * k_scale)
            return (out if v_scale == 1.0 else out * v_scale).flatten(1)
        from minisgl_ref.perf.cascade_kernels import cascade_decode_fwd

        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        cascade_decode_fwd(
            q if q.stride(-1) == 1 else q.contiguous(), k_buf, v_buf, o,
            self.req_to_token.table, md["rows"], md["seq_lens"], md["plan"], md["mid_o"], md["mid_lse"],
            layer.scale * k_scale, max_prefix_pieces=self.max_pieces, max_splits=md["splits"],
            prefix_programs=self.prefix_programs, min_split_len=self.min_kv_split_len, block_m=self.block_m,
            small_block_m=self.small_block_m,
        )  # fmt: skip
        return (o if v_scale == 1.0 else o.mul_(v_scale)).flatten(1)

    def attend_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        raise RuntimeError("cascade attention runs decode steps only; extend steps use the engine's backend")

    # ---------------------------------------------------------------------------------------- CUDA graphs

    def init_graph_buffers(self, max_bs: int) -> None:
        """One plan buffer big enough for any plan of up to ``max_bs`` rows, and the split scratch viewed per
        batch size (like the ``triton`` backend's)."""
        if not self.supports_cuda_graph:
            raise NotImplementedError("cascade attention captures CUDA graphs with its Triton kernels on a GPU")
        rows = max(bs * (self.max_pieces + self.num_kv_splits(bs)) for bs in range(1, max_bs + 1))
        dev = self.device
        self.graph = {
            "plan": torch.zeros(plan_size(max_bs, max_prefix_work(max_bs, self.max_pieces)), dtype=torch.int32,
                                device=dev),
            "mid_o": torch.empty(rows * self.num_q_heads * self.head_dim, dtype=torch.float32, device=dev),
            "mid_lse": torch.empty(rows * self.num_q_heads, dtype=torch.float32, device=dev),
        }  # fmt: skip

    def prepare_capture(self, batch: ForwardBatch) -> None:
        """Views of the static buffers for this batch size; the captured kernels read whatever plan
        :meth:`prepare_replay` copies in later (at capture: no groups, every row alone)."""
        assert self.graph is not None, "call init_graph_buffers first"
        g, bs, heads = self.graph, batch.batch_size, self.num_q_heads
        splits = self.num_kv_splits(bs)
        pieces = self.max_pieces + splits
        self.md = {
            "plan": g["plan"], "splits": splits, "seq_lens": batch.seq_lens, "rows": batch.req_pool_indices,
            "mid_o": g["mid_o"][: bs * heads * pieces * self.head_dim].view(bs, heads, pieces, self.head_dim),
            "mid_lse": g["mid_lse"][: bs * heads * pieces].view(bs, heads, pieces),
        }  # fmt: skip
        self.step_groups = None
        self.prepare_replay(batch)

    def prepare_replay(self, batch: ForwardBatch) -> None:
        """Copy the plan of this step's groups (:meth:`attach` kept them: the graph runner's padded batch does
        not carry them), laid out for the padded batch size, into the static plan buffer: one host-to-device copy
        from pinned memory, none at all when the buffer already holds it."""
        assert self.graph is not None
        host, key = self._plan(self.step_groups, batch.batch_size)
        if self._uploaded != key:
            self.graph["plan"][: len(host)].copy_(torch.from_numpy(host).pin_memory(), non_blocking=True)
            self._uploaded = key


def make_cascade_backend(
    config: EngineConfig,
    kv_pool: KVPool,
    req_to_token: ReqToTokenPool,
    decode_backend: AttentionBackend,
    *,
    num_q_heads: int,
) -> CascadeDecodeBackend | None:
    """The engine's cascade, or ``None`` when it cannot help: turned off (``--disable-cascade-attention``), or no
    radix cache (nothing is shared). With ``torch_native`` decode it computes in plain PyTorch, with any other
    decode backend through the Triton kernels."""
    if config.disable_cascade_attention or config.disable_radix_cache:
        return None
    decode = decode_backend.phase_backend(decode=True)  # a HybridAttnBackend's decode half
    return CascadeDecodeBackend(kv_pool, req_to_token, num_q_heads=num_q_heads, page_size=config.page_size,
                                min_prefix_len=config.cascade_min_prefix_len,
                                use_triton=decode.name != "torch_native")  # fmt: skip


# ------------------------------------------------------------------------------------------------- planner

#: Sees every decode step's context lengths and groups (None: no groups); ``bench offline`` counts with one.
CascadeObserver = Callable[[Sequence[int], "PrefixGroups | None"], None]


class CascadePlanner(AttentionPlanner):
    """The engine's attention planner with a cascade: decode steps whose rows share a cached prefix run on
    ``cascade``, every other step on the engine's ``backend``. Both are decode backends, so the model runner
    captures decode graphs for each."""

    def __init__(self, backend: AttentionBackend, cascade: CascadeDecodeBackend) -> None:
        super().__init__(backend)
        self.cascade = cascade
        self.observers: list[CascadeObserver] = []

    @property
    def decode_backends(self) -> tuple[AttentionBackend, ...]:
        return (self.backend, self.cascade)

    def plan(self, batch: ScheduledBatch, fb: ForwardBatch) -> None:
        if not batch.is_decode:  # new requests (and their prefixes) enter page-table rows in extend steps only
            self.cascade.forget_groups()
            return
        groups = self.cascade.attach(fb, [row.req.req_pool_idx for row in batch.rows])
        for observe in self.observers:
            observe(fb.seq_lens_cpu, groups)
