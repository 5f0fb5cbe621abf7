"""The GPU's memory bandwidth as a device-to-device copy reaches it: the ``--hbm-bandwidth`` of a roofline floor.

A copy of ``--gib`` GiB reads and writes every byte once, so bandwidth = 2 x bytes / time (median of ``--repeats``
copies, CUDA events). Prints the number and writes ``hbm_bandwidth.json`` under ``--out``.

    PYTHONPATH=$PWD python3 scripts/gpu/measure/hbm_bandwidth.py --out results
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results")
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    import torch

    from minisgl_ref.bench.provenance import collect_provenance

    n = int(args.gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(args.repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    bandwidth = 2 * n / statistics.median(times)
    report = {"benchmark": "hbm_bandwidth", "device": torch.cuda.get_device_name(), "bytes_copied": n,
              "median_s": statistics.median(times), "bandwidth_bytes_per_s": bandwidth,
              "provenance": collect_provenance(sys.argv)}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "hbm_bandwidth.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"{bandwidth:.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
