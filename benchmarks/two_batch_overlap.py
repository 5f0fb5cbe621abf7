"""``python -m benchmarks.two_batch_overlap``: a whole decode step as one batch, or as two halves on two streams.

A decode step of Qwen3-0.6B at a few hundred rows is ~300 kernels in a row. The attention kernels read the KV
cache near the memory bandwidth; the matrix multiplies and the small kernels between them do not: each spends a
few microseconds filling the GPU and draining it again. Two halves of the batch, each running the whole model on a
stream of its own inside one CUDA graph, give the GPU a second chain of work to fill those edges with, and
let one half's multiplies run while the other half's attention reads the cache. The price: every weight matrix is
read once per half (unless the two reads meet in the L2 cache) and every small kernel runs twice.

For each stage of the canonical workload (the running requests' context lengths when at most ``--marks``
requests are left, slots laid out as the engine's pool holds them), the script builds the real model (dummy
weights, folded norms, the engine's FlashInfer backend with its own split-KV decode kernel) and times, as CUDA
graph replays:

* ``one``: the step as the engine runs it: the model on all rows, then the LM head;
* ``halves_in_turn``: two halves one after the other on one stream, each with its own attention plan, then one
  LM head over both (what splitting costs without any overlap);
* ``halves_two_streams``: the same two halves on two streams, joined before the LM head.

The logits of the split variants are checked against ``one``. Results go to ``--output`` with provenance.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch

MARKS = (256, 192, 128, 64, 32)


class DecodeProblem:
    """The model, a KV pool holding every running request's context, and one decode batch per part."""

    def __init__(self, lens: list[int], generated: int, split_min_batch: int, seed: int = 0) -> None:
        from minisgl_ref.attention.registry import build_backend
        from minisgl_ref.kvcache.pool import KVPool
        from minisgl_ref.kvcache.req_to_token import ReqToTokenPool
        from minisgl_ref.models.loader import load_model

        dev = torch.device("cuda")
        self.model, config, _ = load_model("Qwen3-0.6B", load_format="dummy", dtype="bfloat16", device=dev)
        self.lens = lens
        b = len(lens)
        total = sum(lens) + 1
        self.pool = KVPool(config.num_layers, total, config.num_kv_heads, config.head_dim, torch.bfloat16, dev)
        gen = torch.Generator(dev).manual_seed(seed)
        for t in self.pool.k + self.pool.v:
            t.normal_(generator=gen)
        # Slots as the engine's pool holds them: each prompt in one run, the generated tokens a batch apart.
        self.table = ReqToTokenPool(b + 1, max(lens) + 1, dev)
        start = 1
        prompt_end = 1 + sum(n - generated for n in lens)
        for i, n in enumerate(lens):
            prompt = n - generated
            slots = torch.cat([torch.arange(start, start + prompt),
                               prompt_end + i + b * torch.arange(generated)])  # fmt: skip
            self.table.write(i + 1, 0, slots)
            start += prompt
        self.num_q_heads = config.num_heads
        self.vocab = config.vocab_size
        self.hidden_size = config.hidden_size
        self.make_backend: Callable[[], Any] = lambda: build_backend(
            "flashinfer", self.pool, self.table, num_q_heads=config.num_heads, page_size=1, device=dev,
            split_decode_min_batch=split_min_batch)  # fmt: skip
        self.ids = torch.randint(0, config.vocab_size, (b,), generator=gen, device=dev)

    def batch(self, rows: range) -> Any:
        """A planned decode batch of ``rows`` (indices into ``lens``) with a backend of its own."""
        from minisgl_ref.core.forward_batch import ForwardBatch, ForwardMode

        dev = torch.device("cuda")
        lens = [self.lens[i] for i in rows]
        pool_rows = torch.tensor([i + 1 for i in rows], device=dev)
        last_slot = self.table.table[pool_rows, torch.tensor(lens, device=dev) - 1].long()
        backend = self.make_backend()
        backend.init_graph_buffers(len(lens))
        fb = ForwardBatch(mode=ForwardMode.DECODE, input_ids=self.ids[rows.start : rows.stop],
                          positions=torch.tensor(lens, device=dev) - 1, extend_lens_cpu=[1] * len(lens),
                          prefix_lens_cpu=[n - 1 for n in lens], attn_backend=backend, req_pool_indices=pool_rows,
                          out_cache_loc=last_slot, seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev))  # fmt: skip
        backend.prepare_capture(fb)
        return fb

    def hidden(self, fb: Any) -> torch.Tensor:
        return self.model(fb.input_ids, fb.positions, fb)


