"""Tensor parallelism, checked and measured (chapter 09): ``python -m benchmarks.tp``, from the repository root.

Three things, each a ``--phase`` so that a GPU script can run them in separate processes (every phase starts with
all GPU memory free, and a phase that runs out of time does not lose the others' results):

* ``check``: the sharded model against the unsharded one. Logits of a few prompts at tp=N versus tp=1 (relative
  error), and the engine's greedy tokens at tp=N versus tp=1.
* ``run``: one tensor-parallel size on a big model: decode step time at given batch sizes (the engine stepping a
  batch that is all decode), then the canonical offline workload (chapter 11) timed like ``bench offline``.
* ``merge``: the phases' JSON files into one results file with provenance.

``--phase comm`` counts the bytes every collective moves in one prefill and one decode forward pass (the
chapter's table; on CPU with gloo it runs in seconds).

The helpers are importable: :func:`sharded_logits` (what rank 0 computes at a given tp size) and
:func:`comm_profile` are what the tests and the chapter call. :func:`count_communication` counts the collectives
from the outside: the engine's collectives call ``torch.distributed`` through one module attribute, and for the
length of a ``with`` block a counting stand-in takes its place.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed

from minisgl_ref.distributed import parallel_state
from minisgl_ref.distributed.parallel_state import get_tp_info, set_tp_info
from minisgl_ref.tp.launch import run_on_ranks

# ------------------------------------------------------------------------------------- counting collectives


@dataclass
class CommCounter:
    """Bytes each rank *contributes* to each kind of collective, and the wall time spent inside them.

    For an all-reduce that is the size of the tensor being summed; for an all-gather, the size of this rank's
    slice. (How many bytes actually cross the wire depends on the algorithm: a ring all-reduce of ``n`` bytes
    over ``p`` ranks sends ``2 n (p - 1) / p`` from every rank.)
    """

    calls: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def record(self, kind: str, tensor: torch.Tensor, seconds: float) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + tensor.numel() * tensor.element_size()
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds


class _CountingDist:
    """Stands in for ``torch.distributed`` inside ``parallel_state``: the collectives the layers issue are timed
    and counted (``sync`` waits for the device around each, so the time is the collective's own), everything
    else passes through."""

    def __init__(self, counter: CommCounter, sync: bool) -> None:
        self.counter, self.sync = counter, sync

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.distributed, name)

    def _timed(self, kind: str, x: torch.Tensor, call: Callable[[], Any]) -> Any:
        if self.sync and x.is_cuda:
            torch.cuda.synchronize(x.device)
        t0 = time.perf_counter()
        result = call()
        if self.sync and x.is_cuda:
            torch.cuda.synchronize(x.device)
        self.counter.record(kind, x, time.perf_counter() - t0)
        return result

    def all_reduce(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self._timed("all_reduce", x, lambda: torch.distributed.all_reduce(x, *args, **kwargs))

    def all_gather_into_tensor(self, out: torch.Tensor, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self._timed("all_gather", x, lambda: torch.distributed.all_gather_into_tensor(out, x, *args, **kwargs))

    def all_gather(self, outs: list[torch.Tensor], x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self._timed("all_gather", x, lambda: torch.distributed.all_gather(outs, x, *args, **kwargs))

    def broadcast(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self._timed("broadcast", x, lambda: torch.distributed.broadcast(x, *args, **kwargs))


@contextmanager
def count_communication(sync: bool = True) -> Iterator[CommCounter]:
    """Count (and time) every collective the model issues inside the ``with`` block (only for measuring: with
    ``sync`` it serialises the device)."""
    counter, previous = CommCounter(), parallel_state.dist
    parallel_state.dist = _CountingDist(counter, sync)  # type: ignore[assignment]
    try:
        yield counter
    finally:
        parallel_state.dist = previous

# ---------------------------------------------------------------------------------------- logits per rank


def _rank_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", get_tp_info().rank)
    return dev


def _load(model_path: str | None, load_format: str, dtype: str, device: torch.device):  # type: ignore[no-untyped-def]
    from minisgl_ref.models.loader import load_model
    from minisgl_ref.perf import model_transforms

    model, config, _ = load_model(model_path, load_format=load_format, dtype=dtype, device=device)
    model_transforms.apply_(model, device, config.dtype)  # as the engine serves it (chapter 11, on a GPU)
    return model, config


def model_logits(model_path: str | None, load_format: str, dtype: str, sequences: list[list[int]],
                 device: str = "cpu") -> torch.Tensor:
    """This rank's logits (float32, on the CPU) for every position of ``sequences``, with the model sharded by
    the current tensor-parallel group (at tp=1: the whole model)."""
    from minisgl_ref.attention.torch_native import NoCacheAttentionBackend
    from minisgl_ref.core.forward_batch import ForwardBatch

    dev = _rank_device(device)
    model, _ = _load(model_path, load_format, dtype, dev)
    batch = ForwardBatch.for_full_sequences(sequences, NoCacheAttentionBackend(), dev)
    with torch.inference_mode():
        logits = model.compute_logits(model(batch.input_ids, batch.positions, batch))
    return logits.float().cpu()


def sharded_logits(model_path: str | None, sequences: list[list[int]], tp_size: int, *, load_format: str = "auto",
                   dtype: str = "float32", device: str = "cpu") -> list[torch.Tensor]:
    """Every rank's logits at ``tp_size`` (all equal: the LM head all-gathers them). At tp=1 the model runs in
    this process; otherwise in ``tp_size`` fresh processes of a new group."""
    if tp_size == 1:
        set_tp_info(0, 1)
        return [model_logits(model_path, load_format, dtype, sequences, device)]
    return run_on_ranks(model_logits, tp_size, model_path, load_format, dtype, sequences, device, device=device)


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |ours - ref| / max |ref|``: the worst element, relative to the scale of the logits."""
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def norm_relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """``||ours - ref|| / ||ref||``: the measure of the model oracle tests (chapter 01); steadier in bf16, where
    single elements round by up to 2^-8 of their own size."""
    return ((ours - ref).norm() / ref.norm()).item()


# ------------------------------------------------------------------------------------- communication count


def comm_profile(model_path: str | None, load_format: str, dtype: str, prefill_tokens: int, decode_batch: int,
                 device: str = "cpu", repeats: int = 3) -> dict[str, Any]:
    """On this rank: the collectives of one prefill pass (one sequence of ``prefill_tokens``) and of one decode-
    shaped pass (``decode_batch`` sequences of one token), counted and timed by wrapping the collectives."""
    from minisgl_ref.attention.torch_native import NoCacheAttentionBackend
    from minisgl_ref.core.forward_batch import ForwardBatch

    dev = _rank_device(device)
    model, config = _load(model_path, load_format, dtype, dev)
    shapes = {"prefill": [list(range(1, prefill_tokens + 1))], "decode": [[7]] * decode_batch}
    out: dict[str, Any] = {"hidden_size": config.hidden_size, "num_layers": config.num_layers,
                           "vocab_size": config.vocab_size, "dtype_bytes": torch.finfo(config.dtype).bits // 8,
                           "tp_size": get_tp_info().size}
    for name, seqs in shapes.items():
        batch = ForwardBatch.for_full_sequences(seqs, NoCacheAttentionBackend(), dev)
        best: dict[str, Any] | None = None
        for _ in range(repeats):
            with torch.inference_mode(), count_communication() as counter:
                t0 = time.perf_counter()
                hidden = model(batch.input_ids, batch.positions, batch)
                model.compute_logits(hidden[batch.last_token_indices])
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                total = time.perf_counter() - t0
            run = {"tokens": sum(len(s) for s in seqs), "rows": len(seqs), "forward_s": total,
                   "calls": dict(counter.calls), "bytes": dict(counter.bytes), "seconds": dict(counter.seconds)}
            if best is None or total < best["forward_s"]:
                best = run
        out[name] = best
    return out


def expected_bytes(hidden: int, layers: int, vocab: int, dtype_bytes: int, tokens: int, rows: int,
                   tp_size: int) -> dict[str, int]:
    """What each rank contributes per forward pass: 2 all-reduces per layer plus one for the embedding, each of
    ``tokens x hidden`` values; and its ``ceil(vocab / tp)`` logits of each sampled row to the all-gather."""
    return {"all_reduce": (2 * layers + 1) * tokens * hidden * dtype_bytes,
            "all_gather": rows * -(-vocab // tp_size) * dtype_bytes}


# ------------------------------------------------------------------------------------------- engine runs


def _llm(model_path: str | None, load_format: str, dtype: str, device: str | None, tp_size: int,
         **engine_kwargs: Any):  # type: ignore[no-untyped-def]
    from minisgl_ref.llm import LLM

    return LLM(model_path, load_format=load_format, dtype=dtype, device=device, tp_size=tp_size, **engine_kwargs)


def greedy_tokens(llm: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from minisgl_ref.sampling.params import SamplingParams

    params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)
    return [o.output_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _sync(llm: Any) -> None:
    if llm.device.type == "cuda":
        torch.cuda.synchronize(llm.device)


def decode_step_time(llm: Any, batch_size: int, prompt_len: int = 256, steps: int = 32) -> dict[str, Any]:
    """Seconds per engine step while ``batch_size`` requests all decode (after their prefill), averaged over
    ``steps`` consecutive steps: the whole engine step, scheduling and the TP broadcasts included."""
    import random

    from minisgl_ref.sampling.params import SamplingParams

    rng = random.Random(batch_size)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_new_tokens=steps + 8, ignore_eos=True)
    reqs = [llm.make_request([rng.randint(0, 10000) for _ in range(prompt_len)], params) for _ in range(batch_size)]
    for r in reqs:
        engine.add_request(r)
    while min(len(r.output_ids) for r in reqs) < 2:  # prefilled, and one decode step taken by all
        engine.step()
    before = engine.stats.decode_tokens
    _sync(llm)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(llm)
    dt = (time.perf_counter() - t0) / steps
    decoded = engine.stats.decode_tokens - before
    engine.run_until_done()
    engine.flush_cache()  # through the engine: at tp > 1 the followers flush theirs too
    return {"batch_size": batch_size, "prompt_len": prompt_len, "steps": steps, "step_s": dt,
            "decode_rows_per_step": decoded / steps, "tokens_per_s": batch_size / dt}


def phase_check(args: argparse.Namespace) -> dict[str, Any]:
    """tp=N against tp=1: logits of a few prompts, then the engine's greedy tokens."""
    import random

    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(n)] for n in (7, 33, 120)]
    ref = sharded_logits(args.check_model, prompts, 1, load_format=args.check_load_format, dtype=args.dtype,
                         device=args.device or _default_device())[0]
    gc.collect()
    ranks = sharded_logits(args.check_model, prompts, args.tp_size, load_format=args.check_load_format,
                           dtype=args.dtype, device=args.device or _default_device())
    errs = [relative_error(r, ref) for r in ranks]
    norm_err = norm_relative_error(ranks[0], ref)
    ranks_equal = all(torch.equal(r, ranks[0]) for r in ranks)
    argmax_agree = (ranks[0].argmax(-1) == ref.argmax(-1)).float().mean().item()
    out: dict[str, Any] = {"model": args.check_model, "dtype": args.dtype, "tp_size": args.tp_size,
                           "logits_rel_err_max": max(errs), "logits_rel_err_per_rank": errs,
                           "logits_rel_err_norm": norm_err, "ranks_identical": ranks_equal,
                           "argmax_agreement": argmax_agree, "tolerance": args.check_tolerance,
                           "logits_ok": norm_err <= args.check_tolerance}
    print(f"[tp] logits tp={args.tp_size} vs tp=1: relative error {norm_err:.2e} (norm; tolerance "
          f"{args.check_tolerance}), worst element {max(errs):.2e}, argmax agreement {argmax_agree:.3f}, "
          f"ranks identical {ranks_equal}", file=sys.stderr)
    if args.dtype not in ("float32", "auto") or (args.device or _default_device()) != "cpu":
        # How far is bf16 itself from float32 here? TP passes if it adds no more than that rounding noise: the
        # tp=N logits are no further from float32 than twice the distance of the tp=1 ones.
        exact = sharded_logits(args.check_model, prompts, 1, load_format=args.check_load_format, dtype="float32",
                               device=args.device or _default_device())[0]
        noise, tp_vs_exact = norm_relative_error(ref, exact), norm_relative_error(ranks[0], exact)
        out |= {"tp1_vs_float32": noise, f"tp{args.tp_size}_vs_float32": tp_vs_exact,
                "logits_ok": out["logits_ok"] or tp_vs_exact <= 2 * noise}
        print(f"[tp] against float32: tp=1 {noise:.2e}, tp={args.tp_size} {tp_vs_exact:.2e} (rounding noise of "
              f"{args.dtype}); logits ok: {out['logits_ok']}", file=sys.stderr)
    _write_partial(args, out)
    engine_args = {"cuda_graph_max_bs": 8, **args.engine_args}  # 3 prompts: capturing big batches is wasted time
    out["greedy_engine_args"] = engine_args
    gen: dict[int, list[list[int]]] = {}
    for tp in (1, args.tp_size):
        llm = _llm(args.check_model, args.check_load_format, args.dtype, args.device, tp, **engine_args)
        try:
            gen[tp] = greedy_tokens(llm, prompts, args.check_tokens)
            if tp == args.tp_size:
                a, b = gen[1], gen[tp]
                prefix = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p)) for p, q in zip(a, b)]
                out |= {"greedy_tp1": a, f"greedy_tp{tp}": b, "greedy_identical": a == b,
                        "greedy_common_prefix": prefix,
                        "greedy_first_token_agree": all(p and q and p[0] == q[0] for p, q in zip(a, b))}
                print(f"[tp] greedy tokens identical: {a == b}; common prefix lengths {prefix} of "
                      f"{args.check_tokens}", file=sys.stderr)
                _write_partial(args, out)  # before shutting the ranks down
        finally:
            t0 = time.perf_counter()
            llm.shutdown()
            out.setdefault("shutdown_s", {})[f"tp{tp}"] = time.perf_counter() - t0
            del llm
            _free()
    return out


