"""Does a small host-to-device copy make the CPU wait for the GPU? (chapter 12)

A constrained decode step copies its token bitmask (``rows x vocab / 32`` int32) to the GPU while the forward pass
of the same step is still queued there. ``tensor.to("cuda", non_blocking=True)`` returns at once only if CUDA can
take the bytes without waiting for the stream to reach the copy. This benchmark queues ``--busy-ms`` of GPU work
(a chain of matrix multiplies), then times the host side of one copy of each size, from ordinary (pageable) and
from pinned memory, and checks that the copied bytes arrive intact. Writes JSON with provenance:

    python -m benchmarks.h2d_copy --output h2d_copy.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROWS = (1, 8, 64, 256)
VOCAB = 49_152  # SmolLM2's vocabulary: 1,536 int32 per mask row


def busy(ms: float, x: torch.Tensor) -> None:
    """Queue about ``ms`` milliseconds of matrix multiplies on the current stream (calibrated by the caller)."""
    for _ in range(max(1, int(ms))):
        torch.mm(x, x)


def calibrate(x: torch.Tensor) -> float:
    """Milliseconds one ``busy(1)`` call keeps the GPU busy."""
    busy(3, x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    busy(20, x)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3 / 20


def host_copy_us(src: torch.Tensor, busy_ms: float, x: torch.Tensor, per_mm_ms: float, repeats: int) -> dict:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        busy(busy_ms / per_mm_ms, x)
        t = time.perf_counter()
        dst = src.to("cuda", non_blocking=True)
        times.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
        assert torch.equal(dst.cpu(), src), "the copy arrived corrupted"
    return {"median_us": round(statistics.median(times), 1), "max_us": round(max(times), 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True)
    p.add_argument("--busy-ms", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    from minisgl_ref.bench.provenance import collect_provenance

    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    per_mm = calibrate(x)
    rows = []
    for n in ROWS:
        pageable = torch.randint(-(2**31), 2**31 - 1, (n, VOCAB // 32), dtype=torch.int32)
        pinned = pageable.pin_memory()
        row = {"rows": n, "kib": round(pageable.numel() * 4 / 1024, 1),
               "pageable": host_copy_us(pageable, args.busy_ms, x, per_mm, args.repeats),
               "pinned": host_copy_us(pinned, args.busy_ms, x, per_mm, args.repeats)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    doc = {"what": __doc__.split("\n\n")[0], "busy_ms": args.busy_ms, "matmul_ms": round(per_mm, 3),
           "vocab": VOCAB, "results": rows, "provenance": collect_provenance(sys.argv)}
    Path(args.output).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{'rows':>5} {'KiB':>7} {'pageable us':>12} {'pinned us':>10}   (host time of one copy, GPU busy)")
    for r in rows:
        print(f"{r['rows']:>5} {r['kib']:>7} {r['pageable']['median_us']:>12} {r['pinned']['median_us']:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
