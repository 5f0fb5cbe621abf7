"""Decode step times with FP8 projections, where the weights are most of the bytes (chapter 15).

On the canonical workload a small model's decode step reads mostly KV; the weights' share, and so what FP8
projections can save, is largest for a larger model at small batches. For each ``--quantization`` variant (none,
``fp8`` group scales through the Triton kernel, ``w8a8_fp8`` per-channel scales through ``torch._scaled_mm``) this
builds ``--model`` with dummy weights and times one decode step (CUDA graph replay, metadata included, no overlap)
at each batch size (Triton attention), every request at a context of ``--context`` tokens, beside the step's floor: the bytes it must
read (the stored weights once, each request's KV) over ``--bandwidth``. Writes ``quant_steps.json`` to ``--out``.

    PYTHONPATH=$PWD:scripts/gpu/measure python3 scripts/gpu/measure/quant_steps.py --out results
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from minisgl_ref.bench.offline import stored_bytes
from minisgl_ref.bench.provenance import collect_provenance
from minisgl_ref.llm import LLM
from offline_suite import _fill_decode, _time_forward, release  # this folder, on sys.path when run as a script


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--variants", default="none,fp8,w8a8_fp8")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--bandwidth", type=float, default=4.278e12)
    ap.add_argument("--out", default="results")
    args = ap.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows = []
    for variant in args.variants.split(","):
        quant = None if variant == "none" else variant
        t0 = time.perf_counter()
        llm = LLM(args.model, load_format="dummy", dtype="bfloat16", device="cuda", quantization=quant,
                  disable_overlap_schedule=True, cuda_graph_max_bs=max(sizes), max_running_requests=max(sizes),
                  attention_backend="triton")  # not the subject here; spares FlashInfer's compiles for this shape
        start_s = time.perf_counter() - t0
        weights, kv = stored_bytes(llm)
        for bs in sizes:
            batch, fb = _fill_decode(llm, bs, args.context)
            ms = _time_forward(llm.engine.runner, fb, args.iters)
            floor_ms = (weights + bs * (args.context + 1) * kv) / args.bandwidth * 1e3
            row = {"model": args.model, "quantization": variant, "batch_size": bs, "context": args.context,
                   "step_ms": round(ms, 4), "floor_ms": round(floor_ms, 4), "of_floor": round(floor_ms / ms, 4),
                   "weight_bytes": weights, "kv_bytes_per_token": kv, "start_s": round(start_s, 1)}
            print(json.dumps(row), flush=True)
            rows.append(row)
            for req in batch.reqs:
                llm.engine.abort(req)
            while llm.engine.has_work:
                llm.engine.step()
            llm.engine.flush_cache()
        llm.shutdown()
        del llm, batch, fb
        release()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"what": "decode step time (graph replay) by FP8 projection variant and batch size", "rows": rows,
              "bandwidth": args.bandwidth,
              "provenance": collect_provenance(model=args.model, context=args.context, iters=args.iters)}
    (out / "quant_steps.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
