"""``python -m benchmarks.overlap_decode``: can a decode step hide its fixed cost under attention? (chapter 11)

A decode step of the canonical workload is two kinds of work. Attention reads every running request's KV cache
and is limited by memory bandwidth; it scales with the batch. Everything else -- four matrix multiplies per layer,
the norms, the activation, the LM head -- reads the 1.2 GB of weights in ~140 short kernels and costs about the
same ~1.5 ms whatever the batch, because short kernels spend much of their time starting and draining, not
streaming. In one stream the two kinds run one after the other.

This benchmark rebuilds a Qwen3-0.6B-shaped decode step (28 layers, random weights, FlashInfer's decode kernel on
pages of one token, the running requests' context lengths at stages of the canonical workload) and times it
four ways, each captured as one CUDA graph:

- ``serial``: the whole batch in one stream, what the engine runs;
- ``halves``: the batch cut into two halves run one after the other in one stream (the cost of reading the
  weights twice, with nothing gained);
- ``overlap``: the two halves in two streams, ordered so that the attention of one half always runs while the
  other half does its matrix multiplies: half A's attention of layer l waits for half B's attention of layer l-1,
  and B's of layer l for A's of layer l. The attentions never compete with each other for bandwidth, and each
  half's weight-bound work fills the other half's attention time;
- ``free``: the two halves in two streams with no ordering between them (the GPU interleaves as it likes).

It also times the step without attention (``no_attention``) and attention alone (``attention_only``) on the whole
batch: what overlapping could at best hide. The overlap variants' final hidden states are compared with
``serial``'s (relative error; bf16 GEMMs cut differently at half the rows round differently).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from benchmarks.decode_balance import HEAD_DIM, KV_BYTES_PER_TOKEN, NUM_KV_HEADS, NUM_Q_HEADS, canonical_stages

HIDDEN, INTERMEDIATE, VOCAB, LAYERS = 1024, 3072, 151936, 28  # Qwen3-0.6B
DTYPE, DEVICE, EPS = torch.bfloat16, "cuda", 1e-6
KV_BUFFERS = 4  # distinct KV pools cycled over the layers: each is far larger than L2, so reuse cannot help
VARIANTS = ("serial", "halves", "overlap", "free", "no_attention", "attention_only")


class Weights:
    """One random bf16 model of Qwen3-0.6B's decode shapes."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator(DEVICE).manual_seed(seed)

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g, device=DEVICE, dtype=DTYPE) * shape[-1] ** -0.5

        q, kv = NUM_Q_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
        self.layers = [dict(qkv=w(q + 2 * kv, HIDDEN), o=w(HIDDEN, q), gate_up=w(2 * INTERMEDIATE, HIDDEN),
                            down=w(HIDDEN, INTERMEDIATE), n1=torch.ones(HIDDEN, device=DEVICE, dtype=DTYPE),
                            n2=torch.ones(HIDDEN, device=DEVICE, dtype=DTYPE)) for _ in range(LAYERS)]  # fmt: skip
        self.final_norm = torch.ones(HIDDEN, device=DEVICE, dtype=DTYPE)
        self.lm_head = w(VOCAB, HIDDEN)
        self.bytes = sum(t.numel() * 2 for d in self.layers for t in d.values()) + self.lm_head.numel() * 2


class Part:
    """A set of running requests (rows) with its own planned FlashInfer graph wrapper and its own activations."""

    def __init__(self, lens: list[int], starts: list[int], hidden: torch.Tensor) -> None:
        import flashinfer

        b = len(lens)
        self.b = b
        indptr = torch.zeros(b + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
        indices = torch.cat([torch.arange(s, s + n, dtype=torch.int32) for s, n in zip(starts, lens)]).to(DEVICE)
        ws = torch.zeros(128 << 20, dtype=torch.uint8, device=DEVICE)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True,
            paged_kv_indptr_buffer=torch.zeros(b + 1, dtype=torch.int32, device=DEVICE),
            paged_kv_indices_buffer=torch.zeros(indices.numel(), dtype=torch.int32, device=DEVICE),
            paged_kv_last_page_len_buffer=torch.ones(b, dtype=torch.int32, device=DEVICE),
        )  # fmt: skip
        self.wrapper.plan(indptr, indices, torch.ones(b, dtype=torch.int32), NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, 1,
                          q_data_type=DTYPE, kv_data_type=DTYPE, sm_scale=HEAD_DIM**-0.5)  # fmt: skip
        self.input = hidden
        self.h = hidden
        self.res = hidden
        self.q: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None


