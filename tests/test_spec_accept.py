"""Speculative decoding's acceptance rule (chapter 13): greedy verification emits plain greedy decoding's tokens,
and sampled verification emits tokens distributed exactly as plain sampling's.

The target "model" here is a function of the whole token sequence (hashed into a seed for a few random logits),
so the verify row's logits at every tree node, and the plain sampler's logits after any accepted path, come from
the same function. The statistical tests draw ``DRAWS`` verifications per parameter set with fixed seeds (so they
are deterministic for a given implementation), tally the first emitted token and the first two (the second comes
from the next, plain, step when the first verification emits only one), and compare the tallies with the plain
sampler's probabilities by Pearson's chi-square test at significance ``ALPHA``: a correct rule passes, and the
same check run on deliberately wrong rules fails, so the check can fail.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
import torch

import minisgl_ref.speculative.accept as accept_mod
from minisgl_ref.sampling import Sampler, SamplingBatchInfo, SamplingParams
from minisgl_ref.sampling.sampler import penalised_logits, sampling_probs
from minisgl_ref.speculative.accept import Verdict, accept, request_generator, target_view, walk
from minisgl_ref.speculative.tree import DraftTree
from tests.stats import chi2_pvalue, chi2_sf, homogeneity_bins, homogeneity_pvalue

V = 6  #: vocabulary of the statistical tests
DRAWS = 12_000  #: verifications per parameter set
ALPHA = 1e-3  #: a correct rule fails a check with this probability (for the fixed seeds here: never)
PROMPT, OUTPUT = [0, 1, 2], [3]  #: the request so far; its last token (3) is the root of every draft
EOS = 5


# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------


def model(seq: tuple[int, ...] | list[int], vocab: int = V, scale: float = 1.5, ties: bool = False) -> torch.Tensor:
    """The target's next-token logits after ``seq``: [vocab] float32, a fixed function of the sequence. With
    ``ties`` the logits are rounded to halves, so equal maxima are common."""
    seed = hash(tuple(seq)) % (1 << 62)
    x = torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale
    return (x * 2).round() / 2 if ties else x


def row_logits(tree: DraftTree, context: list[int], **kw) -> torch.Tensor:
    """The verify row's logits [n + 1, vocab]: offset j sees the context plus the path to j."""
    paths: list[tuple[int, ...]] = [()]
    for t, p in zip(tree.tokens, tree.parents):
        paths.append(paths[p + 1] + (t,))
    return torch.stack([model(tuple(context) + p, **kw) for p in paths])


class Plain:
    """The plain sampler's distribution for one request: the sampler's own processing of the model's logits
    after a sequence (grammar mask, bias, penalties, temperature, filters), as probabilities over the vocabulary."""

    def __init__(self, params: SamplingParams, grammar: Callable[[tuple[int, ...]], torch.Tensor] | None = None):
        self.params, self.grammar = params, grammar

    def probs(self, output: list[int]) -> np.ndarray:
        logits = model(tuple(PROMPT + output))
        if self.grammar is not None:
            logits = logits.masked_fill(~self.grammar(tuple(PROMPT + output)), float("-inf"))
        info = SamplingBatchInfo.build([self.params], [PROMPT], [output], [EOS], V, "cpu", seeds=[0])
        processed = penalised_logits(logits[None], info)
        if self.params.is_greedy:
            out = np.zeros(V)
            out[int(processed.argmax())] = 1
            return out
        return sampling_probs(processed, info)[0].double().numpy()

    def joint(self) -> tuple[dict, dict]:
        """P(first token) and P(first two tokens)."""
        first = self.probs(OUTPUT)
        two = {}
        for y1 in range(V):
            second = self.probs(OUTPUT + [y1])
            for y2 in range(V):
                two[(y1, y2)] = first[y1] * second[y2]
        return {y: first[y] for y in range(V)}, two


def allowed_for(grammar, context: list[int]):
    return None if grammar is None else (lambda path: grammar(tuple(context) + path))


