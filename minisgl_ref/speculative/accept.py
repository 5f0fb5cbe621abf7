"""The acceptance rule: which drafted tokens a request keeps after one verify pass, and the one token it adds.

The target model has scored the whole verify row ``[root, node 0, ..., node n-1]`` of a
:class:`~minisgl_ref.speculative.tree.DraftTree`: row ``j`` of its logits is the target's next-token
distribution after offset ``j``, that is after the request's tokens plus the draft path from the root to that
offset. The rule walks down the tree from the root, keeps children the target agrees with, and at the node where
it stops draws one more token from the target (the *bonus*, or *correction* when a draft was rejected). So a
verify pass always appends at least one token, and at most ``depth + 1``.

**Which distribution.** At every node the target distribution ``p`` is the one a plain decode step would draw
from for a request whose tokens so far are its own plus the accepted path: the grammar's mask (chapter 12), the
logit bias, the repetition / frequency / presence penalties and the ``min_new_tokens`` ban (which count the
path's tokens as generated), then the temperature, top-k, top-p and min-p. :func:`target_view` builds it with
the sampler's own functions (:func:`~minisgl_ref.sampling.sampler.penalised_logits`,
:func:`~minisgl_ref.sampling.sampler.sampling_probs`) on a :class:`~minisgl_ref.sampling.SamplingBatchInfo` with
one row per offset, so the speculative distribution is the plain one by construction, not by a copy of it.

**Greedy requests** (``SamplingParams.is_greedy``): at each node take the child whose token is the argmax of the
processed logits there (``torch.argmax``: the lowest id among ties, as the sampler); stop where no child has it;
the bonus is that argmax. Every emitted token is the argmax after the tokens before it, which is what plain greedy
decoding emits, one token per step.

**Sampled requests: why the output is distributed exactly as ``p``.** It suffices that at each node the token the
rule emits next is distributed as that node's ``p``, and that the walk continues at a child exactly when the
emitted token is that child's: the child's row is then the target's distribution after it, and by induction every
emitted sequence has the probability plain sampling gives it, token after token.

*Several candidates, or deterministic drafts* (``probs`` None, or a node with siblings): the children are tried in
node order. Candidate ``x_1`` is accepted with probability ``p(x_1)``. If it is rejected, ``p`` loses ``x_1``
(``p_2 = p`` with ``p(x_1)`` set to 0, renormalised), and ``x_2`` is accepted with probability ``p_2(x_2)``, and so
on; when every candidate is rejected the token is drawn from what is left. Why that emits ``y`` with probability
``p(y)``: with one candidate, ``y = x_1`` comes out with probability ``p(x_1)``; any other ``y`` needs the rejection
(probability ``1 - p(x_1)``) and then a draw from ``p_2``, which gives it ``p(y) / (1 - p(x_1))``: the product is
``p(y)``. With more candidates, the same argument applies to ``p_2`` and the remaining candidates (induction on
their number). The candidates may come from anywhere (a lookup table, a draft model's top-k) as long as they were
chosen before the target's draws; a repeated token is simply rejected the second time, since ``p_2`` gives it 0.

*One candidate drawn from a known proposal* ``q`` (a draft model sampling a chain, ``probs`` given and no
siblings): accept ``x`` with probability ``min(1, p(x) / q(x))``; on rejection draw from the residual
``r = norm(max(p - q, 0))``. The token comes out as ``y`` by acceptance with probability
``q(y) min(1, p(y) / q(y)) = min(q(y), p(y))``. Rejection has probability
``1 - sum_z min(p(z), q(z)) = sum_z max(p(z) - q(z), 0)``, the normaliser of ``r``, so the residual adds exactly
``max(p(y) - q(y), 0)``. And ``min(p, q) + max(p - q, 0) = p``. This rule accepts more often than the
point-mass one (``min(1, p/q) >= p`` whenever ``q <= 1``), which is why it is used when ``q`` is known.

The random numbers come from a ``torch.Generator``: :func:`request_generator` seeds one from a request's sampling
seed and step, so a seeded request replays the same draws whatever batch it runs in (the property the plain
sampler's counter-based noise gives plain steps).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from minisgl_ref.sampling.params import SamplingParams
from minisgl_ref.sampling.sampler import SamplingBatchInfo, penalised_logits, sampling_probs
from minisgl_ref.speculative.tree import DraftTree

#: The grammar's say at each offset of the verify row. A callable gets the draft tokens of the path from the root
#: to an offset (``()`` for the root itself) and returns a ``[vocab]`` bool mask of the tokens allowed next (True:
#: allowed), or None when nothing is masked there; it is called only for offsets whose path the grammar allows, in
#: node order. A tensor ``[n + 1, vocab]`` (or a sequence of ``[vocab]`` masks / None) gives every offset's mask
#: directly, row ``j`` for offset ``j``.
AllowedTokens = Callable[[tuple[int, ...]], "torch.Tensor | None"] | torch.Tensor | Sequence["torch.Tensor | None"]


@dataclass(frozen=True)
class Verdict:
    """The outcome of one verification: ``nodes``, the accepted draft nodes (a path from the root: each node's
    parent is the one before it, the first is a child of the root), and ``tokens``, what the request appends:
    the accepted nodes' tokens, then the bonus token. ``len(tokens) == len(nodes) + 1`` always."""

    nodes: list[int]
    tokens: list[int]


