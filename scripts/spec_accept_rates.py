"""Expected accept lengths of chapter 13's proposers, measured offline against the target's greedy output.

    PYTHONPATH=. python scripts/spec_accept_rates.py --output docs/data/spec_accept_cpu.json

No engine integration is needed to know how well a proposer guesses. Under greedy verification the target
accepts a draft's longest path whose tokens equal its own greedy continuation, then adds one token of its own (the
bonus). So: generate each prompt's greedy continuation once with the paged engine, then replay it: start the
proposer on the prompt, and at each simulated verify step propose from the true prefix, count the tree path that
matches the continuation, and ``extend`` the proposer by the accepted tokens plus the bonus, exactly what the
engine's verify step would hand it. The *accept length* is the tokens a verify step yields on average (accepted
drafts + 1): the factor by which speculation divides the number of target forward passes.

Workloads: copy-heavy prompts (repeat or lightly edit a paragraph given in the prompt, where prompt lookup shines)
and open chat prompts. Proposers: the n-gram lookup as a tree and as a chain, and self-speculation by the first
``k`` layers of the target (``truncated_model``) as chains and as a top-2 tree; the draft of all 30 layers is the
control (it must accept every draft token).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from minisgl_ref import SamplingParams
from minisgl_ref.bench.provenance import collect_provenance
from minisgl_ref.core.config import EngineConfig
from minisgl_ref.core.request import Req
from minisgl_ref.engine.engine import Engine
from minisgl_ref.models.loader import load_model
from minisgl_ref.speculative.draft_model import DraftModelProposer, truncated_model
from minisgl_ref.speculative.ngram import NgramProposer, NgramSettings
from minisgl_ref.speculative.proposer import Proposer
from minisgl_ref.speculative.tree import DraftTree
from minisgl_ref.tokenizer import Tokenizer

PARAGRAPH = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished the great "
    "lens until it gleamed, and wrote the weather in a leather logbook: wind from the north-west, a heavy swell, "
    "two fishing boats returning late. In forty years the light had never once gone dark."
)
WORKLOADS: dict[str, list[str]] = {
    "copy": [
        f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
        f"Rewrite the following paragraph in the present tense, changing nothing else:\n\n{PARAGRAPH}",
        "Here is a Python function:\n\ndef area(width, height):\n    return width * height\n\n"
        "Rewrite it with type hints and a docstring, keeping the same name and arguments.",
    ],
    "chat": [
        "What is the capital of France? Answer in two sentences.",
        "Write a short poem about the sea.",
        "Explain what a GPU is in a few sentences.",
    ],
}


def greedy_outputs(model: torch.nn.Module, vocab: int, eos: frozenset[int], prompts: list[list[int]],
                   n: int) -> list[list[int]]:
    """The target's greedy continuations (up to ``n`` tokens, the EOS included), from the paged engine."""
    engine = Engine(model, model.config, EngineConfig(max_total_tokens=4096))
    reqs = [Req(list(p), SamplingParams(max_new_tokens=n, temperature=0), eos_token_ids=eos) for p in prompts]
    for r in reqs:
        engine.add_request(r)
    engine.run_until_done()
    return [r.output_ids for r in reqs]


def matched_path(tree: DraftTree | None, truth: list[int]) -> int:
    """How many draft tokens greedy verification accepts: the longest root path equal to a prefix of ``truth``."""
    if tree is None:
        return 0
    node, depth = -1, 0
    children: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents):
        children.setdefault(p, []).append(i)
    while depth < len(truth):
        nxt = next((c for c in children.get(node, []) if tree.tokens[c] == truth[depth]), None)
        if nxt is None:
            break
        node, depth = nxt, depth + 1
    return depth


