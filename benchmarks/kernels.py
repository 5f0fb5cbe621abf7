"""``python -m benchmarks.kernels``: attention kernels alone, against the memory roofline (chapter 07).

Decode attention reads each request's whole KV cache once per step and does two small matrix-vector products
per key, so it is *memory bound*: the fastest possible kernel streams the KV bytes at the device's memory
bandwidth. This benchmark therefore reports, for every backend and shape,

- the kernel time (CUDA events around a CUDA-graph replay of many calls, so launch overhead is not in it;
  warm-up first, the median of many repetitions),
- the achieved bandwidth ``(KV bytes read + q bytes + o bytes) / time``, and that as a fraction of the
  device-to-device copy bandwidth measured *in the same run* (a copy reads and writes every byte once: the
  practical ceiling, ~3.0 TB/s on an H100 SXM whose datasheet says 3.35),
- our Triton kernel's throughput as a fraction of FlashInfer's on the same shape.

Prefill (extend) attention is compute bound (each key is used by many queries), so it is reported in TFLOP/s
(``4 x heads x head_dim`` flops per visible query-key pair, causal pairs only) next to a measured bf16 matmul.

Shapes are Qwen3-0.6B's attention: 16 query heads, 8 KV heads (GQA 2), head dim 128, bf16; other GQA ratios
keep 16 query heads. Each request's context lies in consecutive pool slots (a fresh engine's layout); the
backends read it through their own per-step metadata exactly as in the engine, with pages of one token. The new
tokens' K/V are stored beforehand and the store is left out of the timing: only attention is measured.

Results go to a JSON file with :mod:`~minisgl_ref.bench.provenance` (``docs/data/gpu_kernels_h100.json`` is the
committed H100 run that chapter 07 plots). Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch

NUM_Q_HEADS = 16
HEAD_DIM = 128
DTYPE = torch.bfloat16
DECODE_BATCHES = (1, 8, 32, 64, 128, 256)
DECODE_CONTEXTS = (512, 1024, 2048, 4096, 8192)
GQA_RATIOS = (1, 2, 4, 8)
TARGET = dict(batch=64, context=2048, gqa=2)  # the target: triton >= 80% of flashinfer here
# (batch, cached prefix per request, new tokens per request)
PREFILL_SHAPES = ((1, 0, 1024), (1, 0, 4096), (1, 0, 8192), (8, 0, 1024), (4, 2048, 512), (16, 1000, 100),
                  (64, 100, 64))  # fmt: skip


def add_kernels_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", default="triton,flashinfer,fa3", help="comma-separated backends to time")
    p.add_argument("--output", default=None, help="write the results (with provenance) to this JSON file")
    p.add_argument("--quick", action="store_true", help="a few shapes only (a smoke test)")
    p.add_argument("--repeats", type=int, default=50, help="timed graph replays per shape (median reported)")


# ------------------------------------------------------------------------------------------------ timing


def time_graph(fn: Callable[[], Any], calls_per_graph: int = 10, repeats: int = 50) -> tuple[float, str]:
    """Median seconds per ``fn()`` call. ``fn`` is captured ``calls_per_graph`` times into one CUDA graph and
    the graph is replayed ``repeats`` times between CUDA events. Falls back to timing eager calls with events
    when ``fn`` cannot be captured. Returns (seconds, method)."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls_per_graph):
                fn()
        runner, per_call, method = graph.replay, calls_per_graph, "cuda_graph"
    except RuntimeError:
        torch.cuda.synchronize()
        runner, per_call, method = fn, 1, "eager"
    for _ in range(3):
        runner()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runner()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / per_call)
    return statistics.median(times), method


def copy_bandwidth(nbytes: int = 2 << 30, warmup_s: float = 2.0) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written (buffers far larger
    than the L2 cache). The GPU is kept busy for ``warmup_s`` first: an idle GPU starts at a low clock, and a
    ceiling measured before it ramps up would be too low."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(10):
            dst.copy_(src)
        end.record()
        end.synchronize()
        if start.elapsed_time(end) > warmup_s * 1e3:
            break
    seconds, _ = time_graph(lambda: dst.copy_(src), calls_per_graph=5, repeats=30)
    del src, dst
    return 2 * nbytes / seconds


def matmul_flops(n: int = 8192) -> float:
    a = torch.randn(n, n, dtype=DTYPE, device="cuda")
    b = torch.randn(n, n, dtype=DTYPE, device="cuda")
    seconds, _ = time_graph(lambda: a @ b, calls_per_graph=5, repeats=20)
    return 2 * n**3 / seconds


# ------------------------------------------------------------------------------------------------ problems