@dataclass(frozen=True)
class TargetView:
    """The target's processed distribution at every offset of a verify row: what :func:`walk` decides from.

    ``scores`` is ``[n + 1, vocab]`` float32: the processed logits (after mask, bias and penalties) for a greedy
    request, the probabilities a plain step would draw from for a sampled one. ``reachable[j]`` says whether
    offset ``j``'s path is allowed by the grammar (without a grammar: every offset); an unreachable offset's row
    is meaningless and its node is never accepted."""

    greedy: bool
    scores: torch.Tensor
    reachable: tuple[bool, ...]


def target_view(tree: DraftTree, logits: torch.Tensor, params: SamplingParams, *,
                prompt_ids: Sequence[int] = (), output_ids: Sequence[int] = (),
                eos_token_ids: Sequence[int] | int | None = None,
                allowed: AllowedTokens | None = None) -> TargetView:
    """Process the verify row's logits ``[n + 1, vocab]`` the way a plain step processes a request's logits.

    ``prompt_ids`` and ``output_ids`` are the request's tokens so far (the root, its last known token, is the last
    of them); offset ``j`` is processed as a request whose output is ``output_ids`` plus the draft tokens on the
    path to ``j``: penalties count them, and ``min_new_tokens`` sees them. ``eos_token_ids`` are the ids banned
    while ``min_new_tokens`` is not reached (with the request's ``stop_token_ids``), as for the plain sampler."""
    n = len(tree)
    if logits.dim() != 2 or logits.shape[0] != n + 1:
        raise ValueError(f"a draft of {n} tokens is verified by {n + 1} rows of logits, got {tuple(logits.shape)}")
    vocab = logits.shape[1]
    paths: list[tuple[int, ...]] = [()]
    for token, parent in zip(tree.tokens, tree.parents):
        paths.append(paths[parent + 1] + (token,))
    masks, reachable = _grammar_masks(tree, paths, allowed, vocab, logits.device)
    if any(m is not None for m in masks):
        full = torch.ones(n + 1, vocab, dtype=torch.bool, device=logits.device)
        for j, m in enumerate(masks):
            if m is not None:
                full[j] = m
        logits = logits.float().masked_fill(~full, float("-inf"))  # what the grammar's bitmask does in place
    info = SamplingBatchInfo.build([params] * (n + 1), [list(prompt_ids)] * (n + 1),
                                   [list(output_ids) + list(p) for p in paths], [eos_token_ids] * (n + 1),
                                   vocab, logits.device, seeds=[0] * (n + 1))  # seeds: no draw happens here
    processed = penalised_logits(logits, info)
    if params.is_greedy:
        return TargetView(True, processed, reachable)
    return TargetView(False, sampling_probs(processed, info), reachable)