def phase_run(args: argparse.Namespace) -> dict[str, Any]:
    """Decode step times and the canonical workload at one tp size."""
    from minisgl_ref.bench.offline import summarize, time_generate, workload_floor_seconds
    from minisgl_ref.bench.workloads import canonical_workload, warmup_workload

    t_load = time.perf_counter()
    llm = _llm(args.model_path, args.load_format, args.dtype, args.device, args.tp_size, **args.engine_args)
    out: dict[str, Any] = {"tp_size": args.tp_size, "model": args.model_path, "engine_args": args.engine_args,
                           "load_s": time.perf_counter() - t_load,
                           "max_total_tokens": llm.engine.max_total_tokens, "device": str(llm.device)}
    print(f"[tp] tp={args.tp_size}: loaded {args.model_path} in {out['load_s']:.1f} s, KV pool "
          f"{out['max_total_tokens']:,} tokens", file=sys.stderr)
    try:
        warm = warmup_workload()
        llm.generate(warm.prompts, warm.sampling_params, use_tqdm=False)
        out["decode"] = []
        for bs in args.decode_batch_sizes:
            r = decode_step_time(llm, bs, prompt_len=args.decode_prompt_len, steps=args.decode_steps)
            out["decode"].append(r)
            print(f"[tp] tp={args.tp_size} decode batch {bs}: {r['step_s'] * 1e3:.2f} ms/step", file=sys.stderr)
            _write_partial(args, out)
        if args.num_prompts > 0:
            workload = canonical_workload(args.num_prompts)
            outputs, wall, counters = time_generate(llm, workload, warmup=None)
            res = summarize(llm, f"tp{args.tp_size}", outputs, wall, counters)
            floor = workload_floor_seconds(workload, llm.config, args.hbm_bandwidth * args.tp_size)
            out["canonical"] = res.__dict__ | {"workload": workload.summary(), "roofline_floor_s": floor,
                                               "roofline_fraction": floor / wall,
                                               "bandwidth_assumed": args.hbm_bandwidth * args.tp_size}
            print(f"[tp] tp={args.tp_size} canonical ({args.num_prompts} requests): {res.output_tokens:,} tokens in "
                  f"{wall:.1f} s = {res.output_throughput:,.0f} tok/s", file=sys.stderr)
            _write_partial(args, out)  # before shutdown: a rank that hangs on exit must not lose the numbers
    finally:
        llm.shutdown()
    return out