def draw_two(tree_for: Callable[[torch.Generator], DraftTree], params: SamplingParams, grammar=None,
             seed: int = 0, draws: int = DRAWS) -> tuple[Counter, Counter]:
    """Run ``draws`` verifications (the tree may be drawn anew each time) and tally the first emitted token and
    the first two. When a verification emits one token, the second is what the next step emits after it: a
    verification of an empty draft, which is a plain draw."""
    context = PROMPT + OUTPUT
    views: dict = {}

    def view(tree: DraftTree, output: list[int]):
        key = (tree.tokens, tree.parents, tuple(output))
        if key not in views:
            ctx = PROMPT + output
            views[key] = target_view(tree, row_logits(tree, ctx), params, prompt_ids=PROMPT, output_ids=output,
                                     eos_token_ids=EOS, allowed=allowed_for(grammar, ctx))
        return views[key]

    g = torch.Generator().manual_seed(seed)
    empty = DraftTree((), ())
    first, two = Counter(), Counter()
    for _ in range(draws):
        tree = tree_for(g)
        verdict = walk(tree, view(tree, OUTPUT), g)
        tokens = verdict.tokens
        if len(tokens) == 1:
            tokens = tokens + walk(empty, view(empty, OUTPUT + tokens), g).tokens
        first[tokens[0]] += 1
        two[tuple(tokens[:2])] += 1
    assert context[-1] == OUTPUT[-1]
    return first, two


def check_lossless(tree_for, params: SamplingParams, grammar=None, seed: int = 0) -> tuple[float, float]:
    """The p-values of the first token's and the first two tokens' tallies against the plain distributions."""
    p1, p2 = Plain(params, grammar).joint()
    first, two = draw_two(tree_for, params, grammar, seed)
    return chi2_pvalue(first, p1, DRAWS), chi2_pvalue(two, p2, DRAWS)


def likely_tree() -> DraftTree:
    """A depth-2 tree of the root's most likely tokens under plain temperature-1 sampling, with a repeated
    sibling: node 0 and node 2 draft the same token; nodes 3 and 4 are node 0's children, node 5 node 1's."""
    ctx = PROMPT + OUTPUT
    order = model(tuple(ctx)).argsort(descending=True).tolist()
    a, b = order[0], order[1]
    under_a = model(tuple(ctx + [a])).argsort(descending=True).tolist()
    under_b = model(tuple(ctx + [b])).argsort(descending=True).tolist()
    return DraftTree((a, b, a, under_a[0], under_a[1], under_b[0]), (-1, -1, -1, 0, 0, 1))


def forbid_after(seq: tuple[int, ...]) -> torch.Tensor:
    """A hand-written grammar: after token t, token (t + 1) % V is forbidden, and so is token 4 after an even
    token (the mask depends on the path, as a real grammar's does)."""
    m = torch.ones(V, dtype=torch.bool)
    m[(seq[-1] + 1) % V] = False
    if seq[-1] % 2 == 0:
        m[4] = False
    return m


# ---------------------------------------------------------------------------------------------------------------
# the chi-square helper itself
# ---------------------------------------------------------------------------------------------------------------


def test_chi2_sf_matches_the_table():
    # Critical values at p = 0.001 from the standard table (and at p = 0.05 for df = 30).
    for df, crit in {1: 10.828, 2: 13.816, 5: 20.515, 9: 27.877, 20: 45.315, 35: 66.619}.items():
        assert chi2_sf(crit, df) == pytest.approx(1e-3, rel=2e-3)
    assert chi2_sf(43.773, 30) == pytest.approx(0.05, rel=2e-3)
    assert chi2_sf(0.0, 4) == 1.0 and chi2_sf(1e5, 4) < 1e-300 + 1e-200


def test_homogeneity_matches_a_hand_computed_table():
    # Expected counts 40, 30, 30 in each sample: statistic 2 * (100 / 40 + 0 + 100 / 30) = 11.667 on 2 degrees of
    # freedom, whose upper tail is exp(-11.667 / 2).
    a, b = Counter(x=50, y=30, z=20), Counter(x=30, y=30, z=40)
    assert homogeneity_pvalue(a, b) == pytest.approx(math.exp(-35 / 6), rel=1e-9)
    assert homogeneity_pvalue(a, a) == pytest.approx(1.0)
    # Outcomes expected fewer than 5 times in a sample are pooled; a pool itself expected fewer than 5 times
    # (here 6 * 103 / 209 = 3.0) joins the smallest bin.
    assert homogeneity_bins(a + Counter(u=2, v=1), b + Counter(w=3)) == [(50, 30), (30, 30), (23, 43)]
    assert homogeneity_bins(a + Counter(u=6, v=1), b + Counter(w=7)) == [(50, 30), (30, 30), (20, 40), (7, 7)]


# ---------------------------------------------------------------------------------------------------------------
# greedy
# ---------------------------------------------------------------------------------------------------------------


