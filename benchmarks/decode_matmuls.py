"""The matrix multiplies of a decode step, alone, by BLAS library (chapter 11).

A decode step of Qwen3-0.6B reads its 1.2 GB of weights in 28 x 4 matrix multiplies plus the LM head, with as
many rows as requests are running. At a few rows they are pure weight reads, and the question is how close to
the memory bandwidth each library's kernels get. This benchmark builds the 28 layers' projection weights (bf16,
distinct tensors, so nothing stays in L2), chains one step's multiplies in a CUDA graph for each row count, and
times replays with cuBLAS and with cuBLASLt (``torch.backends.cuda.preferred_blas_library``), and, at up to 64
rows, with a plain Triton kernel that streams the weights (``weight_stream``, the best of a few tile shapes per
matrix, picked by timing; checked against cuBLAS). Writes JSON:

    python -m benchmarks.decode_matmuls --output decode_matmuls.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HIDDEN, Q, KV, FFN, LAYERS, VOCAB = 1024, 2048, 1024, 3072, 28, 151_936  # Qwen3-0.6B
ROWS = (1, 8, 16, 32, 64, 128, 256)
TRITON_ROWS = (1, 16, 64)
TILES = [(bn, bk, st) for bn in (16, 32, 64) for bk in (128, 256) for st in (3, 5)]  # BLOCK_N, BLOCK_K, stages


def _kernel():  # type: ignore[no-untyped-def]
    import triton
    import triton.language as tl

    @triton.jit
    def weight_stream(x, w, out, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[M, N] = x[M, K] @ w[N, K]^T, one program per BLOCK_N output columns, the whole K in a loop."""
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x + rm[:, None] * K + rk[None, :], mask=rm[:, None] < M, other=0.0)
            b = tl.load(w + rn[:, None] * K + rk[None, :])
            acc += tl.dot(a, tl.trans(b))
        tl.store(out + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=rm[:, None] < M)

    return weight_stream