def _grammar_masks(tree: DraftTree, paths: list[tuple[int, ...]], allowed: AllowedTokens | None, vocab: int,
                   device: torch.device) -> tuple[list[torch.Tensor | None], tuple[bool, ...]]:
    """Each offset's allowed-token mask (None: unmasked) and whether its path is allowed. An offset is reachable
    when its parent is and its token is allowed at the parent; the callable is asked only about those."""
    n = len(tree)
    masks: list[torch.Tensor | None] = [None] * (n + 1)
    reachable = [True] * (n + 1)
    if allowed is None:
        return masks, tuple(reachable)
    for j in range(n + 1):
        if j > 0:
            parent, token = tree.parents[j - 1] + 1, tree.tokens[j - 1]
            above = masks[parent]
            reachable[j] = reachable[parent] and (above is None or bool(above[token]))
            if not reachable[j]:
                continue
        m = allowed(paths[j]) if callable(allowed) else allowed[j]
        if m is not None:
            if m.shape != (vocab,) or m.dtype != torch.bool:
                raise ValueError(f"an allowed-token mask must be [{vocab}] bool, got {tuple(m.shape)} {m.dtype}")
            masks[j] = m.to(device)
    return masks, tuple(reachable)


def walk(tree: DraftTree, target: TargetView, generator: torch.Generator | None = None) -> Verdict:
    """Walk ``tree`` from the root under the target's distributions (the module docstring has the rules and why
    they are lossless). ``generator`` supplies every random number of a sampled request (None: torch's default
    CPU generator); a greedy request draws none. The draws happen on the generator's device.

    At each node of the walk (the root is ``node = -1``) two things are decided: the token emitted there, and
    whether the walk goes on to a child. The node's distribution is the row of its *offset* in the verify row
    (``node + 1``), not of its depth: in a tree, siblings and their subtrees lie side by side in the row.

    A greedy request follows the child that drafts the row's argmax, the lowest id among ties (as the plain
    sampler picks), provided that child's offset is ``reachable``. A sampled request needs the rule whose
    guarantee fits how the children were chosen: the ``min(1, p / q)`` rule (:func:`_try_proposal`) holds only
    for one child drawn from the ``q`` it carries (``tree.probs`` given and no sibling); everything else
    (deterministic drafts, siblings) goes through the candidate rule (:func:`_try_candidates`), which assumes
    nothing about where the candidates came from. Which rule applies must depend on the tree's shape only, never
    on the drafted token or on ``p``: each rule is lossless on average over the drafts it is given, so choosing by
    the token would bias the mix.

    The walk stops at the first node where no child is accepted (a leaf included). The token decided there is
    still emitted: it is the bonus (or the correction after a rejection), which is why a verify pass always
    appends ``len(nodes) + 1`` tokens, and why it must be the target's own choice at that node."""
    node, nodes, tokens = -1, [], []
    scores = target.scores
    if not target.greedy:
        device = generator.device if generator is not None else torch.device("cpu")
        scores = scores.to(device)
    kids_of: dict[int, list[int]] = {}
    for i, parent in enumerate(tree.parents):
        kids_of.setdefault(parent, []).append(i)
    # BEGIN TASK 13.1: the acceptance rule
    while True:
        row, kids = scores[node + 1], kids_of.get(node, [])
        if target.greedy:
            best = int(row.argmax())
            nxt = next((c for c in kids if tree.tokens[c] == best and target.reachable[c + 1]), None)
            token = best
        elif tree.probs is not None and len(kids) == 1:
            # A child the grammar forbids has p(x) = 0 and is rejected here, but still by this rule: the rule is
            # lossless on average over the x that q draws, so it must not change with x.
            q = tree.probs[kids[0]].to(row.device, torch.float32)
            accepted, token = _try_proposal(row, q, tree.tokens[kids[0]], generator)
            nxt = kids[0] if accepted else None
        else:  # a forbidden candidate has p(x) = 0: it is rejected and takes no mass with it
            index, token = _try_candidates(row, [tree.tokens[c] for c in kids], generator)
            nxt = None if index is None else kids[index]
        tokens.append(token)
        if nxt is None:
            return Verdict(nodes, tokens)
        nodes.append(nxt)
        node = nxt
    # END TASK 13.1


