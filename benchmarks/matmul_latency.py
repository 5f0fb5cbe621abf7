"""``python -m benchmarks.matmul_latency``: are a decode step's matrix multiplies bound by reading their weights?
(chapter 11)

A decode step of Qwen3-0.6B runs 113 matrix multiplies (four per layer and the LM head) over 1.2 GB of weights,
and cuBLAS takes ~0.8-1.0 ms for them where reading the weights once takes 0.4 ms. Three measurements say where
the rest goes:

1. **Weights already in the L2 cache.** The 28 layers' four multiplies, each layer with its own weights (as in a
   step: every weight comes from memory), against the same chain with the *first* layer's weights every time
   (30 MB, which stays in the 50 MB L2 cache between calls). If reading memory were the bottleneck, the second
   chain would be much faster.
2. **Prefetching into L2 during attention.** The decode attention of each layer, then its multiplies (as
   ``benchmarks/decode_balance.py --with-matmuls``), with a small kernel on a side stream that asks the L2 cache to
   fetch the layer's weights (``prefetch.global.L2::evict_last``, or plain) while the attention runs. If the
   multiplies waited on memory, they would then find their weights in L2 and the step would get shorter.
3. **PyTorch's TunableOp**, which times every cuBLAS/cuBLASLt algorithm it can enumerate for each shape and
   keeps the fastest, against cuBLAS's own choice.

Times are medians over CUDA-graph replays (``benchmarks.kernels.time_graph``), per layer or per step. One JSON
file with provenance. Needs a CUDA device (and flashinfer-python for part 2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any, Callable

import torch

from benchmarks.decode_balance import LAYER_MATMULS, Stage, canonical_stages, generated_tokens, variants

DTYPE = torch.bfloat16
LAYERS = 28
ROWS = (1, 8, 32, 64, 128, 192, 256)


def layer_weights(layers: int) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """Each layer's four weights (qkv, o, gate_up, down), carved out of one flat tensor per layer (also returned)
    so that a prefetch kernel can walk them as one range."""
    sizes = [o * i for o, i in LAYER_MATMULS]
    out, flats = [], []
    for _ in range(layers):
        flat = torch.randn(sum(sizes), device="cuda", dtype=DTYPE) * 0.02
        ws, off = [], 0
        for (o, i), n in zip(LAYER_MATMULS, sizes):
            ws.append(flat[off : off + n].view(o, i))
            off += n
        out.append(ws)
        flats.append(flat)
    return out, flats


def matmul_chain(rows: int, weights: list[list[torch.Tensor]], order: list[int],
                 lm_head: torch.Tensor | None = None) -> Callable[[], None]:  # fmt: skip
    """One step's multiplies at ``rows`` rows, layer ``order[i]``'s weights for the i-th layer. o_proj and
    down_proj accumulate into the residual (``addmm``), as the engine's folded layer does."""
    xs = {i: torch.randn(rows, i, device="cuda", dtype=DTYPE) for _, i in LAYER_MATMULS}
    res = torch.randn(rows, 1024, device="cuda", dtype=DTYPE)

    def run() -> None:
        for layer in order:
            for j, w in enumerate(weights[layer]):
                if j in (1, 3):
                    torch.addmm(res, xs[w.shape[1]], w.t(), out=res)
                else:
                    torch.nn.functional.linear(xs[w.shape[1]], w)
        if lm_head is not None:
            torch.nn.functional.linear(res, lm_head)

    return run


def l2_prefetch_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def prefetch_l2(ptr, n_lines, LINES: tl.constexpr, EVICT_LAST: tl.constexpr):  # noqa: N803
        # A grid-stride walk over 128-byte lines; each lane asks L2 for one line and moves on (no register waits).
        for start in range(tl.program_id(0) * LINES, n_lines, tl.num_programs(0) * LINES):
            offs = start + tl.arange(0, LINES)
            p = tl.where(offs < n_lines, ptr + offs.to(tl.int64) * 64, ptr)  # 64 bf16 values a line
            if EVICT_LAST:
                tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [p],
                                          dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
            else:
                tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [p],
                                          dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip

    return prefetch_l2


def weights_in_l2(repeats: int) -> list[dict[str, Any]]:
    """Part 1: every layer's own weights against the first layer's weights 28 times, per layer."""
    from benchmarks.kernels import time_graph

    weights, _ = layer_weights(LAYERS)
    rows_out = []
    for rows in ROWS:
        cold, _ = time_graph(matmul_chain(rows, weights, list(range(LAYERS))), calls_per_graph=1, repeats=repeats)
        hot, _ = time_graph(matmul_chain(rows, weights, [0] * LAYERS), calls_per_graph=1, repeats=repeats)
        row = {"rows": rows, "own_weights_us_per_layer": round(cold * 1e6 / LAYERS, 2),
               "weights_in_l2_us_per_layer": round(hot * 1e6 / LAYERS, 2)}  # fmt: skip
        rows_out.append(row)
        print(row, flush=True)
    return rows_out