def one_hot_rows(argmaxes: list[int], vocab: int = 5) -> torch.Tensor:
    rows = torch.zeros(len(argmaxes), vocab)
    for j, t in enumerate(argmaxes):
        rows[j, t] = 3.0
    return rows


GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.task("13.1", weight=3)
def test_greedy_walks_the_argmax_through_siblings():
    # Root's children: 1 (node 0), 2 (node 1); node 1's children: 4 (node 2), 0 (node 3); node 3's child 3 (node 4).
    tree = DraftTree((1, 2, 4, 0, 3), (-1, -1, 1, 1, 3))
    # argmax after: root 2 -> node 1; node 1: 0 -> node 3; node 3: 3 -> node 4; node 4: 1 (bonus).
    logits = one_hot_rows([2, 4, 0, 2, 3, 1])
    assert accept(tree, logits, GREEDY) == Verdict([1, 3, 4], [2, 0, 3, 1])


@pytest.mark.task("13.1")
def test_greedy_chain_partly_accepted():
    tree = DraftTree.chain([1, 2, 3])
    logits = one_hot_rows([1, 2, 4, 0])  # agrees with 1 and 2, then wants 4 where the draft has 3
    assert accept(tree, logits, GREEDY) == Verdict([0, 1], [1, 2, 4])


@pytest.mark.task("13.1")
def test_greedy_nothing_accepted():
    tree = DraftTree((1, 2), (-1, -1))
    assert accept(tree, one_hot_rows([3, 0, 0]), GREEDY) == Verdict([], [3])


@pytest.mark.task("13.1", weight=2)
def test_greedy_everything_accepted_adds_the_bonus():
    tree = DraftTree.chain([4, 4, 0])
    assert accept(tree, one_hot_rows([4, 4, 0, 2]), GREEDY) == Verdict([0, 1, 2], [4, 4, 0, 2])


@pytest.mark.task("13.1", weight=2)
def test_greedy_ties_go_to_the_lowest_id():
    tree = DraftTree((3, 1), (-1, -1))  # both tie at the top; the plain sampler's argmax is 1
    logits = torch.tensor([[0.0, 2.0, 0.0, 2.0, 0.0], [0.0] * 5, [0.0, 0.0, 1.0, 0.0, 0.0]])
    assert accept(tree, logits, GREEDY) == Verdict([1], [1, 2])


@pytest.mark.task("13.1")
def test_greedy_with_top_k_one_is_greedy():
    tree = DraftTree.chain([2])
    assert accept(tree, one_hot_rows([2, 3]), SamplingParams(temperature=0.8, top_k=1)) == Verdict([0], [2, 3])


def plain_greedy(params: SamplingParams, output: list[int], steps: int, vocab: int, eos: int) -> list[int]:
    """Plain decoding through the Sampler, one step at a time (with penalties and ties)."""
    sampler, out = Sampler(), []
    for _ in range(steps):
        info = SamplingBatchInfo.build([params], [PROMPT], [output + out], [eos], vocab, "cpu", seeds=[0])
        out.append(int(sampler(model(tuple(PROMPT + output + out), vocab, ties=True)[None], info)))
    return out


@pytest.mark.task("13.1", weight=5)
@pytest.mark.parametrize("params", [
    GREEDY,
    SamplingParams(temperature=0.0, repetition_penalty=1.8, frequency_penalty=1.0, presence_penalty=0.5),
    SamplingParams(temperature=0.0, min_new_tokens=3, logit_bias={2: 1.0}),
], ids=["plain", "penalties", "min-new-tokens-bias"])
def test_greedy_equals_plain_greedy_decoding(params):
    """Random trees over a tiny vocabulary with tied logits: the verdict's tokens are what plain greedy decoding
    emits, token for token, and the accepted nodes are exactly the path those tokens trace."""
    vocab, eos, rng = 4, 2, np.random.default_rng(0)
    accepted_some = 0
    for trial in range(60):
        n = int(rng.integers(0, 8))
        parents = [int(rng.integers(-1, i)) for i in range(n)]
        tree = DraftTree(tuple(int(t) for t in rng.integers(0, vocab, n)), tuple(parents))
        output = [3] + [int(t) for t in rng.integers(0, vocab, trial % 3)]
        ctx = PROMPT + output
        verdict = accept(tree, row_logits(tree, ctx, vocab=vocab, ties=True), params, prompt_ids=PROMPT,
                         output_ids=output, eos_token_ids=eos)
        assert verdict.tokens == plain_greedy(params, output, len(verdict.tokens), vocab, eos)
        node = -1
        for nxt, tok in zip(verdict.nodes, verdict.tokens):
            assert tree.parents[nxt] == node and tree.tokens[nxt] == tok
            node = nxt
        # The walk stopped because no child of the last node drafts the bonus token.
        assert all(tree.tokens[c] != verdict.tokens[-1] for c in tree.children(node))
        accepted_some += bool(verdict.nodes)
    assert accepted_some > 10  # the random drafts do agree with the target often enough to test something


