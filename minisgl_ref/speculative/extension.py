"""Speculative decoding as an engine extension: draft, verify in the target's step, keep what it agrees with
(chapter 13).

:class:`SpeculativeExtension` owns a proposer (:mod:`~minisgl_ref.speculative.proposer`) and plugs into two seams
of the core, neither of which knows what speculation is:

* **the scheduler's guesser** (``Scheduler.guesser``). While a step is planned, the decode rows of the running
  requests it may draft for are widened into verify rows: the request's last token followed by the draft
  (``Row.guess``), with KV slots for every drafted token, allocated like extend tokens. A verify row is an
  ordinary causal extend row when the draft is a chain; the model runner computes the logits at all of its
  positions (``StepOutput.row_logits``).
* **the engine's ``row_tokens`` hook**. As the step is processed, the draft is checked against those logits
  (:meth:`SpeculativeExtension._verify`, the one place the acceptance rule of
  :mod:`~minisgl_ref.speculative.accept` is called), the KV of the rejected tokens is given
  back and the request's scheduled length rewound to the accepted ones; the tokens to append, the accepted drafts
  and the target's bonus token after them, go through the request's ordinary append path one by one, so stop
  tokens, stop strings, ``max_new_tokens`` and the detokenizer apply per token and a stop inside the run drops the
  rest. Only then can the KV of accepted tokens reach the radix cache (a verify row is never committed at
  launch).

**What it costs.** A verify row's request has an unknown length until its step is processed, and a draft needs
the request's last token: while speculation is on, the scheduler asks for the step in flight to be processed
before the next is planned (``NEED_SYNC``), so overlap scheduling (chapter 06) is off for those steps and the
host's scheduling and processing are no longer hidden behind the device. That is why speculation turns itself
down: above ``speculative_max_batch`` running requests it pauses entirely and overlap comes back, and a request
whose drafts are mostly rejected (or for which the proposer keeps finding nothing) drafts fewer tokens, then none
for a while; once no running request may draft, steps overlap again.

**What it buys.** On an H200, with the embedded SmolLM2 zero-padded to 2.1B parameters (its outputs, a larger
model's bytes) on a copy-heavy workload, greedy, up to 67 output tokens per request
(``scripts/gpu/measure/spec_bench.py``, ``docs/data/spec_bench_h200.json``): at batch 1 the n-gram chain of 4
drafts takes 0.88 ms per output token against 2.04 without speculation (2.3x, 4.2 tokens per verify row), a chain
of 8 drafts 0.58 ms (3.5x, 6.6 tokens per row). A verify step costs about two decode steps (no overlap; an extend
graph of 64 tokens and the LM head on the drafted positions), and a batch lasts until its slowest drafter is done,
so chains that never pause are about even at 4 and 8 requests, 0.75x at 16 and 0.30x at 64 (64 verify rows of 5
tokens make a step bound by arithmetic). Paused above 4 requests, the default, measured side by side with the
plain engine (``docs/data/spec_interleaved_h200.json``), is 2.39x at batch 1, 1.05x at 4 and 1.00-1.01x from 8 to
64. A verify step replays the extend CUDA graphs of chapter 11 and runs the LM head on the drafted positions; a
tree step (FlashInfer's FA2 kernels, which take a mask, and have no extend graphs here) runs eagerly and gained
1.25x at batch 1.

**Which requests draft.** Every request: greedy and sampled ones, with any penalties, with or without log
probabilities or a grammar. The acceptance rule processes each offset's logits with the sampler's own functions, so
a greedy request appends exactly the tokens it would have decoded alone, and a sampled one tokens of exactly the
same distribution (its accept / reject draws come from a generator seeded by its seed and step).

*A grammar* (chapter 12) is followed at every drafted offset. The engine's structured output, handed over by
``build_runtime`` as the ``constraint`` (a :class:`TokenConstraint`: ``may_draft(req)``,
``allowed_after(req, tokens)``), gives the mask there: the request's matcher accepts the path's draft tokens, fills
its mask and rolls them back. The rule walks under those masks, so a drafted token the grammar forbids is never
accepted (nor anything below it), and the tokens appended then advance the matcher one by one, through the
ordinary append path, as decoded ones do; a stop token or the grammar's end inside the run drops the rest. Drafts
are not pruned by the grammar before they are verified: a forbidden draft costs one position of the verify row,
and pruning a draft model's sampled chain would bias its acceptance rule, which must not depend on the drafted
token.

*Log probabilities*: each token a verify row appends gets what a plain step computes for it, from the row's
logits at the offset it was chosen at (masked, biased and penalised as there, over the temperature:
:meth:`SpeculativeExtension._token_logprobs`), with the request's ``top`` alternatives; the prompt's are computed
by its prefill, before any draft. They equal a run without drafts up to float rounding: the verify row's logits
come from an extend pass, whose sums run in another order than a decode step's (about 4e-6 in float32 on a CPU).

*Without drafts*, in the same batches: a request that follows a grammar when the engine has no constraint, or has
jump-forward on (``enable_jump_forward``: the grammar would append forced text in the middle of a run verified
without it).

**Trees.** A draft tree (several guesses at one depth) needs an attention mask that lets each node see only its
ancestors (``Guess.mask``, carried to the backend as ``ForwardBatch.extend_masks``). With an attention backend
that takes one (``supports_custom_mask``) trees are verified whole; with any other a tree is cut to its longest
chain (the path to its first deepest node) before it is verified, never verified under a causal mask, which would
let siblings see each other; asking for trees there (``speculative_eagle_topk > 1``) is refused. When a tree is
verified, the accepted path's KV is moved from the nodes' slots to the slots of its positions (``KVPool.move``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from minisgl_ref.core.batch import Guess, Row
from minisgl_ref.core.request import Req, TokenLogprob
from minisgl_ref.engine.extension import EngineExtension, EngineView
from minisgl_ref.engine.step import Launched, StepEvent
from minisgl_ref.sampling.sampler import SamplingBatchInfo, penalised_logits, sampling_temperatures, token_logprobs
from minisgl_ref.speculative.accept import accept, request_generator
from minisgl_ref.speculative.config import SpeculativeConfig

from minisgl_ref.speculative.tree import DraftTree

from minisgl_ref.speculative.proposer import Proposer

log = logging.getLogger(__name__)

#: How many requests' figures (:class:`SpecStats`) are kept for the server to read with their last row.
KEPT_STATS = 4096


@dataclass(frozen=True, eq=False)
class DraftGuess(Guess):
    """The core's :class:`~minisgl_ref.core.batch.Guess` of a verify row, with the draft tree it was made from."""

    tree: DraftTree = field(default_factory=lambda: DraftTree((), ()))

    @classmethod
    def of(cls, tree: DraftTree) -> DraftGuess:
        return cls(tree.tokens, tuple(tree.depths()), None if is_chain(tree) else tree.mask(), tree)


