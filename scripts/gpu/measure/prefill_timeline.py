"""Where the host time of a prefill-launching step goes: phase timers, per-layer host times, synchronising calls,
allocator activity and a profiler timeline of the step that launches a long prompt while a few requests decode;
with an interleaved A/B of the ways FlashAttention-3 can be called, and the host cost of a matmul launch for a
token count seen before against a new one.

    python3 scripts/gpu/measure/prefill_timeline.py OUT_PREFIX [--arrivals 12] [--fixed-length 1000]

Writes OUT_PREFIX.json and OUT_PREFIX.trace.json.gz (a Chrome trace of one such step).
"""

from __future__ import annotations

import argparse
import collections
import gc
import gzip
import json
import random
import statistics
import sys
import time
import warnings
from typing import Any

PHASES = collections.defaultdict(float)


def timed(obj: Any, name: str, label: str) -> None:
    """Wrap ``obj.name`` so that its host time adds to PHASES[label] (and shows as a range in a profile)."""
    import torch

    fn = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        with torch.profiler.record_function(label):
            try:
                return fn(*args, **kwargs)
            finally:
                PHASES[label] += time.perf_counter() - t0

    setattr(obj, name, wrapper)


class RawFA3:
    """``flash_attn_with_kvcache`` for the two call shapes the fa3 backend uses, straight to the operator."""

    def __init__(self, fa: Any, mode: str) -> None:
        self.fa, self.mode = fa, mode
        self.op = fa.flash_attn_3_gpu.fwd if mode == "raw_op" else fa._flash_attn_forward._init_fn

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, *, cache_seqlens, page_table, softmax_scale, causal,
                                cu_seqlens_q=None, max_seqlen_q=None):  # noqa: ANN001, ANN201
        return self.op(q, k_cache, v_cache, None, None, None, None, cu_seqlens_q, None, None, None, cache_seqlens,
                       max_seqlen_q, None, page_table, None, None, None, None, None, None, None, None,
                       softmax_scale, causal, -1, -1, 0, 0.0, True, None, 1, None, 0, None)[0]