def simulate(proposer: Proposer, prompt: list[int], output: list[int], max_tokens: int) -> dict[str, Any]:
    """Replay one request's greedy output through ``proposer``'s drafts; count verify steps and accepted drafts."""
    proposer.start(0, prompt)
    done = steps = accepted = proposed = 0
    clock = time.perf_counter()
    while done < len(output):
        (tree,) = proposer.propose([0], max_tokens)
        took = matched_path(tree, output[done:])
        step = min(took + 1, len(output) - done)  # the accepted drafts and the target's bonus token
        proposer.extend(0, output[done:done + step])
        done += step
        steps += 1
        accepted += step - 1
        proposed += 0 if tree is None else len(tree)
    proposer.finish(0)
    return {"output_tokens": len(output), "verify_steps": steps, "accepted_drafts": accepted,
            "proposed_nodes": proposed, "accept_length": round(len(output) / steps, 3),
            "propose_seconds": round(time.perf_counter() - clock, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", type=Path, default=None, help="write the results here as JSON")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.manual_seed(0)
    model, config, folder = load_model(None, device="cpu")
    tokenizer = Tokenizer.find(folder)
    assert tokenizer is not None
    eos = frozenset(config.eos_token_ids) | tokenizer.eos_token_ids
    vocab = config.vocab_size

    def draft(layers: int, **kw: Any) -> Callable[[], Proposer]:
        net = truncated_model(model, layers)
        return lambda: DraftModelProposer(net, net.config, target_vocab_size=vocab, max_total_tokens=2048,
                                          max_requests=2, **kw)

    proposers: dict[str, tuple[Callable[[], Proposer], int, str]] = {
        "ngram_tree": (lambda: NgramProposer(), 8, "NgramProposer, SGLang's defaults, BFS tree of <= 8 nodes"),
        "ngram_chain": (lambda: NgramProposer(NgramSettings(max_bfs_breadth=1)), 4, "n-gram lookup, a chain of <= 4"),
        "draft_k4_chain": (draft(4, num_steps=4), 4, "first 4 of 30 layers, greedy chain of 4"),
        "draft_k10_chain": (draft(10, num_steps=4), 4, "first 10 of 30 layers, greedy chain of 4"),
        "draft_k10_tree": (draft(10, num_steps=4, topk=2), 8, "first 10 of 30 layers, top-2 tree of <= 8 nodes"),
        "draft_k20_chain": (draft(20, num_steps=4), 4, "first 20 of 30 layers, greedy chain of 4"),
        "draft_k24_chain": (draft(24, num_steps=4), 4, "first 24 of 30 layers, greedy chain of 4"),
        "draft_k27_chain": (draft(27, num_steps=4), 4, "first 27 of 30 layers, greedy chain of 4"),
        "draft_k27_tree": (draft(27, num_steps=4, topk=2), 8, "first 27 of 30 layers, top-2 tree of <= 8 nodes"),
        "draft_k30_chain": (draft(30, num_steps=4), 4, "all 30 layers (control: must accept all), chain of 4"),
    }
    results: dict[str, Any] = {}
    for workload, texts in WORKLOADS.items():
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
        outputs = greedy_outputs(model, vocab, eos, prompts, args.max_new_tokens)
        results[workload] = {"prompts": texts, "prompt_tokens": [len(p) for p in prompts],
                             "outputs": [tokenizer.decode(o) for o in outputs], "proposers": {}}
        for name, (make, max_tokens, what) in proposers.items():
            runs = [simulate(make(), p, o, max_tokens) for p, o in zip(prompts, outputs)]
            tokens = sum(r["output_tokens"] for r in runs)
            steps = sum(r["verify_steps"] for r in runs)
            results[workload]["proposers"][name] = {
                "what": what, "max_tokens": max_tokens, "accept_length": round(tokens / steps, 3),
                "per_prompt": runs,
            }
            print(f"{workload:5s} {name:16s} accept length {tokens / steps:.2f} "
                  f"({tokens} tokens in {steps} verify steps)", flush=True)
    if args.output is not None:
        doc = {"provenance": collect_provenance(model="SmolLM2-135M-Instruct (embedded)", dtype=str(config.dtype),
                                                max_new_tokens=args.max_new_tokens),
               "method": "offline simulation of greedy verification against the target's greedy output "
                         "(accept length = output tokens / verify steps, bonus token included)",
               "results": results}
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
