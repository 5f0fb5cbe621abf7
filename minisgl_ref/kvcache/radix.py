"""The radix cache: share the KV of common prefixes between requests (chapter 04).

Requests often begin the same way: a system prompt, a few-shot preamble, the earlier turns of a chat. Their KV
for that prefix is identical, so it should be computed once and kept. A radix tree keyed by token ids stores, for
every cached sequence, the KV slots of its tokens; edges hold runs of tokens, so a long shared prefix is one
edge, not thousands of nodes.

Four operations, each explained where it is defined:

* ``match_prefix``: the longest cached prefix of a new request (its KV need not be computed again);
* ``insert``: add a request's tokens and slots after they were computed;
* ``inc_lock`` / ``dec_lock``: a running request pins the path it uses, so eviction cannot take it away;
* ``evict``: free least-recently-used, unpinned leaves when the pool runs short.

Requests that carry a ``cache_salt`` get a tree of their own (a separate root per salt): two tenants can then never
share a prefix, so neither can learn from a fast first token which prompts the other has sent.

With ``page_size > 1`` everything happens in whole pages: a prefix is matched, stored and evicted only in
multiples of the page size, because the pool hands out memory by the page.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import torch

from minisgl_ref.kvcache.allocator import PageAllocator


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share.

    Prompts are thousands of tokens long and this runs for every waiting request at every step, so instead of a
    Python loop over tokens it compares slices (a C loop) and narrows the first mismatch down by bisection."""
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    if a[:n] == b[:n]:
        return n
    lo, hi = 1, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(eq=False)
class TreeNode:
    key: list[int] = field(default_factory=list)  # the token ids on the edge into this node
    value: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))  # their KV slots
    parent: TreeNode | None = None
    children: dict[object, TreeNode] = field(default_factory=dict)
    lock_ref: int = 0  # how many running requests pin this node (and so every ancestor)
    last_access: int = 0  # its tree's clock when it was last matched or inserted: LRU order for eviction

    def __lt__(self, other: TreeNode) -> bool:  # for the eviction heap: least recently used first
        return self.last_access < other.last_access


@dataclass
class MatchResult:
    slots: torch.Tensor  # KV slots of the matched prefix, int64 on the CPU
    node: TreeNode  # the deepest node of the match: lock it while the prefix is in use

    @property
    def length(self) -> int:
        return len(self.slots)


