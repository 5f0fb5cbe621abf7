"""The two per-token Triton kernels of a decode layer (``minisgl_ref/perf/triton_ops.py``), this checkout's
against another version of the file, in one process (chapter 11).

For each row count, 28 layers' worth of inputs (Qwen3-0.6B's shapes: 16 query and 8 KV heads of 128, hidden
1,024, intermediate 3,072; each layer its own tensors, so nothing stays in the L2 cache from one call to the
next) go through each version's QK-norm/RoPE/KV-store kernel (norms folded: ``row_rms``) and its activation,
captured in one CUDA graph per version; the graphs are replayed in turn and the median time per layer is written
with both versions' outputs (the rotated q and k, the scaled v, the activation) compared bit for
bit.

    python scripts/gpu/measure/fused_kernels_ab.py --old .baseline/minisgl_ref/perf/triton_ops.py --output ab.json

(in a checkout older than ``minisgl_ref/perf/``, the file was ``minisgl_ref/layers/triton_fused.py``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch

HEADS, KV_HEADS, D, HIDDEN, FFN, LAYERS = 16, 8, 128, 1024, 3072, 28


def load_module(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("triton_fused_old", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def layer_inputs(rows: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    dev, bf = "cuda", torch.bfloat16
    slots = torch.randperm(100_000, generator=g, device=dev)[:rows] + 1
    return {"qkv": torch.randn(rows, (HEADS + 2 * KV_HEADS) * D, generator=g, device=dev, dtype=bf),
            "x": torch.randn(rows, HIDDEN, generator=g, device=dev, dtype=bf),
            "gate_up": torch.randn(rows, 2 * FFN, generator=g, device=dev, dtype=bf),
            "k_pool": torch.zeros(100_001, KV_HEADS, D, device=dev, dtype=bf),
            "v_pool": torch.zeros(100_001, KV_HEADS, D, device=dev, dtype=bf),
            "slots": slots, "positions": torch.randint(0, 4000, (rows,), generator=g, device=dev)}  # fmt: skip


def step(module: ModuleType, layers: list[dict[str, torch.Tensor]], cos: torch.Tensor, sin: torch.Tensor,
         weights: tuple[torch.Tensor, torch.Tensor], outs: list[torch.Tensor]) -> None:  # fmt: skip
    outs.clear()
    for t in layers:
        qkv = t["qkv"].clone()  # the kernel works in place: every replay starts from the same projection
        q, k, v = qkv.split([HEADS * D, KV_HEADS * D, KV_HEADS * D], dim=-1)
        q, k, v = q.view(-1, HEADS, D), k.view(-1, KV_HEADS, D), v.view(-1, KV_HEADS, D)
        module.qk_norm_rope_(t["positions"], q, k, cos, sin, *weights, 1e-6,
                             store=(v, t["k_pool"], t["v_pool"], t["slots"]), row_rms=(t["x"], v, 1e-6))  # fmt: skip
        outs += [qkv, module.silu_and_mul_rms(t["gate_up"], t["x"], 1e-6)]


def capture(fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def measure(rows: int, versions: dict[str, ModuleType], rounds: int) -> dict[str, Any]:
    g = torch.Generator("cuda").manual_seed(rows)
    layers = [layer_inputs(rows, g) for _ in range(LAYERS)]
    angles = torch.arange(4096, device="cuda")[:, None] * (1e6 ** (-torch.arange(0, D, 2, device="cuda") / D))
    cos, sin = angles.cos().float().contiguous(), angles.sin().float().contiguous()
    weights = tuple((1 + 0.1 * torch.randn(D, generator=g, device="cuda")).bfloat16() for _ in "qk")
    outs: dict[str, list[torch.Tensor]] = {name: [] for name in versions}
    graphs = {name: capture(lambda m=m, o=outs[name]: step(m, layers, cos, sin, weights, o))  # type: ignore[misc]
              for name, m in versions.items()}
    names = list(versions)
    same = all(torch.equal(a, b) for a, b in zip(outs[names[0]], outs[names[1]]))
    times: dict[str, list[float]] = {name: [] for name in versions}
    for _ in range(rounds):
        for name, graph in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / 10 / LAYERS)
    med = {name: statistics.median(t) for name, t in times.items()}
    return {"rows": rows, "us_per_layer_both_kernels": {n: round(m, 3) for n, m in med.items()},
            "change": round(med[names[1]] / med[names[0]] - 1, 4), "same_outputs": same}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", required=True, help="another version of minisgl_ref/perf/triton_ops.py")
    p.add_argument("--output", required=True)
    p.add_argument("--rows", default="256,128,64,16")
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args()
    from minisgl_ref.bench.provenance import collect_provenance
    from minisgl_ref.perf import triton_ops

    versions = {"old": load_module(args.old), "new": triton_ops}
    result: dict[str, Any] = {"what": __doc__.split("\n\n")[0].replace("\n", " "), "old": args.old, "results": [],
                              "provenance": collect_provenance(rounds=args.rounds)}  # fmt: skip
    for rows in (int(r) for r in args.rows.split(",")):
        row = measure(rows, versions, args.rounds)
        print(row, flush=True)
        result["results"].append(row)
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
