"""Chapter 12's GPU numbers: what a JSON-schema grammar costs per output token, and what jump-forward buys.

    python3 scripts/gpu/measure/constrained_bench.py OUT.json [--batch-sizes 1 64 256] [--max-new-tokens 160] [--mixed]

The embedded SmolLM2-135M-Instruct (real weights: a grammar only means something with a model that writes JSON)
on the GPU, default engine (overlap, CUDA graphs). Per batch size, three timed runs of the same prompts, each
after an untimed warm-up of the same shape:

  constrained    every request asks for a typical JSON schema (an object with a string, an integer with bounds,
                 an enum, an array of strings and an optional nested object), greedy
  free           the same prompts without the grammar, ignore_eos, each request held to the length its
                 constrained twin produced: the same number of output tokens, so the time per token compares
  jump_forward   constrained, with jump-forward decoding on

Reported: wall seconds, output tokens, milliseconds per output token per request (wall / decode steps) and
throughput, and the ratios constrained / free and jump_forward / constrained; every constrained output is
checked against the schema (jsonschema) and the count of invalid ones is reported (it must be 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["student", "teacher", "engineer", "artist"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                     "country": {"type": "string", "maxLength": 30}},
                    "required": ["city", "country"]},
    },
    "required": ["name", "age", "role", "skills"],
}
# The same fields as a pydantic model declares them by default: no length bounds (``--schema typical``). Bounded
# strings are the expensive case for a grammar engine: a string of at most 40 characters is a 40-state chain, and
# the tokens that fit at each point of it are not known in advance but checked at every step.
TYPICAL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "role": {"type": "string", "enum": ["student", "teacher", "engineer", "artist"]},
        "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
                    "required": ["city", "country"]},
    },
    "required": ["name", "age", "role", "skills"],
}
PEOPLE = ["a nurse from Lyon", "a retired pilot", "a young painter in Oslo", "a chess teacher", "a data engineer",
          "a student of music", "a baker in Naples", "a marine biologist"]


def prompts(llm, n: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    out = []
    for i in range(n):
        text = f"Describe {PEOPLE[i % len(PEOPLE)]} (person #{i}) as a JSON object with name, age, role and skills."
        out.append(llm.tokenizer.apply_chat_template([{"role": "user", "content": text}]))
    return out


def step_kinds(path: Path) -> dict[str, dict[str, float]]:
    """The timed run's steps from its step log, by kind: ``decode`` (every row decodes one token), ``extend``
    (no decode row: prompts, or the tokens a jump appended) and ``mixed`` (both in one step). Per kind: how many
    steps, their rows and extend tokens on average, and the milliseconds between consecutive steps' tokens
    (median and total): where a run's wall time went."""
    import statistics

    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out: dict[str, dict[str, float]] = {}
    for kind in ("decode", "extend", "mixed"):
        rows = [s for s in lines
                if kind == ("decode" if s["prefill_tokens"] == 0 else "extend" if s["decode_rows"] == 0 else "mixed")]
        if rows:
            gaps = [s["gap_ms"] for s in rows]
            out[kind] = {"steps": len(rows), "mean_rows": round(statistics.fmean(s["rows"] for s in rows), 1),
                         "mean_extend_tokens": round(statistics.fmean(s["prefill_tokens"] for s in rows), 1),
                         "median_gap_ms": round(statistics.median(gaps), 3), "total_gap_ms": round(sum(gaps), 1)}
    return out


