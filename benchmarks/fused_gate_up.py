"""The MLP's gate/up projection and its activation in one Triton kernel, against cuBLAS and the activation kernel
(chapter 11).

With the norms folded (chapter 11, "Folding the norms into their neighbours") a decode layer's MLP is three
kernels: cuBLAS's ``gate_up`` multiply, the Triton ``silu_and_mul_rms`` activation (which divides by each row's
RMS and applies ``silu(gate) * up``), and cuBLAS's ``down`` multiply adding into the residual stream. The
activation is short (2-3 µs at 256 rows), but it is a kernel of its own with its own gap, and it writes and reads
back the ``[rows, 6144]`` projection.

This kernel does the activation in the multiply's epilogue. Program ``(n, m)`` owns the output tile
``h[m rows, n cols]``: it takes its rows' sums of squares (one pass over their ``x``), then accumulates the
matching tile of the gate columns *and* of the up columns (two ``tl.dot`` per step of K, on the same tile of
``x``); after the loop it has ``gate``, ``up`` and the RMS, and writes only ``silu(gate / rms) * (up / rms)``.
Its float32 ``gate`` and ``up`` are rounded once, at the end, where the two-kernel path rounds them to bf16 in
between.

The question is whether a Triton tile gets close enough to cuBLAS's Hopper kernels at these sizes for the saved
kernel to show. For each row count the script tunes the tile over a small grid (timed as a CUDA graph of the 28
layers' weights, distinct tensors so that nothing stays in L2; a configuration whose output is not within bf16
rounding of a float32 reference is rejected and listed, not timed), then times the 28 layers' MLP both ways, with
``down`` (cuBLAS, ``addmm_`` into the residual) in both. Writes JSON:

    python -m benchmarks.fused_gate_up --output fused_gate_up.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

HIDDEN, FFN, LAYERS, EPS = 1024, 3072, 28, 1e-6  # Qwen3-0.6B
MAX_REL_ERROR = 0.01  # against float32; bf16 outputs are ~0.002-0.003 off
ROWS = (1, 16, 64, 128, 192, 256)
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
CONFIGS = [(bm, bn, bk, w, st) for bm in (64, 128) for bn in (32, 64, 128) for bk in (64, 128)
           for w in (4, 8) for st in (3, 4)]


@triton.jit
def _gate_up_silu_kernel(x, w, out, M, stride_xm, stride_wn, stride_om, eps,
                         I: tl.constexpr, K: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    x_ptr = x + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]
    g_ptr = w + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]  # [BLOCK_N, BLOCK_K] of gate's rows
    u_ptr = g_ptr + I * stride_wn  # the same columns of up
    # The rows' sums of squares first, in a loop of their own: the x tiles come again from L2 in the main loop.
    # (Taking them from the main loop's tiles, on the way, Triton 3.6 compiled wrong results for many tile shapes.)
    sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(x_ptr + k, mask=row_ok[:, None], other=0.0).to(tl.float32)
        sumsq += tl.sum(a * a, axis=1)
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(x_ptr + k, mask=row_ok[:, None], other=0.0)
        gate = tl.dot(a, tl.trans(tl.load(g_ptr + k)), gate)
        up = tl.dot(a, tl.trans(tl.load(u_ptr + k)), up)
    inv_rms = 1.0 / tl.sqrt(sumsq / K + eps)
    g = gate * inv_rms[:, None]
    y = g / (1.0 + tl.exp(-g)) * (up * inv_rms[:, None])
    tl.store(out + rows[:, None].to(tl.int64) * stride_om + cols[None, :], y.to(out.dtype.element_ty),
             mask=row_ok[:, None])


def gate_up_silu(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, eps: float,
                 config: tuple[int, int, int, int, int]) -> torch.Tensor:  # fmt: skip
    """``out = silu(g / rms(x)) * (u / rms(x))`` with ``[g | u] = x @ w.T``: ``x`` [M, K], ``w`` [2 * I, K] (gate
    rows, then up rows), ``out`` [M, I]. ``config`` = (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages); I must be a
    multiple of BLOCK_N and K of BLOCK_K."""
    m, k = x.shape
    inter = w.shape[0] // 2
    bm, bn, bk, warps, stages = config
    if inter % bn or k % bk or w.shape[1] != k or x.stride(1) != 1 or w.stride(1) != 1 or out.shape != (m, inter):
        raise ValueError(f"gate_up_silu: x {tuple(x.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)} do not fit "
                         f"tiles {config}")
    grid = (inter // bn, triton.cdiv(m, bm))
    _gate_up_silu_kernel[grid](x, w, out, m, x.stride(0), w.stride(0), out.stride(0), eps, I=inter, K=k,
                               BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return out


def reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The same in float32 with plain PyTorch."""
    xf = x.float()
    gu = xf @ w.float().T / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    g, u = gu.chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


