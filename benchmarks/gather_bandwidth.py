"""How fast can a decode step's KV cache be read, and does the size of each piece matter? (chapter 11)

With one-token pages a request's cached keys sit in slots scattered over the pool: its prompt in one run of slots,
but every generated token wherever the allocator put it (a decode step hands out a run of slots to the whole batch,
so one request's tokens end up a batch apart). A token's keys for all KV heads are one contiguous row (8 heads x
128 values x 2 bytes = 2 KiB for Qwen3-0.6B); a kernel that gives each head its own program reads 256-byte pieces
of those rows, one that takes all heads at once reads whole rows. This benchmark reads the same slots in both ways,
plus a plain stream over contiguous memory, and reports the bandwidth of each, for slot orders that run from
contiguous to the canonical workload's to random. Writes JSON:

    python -m benchmarks.gather_bandwidth --output gather_bandwidth.json
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
from pathlib import Path

import torch

from benchmarks.decode_matmuls import time_graph

KV_HEADS, HEAD_DIM = 8, 128  # Qwen3-0.6B


@functools.cache
def _kernels():  # type: ignore[no-untyped-def]
    import triton
    import triton.language as tl

    @triton.jit
    def read_rows(kv, slots, out, n, ROW: tl.constexpr, PIECE: tl.constexpr, BLOCK_T: tl.constexpr,
                  PIECES_FIRST: tl.constexpr = False):
        """Program (t, p): tokens t*BLOCK_T.., piece p of each token's row (PIECE values at offset p*PIECE). With
        PIECES_FIRST the grid is (p, t): the pieces of one block of tokens are neighbours in launch order."""
        block, piece = (tl.program_id(1), tl.program_id(0)) if PIECES_FIRST else (tl.program_id(0), tl.program_id(1))
        rt = block * BLOCK_T + tl.arange(0, BLOCK_T)
        s = tl.load(slots + rt, mask=rt < n, other=0).to(tl.int64)
        x = tl.load(kv + s[:, None] * ROW + piece * PIECE + tl.arange(0, PIECE)[None, :], mask=(rt < n)[:, None],
                    other=0.0)
        tl.store(out + block * (ROW // PIECE) + piece, tl.sum(tl.sum(x.to(tl.float32), 1), 0))

    @triton.jit
    def read_head_major(kv, slots, out, n, pool, DIM: tl.constexpr, BLOCK_T: tl.constexpr):
        """Program (h, t): KV head h's keys of tokens t*BLOCK_T.., in a pool laid out head by head."""
        head = tl.program_id(0)
        rt = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        s = tl.load(slots + rt, mask=rt < n, other=0).to(tl.int64)
        x = tl.load(kv + head * pool * DIM + s[:, None] * DIM + tl.arange(0, DIM)[None, :], mask=(rt < n)[:, None],
                    other=0.0)
        tl.store(out + tl.program_id(1) * tl.num_programs(0) + head, tl.sum(tl.sum(x.to(tl.float32), 1), 0))

    return read_rows, read_head_major


