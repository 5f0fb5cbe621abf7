"""Decode step times with FP8 weights or an FP8 KV cache, against each step's floor (chapter 15).

For each variant (``--variants``: ``none``; ``fp8``, group-scaled projections through the Triton kernel;
``w8a8_fp8``, per-channel ones through ``torch._scaled_mm``; ``fp8_kv``, an FP8 cache; ``nosplit``, bf16 with
FlashInfer's decode kernel at every batch size, the kernel an FP8 cache is read by) this builds ``--model`` with
dummy weights and times one decode step (CUDA graph replay, metadata included, no overlap) at each batch size,
every request at a context of ``--context`` tokens, beside the step's floor: the bytes it must read (the stored
weights once, each request's KV) over ``--bandwidth``. Two uses: the weights' share of a step, and so what FP8
projections can save, is largest for a larger model at small batches (Qwen3-14B at 1 to 64 requests); the KV's
share is largest for a small model at large batches (Qwen3-0.6B at 256). Writes ``quant_steps_<label>.json``.

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
from offline_suite import _empty_decode, _fill_decode, _time_forward, release  # this folder, on sys.path when run as a script


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-14b")
    ap.add_argument("--variants", default="none,fp8,w8a8_fp8")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--bandwidth", type=float, default=4.278e12)
    ap.add_argument("--attention", default="triton", help="the attention backend (default: not the subject)")
    ap.add_argument("--label", default="weights")
    ap.add_argument("--out", default="results")
    args = ap.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows = []
    for variant in args.variants.split(","):
        kw: dict = {"fp8": {"quantization": "fp8"}, "w8a8_fp8": {"quantization": "w8a8_fp8"}, "none": {},
                    "fp8_kv": {"kv_cache_dtype": "fp8_e4m3"}, "nosplit": {"split_decode_min_batch": 0}}[variant]
        if args.attention != "default":
            kw["attention_backend"] = args.attention
        t0 = time.perf_counter()
        llm = LLM(args.model, load_format="dummy", dtype="bfloat16", device="cuda", disable_overlap_schedule=True,
                  cuda_graph_max_bs=max(sizes), max_running_requests=max(sizes), **kw)
        start_s = time.perf_counter() - t0
        weights, kv = stored_bytes(llm)
        for bs in sizes:
            batch, fb = _fill_decode(llm, bs, args.context)
            ms = _time_forward(llm.engine.runner, fb, args.iters)
            floor_ms = (weights + bs * (args.context + 1) * kv) / args.bandwidth * 1e3
            row = {"model": args.model, "variant": variant, "attention": args.attention, "batch_size": bs,
                   "context": args.context,
                   "step_ms": round(ms, 4), "floor_ms": round(floor_ms, 4), "of_floor": round(floor_ms / ms, 4),
                   "weight_bytes": weights, "kv_bytes_per_token": kv, "start_s": round(start_s, 1)}
            print(json.dumps(row), flush=True)
            rows.append(row)
            _empty_decode(llm, batch)
        llm.shutdown()
        del llm, batch, fb
        release()
        save(args, rows)  # after each variant: a run cut short keeps what it measured
    return 0


def save(args: argparse.Namespace, rows: list[dict]) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"what": "decode step time (graph replay) by FP8 variant and batch size", "rows": rows,
              "bandwidth": args.bandwidth,
              "provenance": collect_provenance(model=args.model, context=args.context, iters=args.iters)}
    (out / f"quant_steps_{args.label}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
