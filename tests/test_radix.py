"""The radix cache (chapter 04), one task at a time: match, insert, locking and eviction, commit, in-batch deferral.

The tree tests build small trees *by hand* (``hang``): every node's tokens, slots and last-used time are written
down in the test, so a check of ``match_prefix`` does not depend on ``insert`` and a check of eviction order does
not depend on either. The tree's own clock starts at 1000 (``make_tree``), so any time the code under test stamps
is later than every time a test wrote. ``check_tree`` asserts the bookkeeping every operation must leave behind:
parent and child links, whole pages, lock counts, the two size counters, and no slot both in the tree and free.

The cache-manager tests drive ``CacheManager`` the way the scheduler and the engine do, without a model: a
request is matched, gets slots for the rest of its prompt (its KV "computed"), and is committed and released. The
engine tests run the tiny model with the radix cache on, overlap off and no chunking: they compare its greedy
tokens with the chapter-00 oracle, and the K and V it reuses from the tree with those a fresh prefill computes.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minisgl_ref import SamplingParams
from minisgl_ref.core.config import EngineConfig
from minisgl_ref.core.request import Req
from minisgl_ref.kvcache import PageAllocator, ReqToTokenPool
from minisgl_ref.kvcache.radix import RadixCache, TreeNode
from minisgl_ref.scheduler.cache_manager import CacheManager
from minisgl_ref.scheduler.scheduler import Scheduler
from tests.engine_fixtures import (
    assert_matches_oracle,
    assert_pool_accounting,
    drive,
    make_engine,
    make_reqs,
    oracle,
    tiny_engine_path,  # noqa: F401  (fixture)
    tiny_llm,  # noqa: F401  (fixture)
)

# ------------------------------------------------------------------------------------------------ helpers


def make_tree(page_size: int = 1, num_pages: int = 64) -> RadixCache:
    tree = RadixCache(PageAllocator(num_pages, page_size))
    tree._clock = itertools.count(1000)  # later than every last_access a test sets by hand
    return tree


def take(alloc: PageAllocator, n: int) -> torch.Tensor:
    """Slots for ``n`` tokens on fresh pages (what a prefill of ``n`` tokens from a page boundary is given)."""
    ps = alloc.page_size
    pages = alloc.alloc_pages(-(-n // ps))
    return torch.tensor([p * ps + i for p in pages for i in range(ps)][:n], dtype=torch.int64)


def hang(tree: RadixCache, parent: TreeNode, key: list[int], t: int) -> TreeNode:
    """Add an unlocked node below ``parent`` by hand (no ``insert``): tokens ``key``, fresh slots, last used at
    time ``t``."""
    node = TreeNode(key=list(key), value=take(tree.allocator, len(key)), parent=parent, last_access=t)
    parent.children[tree._child_key(node.key)] = node
    tree.evictable_size += len(node.key)
    return node


def shape(node: TreeNode) -> list:
    """The tree below ``node`` as nested ``(edge tokens, [children])``, children in token order."""
    return sorted((tuple(c.key), shape(c)) for c in node.children.values())


def path_tokens(node: TreeNode) -> list[int]:
    keys = []
    while node.parent is not None:
        keys.append(node.key)
        node = node.parent
    return [t for key in reversed(keys) for t in key]


def path_slots(node: TreeNode) -> list[int]:
    values = []
    while node.parent is not None:
        values.append(node.value.tolist())
        node = node.parent
    return [s for v in reversed(values) for s in v]


def node_at(tree: RadixCache, tokens: list[int], salt: str | None = None) -> TreeNode:
    """The node whose path spells exactly ``tokens`` (found by walking, without touching the tree)."""
    node, i = tree.root_for(salt), 0
    while i < len(tokens):
        node = node.children[tree._child_key(tokens[i:])]
        assert tokens[i : i + len(node.key)] == node.key, "no node ends exactly there"
        i += len(node.key)
    return node


def check_tree(tree: RadixCache) -> None:
    """The bookkeeping every operation must leave behind."""
    ps = tree.page_size
    nodes = tree._all_nodes()
    for node in [tree.root, *tree.salted_roots.values(), *nodes]:
        for key, child in node.children.items():
            assert child.parent is node, "a child's parent link is wrong"
            assert key == tree._child_key(child.key), "a child is filed under the wrong key"
            assert len(child.key) == len(child.value) > 0 and len(child.key) % ps == 0, \
                f"edge {child.key} has {len(child.value)} slots (page size {ps})"
            assert child.value.dtype == torch.int64
        if node.parent is not None:
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), \
                "a child is pinned more often than its parent: every lock pins the whole path"
    assert tree.protected_size == sum(len(n.key) for n in nodes if n.lock_ref > 0), "protected_size is off"
    assert tree.evictable_size == sum(len(n.key) for n in nodes if n.lock_ref == 0), "evictable_size is off"
    pages = [p for n in nodes for p in sorted(set((n.value // ps).tolist()))]
    assert len(pages) == len(set(pages)), "two nodes hold the same page"
    assert not set(pages) & set(tree.allocator._free), "a page is in the tree and free at once"


# ------------------------------------------------------------------------------------------------ 4.1 match


@pytest.mark.task("4.1")
def test_match_follows_whole_edges_and_joins_their_slots():
    """[1 2 3] -> {[4 5], [6]}, [7 7]: a match walks edge after edge and returns the slots of every edge on its
    path, in order, and the deepest node; nothing cached gives an empty int64 tensor and the root."""
    tree = make_tree()
    a = hang(tree, tree.root, [1, 2, 3], t=1)
    b = hang(tree, a, [4, 5], t=2)
    c = hang(tree, a, [6], t=3)
    hang(tree, tree.root, [7, 7], t=4)
    before = shape(tree.root)

    m = tree.match_prefix([1, 2, 3, 4, 5, 9])
    assert (m.length, m.node) == (5, b)
    assert m.slots.dtype == torch.int64 and m.slots.tolist() == a.value.tolist() + b.value.tolist()
    m = tree.match_prefix([1, 2, 3, 6])
    assert (m.length, m.node) == (4, c) and m.slots.tolist() == a.value.tolist() + c.value.tolist()
    m = tree.match_prefix([1, 2, 3])
    assert (m.length, m.node) == (3, a) and m.slots.tolist() == a.value.tolist()
    for miss in ([9, 1, 2], [], [4, 5]):
        m = tree.match_prefix(miss)
        assert (m.length, m.node) == (0, tree.root), miss
        assert m.slots.dtype == torch.int64 and m.slots.numel() == 0
    assert shape(tree.root) == before, "matches that end at a node's end split nothing"
    check_tree(tree)


@pytest.mark.task("4.1")
def test_match_that_ends_inside_an_edge_splits_it():
    """[1 2 3 4 5 6] -> [7 8]. Matching [1 2 3 9] ends three tokens into the edge: the edge is split there, and
    the node returned covers exactly [1 2 3] (a request locks it; it must not pin [4 5 6], which it does not
    use). The slots stay where they were, cut in two; the sizes do not change."""
    tree = make_tree()
    a = hang(tree, tree.root, [1, 2, 3, 4, 5, 6], t=1)
    hang(tree, a, [7, 8], t=2)
    slots = a.value.tolist()

    m = tree.match_prefix([1, 2, 3, 9])
    assert m.length == 3 and m.slots.tolist() == slots[:3]
    assert m.node.key == [1, 2, 3] and m.node.value.tolist() == slots[:3], "the node must end where the match ends"
    assert m.node.parent is tree.root and list(m.node.children.values()) == [a]
    assert a.key == [4, 5, 6] and a.value.tolist() == slots[3:] and a.parent is m.node
    assert shape(tree.root) == [((1, 2, 3), [((4, 5, 6), [((7, 8), [])])])]
    assert tree.evictable_size == tree.total_size == 8
    check_tree(tree)

    again = tree.match_prefix([1, 2, 3, 9])
    assert again.node is m.node and shape(tree.root) == [((1, 2, 3), [((4, 5, 6), [((7, 8), [])])])]
    m = tree.match_prefix([1, 2])
    assert m.node.key == [1, 2] and shape(tree.root) == [((1, 2), [((3,), [((4, 5, 6), [((7, 8), [])])])])]
    check_tree(tree)


@pytest.mark.task("4.1")
def test_match_stamps_every_node_it_enters():
    """Eviction takes the least recently used leaves first, so a match must refresh ``last_access`` on its whole
    path (and only there), the node a split creates included."""
    tree = make_tree()
    a = hang(tree, tree.root, [1, 2], t=1)
    b = hang(tree, a, [3, 4], t=2)
    c = hang(tree, a, [5], t=3)
    d = hang(tree, tree.root, [6], t=4)

    tree.match_prefix([1, 2, 3, 4, 9])
    assert a.last_access > 4 and b.last_access > 4, "the matched path was not marked as used"
    assert (c.last_access, d.last_access) == (3, 4), "a node off the matched path was marked as used"
    tree.match_prefix([1, 2, 5])
    assert c.last_access > b.last_access and a.last_access > b.last_access
    m = tree.match_prefix([1, 2, 3, 8])  # ends inside [3 4]
    assert m.node.key == [3] and m.node.last_access > c.last_access, "the node of a split is on the path too"


@pytest.mark.task("4.1")
def test_match_counts_whole_pages_only():
    """Page size 4, one edge of three pages. Six agreeing tokens match one page (4), ten match two (8), three
    match nothing (and split nothing): a matched length is always a whole number of pages, since a page has one
    owner. Tokens past the query's last whole page are never matched."""
    tree = make_tree(page_size=4)
    seq = list(range(100, 112))
    a = hang(tree, tree.root, seq, t=1)
    slots = a.value.tolist()

    m = tree.match_prefix([100, 101, 102, 0, 0, 0, 0, 0])
    assert (m.length, m.node) == (0, tree.root) and shape(tree.root) == [(tuple(seq), [])]
    m = tree.match_prefix(seq[:6] + [0, 0])
    assert m.length == 4 and m.slots.tolist() == slots[:4] and m.node.key == seq[:4]
    m = tree.match_prefix(seq[:10])
    assert m.length == 8 and m.slots.tolist() == slots[:8] and m.node.key == seq[4:8]
    m = tree.match_prefix(seq + [1, 2])
    assert m.length == 12 and m.slots.tolist() == slots and m.node.key == seq[8:]
    assert shape(tree.root) == [(tuple(seq[:4]), [(tuple(seq[4:8]), [(tuple(seq[8:]), [])])])]
    check_tree(tree)