@dataclass
class SpecStats:
    """One request's speculation, as SGLang reports it in ``meta_info``: verify rows, draft tokens proposed and
    accepted, and tokens appended by verify rows (accepted drafts plus one bonus token each)."""

    verify_ct: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    appended_tokens: int = 0

    @property
    def accept_length(self) -> float:
        """Tokens appended per verify row (1.0: no draft token was ever accepted)."""
        return self.appended_tokens / self.verify_ct if self.verify_ct else 0.0


@dataclass
class _Drafting:
    """What the extension keeps per request: how many of its tokens the proposer has seen, its recent accept
    rate (accepted / drafted, a moving average), and steps left before it may draft again."""

    seen: int
    rate: float = 1.0
    cooldown: int = 0


def is_chain(tree: DraftTree) -> bool:
    return all(p == i - 1 for i, p in enumerate(tree.parents))


def longest_chain(tree: DraftTree) -> DraftTree:
    """The path from the root to ``tree``'s first deepest node, as a chain (with its nodes' proposal rows)."""
    depths = tree.depths()
    node = depths.index(max(depths))
    path: list[int] = []
    while node >= 0:
        path.append(node)
        node = tree.parents[node]
    path.reverse()
    probs = tree.probs[path] if tree.probs is not None else None
    return DraftTree.chain([tree.tokens[i] for i in path], probs)


def first_nodes(tree: DraftTree, n: int) -> DraftTree:
    """``tree``'s first ``n`` nodes (a tree again: parents come before their children)."""
    if len(tree) <= n:
        return tree
    probs = tree.probs[:n] if tree.probs is not None else None
    return DraftTree(tree.tokens[:n], tree.parents[:n], probs)