def phase_comm(args: argparse.Namespace) -> dict[str, Any]:
    results = run_on_ranks(comm_profile, args.tp_size, args.model_path, args.load_format, args.dtype,
                           args.comm_prefill_tokens, args.comm_decode_batch, args.device or "cpu",
                           device=args.device or "cpu")
    return {"ranks": results}


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _write_partial(args: argparse.Namespace, out: dict[str, Any]) -> None:
    if args.output:
        Path(args.output).write_text(json.dumps(out, indent=2) + "\n")


def phase_merge(args: argparse.Namespace) -> dict[str, Any]:
    """One results file: every phase file given, plus a summary table and provenance."""
    from minisgl_ref.bench.provenance import collect_provenance

    merged: dict[str, Any] = {"benchmark": "tensor_parallel"}
    for f in args.inputs:
        path = Path(f)
        if path.is_file():
            merged[path.stem] = json.loads(path.read_text())
        else:
            merged[path.stem] = {"missing": True}
    env = {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "MODEL", "CHECK_MODEL", "NUM_PROMPTS", "DECODE_BS",
                                          "ENGINE_ARGS", "DTYPE", "DEVICE", "MINISGL_FUSED", "MINISGL_GIT_COMMIT")}
    merged["provenance"] = collect_provenance(inputs=args.inputs, script="scripts/gpu/measure/tp_bench.sh", environment=env)
    return merged


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tp", description=__doc__.split("\n\n")[0])
    p.add_argument("--phase", required=True, choices=["check", "run", "comm", "merge"])
    p.add_argument("--tp-size", type=int, default=2)
    p.add_argument("--model-path", default="qwen3-14b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default=None)
    p.add_argument("--check-model", default="qwen3-0.6b", help="model of the check phase (small)")
    p.add_argument("--check-load-format", default="dummy")
    p.add_argument("--check-tokens", type=int, default=32)
    p.add_argument("--check-tolerance", type=float, default=2e-2,
                   help="largest logits relative error (norm) accepted (bf16: ~1e-2; float32: 1e-5)")
    p.add_argument("--decode-batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    p.add_argument("--decode-prompt-len", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=256, help="canonical workload size (0: skip it)")
    p.add_argument("--hbm-bandwidth", type=float, default=4.8e12, help="per GPU, for the roofline floor (H200)")
    p.add_argument("--comm-prefill-tokens", type=int, default=128)
    p.add_argument("--comm-decode-batch", type=int, default=8)
    p.add_argument("--engine-args", type=json.loads, default={},
                   help='engine keyword arguments as JSON, e.g. \'{"disable_cuda_graph": true}\'')
    p.add_argument("--inputs", nargs="*", default=[], help="merge: the phase JSON files")
    p.add_argument("--output", default=None, help="write this phase's JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if os.environ.get("MINISGL_THREADS"):
        torch.set_num_threads(int(os.environ["MINISGL_THREADS"]))
    phases = {"check": phase_check, "run": phase_run, "comm": phase_comm, "merge": phase_merge}
    t0 = time.perf_counter()
    out = phases[args.phase](args)
    out["phase_wall_s"] = time.perf_counter() - t0
    if args.output:
        Path(args.output).write_text(json.dumps(out, indent=2) + "\n")
        print(f"[tp] wrote {args.output}", file=sys.stderr)
    else:
        print(json.dumps(out, indent=2))
    if args.phase == "check" and not (out["logits_ok"]):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