def linear_host_cost(torch: Any, model: Any) -> dict[str, Any]:
    """Host microseconds per ``F.linear`` launch: the same token count every call; a new count every call, then
    the same new counts again; counts rounded up to a multiple of 64; new multiples of 8, then again (200 calls
    each, three weights of a layer)."""
    import torch.nn.functional as F

    layer = model.layers[0]
    weights = [layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight]
    out: dict[str, Any] = {}
    for label, counts in (("same_count", [1000] * 200), ("new_count", list(range(1000, 1200))),
                          ("new_count_again", list(range(1000, 1200))),
                          ("new_count_round64", [(m + 63) // 64 * 64 for m in range(1200, 1400)]),
                          ("new_count_multiple_of_8", list(range(2000, 3600, 8))),
                          ("new_count_multiple_of_8_again", list(range(2000, 3600, 8)))):
        xs = {w.shape[1]: torch.randn(max(counts) + 64, w.shape[1], dtype=w.dtype, device=w.device)
              for w in weights}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for m in counts:
            for w in weights:
                F.linear(xs[w.shape[1]][:m], w)
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
        n = len(counts) * len(weights)
        out[label] = {"host_us_per_call": round(1e6 * host / n, 2), "wall_us_per_call": round(1e6 * total / n, 2)}
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--model-path", default="qwen3-0.6b")
    p.add_argument("--arrivals", type=int, default=12)
    p.add_argument("--running", type=int, default=8)
    p.add_argument("--fixed-length", type=int, default=1000)
    p.add_argument("--linear-only", action="store_true", help="only the matmul launch costs")
    p.add_argument("--device", default="cuda", help="cpu: a dry run of this script, nothing measured")
    p.add_argument("--mixed", action="store_true", help="mixed chunks: the running requests' decode rows ride along")
    args = p.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from minisgl_ref import LLM, SamplingParams
    from minisgl_ref.bench.provenance import collect_provenance
    from minisgl_ref.engine import model_runner as mr
    from minisgl_ref.engine.extend_graph import ExtendGraphRunner

    llm = LLM(args.model_path, load_format="dummy", dtype="bfloat16", device=args.device,
              enable_mixed_chunk=args.mixed)
    cuda = args.device == "cuda"
    engine = llm.engine
    runner = engine.runner
    backend = runner.attn_backend
    pb = backend.phase_backend(decode=False)  # the backend that runs extend steps
    rng = random.Random(0)
    vocab = llm.config.vocab_size
    result: dict[str, Any] = {"what": __doc__.split("\n\n")[0], "backend": type(backend).__name__}

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    llm.generate([prompt(900) for _ in range(4)], SamplingParams(max_new_tokens=8, ignore_eos=True), use_tqdm=False)
    result["linear_host_cost"] = linear_host_cost(torch, runner.model) if cuda else {}
    print("linear:", result["linear_host_cost"], flush=True)
    if args.linear_only:
        result["provenance"] = collect_provenance(sys.argv)
        with open(args.out + ".json", "w") as f:
            json.dump(result, f, indent=1)
        return 0

    # Phase timers (host time), each also a profiler range.
    timed(engine.scheduler, "schedule", "schedule")
    timed(runner, "prepare", "prepare")
    timed(runner.sampling, "info", "sampling_info")
    timed(runner.sampler, "sample", "sample")
    timed(backend, "init_forward_metadata", "attn_metadata")
    timed(runner.model, "forward", "model_forward")
    timed(runner.model, "compute_logits", "logits")
    timed(engine, "_finish_inflight", "finish_inflight")
    timed(engine, "_commit_launched", "commit")
    timed(runner, "forward", "runner_forward")
    timed(runner, "pad_extend", "pad_extend")
    timed(engine, "_process", "process")
    for graphs in runner.graph_runners:
        if isinstance(graphs, ExtendGraphRunner):
            timed(graphs, "replay", "extend_graph_replay")
    timed(pb, "attend_extend", "attend_extend")
    timed(pb.kv_pool, "store", "kv_store")
    orig_tokens = mr.StepOutput.tokens

    def tokens(self: Any) -> list[int]:
        t0 = time.perf_counter()
        with torch.profiler.record_function("wait_tokens"):
            try:
                return orig_tokens(self)
            finally:
                PHASES["wait_tokens"] += time.perf_counter() - t0

    mr.StepOutput.tokens = tokens

    layer_t: list[float] = []
    for layer in runner.model.layers:
        layer.register_forward_pre_hook(lambda m, a: layer_t.append(time.perf_counter()))
    runner.model.norm.register_forward_pre_hook(lambda m, a: layer_t.append(time.perf_counter()))

    variants = {"wrapper": getattr(pb, "fa", None)}
    if hasattr(variants["wrapper"], "flash_attn_3_gpu"):
        variants["init_fn"] = RawFA3(pb.fa, "init_fn")
        variants["raw_op"] = RawFA3(pb.fa, "raw_op")

    for _ in range(args.running):
        engine.add_request(llm.make_request(prompt(1000), SamplingParams(max_new_tokens=100000, ignore_eos=True)))
    for _ in range(30):
        engine.step()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()

    def one_step() -> tuple[float, dict[str, float], list[float], list[str], dict[str, int]]:
        PHASES.clear()
        layer_t.clear()
        mem0 = torch.cuda.memory_stats() if cuda else {}
        gc0 = [s["collections"] for s in gc.get_stats()]
        if cuda:
            torch.cuda.set_sync_debug_mode(1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            engine.step()
            wall = 1e3 * (time.perf_counter() - t0)
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
        mem1 = torch.cuda.memory_stats() if cuda else {}
        gc1 = [s["collections"] for s in gc.get_stats()]
        layers = [1e3 * (b - a) for a, b in zip(layer_t, layer_t[1:])]
        syncs = [f"{w.filename}:{w.lineno}: {str(w.message)[:120]}" for w in caught]
        counters = {k: int(mem1.get(k, 0) - mem0.get(k, 0)) for k in
                    ("num_alloc_retries", "segment.all.allocated", "segment.all.freed", "num_device_alloc",
                     "num_device_free")}
        counters["gc_collections"] = sum(gc1) - sum(gc0)
        return wall, {k: round(1e3 * v, 3) for k, v in PHASES.items()}, layers, syncs, counters

    arrivals = []
    names = list(variants)
    for i in range(args.arrivals):
        name = names[i % len(names)]
        if cuda:
            pb.fa = variants[name]
        before = [one_step()[0] for _ in range(5)]
        n = args.fixed_length or rng.randrange(700, 1100)
        engine.add_request(llm.make_request(prompt(n), SamplingParams(max_new_tokens=100000, ignore_eos=True)))
        wall, phases, layers, syncs, counters = one_step()
        after = [one_step()[0] for _ in range(2)]
        rec = {"fa3_call": name, "prompt_tokens": n, "decode_steps_before_ms": [round(x, 3) for x in before],
               "stall_step_ms": round(wall, 3), "next_steps_ms": [round(x, 3) for x in after],
               "stall_phases_ms": phases,
               "stall_layer_host_ms": {"first": round(layers[0], 3) if layers else None,
                                       "median": round(statistics.median(layers), 3) if layers else None,
                                       "max": round(max(layers), 3) if layers else None,
                                       "sum": round(sum(layers), 3), "count": len(layers)},
               "stall_sync_warnings": syncs[:10], "stall_counters": counters}
        arrivals.append(rec)
        print(json.dumps(rec), flush=True)
        for _ in range(15):
            engine.step()
    if cuda:
        pb.fa = variants["wrapper"]
    result["arrivals"] = arrivals
    summary = {}
    for name in names:
        rows = [a for a in arrivals if a["fa3_call"] == name]
        summary[name] = {"stall_ms_median": round(statistics.median(a["stall_step_ms"] for a in rows), 3),
                         "model_forward_ms_median": round(statistics.median(
                             a["stall_phases_ms"].get("model_forward", 0.0) for a in rows), 3),
                         "attend_extend_ms_median": round(statistics.median(
                             a["stall_phases_ms"].get("attend_extend", 0.0) for a in rows), 3)}
    result["summary_by_fa3_call"] = summary
    print("summary:", json.dumps(summary), flush=True)

    # One profiled stall step: its timeline, and the largest host gaps between top-level operators.
    for _ in range(5):
        engine.step()
    engine.add_request(llm.make_request(prompt(args.fixed_length or 1000),
                                        SamplingParams(max_new_tokens=100000, ignore_eos=True)))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        engine.step()
        wall = 1e3 * (time.perf_counter() - t0)
        sync()
    prof.export_chrome_trace(args.out + ".trace.json")
    with open(args.out + ".trace.json", "rb") as f, gzip.open(args.out + ".trace.json.gz", "wb") as g:
        g.write(f.read())
    import os

    os.remove(args.out + ".trace.json")
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    labels = set(PHASES) | {"wait_tokens"}
    # Operators not nested in another operator (the phase ranges are not operators): the host's launch sequence.
    top = sorted((e for e in events if e.name not in labels
                  and (e.cpu_parent is None or e.cpu_parent.name in labels)), key=lambda e: e.time_range.start)
    gaps, all_gaps = [], []
    for a, b in zip(top, top[1:]):
        gap = b.time_range.start - a.time_range.end
        all_gaps.append(gap)
        if gap > 200:
            gaps.append({"gap_us": round(gap, 1), "after": a.name, "before": b.name})
    gaps.sort(key=lambda g: -g["gap_us"])
    ranges = collections.defaultdict(float)
    for e in events:
        if e.name in PHASES or e.name == "wait_tokens":
            ranges[e.name] += e.cpu_time_total / 1e3
    cuda_us = sum(e.self_device_time_total for e in prof.key_averages())
    result["profiled_step"] = {"wall_ms": round(wall, 3), "top_level_ops": len(top),
                               "host_gaps_over_200us": gaps[:25],
                               "sum_gaps_over_200us_ms": round(sum(g["gap_us"] for g in gaps) / 1e3, 3),
                               "sum_all_gaps_ms": round(sum(x for x in all_gaps if x > 0) / 1e3, 3),
                               "sum_top_level_op_ms": round(sum(e.cpu_time_total for e in top) / 1e3, 3),
                               "ranges_ms": {k: round(v, 3) for k, v in ranges.items()},
                               "device_time_ms": round(cuda_us / 1e3, 3),
                               "top_by_self_cpu": prof.key_averages().table(sort_by="self_cpu_time_total",
                                                                            row_limit=20,
                                                                            max_name_column_width=60)}
    print(result["profiled_step"]["top_by_self_cpu"], flush=True)
    print("gaps:", json.dumps(gaps[:10]), flush=True)
    result["provenance"] = collect_provenance(sys.argv)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
