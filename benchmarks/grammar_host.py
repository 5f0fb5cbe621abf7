"""``python -m benchmarks.grammar_host``: the host's grammar work per decode step, part by part (chapter 12).

On a GPU a decode step of a small model is bound by the host (chapter 11), so every microsecond of grammar work
per step adds to the step: it is the whole overhead of constrained decoding there. This benchmark replays what
the engine does for each constrained row of a decode step, without a model, so that each part can be timed on
any machine:

- ``accept``: the matcher accepts the row's sampled token and the engine asks whether the grammar has ended,
  one Python call each per row (:meth:`GrammarState.accept`, :attr:`GrammarState.is_terminated`);
- ``accept_batch``: the same tokens accepted by one call of xgrammar's ``batch_accept_token`` (native loop);
- ``fill``: the rows' next-token masks written by :meth:`TokenBitmask.fill` (xgrammar's batch fill, on
  ``FILL_THREADS`` threads);
- ``apply``: :meth:`TokenBitmask.apply` on CPU logits (on a GPU this is a device kernel instead).

The rows write real documents: valid instances of the typical schema of ``scripts/gpu/measure/constrained_bench.py``
(the fields a pydantic model declares, no length bounds), tokenized by the embedded SmolLM2's tokenizer, one per
row with different values, so that rows sit in different places of the grammar at each step as they would in a
batch. Times are per decode step (the median over the steps of all documents), for each batch size.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["Ada Lovelace", "Grace Hopper", "Alan Turing", "Barbara Liskov", "Edsger Dijkstra", "Frances Allen",
         "Donald Knuth", "Margaret Hamilton", "Ken Thompson", "Radia Perlman", "John Backus", "Karen Jones"]  # fmt: skip
CITIES = [("London", "United Kingdom"), ("Lyon", "France"), ("Oslo", "Norway"), ("Naples", "Italy")]
ROLES = ["student", "teacher", "engineer", "artist"]
SKILLS = ["mathematics", "poetry", "compilers", "chess", "painting", "networks", "sailing", "baking"]


def typical_schema() -> dict[str, Any]:
    """The typical schema of chapter 12's GPU benchmark (one definition, read from that script)."""
    spec = importlib.util.spec_from_file_location("constrained_bench", ROOT / "scripts" / "gpu" / "measure" / "constrained_bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TYPICAL_SCHEMA


def document(i: int) -> str:
    """The ``i``-th valid instance of the typical schema: every row of a batch writes a different one."""
    city, country = CITIES[i % len(CITIES)]
    doc: dict[str, Any] = {"name": f"{NAMES[i % len(NAMES)]} {i}", "age": 20 + (7 * i) % 60,
                           "role": ROLES[i % len(ROLES)], "skills": [SKILLS[(i + k) % len(SKILLS)] for k in range(1 + i % 3)]}  # fmt: skip
    if i % 2 == 0:
        doc["address"] = {"city": city, "country": country}
    return json.dumps(doc)


def measure(batch: int, backend: Any, compiled: Any, docs: list[list[int]], eos: int) -> dict[str, float]:
    """Median milliseconds per decode step of each part, for ``batch`` rows writing ``docs`` (then EOS)."""
    import xgrammar as xgr

    from minisgl_ref.constrained.bitmask import TokenBitmask

    streams = [docs[r % len(docs)] + [eos] for r in range(batch)]
    states = [backend.matcher(compiled, [eos]) for _ in range(batch)]
    twins = [backend.matcher(compiled, [eos]) for _ in range(batch)]  # advanced by the batch call
    mask = TokenBitmask(backend.vocab_size, batch)
    logits = torch.zeros(batch, backend.vocab_size, dtype=torch.bfloat16)
    runner = xgr.BatchGrammarMatcher()
    parts: dict[str, list[float]] = {"accept": [], "accept_batch": [], "fill": [], "apply": []}
    rows = list(range(batch))
    mask.fill([(i, states[i]) for i in rows])  # the first step's masks, as at admission
    for t in range(max(len(s) for s in streams)):
        live = [i for i in rows if t < len(streams[i])]
        if not live:
            break
        tokens = [streams[i][t] for i in live]
        t0 = time.perf_counter()
        for i, token in zip(live, tokens):
            if not states[i].accept(token):
                raise ValueError(f"row {i} refused token {token} at step {t}: the document does not fit the schema")
            states[i].is_terminated  # noqa: B018 - the engine asks this for every accepted token
        t1 = time.perf_counter()
        ok = runner.batch_accept_token([twins[i].xgr_matcher for i in live], tokens)
        [twins[i].is_terminated for i in live]  # noqa: B018
        t2 = time.perf_counter()
        if not all(ok):
            raise ValueError(f"batch accept refused a token at step {t}")
        open_rows = [i for i in live if not states[i].is_terminated]
        mask.fill([(i, states[i]) for i in open_rows])
        t3 = time.perf_counter()
        mask.apply(logits, open_rows)
        t4 = time.perf_counter()
        for name, seconds in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            parts[name].append(seconds * 1e3)
    return {name: round(statistics.median(v), 4) for name, v in parts.items()} | {"steps": len(parts["fill"])}


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.grammar_host", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 64, 256])
    p.add_argument("--repeats", type=int, default=3, help="runs per batch size (the median of each part is kept)")
    p.add_argument("--output", default=None, help="write the results with provenance to this JSON file")
    args = p.parse_args()
    from minisgl_ref.bench.provenance import collect_provenance
    from minisgl_ref.constrained.backend import GrammarBackend
    from minisgl_ref.constrained.bitmask import FILL_THREADS
    from minisgl_ref.constrained.spec import GrammarSpec
    from minisgl_ref.models.embedded import embedded_model_path
    from minisgl_ref.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(embedded_model_path())
    eos = min(tokenizer.eos_token_ids)
    backend = GrammarBackend(tokenizer.hf, len(tokenizer.hf), stop_token_ids=[eos])
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps(typical_schema())))
    docs = [tokenizer.hf.encode(document(i), add_special_tokens=False) for i in range(64)]
    results = []
    for batch in args.batch_sizes:
        runs = [measure(batch, backend, compiled, docs, eos) for _ in range(args.repeats)]
        row = {"batch": batch, **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
        row["accept_us_per_row"] = round(1e3 * row["accept"] / batch, 2)
        row["accept_batch_us_per_row"] = round(1e3 * row["accept_batch"] / batch, 2)
        row["fill_us_per_row"] = round(1e3 * row["fill"] / batch, 2)
        results.append(row)
        print(f"batch {batch:>4}: accept {row['accept']:.3f} ms (batch call {row['accept_batch']:.3f}), fill "
              f"{row['fill']:.3f} ms, apply {row['apply']:.3f} ms per step; {row['steps']:.0f} steps", flush=True)
    backend.shutdown()
    out = {"benchmark": "grammar_host", "schema": "typical (scripts/gpu/measure/constrained_bench.py TYPICAL_SCHEMA)",
           "tokenizer": "SmolLM2-135M-Instruct (embedded)", "fill_threads": FILL_THREADS,
           "mean_document_tokens": round(statistics.fmean(len(d) for d in docs), 1), "results": results,
           "provenance": collect_provenance(batch_sizes=args.batch_sizes, repeats=args.repeats)}  # fmt: skip
    if args.output:
        Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
