"""The canonical offline workload through the public ``LLM`` API, for comparing two versions of the engine.

Runs whichever ``minisgl_ref`` is first on ``sys.path`` (so the same file measures an older checkout too, with
``PYTHONPATH=that/checkout``): one untimed warm-up of 32 requests, then the 256-request workload ``--runs``
times in this process, each timed around the whole ``generate`` call. Prints one JSON line.

Every timed run starts with an empty radix cache: the warm-up's prompts are drawn from another seed, and the
cache is flushed after the warm-up and after each run. Without that, a repeat finds most of its prompts cached
and skips most of its prefill, so it is not a repeat of the same work (a ~3% faster "second run").

The workload is written out here rather than imported, so that it is the same for every version measured:
``random.seed(0)``; 256 prompts of ``randint(100, 1024)`` ids drawn with ``randint(0, 10000)``; then each
request's ``max_new_tokens = randint(100, 1024)``; temperature 0.6, ``ignore_eos``. Qwen3-0.6B config, bf16,
dummy weights. ``scripts/gpu/ab.sh`` interleaves processes of two checkouts.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch


def canonical(n: int = 256, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    random.seed(seed)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(n)]
    max_tokens = [random.randint(100, 1024) for _ in range(n)]
    return prompts, max_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--label", required=True)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--page-size", type=int, default=None, help="the engine's KV page size (default: its own)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="NAME=JSON",
                    help="another engine argument, its value as JSON (e.g. disable_budget_step_graph=true); repeatable")
    args = ap.parse_args()
    import minisgl_ref
    from minisgl_ref import LLM, SamplingParams

    t0 = time.perf_counter()
    extra = {} if args.page_size is None else {"page_size": args.page_size}
    for item in args.engine_arg:
        name, _, value = item.partition("=")
        extra[name] = json.loads(value)
    llm = LLM("qwen3-0.6b", load_format="dummy", dtype="bfloat16", device="cuda", **extra)
    start_s = time.perf_counter() - t0

    def flush() -> None:
        """Empty the radix cache, so the next run prefills every prompt."""
        engine = getattr(llm, "engine", None)
        if engine is not None and hasattr(engine, "flush_cache") and engine.flush_cache() is False:
            raise RuntimeError("the radix cache could not be flushed: requests still running")

    def run(n: int, seed: int = 0) -> tuple[int, float]:
        prompts, max_tokens = canonical(n, seed)
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_new_tokens=m) for m in max_tokens]
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        return sum(o.completion_tokens for o in outs), time.perf_counter() - t

    warm_tokens, warm_s = run(32, seed=1)
    flush()
    runs = []
    for _ in range(args.runs):
        tokens, wall = run(256)
        flush()
        runs.append({"output_tokens": tokens, "wall_s": round(wall, 3), "tok_s": round(tokens / wall, 1)})
    print(json.dumps({"label": args.label, "package": minisgl_ref.__file__, **extra, "engine_start_s": round(start_s, 1),
                      "warmup_32_s": round(warm_s, 2), "runs": runs}), flush=True)


if __name__ == "__main__":
    main()