class Problem:
    """One attention call laid out as the engine lays it out: a one-layer KV pool, a page table, a forward
    batch. Request ``b``'s context occupies consecutive slots; slot 0 stays the reserved dummy."""

    def __init__(self, specs: list[tuple[int, int]], num_kv_heads: int, decode: bool, seed: int = 0) -> None:
        from minisgl_ref.core.forward_batch import ForwardBatch, ForwardMode
        from minisgl_ref.kvcache.pool import KVPool
        from minisgl_ref.kvcache.req_to_token import ReqToTokenPool
        from minisgl_ref.layers.attention import AttentionLayer

        dev = "cuda"
        gen = torch.Generator(dev).manual_seed(seed)
        total = sum(p + e for p, e in specs)
        self.pool = KVPool(1, total + 1, num_kv_heads, HEAD_DIM, DTYPE, dev)
        self.pool.k[0].normal_(generator=gen)
        self.pool.v[0].normal_(generator=gen)
        self.table = ReqToTokenPool(len(specs), max(p + e for p, e in specs), dev)
        new_slots, start = [], 1
        for row, (prefix, extend) in enumerate(specs):
            slots = torch.arange(start, start + prefix + extend, dtype=torch.int64)
            self.table.write(row, 0, slots)
            new_slots.append(slots[prefix:])
            start += prefix + extend
        num_tokens = sum(e for _, e in specs)
        self.q = torch.randn(num_tokens, NUM_Q_HEADS, HEAD_DIM, generator=gen, device=dev, dtype=DTYPE)
        out_cache_loc = torch.cat(new_slots).to(dev)
        self.k = self.pool.k[0][out_cache_loc].clone()  # the new tokens' K/V are already in the pool
        self.v = self.pool.v[0][out_cache_loc].clone()
        self.layer = AttentionLayer(0, NUM_Q_HEADS, num_kv_heads, HEAD_DIM)
        self.batch = ForwardBatch(
            mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=dev),
            positions=torch.zeros(num_tokens, dtype=torch.int64, device=dev),
            extend_lens_cpu=[e for _, e in specs],
            prefix_lens_cpu=[p for p, _ in specs],
            attn_backend=None,  # type: ignore[arg-type]
            req_pool_indices=torch.arange(len(specs), device=dev),
            out_cache_loc=out_cache_loc,
        )
        kv_tokens = total
        elem = torch.finfo(DTYPE).bits // 8
        self.bytes = (2 * kv_tokens * num_kv_heads * HEAD_DIM + 2 * num_tokens * NUM_Q_HEADS * HEAD_DIM) * elem
        pairs = sum(e * p + e * (e + 1) // 2 for p, e in specs)  # causal: visible query-key pairs
        self.flops = 4 * NUM_Q_HEADS * HEAD_DIM * pairs

    def runner(self, name: str) -> Callable[[], torch.Tensor]:
        """Build backend ``name`` on this problem, plan once, return the per-layer call to time."""
        from minisgl_ref.attention.registry import build_backend

        backend = build_backend(name, self.pool, self.table, num_q_heads=NUM_Q_HEADS, page_size=1,
                                device=torch.device("cuda"))  # fmt: skip
        self.batch.attn_backend = backend
        backend.init_forward_metadata(self.batch)
        # attend_* and not forward: time attention, not the K/V store that forward does first
        if self.batch.mode.is_decode:
            return lambda: backend.attend_decode(self.q, self.layer, self.batch)
        return lambda: backend.attend_extend(self.q, self.k, self.v, self.layer, self.batch)


def measure(problem: Problem, names: list[str], repeats: int, copy_bw: float, peak_flops: float,
            **shape: int) -> list[dict[str, Any]]:  # fmt: skip
    rows = []
    for name in names:
        try:
            seconds, method = time_graph(problem.runner(name), repeats=repeats)
        except Exception as e:  # one backend failing must not lose the others' numbers
            rows.append({"backend": name, **shape, "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        rows.append({
            "backend": name, **shape, "time_us": round(seconds * 1e6, 3), "timing": method,
            "bytes": problem.bytes, "bandwidth_GBps": round(problem.bytes / seconds / 1e9, 1),
            "fraction_of_copy_bw": round(problem.bytes / seconds / copy_bw, 4),
            "tflops": round(problem.flops / seconds / 1e12, 2),
            "fraction_of_matmul": round(problem.flops / seconds / peak_flops, 4),
        })  # fmt: skip
    return rows


def ratios(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """Triton throughput / FlashInfer throughput (= flashinfer time / triton time) per shape."""
    by_shape: dict[tuple[int, ...], dict[str, float]] = {}
    for r in rows:
        if "time_us" in r:
            by_shape.setdefault(tuple(r[k] for k in keys), {})[r["backend"]] = r["time_us"]
    out = []
    for shape, times in by_shape.items():
        if "triton" in times and "flashinfer" in times:
            out.append({**dict(zip(keys, shape)), "triton_over_flashinfer": round(times["flashinfer"] / times["triton"], 3)})
    return out


def run(names: list[str], quick: bool, repeats: int, log: Callable[[str], None] = print) -> dict[str, Any]:
    copy_bw = copy_bandwidth()
    peak = matmul_flops()
    log(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write); bf16 matmul {peak / 1e12:.0f} TFLOP/s")
    batches = (1, 64) if quick else DECODE_BATCHES
    contexts = (2048,) if quick else DECODE_CONTEXTS
    decode: list[dict[str, Any]] = []
    points = [(bs, ctx, 2) for bs in batches for ctx in contexts]
    points += [(TARGET["batch"], TARGET["context"], g) for g in GQA_RATIOS if g != 2]
    for bs, ctx, gqa in points:
        problem = Problem([(ctx - 1, 1)] * bs, NUM_Q_HEADS // gqa, decode=True, seed=bs + ctx)
        decode += measure(problem, names, repeats, copy_bw, peak, batch=bs, context=ctx, gqa=gqa)
        del problem
        torch.cuda.empty_cache()
        log("decode " + " ".join(f"{r['backend']}={r.get('bandwidth_GBps', 'ERR')}GB/s" for r in decode[-len(names):])
            + f"  bs={bs} ctx={ctx} gqa={gqa}")  # fmt: skip
    prefill: list[dict[str, Any]] = []
    for bs, prefix, extend in PREFILL_SHAPES[:2] if quick else PREFILL_SHAPES:
        problem = Problem([(prefix, extend)] * bs, NUM_Q_HEADS // 2, decode=False, seed=bs + extend)
        prefill += measure(problem, names, max(10, repeats // 5), copy_bw, peak, batch=bs, prefix=prefix,
                           extend=extend, gqa=2)  # fmt: skip
        del problem
        torch.cuda.empty_cache()
        log("prefill " + " ".join(f"{r['backend']}={r.get('tflops', 'ERR')}TF/s" for r in prefill[-len(names):])
            + f"  bs={bs} prefix={prefix} extend={extend}")  # fmt: skip
    copy_bw_end = copy_bandwidth(warmup_s=0.5)  # once more, after the kernels: the ceiling is the larger
    log(f"copy bandwidth at the end {copy_bw_end / 1e9:.0f} GB/s")
    if copy_bw_end > copy_bw:
        for r in decode + prefill:
            if "bytes" in r:
                r["fraction_of_copy_bw"] = round(r["bandwidth_GBps"] * 1e9 / copy_bw_end, 4)
    decode_ratios = ratios(decode, ("batch", "context", "gqa"))
    target = next((r for r in decode_ratios if all(r[k] == v for k, v in
                                                   (("batch", TARGET["batch"]), ("context", TARGET["context"]),
                                                    ("gqa", TARGET["gqa"])))), None)  # fmt: skip
    return {
        "copy_bandwidth_GBps": round(max(copy_bw, copy_bw_end) / 1e9, 1),
        "copy_bandwidth_GBps_start_end": [round(copy_bw / 1e9, 1), round(copy_bw_end / 1e9, 1)],
        "matmul_tflops": round(peak / 1e12, 1),
        "shapes": dict(num_q_heads=NUM_Q_HEADS, head_dim=HEAD_DIM, dtype=str(DTYPE).replace("torch.", ""),
                       kv_layout="pool [slots, kv_heads, head_dim]; each context in consecutive slots"),
        "decode": decode,
        "prefill": prefill,
        "decode_triton_over_flashinfer": decode_ratios,
        "prefill_triton_over_flashinfer": ratios(prefill, ("batch", "prefix", "extend")),
        "target": {**TARGET, "required": 0.8, "triton_over_flashinfer": target and target["triton_over_flashinfer"]},
    }


def main(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise ValueError("benchmarks.kernels needs a CUDA device (it times GPU attention kernels)")
    from minisgl_ref.attention.registry import check_backend_can_run
    from minisgl_ref.bench.provenance import collect_provenance

    names = [n.strip() for n in args.backends.split(",") if n.strip()]
    usable = []
    for name in names:
        try:
            check_backend_can_run(name, torch.device("cuda"))
            usable.append(name)
        except ValueError as e:
            print(f"skipping {name}: {e}", file=sys.stderr)
    results = run(usable, args.quick, args.repeats)
    from minisgl_ref.bench.provenance import package_version

    kernel_packages = {n: package_version(n) for n in ("triton", "flashinfer-python", "tokenspeed-fa3", "flash-attn")}
    prov = collect_provenance(backends=usable, quick=args.quick, repeats=args.repeats, kernel_packages=kernel_packages)
    out = {"provenance": prov, **results}
    t = results["target"]
    print(f"target bs={t['batch']} ctx={t['context']} gqa={t['gqa']}: triton/flashinfer = "
          f"{t['triton_over_flashinfer']} (required >= {t['required']})")  # fmt: skip
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.split("\n\n")[0])
    add_kernels_args(parser)
    sys.exit(main(parser.parse_args()))