@pytest.mark.task("13.1")
def test_greedy_grammar_mask_changes_the_argmax():
    tree = DraftTree.chain([1])
    logits = one_hot_rows([1, 2])
    forbid_1 = torch.tensor([True, False, True, True, True])
    verdict = accept(tree, logits, GREEDY, allowed=lambda path: forbid_1 if path == () else None)
    assert verdict == Verdict([], [0])  # 1 is forbidden: the masked argmax is the lowest id among the zeros


# ---------------------------------------------------------------------------------------------------------------
# sampled: the rule is lossless
# ---------------------------------------------------------------------------------------------------------------

SAMPLED = {
    "temperature": SamplingParams(temperature=1.0),
    "cold-top-k": SamplingParams(temperature=0.7, top_k=3),
    "top-p": SamplingParams(temperature=1.2, top_p=0.8),
    "min-p": SamplingParams(temperature=1.3, min_p=0.2),
    "penalties": SamplingParams(temperature=0.9, repetition_penalty=1.6, frequency_penalty=0.8,
                                presence_penalty=0.4, logit_bias={1: 0.7}),
    "min-new-tokens": SamplingParams(temperature=1.0, min_new_tokens=2),  # EOS banned for the first token only
}


@pytest.mark.task("13.1", weight=12)
@pytest.mark.parametrize("name", list(SAMPLED))
def test_sampled_tree_is_lossless(name):
    """A fixed tree with siblings (and a repeated sibling): the point-mass rule with renormalisation."""
    tree = likely_tree()
    p_first, p_two = check_lossless(lambda g: tree, SAMPLED[name], seed=1)
    assert p_first > ALPHA and p_two > ALPHA, (p_first, p_two)


@pytest.mark.task("13.1", weight=5)
def test_sampled_chain_without_proposal_is_lossless():
    ctx = PROMPT + OUTPUT
    a = int(model(tuple(ctx)).argmax())
    tree = DraftTree.chain([a, int(model(tuple(ctx + [a])).argmax())])
    p_first, p_two = check_lossless(lambda g: tree, SamplingParams(temperature=1.0, top_k=4), seed=2)
    assert p_first > ALPHA and p_two > ALPHA, (p_first, p_two)


@pytest.mark.task("13.1", weight=3)
def test_sampled_tree_under_a_grammar_is_lossless():
    """The mask depends on the path; node 1's token is forbidden after the root, so its subtree is unreachable."""
    ctx = PROMPT + OUTPUT
    a = int(model(tuple(ctx)).masked_fill(~forbid_after(tuple(ctx)), -1e9).argmax())
    banned = (ctx[-1] + 1) % V
    tree = DraftTree((a, banned, (a + 2) % V, 0), (-1, -1, 0, 1))
    params = SamplingParams(temperature=1.1, frequency_penalty=0.5)
    p_first, p_two = check_lossless(lambda g: tree, params, grammar=forbid_after, seed=3)
    assert p_first > ALPHA and p_two > ALPHA, (p_first, p_two)


#: A draft model's proposals: at the root, and after each first token (rows), over the vocabulary.
Q_ROOT = torch.tensor([0.30, 0.05, 0.25, 0.10, 0.20, 0.10])
Q_NEXT = torch.softmax(torch.randn(V, V, generator=torch.Generator().manual_seed(7)), dim=-1)


def chain_from_q(g: torch.Generator) -> DraftTree:
    x1 = int(torch.multinomial(Q_ROOT, 1, generator=g))
    x2 = int(torch.multinomial(Q_NEXT[x1], 1, generator=g))
    return DraftTree.chain([x1, x2], probs=torch.stack([Q_ROOT, Q_NEXT[x1]]))


@pytest.mark.task("13.1", weight=12)
@pytest.mark.parametrize("name", ["temperature", "penalties"])
def test_sampled_chain_with_proposal_is_lossless(name):
    """Drafts drawn from a known q: accept with min(1, p/q), else draw from norm(max(p - q, 0))."""
    p_first, p_two = check_lossless(chain_from_q, SAMPLED[name], seed=4)
    assert p_first > ALPHA and p_two > ALPHA, (p_first, p_two)