def _try_candidates(p: torch.Tensor, candidates: list[int],
                    generator: torch.Generator | None) -> tuple[int | None, int]:
    """The multi-candidate rule at one node: ``(index of the accepted candidate, its token)``, or ``(None, the
    token drawn from what the rejections left of p)``. ``p`` is a probability row (it need not sum exactly to 1).

    The candidates are tried in order, each against what the rejections before it left of ``p``: a rejected
    token's mass is removed, so the next candidate is accepted with its share of the mass that is left, not with
    its original ``p(x)``. That renormalisation is what makes the emitted token come out as ``p`` (the module
    docstring's induction); without it, later siblings are accepted too rarely. A candidate repeated after its
    rejection has no mass left and is rejected again. When every candidate is rejected, the token is drawn from
    the mass left (a token the rejections removed must never come out then); only if rounding left none is it
    drawn from ``p``. Every random number comes from ``generator``, on ``p``'s device."""
    # BEGIN TASK 13.1: the acceptance rule
    if candidates:
        mass = p[torch.tensor(candidates, device=p.device)].tolist()
        left = float(p.sum())
        u = torch.rand(len(candidates), generator=generator, device=p.device).tolist()
        rejected: set[int] = set()
        for i, (x, px) in enumerate(zip(candidates, mass)):
            if x in rejected:  # its mass is gone already: p_k(x) = 0
                continue
            if left > 0 and u[i] < px / left:
                return i, x
            rejected.add(x)
            left -= px
        rest = p.index_fill(0, torch.tensor(sorted(rejected), device=p.device), 0.0)
        if float(rest.sum()) > 0:  # zero only through rounding: every token of p was a rejected candidate
            p = rest
    return None, int(torch.multinomial(p, 1, generator=generator))
    # END TASK 13.1


def _try_proposal(p: torch.Tensor, q: torch.Tensor, x: int, generator: torch.Generator | None) -> tuple[bool, int]:
    """The rule for a candidate ``x`` drawn from ``q``: ``(True, x)`` if accepted, else ``(False, a token drawn
    from norm(max(p - q, 0)))``.

    Accepting ``x`` with probability ``min(1, p(x) / q(x))`` keeps exactly the part of ``q`` that ``p`` also has,
    ``min(p, q)``; the rejections must then supply the part of ``p`` that ``q`` under-proposes, ``max(p - q, 0)``,
    and nothing else: drawing from ``p`` itself would count ``min(p, q)`` twice. The residual is clamped at zero
    (where ``q`` over-proposes, ``p - q`` is negative and is no probability) and renormalised, which
    ``torch.multinomial`` does for any non-negative row. A ``q(x)`` of zero cannot have drawn ``x``; treat it as
    a ratio of 1 if ``p(x) > 0``, else 0. If rounding leaves the residual empty (``p == q``), draw from ``p``.
    Every random number comes from ``generator``, on ``p``'s device."""
    # BEGIN TASK 13.1: the acceptance rule
    px, qx = float(p[x]), float(q[x])
    u = float(torch.rand((), generator=generator, device=p.device))
    ratio = px / qx if qx > 0 else (1.0 if px > 0 else 0.0)
    if u < ratio:
        return True, x
    residual = (p - q).clamp_min(0.0)
    if float(residual.sum()) <= 0:  # p <= q everywhere means p == q: rejection had probability 0 (rounding)
        residual = p
    return False, int(torch.multinomial(residual, 1, generator=generator))
    # END TASK 13.1


def accept(tree: DraftTree, logits: torch.Tensor, params: SamplingParams, *,
           prompt_ids: Sequence[int] = (), output_ids: Sequence[int] = (),
           eos_token_ids: Sequence[int] | int | None = None, allowed: AllowedTokens | None = None,
           generator: torch.Generator | None = None) -> Verdict:
    """Verify ``tree`` against the target's ``logits`` for its verify row (``[n + 1, vocab]``, row ``j`` after
    offset ``j``): :func:`target_view`, then :func:`walk`. See the module docstring for the rule."""
    view = target_view(tree, logits, params, prompt_ids=prompt_ids, output_ids=output_ids,
                       eos_token_ids=eos_token_ids, allowed=allowed)
    return walk(tree, view, generator)


def request_generator(seed: int, step: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one verification of one request: seeded from the request's sampling seed and its step
    (the number of tokens it has generated), so a seeded request's accept / reject draws are the same whatever
    batch it runs in and however often it is replayed. A hash of both, so that neighbouring seeds or steps do not
    start correlated streams."""
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") >> 1)
