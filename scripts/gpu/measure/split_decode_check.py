"""Check every compiled variant of the split-KV decode kernel against a float64 softmax on the GPU (chapter 11).

Contexts of 1 to ~3,000 tokens in scattered slots, cut into pieces by the engine's planner with one to sixteen
pieces per request, for 1, 2 and 4 query heads per KV head; both variants of the engine's build (one block an SM,
and four for one or two query heads per KV head), each called twice (the second call finds the merge counters
reset by the first). The builds with other rows per half-warp and block sizes that this script also checked
(``split_decode_check_h100.json``) were removed after chapter 11 measured them; commit e598280 has them. Prints
one line per case and writes JSON:

    python scripts/gpu/measure/split_decode_check.py --output split_decode_check.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from minisgl_ref.perf.split_decode import load_kernel, plan_pieces


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: list[torch.Tensor],
              scale: float) -> torch.Tensor:
    """Each request's attention in float64, one softmax over its whole context."""
    outs = []
    group = q.shape[1] // k.shape[1]
    for i, s in enumerate(slots):
        kk = k[s].double().repeat_interleave(group, 1)  # [n, H, D]
        vv = v[s].double().repeat_interleave(group, 1)
        w = torch.einsum("hd,nhd->hn", q[i].double(), kk) * scale
        outs.append(torch.einsum("hn,nhd->hd", w.softmax(-1), vv))
    return torch.stack(outs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True)
    args = p.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    engine = load_kernel()
    rows = []
    for kv_heads, group in ((8, 2), (8, 1), (4, 4), (2, 2)):
        heads = kv_heads * group
        lens = [1, 2, 17, 300, 3000] + torch.randint(1, 1200, (27,), generator=gen).tolist()
        pool = sum(lens) * 2
        k = torch.randn(pool, kv_heads, 128, generator=gen).to(dev, torch.bfloat16)
        v = torch.randn(pool, kv_heads, 128, generator=gen).to(dev, torch.bfloat16)
        q = torch.randn(len(lens), heads, 128, generator=gen).to(dev, torch.bfloat16)
        perm = torch.randperm(pool, generator=gen)[: sum(lens)].to(dev)
        slots = list(perm.split(lens))
        scale = 128**-0.5
        ref = reference(q, k, v, slots, scale)
        indices = perm.to(torch.int32)
        for per_request in (1, 2, 8, 16):
            items, parts, first = (torch.from_numpy(x).to(dev) for x in
                                   plan_pieces(lens, len(lens) * per_request, None if per_request > 1 else 2.0))
            variants = [("engine", engine, (4, 128, 1))] + ([("engine", engine, (4, 128, 4))] if group <= 2 else [])
            for build, mod, (unroll, threads, min_blocks) in variants:
                part_o = torch.full((items.shape[0], heads, 128), float("nan"), device=dev)
                part_lse = torch.full((items.shape[0], heads), float("nan"), device=dev)
                counters = torch.zeros(len(lens), kv_heads, dtype=torch.int32, device=dev)
                out = torch.full_like(q, float("nan"))
                row = {"kv_heads": kv_heads, "group": group, "pieces_per_request": per_request, "build": build,
                       "unroll": unroll, "threads": threads, "min_blocks": min_blocks}
                try:
                    for _ in range(2):  # the second call checks that the counters were reset
                        mod.split_decode(q, k, v, indices, items, parts, first, part_o, part_lse, counters, out, scale,
                                         unroll, threads, min_blocks)  # fmt: skip
                    torch.cuda.synchronize()
                    err = (out.double() - ref).abs().max().item()
                    row.update(max_abs_error=err, ok=bool(err < 2e-2), counters_reset=bool((counters == 0).all()))
                except Exception as e:  # noqa: BLE001 - report every variant
                    row.update(error=f"{type(e).__name__}: {e}"[:300], ok=False)
                rows.append(row)
                print(json.dumps(row), flush=True)
    from minisgl_ref.bench.provenance import collect_provenance

    ok = all(r["ok"] and r.get("counters_reset", False) for r in rows)
    doc = {"what": __doc__.split("\n\n")[0], "all_ok": ok, "cases": rows, "provenance": collect_provenance(sys.argv)}
    Path(args.output).write_text(json.dumps(doc, indent=1) + "\n")
    print("all ok" if ok else "FAILURES")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
