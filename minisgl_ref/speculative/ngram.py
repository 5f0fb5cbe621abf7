"""Prompt lookup: guess the continuation of a request from what followed the same words earlier in it (chapter 13).

Much of what a model writes repeats its context: code being edited, a quoted document, names, the answer's own
earlier sentences. If the last few tokens of a request occurred before, whatever followed them then is a good
guess for what follows now, and finding it costs no model at all. This is SGLang's ``NGRAM`` algorithm (called
prompt lookup, or lookahead, elsewhere), per request.

**The index.** Each request keeps a trie of every n-gram of its own tokens (prompt and output) up to
``max_match_window_size + branch_length`` tokens long: the node reached by the path ``a b c`` counts how often
``a b c`` occurred and when it last ended. A token appended at position ``p`` extends the n-grams that end at
``p - 1`` by one token each: the index keeps the trie nodes of those at most ``L = max_window + branch_length``
open n-grams, moves each one step down (creating the child or bumping its count) and opens a new one at the root.
So one appended token costs exactly ``L`` node visits (fewer near the start), whatever the request's length, and
the index is never rebuilt: ``start`` with ``n`` tokens is ``n`` appends, ``extend`` with ``k`` tokens is ``k``.
The trie holds at most ``n * L`` nodes for ``n`` tokens (SGLang bounds one shared trie by a capacity instead;
here a request's index dies with it).

**The match.** The last ``w`` tokens of the request, for ``w`` from ``max_match_window_size`` down to
``min_match_window_size``, are looked up in the trie; the longest suffix whose node has children (it occurred
before, and something followed it) wins. Its subtree *is* the draft tree: each child is a token seen right after
the suffix, each grandchild one seen after that, and so on.

**The tree.** Nodes are chosen best-first from the matched node down, a node being eligible once its parent is
chosen, until ``max_tokens`` nodes are chosen. ``match_type="BFS"`` (SGLang's default) takes nodes level by level,
at most ``breadth`` children per node, the most frequent first (then the most recent, then the smaller token id:
deterministic), where ``breadth`` shrinks linearly from ``max_bfs_breadth`` for a match of the shortest window to
``min_bfs_breadth`` for one of the longest (a long match is a confident one, so its budget goes to depth, not
width). ``match_type="PROB"`` ranks every eligible node by its empirical path probability (the product of
``count(child) / count(parent)`` along the path), so a branch the text took once in ten loses to a deep chain it
always took. Either way the tree is deterministic (``probs`` is None: the acceptance rule treats each node as a
point mass).

**What it buys.** Replaying the embedded SmolLM2-135M's greedy output offline (``scripts/spec_accept_rates.py``,
``docs/data/spec_accept_cpu.json``), the default tree of at most 8 nodes yields 3.25 tokens per verify step on
prompts that ask to repeat or edit a paragraph (6.4 when the answer is a verbatim copy) and 1.30 on chat; a chain of
4 yields 2.49 and 1.23. The lookup itself costs microseconds per request.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from minisgl_ref.speculative.tree import DraftTree

#: SGLang's defaults (``--speculative-ngram-*``).
DEFAULT_MIN_MATCH_WINDOW = 1
DEFAULT_MAX_MATCH_WINDOW = 12
DEFAULT_MIN_BFS_BREADTH = 1
DEFAULT_MAX_BFS_BREADTH = 10
DEFAULT_BRANCH_LENGTH = 18
MATCH_TYPES = ("BFS", "PROB")


class _Node:
    """One n-gram of the trie: how often it occurred, the position its last occurrence ended at, what followed."""

    __slots__ = ("children", "count", "last")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0
        self.last = -1


class NgramIndex:
    """The trie of one token sequence's n-grams up to ``depth`` tokens, grown one token at a time.

    ``work`` counts node visits made by :meth:`append` since the index was built: ``depth`` per token at most,
    which is what keeps an extend's cost independent of the sequence's length."""

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"an n-gram index needs depth >= 1, got {depth}")
        self.depth = depth
        self.root = _Node()
        self.tokens: list[int] = []
        self._open: list[_Node] = []  # the nodes of the n-grams ending at the last token, longest first
        self.work = 0

    def append(self, tokens: list[int]) -> None:
        for t in tokens:
            pos = len(self.tokens)
            self.tokens.append(t)
            grown: list[_Node] = []
            # The longest open n-gram already has `depth` tokens: it cannot grow, so it closes.
            for node in self._open[-(self.depth - 1):] if self.depth > 1 else []:
                grown.append(self._step(node, t, pos))
            grown.append(self._step(self.root, t, pos))
            self._open = grown

    def _step(self, node: _Node, token: int, pos: int) -> _Node:
        self.work += 1
        child = node.children.get(token)
        if child is None:
            child = node.children[token] = _Node()
        child.count += 1
        child.last = pos
        return child

    def find(self, suffix: list[int]) -> _Node | None:
        """The node of the n-gram ``suffix`` (None if it never occurred, or is longer than ``depth``)."""
        node: _Node | None = self.root
        for t in suffix:
            node = node.children.get(t) if node is not None else None
        return node

    def snapshot(self) -> tuple:
        """The whole trie as nested tuples ``((token, count, last, children), ...)``, sorted by token: equal for
        two indexes exactly when they hold the same n-grams with the same counts and positions."""

        def walk(node: _Node) -> tuple:
            return tuple((t, c.count, c.last, walk(c)) for t, c in sorted(node.children.items()))

        return walk(self.root)


def _rank(item: tuple[int, _Node]) -> tuple[int, int, int]:
    """Children in draft order: most frequent, then most recent, then the smaller token id."""
    token, node = item
    return (-node.count, -node.last, token)


@dataclass(frozen=True)
class NgramSettings:
    """The n-gram proposer's knobs, named after SGLang's ``--speculative-ngram-*`` flags."""

    min_match_window_size: int = DEFAULT_MIN_MATCH_WINDOW
    max_match_window_size: int = DEFAULT_MAX_MATCH_WINDOW
    min_bfs_breadth: int = DEFAULT_MIN_BFS_BREADTH
    max_bfs_breadth: int = DEFAULT_MAX_BFS_BREADTH
    branch_length: int = DEFAULT_BRANCH_LENGTH  #: the deepest a draft goes below the matched suffix
    match_type: str = "BFS"

    def __post_init__(self) -> None:
        if not 1 <= self.min_match_window_size <= self.max_match_window_size:
            raise ValueError(f"speculative_ngram_min_match_window_size must be between 1 and "
                             f"speculative_ngram_max_match_window_size ({self.max_match_window_size}), got "
                             f"{self.min_match_window_size}")
        if not 1 <= self.min_bfs_breadth <= self.max_bfs_breadth:
            raise ValueError(f"speculative_ngram_min_bfs_breadth must be between 1 and "
                             f"speculative_ngram_max_bfs_breadth ({self.max_bfs_breadth}), got {self.min_bfs_breadth}")
        if self.branch_length < 1:
            raise ValueError(f"speculative_ngram_branch_length must be >= 1, got {self.branch_length}")
        if self.match_type not in MATCH_TYPES:
            raise ValueError(f"speculative_ngram_match_type must be one of {MATCH_TYPES}, got {self.match_type!r}")

    @property
    def depth(self) -> int:
        """The longest n-gram the index keeps: a full window plus a full branch below it."""
        return self.max_match_window_size + self.branch_length

    def breadth(self, window: int) -> int:
        """Children per node in a BFS draft after a match of ``window`` tokens: ``max_bfs_breadth`` for the
        shortest window, shrinking linearly to ``min_bfs_breadth`` for the longest."""
        span = self.max_match_window_size - self.min_match_window_size
        if span == 0:
            return self.max_bfs_breadth
        shrink = (self.max_bfs_breadth - self.min_bfs_breadth) * (window - self.min_match_window_size) / span
        return max(self.min_bfs_breadth, round(self.max_bfs_breadth - shrink))


class NgramProposer:
    """A :class:`~minisgl_ref.speculative.proposer.Proposer` that looks each request's continuation up in its own
    tokens (see the module docstring). Pure Python, no device work: ``propose`` costs at most
    ``max_match_window_size`` trie lookups plus ``O(max_tokens * log)`` for the tree, per request."""

    def __init__(self, settings: NgramSettings = NgramSettings()) -> None:
        self.settings = settings
        self.indexes: dict[int, NgramIndex] = {}

    def start(self, rid: int, tokens: list[int]) -> None:
        index = NgramIndex(self.settings.depth)
        index.append(list(tokens))
        self.indexes[rid] = index

    def extend(self, rid: int, tokens: list[int]) -> None:
        self.indexes[rid].append(list(tokens))

    def finish(self, rid: int) -> None:
        self.indexes.pop(rid, None)

    def propose(self, rids: list[int], max_tokens: int) -> list[DraftTree | None]:
        return [self.propose_one(self.indexes[rid], max_tokens) for rid in rids]

    def match(self, index: NgramIndex) -> tuple[int, _Node] | None:
        """The longest suffix window (within the settings' bounds) seen before with a continuation: (its length,
        its trie node), or None."""
        s, tokens = self.settings, index.tokens
        for w in range(min(s.max_match_window_size, len(tokens)), s.min_match_window_size - 1, -1):
            node = index.find(tokens[len(tokens) - w:])
            if node is not None and node.children:
                return w, node
        return None

    def propose_one(self, index: NgramIndex, max_tokens: int) -> DraftTree | None:
        """The draft tree after ``index``'s last token, at most ``max_tokens`` nodes (None: no match)."""
        found = self.match(index) if max_tokens > 0 else None
        if found is None:
            return None
        window, matched = found
        s = self.settings
        prob = s.match_type == "PROB"
        breadth = s.breadth(window) if not prob else None
        tokens: list[int] = []
        parents: list[int] = []
        # Eligible nodes, best first. Keys: BFS (depth, parent's node index, rank among siblings): level order,
        # each parent's children in draft order; PROB (-path probability, depth, the same tie-breakers).
        heap: list[tuple] = []
        order = 0  # insertion counter: a total order, so no two keys tie and nodes are never compared

        def push_children(parent_idx: int, node: _Node, depth: int, path_p: float) -> None:
            nonlocal order
            if depth > s.branch_length:
                return
            ranked = sorted(node.children.items(), key=_rank)
            if breadth is not None:
                ranked = ranked[:breadth]
            total = sum(c.count for c in node.children.values())
            for token, child in ranked:
                p = path_p * child.count / total  # how often the text went this way, among the ways it went
                key = (-p, depth, order) if prob else (depth, order)
                heapq.heappush(heap, (key, token, parent_idx, child, p))
                order += 1

        push_children(-1, matched, 1, 1.0)
        while heap and len(tokens) < max_tokens:
            key, token, parent_idx, node, p = heapq.heappop(heap)
            tokens.append(token)
            parents.append(parent_idx)
            depth = (key[1] if prob else key[0]) + 1
            push_children(len(tokens) - 1, node, depth, p)
        return DraftTree(tuple(tokens), tuple(parents))