def timed(llm, batch, params, profiler=None, step_log: Path | None = None):  # type: ignore[no-untyped-def]
    llm.generate(batch, params, use_tqdm=False)  # warm-up of the same shape (graphs, grammar cache)
    stats = llm.engine.stats
    steps0 = stats.steps
    trace = None
    if step_log is not None:
        from minisgl_ref.bench.step_trace import StepTrace

        step_log.unlink(missing_ok=True)
        trace = StepTrace(step_log)
        llm.engine.extensions.attach(trace)
    if profiler is not None:
        profiler.enable()
    t0 = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    if profiler is not None:
        profiler.disable()
    tokens = sum(len(o.output_ids) for o in outs)
    steps = stats.steps - steps0
    result = {"wall_s": wall, "output_tokens": tokens, "steps": steps, "output_throughput": tokens / wall,
              "ms_per_step": 1e3 * wall / max(steps, 1)}
    if trace is not None and step_log is not None:
        llm.engine.extensions.detach(trace)
        trace.close()
        result["step_kinds"] = step_kinds(step_log)
    return outs, result


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--load-format", default="auto", help="dummy: random weights, the folder's real tokenizer")
    p.add_argument("--schema", choices=["bounded", "typical"], default="bounded",
                   help="bounded: strings with maxLength (the default); typical: the same fields without bounds")
    p.add_argument("--mixed", action="store_true",
                   help="mixed prefill+decode steps (as `serve` runs on a GPU): a jumped request's extend row rides "
                        "in the decode step, which then replays an extend graph when it fits one")
    p.add_argument("--torch-profile", action="store_true",
                   help="profile the device (torch.profiler) during each timed jump-forward run: the kernels and "
                        "operators by device and host time to OUT.torch_profile.txt")
    p.add_argument("--step-log", default=None, metavar="DIR",
                   help="write each timed run's step log to DIR and add its steps by kind (decode, extend, mixed) "
                        "to the results")
    p.add_argument("--profile", action="store_true",
                   help="profile the host (cProfile) during each timed constrained, free and jump-forward run, top "
                        "functions to OUT.profile.txt")
    p.add_argument("--skip-jump-forward", action="store_true", help="only the constrained and free runs")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs of each kind per batch size, constrained and free alternating; the median counts")
    args = p.parse_args()
    import jsonschema

    from minisgl_ref import LLM, SamplingParams
    from minisgl_ref.bench.provenance import collect_provenance
    from minisgl_ref.constrained.extension import StructuredOutput

    schema_obj = SCHEMA if args.schema == "bounded" else TYPICAL_SCHEMA
    schema = json.dumps(schema_obj)
    results = []

    def log_path(bs: int, run: str) -> Path | None:
        return Path(args.step_log) / f"{run}_{bs}.jsonl" if args.step_log else None

    for jump in (False,) if args.skip_jump_forward else (False, True):
        llm = LLM(args.model_path, load_format=args.load_format, enable_jump_forward=jump,
                  enable_mixed_chunk=args.mixed)
        for bs in args.batch_sizes:
            batch = prompts(llm, bs)
            cons = SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens, json_schema=schema)
            structured = llm.engine.extensions.find(StructuredOutput)
            jumped = structured.jump_forward_tokens
            if args.profile:
                import cProfile
                import io
                import pstats

                prof = cProfile.Profile()
                outs, r = timed(llm, batch, cons, prof)
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
                with open(args.out + ".profile.txt", "a") as f:
                    f.write(f"=== batch {bs}, {'jump_forward' if jump else 'constrained'}, {r['wall_s']:.2f} s\n"
                            f"{text.getvalue()}\n")
            elif args.torch_profile and jump:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    outs, r = timed(llm, batch, cons)
                with open(args.out + ".torch_profile.txt", "a") as f:
                    f.write(f"=== batch {bs}, jump_forward, {r['wall_s']:.2f} s, {r['steps']} steps\n")
                    for key in ("self_cuda_time_total", "self_cpu_time_total"):
                        f.write(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=70) + "\n")
            else:
                outs, r = timed(llm, batch, cons, step_log=log_path(bs, "jump_forward" if jump else "constrained"))
            jumped = (structured.jump_forward_tokens - jumped) // 2  # warm-up and timed run alike
            bad = 0
            for o in outs:
                try:
                    jsonschema.validate(json.loads(o.text), schema_obj)
                except (ValueError, jsonschema.ValidationError):
                    bad += 1
            row = {"batch_size": bs, "run": "jump_forward" if jump else "constrained", "invalid": bad,
                   "finished_by_length": sum(o.finish_reason == "length" for o in outs), **r}
            if jump:
                row["jump_forward_tokens"] = jumped
            results.append(row)
            if not jump:  # the free twin: same prompts, the same output lengths, no grammar
                free = [SamplingParams(temperature=0, max_new_tokens=max(len(o.output_ids), 1), ignore_eos=True)
                        for o in outs]
                if args.profile:  # the free twin too, to compare the two host profiles function by function
                    import cProfile
                    import io
                    import pstats

                    prof = cProfile.Profile()
                    _, r = timed(llm, batch, free, prof)
                    text = io.StringIO()
                    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
                    with open(args.out + ".profile.txt", "a") as f:
                        f.write(f"=== batch {bs}, free, {r['wall_s']:.2f} s\n{text.getvalue()}\n")
                else:
                    _, r = timed(llm, batch, free, step_log=log_path(bs, "free"))
                results.append({"batch_size": bs, "run": "free", **r})
                if args.repeats > 1:  # more timed runs, alternating, so that a slow moment hits both kinds
                    runs = {"constrained": [results[-2]["wall_s"]], "free": [r["wall_s"]]}
                    for _ in range(args.repeats - 1):
                        for kind, params in (("constrained", cons), ("free", free)):
                            t0 = time.perf_counter()
                            llm.generate(batch, params, use_tqdm=False)
                            runs[kind].append(time.perf_counter() - t0)
                    for row in results[-2:]:
                        row["wall_runs_s"] = [round(w, 4) for w in runs[row["run"]]]
                        row["wall_s"] = statistics.median(runs[row["run"]])
                        row["output_throughput"] = row["output_tokens"] / row["wall_s"]
                        row["ms_per_step"] = 1e3 * row["wall_s"] / max(row["steps"], 1)
            print(json.dumps(results[-1]), flush=True)
        del llm
    by = {(r["batch_size"], r["run"]): r for r in results}
    summary = []
    for bs in args.batch_sizes:
        c, f, j = by[(bs, "constrained")], by[(bs, "free")], by.get((bs, "jump_forward"))
        summary.append({"batch_size": bs,
                        "constrained_over_free_time_per_token": (c["wall_s"] / c["output_tokens"])
                        / (f["wall_s"] / f["output_tokens"])})
        if j is not None:
            summary[-1]["jump_forward_over_constrained_wall"] = j["wall_s"] / c["wall_s"]
        print(f"bs {bs:>4}: constrained / free time per output token {summary[-1]['constrained_over_free_time_per_token']:.3f}"
              + (f"   jump-forward / constrained wall {summary[-1]['jump_forward_over_constrained_wall']:.3f}"
                 f"   invalid {c['invalid']}/{bs}, {j['invalid']}/{bs}" if j is not None else f"   invalid {c['invalid']}/{bs}"))
    doc = {"what": __doc__.split("\n\n")[0], "model_path": args.model_path or "embedded SmolLM2-135M-Instruct",
           "load_format": args.load_format, "schema_name": args.schema, "mixed": args.mixed,
           "schema": schema_obj, "results": results,
           "summary": summary,
           "provenance": collect_provenance(sys.argv)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