def capture(fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


def time_replays(graphs: dict[str, torch.cuda.CUDAGraph], rounds: int) -> dict[str, list[float]]:
    """Milliseconds per replay, the variants interleaved round by round (ten replays between two events)."""
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(3):
        for g in graphs.values():
            g.replay()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, g in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                g.replay()
            end.record()
            end.synchronize()
            times[name].append(round(start.elapsed_time(end) / 10, 4))
    return times


def measure(lens: list[int], generated: int, split_min_batch: int, rounds: int) -> dict[str, Any]:
    p = DecodeProblem(lens, generated, split_min_batch)
    b, half = len(lens), len(lens) // 2
    whole = p.batch(range(b))
    first, second = p.batch(range(half)), p.batch(range(half, b))
    head = p.model.compute_logits
    joined = torch.empty(b, p.hidden_size, dtype=torch.bfloat16, device="cuda")

    def one() -> torch.Tensor:
        return head(p.hidden(whole))

    def in_turn() -> torch.Tensor:
        joined[:half].copy_(p.hidden(first))
        joined[half:].copy_(p.hidden(second))
        return head(joined)

    def two_streams() -> torch.Tensor:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            joined[half:].copy_(p.hidden(second))
        joined[:half].copy_(p.hidden(first))
        main.wait_stream(side)
        return head(joined)

    side = torch.cuda.Stream()
    graphs, outs = {}, {}
    for name, fn in (("one", one), ("halves_in_turn", in_turn), ("halves_two_streams", two_streams)):
        graphs[name], outs[name] = capture(fn)
    for g in graphs.values():
        g.replay()
    torch.cuda.synchronize()
    ref = outs["one"].float()
    errors = {name: round(((o.float() - ref).norm() / ref.norm()).item(), 5) for name, o in outs.items()}
    same_argmax = {name: round((o.argmax(-1) == ref.argmax(-1)).float().mean().item(), 4) for name, o in outs.items()}
    times = time_replays(graphs, rounds)
    med = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    row = {"running": b, "kv_tokens": sum(lens), "ms_per_step": times, "median_ms": med,
           "ratio_to_one": {name: round(m / med["one"], 4) for name, m in med.items()},
           "rel_error_vs_one": errors, "argmax_agreement_vs_one": same_argmax}  # fmt: skip
    del graphs, outs, p, whole, first, second
    torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--marks", default=",".join(map(str, MARKS)))
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--split-decode-min-batch", type=int, default=128, help="as the engine's option")
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.two_batch_overlap needs a CUDA device", file=sys.stderr)
        return 1
    from benchmarks.decode_balance import canonical_stages, generated_tokens
    from minisgl_ref.bench.provenance import collect_provenance

    marks = tuple(int(m) for m in args.marks.split(","))
    stages = canonical_stages(marks)
    rows = []
    with torch.inference_mode():
        for mark in marks:
            row = measure(stages[str(mark)], generated_tokens(mark), args.split_decode_min_batch, args.rounds)
            print(json.dumps({k: v for k, v in row.items() if k != "ms_per_step"}), flush=True)
            rows.append(row)
    if args.output:
        out = {"stages": rows, "provenance": collect_provenance(split_decode_min_batch=args.split_decode_min_batch)}
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