@pytest.mark.task("4.1")
def test_match_looks_only_below_the_salts_root():
    """Requests with a cache salt share prefixes only with the same salt: each salt has a root of its own."""
    tree = make_tree()
    salted = tree.root_for("tenant-a", create=True)
    x = hang(tree, salted, [1, 2, 3], t=1)
    y = hang(tree, tree.root, [1, 2], t=2)
    m = tree.match_prefix([1, 2, 3, 4], salt="tenant-a")
    assert (m.length, m.node) == (3, x) and m.slots.tolist() == x.value.tolist()
    m = tree.match_prefix([1, 2, 3, 4])
    assert (m.length, m.node) == (2, y)
    m = tree.match_prefix([1, 2, 3, 4], salt="tenant-b")
    assert (m.length, m.node) == (0, tree.root)


# ------------------------------------------------------------------------------------------------ 4.2 insert


@pytest.mark.task("4.2")
def test_insert_into_an_empty_tree_makes_one_leaf():
    tree = make_tree()
    slots = take(tree.allocator, 6)
    assert tree.insert([1, 2, 3, 4, 5, 6], slots) == 0, "nothing was cached before"
    assert shape(tree.root) == [((1, 2, 3, 4, 5, 6), [])]
    leaf = node_at(tree, [1, 2, 3, 4, 5, 6])
    assert leaf.value.tolist() == slots.tolist() and leaf.value.dtype == torch.int64
    assert (tree.evictable_size, tree.protected_size) == (6, 0), "a new node's tokens are evictable"
    check_tree(tree)


