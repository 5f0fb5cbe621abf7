"""A decode step's matrix multiplies: cuBLAS against a split-K Triton kernel with and without programmatic
dependent launch (chapter 11).

For each row count: per weight shape of Qwen3-0.6B's layers, the best split-K configuration (timed as a CUDA graph
of the 28 layers' multiplies of that shape, distinct weights so that nothing stays in L2) and cuBLAS on the same
chain; then one step's 112 layer multiplies (the LM head by cuBLAS in every variant) as a CUDA graph: cuBLAS,
split-K, split-K launched with programmatic dependent launch (PDL), and PDL with the weights prefetched into L2
before the wait. A last pair puts a small eager-style elementwise kernel between the multiplies (as norms and
activations sit in a real layer) to see what PDL keeps when its neighbours do not take part. Writes JSON:

    python -m benchmarks.decode_matmuls_pdl --output decode_matmuls_pdl.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from benchmarks.decode_matmuls import FFN, HIDDEN, KV, Q, parse_args, step_weights, time_graph
from benchmarks.skinny_gemm import Workspace, skinny_linear

ROWS = (1, 16, 64, 128, 256)
CONFIGS = [(bn, 128, split, 4) for bn in (32, 64, 128) for split in (1, 2, 4, 8)]


def tune(rows: int, ws_list: list[torch.Tensor], x: torch.Tensor, out: torch.Tensor, ws: Workspace) -> dict:
    """Time each configuration on the chain of this shape's 28 weights; return the table and the pick."""
    import triton.runtime.errors

    timed = {}
    for cfg in CONFIGS:
        try:
            skinny_linear(x, ws_list[0], out, ws, cfg)
        except (ValueError, triton.runtime.errors.OutOfResources):
            continue
        timed[cfg] = time_graph(lambda: [skinny_linear(x, w, out, ws, cfg) for w in ws_list], repeats=20)
    cublas = time_graph(lambda: [torch.nn.functional.linear(x, w) for w in ws_list], repeats=20)
    best = min(timed, key=timed.get)
    ref = torch.nn.functional.linear(x, ws_list[0]).float()
    skinny_linear(x, ws_list[0], out, ws, best)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    return {"best": list(best), "best_ms": round(timed[best], 4), "cublas_ms": round(cublas, 4),
            "rel_error": round(err, 6), "all_ms": {"x".join(map(str, c)): round(t, 4) for c, t in timed.items()}}


def main() -> int:
    args = parse_args(__doc__)
    from minisgl_ref.bench.provenance import collect_provenance

    dev = torch.device("cuda")
    layers, head = step_weights(dev)
    layer_bytes = sum(w.numel() for ws in layers for w in ws) * 2
    ws = Workspace(dev, floats=1 << 24, tiles=1 << 14)
    results = []
    for rows in ROWS:
        xs = {k: torch.randn(rows, k, device=dev, dtype=torch.bfloat16) for k in (HIDDEN, Q, FFN)}
        outs = {n: torch.empty(rows, n, device=dev, dtype=torch.bfloat16) for n in (Q + 2 * KV, HIDDEN, 2 * FFN)}
        row: dict = {"rows": rows, "shapes": {}}
        picks = {}
        for i in range(4):
            chain = [ws_[i] for ws_ in layers]
            n, k = chain[0].shape
            t = tune(rows, chain, xs[k], outs[n], ws)
            row["shapes"][f"{n}x{k}"] = t
            picks[(n, k)] = tuple(t["best"])

        def cublas_step(between: bool = False) -> None:
            for ws_ in layers:
                for w in ws_:
                    y = torch.nn.functional.linear(xs[w.shape[1]], w)
                    if between:
                        y.mul_(1.0)
            torch.nn.functional.linear(xs[HIDDEN], head)

        def skinny_step(pdl: bool, prefetch: bool, between: bool = False, late: bool = False) -> None:
            for ws_ in layers:
                for w in ws_:
                    y = skinny_linear(xs[w.shape[1]], w, outs[w.shape[0]], ws, picks[tuple(w.shape)], pdl, prefetch,
                                      late)
                    if between:
                        y.mul_(1.0)
            torch.nn.functional.linear(xs[HIDDEN], head)

        variants = {
            "cublas": lambda: cublas_step(),
            "splitk": lambda: skinny_step(False, False),
            "splitk_pdl": lambda: skinny_step(True, False),
            "splitk_pdl_prefetch": lambda: skinny_step(True, True),
            "splitk_pdl_prefetch_late_trigger": lambda: skinny_step(True, True, late=True),
            "cublas_with_elementwise": lambda: cublas_step(True),
            "splitk_pdl_prefetch_with_elementwise": lambda: skinny_step(True, True, True),
        }
        row["step_ms"] = {}
        for _ in range(2):  # interleaved
            for name, fn in variants.items():
                try:
                    ms = time_graph(fn)
                except Exception as exc:  # noqa: BLE001 - e.g. a Triton without launch_pdl: record and go on
                    row.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"[:300]
                    continue
                row["step_ms"].setdefault(name, []).append(round(ms, 4))
        results.append(row)
        print(json.dumps({"rows": rows, "step_ms": row["step_ms"], "picks": {f"{n}x{k}": c for (n, k), c in picks.items()},
                          "errors": row.get("errors")}), flush=True)
    doc = {"what": __doc__.split("\n\n")[0], "layer_weight_bytes": layer_bytes,
           "head_bytes": head.numel() * 2, "bandwidth": args.bandwidth,
           "floor_ms_at_bandwidth": round((layer_bytes + head.numel() * 2) / args.bandwidth * 1e3, 4),
           "results": results, "provenance": collect_provenance(sys.argv)}
    Path(args.output).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"floor {doc['floor_ms_at_bandwidth']:.3f} ms for {(layer_bytes + head.numel() * 2) / 1e9:.2f} GB")
    for r in results:
        print(f"{r['rows']:>4} rows: " + ", ".join(f"{k} {min(v):.3f}" for k, v in r["step_ms"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
