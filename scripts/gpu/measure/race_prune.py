"""The sampler's race with and without skipping the blocks that cannot win (``PRUNE``), alone on the GPU.

For each row count: the draw's time with pruning and without (alternating, each call captured in a CUDA graph
where possible), with the default split of the rows into programs and with coarser ones (longer programs skip
more blocks); whether the two draws agree token for token over many steps, on logits of the canonical workload's
scale (the dummy model's, std ~0.4, at temperature 0.6) and on wider ones; and the eager sampler's tokens.

    python3 scripts/gpu/measure/race_prune.py OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> int:
    import torch

    from benchmarks.kernels import time_graph
    from minisgl_ref.bench.provenance import collect_provenance
    from minisgl_ref.sampling import fused_draw, sampler

    out = Path(sys.argv[1])
    dev = torch.device("cuda")
    vocab = 151936
    results = []
    for rows in (1, 8, 64, 128, 256):
        row: dict = {"rows": rows, "default_chunks": fused_draw.num_chunks(rows, vocab)}
        temps = torch.full((rows,), 0.6, device=dev)
        seeds = torch.arange(rows, device=dev)
        steps = torch.zeros(rows, dtype=torch.int64, device=dev)
        for scale in (0.4, 3.0):
            logits = (torch.randn(rows, vocab, device=dev) * scale).to(torch.bfloat16)
            default = row["default_chunks"]
            for chunks in sorted({default, max(1, default // 2), max(1, default // 4)}, reverse=True):
                for prune in (False, True, False, True):
                    def draw() -> torch.Tensor:
                        return fused_draw.temperature_sample(logits, temps, seeds, steps, chunks=chunks,  # noqa: B023
                                                             prune=prune)  # noqa: B023
                    seconds, method = time_graph(draw, repeats=30)
                    key = f"scale{scale}_chunks{chunks}_{'prune' if prune else 'full'}_us"
                    row.setdefault(key, []).append(round(seconds * 1e6, 1))
                    row["method"] = method
            differ, draws = 0, 0
            for step in range(100 if rows >= 64 else 20):
                steps.fill_(step)
                a = fused_draw.temperature_sample(logits, temps, seeds, steps)
                b = fused_draw.temperature_sample(logits, temps, seeds, steps, prune=False)
                differ += int((a != b).sum())
                draws += rows
            row[f"scale{scale}_draws_compared"], row[f"scale{scale}_draws_differing"] = draws, differ
            eager = sampler.temperature_sample(logits.float(), temps, seeds, steps)
            row[f"scale{scale}_same_as_eager"] = int((fused_draw.temperature_sample(logits, temps, seeds, steps)
                                                      == eager).sum())
        results.append(row)
        print(json.dumps(row), flush=True)
    doc = {"what": __doc__.split("\n\n")[0], "vocab": vocab, "results": results,
           "provenance": collect_provenance(sys.argv)}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