@pytest.mark.task("4.2")
def test_insert_splits_where_the_tokens_part_and_returns_the_cached_length():
    """The example of section 2: [1 2 3 4 5 6], then [1 2 3 7 8] splits the edge after 3 tokens and returns 3
    (the caller's slots for [1 2 3] are duplicates); then [1 2 9 9] splits [1 2 3] and returns 2."""
    tree = make_tree()
    s1, s2, s3 = (take(tree.allocator, n) for n in (6, 5, 4))
    assert tree.insert([1, 2, 3, 4, 5, 6], s1) == 0
    assert tree.insert([1, 2, 3, 7, 8], s2) == 3
    assert shape(tree.root) == [((1, 2, 3), [((4, 5, 6), []), ((7, 8), [])])]
    assert node_at(tree, [1, 2, 3]).value.tolist() == s1[:3].tolist(), "the tree keeps its own copy"
    assert node_at(tree, [1, 2, 3, 4, 5, 6]).value.tolist() == s1[3:].tolist()
    assert node_at(tree, [1, 2, 3, 7, 8]).value.tolist() == s2[3:].tolist()
    assert tree.evictable_size == 8
    check_tree(tree)
    tree.allocator.free_slots(s2[:3])  # what the caller does with the duplicates

    assert tree.insert([1, 2, 9, 9], s3) == 2
    assert shape(tree.root) == [((1, 2), [((3,), [((4, 5, 6), []), ((7, 8), [])]), ((9, 9), [])])]
    assert node_at(tree, [1, 2, 9, 9]).value.tolist() == s3[2:].tolist()
    assert tree.evictable_size == 10
    tree.allocator.free_slots(s3[:2])
    check_tree(tree)


@pytest.mark.task("4.2")
def test_insert_of_a_cached_sequence_reuses_it():
    """Inserting what the tree already holds adds nothing and returns the whole length: every slot the caller
    passed is a duplicate. A cached prefix of a longer edge is split off, not stored again."""
    tree = make_tree()
    s1 = take(tree.allocator, 6)
    tree.insert([1, 2, 3, 4, 5, 6], s1)
    again = take(tree.allocator, 6)
    assert tree.insert([1, 2, 3, 4, 5, 6], again) == 6, "the tree already had all six tokens"
    assert shape(tree.root) == [((1, 2, 3, 4, 5, 6), [])] and path_slots(node_at(tree, [1, 2, 3, 4, 5, 6])) == \
        s1.tolist(), "the tree must keep its own slots, not take the duplicates"
    assert tree.insert([1, 2, 3, 4], again[:4]) == 4
    assert shape(tree.root) == [((1, 2, 3, 4), [((5, 6), [])])]
    assert tree.insert([], again[:0]) == 0
    assert tree.evictable_size == tree.total_size == 6
    tree.allocator.free_slots(again)
    check_tree(tree)


@pytest.mark.task("4.2")
def test_insert_stores_and_splits_in_whole_pages():
    """Page size 4: 10 tokens store two pages (the half page stays the caller's); a sequence that agrees with
    them for 6 tokens splits the edge after one page (4), not 6, and its new leaf starts there."""
    tree = make_tree(page_size=4)
    seq = list(range(100, 110))
    slots = take(tree.allocator, 10)
    assert tree.insert(seq, slots) == 0
    assert shape(tree.root) == [(tuple(seq[:8]), [])]
    assert node_at(tree, seq[:8]).value.tolist() == slots[:8].tolist()
    assert tree.evictable_size == 8
    tree.allocator.free_slots(slots[8:])

    other = seq[:6] + [0] * 6
    s2 = take(tree.allocator, 12)
    assert tree.insert(other, s2) == 4
    assert shape(tree.root) == [(tuple(seq[:4]), [((104, 105, 0, 0, 0, 0, 0, 0), []), (tuple(seq[4:8]), [])])]
    assert node_at(tree, other).value.tolist() == s2[4:].tolist()
    assert tree.evictable_size == 16
    tree.allocator.free_slots(s2[:4])
    check_tree(tree)


@pytest.mark.task("4.2")
def test_insert_stamps_the_path_it_walks():
    """A sequence just computed is the most recently used: every node its insertion passes through, and its new
    leaf, get a later ``last_access`` than the nodes it does not touch."""
    tree = make_tree()
    tree.insert([1, 2, 3], take(tree.allocator, 3))
    tree.insert([4, 5], take(tree.allocator, 2))
    first, second = node_at(tree, [1, 2, 3]), node_at(tree, [4, 5])
    assert first.last_access < second.last_access
    s = take(tree.allocator, 4)
    assert tree.insert([1, 2, 3, 6], s) == 3
    tree.allocator.free_slots(s[:3])
    assert first.last_access > second.last_access, "the cached prefix an insertion walked was not marked as used"
    assert node_at(tree, [1, 2, 3, 6]).last_access > second.last_access


@pytest.mark.task("4.2")
def test_insert_under_a_salt_shares_only_with_that_salt():
    tree = make_tree()
    assert tree.insert([1, 2, 3], take(tree.allocator, 3), salt="a") == 0
    assert tree.insert([1, 2, 3], take(tree.allocator, 3), salt="b") == 0
    assert tree.insert([1, 2, 3], take(tree.allocator, 3)) == 0
    dup = take(tree.allocator, 3)
    assert tree.insert([1, 2, 3], dup, salt="a") == 3
    tree.allocator.free_slots(dup)
    assert sorted(tree.salted_roots) == ["a", "b"]
    assert all(shape(r) == [((1, 2, 3), [])] for r in [tree.root, *tree.salted_roots.values()])
    check_tree(tree)