@pytest.mark.task("13.1", weight=6)
def test_sampled_chain_with_proposal_under_a_grammar_is_lossless():
    p_first, p_two = check_lossless(chain_from_q, SamplingParams(temperature=1.0), grammar=forbid_after, seed=5)
    assert p_first > ALPHA and p_two > ALPHA, (p_first, p_two)


# ---------------------------------------------------------------------------------------------------------------
# the same checks fail for wrong rules
# ---------------------------------------------------------------------------------------------------------------


def always_accept_first(p, candidates, generator):
    """Wrong: a deterministic draft accepted whenever the target gives it any probability."""
    for i, x in enumerate(candidates):
        if float(p[x]) > 0:
            return i, x
    return None, int(torch.multinomial(p, 1, generator=generator))


def no_renormalisation(p, candidates, generator):
    """Wrong: each sibling accepted with its original p(x), not with p(x) over the mass the rejections left."""
    rejected = []
    for i, x in enumerate(candidates):
        if float(torch.rand((), generator=generator)) < float(p[x]):
            return i, x
        rejected.append(x)
    rest = p.clone()
    rest[rejected] = 0
    return None, int(torch.multinomial(rest, 1, generator=generator))


def resample_from_p(p, q, x, generator):
    """Wrong: after rejecting a draft drawn from q, draw from p instead of the residual max(p - q, 0)."""
    px, qx = float(p[x]), float(q[x])
    if float(torch.rand((), generator=generator)) < min(1.0, px / qx):
        return True, x
    return False, int(torch.multinomial(p, 1, generator=generator))


@pytest.mark.parametrize("wrong,attr,tree_for", [
    (always_accept_first, "_try_candidates", lambda g: likely_tree()),
    (no_renormalisation, "_try_candidates", lambda g: likely_tree()),
    (resample_from_p, "_try_proposal", chain_from_q),
], ids=["always-accept", "no-renormalisation", "resample-from-p"])
def test_a_wrong_rule_fails_the_check(monkeypatch, wrong, attr, tree_for):
    monkeypatch.setattr(accept_mod, attr, wrong)
    p_first, p_two = check_lossless(tree_for, SamplingParams(temperature=1.0), seed=6)
    assert min(p_first, p_two) < ALPHA, (p_first, p_two)


# ---------------------------------------------------------------------------------------------------------------
# the interface
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.task("13.1")
def test_verdict_is_a_path_and_tokens_end_with_one_more():
    tree, g = likely_tree(), torch.Generator().manual_seed(0)
    logits = row_logits(tree, PROMPT + OUTPUT)
    for _ in range(200):
        v = accept(tree, logits, SamplingParams(temperature=1.0), prompt_ids=PROMPT, output_ids=OUTPUT, generator=g)
        assert len(v.tokens) == len(v.nodes) + 1
        node = -1
        for nxt, tok in zip(v.nodes, v.tokens):
            assert tree.parents[nxt] == node and tree.tokens[nxt] == tok
            node = nxt


@pytest.mark.task("13.1")
def test_request_generator_replays_and_separates():
    tree = likely_tree()
    logits = row_logits(tree, PROMPT + OUTPUT)
    params = SamplingParams(temperature=1.0)

    def run(seed: int, step: int) -> list[list[int]]:
        g = request_generator(seed, step)
        return [accept(tree, logits, params, output_ids=OUTPUT, generator=g).tokens for _ in range(20)]

    assert run(11, 4) == run(11, 4)
    assert run(11, 4) != run(11, 5) and run(11, 4) != run(12, 4)


def test_logits_of_the_wrong_height_are_refused():
    with pytest.raises(ValueError, match="3 rows"):
        accept(DraftTree.chain([1, 2]), torch.zeros(2, 5), GREEDY)


def test_mask_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match="bool"):
        accept(DraftTree.chain([1]), torch.zeros(2, 5), GREEDY, allowed=torch.ones(2, 5))


@pytest.mark.task("13.1")
def test_per_offset_masks_as_a_tensor():
    tree = DraftTree((2, 1), (-1, 0))
    logits = one_hot_rows([2, 1, 0])
    masks = torch.ones(3, 5, dtype=torch.bool)
    masks[1, 1] = False  # after node 0, token 1 is forbidden: the walk stops there with the masked argmax
    assert accept(tree, logits, GREEDY, allowed=masks) == Verdict([0], [2, 0])
