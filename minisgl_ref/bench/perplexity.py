"""Perplexity of a fixed text through the engine (chapter 15): how much a way of storing numbers costs in accuracy.

The perplexity of a text is ``exp`` of the mean negative log probability the model gives each of its tokens after
the ones before; a model that quantization damages is more surprised by ordinary text. It is measured through the
real engine (prompt log probabilities of one request, ``logprob_start_len=0``), with chunked prefill, so that every
chunk after the first reads the earlier chunks' keys and values back from the KV pool: with an FP8 KV cache the
measurement includes what the cache stored, not only the weights.

The text (``texts/perplexity.txt``, 2,548 tokens for SmolLM2's tokenizer) is prose from this book's own early
chapters, frozen here so that the number means the same thing later.

    python -m minisgl_ref bench perplexity                 # bf16 against FP8 weights, FP8 KV and both
    python -m minisgl_ref bench perplexity --variants bf16,fp8 --output results/ppl.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

TEXT = Path(__file__).parent / "texts" / "perplexity.txt"

#: name -> (quantization, kv_cache_dtype): the model as stored, and what each variant changes.
VARIANTS: dict[str, tuple[str | None, str]] = {
    "bf16": (None, "auto"),
    "fp8": ("fp8", "auto"),
    "w8a8_fp8": ("w8a8_fp8", "auto"),
    "fp8_kv": (None, "fp8_e4m3"),
    "fp8_e5m2_kv": (None, "fp8_e5m2"),
    "fp8+fp8_kv": ("fp8", "fp8_e4m3"),
}
DEFAULT_VARIANTS = ("bf16", "fp8", "fp8_kv", "fp8+fp8_kv")
#: The chat questions of the engine's oracle tests: each variant answers them greedily, and the answers are
#: compared token by token with the first variant's.
QUESTIONS = ("What is the capital of France?", "Write a short poem about the sea.", "List three prime numbers.",
             "Explain what a GPU is in one sentence.")
GREEDY_TOKENS = 32


def default_text() -> str:
    return TEXT.read_text()


@dataclass
class PerplexityResult:
    variant: str
    quantization: str | None
    kv_cache_dtype: str
    tokens: int  # tokens scored (the text's tokens but the first)
    nll: float  # mean negative log probability per token (nats)
    perplexity: float
    ratio_to_first: float  # perplexity / that of the first variant measured (bf16 by default)
    seconds: float
    # Greedy answers to QUESTIONS: how many equal the first variant's token for token, and the mean share of
    # tokens before an answer first differs from it.
    greedy_identical: int = 0
    greedy_shared_prefix: float = 1.0


def text_perplexity(llm, ids: list[int]) -> tuple[int, float]:  # type: ignore[no-untyped-def]
    """``(tokens scored, mean negative log probability)`` of ``ids`` under ``llm``, from one request's prompt log
    probabilities."""
    from minisgl_ref.sampling.params import SamplingParams

    out = llm.generate([ids], SamplingParams(max_new_tokens=1, temperature=0), return_logprob=True,
                       logprob_start_len=0, use_tqdm=False)[0]
    logprobs = [lp for lp, _, _ in out.input_token_logprobs if lp is not None]
    if len(logprobs) != len(ids) - 1:
        raise RuntimeError(f"expected {len(ids) - 1} prompt log probabilities, got {len(logprobs)}")
    return len(logprobs), -sum(logprobs) / len(logprobs)


def greedy_answers(llm, tokens: int = GREEDY_TOKENS) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """``tokens`` greedy tokens answering each of :data:`QUESTIONS` (the chat template applied)."""
    from minisgl_ref.sampling.params import SamplingParams

    prompts = [llm.chat_prompt_ids([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True)
    return [o.output_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def compare_answers(answers: list[list[int]], baseline: list[list[int]]) -> tuple[int, float]:
    """``(answers equal to the baseline's, mean share of each answer before it first differs)``."""
    shared = []
    for a, b in zip(answers, baseline):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        shared.append(same / max(len(b), 1))
    return sum(a == b for a, b in zip(answers, baseline)), sum(shared) / max(len(shared), 1)


def measure(variants: list[str], *, model_path: str | None = None, dtype: str = "bfloat16", device: str = "cpu",
            text: str | None = None, chunked_prefill_size: int = 256, greedy_tokens: int = GREEDY_TOKENS,
            log: Any = None) -> list[PerplexityResult]:
    """Build one engine per variant (same model, dtype and prefill chunks) and score the text on each."""
    from minisgl_ref.llm import LLM

    results: list[PerplexityResult] = []
    baseline: list[list[int]] = []
    for name in variants:
        if name not in VARIANTS:
            raise ValueError(f"unknown variant {name!r} (choose from {', '.join(VARIANTS)})")
        quantization, kv = VARIANTS[name]
        start = time.perf_counter()
        llm = LLM(model_path, dtype=dtype, device=device, quantization=quantization, kv_cache_dtype=kv,
                  chunked_prefill_size=chunked_prefill_size, disable_radix_cache=True)
        try:
            if llm.tokenizer is None:
                raise ValueError("perplexity needs a model with a tokenizer")
            ids = llm.tokenizer.encode(text if text is not None else default_text())
            tokens, nll = text_perplexity(llm, ids)
            answers = greedy_answers(llm, greedy_tokens)
        finally:
            llm.shutdown()
        ppl = math.exp(nll)
        first = results[0].perplexity if results else ppl
        if not results:
            baseline = answers
        identical, shared = compare_answers(answers, baseline)
        results.append(PerplexityResult(name, quantization, kv, tokens, nll, ppl, ppl / first,
                                        time.perf_counter() - start, identical, shared))
        if log is not None:
            print(f"[perplexity] {name}: {ppl:.3f} ({ppl / first - 1:+.2%} against {results[0].variant}); greedy "
                  f"answers identical {identical}/{len(QUESTIONS)}", file=log, flush=True)
    return results


def add_perplexity_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated, the first is the baseline (from {', '.join(VARIANTS)})")
    p.add_argument("--text", default=None, help="a text file to score (default: the book's frozen text)")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk size: later chunks read earlier KV back")
    p.add_argument("--output", default=None, help="write the results and their provenance to this JSON file")


def main(args: argparse.Namespace) -> int:
    from minisgl_ref.bench.provenance import collect_provenance

    text = Path(args.text).read_text() if args.text else None
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    dtype = "bfloat16" if args.dtype == "auto" else args.dtype
    device = args.device or "cpu"
    results = measure(variants, model_path=args.model_path, dtype=dtype, device=device, text=text,
                      chunked_prefill_size=args.chunk, log=sys.stderr)
    for r in results:
        print(f"{r.variant:12s} {r.perplexity:9.3f}  {r.ratio_to_first - 1:+7.2%}  greedy {r.greedy_identical}/"
              f"{len(QUESTIONS)} identical, {r.greedy_shared_prefix:.0%} shared  ({r.tokens} tokens, {r.seconds:.0f} s)")
    if args.output:
        report = {"benchmark": "perplexity", "text": str(args.text or TEXT.name),
                  "provenance": collect_provenance(sys.argv, dtype=dtype, device=device, chunk=args.chunk),
                  "results": [asdict(r) for r in results]}
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
        print(f"[perplexity] wrote {args.output}", file=sys.stderr)
    return 0
