"""``python -m benchmarks.cascade``: cascade decode attention alone, against plain decode (chapter 11).

One layer's decode attention for batches laid out as the shared-prefix workload leaves them in the engine:
``groups`` system prompts of ``prefix`` tokens, each shared (the same pool slots) by ``rows`` running requests
whose own questions and answers add ``suffix`` tokens each, plus ``alone`` requests that share nothing. Each
backend is timed with the CUDA-graph replay of :func:`benchmarks.kernels.time_graph` (no launch overhead), and
every row reports the KV bytes the call reads: plain decode streams every request's whole context, the cascade
each shared prefix once. Shapes are Qwen3-0.6B's attention (16 query heads, 8 KV heads, head dim 128, bf16).

Results go to a JSON file with provenance when ``--output`` is given. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.kernels import DTYPE, HEAD_DIM, NUM_Q_HEADS, copy_bandwidth, time_graph

#: (groups, rows per group, shared prefix, longest suffix, rows alone)
SHAPES = (
    (64, 4, 2048, 384, 0),  # shared-prefix workload, requests shuffled: ~4 of each group run together
    (16, 16, 2048, 384, 0),  # the same with whole groups running together
    (32, 8, 2048, 384, 0),
    (8, 2, 2048, 384, 0),
    (4, 4, 2048, 384, 240),  # few groups among many unrelated requests
    (1, 256, 4096, 256, 0),  # one long shared document
)


class SharedPrefixProblem:
    """A one-layer pool and page table where the rows of a group share the slots of their prefix."""

    def __init__(self, groups: int, rows: int, prefix: int, suffix: int, alone: int, num_kv_heads: int = 8,
                 seed: int = 0) -> None:  # fmt: skip
        from minisgl_ref.core.forward_batch import ForwardBatch, ForwardMode
        from minisgl_ref.kvcache.pool import KVPool
        from minisgl_ref.kvcache.req_to_token import ReqToTokenPool
        from minisgl_ref.layers.attention import AttentionLayer

        rng = random.Random(seed)
        specs: list[tuple[int, int]] = []  # (group or -1, own tokens)
        specs += [(g, rng.randint(1, suffix)) for g in range(groups) for _ in range(rows)]
        specs += [(-1, rng.randint(1, prefix + suffix)) for _ in range(alone)]
        rng.shuffle(specs)
        total = groups * prefix + sum(n for _, n in specs) + 1
        dev = "cuda"
        gen = torch.Generator(dev).manual_seed(seed)
        self.pool = KVPool(1, total, num_kv_heads, HEAD_DIM, DTYPE, dev)
        self.pool.k[0].normal_(generator=gen)
        self.pool.v[0].normal_(generator=gen)
        self.table = ReqToTokenPool(len(specs) + 1, prefix + suffix + 1, dev)
        prefixes = [torch.arange(1 + g * prefix, 1 + (g + 1) * prefix) for g in range(groups)]
        start, lens = 1 + groups * prefix, []
        for row, (g, own) in enumerate(specs):
            shared = prefixes[g] if g >= 0 else torch.empty(0, dtype=torch.int64)
            self.table.write(row, 0, torch.cat([shared, torch.arange(start, start + own)]))
            start += own
            lens.append(len(shared) + own)
        self.rows = list(range(len(specs)))
        self.lens = lens
        bs = len(specs)
        self.q = torch.randn(bs, NUM_Q_HEADS, HEAD_DIM, generator=gen, device=dev, dtype=DTYPE)
        self.layer = AttentionLayer(0, NUM_Q_HEADS, num_kv_heads, HEAD_DIM)
        self.batch = ForwardBatch(mode=ForwardMode.DECODE, input_ids=torch.zeros(bs, dtype=torch.int64, device=dev),
                                  positions=torch.tensor(lens, device=dev) - 1, extend_lens_cpu=[1] * bs,
                                  prefix_lens_cpu=[n - 1 for n in lens], attn_backend=None,  # type: ignore[arg-type]
                                  req_pool_indices=torch.arange(bs, device=dev),
                                  seq_lens=torch.tensor(lens, device=dev))  # fmt: skip
        self.token_bytes = 2 * num_kv_heads * HEAD_DIM * (torch.finfo(DTYPE).bits // 8)  # K and V, one layer

    def runner(self, name: str):  # type: ignore[no-untyped-def]
        """The per-layer call of backend ``name`` (planned once): ``cascade`` or a registered decode backend."""
        import dataclasses

        groups = None
        if name == "cascade":
            from minisgl_ref.perf.cascade import CascadeDecodeBackend

            backend = CascadeDecodeBackend(self.pool, self.table, num_q_heads=NUM_Q_HEADS, page_size=1)
            groups = backend.attach(dataclasses.replace(self.batch, attn_backend=backend), self.rows)
        else:
            from minisgl_ref.attention.registry import build_backend

            backend = build_backend(name, self.pool, self.table, num_q_heads=NUM_Q_HEADS, page_size=1,
                                    device=torch.device("cuda"))  # fmt: skip
        batch = dataclasses.replace(self.batch, attn_backend=backend)
        backend.init_forward_metadata(batch)
        return lambda: backend.attend_decode(self.q, self.layer, batch), groups


def run(shapes: tuple[tuple[int, ...], ...], names: list[str], repeats: int) -> dict[str, Any]:
    from minisgl_ref.perf.cascade import kv_tokens_read

    copy_bw = copy_bandwidth()
    rows: list[dict[str, Any]] = []
    for shape in shapes:
        problem = SharedPrefixProblem(*shape)
        ref = None
        for name in names:
            try:
                fn, groups = problem.runner(name)
                out = fn().float()
                ref = out if ref is None else ref
                seconds, method = time_graph(fn, repeats=repeats)
            except Exception as e:  # one backend failing must not lose the others' numbers
                rows.append({"backend": name, "shape": list(shape), "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            plain, cascade = kv_tokens_read(problem.lens, groups)
            read = (cascade if name == "cascade" else plain) * problem.token_bytes
            rows.append({"backend": name, "shape": list(shape), "batch": len(problem.lens),
                         "time_us": round(seconds * 1e6, 2), "timing": method, "kv_bytes": read,
                         "kv_bytes_plain": plain * problem.token_bytes,
                         "bandwidth_GBps": round(read / seconds / 1e9, 1),
                         "fraction_of_copy_bw": round(read / seconds / copy_bw, 3),
                         "rel_error_vs_first": round(((out - ref).norm() / ref.norm()).item(), 5)})  # fmt: skip
        del problem
        torch.cuda.empty_cache()
    return {"copy_bandwidth_Bps": copy_bw, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="flashinfer,triton,cascade",
                   help="comma-separated: registered decode backends and/or cascade")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--quick", action="store_true", help="the first two shapes only")
    p.add_argument("--output", default=None, help="write the results (with provenance) to this JSON file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.cascade needs a CUDA device", file=sys.stderr)
        return 1
    names = [n for n in args.backends.split(",") if n]
    result = run(SHAPES[:2] if args.quick else SHAPES, names, args.repeats)
    print(f"{'shape (groups x rows, prefix, suffix<=, alone)':<44} {'backend':<11} {'us':>9} {'KV GB':>7} "
          f"{'GB/s':>7} {'speedup':>8}")
    base: dict[tuple[int, ...], float] = {}
    for r in result["rows"]:
        if "error" in r:
            print(f"{str(r['shape']):<44} {r['backend']:<11} {r['error']}")
            continue
        key = tuple(r["shape"])
        base.setdefault(key, r["time_us"])
        print(f"{str(r['shape']):<44} {r['backend']:<11} {r['time_us']:>9.1f} {r['kv_bytes'] / 1e9:>7.3f} "
              f"{r['bandwidth_GBps']:>7.0f} {base[key] / r['time_us']:>7.2f}x")
    if args.output:
        from minisgl_ref.bench.provenance import collect_provenance

        result = {"benchmark": "cascade_decode_attention", "provenance": collect_provenance(argv), **result}
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
