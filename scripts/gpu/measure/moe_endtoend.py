"""The fused MoE kernel against the reference loop over experts, end to end through the engine (chapter 14).

One engine of Qwen3-30B-A3B (its real config, dummy weights, bf16, one GPU) with CUDA graphs off, because the
reference loop reads the routing back to the host and cannot be captured. The same small canonical workload runs
with each experts function in turn (:func:`~minisgl_ref.moe.layer.use_experts` swaps them in the built engine),
alternating, ``--repeats`` times each; the report gives each run's wall time and output tok/s, the median ratio,
and the routing counts of the last fused run (``enable_expert_distribution_metrics``). Every run's greedy output
tokens are compared too: the two functions compute the same layer (bf16 rounding aside).

    PYTHONPATH=$PWD python3 scripts/gpu/measure/moe_endtoend.py --out results   # writes results/moe_endtoend.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results")
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-output", type=int, default=64)
    p.add_argument("--max-input", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", default="cuda", help="cpu: a check of the script on a tiny model folder")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()

    import torch

    from minisgl_ref import LLM
    from minisgl_ref.bench.offline import time_generate
    from minisgl_ref.bench.provenance import collect_provenance
    from minisgl_ref.bench.workloads import canonical_workload
    from minisgl_ref.moe.experts import reference_experts
    from minisgl_ref.moe.fused_moe import fused_experts
    from minisgl_ref.moe.layer import use_experts

    workload = canonical_workload(args.num_prompts, input_len=(min(100, args.max_input), args.max_input), output_len=(args.max_output // 2, args.max_output))
    t0 = time.perf_counter()
    llm = LLM(args.model, load_format="dummy", dtype=args.dtype, device=args.device, disable_cuda_graph=True,
              enable_expert_distribution_metrics=True)
    startup = time.perf_counter() - t0
    warm = canonical_workload(2, input_len=(16, 32), output_len=(4, 8), seed=1)
    runs: list[dict] = []
    outputs: dict[str, list[list[int]]] = {}
    greedy = [dict(p, temperature=0.0) for p in workload.sampling_params]
    workload = dataclasses.replace(workload, sampling_params=greedy)
    if args.device == "cpu":  # the check's tiny vocabulary
        vocab = llm.config.vocab_size
        workload = dataclasses.replace(workload, prompts=[[t % vocab for t in p] for p in workload.prompts])
        warm = dataclasses.replace(warm, prompts=[[t % vocab for t in p] for p in warm.prompts])
    for _ in range(args.repeats):
        for name, fn in (("fused", fused_experts), ("reference", reference_experts)):
            use_experts(llm.model, fn)
            outs, wall, _ = time_generate(llm, workload, warmup=warm)
            outputs[name] = [o.output_ids for o in outs]
            tokens = sum(len(o.output_ids) for o in outs)
            aborted = sum(o.finish_reason == "abort" for o in outs)
            runs.append({"experts": name, "wall_s": wall, "output_tokens": tokens, "output_throughput": tokens / wall,
                         "aborted": aborted})
            if aborted:
                raise RuntimeError(f"{aborted} requests aborted with the {name} experts: the numbers would be wrong")
            print(f"[moe_endtoend] {name}: {wall:.2f} s, {tokens / wall:,.1f} output tok/s", file=sys.stderr)
            if name == "fused":
                routing = llm.dump_expert_distribution_record()
    med = {n: statistics.median(r["wall_s"] for r in runs if r["experts"] == n) for n in ("fused", "reference")}
    same = sum(a == b for a, b in zip(outputs["fused"], outputs["reference"]))
    report = {
        "benchmark": "moe_endtoend",
        "model": args.model,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device, "startup_s": startup,
        "workload": workload.summary(), "disable_cuda_graph": True, "runs": runs,
        "median_wall_s": med, "speedup_fused_over_reference": med["reference"] / med["fused"],
        "requests_with_identical_greedy_tokens": same, "requests": len(outputs["fused"]),
        "routing_of_last_fused_run": {k: v for k, v in routing.items() if k != "pairs"},
        "provenance": collect_provenance(sys.argv, repeats=args.repeats),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_endtoend.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"[moe_endtoend] fused {report['speedup_fused_over_reference']:.1f}x the reference; identical greedy "
          f"tokens in {same} of {len(outputs['fused'])} requests", file=sys.stderr)
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
