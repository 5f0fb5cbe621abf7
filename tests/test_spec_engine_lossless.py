"""Speculative decoding leaves a sampled request's distribution unchanged, through the whole engine (chapter 13).

``tests/test_spec_accept.py`` checks the acceptance rule alone, against probabilities it computes. Here the same
claim is checked end to end: the embedded SmolLM2 on the CPU, the paged engine with its radix cache, tree mask,
KV moves and sampler. Two arms sample one short prompt ``DRAWS`` times per sampling setting, every request with
its own seed (the arms' seeds differ, so the samples are independent): arm A on the plain engine, arm B with
speculation, whose drafts come from :class:`FixedDrafts`, a scripted proposer whose drafts hold both likely and
unlikely tokens, so that drafts are both accepted and rejected. Output token 1 comes from the prefill, without
drafts; tokens 2, 3 and 4 come from verify rows (token 4 from a plain decode step when the first verify row
accepted a draft). Each of these three positions is compared between the arms by Pearson's two-sample
chi-square test of homogeneity (:func:`tests.stats.homogeneity_pvalue`, rare tokens pooled) at ``LEVEL`` =
``ALPHA / 3``: by Bonferroni's inequality a correct engine fails a setting's test with probability at most
``ALPHA`` (and, the seeds being fixed, the outcome is the same on every run).

That the test can fail is checked by :func:`test_a_wrong_rule_changes_the_engine_s_distribution`: the same test
with the acceptance rule monkeypatched to draw from p itself, rather than from what the rejected candidates left
of p, once every draft at a node is rejected.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

import minisgl_ref.speculative.accept as accept_mod
from minisgl_ref import LLM, SamplingParams
from minisgl_ref.core.config import EngineConfig
from minisgl_ref.engine.engine import Engine
from minisgl_ref.speculative.config import SpeculativeConfig
from minisgl_ref.speculative.extension import SpeculativeExtension
from minisgl_ref.speculative.tree import DraftTree
from tests.engine_fixtures import assert_pool_accounting, smol_llm
from tests.stats import homogeneity_bins, homogeneity_pvalue

__all__ = ["smol_llm"]  # the fixture, imported for pytest

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
DRAWS = 300  #: requests per arm and sampling setting
ALPHA = 1e-3  #: the family-wise level of one setting's test
NEW_TOKENS = 4  #: tokens per request: the first from the prefill, the other three speculated
LEVEL = ALPHA / (NEW_TOKENS - 1)  #: Bonferroni: each speculated position is compared at this level

# The embedded SmolLM2's tokens for the drafts. After the prompt and " Paris" (the first token of about four
# requests in five at temperature 1.0), the model's next token is "." with probability 0.68, "," 0.19, " (" 0.05;
# after " Paris." it is "\n" with probability 0.36.
PERIOD, COMMA, PAREN, NEWLINE, PARIS = 30, 28, 284, 198, 7042

#: What :class:`FixedDrafts` drafts after a request's last token (any other: the ``None`` entry; the engine
#: keeps a tree's first nodes, as many as the request's remaining tokens allow). After " Paris" an unlikely
#: first candidate comes before a likely one: its rejection renormalises what is left for the sibling, and an
#: accepted sibling's KV moves into place.
DRAFTS = {
    PARIS: DraftTree((PAREN, PERIOD), (-1, -1)),
    PERIOD: DraftTree.chain([NEWLINE]),
    None: DraftTree((PERIOD, PAREN, COMMA), (-1, -1, -1)),
}

SETTINGS = {
    "temperature": SamplingParams(temperature=1.0),
    "top-k-top-p": SamplingParams(temperature=1.0, top_k=12, top_p=0.9),
    "min-p-penalties": SamplingParams(temperature=1.0, min_p=0.04, repetition_penalty=1.3, frequency_penalty=0.6),
}


class FixedDrafts:
    """A scripted proposer: it drafts :data:`DRAFTS` by the request's last token, so its drafts depend on the
    context only, never on the draws."""

    def __init__(self) -> None:
        self.last: dict[str, int] = {}

    def start(self, rid: str, tokens: list[int]) -> None:
        self.last[rid] = tokens[-1]

    def extend(self, rid: str, tokens: list[int]) -> None:
        self.last[rid] = tokens[-1]

    def propose(self, rids: list[str], max_tokens: int) -> list[DraftTree]:
        return [DRAFTS.get(self.last[rid], DRAFTS[None]) for rid in rids]

    def finish(self, rid: str) -> None:
        self.last.pop(rid, None)


def sample(llm: LLM, params: SamplingParams, first_seed: int,
           speculate: bool) -> tuple[list[list[int]], SpeculativeExtension | None]:
    """``DRAWS`` requests of ``params`` with seeds ``first_seed, first_seed + 1, ...``, run together in one batch
    on a fresh engine; their output ids, and the extension. With speculation every request of the batch may draft
    (``speculative_max_batch`` covers the batch) whenever its remaining tokens leave room for a draft."""
    ext = None
    if speculate:
        spec = SpeculativeConfig("NGRAM", speculative_num_steps=2, speculative_eagle_topk=2,
                                 speculative_num_draft_tokens=4, speculative_max_batch=DRAWS,
                                 speculative_min_accept_rate=0.0)  # never pause a request's drafting
        ext = SpeculativeExtension(FixedDrafts(), spec)
    engine = Engine(llm.model, llm.config, EngineConfig(max_total_tokens=8192, max_running_requests=DRAWS),
                    device="cpu", context_length=llm.context_length, extensions=[ext] if ext else [])
    prompt = llm.tokenizer.encode(PROMPT)
    # One request first puts the prompt in the radix cache, so that each draw's prefill computes one token.
    engine.add_request(llm.make_request(prompt, SamplingParams(temperature=0, max_new_tokens=1)))
    engine.run_until_done()
    reqs = []
    for i in range(DRAWS):
        reqs.append(llm.make_request(prompt, replace(params, seed=first_seed + i, max_new_tokens=NEW_TOKENS)))
        engine.add_request(reqs[-1])
    engine.run_until_done()
    assert_pool_accounting(engine)
    return [r.output_ids for r in reqs], ext


def tallies(outputs: list[list[int]]) -> list[Counter]:
    """Each speculated position's tokens: output tokens 2, 3 and 4 (None past an early end: EOS is not
    ignored)."""
    padded = [ids + [None] * (NEW_TOKENS - len(ids)) for ids in outputs]
    return [Counter(ids[i] for ids in padded) for i in range(1, NEW_TOKENS)]


_PLAIN: dict[str, list[Counter]] = {}


def plain(llm: LLM, name: str) -> list[Counter]:
    """Arm A for a setting, drawn once per test process (the right and the wrong rule's tests share it)."""
    if name not in _PLAIN:
        _PLAIN[name] = tallies(sample(llm, SETTINGS[name], 0, speculate=False)[0])
    return _PLAIN[name]


def compare(llm: LLM, name: str, seed: int) -> tuple[list[float], SpeculativeExtension | None]:
    """Arm B for a setting, drawn with seeds from ``seed`` on; the p-values of its comparisons with arm A, one per
    speculated position."""
    outputs, ext = sample(llm, SETTINGS[name], seed, speculate=True)
    pvalues = []
    for a, b in zip(plain(llm, name), tallies(outputs)):
        assert len(homogeneity_bins(a, b)) >= 4  # enough bins to see a distribution change
        pvalues.append(homogeneity_pvalue(a, b))
    return pvalues, ext


@pytest.mark.parametrize("name", list(SETTINGS))
def test_speculation_keeps_the_sampled_distribution(smol_llm, name):
    """Draws: ``DRAWS`` = 300 per arm. Level: ``ALPHA`` = 1e-3 for the setting, ``ALPHA / 3`` for each of the
    three positions. Power: a rule that draws from p instead of the rejections' residual gives a rejected likely
    draft back too often (after " Paris": "." rises from 0.68 to about 0.86), and the same test then gives
    p < 1e-8 at token 2 (see the next test)."""
    pvalues, ext = compare(smol_llm, name, seed=1_000_000)
    assert ext is not None
    stats = list(ext.stats.values())
    assert len(stats) == DRAWS and all(s.verify_ct >= 1 for s in stats), "a request did not speculate"
    drafted = sum(s.draft_tokens for s in stats)
    accepted = sum(s.accepted_tokens for s in stats)
    assert 0.1 * drafted < accepted < 0.9 * drafted, (accepted, drafted)  # both accept and reject happened
    assert min(pvalues) > LEVEL, pvalues  # seen: 0.11 to 0.71


def draw_rejection_from_p(p: torch.Tensor, candidates: list[int],
                          generator: torch.Generator | None) -> tuple[int | None, int]:
    """Wrong: the candidates are tried as the right rule tries them, but after rejecting all of them the token
    is drawn from p itself, not from what the rejections left of p, so a rejected draft comes back too often."""
    if candidates:
        mass = p[torch.tensor(candidates, device=p.device)].tolist()
        left = float(p.sum())
        u = torch.rand(len(candidates), generator=generator, device=p.device).tolist()
        for i, (x, px) in enumerate(zip(candidates, mass)):
            if left > 0 and u[i] < px / left:
                return i, x
            left -= px
    return None, int(torch.multinomial(p, 1, generator=generator))


def test_a_wrong_rule_changes_the_engine_s_distribution(smol_llm, monkeypatch):
    """The test above has power: the same engine run with :func:`draw_rejection_from_p` as the rule fails it."""
    monkeypatch.setattr(accept_mod, "_try_candidates", draw_rejection_from_p)
    pvalues, _ = compare(smol_llm, "temperature", seed=2_000_000)
    assert min(pvalues) < LEVEL, pvalues  # seen: 2.2e-9 at token 2
