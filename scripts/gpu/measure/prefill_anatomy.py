"""The prefill phase of the canonical workload, kernel by kind, against its compute floor (chapter 11).

All 256 prompts arrive at once, so the workload starts with a run of prefill steps (a 16,384-token budget each)
before the first decode step. This script times that phase in a fresh engine without the profiler (its wall
time, step by step, under overlap scheduling as in a real run), runs the rest of the workload to empty the engine,
flushes the prefix cache, and runs the same phase again under the profiler: the GPU time of its kernels by kind
(matrix multiplies, attention, the rest), their count, and the largest ones. The floor is the phase's matrix
multiply FLOPs (2 x parameters x tokens, the LM head for one row per request) and attention FLOPs (causal, each
prompt on its own) at the dense bf16 peak measured on an H100 (~800 TFLOP/s). Writes JSON:

    python3 scripts/gpu/measure/prefill_anatomy.py --out results
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_anatomy import _kind, _short  # noqa: E402 - this folder, put on sys.path above
from offline_suite import canonical_workload  # noqa: E402

from minisgl_ref import SamplingParams  # noqa: E402
from minisgl_ref.bench.provenance import collect_provenance  # noqa: E402
from minisgl_ref.llm import LLM  # noqa: E402


def prefill_phase(llm, profiled: bool) -> dict:  # type: ignore[no-untyped-def]
    """Queue the canonical workload and step through its prefill phase; return per-step times (and kernels), the
    host time it took to queue the requests, and the caching allocator's device allocations during the phase."""
    engine = llm.engine
    wl = canonical_workload()
    t_queue = time.perf_counter()
    for prompt, params in zip(wl.prompts, wl.sampling_params):
        engine.add_request(llm.make_request(prompt, SamplingParams(**params)))
    queue_ms = (time.perf_counter() - t_queue) * 1e3
    torch.cuda.synchronize()
    allocs = torch.cuda.memory_stats().get("num_device_alloc", 0)
    prof = profile(activities=[ProfilerActivity.CUDA]) if profiled else None
    if prof is not None:
        prof.__enter__()
    t0 = time.perf_counter()
    marks = []
    while engine.scheduler.waiting or engine.scheduler.chunked:
        engine.step()
        marks.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    if prof is not None:
        prof.__exit__(None, None, None)
    out: dict = {"steps": len(marks), "wall_ms": round(wall * 1e3, 2),
                 "step_end_ms": [round(m * 1e3, 2) for m in marks], "queue_ms": round(queue_ms, 2),
                 "device_allocs": torch.cuda.memory_stats().get("num_device_alloc", 0) - allocs}
    if prof is not None:
        by_kind: dict[str, float] = {}
        top: dict[str, float] = {}
        kernels = 0
        for e in prof.key_averages():
            if e.device_type.name != "CUDA" or e.self_device_time_total <= 0:
                continue
            kind = _kind(e.key)
            by_kind[kind] = by_kind.get(kind, 0.0) + e.self_device_time_total / 1e3
            kernels += e.count if kind != "copies" else 0
            name = _short(e.key)
            top[name] = top.get(name, 0.0) + e.self_device_time_total / 1e3
        out["gpu_ms_by_kind"] = {k: round(v, 2) for k, v in sorted(by_kind.items())}
        out["gpu_busy_ms"] = round(sum(by_kind.values()), 2)
        out["kernels"] = kernels
        out["top_kernels_ms"] = {k: round(v, 2) for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:15]}
    while engine.has_work:  # the rest of the workload, so that the engine is empty again
        engine.step()
    assert engine.flush_cache()
    return out


def floor_ms(llm, tflops: float) -> dict:  # type: ignore[no-untyped-def]
    cfg = llm.engine.runner.model.config
    wl = canonical_workload()
    lens = [len(p) for p in wl.prompts]
    tokens = sum(lens)
    params = sum(p.numel() for n, p in llm.engine.runner.model.named_parameters() if "embed" not in n)
    head = cfg.vocab_size * cfg.hidden_size
    layer_params = params - (0 if cfg.tie_word_embeddings else head)
    mm = 2 * layer_params * tokens + 2 * head * len(lens)
    attn = sum(4 * (n * (n + 1) // 2) * cfg.num_heads * cfg.head_dim for n in lens) * cfg.num_layers
    return {"prompt_tokens": tokens, "matmul_tflop": round(mm / 1e12, 2), "attention_tflop": round(attn / 1e12, 3),
            "floor_ms_at_peak": round((mm + attn) / (tflops * 1e12) * 1e3, 1), "peak_tflops": tflops}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "results"))
    ap.add_argument("--tflops", type=float, default=800.0)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    llm = LLM("qwen3-0.6b", load_format="dummy", dtype="bfloat16", device="cuda")
    plain = [prefill_phase(llm, profiled=False) for _ in range(2)]
    profiled = prefill_phase(llm, profiled=True)
    result = {"what": __doc__.split("\n\n")[0], "floor": floor_ms(llm, args.tflops), "unprofiled": plain,
              "profiled": profiled, "provenance": collect_provenance(sys.argv)}
    (out / "prefill_anatomy.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["floor"]))
    for p in plain:
        print(f"unprofiled: {p['steps']} steps, {p['wall_ms']} ms; step ends {p['step_end_ms']}")
    print(f"profiled: {profiled['wall_ms']} ms wall, GPU busy {profiled['gpu_busy_ms']} ms, {profiled['kernels']} kernels,"
          f" by kind {profiled['gpu_ms_by_kind']}")
    for k, v in profiled["top_kernels_ms"].items():
        print(f"  {v:8.2f} ms  {k}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
