"""Why a request arriving during decode stalls the running ones: time every engine step around the arrival of a
long prompt while a few requests decode, and profile (cProfile, torch.profiler) the step that launches its prefill.

    python3 scripts/gpu/measure/prefill_stall.py OUT_PREFIX [--model-path qwen3-0.6b] [--arrivals 8]
    python3 scripts/gpu/measure/prefill_stall.py OUT_PREFIX --ab --arrivals 24   # padding x FA3 call, interleaved
    python3 scripts/gpu/measure/prefill_stall.py OUT_PREFIX --ab graphs --arrivals 16   # extend CUDA graphs on/off

Writes OUT_PREFIX.json (step times per arrival) and OUT_PREFIX.profile.txt.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--model-path", default="qwen3-0.6b")
    p.add_argument("--arrivals", type=int, default=8)
    p.add_argument("--running", type=int, default=8)
    p.add_argument("--fixed-length", type=int, default=None,
                   help="every arriving prompt has this many tokens (default: 700-1,099 at random): whether the "
                        "stall is a first-call cost per new shape")
    p.add_argument("--ab", nargs="?", const="pad", choices=["pad", "graphs"],
                   help="interleave settings over the arrivals: 'pad' (the default), extend padding to 64 tokens "
                        "on/off x FA3's operator called directly / through its Python entry point; 'graphs', "
                        "one-request extend steps in CUDA graphs or eager")
    p.add_argument("--device", default="cuda", help="cpu: a dry run of this script, nothing measured")
    args = p.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from minisgl_ref import LLM, SamplingParams
    from minisgl_ref.bench.provenance import collect_provenance
    from minisgl_ref.engine.extend_graph import ExtendGraphRunner

    llm = LLM(args.model_path, load_format="dummy", dtype="bfloat16", device=args.device)
    engine = llm.engine
    rng = random.Random(0)
    vocab = llm.config.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    llm.generate([prompt(900) for _ in range(4)], SamplingParams(max_new_tokens=8, ignore_eos=True), use_tqdm=False)
    for _ in range(args.running):
        engine.add_request(llm.make_request(prompt(1000), SamplingParams(max_new_tokens=100000, ignore_eos=True)))
    for _ in range(30):
        engine.step()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    sync()

    def timed_steps(n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            engine.step()
            out.append(1e3 * (time.perf_counter() - t0))
        return out

    runner = engine.runner
    pb = runner.attn_backend.phase_backend(decode=False)  # the backend of extend steps
    op = getattr(pb, "op", None)
    settings = [("pad64+op", 64, op), ("pad1+op", 1, op), ("pad64+entry", 64, None), ("pad1+entry", 1, None)]
    if args.ab == "pad" and runner.extend_token_multiple < 64:
        p.error("--ab pad needs an engine built with extend steps padded to 64 (a CUDA device)")
    graphs = runner.graph_runners
    if args.ab == "graphs":
        eager = [g for g in graphs if not isinstance(g, ExtendGraphRunner)]
        settings = [("extend graphs", graphs, None), ("eager extend", eager, None)]
    report, text = [], io.StringIO()
    for i in range(args.arrivals):
        label = None
        if args.ab == "graphs":
            label, runner.graph_runners, _ = settings[i % len(settings)]
        elif args.ab:
            label, runner.extend_token_multiple, pb.op = settings[i % len(settings)]
        before = timed_steps(5)
        n = args.fixed_length or rng.randrange(700, 1100)
        engine.add_request(llm.make_request(prompt(n), SamplingParams(max_new_tokens=100000, ignore_eos=True)))
        if args.ab:
            after = timed_steps(3)
        elif i == args.arrivals - 2:
            prof = cProfile.Profile()
            prof.enable()
            after = timed_steps(3)
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
            text.write(f"=== cProfile: the 3 steps after an arrival of {n} tokens: {after}\n{s.getvalue()}\n")
        elif i == args.arrivals - 1:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
                after = timed_steps(3)
                torch.cuda.synchronize()
            text.write(f"=== torch.profiler: the 3 steps after an arrival of {n} tokens: {after}\n")
            for key in ("self_cpu_time_total", "self_cuda_time_total"):
                text.write(tp.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70) + "\n")
        else:
            after = timed_steps(3)
        report.append({"setting": label, "prompt_tokens": n, "steps_before_ms": before, "steps_after_ms": after})
        print(json.dumps(report[-1]), flush=True)
        for _ in range(20):
            engine.step()
    summary = {}
    for label, _, _ in settings if args.ab else []:
        stalls = sorted(r["steps_after_ms"][0] for r in report if r["setting"] == label)
        summary[label] = {"arrivals": len(stalls), "stall_ms_median": round(stalls[len(stalls) // 2], 3),
                          "stall_ms_max": round(stalls[-1], 3), "stall_ms": [round(x, 3) for x in stalls]}
    print("summary:", json.dumps(summary), flush=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"what": __doc__.split("\n\n")[0], "fixed_length": args.fixed_length, "ab": summary or None,
                   "arrivals": report, "provenance": collect_provenance(sys.argv)}, f, indent=1)
    with open(args.out + ".profile.txt", "w") as f:
        f.write(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
