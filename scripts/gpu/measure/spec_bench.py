"""Chapter 13's GPU numbers: time per output token with and without speculative decoding, by batch size.

    python3 scripts/gpu/measure/spec_bench.py OUT.json --model-path /tmp/padded [--batch-sizes 1 8 64]

The target is the embedded SmolLM2-135M zero-padded to 2.1B parameters (``padded_model.py``): its outputs are
the 135M's, so drafts are accepted at the real model's rate, while every forward pass reads and multiplies the
bytes of a 2.1B model, as a realistic target does. The workload is copy-heavy (repeat or lightly edit a paragraph
given in the prompt, the case prompt lookup is made for), greedy, up to ``--max-new-tokens`` each.

For each configuration (no speculation; the n-gram proposer as a chain or a tree, pausing above its batch limit or
never; no speculation again at the end, to see drift) the engine is built once
(its cold start timed), then per batch size: one untimed warm-up of the same shape, then ``--repeats`` timed runs.
Reported per run: wall seconds, output tokens, milliseconds per output token per request (wall over the longest
request's tokens: what a user of that batch waits per token), throughput, verify rows and tokens appended per
verify row, and the steps each request needed (the batch lasts as long as its slowest request); per batch size the speed-up against the faster of the runs without speculation in the same process
(the conservative ratio), and how many outputs are
token-for-token identical to the plain engine's (bf16 on a GPU: a verify row's logits come from the extend
kernel and a decode row's from the decode kernel, so a near-tie may round the other way).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

CONFIGS: dict[str, dict[str, object]] = {
    "plain": {},
    "ngram": {"speculative_algorithm": "NGRAM"},  # the defaults: a chain of 4
    "ngram_chain8": {"speculative_algorithm": "NGRAM", "speculative_num_steps": 8},
    # trees need a backend that takes a mask for the verify rows (FA3 does not)
    "ngram_tree": {"speculative_algorithm": "NGRAM", "speculative_num_steps": 8, "speculative_eagle_topk": 4,
                   "speculative_num_draft_tokens": 12, "prefill_attention_backend": "flashinfer"},
    "plain_fi": {"prefill_attention_backend": "flashinfer"},
    # the same chains at every batch size (no pause), to find where speculation stops paying
    "ngram_b64": {"speculative_algorithm": "NGRAM", "speculative_max_batch": 64},
    "ngram_chain8_b64": {"speculative_algorithm": "NGRAM", "speculative_num_steps": 8, "speculative_max_batch": 64},
    "ngram_b4": {"speculative_algorithm": "NGRAM", "speculative_max_batch": 4},
    # no speculation and no overlap: what a verify step gives up by waiting for the step before it
    "plain_sync": {"disable_overlap_schedule": True},
    # no speculation again, last: how far the GPU's speed drifted over the run (clocks, heat)
    "plain_again": {},
}

#: Configurations without speculation; each speculative one is compared with the fastest of them.
PLAIN = ("plain", "plain_again")


def prompts(llm, n: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """``n`` copy-heavy chat prompts, cycling over the workload's and numbered so no two are the same text."""
    from spec_accept_rates import WORKLOADS
    base = WORKLOADS["copy"]
    out = []
    for i in range(n):
        text = f"(Task {i + 1}.) " + base[i % len(base)]
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        out.append(list(ids))
    return out


def spec_counts(llm) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """(verify rows, tokens they appended) so far, or (0, 0) without speculation."""
    for ext in getattr(llm.runtime.engine, "extensions").all:
        if hasattr(ext, "verify_ct") and hasattr(ext, "appended_tokens"):
            return int(ext.verify_ct), int(ext.appended_tokens)
    return 0, 0