def triton_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tile: tuple[int, int, int]) -> None:
    bn, bk, stages = tile
    rows, k = x.shape
    block_m = max(16, 1 << (rows - 1).bit_length())
    _kernel()[(w.shape[0] // bn,)](x, w, out, rows, w.shape[0], k, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk,
                                   num_warps=4, num_stages=stages)


def best_tiles(rows: int, layers: list[list[torch.Tensor]], head: torch.Tensor) -> tuple[dict, float]:
    """Per weight shape, the fastest tile (timed alone), and the worst relative error against cuBLAS."""
    import triton.runtime.errors
    import triton.testing

    picks, worst = {}, 0.0
    for w in [*layers[0], head]:
        x = torch.randn(rows, w.shape[1], device=w.device, dtype=torch.bfloat16)
        out = torch.empty(rows, w.shape[0], device=w.device, dtype=torch.bfloat16)
        timed = {}
        for tile in TILES:
            if w.shape[0] % tile[0] or w.shape[1] % tile[1]:
                continue
            try:
                timed[tile] = triton.testing.do_bench(lambda: triton_linear(x, w, out, tile), warmup=5, rep=20)
            except triton.runtime.errors.OutOfResources:  # too large a tile for shared memory at these rows
                continue
        tile = min(timed, key=timed.get)
        triton_linear(x, w, out, tile)
        ref = torch.nn.functional.linear(x, w).float()
        worst = max(worst, ((out.float() - ref).norm() / ref.norm()).item())
        picks[tuple(w.shape)] = tile
    return picks, worst


def weights(device: torch.device) -> list[list[torch.Tensor]]:
    """Per layer: qkv [Q + 2 KV, H], o [H, Q], gate_up [2 FFN, H], down [H, FFN], as nn.Linear stores them."""
    shapes = [(Q + 2 * KV, HIDDEN), (HIDDEN, Q), (2 * FFN, HIDDEN), (HIDDEN, FFN)]
    return [[torch.randn(s, device=device, dtype=torch.bfloat16) * 0.02 for s in shapes] for _ in range(LAYERS)]


def parse_args(doc: str) -> argparse.Namespace:
    """``--output`` (the JSON file) and ``--bandwidth`` (bytes/s for the floor), shared by the matmul benchmarks."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--output", required=True)
    p.add_argument("--bandwidth", type=float, default=3.0e12)
    return p.parse_args()


def step_weights(device: torch.device) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    """Every layer's projection weights and the LM head, distinct tensors as in the model."""
    return weights(device), torch.randn(VOCAB, HIDDEN, device=device, dtype=torch.bfloat16) * 0.02


def step(xs: dict[int, torch.Tensor], layers: list[list[torch.Tensor]], head: torch.Tensor) -> None:
    """One step's multiplies in order, each fed a fixed input of its width (the kernels run one after another on
    the stream whatever the data, and the engine's inputs are contiguous too)."""
    for qkv, o, gate_up, down in layers:
        for w in (qkv, o, gate_up, down):
            torch.nn.functional.linear(xs[w.shape[1]], w)
    torch.nn.functional.linear(xs[HIDDEN], head)


def time_graph(fn, repeats: int = 50) -> float:  # type: ignore[no-untyped-def]
    """Milliseconds per replay of a CUDA graph of ``fn``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> int:
    args = parse_args(__doc__)
    from minisgl_ref.bench.provenance import collect_provenance

    dev = torch.device("cuda")
    layers, head = step_weights(dev)
    total_bytes = sum(w.numel() for ws in layers for w in ws) * 2 + head.numel() * 2
    floor_ms = total_bytes / args.bandwidth * 1e3
    rows_out = []
    for rows in ROWS:
        xs = {k: torch.randn(rows, k, device=dev, dtype=torch.bfloat16) for k in (HIDDEN, Q, FFN)}
        row: dict = {"rows": rows}
        for lib in ("cublas", "cublaslt", "cublas", "cublaslt"):  # twice each, interleaved
            torch.backends.cuda.preferred_blas_library(lib)
            ms = time_graph(lambda: step(xs, layers, head))
            row.setdefault(lib, []).append(round(ms, 4))
        torch.backends.cuda.preferred_blas_library("cublas")
        if rows in TRITON_ROWS:
            picks, err = best_tiles(rows, layers, head)
            outs = {k: torch.empty(rows, k, device=dev, dtype=torch.bfloat16) for k in (Q + 2 * KV, HIDDEN, 2 * FFN)}
            outs[VOCAB] = torch.empty(rows, VOCAB, device=dev, dtype=torch.bfloat16)

            def triton_step() -> None:
                for ws in layers:
                    for w in ws:
                        triton_linear(xs[w.shape[1]], w, outs[w.shape[0]], picks[tuple(w.shape)])
                triton_linear(xs[HIDDEN], head, outs[VOCAB], picks[tuple(head.shape)])

            row["triton"] = [round(time_graph(triton_step), 4) for _ in range(2)]
            row["triton_tiles"] = {f"{n}x{k}": list(t) for (n, k), t in picks.items()}
            row["triton_rel_error"] = round(err, 5)
        best = {lib: min(row[lib]) for lib in ("cublas", "cublaslt", "triton") if lib in row}
        row["tb_per_s"] = {lib: round(total_bytes / (ms * 1e-3) / 1e12, 2) for lib, ms in best.items()}
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    doc = {"what": __doc__.split("\n\n")[0], "weight_bytes": total_bytes, "floor_ms_at_bandwidth": round(floor_ms, 4),
           "bandwidth": args.bandwidth, "results": rows_out, "provenance": collect_provenance(sys.argv)}
    Path(args.output).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"weights {total_bytes / 1e9:.2f} GB, floor {floor_ms:.3f} ms at {args.bandwidth / 1e12:.1f} TB/s")
    for r in rows_out:
        tri = f", Triton {min(r['triton']):.3f} ms ({r['tb_per_s']['triton']} TB/s)" if "triton" in r else ""
        print(f"{r['rows']:>4} rows: cuBLAS {min(r['cublas']):.3f} ms ({r['tb_per_s']['cublas']} TB/s), "
              f"cuBLASLt {min(r['cublaslt']):.3f} ms ({r['tb_per_s']['cublaslt']} TB/s){tri}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