class RadixCache:
    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.root = TreeNode()
        self.root.lock_ref = 1  # the root is never evicted
        self.salted_roots: dict[str, TreeNode] = {}  # one more root per cache salt, dropped when it empties
        self.evictable_size = 0  # tokens in unlocked nodes
        self.protected_size = 0  # tokens in locked nodes
        self.hit_tokens = 0
        self.query_tokens = 0
        self._clock = itertools.count(1)  # this tree's LRU clock: ticks at every match or insertion of a node

    # -------------------------------------------------------------------------------------------- helpers

    def root_for(self, salt: str | None, *, create: bool = False) -> TreeNode | None:
        """The root under which requests with this salt share prefixes (``None``: the common one)."""
        if salt is None:
            return self.root
        if create and salt not in self.salted_roots:
            self.salted_roots[salt] = TreeNode(lock_ref=1)
        return self.salted_roots.get(salt)

    def _child_key(self, tokens: list[int]) -> object:
        return tokens[0] if self.page_size == 1 else tuple(tokens[: self.page_size])

    def _common_len(self, a: list[int], b: list[int]) -> int:
        """Length of the common prefix of a and b, rounded down to whole pages."""
        n = common_prefix_len(a, b)
        return n - n % self.page_size

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Cut ``child``'s edge after ``at`` tokens; return the new node that holds the first part."""
        parent = child.parent
        assert parent is not None and 0 < at < len(child.key)
        mid = TreeNode(key=child.key[:at], value=child.value[:at], parent=parent, lock_ref=child.lock_ref,
                       last_access=child.last_access)
        parent.children[self._child_key(mid.key)] = mid
        child.key, child.value, child.parent = child.key[at:], child.value[at:], mid
        mid.children[self._child_key(child.key)] = child
        return mid

    # ------------------------------------------------------------------------------------------ operations

    def match_prefix(self, tokens: list[int], salt: str | None = None) -> MatchResult:
        """The longest cached prefix of ``tokens``, in whole pages: its KV slots and the node where it ends.

        Walk down from ``root`` (the root of this cache salt, looked up above). At a node, the child to follow is
        ``node.children.get(self._child_key(rest))``, ``rest`` being the tokens not matched yet, and
        ``self._common_len(child.key, rest)`` says how many of them its edge holds, rounded down to whole pages.
        Stop where no child continues them, or where a child agrees on less than one page. Stamp every node the
        walk enters with ``last_access = next(self._clock)``: eviction (task 4.3) takes the least recently used
        leaves first, and a prefix just matched is about to be used.

        A match that ends inside an edge splits it there (``self._split(child, n)`` returns the new upper node),
        so that the node returned covers exactly the matched tokens: the caller locks that node while it uses the
        prefix, and must not pin tokens it does not use. Tokens beyond the last whole page of ``tokens`` are never
        matched. Return ``MatchResult(slots, node)``: ``slots`` is the ``value`` of every node on the path, in
        order, concatenated (int64 on the CPU; ``torch.empty(0, dtype=torch.int64)`` and ``root`` itself when
        nothing matches), so ``length`` is always a multiple of ``page_size``."""
        root = self.root_for(salt)
        if root is None:  # a salt nobody has cached anything under yet
            return MatchResult(torch.empty(0, dtype=torch.int64), self.root)
        # BEGIN TASK 4.1: longest cached prefix
        tokens = tokens[: len(tokens) - len(tokens) % self.page_size]
        node, pieces, i = root, [], 0
        while i < len(tokens):
            child = node.children.get(self._child_key(tokens[i:]))
            if child is None:
                break
            n = self._common_len(child.key, tokens[i:])
            if n == 0:
                break
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = next(self._clock)
            pieces.append(child.value)
            node, i = child, i + n
        slots = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64)
        return MatchResult(slots, node)
        # END TASK 4.1

    def peek_prefix_len(self, tokens: list[int], salt: str | None = None) -> int:
        """How many leading tokens :meth:`match_prefix` would find, without changing the tree: no edge is split
        and no LRU clock moves, so sorting a queue by it does not refresh prefixes nobody uses yet."""
        tokens = tokens[: len(tokens) - len(tokens) % self.page_size]
        node, i = self.root_for(salt), 0
        while node is not None and i < len(tokens):
            child = node.children.get(self._child_key(tokens[i:]))
            n = self._common_len(child.key, tokens[i:]) if child is not None else 0
            i += n
            node = child if child is not None and n == len(child.key) else None
        return i

    def insert(self, tokens: list[int], slots: torch.Tensor, salt: str | None = None) -> int:
        """Store ``tokens`` with their KV ``slots`` (``slots[j]`` holds token ``j``'s KV); return how many leading
        tokens (whole pages) the tree already had.

        Only whole pages go in: leave out the last ``len(tokens) % page_size`` tokens and their slots (that
        partial page stays the caller's). Walk down from ``root`` (looked up above) as :meth:`match_prefix` does,
        splitting an edge where the tokens part from it (at a page boundary: ``self._common_len``) and stamping
        every node the walk enters with ``last_access = next(self._clock)``. Where no child continues the tokens,
        hang all the rest below the current node as one new leaf: key the remaining tokens, value their slots
        (int64 on the CPU, a copy rather than a view of the caller's tensor), ``parent`` the current node, a fresh
        clock stamp, registered in ``node.children`` under ``self._child_key(key)``. A new node is unlocked, so its
        length goes into ``evictable_size``. Return the number of tokens walked before that leaf; if the whole
        (page-rounded) sequence was cached already, its length.

        The return value is how the caller avoids keeping the same KV twice: the tree keeps its own slots for
        tokens it already had, so the caller's slots for those first tokens are duplicates, which the caller
        frees (``CacheManager.commit``)."""
        root = self.root_for(salt, create=len(tokens) >= self.page_size)
        if root is None:  # nothing to store (less than a page) under a salt nobody has used yet
            return 0
        # BEGIN TASK 4.2: insert a computed sequence
        n_tok = len(tokens) - len(tokens) % self.page_size
        tokens, slots = tokens[:n_tok], slots[:n_tok].to(torch.int64).cpu()
        node, i = root, 0
        while i < n_tok:
            key = self._child_key(tokens[i:])
            child = node.children.get(key)
            if child is None:
                leaf = TreeNode(key=tokens[i:], value=slots[i:].clone(), parent=node,
                                last_access=next(self._clock))
                node.children[key] = leaf
                self.evictable_size += len(leaf.key)
                return i
            n = self._common_len(child.key, tokens[i:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = next(self._clock)
            node, i = child, i + n
        return n_tok
        # END TASK 4.2

    def inc_lock(self, node: TreeNode) -> None:
        """Pin ``node`` and its ancestors: a running request's prefix must stay in memory.

        A request reads its whole cached prefix at every step, so no node on that path may be evicted while it
        runs, and several requests may share a node. ``lock_ref`` counts the requests pinning a node (a count, not
        a flag, so one request finishing cannot unpin another's prefix). The tree also keeps two totals the
        scheduler budgets with: ``evictable_size`` (tokens eviction could give back) and ``protected_size``
        (tokens pinned); a node's tokens belong to exactly one of them, and change sides only when a node goes
        from unpinned to pinned. Roots (``parent`` is None) hold no tokens and are never counted."""
        # BEGIN TASK 4.3: locking and LRU eviction
        while node.parent is not None:  # up to its root
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]
        # END TASK 4.3

    def dec_lock(self, node: TreeNode) -> None:
        """Undo one :meth:`inc_lock` of ``node``: the request that pinned this path no longer uses it.

        The mirror of :meth:`inc_lock`, along the same path: a node becomes evictable again only when the last
        request pinning it lets go. Unlocking more often than locking is a bug in the caller that would let the
        two totals drift until eviction frees KV a running request still reads, so it raises ``RuntimeError``
        instead of being absorbed."""
        # BEGIN TASK 4.3: locking and LRU eviction
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise RuntimeError("radix node unlocked more often than locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.protected_size -= len(node.key)
                self.evictable_size += len(node.key)
            node = node.parent  # type: ignore[assignment]
        # END TASK 4.3

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` tokens of KV from unpinned leaves, least recently used first (fewer if the
        tree has no more to give). Returns how many were freed: leaves go whole, so it may be more than asked.

        Only a leaf can go: an inner node's tokens are the prefix of its children's, which would be left without
        their start. Only an unpinned leaf can go: a pinned one is read by a running request. Among those, the
        one touched longest ago (``last_access``; ``TreeNode`` orders by it, so ``heapq`` works on nodes) is the
        one least likely to be matched again. Removing a leaf can turn its parent into a leaf, which then
        competes like any other; a salted root left with no children is forgotten
        (``self._drop_salted_root``). The slots go back with ``self.allocator.free_slots``, and the totals of
        :meth:`inc_lock` must still add up afterwards."""
        # BEGIN TASK 4.3: locking and LRU eviction
        heap = [n for n in self._all_nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            self.allocator.free_slots(leaf.value)
            del parent.children[self._child_key(leaf.key)]
            self.evictable_size -= len(leaf.key)
            freed += len(leaf.key)
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
            elif parent.parent is None and not parent.children:
                self._drop_salted_root(parent)
        return freed
        # END TASK 4.3

    # ------------------------------------------------------------------------------------------ bookkeeping

    def _drop_salted_root(self, root: TreeNode) -> None:
        for salt, node in list(self.salted_roots.items()):
            if node is root:
                del self.salted_roots[salt]

    def _all_nodes(self) -> list[TreeNode]:
        roots = [self.root, *self.salted_roots.values()]
        out, stack = [], [child for root in roots for child in root.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    @property
    def total_size(self) -> int:
        return sum(len(n.key) for n in self._all_nodes())

    def record_lookup(self, query: int, hit: int) -> None:
        self.query_tokens += query
        self.hit_tokens += hit

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def flush(self) -> None:
        """Drop every cached prefix. Only allowed when no request pins anything (the server's /flush_cache)."""
        if self.protected_size:
            raise RuntimeError("cannot flush the radix cache while running requests pin part of it")
        for node in self._all_nodes():
            self.allocator.free_slots(node.value)
        self.root.children.clear()
        self.salted_roots.clear()
        self.evictable_size = 0
        self.hit_tokens = self.query_tokens = 0

    def pretty(self, max_tokens: int = 8) -> str:
        """A text drawing of the tree, for chapters and debugging."""
        lines: list[str] = []

        def walk(node: TreeNode, depth: int) -> None:
            for child in sorted(node.children.values(), key=lambda n: n.key):
                shown = child.key[:max_tokens]
                more = "..." if len(child.key) > max_tokens else ""
                lines.append(f"{'  ' * depth}{shown}{more} ({len(child.key)} tok, lock={child.lock_ref})")
                walk(child, depth + 1)

        walk(self.root, 0)
        return "\n".join(lines) or "(empty)"
