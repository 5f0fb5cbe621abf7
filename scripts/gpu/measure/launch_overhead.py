"""Host time per kernel launch, by launcher (chapter 11): why our Triton kernels run only inside CUDA graphs.

Each op is launched ``--iters`` times back to back on tiny tensors, so the GPU finishes every kernel long before
the host has launched the next one: wall time per launch is then the host's cost of launching it. Compared:
a PyTorch indexing kernel (``pool[slots] = k``), FlashInfer's RMSNorm (its Python wrapper and TVM-FFI call), and
our two Triton kernels (Triton's Python launcher). Writes ``launch_overhead.json`` (with provenance) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from minisgl_ref.bench.provenance import collect_provenance
from minisgl_ref.perf import fused_ops, triton_ops
from minisgl_ref.layers.rotary import RotaryEmbedding


def per_launch_us(fn, iters: int) -> float:  # type: ignore[no-untyped-def]
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="results")
    p.add_argument("--iters", type=int, default=2000)
    args = p.parse_args()
    dev, dt = "cuda", torch.bfloat16
    t, heads, kv_heads, d = 1, 16, 8, 128
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, device=dev, dtype=dt)
    q = qkv[:, : heads * d].view(t, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(t, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(t, kv_heads, d)
    pool_k = torch.zeros(64, kv_heads, d, device=dev, dtype=dt)
    pool_v = torch.zeros_like(pool_k)
    slots = torch.tensor([5], device=dev)
    pos = torch.tensor([3], device=dev)
    rope = RotaryEmbedding(d, 4096, 1e6).to(dev)
    w = torch.ones(d, device=dev, dtype=dt)
    ops = {
        "torch index_put (pool[slots] = k)": lambda: pool_k.__setitem__(slots, k),
        "triton store_kv_ (K and V)": lambda: triton_ops.store_kv_(pool_k, pool_v, slots, k, v),
        "triton qk_norm_rope_": lambda: triton_ops.qk_norm_rope_(pos, q, k, rope.cos_cache, rope.sin_cache,
                                                                 w, w, 1e-6),
    }
    if fused_ops.fused_available(q):
        ops["flashinfer rmsnorm (q heads)"] = lambda: fused_ops.rmsnorm(q, w, 1e-6)
    results = {name: per_launch_us(fn, args.iters) for name, fn in ops.items()}
    for name, us in results.items():
        print(f"{name:<40} {us:7.1f} us per launch (host-bound)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": "launch_overhead", "iters": args.iters, "us_per_launch": results,
              "provenance": collect_provenance(sys.argv)}
    (out / "launch_overhead.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
