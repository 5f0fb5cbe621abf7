"""Per-request features on a GPU (chapter 10): log probabilities, logit bias, cache salts, and a request whose
step fails, on Qwen3-0.6B (bf16, dummy weights) with the default engine (CUDA graphs, overlap).

Checks, each recorded in the JSON:

* asking for log probabilities does not change the greedy tokens, and each greedy token's log probability is
  its position's best one;
* prompt log probabilities are computed even when the prompt's prefix is cached (the cache is bypassed for them);
* a logit bias of -100 bans a token; requests with different cache salts share nothing;
* a request whose data breaks a step (stop ids corrupted after admission) is aborted alone: the others produce
  the tokens they produce without it;
* the cost of log probabilities: decode-heavy batches of 64 requests with none / all of them asking (top 5).

Usage (repository root, CUDA): ``python3 scripts/gpu/measure/request_features.py --out results``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from minisgl_ref import LLM, SamplingParams
from minisgl_ref.bench.provenance import collect_provenance


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 100_000) for _ in range(length)] for _ in range(n)]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(llm: LLM, batch: list[list[int]], params: SamplingParams, **kw) -> tuple[float, list]:
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False, **kw)
    sync()
    return time.perf_counter() - t0, outs


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="results")
    p.add_argument("--quick", action="store_true", help="tiny sizes, to try the script on a CPU")
    args = p.parse_args()
    n_cost, n_out = (4, 8) if args.quick else (64, 128)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    llm = LLM("qwen3-0.6b", load_format="dummy", dtype="bfloat16")
    start_s = time.perf_counter() - t_start
    greedy = SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True)
    checks: dict[str, bool] = {}
    batch = prompts(8, 200, 0)

    plain = llm.generate(batch, greedy, use_tqdm=False)
    with_lp = llm.generate(batch, greedy, use_tqdm=False, return_logprob=True, top_logprobs_num=5,
                           logprob_start_len=150)
    checks["logprobs_do_not_change_tokens"] = [o.output_ids for o in plain] == [o.output_ids for o in with_lp]
    checks["greedy_token_is_top1"] = all(abs(lp - top[0][1]) < 1e-3 and tok == top[0][0]
                                         for o in with_lp for lp, tok, top in o.output_token_logprobs)
    checks["prompt_logprobs_despite_cache"] = all(len(o.input_token_logprobs) == 50 for o in with_lp)

    banned = plain[0].output_ids[0]
    biased = llm.generate(batch[0], SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True,
                                                   logit_bias={banned: -100}), use_tqdm=False)[0]
    checks["logit_bias_bans"] = banned not in biased.output_ids

    salted = prompts(1, 300, 1)[0]
    cached = []
    for salt in ("a", "b", "a"):
        req = llm.make_request(salted, SamplingParams(max_new_tokens=1), cache_salt=salt)
        llm.engine.add_request(req)
        llm.engine.run_until_done()
        cached.append(req.cached_tokens)
    checks["cache_salt_isolates"] = cached[0] == 0 and cached[1] == 0 and cached[2] > 0

    # A request whose stop ids are corrupted while it waits is admitted into a mixed step with the others.
    iso_prompts = prompts(4, 64, 2)
    iso_params = [SamplingParams(temperature=0, max_new_tokens=m, ignore_eos=True) for m in (3, 24, 24, 24)]
    expected = [o.output_ids for o in llm.generate(iso_prompts[:3], iso_params[:3], use_tqdm=False)]
    iso = LLM("qwen3-0.6b", load_format="dummy", dtype="bfloat16", max_running_requests=3, enable_mixed_chunk=True,
              max_total_tokens=8192)  # the first engine's pool holds most of the GPU's memory
    reqs = [iso.make_request(pr, sp) for pr, sp in zip(iso_prompts, iso_params)]
    victim = reqs[3]
    victim.params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    for r in reqs:
        iso.engine.add_request(r)
    while iso.engine.has_work:
        if victim in iso.engine.scheduler.waiting and not victim.params.stop_token_ids:
            victim.params.stop_token_ids = [10**7]
            victim.params.min_new_tokens = 5
        iso.engine.step()
    checks["failing_request_aborted_alone"] = (
        victim.finish_reason.kind == "abort" and [r.output_ids for r in reqs[:3]] == expected)
    del iso

    # The cost of asking: 64 requests, 128 tokens out, with and without log probabilities (top 5), twice each.
    cost_batch = prompts(n_cost, 256, 3)
    cost_params = SamplingParams(temperature=0, max_new_tokens=n_out, ignore_eos=True)
    timed(llm, cost_batch[:8], cost_params)  # warm
    runs = {"none": [], "all_top5": []}
    for _ in range(2):
        runs["none"].append(timed(llm, cost_batch, cost_params)[0])
        runs["all_top5"].append(timed(llm, cost_batch, cost_params, return_logprob=True, top_logprobs_num=5)[0])
    tokens = n_cost * n_out
    result = {
        "provenance": collect_provenance(sys.argv),
        "engine_start_s": round(start_s, 2),
        "checks": checks,
        "logprob_cost": {k: {"seconds": [round(x, 3) for x in v], "tok_per_s": round(tokens / min(v))}
                         for k, v in runs.items()},
        "cached_tokens_by_salt": cached,
    }
    (out / "gpu_request_features_h100.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("checks", "logprob_cost", "engine_start_s")}, indent=2))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