def read(kv: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, piece: int, block_t: int,
         pieces_first: bool = False) -> None:
    row = kv.shape[1]
    n = slots.numel()
    grid = (row // piece, triton_cdiv(n, block_t)) if pieces_first else (triton_cdiv(n, block_t), row // piece)
    _kernels()[0][grid](kv, slots, out, n, ROW=row, PIECE=piece, BLOCK_T=block_t, PIECES_FIRST=pieces_first,
                        num_warps=4)


def read_head_major(kv: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, block_t: int) -> None:
    """The same keys from a pool laid out ``[KV heads, slots, 128]``: one head's tokens lie 256 bytes apart, so
    a prompt's keys of one head are one contiguous run (as in pages laid out head by head)."""
    heads, pool, dim = kv.shape
    n = slots.numel()
    grid = (heads, triton_cdiv(n, block_t))  # the heads of one block of tokens are neighbours in the grid
    _kernels()[1][grid](kv, slots, out, n, pool, DIM=dim, BLOCK_T=block_t, num_warps=4)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def slot_orders(pool: int, lens: list[int], prefill: list[int], rng: random.Random) -> dict[str, list[int]]:
    """Slots of the batch's contexts, one request after another, under three allocations."""
    total = sum(lens)
    contiguous = list(range(total))
    # The canonical pattern: each prompt in one run, then the generated tokens handed out a batch at a time.
    canonical, nxt = [], 0
    prompt_start = []
    for p in prefill:
        prompt_start.append(nxt)
        nxt += p
    gen = [ln - p for ln, p in zip(lens, prefill)]
    gen_slots: list[list[int]] = [[] for _ in lens]
    step = 0
    while any(len(g) < want for g, want in zip(gen_slots, gen)):
        for i, want in enumerate(gen):
            if len(gen_slots[i]) < want:
                gen_slots[i].append(nxt)
                nxt += 1
        step += 1
    for i, p in enumerate(prefill):
        canonical += list(range(prompt_start[i], prompt_start[i] + p)) + gen_slots[i]
    shuffled = rng.sample(range(pool), total)
    return {"contiguous": contiguous, "canonical": canonical, "random": shuffled}


def best_ms(fn) -> float:  # type: ignore[no-untyped-def]
    """The best of three timings of a CUDA graph of ``fn`` (milliseconds per replay)."""
    return min(time_graph(fn, repeats=30) for _ in range(3))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--layers", type=int, default=1,
                   help="read this many separate pools, one after another, per timed replay (a decode step reads "
                        "every layer's cache once: with one pool, replays reread what the L2 cache kept)")
    p.add_argument("--head-major", action="store_true",
                   help="also read the keys from pools laid out [KV heads, slots, 128] (one head's tokens together)")
    args = p.parse_args()
    from minisgl_ref.bench.provenance import collect_provenance

    rng = random.Random(0)
    lens = [rng.randint(100, 1024) + rng.randint(0, 400) for _ in range(args.requests)]  # mid-workload contexts
    prefill = [min(ln, rng.randint(100, 1024)) for ln in lens]
    total = sum(lens)
    pool = (4 if args.layers == 1 else 2) * total
    dev = torch.device("cuda")
    row = KV_HEADS * HEAD_DIM
    kvs = [torch.randn(pool, row, device=dev, dtype=torch.bfloat16) for _ in range(args.layers)]
    hms = [kv.view(pool, KV_HEADS, HEAD_DIM).transpose(0, 1).contiguous() for kv in kvs] if args.head_major else []
    results = []
    stream_bytes = total * row * 2 * args.layers
    flats = [kv[:total] for kv in kvs]
    results.append({"order": "contiguous", "how": "torch.sum over the rows (a plain stream)",
                    "ms": round(best_ms(lambda: [flat.sum(dtype=torch.float32) for flat in flats]), 4)})
    for order, slots_list in slot_orders(pool, lens, prefill, rng).items():
        slots = torch.tensor(slots_list, dtype=torch.int32, device=dev)
        for piece, block_t in ((HEAD_DIM, 64), (HEAD_DIM, 128), (2 * HEAD_DIM, 64), (row, 16), (row, 32)):
            out = torch.empty(triton_cdiv(total, block_t) * (row // piece), device=dev, dtype=torch.float32)
            ms = best_ms(lambda: [read(kv, slots, out, piece, block_t) for kv in kvs])  # noqa: B023 - timed here
            results.append({"order": order, "piece_bytes": piece * 2, "block_tokens": block_t, "ms": round(ms, 4)})
        if args.head_major:
            out = torch.empty(triton_cdiv(total, 64) * KV_HEADS, device=dev, dtype=torch.float32)
            ms = best_ms(lambda: [read(kv, slots, out, HEAD_DIM, 64, pieces_first=True) for kv in kvs])  # noqa: B023
            results.append({"order": order, "layout": "pieces of a block of tokens launched together",
                            "piece_bytes": HEAD_DIM * 2, "block_tokens": 64, "ms": round(ms, 4)})
            for block_t in (32, 64, 128):
                out = torch.empty(triton_cdiv(total, block_t) * KV_HEADS, device=dev, dtype=torch.float32)
                ms = best_ms(lambda: [read_head_major(kv, slots, out, block_t) for kv in hms])  # noqa: B023
                results.append({"order": order, "layout": "head-major", "piece_bytes": HEAD_DIM * 2,
                                "block_tokens": block_t, "ms": round(ms, 4)})
    for r in results:
        r["tb_per_s"] = round(stream_bytes / (r["ms"] * 1e-3) / 1e12, 3)
        print(json.dumps(r), flush=True)
    doc = {"what": __doc__.split("\n\n")[0], "tokens": total, "layers": args.layers, "bytes_read": stream_bytes,
           "results": results, "provenance": collect_provenance(sys.argv)}
    Path(args.output).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
