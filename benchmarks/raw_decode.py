"""``python -m benchmarks.raw_decode``: the decode layer with and without its QK-norm/RoPE kernel (chapter 11).

A decode layer of the engine with its norms folded is seven kernels: ``qkv_proj``, the QK-norm/RoPE/KV-store
kernel, the attention, ``o_proj`` (adding into the residual stream), ``gate_up_proj``, the activation and
``down_proj``. Here the 28 layers of Qwen3-0.6B run as the engine runs them -- the engine's own Triton kernels
and split-KV decode kernel, random weights, each layer its own KV cache holding the canonical workload's contexts
at a few stages -- captured in one CUDA graph and replayed. Two ways:

* ``plain``: the Triton kernel divides q, k and v by the row's rms, applies the QK-norm and RoPE and stores the
  new K/V, then the split-KV kernel attends over the finished q;
* ``raw``: the split-KV kernel takes the raw QKV projection and does all of that itself
  (``SplitDecode.run_raw``): one kernel a layer fewer.

The two graphs are replayed in turn, ``--rounds`` times each, and the median time of a 28-layer step is reported
per stage, with the two attention outputs compared. Writes JSON with provenance:

    python -m benchmarks.raw_decode --output raw_decode.json
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

from benchmarks.decode_balance import (DTYPE, HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS, Stage, canonical_stages,
                                       generated_tokens)  # fmt: skip

HIDDEN, FFN, LAYERS = 1024, 3072, 28
MARKS = (256, 192, 128, 96, 64)
EPS = 1e-6


class Layers:
    """The 28 layers' weights and KV caches, and a decode step's inputs, for the running requests of ``lens``."""

    def __init__(self, lens: list[int], generated: int, device: torch.device) -> None:
        from minisgl_ref.attention.split_decode import SplitDecode

        rows = len(lens)
        g = torch.Generator(device).manual_seed(rows)

        def w(o: int, i: int) -> torch.Tensor:
            return torch.randn(o, i, generator=g, device=device, dtype=DTYPE) * i**-0.5

        q_size, kv_size = NUM_Q_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
        self.weights = [(w(q_size + 2 * kv_size, HIDDEN), w(HIDDEN, q_size), w(2 * FFN, HIDDEN), w(HIDDEN, FFN))
                        for _ in range(LAYERS)]  # fmt: skip
        self.norms = tuple(1 + 0.1 * torch.randn(HEAD_DIM, generator=g, device=device, dtype=DTYPE) for _ in "qk")
        self.caches = [Stage(lens, seed=rows + i, generated=generated) for i in range(LAYERS)]
        st = self.caches[0]  # every layer's cache has its slots in the same places
        self.kv_indices = st.slots(list(range(rows)))
        self.new_slots = torch.tensor([int(s[-1]) for s in st.token_slots], device=device, dtype=torch.int64)
        self.positions = torch.tensor([n - 1 for n in lens], device=device, dtype=torch.int64)
        inv = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, device=device, dtype=torch.float32) / HEAD_DIM))
        angles = torch.arange(max(lens) + 1, device=device, dtype=torch.float32)[:, None] * inv[None, :]
        self.cos, self.sin = angles.cos().contiguous(), angles.sin().contiguous()
        self.x0 = torch.randn(rows, HIDDEN, generator=g, device=device, dtype=DTYPE)
        self.x = self.x0.clone()
        self.split = SplitDecode(num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                                 sm_scale=HEAD_DIM**-0.5, max_batch=rows, device=device)  # fmt: skip
        self.split.plan(lens, self.kv_indices)
        self.last_attention: torch.Tensor | None = None

    def step(self, raw_path: bool) -> None:
        """The 28 layers of one decode step, as ``LlamaDecoderLayer.forward_folded`` runs them."""
        from minisgl_ref.layers.attention import RawDecodeInputs
        from minisgl_ref.layers.triton_fused import qk_norm_rope_, silu_and_mul_rms

        q_size, kv_size = NUM_Q_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
        x = self.x
        x.copy_(self.x0)  # the same input every replay
        for (w_qkv, w_o, w_gu, w_d), cache in zip(self.weights, self.caches):
            qkv = torch.nn.functional.linear(x, w_qkv)
            if raw_path:
                raw = RawDecodeInputs(qkv, x, EPS, self.positions, self.cos, self.sin, *self.norms, EPS)
                attn = self.split.run_raw(raw, q_size, kv_size, cache.k, cache.v, self.new_slots)
            else:
                q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
                q = q.view(-1, NUM_Q_HEADS, HEAD_DIM)
                k, v = k.view(-1, NUM_KV_HEADS, HEAD_DIM), v.view(-1, NUM_KV_HEADS, HEAD_DIM)
                qk_norm_rope_(self.positions, q, k, self.cos, self.sin, *self.norms, EPS,
                              store=(v, cache.k, cache.v, self.new_slots), row_rms=(x, v, EPS))  # fmt: skip
                attn = self.split.run(q, cache.k, cache.v)
            self.last_attention = attn
            x.addmm_(attn.view(-1, q_size), w_o.t())
            x.addmm_(silu_and_mul_rms(torch.nn.functional.linear(x, w_gu), x, EPS), w_d.t())


def capture(fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def measure(lens: list[int], generated: int, rounds: int) -> dict[str, Any]:
    layers = Layers(lens, generated, torch.device("cuda"))
    graphs, outputs = {}, {}
    for name in ("plain", "raw"):
        graphs[name] = capture(lambda: layers.step(name == "raw"))
        assert layers.last_attention is not None
        outputs[name] = layers.last_attention.float().clone()
    err = ((outputs["raw"] - outputs["plain"]).norm() / outputs["plain"].norm()).item()
    times: dict[str, list[float]] = {n: [] for n in graphs}
    for _ in range(rounds):
        for name, graph in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / 5)
    med = {n: statistics.median(t) for n, t in times.items()}
    return {"running": len(lens), "context_tokens": sum(lens), "rel_error_raw_vs_plain": err,
            "ms_per_step": {n: round(m, 4) for n, m in med.items()},
            "change": round(med["raw"] / med["plain"] - 1, 4),
            "us_per_layer_saved": round((med["plain"] - med["raw"]) * 1e3 / LAYERS, 2),
            "all_ms": {n: [round(x, 4) for x in t] for n, t in times.items()}}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.raw_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True)
    p.add_argument("--marks", default=",".join(map(str, MARKS)))
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise ValueError("benchmarks.raw_decode needs a CUDA device")
    from benchmarks.kernels import copy_bandwidth
    from minisgl_ref.bench.provenance import collect_provenance

    copy_bandwidth(nbytes=1 << 30, warmup_s=2.0)  # bring the clock up
    result: dict[str, Any] = {"benchmark": "raw_decode", "what": __doc__.split("\n\n")[1].replace("\n", " "),
                              "stages": [], "provenance": collect_provenance(rounds=args.rounds)}  # fmt: skip
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for mark, lens in canonical_stages(tuple(int(m) for m in args.marks.split(","))).items():
        row = measure(lens, generated_tokens(int(mark)), args.rounds)
        print(f"{row['running']:>4} running: plain {row['ms_per_step']['plain']:.3f} ms, raw "
              f"{row['ms_per_step']['raw']:.3f} ms ({row['change']:+.2%}, {row['us_per_layer_saved']:.2f} us a "
              f"layer), error {row['rel_error_raw_vs_plain']:.1e}", flush=True)
        result["stages"].append(row)
        result["elapsed_s"] = round(time.perf_counter() - t0, 1)
        out.write_text(json.dumps(result, indent=1) + "\n")
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
