"""The engine's split-KV CUDA decode kernel (``minisgl_ref/perf/cuda/split_decode.cu``) under other plans, for
``benchmarks.decode_balance`` (chapter 11).

Every context is cut into pieces; each (piece, KV head) is one thread block of a grid several waves long, so the
GPU balances the pieces over the SMs by itself, and the last piece of a context to finish merges the partial
results. :func:`plan` cuts pieces of at most ``chunk`` tokens, or (``fixed``) as the engine does, a fixed number
of pieces per request; :func:`runner` returns a call over a :class:`benchmarks.decode_balance.Stage`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def plan(lens: list[int], chunk: int, device: str = "cuda", longest_first: bool = False, even: bool = False,
         fixed: float | None = None, split_above: float | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """The pieces of contexts of ``lens`` tokens (their slots laid out one request after another in the index
    array): ``items`` holds (request, first index, end index, partial-result row) per piece, longest pieces first
    with ``longest_first`` (the GPU starts blocks in grid order, so the last wave is made of the shortest), and
    each request's piece count and first partial-result row. With ``even`` a context is cut into as many pieces
    as ``chunk`` asks for, all of about the same length, instead of full pieces and a remainder. With ``fixed``
    (>= 0) ``chunk`` is ignored: there are always ``len(lens) * (1 + fixed)`` pieces, as a captured graph's fixed
    grid needs: a piece per context, then the longest piece cut in two until the count is reached, or with
    ``split_above`` as long as it is longer than that many times the mean context (the engine's rule)."""
    if fixed is not None:
        return _fixed_plan(lens, fixed, device, split_above)
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    items, parts, first = [], [], []
    pos = 0
    for r, n in enumerate(lens):
        first.append(len(items))
        count = -(-n // chunk)
        cuts = [n * i // count for i in range(count + 1)] if even else [*range(0, n, chunk), n]
        parts.append(count)
        for a, b in zip(cuts, cuts[1:]):
            items.append((r, pos + a, pos + b, len(items)))
        pos += n
    if longest_first:
        items.sort(key=lambda it: it[1] - it[2])  # stable: equal lengths stay in request order

    def t(x: list[Any]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int32, device=device)

    return {"items": t(items), "req_parts": t(parts), "req_first_item": t(first)}


def _fixed_plan(lens: list[int], fixed: float, device: str,
                split_above: float | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    from minisgl_ref.perf.split_decode import plan_pieces

    items, parts, first = plan_pieces(lens, int(len(lens) * (1 + fixed)), split_above)
    return {"items": torch.from_numpy(items).to(device), "req_parts": torch.from_numpy(parts).to(device),
            "req_first_item": torch.from_numpy(first).to(device)}  # fmt: skip


def runner(st: Any, chunk: int = 512, unroll: int = 4, threads: int = 128, longest_first: bool = False,
           even: bool = False, fixed: float | None = None, split_above: float | None = None,
           min_blocks: int = 1) -> tuple[Callable[[], torch.Tensor], list[int]]:  # fmt: skip
    """The kernel over a decode_balance stage: pieces of at most ``chunk`` tokens, blocks of ``threads``,
    ``unroll`` rows per half-warp in each of two buffers (the other options: see :func:`plan`). The kernel module
    is the engine's, compiled for 4 rows and 128 threads (one or, for 1-2 query heads per KV head, four blocks an
    SM); the builds with other rows, block sizes and streaming loads that chapter 11 compares were removed after
    their measurements (commit e598280 has them)."""
    from minisgl_ref.perf.split_decode import load_kernel

    mod = load_kernel()
    b = len(st.lens)
    p = plan(st.lens, chunk, device=str(st.q.device), longest_first=longest_first, even=even, fixed=fixed,
             split_above=split_above)
    items = p["items"].shape[0]
    heads, dim = st.q.shape[1], st.q.shape[2]
    part_o = torch.empty(items, heads, dim, dtype=torch.float32, device=st.q.device)
    part_lse = torch.empty(items, heads, dtype=torch.float32, device=st.q.device)
    counters = torch.zeros(b, st.k.shape[1], dtype=torch.int32, device=st.q.device)
    indices = st.slots(list(range(b)))
    out = torch.empty_like(st.q)

    def call() -> torch.Tensor:
        mod.split_decode(st.q, st.k, st.v, indices, p["items"], p["req_parts"], p["req_first_item"], part_o, part_lse,
                         counters, out, dim**-0.5, unroll, threads, min_blocks)  # fmt: skip
        return out

    return call, list(range(b))
