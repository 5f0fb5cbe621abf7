"""Attention in plain PyTorch: the oracle every faster backend is checked against (chapters 00 and 07).

Nothing clever happens here on purpose: keys and values are gathered into ordinary tensors, scores are a matmul,
the causal mask is built explicitly and the softmax runs in float32. It is slow and obviously right.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from minisgl_ref.attention.base import AttentionBackend

if TYPE_CHECKING:
    from minisgl_ref.core.forward_batch import ForwardBatch
    from minisgl_ref.layers.attention import AttentionLayer


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one sequence's ``Lq`` newest queries over all its ``Lk`` keys.

    q: [Lq, H, D]; k, v: [Lk, KVH, D] with ``Lk >= Lq``; the queries are the last ``Lq`` positions, so query i may
    see keys ``0 .. Lk - Lq + i`` and no later one (a prefill has ``Lq == Lk``; a decode step ``Lq == 1`` sees every
    key). Grouped-query attention: ``H`` is a multiple of ``KVH`` and query head h reads KV head ``h // (H // KVH)``,
    so consecutive query heads share a KV head. Scores are ``q . k * scale`` (the caller passes
    ``scale = 1 / sqrt(D)``); a key a query may not see gets the score ``-inf`` before the softmax over keys.

    Compute in float32 whatever the input dtype (a bf16 softmax over thousands of keys loses digits) and return
    [Lq, H, D] in q's dtype.
    """
    # BEGIN TASK 0.1: causal attention with grouped-query heads
    lq, num_heads, _ = q.shape
    lk, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)  # [Lk, H, D]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale  # [H, Lq, Lk]
    q_pos = torch.arange(lk - lq, lk, device=q.device).unsqueeze(1)
    k_pos = torch.arange(lk, device=q.device).unsqueeze(0)
    scores.masked_fill_(k_pos > q_pos, float("-inf"))
    probs = scores.softmax(dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs, v.float())
    return out.to(q.dtype)
    # END TASK 0.1


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     visible: torch.Tensor) -> torch.Tensor:
    """:func:`reference_attention` with the visibility spelled out instead of causal: ``visible`` is ``[Lq, Lk]``
    bool, True where query i may see key j (each query must see at least one key). A row whose new tokens form a
    draft tree (``ForwardBatch.extend_masks``) sees its whole prefix and, among its new tokens, its ancestors."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    scores.masked_fill_(~visible.to(scores.device), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v.float())
    return out.to(q.dtype)


def extend_visibility(prefix_len: int, mask: torch.Tensor) -> torch.Tensor:
    """``[E, prefix + E]`` bool: a row's whole visibility, from its mask over its ``E`` new tokens (the prefix is
    visible to all of them)."""
    prefix = torch.ones(mask.shape[0], prefix_len, dtype=torch.bool, device=mask.device)
    return torch.cat([prefix, mask], dim=1)


class NoCacheAttentionBackend(AttentionBackend):
    """The chapter-00 backend: no KV cache. Every step feeds each request's *whole* sequence, so a sequence's
    keys and values are exactly the k and v of this forward pass: nothing is stored, and there is no decode."""

    def __init__(self) -> None:  # no pool and no page table to hold
        pass

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch, *,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        if batch.mode.is_decode or any(batch.prefix_lens_cpu):
            raise ValueError("NoCacheAttentionBackend stores no KV: every step must feed whole sequences")
        if batch.has_custom_mask:
            raise ValueError("NoCacheAttentionBackend takes no custom attention mask (extend_masks)")
        outs = []
        start = 0
        for length in batch.extend_lens_cpu:
            end = start + length
            outs.append(reference_attention(q[start:end], k[start:end], v[start:end], layer.scale))
            start = end
        return torch.cat(outs).flatten(1)


class TorchNativeBackend(AttentionBackend):
    """The paged oracle (chapter 03): the base class stores the new K/V at ``out_cache_loc``; each request then
    gathers its whole context through its page-table row and runs :func:`reference_attention`. One loop iteration
    per request: slow, simple, and the reference for the Triton/FlashInfer/FA3 backends of chapter 07.

    No CUDA graphs: the per-request Python loop and the host-side lengths it slices with cannot be recorded into a
    graph, so the engine runs decode eagerly with this backend.

    Custom masks (``ForwardBatch.extend_masks``): a masked row spells out its visibility, prefix then mask
    (:func:`extend_visibility`, built once per step), and runs :func:`masked_attention`."""

    name = "torch_native"
    supports_custom_mask = True
    reads_quantized_kv = True  # through KVPool.gather (chapter 15)
    row_visibility: list[torch.Tensor | None] | None = None  # this step's masked rows' [E, L] visibility

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        # Computed once per step, used by every layer: where each request's context lives in the pool.
        assert batch.req_pool_indices is not None
        rows = batch.req_pool_indices.tolist()
        table = self.req_to_token.table
        self.context_slots = [table[r, :n].to(torch.int64) for r, n in zip(rows, batch.seq_lens_cpu)]
        self.row_visibility = None
        if batch.has_custom_mask:
            batch.check_extend_masks()
            assert batch.extend_masks is not None
            self.row_visibility = [None if m is None else extend_visibility(p, m.to(self.device))
                                   for m, p in zip(batch.extend_masks, batch.prefix_lens_cpu)]

    def attend_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        masks = self.row_visibility if not batch.mode.is_decode else None
        outs, start = [], 0
        for b, (slots, length) in enumerate(zip(self.context_slots, batch.extend_lens_cpu)):
            end = start + length
            k_ctx, v_ctx = self.kv_pool.gather(layer.layer_id, slots)  # values, whatever the pool stores them as
            if masks is not None and masks[b] is not None:
                outs.append(masked_attention(q[start:end], k_ctx, v_ctx, layer.scale, masks[b]))
            else:
                outs.append(reference_attention(q[start:end], k_ctx, v_ctx, layer.scale))
            start = end
        return torch.cat(outs).flatten(1)

    def attend_decode(self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        return self.attend_extend(q, None, None, layer, batch)  # type: ignore[arg-type]  # one token per request


class TorchStaticBackend(TorchNativeBackend):
    """``torch_native`` with the three CUDA-graph hooks: the smallest backend a graph can replay (chapter 08).

    Extend steps are ``torch_native``'s, except under the extend-step graphs of chapter 11
    (``minisgl_ref/engine/extend_graph.py``), whose rows and lengths come from static buffers. Decode reads
    only two small device tensors, each request's page-table
    row and its length, and attends over the whole row at once with a length mask: no Python loop over the
    requests and no host-side length, so every shape depends on the batch size alone. Under graphs those two
    tensors are views of buffers allocated once (:meth:`init_graph_buffers`), pointed at before capture and
    refilled in place before each replay: the pattern of the Triton and FlashInfer backends, in a few lines.

    It gathers ``[B, max context, heads, head_dim]`` per layer, which is fine for tests and for showing the graph
    runner on a CPU (with stand-in graphs, :class:`~minisgl_ref.engine.cuda_graph.RerunGraphFactory`), not for
    serving: it is not one of the engine's ``--attention-backend`` choices."""

    name = "torch_static"
    supports_cuda_graph = True
    supports_extend_graph = True  # the extend-step graphs of chapter 11 (engine/extend_graph.py), on stand-ins
    extend_graph = False  # True between an extend-graph hook and the next eager step's metadata

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.extend_graph = False
        if not batch.mode.is_decode:
            return super().init_forward_metadata(batch)
        assert batch.req_pool_indices is not None
        self.decode_rows = batch.req_pool_indices
        self.decode_lens = torch.tensor(batch.seq_lens_cpu, dtype=torch.int32, device=self.device)

    def attend_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        if self.extend_graph:
            # A replayed extend step: the batch's host lists are those of capture time; the real lengths and rows
            # are in the static buffers (read on the host here, which only a stand-in graph allows).
            rows = batch.batch_size  # the graph's row count (its host lists are capture-time, but as long)
            prefix, extend = self.extend_lens[: 2 * rows].view(2, rows).tolist()
            table = self.req_to_token.table
            self.context_slots = [table[r, : p + e].to(torch.int64)
                                  for r, p, e in zip(self.extend_rows[:rows].tolist(), prefix, extend)]
            batch = dataclasses.replace(batch, extend_lens_cpu=extend, prefix_lens_cpu=prefix)
            self.row_visibility = None  # a graph replays causal rows only (masked steps run eagerly)
        return super().attend_extend(q, k, v, layer, batch)

    def init_extend_graph_buffers(self, max_rows: int) -> None:
        self.extend_lens = torch.zeros(2 * max_rows, dtype=torch.int64, device=self.device)  # prefix, extend lens
        self.extend_rows = torch.zeros(max_rows, dtype=torch.int64, device=self.device)

    def prepare_extend_capture(self, rows: int, tokens: int) -> None:
        self.extend_graph = True
        self.extend_lens.copy_(torch.tensor([0] * rows + [tokens] + [0] * (len(self.extend_lens) - rows - 1)))
        self.extend_rows.zero_()

    def prepare_extend_replay(self, rows: torch.Tensor, prefix_lens: list[int], extend_lens: list[int]) -> None:
        self.extend_graph = True
        self.extend_lens[: 2 * len(prefix_lens)].copy_(torch.tensor(prefix_lens + extend_lens))
        self.extend_rows.zero_()
        self.extend_rows[: rows.shape[0]].copy_(rows)

    def attend_decode(self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        slots = self.req_to_token.table[self.decode_rows].to(torch.int64)  # [B, W]: whole rows
        visible = torch.arange(slots.shape[1], device=q.device) < self.decode_lens[:, None]  # [B, W]
        k_ctx, v_ctx = self.kv_pool.gather(layer.layer_id, slots)  # [B, W, kv_heads, D]
        group = q.shape[1] // k_ctx.shape[2]
        k = k_ctx.repeat_interleave(group, dim=2).float()  # [B, W, H, D]
        v = v_ctx.repeat_interleave(group, dim=2).float()
        scores = torch.einsum("bhd,bwhd->bhw", q.float(), k) * layer.scale
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        out = torch.einsum("bhw,bwhd->bhd", scores.softmax(dim=-1), v)
        return out.to(q.dtype).flatten(1)

    def init_graph_buffers(self, max_bs: int) -> None:
        self.graph_rows = torch.zeros(max_bs, dtype=torch.int64, device=self.device)
        self.graph_lens = torch.ones(max_bs, dtype=torch.int32, device=self.device)

    def prepare_capture(self, batch: ForwardBatch) -> None:
        self.prepare_replay(batch)

    def prepare_replay(self, batch: ForwardBatch) -> None:
        """Refill the static metadata in place. Pointing the decode at the views again costs nothing and keeps a
        stand-in graph, which re-runs this Python, reading the buffers a recorded graph reads."""
        assert batch.req_pool_indices is not None and batch.seq_lens is not None
        bs = batch.batch_size
        self.decode_rows, self.decode_lens = self.graph_rows[:bs], self.graph_lens[:bs]
        self.decode_rows.copy_(batch.req_pool_indices)
        self.decode_lens.copy_(batch.seq_lens)