class Step:
    """The decode step's work, layer by layer, split at the attention call."""

    def __init__(self, weights: Weights, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        import flashinfer

        self.w, self.caches, self.fi = weights, caches, flashinfer

    def begin(self, p: Part) -> None:
        # allocated inside the captured function, so every activation lives in that graph's memory pool
        p.h = p.input.clone()
        p.res = torch.zeros_like(p.input)

    def pre_attention(self, p: Part, layer: int) -> None:
        d = self.w.layers[layer]
        self.fi.norm.fused_add_rmsnorm(p.h, p.res, d["n1"], EPS)  # res += h; h = norm(res)
        qkv = F.linear(p.h, d["qkv"])
        # stands in for the engine's one fused QK-norm + RoPE (+ KV store) kernel
        p.q = (qkv[:, : NUM_Q_HEADS * HEAD_DIM] * 1.0001).view(p.b, NUM_Q_HEADS, HEAD_DIM)

    def attention(self, p: Part, layer: int) -> None:
        cache = self.caches[layer % len(self.caches)]
        p.h = p.wrapper.run(p.q, cache).view(p.b, NUM_Q_HEADS * HEAD_DIM)

    def post_attention(self, p: Part, layer: int) -> None:
        d = self.w.layers[layer]
        p.h = F.linear(p.h, d["o"])
        self.fi.norm.fused_add_rmsnorm(p.h, p.res, d["n2"], EPS)
        p.h = F.linear(self.fi.activation.silu_and_mul(F.linear(p.h, d["gate_up"])), d["down"])

    def end(self, p: Part) -> None:
        self.fi.norm.fused_add_rmsnorm(p.h, p.res, self.w.final_norm, EPS)
        p.logits = F.linear(p.h, self.w.lm_head)

    def serial(self, parts: list[Part], attention: bool = True, rest: bool = True) -> None:
        for p in parts:
            self.begin(p)
            for layer in range(LAYERS):
                if rest or p.q is None:  # attention_only reuses the query of an earlier call
                    self.pre_attention(p, layer)
                if attention:
                    self.attention(p, layer)
                else:  # the attention's output shape, without reading the KV cache
                    p.h = p.q.reshape(p.b, NUM_Q_HEADS * HEAD_DIM)
                if rest:
                    self.post_attention(p, layer)
            if rest:
                self.end(p)

    def two_streams(self, a: Part, b: Part, streams: tuple[torch.cuda.Stream, torch.cuda.Stream],
                    ordered: bool) -> None:  # fmt: skip
        sa, sb = streams
        here = torch.cuda.current_stream()
        sa.wait_stream(here)
        sb.wait_stream(here)
        done_a = [torch.cuda.Event() for _ in range(LAYERS)]
        done_b = [torch.cuda.Event() for _ in range(LAYERS)]
        with torch.cuda.stream(sa):
            self.begin(a)
        with torch.cuda.stream(sb):
            self.begin(b)
        for layer in range(LAYERS):
            with torch.cuda.stream(sa):
                self.pre_attention(a, layer)
                if ordered and layer > 0:
                    sa.wait_event(done_b[layer - 1])
                self.attention(a, layer)
                done_a[layer].record(sa)
                self.post_attention(a, layer)
            with torch.cuda.stream(sb):
                self.pre_attention(b, layer)
                if ordered:
                    sb.wait_event(done_a[layer])
                self.attention(b, layer)
                done_b[layer].record(sb)
                self.post_attention(b, layer)
        with torch.cuda.stream(sa):
            self.end(a)
        with torch.cuda.stream(sb):
            self.end(b)
        here.wait_stream(sa)
        here.wait_stream(sb)


def split_balanced(lens: list[int]) -> tuple[list[int], list[int]]:
    """Two halves of the rows with (nearly) equal context tokens: the longest first, each to the lighter half."""
    a, b, ta, tb = [], [], 0, 0
    for i in sorted(range(len(lens)), key=lambda i: -lens[i]):
        if (ta <= tb and len(a) < (len(lens) + 1) // 2) or len(b) >= len(lens) // 2:
            a.append(i)
            ta += lens[i]
        else:
            b.append(i)
            tb += lens[i]
    return sorted(a), sorted(b)


def capture(fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
    fn()  # eager once: FlashInfer and cuBLAS pick their kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_replays(graph: torch.cuda.CUDAGraph, repeats: int) -> float:
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(lens: list[int], weights: Weights, repeats: int, names: tuple[str, ...]) -> dict[str, Any]:
    total = sum(lens)
    g = torch.Generator(DEVICE).manual_seed(len(lens))
    caches = [(torch.randn(total + 1, 1, NUM_KV_HEADS, HEAD_DIM, generator=g, device=DEVICE, dtype=DTYPE),
               torch.randn(total + 1, 1, NUM_KV_HEADS, HEAD_DIM, generator=g, device=DEVICE, dtype=DTYPE))
              for _ in range(KV_BUFFERS)]  # fmt: skip
    starts = [1 + sum(lens[:i]) for i in range(len(lens))]
    hidden = torch.randn(len(lens), HIDDEN, generator=g, device=DEVICE, dtype=DTYPE)
    step = Step(weights, caches)
    whole = Part(lens, starts, hidden)
    ia, ib = split_balanced(lens)
    half_a = Part([lens[i] for i in ia], [starts[i] for i in ia], hidden[ia].contiguous())
    half_b = Part([lens[i] for i in ib], [starts[i] for i in ib], hidden[ib].contiguous())
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    run: dict[str, Callable[[], None]] = {
        "serial": lambda: step.serial([whole]),
        "halves": lambda: step.serial([half_a, half_b]),
        "overlap": lambda: step.two_streams(half_a, half_b, streams, ordered=True),
        "free": lambda: step.two_streams(half_a, half_b, streams, ordered=False),
        "no_attention": lambda: step.serial([whole], attention=False),
        "attention_only": lambda: step.serial([whole], rest=False),
    }
    order = torch.tensor(ia + ib, device=DEVICE)
    row: dict[str, Any] = {"running": len(lens), "context_tokens": total, "halves": [len(ia), len(ib)],
                           "half_tokens": [sum(lens[i] for i in ia), sum(lens[i] for i in ib)],
                           "kv_bytes_per_step": total * KV_BYTES_PER_TOKEN * LAYERS, "ms": {}, "rel_error": {}}  # fmt: skip
    reference = None
    for name in names:
        try:
            graph = capture(run[name])
            row["ms"][name] = round(time_replays(graph, repeats), 4)
            if name == "serial":
                reference = whole.logits.float()
            elif name in ("halves", "overlap", "free") and reference is not None:
                got = torch.cat([half_a.logits, half_b.logits]).float()
                ref = reference[order]
                row["rel_error"][name] = float((got - ref).norm() / ref.norm())
            del graph
        except Exception as e:  # one variant failing must not lose the others' numbers
            row.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:400]
        print(f"  {name:<15} {row['ms'].get(name, float('nan')):8.3f} ms  "
              f"{row['rel_error'].get(name, '')} {row.get('errors', {}).get(name, '')}", flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.overlap_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True, help="JSON file, rewritten after every stage")
    p.add_argument("--marks", default="256,128,64,32")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise ValueError("benchmarks.overlap_decode needs a CUDA device")
    from benchmarks.kernels import copy_bandwidth
    from minisgl_ref.bench.provenance import collect_provenance, package_version

    t0 = time.perf_counter()
    copy_bw = copy_bandwidth(nbytes=1 << 30, warmup_s=2.0)
    weights = Weights()
    names = tuple(n for n in args.variants.split(",") if n)
    result: dict[str, Any] = {
        "benchmark": "overlap_decode", "what": __doc__.split("\n\n")[0],
        "copy_bandwidth_GBps": round(copy_bw / 1e9, 1), "weight_bytes": weights.bytes, "stages": [],
        "provenance": collect_provenance(variants=list(names), repeats=args.repeats, kernel_packages={
            "flashinfer-python": package_version("flashinfer-python")}),
    }  # fmt: skip
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    for mark, lens in canonical_stages(tuple(int(m) for m in args.marks.split(","))).items():
        print(f"{len(lens)} running, {sum(lens):,} context tokens", flush=True)
        row = measure(lens, weights, args.repeats, names)
        row["kv_floor_ms_at_copy_bw"] = round(row["kv_bytes_per_step"] / copy_bw * 1e3, 3)
        result["stages"].append(row)
        result["elapsed_s"] = round(time.perf_counter() - t0, 1)
        out.write_text(json.dumps(result, indent=1) + "\n")
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