def profile_run(llm, batch, params, bs: int) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """One more run under cProfile: the functions with the most own time, and the run's wall time under it."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    llm.generate(batch, params, use_tqdm=False)
    prof.disable()
    wall = time.perf_counter() - t
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:40]
    return {"batch_size": bs, "wall_s_under_profiler": round(wall, 4),
            "top_own_time": [{"function": f"{Path(f).name}:{line}({fn})", "calls": nc, "own_s": round(tt, 5),
                              "cumulative_s": round(ct, 5)} for (f, line, fn), (_cc, nc, tt, ct, _c) in rows]}


def request_steps(llm, outs) -> list[int]:  # type: ignore[no-untyped-def]
    """Steps each request needed: its verify rows, plus one step per token it got from an ordinary decode or
    prefill row. A batch runs until its last request finishes, so the largest of these, not the average accept
    length, sets how many steps the batch takes."""
    stats: dict = {}
    for ext in getattr(llm.runtime.engine, "extensions").all:
        if hasattr(ext, "verify_ct") and hasattr(ext, "stats"):
            stats = ext.stats
    steps = []
    for o in outs:
        s = stats.get(o.rid)
        verify, appended = (s.verify_ct, s.appended_tokens) if s is not None else (0, 0)
        steps.append(verify + len(o.output_ids) - appended)
    return steps


def timed(llm, batch, params, sync):  # type: ignore[no-untyped-def]
    """One run of the batch: its wall seconds, the device drained before and after, and its outputs."""
    sync()
    t = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    sync()
    return time.perf_counter() - t, outs


def interleaved(args, LLM, SamplingParams, sync) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """Two engines in one process, their runs alternated per batch size: BASE, OTHER, BASE, OTHER, ... Returns
    per batch size both run lists (milliseconds per output token) and the ratio of their medians."""
    base, other = args.interleave
    llms = {name: LLM(args.model_path, dtype=args.dtype, max_total_tokens=args.pool_tokens, **CONFIGS[name])
            for name in (base, other)}
    out: dict[str, object] = {}
    for bs in args.batch_sizes:
        params = SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens)
        batch = prompts(llms[base], bs)
        ms: dict[str, list[float]] = {base: [], other: []}
        verify: dict[str, int] = {base: 0, other: 0}
        for name, llm in llms.items():
            llm.generate(batch, params, use_tqdm=False)  # warm-up of the same shape
        for _ in range(args.repeats):
            for name, llm in llms.items():
                v0, _ = spec_counts(llm)
                wall, outs = timed(llm, batch, params, sync)
                ms[name].append(round(1e3 * wall / max(len(o.output_ids) for o in outs), 3))
                verify[name] += spec_counts(llm)[0] - v0
        ratio = statistics.median(ms[base]) / statistics.median(ms[other])
        out[str(bs)] = {"ms_per_token": ms, "verify_rows": verify, "speedup_of_medians": round(ratio, 3),
                        "speedup_of_bests": round(min(ms[base]) / min(ms[other]), 3)}
        print(f"bs={bs:<3} {base} {statistics.median(ms[base]):.3f}  {other} {statistics.median(ms[other]):.3f} "
              f"ms/token (medians): {ratio:.3f}x  verify rows {verify}", flush=True)
    for llm in llms.values():
        llm.shutdown()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", type=Path)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--configs", nargs="+", default=["plain", "ngram"], choices=sorted(CONFIGS))
    parser.add_argument("--interleave", nargs=2, metavar=("BASE", "OTHER"), choices=sorted(CONFIGS),
                        help="instead: build both engines side by side (each with a pool of --pool-tokens) and "
                             "alternate their runs, so that drift of the GPU's speed and differences between "
                             "separately started engines fall on both alike")
    parser.add_argument("--pool-tokens", type=int, default=65536)
    parser.add_argument("--profile-host", metavar="CONFIG/BS",
                        help="one more run of that configuration and batch size under cProfile: the 40 functions "
                             "with the most own time go into the JSON (where a step's host time goes)")
    args = parser.parse_args()

    import torch

    from minisgl_ref import LLM, SamplingParams
    from minisgl_ref.bench.provenance import collect_provenance

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    result: dict[str, object] = {"provenance": collect_provenance(settings={
        "model_path": args.model_path, "batch_sizes": args.batch_sizes, "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats, "configs": {c: CONFIGS[c] for c in args.configs}}), "runs": {}}
    if args.interleave:
        result["provenance"]["settings"]["settings"]["interleave"] = args.interleave  # type: ignore[index]
        result["interleaved"] = interleaved(args, LLM, SamplingParams, sync)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        return 0
    outputs: dict[tuple[str, int], list[list[int]]] = {}
    for name in args.configs:
        t0 = time.perf_counter()
        llm = LLM(args.model_path, dtype=args.dtype, **CONFIGS[name])
        cold = time.perf_counter() - t0
        entry: dict[str, object] = {"cold_start_s": round(cold, 2), "batches": {}}
        for bs in args.batch_sizes:
            batch = prompts(llm, bs)
            params = SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens)
            llm.generate(batch, params, use_tqdm=False)  # warm-up of the same shape
            runs = []
            for _ in range(args.repeats):
                v0, a0 = spec_counts(llm)
                wall, outs = timed(llm, batch, params, sync)
                v1, a1 = spec_counts(llm)
                lens = [len(o.output_ids) for o in outs]
                steps = request_steps(llm, outs)
                runs.append({"wall_s": round(wall, 4), "output_tokens": sum(lens), "longest": max(lens),
                             "ms_per_token": round(1e3 * wall / max(lens), 3),
                             "tok_per_s": round(sum(lens) / wall, 1), "verify_rows": v1 - v0,
                             "tokens_per_verify_row": round((a1 - a0) / (v1 - v0), 3) if v1 > v0 else None,
                             "steps_of_slowest_request": max(steps), "steps_per_request": steps})
                outputs[(name, bs)] = [list(o.output_ids) for o in outs]
            if args.profile_host == f"{name}/{bs}":
                entry["host_profile"] = profile_run(llm, batch, params, bs)
            best = min(r["ms_per_token"] for r in runs)
            entry["batches"][str(bs)] = {"runs": runs, "best_ms_per_token": best,
                                         "median_ms_per_token": statistics.median(r["ms_per_token"] for r in runs)}
            print(f"{name:<12} bs={bs:<3} best {best:7.2f} ms/token  runs {[r['ms_per_token'] for r in runs]}  "
                  f"accept {[r['tokens_per_verify_row'] for r in runs]}", flush=True)
        result["runs"][name] = entry
        llm.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    plains = [c for c in args.configs if c in PLAIN]
    if plains:
        summary = {}
        for name in args.configs:
            if name in PLAIN:
                continue
            for bs in args.batch_sizes:
                plain = min(result["runs"][c]["batches"][str(bs)]["best_ms_per_token"] for c in plains)
                mine = result["runs"][name]["batches"][str(bs)]["best_ms_per_token"]
                same = sum(a == b for a, b in zip(outputs[(plains[0], bs)], outputs[(name, bs)]))
                summary[f"{name}/bs{bs}"] = {"speedup": round(plain / mine, 3), "identical_outputs": same,
                                             "requests": bs}
                print(f"{name}/bs{bs}: {plain / mine:.2f}x faster per token, {same}/{bs} outputs identical")
        result["summary"] = summary
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