def main() -> int:
    from benchmarks.decode_matmuls import parse_args, time_graph
    from minisgl_ref.bench.provenance import collect_provenance
    from minisgl_ref.perf.triton_ops import silu_and_mul_rms

    args = parse_args(__doc__)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    gate_up = [torch.randn(2 * FFN, HIDDEN, device=dev, dtype=torch.bfloat16, generator=gen) * HIDDEN**-0.5
               for _ in range(LAYERS)]  # fmt: skip
    down = [torch.randn(HIDDEN, FFN, device=dev, dtype=torch.bfloat16, generator=gen) * FFN**-0.5
            for _ in range(LAYERS)]  # fmt: skip
    results = []
    for rows in ROWS:
        x = torch.randn(rows, HIDDEN, device=dev, dtype=torch.bfloat16, generator=gen)
        h = torch.empty(rows, FFN, device=dev, dtype=torch.bfloat16)
        ref = reference(x, gate_up[0], EPS)
        timed, wrong = {}, {}
        for cfg in CONFIGS:
            if cfg[0] > max(64, triton.next_power_of_2(rows)):
                continue  # a taller tile than the rows only adds idle work
            try:
                h.fill_(float("nan"))
                gate_up_silu(x, gate_up[0], h, EPS, cfg)
                torch.cuda.synchronize()
            except (ValueError, triton.runtime.errors.OutOfResources):
                continue
            err = ((h.float() - ref).norm() / ref.norm()).item()
            if not err < MAX_REL_ERROR:  # a configuration the compiler gets wrong is not a candidate
                wrong["x".join(map(str, cfg))] = round(err, 4)
                continue
            timed[cfg] = time_graph(lambda cfg=cfg: [gate_up_silu(x, w, h, EPS, cfg) for w in gate_up], repeats=20)
        best = min(timed, key=timed.get)
        fused = gate_up_silu(x, gate_up[0], h, EPS, best).float()
        two_kernel = silu_and_mul_rms(torch.nn.functional.linear(x, gate_up[0]), x, EPS).float()
        err = {"fused": ((fused - ref).norm() / ref.norm()).item(),
               "cublas_then_activation": ((two_kernel - ref).norm() / ref.norm()).item()}

        resid = x.clone()

        def mlp_two_kernels() -> None:
            for wg, wd in zip(gate_up, down):
                a = silu_and_mul_rms(torch.nn.functional.linear(resid, wg), resid, EPS)
                resid.addmm_(a, wd.T)

        def mlp_fused() -> None:
            for wg, wd in zip(gate_up, down):
                resid.addmm_(gate_up_silu(resid, wg, h, EPS, best), wd.T)

        def gate_up_only() -> None:
            for wg in gate_up:
                torch.nn.functional.linear(x, wg)

        def activation_only() -> None:
            y = torch.nn.functional.linear(x, gate_up[0])
            for _ in gate_up:
                silu_and_mul_rms(y, x, EPS)

        ms: dict[str, list[float]] = {}
        for _ in range(3):  # interleaved
            for name, fn in (("mlp_cublas_then_activation", mlp_two_kernels), ("mlp_fused", mlp_fused),
                             ("gate_up_cublas", gate_up_only), ("activation", activation_only)):  # fmt: skip
                ms.setdefault(name, []).append(round(time_graph(fn, repeats=20), 4))
        row = {"rows": rows, "best_config": list(best), "fused_chain_ms": round(timed[best], 4),
               "ms_28_layers": ms, "rel_error_vs_float32": {k: round(v, 6) for k, v in err.items()},
               "rejected_configs_rel_error": wrong,
               "configs_ms": {"x".join(map(str, c)): round(t, 4) for c, t in sorted(timed.items(), key=lambda kv: kv[1])}}
        results.append(row)
        print(json.dumps({k: row[k] for k in ("rows", "best_config", "fused_chain_ms", "ms_28_layers",
                                              "rel_error_vs_float32")}), flush=True)
    doc = {"what": __doc__.split("\n\n")[0], "layers": LAYERS, "hidden": HIDDEN, "intermediate": FFN,
           "results": results, "provenance": collect_provenance(sys.argv)}
    Path(args.output).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{'rows':>4} {'two kernels':>11} {'fused':>7} {'gate_up':>8} {'activation':>10}   (ms, 28 layers, best of 3)")
    for r in results:
        m = {k: min(v) for k, v in r["ms_28_layers"].items()}
        print(f"{r['rows']:>4} {m['mlp_cublas_then_activation']:>11.3f} {m['mlp_fused']:>7.3f} "
              f"{m['gate_up_cublas']:>8.3f} {m['activation']:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