class TokenConstraint(Protocol):
    """What speculation asks of the extension that restricts which tokens a request may append (structured
    output, chapter 12: ``StructuredOutput``); :func:`~minisgl_ref.runtime.build_runtime` hands it over. Without
    one, a request that follows a grammar does not draft."""

    def may_draft(self, req: Req) -> bool:
        """Whether ``req``'s tokens may be checked a run at a time (its constraint can mask any drafted path)."""
        ...

    def allowed_after(self, req: Req, tokens: Sequence[int]) -> torch.Tensor | None:
        """The ``[vocab]`` bool mask (True: allowed) of the tokens ``req`` may append after its output followed
        by ``tokens``, the mask a plain step would apply there; None where nothing is masked. Leaves ``req``'s
        state as it was."""
        ...


class SpeculativeExtension(EngineExtension):
    """Speculative decoding for one engine (see the module docstring). ``proposer`` drafts; ``config`` holds the
    knobs; ``tree_mask``: whether trees are verified whole under a tree mask (None: when the engine's attention
    backend takes one; False: trees are cut to their longest chain); ``constraint``: the engine's grammar masks
    (None: requests that follow a grammar do not draft)."""

    def __init__(self, proposer: Proposer, config: SpeculativeConfig, *, tree_mask: bool | None = None,
                 constraint: TokenConstraint | None = None) -> None:
        self.proposer = proposer
        self.config = config
        self.tree_mask = tree_mask
        self.constraint = constraint
        self._engine: EngineView | None = None
        self._drafting: dict[Req, _Drafting] = {}
        #: Per rid; an ended request's are kept (for the server's last row) until read, the newest
        #: ``KEPT_STATS`` at most (an offline run never reads them).
        self.stats: dict[str, SpecStats] = {}
        self.verify_ct = 0  #: verify rows processed, all requests
        self.appended_tokens = 0  #: tokens those rows appended
        self._offsets: tuple[Launched | None, dict[int, int]] = (None, {})
        self._argmax: tuple[Launched | None, list[int]] = (None, [])  # a step's target argmax per verify offset
        self._publish: list[Req] = []  # requests that appended tokens no step sampled: their last goes to the device
        # The log probabilities of the tokens a verify row appends, per request, recorded as each is appended.
        self._logprobs: dict[Req, list[tuple[int, TokenLogprob]]] = {}

    def bind(self, engine: EngineView) -> None:
        self._engine = engine
        engine.scheduler.guesser = self
        if self.tree_mask is None:
            self.tree_mask = engine.runner.attn_backend.supports_custom_mask
        if self.config.speculative_eagle_topk > 1 and not self.tree_mask:
            raise ValueError(f"speculative_eagle_topk={self.config.speculative_eagle_topk} drafts trees, and the "
                             f"{engine.runner.attn_backend.name} attention backend takes no tree mask: use "
                             "speculative_eagle_topk=1, or an attention backend with one (torch_native, triton, "
                             "flashinfer)")

    @property
    def engine(self) -> EngineView:
        assert self._engine is not None, "SpeculativeExtension is used by an engine, which binds it first"
        return self._engine

    @property
    def accept_length(self) -> float:
        """Tokens appended per verify row, over every request so far (what ``/metrics`` shows)."""
        return self.appended_tokens / self.verify_ct if self.verify_ct else 0.0

    def pop_stats(self, rid: str) -> SpecStats | None:
        """``rid``'s speculation figures, forgotten once read (a finished request's last report)."""
        return self.stats.pop(rid, None)

    # ------------------------------------------------------------------------------------------ the guesser

    def _may_draft(self, req: Req) -> bool:
        state = self._drafting.get(req)
        return (state is None or state.cooldown == 0) and self._drafts(req)

    def _drafts(self, req: Req) -> bool:
        """Whether ``req`` drafts at all: one that follows a grammar only through the engine's constraint."""
        if req.params.grammar_field is None:
            return True
        return self.constraint is not None and self.constraint.may_draft(req)

    def active(self, running: list[Req]) -> bool:
        return len(running) <= self.config.speculative_max_batch and any(self._may_draft(r) for r in running)

    def guesses(self, reqs: list[Req], room: list[int]) -> list[Guess | None]:
        out: list[Guess | None] = [None] * len(reqs)
        asked: list[tuple[int, Req, int]] = []  # (index, request, most draft tokens)
        for i, (req, limit) in enumerate(zip(reqs, room)):
            if not self._may_draft(req):
                continue
            n = min(limit, self._draft_len(self._sync(req)))
            if n >= 1:
                asked.append((i, req, n))
        if not asked:
            return out
        trees = self.proposer.propose([req.rid for _, req, _ in asked], max(n for _, _, n in asked))
        for (i, req, n), tree in zip(asked, trees):
            if tree is None or len(tree) == 0:
                # Nothing to propose counts as a draft rejected outright: a request the proposer keeps finding
                # nothing for pauses, and a step in which nobody may draft runs overlapped again.
                self._update_rate(self._drafting[req], 0.0)
                continue
            tree = first_nodes(tree, n)
            if not self.tree_mask and not is_chain(tree):
                tree = longest_chain(tree)  # never verified under a causal mask: siblings would see each other
            out[i] = DraftGuess.of(tree)
        return out

    def _sync(self, req: Req) -> _Drafting:
        """Tell the proposer the tokens ``req`` appended since it last saw it (every token, verified or decoded
        plainly), starting it on its first draft."""
        state = self._drafting.get(req)
        ids = req.all_ids
        if state is None:
            self.proposer.start(req.rid, ids)
            state = self._drafting[req] = _Drafting(len(ids))
        elif state.seen < len(ids):
            self.proposer.extend(req.rid, ids[state.seen:])
            state.seen = len(ids)
        return state

    def _draft_len(self, state: _Drafting) -> int:
        """How many draft tokens the request gets: all that a verify row holds while half or more of its recent
        drafts were accepted, proportionally fewer below that (at least one)."""
        most = self.config.draft_tokens - 1
        return most if state.rate >= 0.5 else max(1, int(most * 2 * state.rate))

    # ---------------------------------------------------------------------------------------- verification

    def row_tokens(self, launched: Launched, i: int, token: int) -> list[int] | None:
        row = launched.batch.rows[i]
        guess = row.guess
        if not isinstance(guess, DraftGuess):
            return None  # somebody else's guess
        req = row.req
        try:
            masks = self._masks(req)
            if masks is None and self._plain_greedy(req):
                nodes, tokens = self._greedy_walk(guess.tree, self._argmax_of(launched, i))
            else:
                nodes, tokens = self._verify(req, guess.tree, self._logits_of(launched, i), masks)
            if req.logprobs is not None:
                logprobs = self._token_logprobs(req, self._logits_of(launched, i), nodes, tokens, masks)
                self._logprobs[req] = list(zip(tokens, logprobs))
            self._keep_accepted_kv(row, guess, nodes)
        except Exception as e:  # noqa: BLE001 - one request's failure must not end the engine
            log.exception("verifying the draft of request %s failed", req.rid)
            req.abort(f"this request failed while verifying its draft: {type(e).__name__}: {e}")
            return []
        self._count(req, len(guess.tokens), len(nodes), len(tokens))
        self._publish.append(req)
        return tokens

    def _masks(self, req: Req) -> _PathMasks | None:
        """``req``'s grammar masks per drafted path, asked of the constraint once each (None: no grammar)."""
        if req.params.grammar_field is None or self.constraint is None:
            return None
        return _PathMasks(self.constraint, req)

    @staticmethod
    def _verify(req: Req, tree: DraftTree, logits: torch.Tensor,
                masks: _PathMasks | None = None) -> tuple[list[int], list[int]]:
        """The acceptance rule on one verify row: (accepted nodes, tokens to append). A sampled request's draws
        come from a generator seeded by its seed and step, so a seeded request replays them. A draft token the
        grammar forbids is never accepted (its offset is unreachable)."""
        params = req.params
        generator = None if params.is_greedy else request_generator(req.sampling_seed, len(req.output_ids))
        verdict = accept(tree, logits, params, prompt_ids=req.input_ids, output_ids=req.output_ids,
                         eos_token_ids=sorted(req.eos_token_ids), allowed=masks, generator=generator)
        return verdict.nodes, verdict.tokens

    @staticmethod
    def _token_logprobs(req: Req, logits: torch.Tensor, nodes: list[int], tokens: list[int],
                        masks: _PathMasks | None) -> list[TokenLogprob]:
        """The log probability of each token a verify row appends (and the request's ``top`` alternatives), as
        a plain step computes it for the same token: from the logits at the offset it was chosen at (the root,
        then each accepted node), masked by the grammar there, after bias and penalties counting the tokens
        before it (:func:`~minisgl_ref.sampling.sampler.penalised_logits`), divided by the temperature (1 for a
        greedy request), through the sampler's own :func:`~minisgl_ref.sampling.sampler.token_logprobs`."""
        assert req.logprobs is not None
        offsets = [0] + [n + 1 for n in nodes]
        rows = logits[offsets].float()
        paths = [tuple(tokens[:k]) for k in range(len(tokens))]
        if masks is not None:
            for k, path in enumerate(paths):
                mask = masks(path)
                if mask is not None:
                    rows[k] = rows[k].masked_fill(~mask.to(rows.device), float("-inf"))
        n, params = len(offsets), req.params
        info = SamplingBatchInfo.build([params] * n, [req.input_ids] * n, [req.output_ids + list(p) for p in paths],
                                       [sorted(req.eos_token_ids)] * n, rows.shape[1], rows.device, seeds=[0] * n)
        processed = penalised_logits(rows, info)
        temperatures = None if params.is_greedy else sampling_temperatures(info)
        chosen = torch.tensor(tokens, device=rows.device)
        found = token_logprobs(processed, chosen, req.logprobs.top, temperatures)
        values, ids = found.top_values.tolist(), found.top_ids.tolist()
        return [TokenLogprob(lp, list(zip(ids[k], values[k]))) for k, lp in enumerate(found.chosen.tolist())]

    @staticmethod
    def _plain_greedy(req: Req) -> bool:
        """A greedy request whose logits no penalty, bias or early-EOS ban changes: its target at every offset is
        the raw argmax, read for the whole step at once (:meth:`_argmax_of`) instead of processed row by row.
        On an H200 with eight requests this took a verify step from ~13 ms of host work to a few."""
        p = req.params
        return (p.is_greedy and p.frequency_penalty == 0 and p.presence_penalty == 0 and p.repetition_penalty == 1
                and not p.logit_bias and p.min_new_tokens <= len(req.output_ids))

    @staticmethod
    def _greedy_walk(tree: DraftTree, argmax: list[int]) -> tuple[list[int], list[int]]:
        """Greedy acceptance on the target's argmax per offset (root first): follow the child whose token is the
        target's choice while there is one; the target's choice after the last accepted node is the bonus. The
        same rule as :func:`accept` for a greedy request (ties go to the lowest id, as ``torch.argmax`` does)."""
        nodes: list[int] = []
        offset = 0
        while True:
            choice = argmax[offset]
            parent = nodes[-1] if nodes else -1
            child = next((c for c, (t, p) in enumerate(zip(tree.tokens, tree.parents)) if p == parent and t == choice),
                         None)
            if child is None:
                return nodes, [tree.tokens[n] for n in nodes] + [choice]
            nodes.append(child)
            offset = child + 1

    def _argmax_of(self, launched: Launched, i: int) -> list[int]:
        """Row ``i``'s target argmax per offset, from one device-to-host copy of the whole step's argmax."""
        if self._argmax[0] is not launched:
            assert launched.output.row_logits is not None
            self._argmax = (launched, launched.output.row_logits.argmax(dim=-1).tolist())
        self._logits_of(launched, i)  # fills the row offsets
        row = launched.batch.rows[i]
        assert row.guess is not None
        end = self._offsets[1][i] + row.extend_len
        return self._argmax[1][end - len(row.guess.tokens) - 1 : end]

    def _logits_of(self, launched: Launched, i: int) -> torch.Tensor:
        """Row ``i``'s verify logits [n + 1, vocab]: its last known token's offset and its draft's."""
        if self._offsets[0] is not launched:
            starts, start = {}, 0
            for j, row in enumerate(launched.batch.rows):
                if row.guess is not None:
                    starts[j] = start
                    start += row.extend_len
            self._offsets = (launched, starts)
        row = launched.batch.rows[i]
        assert row.guess is not None and launched.output.row_logits is not None
        end = self._offsets[1][i] + row.extend_len
        return launched.output.row_logits[end - len(row.guess.tokens) - 1 : end]

    def _keep_accepted_kv(self, row: Row, guess: Guess, nodes: list[int]) -> None:
        """Keep the KV of the row's root and accepted nodes, at the slots of positions root + 1 .. root + k, and
        give back the rest: the request's scheduled and allocated lengths end after the accepted tokens, and the
        whole pages past them are freed (through the in-flight frees, like every free). A path through a tree
        whose nodes are not the first k has its KV moved there first."""
        req, cache = row.req, self.engine.scheduler.cache
        assert req.req_pool_idx is not None
        root = row.prefix_len + row.extend_len - len(guess.tokens) - 1
        k = len(nodes)
        if nodes != list(range(k)):
            slots = cache.req_to_token.read(req.req_pool_idx, root + 1 + len(guess.tokens), start=root + 1)
            device = self.engine.kv_pool.k[0].device
            self.engine.kv_pool.move(slots[nodes].to(device), slots[:k].to(device))
        keep = root + 1 + k
        first_free = -(-keep // cache.page_size) * cache.page_size  # the first page holding no kept token
        if first_free < req.kv_allocated_len:
            cache.frees.free(cache.req_to_token.read(req.req_pool_idx, req.kv_allocated_len, start=first_free))
        req.kv_scheduled_len = req.kv_allocated_len = keep

    def _count(self, req: Req, drafted: int, accepted: int, appended: int) -> None:
        stats = self.stats.setdefault(req.rid, SpecStats())
        stats.verify_ct += 1
        stats.draft_tokens += drafted
        stats.accepted_tokens += accepted
        stats.appended_tokens += appended
        self.verify_ct += 1
        self.appended_tokens += appended
        state = self._drafting.get(req)
        if state is not None:
            self._update_rate(state, accepted / drafted)

    def _update_rate(self, state: _Drafting, rate: float) -> None:
        """Fold one verify's accept rate into the request's moving average; below the floor, pause it."""
        decay = self.config.speculative_rate_decay
        state.rate = (1 - decay) * state.rate + decay * rate
        if state.rate < self.config.speculative_min_accept_rate:
            state.cooldown = self.config.speculative_cooldown_steps
            state.rate = self.config.speculative_min_accept_rate  # after the pause: one token, growing if accepted

    # ------------------------------------------------------------------------------------------- the loop

    def before_step(self) -> None:
        for req in [r for r in self._drafting if r.finished]:
            self._forget(req)
        for state in self._drafting.values():
            state.cooldown = max(0, state.cooldown - 1)

    def watches_tokens(self) -> bool:
        """Only while a request that wants log probabilities drafts: its verified tokens' are recorded as each is
        appended (:meth:`before_token`)."""
        return any(r.logprobs is not None for r in self._drafting)

    def before_token(self, launched: Launched, i: int, token: int) -> str | None:
        """Record the log probability of a token a verify row appends, as the engine appends it: a token that
        ends the request drops the rest, and theirs with them. Never refuses a token."""
        req = launched.batch.rows[i].req
        pending = self._logprobs.get(req)
        if pending and launched.batch.rows[i].guess is not None:
            verified, entry = pending.pop(0)
            assert verified == token, "the engine appends the verified tokens in order"
            assert req.logprobs is not None
            req.logprobs.output.append(entry)
        return None

    def after_step(self, launched: Launched, events: list[StepEvent]) -> None:
        """The verified requests that go on read their next decode input from the device's token buffer, which
        holds what the step sampled after the last drafted token: put the last appended token there."""
        self._logprobs.clear()
        publish, self._publish = [r for r in self._publish if not r.finished], []
        if publish:
            runner = self.engine.runner
            rows = torch.tensor([r.req_pool_idx for r in publish])
            last = torch.tensor([r.output_ids[-1] for r in publish], dtype=runner.token_buffer.dtype)
            runner.token_buffer[rows.to(runner.device)] = last.to(runner.device)
        for event in events:
            if event.finished:
                self._forget(event.req)

    def _forget(self, req: Req) -> None:
        if self._drafting.pop(req, None) is not None:
            self.proposer.finish(req.rid)
        while len(self.stats) > KEPT_STATS:
            del self.stats[next(iter(self.stats))]  # the oldest first (dicts keep insertion order)


class _PathMasks:
    """One verify row's grammar masks, by drafted path: asked of the constraint once per path, kept for the log
    probabilities after the walk. The ``allowed`` callable of :func:`~minisgl_ref.speculative.accept.accept`."""

    def __init__(self, constraint: TokenConstraint, req: Req) -> None:
        self._constraint, self._req = constraint, req
        self._found: dict[tuple[int, ...], torch.Tensor | None] = {}

    def __call__(self, path: tuple[int, ...]) -> torch.Tensor | None:
        if path not in self._found:
            self._found[path] = self._constraint.allowed_after(self._req, path)
        return self._found[path]