def prefetch_during_attention(mark: int, name: str, repeats: int) -> dict[str, Any]:
    """Part 2 at one stage of the canonical workload, with the attention variant ``name`` of decode_balance."""
    from benchmarks.kernels import time_graph

    lens = canonical_stages((mark,))[str(mark)]
    gen = generated_tokens(mark)
    stages = [Stage(lens, seed=len(lens) + i, generated=gen) for i in range(LAYERS)]
    attn = [variants()[name](st)[0] for st in stages]
    weights, flats = layer_weights(LAYERS)
    mm = [matmul_chain(len(lens), weights, [layer]) for layer in range(LAYERS)]
    kernel, side = l2_prefetch_kernel(), torch.cuda.Stream()

    def chain(prefetch: str | None, grid: int = 132) -> Callable[[], None]:
        def run() -> None:
            main = torch.cuda.current_stream()
            for layer, f in enumerate(attn):
                if prefetch is not None:
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        kernel[(grid,)](flats[layer], flats[layer].numel() // 64, LINES=256,
                                        EVICT_LAST=prefetch == "evict_last", num_warps=4)  # fmt: skip
                f()
                if prefetch is not None:
                    main.wait_stream(side)
                mm[layer]()

        return run

    row: dict[str, Any] = {"running": len(lens), "attention": name}
    for label, fn in (("no_prefetch", chain(None)), ("prefetch_evict_last", chain("evict_last")),
                      ("prefetch_plain", chain("plain")), ("no_prefetch_again", chain(None))):  # fmt: skip
        t, _ = time_graph(fn, calls_per_graph=1, repeats=repeats)
        row[f"{label}_us_per_layer"] = round(t * 1e6 / LAYERS, 2)
    print(row, flush=True)
    return row


def tunableop(repeats: int) -> dict[str, Any]:
    """Part 3: the whole step's 113 multiplies, cuBLAS's choice against TunableOp's after tuning every shape."""
    import torch.cuda.tunable as tunable

    from benchmarks.kernels import time_graph

    weights, _ = layer_weights(LAYERS)
    lm_head = torch.randn(151936, 1024, device="cuda", dtype=DTYPE) * 0.02
    chains = {rows: matmul_chain(rows, weights, list(range(LAYERS)), lm_head) for rows in ROWS}
    out: dict[str, Any] = {"rows": []}
    default = {rows: time_graph(fn, calls_per_graph=1, repeats=repeats)[0] for rows, fn in chains.items()}
    with tempfile.TemporaryDirectory() as tmp:
        tunable.set_filename(os.path.join(tmp, "tunableop_results.csv"))
        tunable.enable(True)
        tunable.tuning_enable(True)
        t0 = time.perf_counter()
        for fn in chains.values():  # tuning happens on eager calls, never inside a graph capture
            fn()
        torch.cuda.synchronize()
        out["tuning_s"] = round(time.perf_counter() - t0, 1)
        tunable.tuning_enable(False)
        for rows, fn in chains.items():
            tuned = time_graph(fn, calls_per_graph=1, repeats=repeats)[0]
            row = {"rows": rows, "cublas_ms_per_step": round(default[rows] * 1e3, 4),
                   "tunableop_ms_per_step": round(tuned * 1e3, 4)}  # fmt: skip
            out["rows"].append(row)
            print(row, flush=True)
        out["tuned_shapes"] = len(tunable.get_results())
        tunable.enable(False)
    return out


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.matmul_latency", description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--marks", default="256,128,32", help="stages of the canonical workload for part 2")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise ValueError("benchmarks.matmul_latency needs a CUDA device")
    from benchmarks.kernels import copy_bandwidth
    from minisgl_ref.bench.provenance import collect_provenance, package_version

    copy_bandwidth(nbytes=1 << 30, warmup_s=3.0)  # an idle GPU starts at a low clock
    result: dict[str, Any] = {"benchmark": "matmul_latency", "what": __doc__.split("\n\n")[0].split(": ", 1)[1],
                              "provenance": collect_provenance(repeats=args.repeats, kernel_packages={
                                  "flashinfer-python": package_version("flashinfer-python")})}  # fmt: skip
    result["weights_in_l2"] = weights_in_l2(args.repeats)
    result["prefetch_during_attention"] = []
    for mark in (int(m) for m in args.marks.split(",")):
        # the kernel the engine ran at that size when this was measured: FlashInfer's persistent one from 144 rows
        name = "fi_holistic" if mark >= 144 else "fi_graph"
        result["prefetch_during_attention"].append(prefetch_during_attention(mark, name, args.repeats))
        torch.cuda.empty_cache()
    result["tunableop"] = tunableop(args.repeats)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