# ------------------------------------------------------------------------------------------------ 4.3 locks, eviction


@pytest.mark.task("4.3", weight=3)
def test_locks_pin_the_whole_path_and_move_the_sizes():
    """[1 2] -> [3] -> [4 5], and [1 2] -> [6]. A lock pins its node and every ancestor; a node counts once in
    protected_size however many requests pin it; unlocking walks the same path back."""
    tree = make_tree()
    a = hang(tree, tree.root, [1, 2], t=1)
    b = hang(tree, a, [3], t=2)
    c = hang(tree, b, [4, 5], t=3)
    d = hang(tree, a, [6], t=4)

    def locks():
        return [n.lock_ref for n in (a, b, c, d)]

    tree.inc_lock(c)
    assert locks() == [1, 1, 1, 0] and (tree.protected_size, tree.evictable_size) == (5, 1)
    tree.inc_lock(c)
    assert locks() == [2, 2, 2, 0] and (tree.protected_size, tree.evictable_size) == (5, 1)
    tree.inc_lock(d)
    assert locks() == [3, 2, 2, 1] and (tree.protected_size, tree.evictable_size) == (6, 0)
    check_tree(tree)
    tree.dec_lock(c)
    assert locks() == [2, 1, 1, 1] and (tree.protected_size, tree.evictable_size) == (6, 0)
    tree.dec_lock(c)
    assert locks() == [1, 0, 0, 1], "dec_lock must unpin the ancestors too"
    assert (tree.protected_size, tree.evictable_size) == (3, 3)
    check_tree(tree)
    tree.dec_lock(d)
    assert locks() == [0, 0, 0, 0] and (tree.protected_size, tree.evictable_size) == (0, 6)
    tree.inc_lock(tree.root)  # the match of a request that found nothing: its node is the root
    tree.dec_lock(tree.root)
    assert locks() == [0, 0, 0, 0] and (tree.protected_size, tree.evictable_size) == (0, 6)
    check_tree(tree)


@pytest.mark.task("4.3")
def test_unlocking_more_than_locked_is_an_error():
    tree = make_tree()
    a = hang(tree, tree.root, [1], t=1)
    b = hang(tree, a, [2], t=2)
    tree.inc_lock(b)
    tree.dec_lock(b)
    with pytest.raises(RuntimeError):
        tree.dec_lock(b)


@pytest.mark.task("4.3", weight=2)
def test_evict_takes_the_least_recently_used_leaf_first():
    """Three leaves used at times 3, 1, 2: evict(1) frees the one of time 1 (its slot goes back to the pool),
    then the one of time 2."""
    tree = make_tree()
    a = hang(tree, tree.root, [1], t=3)
    b = hang(tree, tree.root, [2], t=1)
    c = hang(tree, tree.root, [3], t=2)
    free = tree.allocator.num_free_tokens
    assert tree.evict(0) == 0 and shape(tree.root) == [((1,), []), ((2,), []), ((3,), [])]
    assert tree.evict(1) == 1
    assert shape(tree.root) == [((1,), []), ((3,), [])], "the least recently used leaf goes first"
    assert b.value.item() in tree.allocator._free and tree.allocator.num_free_tokens == free + 1
    assert tree.evict(1) == 1 and shape(tree.root) == [((1,), [])]
    assert c.value.item() in tree.allocator._free and a.value.item() not in tree.allocator._free
    check_tree(tree)


@pytest.mark.task("4.3")
def test_evict_frees_whole_leaves_until_it_has_enough():
    tree = make_tree()
    hang(tree, tree.root, [1, 1, 1], t=1)
    hang(tree, tree.root, [2, 2], t=2)
    hang(tree, tree.root, [3], t=3)
    free = tree.allocator.num_free_tokens
    assert tree.evict(4) == 5, "3 tokens are not enough, so the next leaf goes too, whole"
    assert shape(tree.root) == [((3,), [])] and tree.evictable_size == 1
    assert tree.allocator.num_free_tokens == free + 5
    assert tree.evict(100) == 1, "asked for more than the tree holds: it gives what it has"
    assert shape(tree.root) == [] and tree.evictable_size == 0 and tree.allocator.num_free_tokens == free + 6
    check_tree(tree)


@pytest.mark.task("4.3", weight=4)
def test_evict_never_takes_a_locked_leaf():
    """A running request's prefix is pinned: attention reads its slots every step. The oldest leaf is locked, so
    eviction takes the other one, and then nothing more until the lock goes."""
    tree = make_tree()
    old = hang(tree, tree.root, [1, 1], t=1)
    hang(tree, tree.root, [2, 2], t=2)
    tree.inc_lock(old)
    assert tree.evict(2) == 2 and shape(tree.root) == [((1, 1), [])], "evicted a leaf a running request uses"
    assert tree.evict(100) == 0 and shape(tree.root) == [((1, 1), [])]
    assert not set(old.value.tolist()) & set(tree.allocator._free)
    check_tree(tree)
    tree.dec_lock(old)
    assert tree.evict(100) == 2 and shape(tree.root) == []
    check_tree(tree)


@pytest.mark.task("4.3", weight=3)
def test_evict_never_takes_an_inner_node():
    """[1 2] (time 1) -> {[3] (5), [4] (6)}, and [9] (4). The oldest node, [1 2], has children: evicting it would
    cut them off (their slots lost to everyone, never freed). It becomes a candidate when its last child goes."""
    tree = make_tree()
    p = hang(tree, tree.root, [1, 2], t=1)
    hang(tree, p, [3], t=5)
    hang(tree, p, [4], t=6)
    hang(tree, tree.root, [9], t=4)
    assert tree.evict(1) == 1 and shape(tree.root) == [((1, 2), [((3,), []), ((4,), [])])]
    assert tree.evict(1) == 1 and shape(tree.root) == [((1, 2), [((4,), [])])]
    assert tree.evict(1) == 1 and shape(tree.root) == [((1, 2), [])]
    assert tree.evict(1) == 2 and shape(tree.root) == []
    check_tree(tree)


