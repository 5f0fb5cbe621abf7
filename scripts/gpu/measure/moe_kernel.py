"""The fused MoE kernel against the reference loop over experts, at Qwen3-30B-A3B's layer shape (chapter 14).

One MoE layer's expert computation (H = 2048, I = 768, E = 128 experts, k = 8 per token, bf16) for T tokens, with
a uniform random routing (each token's k experts drawn without repetition). Timed:

- ``fused``: :func:`minisgl_ref.moe.fused_moe.fused_experts` captured into a CUDA graph (ten calls a graph, the
  median of the replays; ``benchmarks.kernels.time_graph``), so Triton's ~20 us host launcher is not counted,
  as in a server's decode step;
- ``fused_eager``: the same, called eagerly (CUDA events around each call): what a prefill step pays;
- ``reference``: :func:`minisgl_ref.moe.experts.reference_experts`, eagerly (it reads the routing back to the
  host, so it cannot be captured).

The work is reading weights: the experts that at least one token chose, each ``3 x H x I x 2`` bytes (9.4 MB).
The report gives that count, the bytes, and the bandwidth the fused kernel reaches on them (an H200 streams
about 4.3 TB/s in a device-to-device copy); at T = 1 that is 8 experts, at T = 1024 nearly all 128. Also the
largest difference from the reference, as a check that the timed thing is the right one. Each T replays one
routing, so at T = 1 part of its 75 MB of weights may still be in the H200's 60 MB L2 from the previous call:
the smallest T's bandwidth can read high.

    PYTHONPATH=$PWD python3 scripts/gpu/measure/moe_kernel.py --out results   # writes results/moe_kernel.json

``--smoke`` runs a tiny layer on the CPU through Triton's interpreter (no GPU needed), to check the script.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

QWEN3_30B_A3B = dict(hidden=2048, inter=768, num_experts=128, top_k=8)
SMOKE = dict(hidden=64, inter=32, num_experts=16, top_k=4)


def eager_seconds(fn: Callable[[], Any], repeats: int, cuda: bool) -> float:
    """Median seconds per call: CUDA events around each call on the GPU, the wall clock on the CPU."""
    import torch

    fn()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="results", help="folder for moe_kernel.json")
    p.add_argument("--tokens", default="1,8,64,256,1024", help="comma-separated token counts T")
    p.add_argument("--repeats", type=int, default=50, help="timed calls (or graph replays) per T; median reported")
    p.add_argument("--smoke", action="store_true", help="tiny layer on the CPU through Triton's interpreter")
    args = p.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # read when triton.jit decorates the kernel: before the import below
    import torch

    from minisgl_ref.bench.provenance import collect_provenance
    from minisgl_ref.moe.experts import reference_experts
    from minisgl_ref.moe.fused_moe import default_block_m, fused_experts

    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        print("needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shape = QWEN3_30B_A3B if cuda else SMOKE
    h, inter, num_experts, top_k = shape["hidden"], shape["inter"], shape["num_experts"], shape["top_k"]
    repeats = args.repeats if cuda else 3
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(num_experts, 2 * inter, h, generator=g) / h**0.5).to(device, dtype)
    w2 = (torch.randn(num_experts, h, inter, generator=g) / inter**0.5).to(device, dtype)
    bytes_per_expert = (w13[0].numel() + w2[0].numel()) * w13.element_size()

    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, h, generator=g).to(device, dtype)
        ids = torch.rand(tokens, num_experts, generator=g).topk(top_k, dim=1).indices.to(device)
        weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=1).to(device)
        inputs = (x, w13, w2, weights, ids)
        max_diff = (fused_experts(*inputs).float() - reference_experts(*inputs).float()).abs().max().item()
        fused_eager_s = eager_seconds(lambda: fused_experts(*inputs), repeats, cuda)
        fused_s, method = fused_eager_s, "eager"  # the interpreter: no graphs
        if cuda:
            from benchmarks.kernels import time_graph

            fused_s, method = time_graph(lambda: fused_experts(*inputs), repeats=repeats)
        reference_s = eager_seconds(lambda: reference_experts(*inputs), max(3, repeats // 5), cuda)
        experts_touched = int(ids.unique().numel())
        weight_bytes = experts_touched * bytes_per_expert
        row = dict(tokens=tokens, block_m=default_block_m(tokens * top_k, num_experts), timing=method,
                   fused_us=fused_s * 1e6, fused_eager_us=fused_eager_s * 1e6, reference_us=reference_s * 1e6,
                   speedup_vs_reference=reference_s / fused_s, experts_touched=experts_touched,
                   weight_bytes=weight_bytes, fused_weight_gbps=weight_bytes / fused_s / 1e9,
                   max_abs_diff_vs_reference=max_diff)
        rows.append(row)
        print(f"T={tokens:5d}  experts {experts_touched:3d}  fused {row['fused_us']:9.1f} us ({method})"
              f"  eager {row['fused_eager_us']:9.1f} us  reference {row['reference_us']:10.1f} us"
              f"  x{row['speedup_vs_reference']:6.1f}  weights {row['fused_weight_gbps']:7.1f} GB/s"
              f"  max diff {max_diff:.2e}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": "moe_kernel", "shape": shape, "dtype": str(dtype), "device": device,
              "bytes_per_expert": bytes_per_expert, "rows": rows,
              "provenance": collect_provenance(sys.argv, smoke=args.smoke, repeats=repeats)}
    (out / "moe_kernel.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
