"""A draft model: a smaller model of the same vocabulary guesses the next tokens, the target verifies them
(chapter 13).

The draft runs on the engine's own parts: the chapter-01 model classes, a paged KV pool with its page allocator
and page table (chapter 03), the attention backend the engine would choose (chapter 07) and the
:class:`~minisgl_ref.engine.model_runner.ModelRunner`'s forward pass. What it does not take from the engine is
the scheduler: a proposer's steps are not the engine's, so it lays out its own flat batches (one row per request,
or per tree branch) and keeps its own pool, sized for its own layers.

**Self-speculation.** :func:`truncated_model` gives the first ``k`` decoder layers of a model, with its final
norm and LM head, sharing every weight with it (no copy): the shallow model is a draft that costs ``k / L`` of a
target step and needs no weights of its own. It is a weak draft: the final norm and LM head were trained to read
the last layer's hidden state, not an early one. On the embedded SmolLM2-135M (30 layers), replaying the
target's greedy output offline (``scripts/spec_accept_rates.py``, ``docs/data/spec_accept_cpu.json``), a chain of
4 drafted by the first 27 layers yields 1.97 tokens per verify step on copy-heavy prompts and 1.84 on chat (a
top-2 tree of 8 nodes: 2.11 and 1.92); the first 20 layers only 1.19 and 1.17, the first 10 about 1.04; all 30
layers, the control, accept every draft (4.83 and 4.88, the most 4 drafts and a bonus allow on outputs of 64
tokens at most). A draft pays when its accept length outruns its cost, here ``1 + num_steps * k / 30`` target
steps per verify step: 27 layers is not that. Self-speculation needs a model trained to exit early (LayerSkip) or a
feature head (EAGLE); a separate small draft of the same family is the usual choice.

**What a request holds.** One page-table row and the KV slots of its tokens, ``kv_len`` of them, always a prefix
of the tokens it has *accepted* (``start`` plus every ``extend``). ``start`` and ``extend`` only record tokens:
the next ``propose`` computes the KV of every request's unseen tail in one batched extend step (the prompt, the
first time; afterwards the accepted draft tokens and the bonus token), whose last logits give the first draft
token. The prompt's KV may already be there: the draft keeps a radix cache of its own (chapter 04's
:class:`~minisgl_ref.kvcache.radix.RadixCache` over its own pool), into which a finished request's accepted
tokens go, so a request that shares a prefix with an earlier one (a system prompt, the earlier turns of a chat)
starts from that KV instead of recomputing it, and the least recently used prefixes are evicted when the pool runs
short. The draft steps after it write KV for drafted tokens into fresh slots, and before ``propose`` returns
those slots are freed and the table rows forgotten: a rejected guess leaves nothing behind, and an accepted one
is recomputed (a few tokens more in the next extend row, which runs anyway for the bonus token).

**Cost per propose** (B requests, ``num_steps`` = s, draft depth ``k``): one extend pass over the B tails plus
``s - 1`` decode passes of B rows (chain) or ``B * topk`` rows (tree), each a ``k``-layer forward; on the host,
for a tree, each branch row's page-table prefix is copied once per draft step (``O(context)`` int32 per branch,
a memcpy; a radix-style shared prefix would remove it). Greedy (``temperature == 0``) and top-k drafts are
deterministic (``probs`` None); a sampled chain returns the distributions its tokens were drawn from.

**Trees** (``topk > 1``, SGLang's ``--speculative-eagle-topk``): the root's ``topk`` most likely tokens are the
first level; at each later step every one of the ``topk`` *frontier* nodes proposes its ``topk`` most likely
children, scored by the path's summed log probability, and the ``topk`` best of those ``topk * topk`` become the
next frontier. Every scored candidate may enter the tree; ``propose`` keeps the ``max_tokens`` best by score
(a child never outscores its parent, so the kept set holds every kept node's ancestors). This is EAGLE's tree,
grown from the draft model's logits instead of EAGLE's feature head.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from minisgl_ref.attention.registry import create_attention_backend
from minisgl_ref.core.config import EngineConfig
from minisgl_ref.core.forward_batch import ForwardBatch, ForwardMode
from minisgl_ref.engine.attention_planner import AttentionPlanner
from minisgl_ref.engine.model_runner import ModelRunner
from minisgl_ref.kvcache.allocator import PageAllocator
from minisgl_ref.kvcache.pool import KVPool
from minisgl_ref.kvcache.radix import RadixCache, TreeNode
from minisgl_ref.kvcache.req_to_token import ReqToTokenPool
from minisgl_ref.layers.attention import AttentionLayer
from minisgl_ref.models.config import ModelConfig
from minisgl_ref.speculative.tree import DraftTree

#: KV slots of a draft pool on the CPU when none is given (the draft's own; its layers are few).
CPU_DRAFT_TOKENS = 8192


def truncated_model(model: nn.Module, num_layers: int) -> nn.Module:
    """The first ``num_layers`` decoder layers of ``model`` with its embedding, final norm and LM head: a shallow
    draft of ``model`` that shares all of its weights (the returned module holds the same parameter tensors; no
    copy is made, so it costs no memory and follows the target's weights wherever they are).

    The result is an instance of the same class, so it runs the same forward code (folded layers of chapter 11
    included); its ``config.num_layers`` says ``num_layers``. Its attention layers keep their ids ``0 ..
    num_layers - 1``, which index its own KV pool, not the target's."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no `layers` list of decoder layers to truncate")
    if not 1 <= num_layers <= len(layers):
        raise ValueError(f"num_layers must be between 1 and the model's {len(layers)} layers, got {num_layers}")
    draft = copy.copy(model)  # the same class and attributes; the submodule tables are replaced below
    draft._modules = {**model._modules, "layers": nn.ModuleList(list(layers)[:num_layers])}
    draft._parameters, draft._buffers = dict(model._parameters), dict(model._buffers)
    if isinstance(getattr(model, "config", None), ModelConfig):
        draft.config = replace(model.config, num_layers=num_layers)
    return draft


@dataclass
class _Draft:
    """One request as the draft model knows it: its accepted tokens, its page-table row, and the KV slots of its
    first ``len(slots)`` tokens, of which the first ``cached`` belong to the radix cache (pinned through ``node``
    while the request runs) and the rest to the request."""

    tokens: list[int]
    row: int
    slots: list[int] = field(default_factory=list)
    cached: int = 0
    node: TreeNode | None = None


@dataclass
class _Node:
    """A scored node of a draft tree under construction."""

    token: int
    parent: int  # index into the request's node list, -1 for the root
    depth: int
    score: float  # summed log probability of the path from the root
    slots: list[int] = field(default_factory=list)  # KV slots of the path's tokens (once expanded)


class DraftModelProposer:
    """A :class:`~minisgl_ref.speculative.proposer.Proposer` backed by a draft model (see the module docstring).

    ``model`` and ``model_config``: the draft (say ``truncated_model(target, k)`` with the target's config made
    to match by :func:`truncated_model`); ``target_vocab_size``: the target model's vocabulary, which the draft
    must share (token ids mean the same thing to both, or a draft is noise): a different ``vocab_size`` is
    refused. ``num_steps``: draft tokens of a chain, draft levels of a tree (SGLang's
    ``--speculative-num-steps``); ``topk``: children per frontier node (``--speculative-eagle-topk``; 1 draws a
    chain); ``temperature``: 0 for greedy chains, else chains are sampled (with a generator seeded by ``seed``)
    and carry their distributions. ``max_requests`` and ``max_total_tokens`` size the draft's own page table and
    KV pool; ``config`` picks the attention backend the way the engine's flags do (default: the device's), and
    its ``disable_radix_cache`` turns the draft's own radix cache off too.
    A ``propose`` that does not fit the pool raises
    :class:`~minisgl_ref.kvcache.allocator.OutOfPages` and keeps nothing of its step (the engine then verifies no
    draft for those requests, or finishes some); the pool is the proposer's own, so the target never pays for
    it."""

    def __init__(self, model: nn.Module, model_config: ModelConfig, *, target_vocab_size: int, num_steps: int = 4,
                 topk: int = 1, temperature: float = 0.0, seed: int = 0, max_requests: int = 64,
                 max_total_tokens: int | None = None, context_length: int | None = None,
                 device: torch.device | str = "cpu", config: EngineConfig | None = None) -> None:
        if model_config.vocab_size != target_vocab_size:
            raise ValueError(f"vocab_size: the draft model has {model_config.vocab_size} token ids and the target "
                             f"{target_vocab_size}; a draft model must share the target's tokenizer")
        if num_steps < 1:
            raise ValueError(f"num_steps (speculative_num_steps) must be >= 1, got {num_steps}")
        if topk < 1:
            raise ValueError(f"topk (speculative_eagle_topk) must be >= 1, got {topk}")
        if temperature < 0 or (temperature > 0 and topk > 1):
            raise ValueError(f"temperature must be 0, or > 0 with topk 1 (sampled chains), got {temperature} "
                             f"with topk {topk}")
        self.model, self.num_steps, self.topk, self.temperature = model, num_steps, topk, temperature
        self.device = torch.device(device)
        self.config = replace(config or EngineConfig(), page_size=1)  # trees share slots token by token
        attn = [m for m in model.modules() if isinstance(m, AttentionLayer)]
        dtype = next(model.parameters()).dtype
        tokens = max_total_tokens or self.config.max_total_tokens or CPU_DRAFT_TOKENS
        self.allocator = PageAllocator(tokens + 1, 1, self.device)  # + the reserved dummy slot 0
        self.kv_pool = KVPool(len(attn), tokens + 1, attn[0].num_kv_heads, model_config.head_dim, dtype, self.device)
        context = (context_length or model_config.max_position_embeddings) + num_steps + 1
        # Each request's row, plus topk branch rows per request while a tree is drafted.
        self.req_to_token = ReqToTokenPool(max_requests * (1 + (topk if topk > 1 else 0)), context, self.device)
        self.backend = create_attention_backend(self.config, self.kv_pool, self.req_to_token,
                                                num_q_heads=attn[0].num_heads, device=self.device)
        self.runner = ModelRunner(model, model_config.vocab_size, self.req_to_token, AttentionPlanner(self.backend),
                                  self.device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.reqs: dict[int, _Draft] = {}
        self.cache = None if self.config.disable_radix_cache else RadixCache(self.allocator)

    @classmethod
    def self_speculative(cls, target: nn.Module, target_config: ModelConfig, num_layers: int,
                         **kwargs: object) -> DraftModelProposer:
        """Self-speculation: the draft is the first ``num_layers`` layers of ``target`` (:func:`truncated_model`,
        sharing its weights); ``kwargs`` as for the constructor."""
        draft = truncated_model(target, num_layers)
        return cls(draft, draft.config, target_vocab_size=target_config.vocab_size, **kwargs)  # type: ignore[arg-type]

    # ------------------------------------------------------------------------------------------ the interface

    def start(self, rid: int, tokens: list[int]) -> None:
        if not tokens:
            raise ValueError("a request starts with at least one token")
        self.finish(rid)
        req = _Draft(list(tokens), self.req_to_token.alloc())
        if self.cache is not None:
            # All but the last token: that one is computed anyway, since its logits give the first draft token.
            match = self.cache.match_prefix(req.tokens[:-1])
            self.cache.record_lookup(len(req.tokens) - 1, match.length)
            if match.length:
                self.cache.inc_lock(match.node)
                self.req_to_token.write(req.row, 0, match.slots)
                req.slots, req.cached, req.node = match.slots.tolist(), match.length, match.node
        self.reqs[rid] = req

    def extend(self, rid: int, tokens: list[int]) -> None:
        self.reqs[rid].tokens.extend(tokens)

    def finish(self, rid: int) -> None:
        req = self.reqs.pop(rid, None)
        if req is None:
            return
        own = req.slots[req.cached:]
        if self.cache is not None and own:
            # The accepted tokens' KV goes into the tree; it already held the first `have` of them, so the
            # request's own slots among those are duplicates and go back to the pool.
            have = self.cache.insert(req.tokens[: len(req.slots)], torch.tensor(req.slots, dtype=torch.int64))
            own = req.slots[req.cached : max(have, req.cached)]
        self.allocator.free_slots(own)
        if req.node is not None:
            self.cache.dec_lock(req.node)  # type: ignore[union-attr]
        self.req_to_token.free(req.row)

    def _make_room(self, tokens: int) -> None:
        """Evict the least recently used cached prefixes until ``tokens`` slots are free (or nothing is left to
        evict: the allocation after this then fails as it would without a cache)."""
        short = tokens - self.allocator.num_free_tokens
        if short > 0 and self.cache is not None:
            self.cache.evict(short)

    @torch.inference_mode()
    def propose(self, rids: list[int], max_tokens: int) -> list[DraftTree | None]:
        if not rids or max_tokens < 1:
            return [None] * len(rids)
        reqs = [self.reqs[rid] for rid in rids]
        logits = self._catch_up(reqs)  # [B, V]: the distribution after each request's last token
        if self.topk == 1:
            return self._chains(reqs, logits, min(self.num_steps, max_tokens))
        return self._trees(reqs, logits, max_tokens)

    # ------------------------------------------------------------------------------------------------ steps

    def _catch_up(self, reqs: list[_Draft]) -> torch.Tensor:
        """Compute the KV of every request's unseen tail in one extend step; return each one's last logits. A
        request with no unseen token (proposed twice in a row) recomputes its last one."""
        for req in reqs:
            if len(req.slots) == len(req.tokens):
                assert len(req.slots) > req.cached  # the cache never holds a request's last token
                self.allocator.free_slots(req.slots[-1:])
                del req.slots[-1:]
        self._make_room(sum(len(r.tokens) - len(r.slots) for r in reqs))
        ids, positions, new_slots, prefix, extend = [], [], [], [], []
        try:
            for req in reqs:
                start, end = len(req.slots), len(req.tokens)
                slots = self.allocator.alloc_tokens(start, req.slots[-1] if req.slots else 0, end - start).tolist()
                new_slots += slots
                prefix.append(start)
                self.req_to_token.write(req.row, start, torch.tensor(slots))
                ids += req.tokens[start:end]
                positions += range(start, end)
                extend.append(end - start)
            logits = self._forward(ForwardMode.EXTEND, [r.row for r in reqs], ids, positions, new_slots, prefix,
                                   extend)
        except Exception:
            # Out of draft KV, say: nothing of this step happened (no request claims a slot whose KV was not
            # written), and the caller decides what to do without drafts.
            self.allocator.free_slots(new_slots)
            raise
        for req, start in zip(reqs, prefix):
            req.slots.extend(new_slots[:len(req.tokens) - start])
            del new_slots[:len(req.tokens) - start]
        return logits

    def _forward(self, mode: ForwardMode, rows: list[int], ids: list[int], positions: list[int], slots: list[int],
                 prefix: list[int], extend: list[int]) -> torch.Tensor:
        """One forward pass of the draft over a flat batch whose KV slots are already in the page table: the
        logits [B, V] (float32) of each row's last token."""
        dev = self.device

        def t(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int64).to(dev)

        fb = ForwardBatch(mode=mode, input_ids=t(ids), positions=t(positions), extend_lens_cpu=extend,
                          prefix_lens_cpu=prefix, attn_backend=self.backend, req_pool_indices=t(rows),
                          out_cache_loc=t(slots), seq_lens=t([p + e for p, e in zip(prefix, extend)]),
                          last_token_indices=t(extend).cumsum(0) - 1)
        logits, _ = self.runner.forward(fb)
        return logits.float()

    def _decode(self, rows: list[int], tokens: list[int], positions: list[int]) -> tuple[torch.Tensor, list[int]]:
        """One draft token per row at the given positions (each row's earlier slots already in the table): fresh
        slots for them, the logits [B, V] after them, and the slots (the caller frees them)."""
        self._make_room(len(rows))
        slots = self.allocator.alloc_tokens(0, 0, len(rows)).tolist()  # page size 1: any free slots
        for row, pos, slot in zip(rows, positions, slots):
            self.req_to_token.write(row, pos, torch.tensor([slot]))
        logits = self._forward(ForwardMode.DECODE, rows, tokens, positions, slots, positions, [1] * len(rows))
        return logits, slots

    def _chains(self, reqs: list[_Draft], logits: torch.Tensor, n: int) -> list[DraftTree | None]:
        drafted: list[list[int]] = [[] for _ in reqs]
        dists: list[list[torch.Tensor]] = [[] for _ in reqs]
        scratch: list[int] = []  # the drafted tokens' slots: dropped at the end, whatever is accepted
        try:
            for step in range(n):
                if self.temperature > 0:
                    probs = torch.softmax(logits / self.temperature, dim=-1)
                    picked = torch.multinomial(probs, 1, generator=self.generator).squeeze(1).tolist()
                    for d, p in zip(dists, probs):
                        d.append(p)
                else:
                    picked = logits.argmax(dim=-1).tolist()
                for d, token in zip(drafted, picked):
                    d.append(token)
                if step == n - 1:
                    break
                # Feed the tokens just drafted: position len(tokens) + step in each request's own row.
                logits, slots = self._decode([r.row for r in reqs], picked, [len(r.tokens) + step for r in reqs])
                scratch += slots
        finally:
            self.allocator.free_slots(scratch)
        if self.temperature > 0:
            return [DraftTree.chain(d, torch.stack(p)) for d, p in zip(drafted, dists)]
        return [DraftTree.chain(d) for d in drafted]

    def _trees(self, reqs: list[_Draft], logits: torch.Tensor, max_tokens: int) -> list[DraftTree | None]:
        k = self.topk
        nodes: list[list[_Node]] = [[] for _ in reqs]
        frontier: list[list[int]] = [[] for _ in reqs]  # per request: indices of the nodes expanded next
        logp = torch.log_softmax(logits, dim=-1)
        top = logp.topk(k, dim=-1)
        for b in range(len(reqs)):
            for v, tok in zip(top.values[b].tolist(), top.indices[b].tolist()):
                frontier[b].append(len(nodes[b]))
                nodes[b].append(_Node(tok, -1, 1, v))
        branch_rows = [self.req_to_token.alloc() for _ in range(len(reqs) * k)]
        scratch: list[int] = []
        try:
            for _ in range(1, self.num_steps):
                rows, toks, positions, owners = [], [], [], []
                for b, req in enumerate(reqs):
                    base = len(req.tokens)
                    for j, i in enumerate(frontier[b]):
                        node, row = nodes[b][i], branch_rows[b * k + j]
                        parent_slots = nodes[b][node.parent].slots if node.parent >= 0 else []
                        self._copy_prefix(req, row, parent_slots)
                        rows.append(row)
                        toks.append(node.token)
                        positions.append(base + node.depth - 1)
                        owners.append((b, i))
                logits, slots = self._decode(rows, toks, positions)
                scratch += slots
                top = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
                candidates: list[list[int]] = [[] for _ in reqs]
                for r, ((b, i), slot) in enumerate(zip(owners, slots)):
                    node = nodes[b][i]
                    node.slots = (nodes[b][node.parent].slots if node.parent >= 0 else []) + [slot]
                    for v, tok in zip(top.values[r].tolist(), top.indices[r].tolist()):
                        candidates[b].append(len(nodes[b]))
                        nodes[b].append(_Node(tok, i, node.depth + 1, node.score + v))
                for b in range(len(reqs)):
                    best = sorted(candidates[b], key=lambda i: (-nodes[b][i].score, i))
                    frontier[b] = best[:k]
        finally:
            self.allocator.free_slots(scratch)
            for row in branch_rows:
                self.req_to_token.free(row)
        return [_best_tree(ns, max_tokens) for ns in nodes]

    def _copy_prefix(self, req: _Draft, row: int, path_slots: list[int]) -> None:
        """Point branch ``row`` at the request's KV and then at the slots of a drafted path below it."""
        n = len(req.slots)
        table = self.req_to_token
        table.host[row, :n] = table.host[req.row, :n]
        if table.table is not table.host:
            table.table[row, :n] = table.table[req.row, :n]
        if path_slots:
            table.write(row, n, torch.tensor(path_slots))


def _best_tree(nodes: list[_Node], max_tokens: int) -> DraftTree:
    """The ``max_tokens`` best-scored nodes as a tree in topological order. A child's score is its parent's plus a
    log probability (<= 0), and ties go to the shallower, earlier node, so every kept node's parent is kept."""
    keep = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].depth, i))[:max_tokens]
    keep.sort(key=lambda i: (nodes[i].depth, i))
    index = {old: new for new, old in enumerate(keep)}
    return DraftTree(tuple(nodes[i].token for i in keep),
                     tuple(index[nodes[i].parent] if nodes[i].parent >= 0 else -1 for i in keep))
