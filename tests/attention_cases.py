"""One attention call laid out as the engine lays it out, for the attention backend tests (chapter 07) and the
tree-mask tests (chapter 13): :class:`Case` and :func:`make_case`."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from minisgl_ref.core.forward_batch import ForwardBatch, ForwardMode
from minisgl_ref.kvcache.allocator import PageAllocator
from minisgl_ref.kvcache.pool import KVPool
from minisgl_ref.kvcache.req_to_token import ReqToTokenPool
from minisgl_ref.layers.attention import AttentionLayer


@dataclass
class Case:
    """One attention call laid out exactly as the engine lays it out: pages from a PageAllocator (handed out in
    shuffled order, so a request's pages are scattered over the pool), slots in a ReqToTokenPool row per request,
    the new tokens' slots in ``out_cache_loc``. The pool starts full of random values, so reading a wrong slot
    shows up as a wrong result. ``rows``: what the caller built the rows from, if it needs it back (the tree
    tests' ``(prefix length, draft tree or row length)`` pairs)."""

    batch: ForwardBatch
    pool: KVPool
    table: ReqToTokenPool
    layer: AttentionLayer
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    rows: list[Any] = field(default_factory=list)


def make_case(specs: Sequence[tuple[int, int]], *, num_kv_heads: int, gqa: int, head_dim: int, page_size: int,
              dtype: torch.dtype = torch.float32, decode: bool = False, seed: int = 0, device: str = "cpu",
              positions: list[int] | None = None, masks: list[torch.Tensor | None] | None = None) -> Case:
    """A :class:`Case` for ``specs``, ``(prefix_len, extend_len)`` per request (decode: extend_len 1). The
    positions are ``prefix + i`` unless given (a tree row's are ``prefix + depth``); ``masks`` are the rows'
    ``extend_masks`` (None for a causal row)."""
    rng = random.Random(seed)
    gen = torch.Generator(device).manual_seed(seed)  # random values made on the device (GPU pools are large)
    num_heads = num_kv_heads * gqa
    total = sum(p + e for p, e in specs)
    num_pages = total // page_size + 2 * len(specs) + 2
    allocator = PageAllocator(num_pages, page_size, device)
    rng.shuffle(allocator._free)  # scatter: consecutive allocations get non-adjacent pages
    max_ctx = max(p + e for p, e in specs) + 1
    table = ReqToTokenPool(2 * len(specs) + 1, max_ctx, device)
    pool = KVPool(1, num_pages * page_size, num_kv_heads, head_dim, dtype, device)
    pool.k[0].normal_(generator=gen)
    pool.v[0].normal_(generator=gen)
    rows = rng.sample(range(table.max_requests), len(specs))  # page-table rows in no particular order
    new_slots = []
    for row, (prefix, extend) in zip(rows, specs):
        # Prefix then new tokens, each through alloc_tokens: the new tokens first fill the prefix's last page.
        pre = allocator.alloc_tokens(0, 0, prefix)
        table.write(row, 0, pre)
        new = allocator.alloc_tokens(prefix, int(pre[-1]) if prefix else 0, extend)
        table.write(row, prefix, new)
        new_slots.append(new)
    num_tokens = sum(e for _, e in specs)
    q = 2 * torch.randn(num_tokens, num_heads, head_dim, generator=gen, device=device, dtype=dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
    if positions is None:
        positions = [p + i for p, e in specs for i in range(e)]
    batch = ForwardBatch(
        mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        extend_lens_cpu=[e for _, e in specs],
        prefix_lens_cpu=[p for p, _ in specs],
        attn_backend=None,  # type: ignore[arg-type]
        req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=device),
        out_cache_loc=torch.cat(new_slots).to(device),
        extend_masks=masks if masks is not None and any(m is not None for m in masks) else None,
    )
    return Case(batch, pool, table, AttentionLayer(0, num_heads, num_kv_heads, head_dim), q, k, v)


__all__ = ["Case", "make_case"]
