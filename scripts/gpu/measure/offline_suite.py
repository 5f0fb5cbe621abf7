"""Chapter 08/11's GPU measurements in one process (run by scripts/gpu/measure/offline.sh).

Parts (``--parts``, comma-separated; default all):

* ``bandwidth``  device-to-device copy bandwidth (bytes read + written / s): the roofline's denominator, measured
                 in the same run as the throughput it judges.
* ``steps``      decode step time (metadata + forward + logits) at several batch sizes, CUDA graph vs eager,
                 on Qwen3-0.6B (bf16, dummy weights), every request at a context of 512 tokens.
* ``canonical``  the canonical offline workload (256 requests) with the full engine, default settings.
* ``ladder``     the stage ladder (naive .. overlap, torch_native attention) on a reduced workload, then the
                 full engine on the canonical workload for each attention backend, CUDA graphs off and on.
* ``profile``    torch.profiler tables of a few decode steps at batch 64 (eager and graphed), and a cProfile of
                 the engine's host code over 100 decode-heavy steps.

Writes ``gpu_offline_h100.json`` (everything, with provenance) and the profile text files to ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from minisgl_ref.bench import offline as bo
from minisgl_ref.bench.provenance import collect_provenance
from minisgl_ref.bench.workloads import canonical_workload

MODEL = "qwen3-0.6b"
PARTS = ("bandwidth", "steps", "canonical", "ladder", "profile")


def log(msg: str) -> None:
    print(f"[suite {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def model_spec() -> bo.ModelSpec:
    return bo.resolve_model(MODEL, "dummy", quick=False, dtype="bfloat16", device="cuda")


def make_llm(**engine_kwargs):  # type: ignore[no-untyped-def]
    from minisgl_ref.llm import LLM

    return LLM(MODEL, load_format="dummy", dtype="bfloat16", device="cuda", **engine_kwargs)


def canonical_in_decode(llm):  # type: ignore[no-untyped-def]
    """Queue the canonical workload on ``llm``'s engine and step until every prompt is prefilled; returns the
    engine, in its decode phase."""
    from minisgl_ref import SamplingParams

    engine = llm.engine
    wl = canonical_workload()
    for prompt, params in zip(wl.prompts, wl.sampling_params):
        engine.add_request(llm.make_request(prompt, SamplingParams(**params)))
    while engine.scheduler.waiting or engine.scheduler.chunked:
        engine.step()
    return engine


def release() -> None:
    """Hand a dropped engine's memory back (call after ``del llm``): the next engine sizes its KV pool from
    what is free."""
    bo._free_device_memory(torch.device("cuda"))


# ------------------------------------------------------------------------------------------------ bandwidth


def copy_bandwidth(gib: float = 2.0, reps: int = 20) -> float:
    """Median bytes/s of a large device-to-device copy, counting bytes read plus bytes written."""
    n = int(gib * (1 << 30)) // 4
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 4 / statistics.median(times)


# ---------------------------------------------------------------------------------------------- step times


def _fill_decode(llm, bs: int, ctx: int):  # type: ignore[no-untyped-def]
    """``bs`` requests prefilled to ``ctx`` tokens; returns a prepared decode ForwardBatch for all of them."""
    from minisgl_ref import SamplingParams

    engine = llm.engine
    g = torch.Generator().manual_seed(bs)
    reqs = []
    for _ in range(bs):
        prompt = torch.randint(0, 10000, (ctx,), generator=g).tolist()
        req = llm.make_request(prompt, SamplingParams(max_new_tokens=4096, temperature=0.0, ignore_eos=True))
        engine.add_request(req)
        reqs.append(req)
    while engine.scheduler.waiting or engine.scheduler.chunked:
        engine.step()
    batch = engine.scheduler.schedule()
    assert batch is not None and batch.is_decode and len(batch.reqs) == bs, "expected one decode batch"
    return batch, engine.runner.prepare(batch)


def _empty_decode(llm, batch) -> None:  # type: ignore[no-untyped-def]
    """Abort the requests :func:`_fill_decode` made, run the engine dry and empty the radix cache."""
    for req in batch.reqs:
        llm.engine.abort(req)
    while llm.engine.has_work:
        llm.engine.step()
    llm.engine.flush_cache()


def _time_forward(runner, fb, iters: int) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        runner.forward(fb)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        runner.forward(fb)
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / iters  # ms per step, host launch gaps included


def decode_step_times(batch_sizes: list[int], ctx: int = 512, iters: int = 50, backend: str | None = None,
                      eager: bool = True) -> list[dict]:
    """Decode forward time per step, graph and (if ``eager``) eager, with ``backend`` for decode (None: the
    default)."""
    llm = make_llm(disable_overlap_schedule=True, cuda_graph_max_bs=max(batch_sizes), max_running_requests=256,
                   decode_attention_backend=backend)
    runner = llm.engine.runner
    graphs = runner.graph_runners
    out = []
    for bs in batch_sizes:
        batch, fb = _fill_decode(llm, bs, ctx)
        graph_ms = _time_forward(runner, fb, iters)
        eager_ms = None
        if eager:
            runner.graph_runners = []
            eager_ms = _time_forward(runner, fb, iters)
            runner.graph_runners = graphs
        row = {"batch_size": bs, "context": ctx, "graph_ms": graph_ms, "eager_ms": eager_ms,
               "speedup": eager_ms / graph_ms if eager_ms else None, "decode_backend": backend or "default"}
        log(f"decode step [{backend or 'default'}] bs={bs}: eager {eager_ms or 0:.3f} ms, graph {graph_ms:.3f} ms")
        out.append(row)
        _empty_decode(llm, batch)
    info = {"attention_backend": type(runner.attn_backend).__name__,
            "capture_seconds": getattr(graphs, "capture_seconds", None)}
    del runner, graphs, batch, fb, llm
    release()
    return [dict(r, **info) for r in out]


# ------------------------------------------------------------------------------------------------ throughput


def run_one(label: str, workload, engine_kwargs: dict, bandwidth: float, stage: str = "custom",
            engine: str = "paged") -> dict:
    try:
        return _run_one(label, workload, engine_kwargs, bandwidth, stage, engine)
    except Exception as exc:  # noqa: BLE001 - one failed configuration must not lose the rest of the call
        import traceback

        traceback.print_exc()
        log(f"{label}: FAILED {type(exc).__name__}: {exc}")
        bo._free_device_memory(torch.device("cuda"))
        return {"label": label, "error": f"{type(exc).__name__}: {exc}", "workload_requests": workload.num_requests,
                "output_throughput": 0.0, "roofline_fraction": None}


def _run_one(label: str, workload, engine_kwargs: dict, bandwidth: float, stage: str, engine: str) -> dict:
    t0 = time.time()
    if stage == "custom":
        result = bo.run_stage("custom", workload, model_spec(), engine_kwargs, bandwidth=bandwidth, engine=engine)
    else:
        result = bo.run_stage(stage, workload, model_spec(), engine_kwargs, bandwidth=bandwidth)
    row = asdict(result)
    row.update(label=label, workload_requests=workload.num_requests, build_and_run_s=time.time() - t0)
    log(f"{label:<40} {workload.num_requests:>4} reqs  {result.output_throughput:>10,.1f} out tok/s  "
        f"wall {result.wall_s:7.2f} s  floor {100 * (result.roofline_fraction or 0):5.1f}%")
    return row


def ladder(bandwidth: float, small_n: int, small_out: int, rows: list, save) -> None:  # type: ignore[no-untyped-def]
    """Append one row per run to ``rows`` (calling ``save`` after each, so a cut-off run keeps what it has)."""

    def add(row: dict | None) -> None:
        if row is not None:
            rows.append(row)
            save()

    small = canonical_workload(small_n, output_len=(100, small_out))
    add(run_one("naive (oracle)", small, {}, bandwidth, stage="naive"))
    base = {"attention_backend": "torch_native", "disable_cuda_graph": True}
    for stage in ("paged", "radix", "chunked", "overlap"):
        add(run_one(f"{stage} / torch_native", small, base, bandwidth, stage=stage))
    add(run_one("overlap / default backends / graphs on", small, {}, bandwidth, stage="overlap"))
    full = canonical_workload()
    for backend, extra in (("triton", {"attention_backend": "triton"}),
                           ("flashinfer", {"attention_backend": "flashinfer"}),
                           ("fa3+flashinfer (default)", {})):
        for graphs in (False, True):
            kw = dict(extra, disable_cuda_graph=not graphs)
            add(run_one(f"overlap / {backend} / graphs {'on' if graphs else 'off'}", full, kw, bandwidth))
    # the fused element-wise kernels off (plain PyTorch RMSNorm / SiLU / RoPE), everything else default
    from minisgl_ref.perf import fused_ops

    os.environ["MINISGL_FUSED"] = "0"
    fused_ops._flashinfer.cache_clear()
    try:
        add(run_one("overlap / default / graphs on / fused ops off", full, {}, bandwidth))
    finally:
        os.environ["MINISGL_FUSED"] = "1"
        fused_ops._flashinfer.cache_clear()


# ------------------------------------------------------------------------------------------------- profile


def _kernel_table(prof, title: str, rows: int = 30) -> str:
    by_cuda = prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70)
    by_cpu = prof.key_averages().table(sort_by="cpu_time_total", row_limit=20, max_name_column_width=70)
    return f"{title}\n\n== by CUDA time ==\n{by_cuda}\n\n== by CPU time ==\n{by_cpu}\n"


def _gpu_busy_ms(prof) -> float:
    """Sum of the GPU time of all kernels and copies in a profile (overlapping kernels counted twice: we run one
    stream, so there are none)."""
    return sum(e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA") / 1e3


def profile(out_dir: Path) -> dict:
    """(1) kernel table of eager decode steps at batch 256, context 512; (2) the canonical workload in its
    decode phase with the default engine: kernel table of 10 engine steps, GPU busy time vs wall time, and a
    cProfile of the engine's host code over 100 steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    result: dict = {}
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    # (1) eager forward at batch 256: which kernels a decode step is made of
    llm = make_llm(disable_overlap_schedule=True, disable_cuda_graph=True)
    batch, fb = _fill_decode(llm, 256, 512)
    runner = llm.engine.runner
    for _ in range(3):
        runner.forward(fb)
    torch.cuda.synchronize()
    with tprofile(activities=acts) as prof:
        for _ in range(3):
            runner.forward(fb)
        torch.cuda.synchronize()
    (out_dir / "profile_forward_bs256_eager.txt").write_text(
        _kernel_table(prof, "3 eager decode forwards (metadata + model + logits), batch 256, context 512"))
    result["eager_bs256_gpu_ms_per_forward"] = _gpu_busy_ms(prof) / 3
    result["eager_bs256_kernels_per_forward"] = sum(
        e.count for e in prof.key_averages() if e.device_type.name == "CUDA" and not e.key.startswith("Memcpy")
        and not e.key.startswith("Memset")) / 3
    del batch, fb, runner, prof, llm
    release()

    # (2) the canonical workload, default engine, in its decode phase
    llm = make_llm()
    engine = canonical_in_decode(llm)
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    n = 10
    t0 = time.perf_counter()
    with tprofile(activities=acts) as prof:
        for _ in range(n):
            engine.step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / n * 1e3
    running = len(engine.scheduler.running)
    (out_dir / "profile_canonical_decode.txt").write_text(
        _kernel_table(prof, f"{n} engine steps of the canonical workload, {running} running, default engine"))
    result["canonical_decode"] = {"running": running, "wall_ms_per_step_profiled": wall,
                                  "gpu_busy_ms_per_step": _gpu_busy_ms(prof) / n}
    t0 = time.perf_counter()
    for _ in range(50):
        engine.step()
    torch.cuda.synchronize()
    result["canonical_decode"]["wall_ms_per_step"] = (time.perf_counter() - t0) / 50 * 1e3
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    for _ in range(100):
        engine.step()
    pr.disable()
    torch.cuda.synchronize()
    result["canonical_decode"]["wall_ms_per_step_cprofile"] = (time.perf_counter() - t0) * 10
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(40)
    (out_dir / "host_profile.txt").write_text(
        f"cProfile of 100 engine steps (canonical, decode phase, {len(engine.scheduler.running)} running)\n"
        + buf.getvalue())
    log(f"profile: {result}")
    del engine, prof, pr, llm
    release()
    return result