@pytest.mark.task("4.3")
def test_evict_continues_with_a_parent_left_without_children():
    """[1 2] (time 1) -> [3] (2), and [4] (10). Evicting [3] leaves [1 2] a leaf, and an older one than [4]: it
    is next, before [4]."""
    tree = make_tree()
    p = hang(tree, tree.root, [1, 2], t=1)
    hang(tree, p, [3], t=2)
    hang(tree, tree.root, [4], t=10)
    assert tree.evict(2) == 3
    assert shape(tree.root) == [((4,), [])], "a parent whose last child went is a leaf, and a candidate, too"
    check_tree(tree)


@pytest.mark.task("4.3", weight=4)
def test_evict_keeps_a_locked_parent_and_drops_an_empty_salted_root():
    """A request pins [1 2]; its unpinned child [3] may go, but [1 2] stays even once it has no children. A salted
    root whose last prefix is evicted goes too."""
    tree = make_tree()
    p = hang(tree, tree.root, [1, 2], t=1)
    hang(tree, p, [3], t=2)
    hang(tree, tree.root, [4], t=10)
    hang(tree, tree.root_for("tenant", create=True), [5], t=5)
    tree.inc_lock(p)
    assert tree.evict(100) == 3
    assert shape(tree.root) == [((1, 2), [])] and tree.protected_size == 2
    assert "tenant" not in tree.salted_roots
    check_tree(tree)