# ----------------------------------------------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--out", default=os.environ.get("OUT", "results"))
    p.add_argument("--small-n", type=int, default=8, help="requests of the reduced ladder workload")
    p.add_argument("--small-out", type=int, default=256, help="longest output of the reduced workload")
    p.add_argument("--step-backends", default="", help="also time graphed decode per backend, e.g. fa3,triton")
    p.add_argument("--step-bs", default="1,8,64,256")
    args = p.parse_args()
    parts = args.parts.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"benchmark": "gpu_offline", "model": MODEL, "dtype": "bfloat16", "load_format": "dummy",
                    "provenance": collect_provenance(sys.argv), "parts": parts,
                    "fused_ops": os.environ.get("MINISGL_FUSED", "1") != "0"}
    path = out / "gpu_offline_h100.json"

    def save() -> None:
        path.write_text(json.dumps(report, indent=2) + "\n")

    bw = bo.H100_MEASURED_BANDWIDTH
    if "bandwidth" in parts:
        bw = copy_bandwidth()
        report["copy_bandwidth_Bps"] = bw
        log(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    report["roofline_bandwidth_Bps"] = bw
    wl = canonical_workload()
    cfg = make_llm_config()
    report["roofline_floor_s"] = bo.workload_floor_seconds(wl, cfg, bw)
    report["roofline_floor_s_datasheet"] = bo.workload_floor_seconds(wl, cfg, 3.35e12)
    report["canonical_output_tokens"] = wl.output_tokens
    save()
    if "steps" in parts:
        sizes = [int(x) for x in args.step_bs.split(",")]
        report["decode_steps"] = decode_step_times(sizes)
        save()
        if args.step_backends:
            report["decode_steps_by_backend"] = [row for b in args.step_backends.split(",")
                                                 for row in decode_step_times(sizes, backend=b, eager=False)]
            save()
    if "canonical" in parts:
        # An untimed full-length warm-up first: kernels for large prefill shapes compile on first use (Triton,
        # FlashInfer JIT, torch.compile), and the engine's own 4-request warm-up does not reach them.
        run_one("warm-up (untimed): 32 canonical requests", canonical_workload(32), {}, bw)
        row = run_one("full engine (defaults)", wl, {}, bw)
        report["canonical"] = row
        save()
        # The same run again (the spread between two runs of one process), then once with the step's tokens
        # read by a plain .tolist() instead of the event-guarded pinned copy: what chapter 06's "wait on the
        # right event" buys, measured in this run.
        report["canonical_repeat"] = run_one("full engine (defaults), again", wl, {}, bw)
        save()
        from minisgl_ref.engine.model_runner import StepOutput

        tokens = StepOutput.tokens
        StepOutput.tokens = lambda self: self.next_tokens.tolist()  # type: ignore[method-assign]
        try:
            report["canonical_sync_tokens"] = run_one("full engine, tokens by tolist() (no copy event)", wl, {}, bw)
        finally:
            StepOutput.tokens = tokens  # type: ignore[method-assign]
        save()
        # ... and once without our two Triton per-token kernels (QK-norm + RoPE, KV store): the FlashInfer norm /
        # RoPE kernels and PyTorch indexing do that work instead, as before those kernels existed.
        from minisgl_ref.perf import triton_ops

        available = triton_ops.available
        triton_ops.available = lambda x: False  # type: ignore[assignment]
        try:
            report["canonical_no_triton_fused"] = run_one("full engine, Triton per-token kernels off", wl, {}, bw)
        finally:
            triton_ops.available = available  # type: ignore[assignment]
        save()
    if "ladder" in parts:
        report["ladder_note"] = (f"rows marked workload_requests={args.small_n} use a reduced workload: the canonical "
                                 f"recipe with {args.small_n} requests and outputs of 100-{args.small_out} tokens "
                                 "(canonical_workload(n, output_len=...)), so that the naive oracle and the "
                                 "torch_native stages fit in one run; the other rows run the full 256-request "
                                 "canonical workload")
        report["ladder"] = []
        ladder(bw, args.small_n, args.small_out, report["ladder"], save)
    if "profile" in parts:
        try:
            report["profile"] = profile(out)
        except Exception as exc:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            report["profile"] = {"error": f"{type(exc).__name__}: {exc}"}
        save()
    log(f"wrote {path}")
    if "canonical" in report:
        c = report["canonical"]
        print(f"\ncanonical: {c['output_throughput']:,.0f} out tok/s, {100 * (c['roofline_fraction'] or 0):.1f}% of the "
              f"floor ({report['roofline_floor_s']:.2f} s at {bw / 1e12:.2f} TB/s)")
        for key in ("canonical_repeat", "canonical_sync_tokens", "canonical_no_triton_fused"):
            if key in report:
                print(f"{report[key]['label']}: {report[key]['output_throughput']:,.0f} out tok/s")
    for r in report.get("decode_steps", []):
        print(f"decode bs={r['batch_size']:>3}: eager {r['eager_ms']:.3f} ms  graph {r['graph_ms']:.3f} ms  "
              f"x{r['speedup']:.2f}")
    for r in report.get("decode_steps_by_backend", []):
        print(f"decode [{r['decode_backend']:>10}] bs={r['batch_size']:>3}: graph {r['graph_ms']:.3f} ms")
    for r in report.get("ladder", []):
        print(f"{r['label']:<42} {r['output_throughput']:>10,.1f} tok/s  {100 * (r['roofline_fraction'] or 0):5.1f}%")
    return 0


def make_llm_config():  # type: ignore[no-untyped-def]
    """Qwen3-0.6B's shipped config, in bf16 (the roofline counts bytes in the dtype that runs)."""
    import dataclasses

    from minisgl_ref.models.config import ModelConfig
    from minisgl_ref.models.loader import resolve_model_path

    cfg = ModelConfig.from_file(resolve_model_path(MODEL, "dummy").config_file)
    return dataclasses.replace(cfg, dtype=torch.bfloat16)


if __name__ == "__main__":
    sys.exit(main())