@pytest.mark.task("4.3")
def test_evict_in_whole_pages():
    tree = make_tree(page_size=4)
    pages = tree.allocator.num_free_pages
    a = hang(tree, tree.root, list(range(8)), t=1)
    assert tree.allocator.num_free_pages == pages - 2
    assert tree.evict(1) == 8 and tree.allocator.num_free_pages == pages
    assert sorted(set((a.value // 4).tolist())) == sorted(tree.allocator._free[-2:])
    check_tree(tree)


@pytest.mark.task("4.3", weight=12)
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("page_size", [1, 4])
def test_random_locks_and_evictions_never_lose_a_pinned_prefix(seed: int, page_size: int):
    """A random tree (about 20 nodes, some salted, random ages), random requests pinning random paths, then
    evictions of random sizes while the pins come and go. After every operation: a pinned node is still in the
    tree with its slots not free (a running request reads them every step), the sizes and the free list agree
    with the tree, and an eviction frees what was asked whenever the unpinned part of the tree holds that much,
    never more than that part, and takes only whole unpinned nodes."""
    rng = random.Random(seed)
    tree = make_tree(page_size, num_pages=200)
    nodes: list[TreeNode] = []
    roots = [tree.root, tree.root_for("a", create=True), tree.root_for("b", create=True)]
    for i in range(20):
        parent = rng.choice(roots + nodes)
        key = [3 + i] + [rng.randrange(3, 50) for _ in range(rng.randint(1, 3) * page_size - 1)]
        nodes.append(hang(tree, parent, key, t=rng.randrange(1000)))
    pins: list[TreeNode] = []

    def attached(node: TreeNode) -> bool:
        while node.parent is not None:
            if node.parent.children.get(tree._child_key(node.key)) is not node:
                return False
            node = node.parent
        return node is tree.root or node in tree.salted_roots.values()

    for _ in range(40):
        op = rng.random()
        live = [n for n in nodes if attached(n)]
        if op < 0.4 and live:
            node = rng.choice(live)
            tree.inc_lock(node)
            pins.append(node)
        elif op < 0.6 and pins:
            tree.dec_lock(pins.pop(rng.randrange(len(pins))))
        else:
            asked = rng.randint(1, 12) * page_size
            before = tree.evictable_size
            freed = tree.evict(asked)
            assert freed + tree.evictable_size == before, "eviction took pinned tokens, or lost track of some"
            assert freed >= min(asked, before), "eviction stopped although unpinned leaves were left"
        check_tree(tree)
        free = set(tree.allocator._free)
        for node in pins:
            assert attached(node), "a pinned node was evicted (or cut off with its parent)"
            assert not {s // page_size for s in path_slots(node)} & free, "a pinned slot went back to the pool"
    for node in pins:
        tree.dec_lock(node)
    tree.evict(10**6)
    assert tree.evictable_size == tree.protected_size == 0 and not tree._all_nodes()
    assert len(tree.allocator._free) == 199, "evicting everything must give every page back"


# ------------------------------------------------------------------------------------------------ 4.4 commit


def make_manager(page_size: int = 1, num_pages: int = 64) -> CacheManager:
    return CacheManager(PageAllocator(num_pages, page_size), ReqToTokenPool(max_requests=4, max_context_len=64))


def admit_and_compute(cm: CacheManager, prompt: list[int], salt: str | None = None) -> Req:
    """What the scheduler and a prefill step do for a new request: match it (reusing and pinning its cached
    prefix), give the rest of its prompt fresh slots, and compute their KV (here: pretend to)."""
    req = Req(list(prompt), SamplingParams(max_new_tokens=8), cache_salt=salt)
    cm.match(req)
    start = req.kv_allocated_len  # a whole number of pages
    cm.req_to_token.write(req.req_pool_idx, start, take(cm.allocator, len(prompt) - start))
    req.kv_allocated_len = req.kv_scheduled_len = len(prompt)
    return req


def row_of(cm: CacheManager, req: Req) -> list[int]:
    return cm.req_to_token.read(req.req_pool_idx, req.kv_allocated_len).tolist()


def check_manager(cm: CacheManager, live: list[Req]) -> None:
    """The tree is sound, each live request's shared part is its tree path, and no slot in use is free."""
    tree = cm.tree
    check_tree(tree)
    free = set(cm.allocator._free)
    for req in live:
        row = row_of(cm, req)
        assert path_tokens(req.last_node) == req.all_ids[: req.tree_len], "last_node is not the committed prefix"
        assert row[: req.tree_len] == path_slots(req.last_node), "the row's shared part is not the tree's slots"
        assert not {s // cm.page_size for s in row} & free, f"{req.rid} reads a slot that is free"
    pins: dict[int, int] = {}
    for req in live:
        node = req.last_node
        while node.parent is not None:
            pins[id(node)] = pins.get(id(node), 0) + 1
            node = node.parent
    for node in tree._all_nodes():
        assert node.lock_ref == pins.get(id(node), 0), "a lock count differs from the requests pinning the node"


@pytest.mark.task("4.4")
def test_commit_puts_the_computed_pages_in_the_tree_and_pins_them():
    """Page size 4, a 10-token prompt computed on an empty tree: commit stores its two whole pages, the request now
    pins them (tree_len 8), and the half page stays its own. Committing again changes nothing; on release the
    tree keeps the 8 tokens, unpinned, and the half page is freed."""
    cm = make_manager(page_size=4)
    prompt = list(range(10, 20))
    a = admit_and_compute(cm, prompt)
    row = row_of(cm, a)
    cm.commit(a)
    assert a.tree_len == 8 and path_tokens(a.last_node) == prompt[:8]
    assert row_of(cm, a) == row, "nothing was shared, so the row keeps its slots"
    assert (cm.tree.protected_size, cm.tree.evictable_size) == (8, 0)
    check_manager(cm, [a])
    cm.commit(a)
    assert a.tree_len == 8 and (cm.tree.protected_size, cm.tree.evictable_size) == (8, 0)
    check_manager(cm, [a])
    cm.release(a)
    assert (cm.tree.protected_size, cm.tree.evictable_size) == (0, 8)
    assert cm.allocator.num_free_pages == cm.allocator.capacity_pages - 2
    check_tree(cm.tree)


@pytest.mark.task("4.4")
def test_commit_moves_the_lock_from_the_matched_prefix_to_the_new_node():
    """A request that matched [1..8] computes three more tokens. After commit it pins the node of its own 11
    tokens, and through it [1..8], once: the lock of its match was moved down, not added to."""
    cm = make_manager()
    first = admit_and_compute(cm, list(range(1, 9)))
    cm.commit(first)
    cm.release(first)
    b = admit_and_compute(cm, list(range(1, 12)))
    assert b.tree_len == 8 and b.last_node.lock_ref == 1
    cm.commit(b)
    assert b.tree_len == 11 and path_tokens(b.last_node) == list(range(1, 12))
    assert node_at(cm.tree, list(range(1, 9))).lock_ref == 1, "the lock of the matched prefix was not released"
    assert (cm.tree.protected_size, cm.tree.evictable_size) == (11, 0)
    check_manager(cm, [b])
    cm.release(b)
    assert cm.tree.protected_size == 0 and all(n.lock_ref == 0 for n in cm.tree._all_nodes())


@pytest.mark.task("4.4", weight=3)
def test_commit_keeps_one_copy_of_a_prefix_two_requests_computed():
    """The pitfall of section 6. [1 2 3 4] is cached; A and B both match it, and both compute the same *new*
    tokens [5..10] in one prefill step (each into its own slots), then their own tails. A commits first. B's
    insert finds [1..10] cached: B's slots for [5..10] (not for [1..4], which were the tree's all along) are
    duplicates and are freed, and B's row is pointed at A's slots for them, whose KV is identical."""
    cm = make_manager()
    base = admit_and_compute(cm, [1, 2, 3, 4])
    cm.commit(base)
    cm.release(base)
    shared = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    a = admit_and_compute(cm, shared + [20, 21])
    b = admit_and_compute(cm, shared + [30])
    assert a.tree_len == b.tree_len == 4
    row_a, row_b, free = row_of(cm, a), row_of(cm, b), cm.allocator.num_free_tokens
    cm.commit(a)
    assert row_of(cm, a) == row_a and a.tree_len == 12
    cm.commit(b)
    assert b.tree_len == 11 and path_tokens(b.last_node) == shared + [30]
    assert row_of(cm, b)[:10] == row_a[:10], "B's row must point at the tree's copy of the shared tokens"
    assert row_of(cm, b)[10:] == row_b[10:]
    assert cm.allocator.num_free_tokens == free + 6, "exactly B's six duplicate slots are freed"
    assert sorted(cm.allocator._free[-6:]) == sorted(row_b[4:10])
    check_manager(cm, [a, b])
    for req in (a, b):
        cm.release(req)
    assert cm.flush_cache()
    assert sorted(cm.allocator._free) == list(range(1, cm.allocator.num_pages)), "a slot leaked or was freed twice"


@pytest.mark.task("6.1", weight=4)
def test_commit_frees_duplicates_only_after_the_step_in_flight():
    """Duplicate slots were written by the step that computed them; with a step in flight (overlap) they may still
    be being written, so they go back to the pool only once that step has been processed (``frees``).

    Graded with chapter 06: without a step in flight, handing duplicates to ``frees`` and freeing them at once
    look the same, so only the parking of task 6.1 can tell a commit that bypasses ``frees``."""
    cm = make_manager()
    a = admit_and_compute(cm, [1, 2, 3, 4, 5])
    b = admit_and_compute(cm, [1, 2, 3, 4, 6])
    row_b = row_of(cm, b)
    step = cm.frees.launch()
    free = cm.allocator.num_free_tokens
    cm.commit(a)
    cm.commit(b)
    assert cm.allocator.num_free_tokens == free, "freed slots the step in flight may still write"
    assert sorted(s for slots in cm.frees.parked_slots for s in slots.tolist()) == sorted(row_b[:4])
    cm.frees.processed(step)
    assert cm.allocator.num_free_tokens == free + 4
    check_manager(cm, [a, b])


@pytest.mark.task("4.4")
def test_commit_stops_at_upto():
    """``upto`` limits what goes in (release passes all but the last token: under overlap the step in flight may
    still be computing it); a commit that would not go beyond ``tree_len`` does nothing."""
    cm = make_manager()
    a = admit_and_compute(cm, [1, 2, 3, 4, 5, 6, 7, 8])
    cm.commit(a, upto=5)
    assert a.tree_len == 5 and cm.tree.total_size == 5 and path_tokens(a.last_node) == [1, 2, 3, 4, 5]
    check_manager(cm, [a])
    cm.commit(a, upto=3)
    assert a.tree_len == 5 and cm.tree.total_size == 5
    cm.commit(a, upto=20)
    assert a.tree_len == 8 and cm.tree.total_size == 8
    check_manager(cm, [a])


@pytest.mark.task("4.4", weight=3)
@pytest.mark.parametrize("page_size", [1, 4])
def test_radix_engine_reuses_prefixes_and_matches_the_oracle(tiny_llm, page_size):
    """The tiny model through an engine with the radix cache (overlap off, no chunking, in-batch deferral off):
    two requests share a new 42-token prefix in one prefill step, a third reuses it one step later, and the whole
    batch is then run again, almost all from the cache. Greedy tokens equal the oracle's; afterwards the pool is
    whole (free + evictable == capacity, nothing pinned)."""
    rng = random.Random(5)
    shared = [rng.randrange(3, 320) for _ in range(42)]
    prompts = [shared + [rng.randrange(3, 320) for _ in range(n)] for n in (9, 14, 3)]
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    expected = oracle(tiny_llm, prompts, params)
    engine = make_engine(tiny_llm, page_size=page_size, disable_overlap_schedule=True, chunked_prefill_size=-1,
                         in_batch_prefix_threshold=-1, max_prefill_tokens=110)
    reqs = make_reqs(tiny_llm, prompts, params)
    drive(engine, reqs)
    assert_matches_oracle(reqs, expected)
    assert_pool_accounting(engine)
    aligned = 42 - 42 % page_size
    assert [r.cached_tokens for r in reqs] == [0, 0, aligned]
    again = make_reqs(tiny_llm, prompts, params)
    before = engine.stats.prefill_tokens
    drive(engine, again)
    assert_matches_oracle(again, expected)
    assert_pool_accounting(engine)
    assert [r.cached_tokens for r in again] == [len(p) - 1 - (len(p) - 1) % page_size for p in prompts]
    assert engine.stats.prefill_tokens - before == sum(len(p) - r.cached_tokens for p, r in zip(prompts, again))


# ------------------------------------------------------------------------------------------------ 4.4 real KV


def check_cached_kv_equals_fresh_kv(llm, seed: int, page_size: int, **config) -> None:
    """Prompts with shared openings go through a radix engine, all at once, so that later ones reuse earlier
    ones' cached KV. Then every cached prefix in the tree is prefilled again, alone, by an engine without a cache;
    the two copies of K and V agree in every layer."""
    rng = random.Random(seed)
    opening = [rng.randrange(3, 320) for _ in range(rng.randrange(16, 40))]
    batch = [opening[: rng.randrange(8, len(opening) + 1)] + [rng.randrange(3, 320) for _ in range(rng.randrange(1, 9))]
             for _ in range(4)]
    engine = make_engine(llm, page_size=page_size, **config)
    reqs = [Req(p, SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)) for p in batch]
    for r in reqs:
        engine.add_request(r)
    engine.run_until_done()
    tree = engine.cache.tree
    leaves, stack = [], [(tree.root, [])]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            stack.append((child, prefix + child.key))
        if not node.children and node is not tree.root:
            leaves.append(prefix)
    assert leaves, "nothing was cached"
    for tokens in leaves:
        cached = tree.match_prefix(tokens)
        assert cached.length == len(tokens)
        fresh_engine = make_engine(llm, disable_radix_cache=True, disable_overlap_schedule=True,
                                   chunked_prefill_size=-1)
        fresh = Req(tokens + [5], SamplingParams(temperature=0, max_new_tokens=2))  # its prefill covers `tokens`
        fresh_engine.add_request(fresh)
        fresh_engine.step()  # the prefill (the request still runs: it wants a second token)
        fresh_slots = fresh_engine.req_to_token.read(fresh.req_pool_idx, len(tokens))
        pools = [(engine.kv_pool.k, fresh_engine.kv_pool.k), (engine.kv_pool.v, fresh_engine.kv_pool.v)]
        for layer in range(len(engine.kv_pool.k)):
            for pool, fresh_pool in pools:
                torch.testing.assert_close(pool[layer][cached.slots], fresh_pool[layer][fresh_slots])


@pytest.mark.task("4.4")
@pytest.mark.parametrize("seed,page_size", [(0, 1), (1, 4), (2, 16), (3, 1)])
def test_matched_prefix_kv_equals_freshly_computed_kv(tiny_llm, seed, page_size):
    """Real KV through the plainest radix engine (overlap off, no chunking, in-batch deferral off, so requests
    that share a new opening compute it in the same step and commit keeps one copy)."""
    check_cached_kv_equals_fresh_kv(tiny_llm, seed, page_size, disable_overlap_schedule=True,
                                    chunked_prefill_size=-1, in_batch_prefix_threshold=-1)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), page_size=st.sampled_from([1, 4, 16]), chunk=st.sampled_from([-1, 5, 24]))
def test_matched_prefix_kv_equals_freshly_computed_kv_overlap_chunked(tiny_llm, seed, page_size, chunk):
    """The same with the default engine (overlap on, in-batch deferral on), chunked or not: prefixes committed
    at launch, a chunk at a time, or a step late are still the KV a fresh prefill computes."""
    check_cached_kv_equals_fresh_kv(tiny_llm, seed, page_size, chunked_prefill_size=chunk)


# ------------------------------------------------------------------------------------------------ 4.5 in-batch


def scheduler(threshold: int = 32) -> Scheduler:
    cm = make_manager(num_pages=256)
    return Scheduler(EngineConfig(in_batch_prefix_threshold=threshold), cm)


def matched(prompt: list[int], cached: int = 0, salt: str | None = None) -> Req:
    """A request as the scheduler has just matched it: ``cached`` of its tokens found in the tree."""
    req = Req(list(prompt), SamplingParams(max_new_tokens=8), cache_salt=salt)
    req.kv_scheduled_len = req.kv_allocated_len = req.tree_len = cached
    return req


SHARED = list(range(1000, 1040))  # 40 tokens


@pytest.mark.task("4.5")
def test_defer_when_a_row_of_the_step_computes_a_long_stretch_of_the_prompt():
    """The threshold is 32 tokens: an overlap of 32 defers, 31 does not."""
    s = scheduler(32)
    computing = [(None, SHARED + [1, 2, 3])]
    assert s._defer_for_in_batch_prefix(matched(SHARED + [7, 7]), computing)
    assert s._defer_for_in_batch_prefix(matched(SHARED[:32] + [7, 7]), computing), "an overlap of exactly 32"
    assert not s._defer_for_in_batch_prefix(matched(SHARED[:31] + [7, 7]), computing)
    assert not s._defer_for_in_batch_prefix(matched([5] + SHARED), computing), "no common *prefix*"
    assert not scheduler(41)._defer_for_in_batch_prefix(matched(SHARED + [7, 7]), computing)


@pytest.mark.task("4.5")
def test_defer_looks_at_every_row_of_the_step():
    s = scheduler(32)
    computing = [(None, [5, 6, 7]), (None, SHARED[:35]), (None, [9] * 50)]
    assert s._defer_for_in_batch_prefix(matched(SHARED + [7]), computing)


@pytest.mark.task("4.5")
def test_defer_counts_only_what_the_request_would_compute_twice():
    """The first ``kv_scheduled_len`` tokens of the request are cached for it already (it matched them): only the
    rest of the overlap would be computed twice."""
    s = scheduler(32)
    computing = [(None, SHARED + [1, 2, 3])]
    assert s._defer_for_in_batch_prefix(matched(SHARED + [7], cached=8), computing)  # 40 - 8 = 32 new
    assert not s._defer_for_in_batch_prefix(matched(SHARED + [7], cached=9), computing)  # 31 new
    assert not s._defer_for_in_batch_prefix(matched(SHARED + [7], cached=40), computing)


@pytest.mark.task("4.5")
def test_defer_never_counts_the_last_token():
    """A request's last token is always computed (its logits give the next token), so it never comes from the
    cache and does not count: a twin of a 33-token prompt overlaps it by 32 cacheable tokens."""
    prompt = SHARED[:33]
    assert not scheduler(33)._defer_for_in_batch_prefix(matched(prompt), [(None, prompt)])
    assert scheduler(32)._defer_for_in_batch_prefix(matched(prompt), [(None, prompt)])


@pytest.mark.task("4.5")
def test_defer_only_for_rows_of_the_same_salt():
    """A request can reuse only the prefixes of its own cache salt: another salt's row is no reason to wait."""
    s = scheduler(32)
    computing = [("tenant-a", SHARED + [1])]
    assert not s._defer_for_in_batch_prefix(matched(SHARED + [7]), computing)
    assert not s._defer_for_in_batch_prefix(matched(SHARED + [7], salt="tenant-b"), computing)
    assert s._defer_for_in_batch_prefix(matched(SHARED + [7], salt="tenant-a"), computing)


@pytest.mark.task("4.5")
@pytest.mark.parametrize("policy,page_size", [("fcfs", 1), ("lpm", 4)])
def test_in_batch_prefix_caching_in_the_engine(tiny_llm, policy, page_size):
    """Two requests share a new 42-token prefix, a third is unrelated; all arrive together (overlap off, no
    chunking). With the default threshold (32) the second one waits a step and then finds the prefix in the tree,
    so it is computed once; the unrelated one is not held back. With the check off, both compute it."""
    rng = random.Random(11)
    shared = [rng.randrange(3, 320) for _ in range(42)]
    prompts = [shared + [rng.randrange(3, 320) for _ in range(9)], [rng.randrange(3, 320) for _ in range(20)],
               shared + [rng.randrange(3, 320) for _ in range(14)]]
    params = SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True)
    expected = oracle(tiny_llm, prompts, params)
    aligned = 42 - 42 % page_size
    for threshold, deferred in ((32, True), (-1, False)):
        engine = make_engine(tiny_llm, schedule_policy=policy, page_size=page_size, disable_overlap_schedule=True,
                             chunked_prefill_size=-1, in_batch_prefix_threshold=threshold)
        a, c, b = reqs = make_reqs(tiny_llm, prompts, params)
        trace = drive(engine, reqs)
        assert_matches_oracle(reqs, expected)
        assert_pool_accounting(engine)
        if deferred:
            assert set(trace.launched[0].reqs) == {a, c}, "the request sharing a's new prefix waits one step"
            assert b in trace.launched[1].reqs and b.cached_tokens == aligned
            assert engine.stats.prefill_tokens == sum(map(len, prompts)) - aligned
        else:
            assert set(trace.launched[0].reqs) == {a, b, c} and b.cached_tokens == 0
