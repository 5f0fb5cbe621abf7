"""Chapter 13's proposers: the n-gram lookup and the draft model (self-speculation by a truncated target).

The n-gram tests run on token lists made up for each case, so every expected draft is known in advance. The
draft-model tests run the embedded SmolLM2-135M on the CPU, few prompts and few steps, and hold the proposer to
plain references: the chapter-00 oracle on the same (truncated) model, and a proposer built from scratch.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl_ref import SamplingParams
from minisgl_ref.attention.torch_native import NoCacheAttentionBackend
from minisgl_ref.core.forward_batch import ForwardBatch
from minisgl_ref.core.request import Req
from minisgl_ref.engine.naive import NaiveEngine
from minisgl_ref.speculative.draft_model import DraftModelProposer, truncated_model
from minisgl_ref.speculative.ngram import NgramIndex, NgramProposer, NgramSettings
from minisgl_ref.speculative.proposer import Proposer, empty
from minisgl_ref.speculative.tree import DraftTree


def paths(tree: DraftTree) -> set[tuple[int, ...]]:
    """Every root-to-node token path of a tree."""
    out: list[tuple[int, ...]] = []
    for tok, parent in zip(tree.tokens, tree.parents):
        out.append((out[parent] if parent >= 0 else ()) + (tok,))
    return set(out)


# ------------------------------------------------------------------------------------------------ n-gram


def test_ngram_proposes_the_continuation_of_a_repeated_text() -> None:
    text = [5, 6, 7, 8, 9, 10, 11, 12]
    p = NgramProposer(NgramSettings(min_bfs_breadth=1, max_bfs_breadth=1))
    assert isinstance(p, Proposer)
    p.start(1, text + [1, 2] + text[:3])  # the text, something else, then the text starts over
    (tree,) = p.propose([1], 5)
    assert tree is not None
    assert tree == DraftTree.chain([8, 9, 10, 11, 12])


def test_ngram_branches_where_a_suffix_was_followed_by_different_tokens() -> None:
    # "1 2" was followed by 3 twice, then by 4 once (most recently): 3 is the most frequent, so it comes first.
    wide = dict(max_match_window_size=2, min_bfs_breadth=3, max_bfs_breadth=3)
    p = NgramProposer(NgramSettings(branch_length=2, **wide))
    p.start(7, [1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 4, 0, 1, 2])
    (tree,) = p.propose([7], 10)
    assert tree is not None
    assert tree.children(-1) == [0, 1]
    assert [tree.tokens[i] for i in tree.children(-1)] == [3, 4]
    assert paths(tree) == {(3,), (4,), (3, 0), (4, 0)}
    # Equally frequent continuations: the most recent first.
    q = NgramProposer(NgramSettings(branch_length=1, **wide))
    q.start(1, [1, 2, 3, 1, 2, 4, 1, 2])
    assert q.propose([1], 4)[0] == DraftTree((4, 3), (-1, -1))
    # BFS breadth shrinks as the matched window grows: a long match is a confident one.
    s = NgramSettings()
    assert [s.breadth(w) for w in (1, 12)] == [10, 1] and s.breadth(6) < 10
    narrow = NgramProposer(NgramSettings(max_match_window_size=2, branch_length=1, max_bfs_breadth=3))
    narrow.start(1, [1, 2, 3, 1, 2, 4, 1, 2])
    assert narrow.propose([1], 4)[0] == DraftTree.chain([4])  # a 2-token match: breadth 1


def test_ngram_prefers_the_longest_matching_window() -> None:
    # After "... 9 1 2", the 3-gram "9 1 2" was followed by 5 while "1 2" alone was mostly followed by 3.
    p = NgramProposer(NgramSettings(min_bfs_breadth=1, max_bfs_breadth=1, branch_length=1))
    p.start(1, [1, 2, 3, 1, 2, 3, 9, 1, 2, 5, 0, 9, 1, 2])
    assert p.propose([1], 1)[0] == DraftTree.chain([5])
    assert p.match(p.indexes[1])[0] == 3  # type: ignore[index]
    # With the window capped at 2 tokens, "1 2" wins, and 3 is its most frequent continuation.
    q = NgramProposer(NgramSettings(max_match_window_size=2, min_bfs_breadth=1, max_bfs_breadth=1, branch_length=1))
    q.start(1, [1, 2, 3, 1, 2, 3, 9, 1, 2, 5, 0, 9, 1, 2])
    assert q.propose([1], 1)[0] == DraftTree.chain([3])


def test_ngram_without_a_match_proposes_nothing_and_respects_the_min_window() -> None:
    p = NgramProposer()
    p.start(1, [1, 2, 3, 4])
    p.start(2, [4])
    assert p.propose([1, 2], 8) == [None, None]
    q = NgramProposer(NgramSettings(min_match_window_size=2))
    q.start(1, [1, 9, 3, 1])  # "1" recurs, but no 2-gram does
    assert q.propose([1], 8) == [None]
    q.extend(1, [9])  # now "1 9" has
    assert q.propose([1], 8)[0] == DraftTree.chain([3, 1, 9])


def test_ngram_limits_nodes_depth_and_breadth() -> None:
    s = NgramSettings(max_match_window_size=3, min_bfs_breadth=2, max_bfs_breadth=2, branch_length=4)
    p = NgramProposer(s)
    seq = []
    for follow in range(10):  # "7 7" followed by ten different tokens, each then by two more
        seq += [7, 7, 100 + follow, 200 + follow, 300 + follow]
    p.start(1, seq + [7, 7])
    for budget in (1, 3, 6, 50):
        (tree,) = p.propose([1], budget)
        assert tree is not None and len(tree) <= budget
        assert max(tree.depths()) <= s.branch_length
        for node in [-1, *range(len(tree))]:
            assert len(tree.children(node)) <= 2
    assert len(p.propose([1], 50)[0]) < 50  # type: ignore[arg-type]  # breadth 2 and depth 4 cap it
    assert p.propose([1], 0) == [None]
    # PROB: a chain the text always took beats a branch it took once.
    prob = NgramProposer(NgramSettings(max_match_window_size=1, branch_length=3, match_type="PROB"))
    prob.start(1, [1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 5, 0, 1])
    assert prob.propose([1], 3)[0] == DraftTree.chain([2, 3, 4])


def test_ngram_settings_are_checked_by_name() -> None:
    with pytest.raises(ValueError, match="speculative_ngram_min_match_window_size"):
        NgramSettings(min_match_window_size=5, max_match_window_size=4)
    with pytest.raises(ValueError, match="speculative_ngram_match_type"):
        NgramSettings(match_type="DFS")
    assert NgramSettings().max_match_window_size == 12 and NgramSettings().branch_length == 18  # SGLang's


def test_ngram_extend_costs_a_bounded_number_of_node_visits() -> None:
    s = NgramSettings(max_match_window_size=4, branch_length=3)
    index = NgramIndex(s.depth)
    index.append(list(range(50)) * 40)  # 2000 tokens
    for extra in ([1], [2, 3, 4]):
        before = index.work
        index.append(extra)
        assert index.work - before == s.depth * len(extra)  # independent of the 2000 tokens before
    p = NgramProposer(s)
    p.start(1, [3] * 500)
    before = p.indexes[1].work
    p.extend(1, [3, 3])
    assert p.indexes[1].work - before == 2 * s.depth


def test_ngram_finish_forgets_the_request() -> None:
    p = NgramProposer()
    p.start(1, [1, 2, 1])
    p.finish(1)
    p.finish(1)  # twice, or never started: nothing to do
    with pytest.raises(KeyError):
        p.propose([1], 4)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.lists(st.integers(1, 8), max_size=12),
       st.sampled_from(["BFS", "PROB"]))
def test_ngram_incremental_extend_equals_building_from_scratch(tokens: list[int], cuts: list[int],
                                                               match_type: str) -> None:
    s = NgramSettings(max_match_window_size=3, max_bfs_breadth=3, branch_length=4, match_type=match_type)
    inc, scratch = NgramProposer(s), NgramProposer(s)
    first = cuts[0] if cuts else len(tokens)
    inc.start(1, tokens[:first])
    seen = first
    for cut in cuts[1:]:
        if seen >= len(tokens):
            break
        inc.extend(1, tokens[seen:seen + cut])
        seen += cut
        scratch.start(1, tokens[:seen])
        assert inc.indexes[1].snapshot() == scratch.indexes[1].snapshot()
        assert inc.propose([1], 6) == scratch.propose([1], 6)
    inc.extend(1, tokens[seen:])
    scratch.start(1, tokens)
    assert inc.indexes[1].snapshot() == scratch.indexes[1].snapshot()
    assert inc.propose([1], 6) == scratch.propose([1], 6)


# ------------------------------------------------------------------------------------------- draft model

PROMPTS = ["The capital of France is", "Count: one, two, three, four, five,", "def add(a, b):\n    return"]


@pytest.fixture(scope="module")
def smol():  # type: ignore[no-untyped-def]
    from minisgl_ref.models.loader import load_model
    from minisgl_ref.tokenizer import Tokenizer

    model, config, folder = load_model(None, device="cpu")
    tokenizer = Tokenizer.find(folder)
    assert tokenizer is not None
    return model, config, [tokenizer.hf.encode(p) for p in PROMPTS]


def greedy(model: torch.nn.Module, vocab: int, prompt: list[int], n: int, device: str = "cpu") -> list[int]:
    """The chapter-00 oracle's greedy continuation of ``prompt`` by ``model``."""
    req = Req(list(prompt), SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True))
    NaiveEngine(model, vocab, device).run([req])
    return req.output_ids


def proposer(model, config, vocab: int, **kw) -> DraftModelProposer:  # type: ignore[no-untyped-def]
    return DraftModelProposer(model, config, target_vocab_size=vocab, max_total_tokens=256, max_requests=8, **kw)


def test_truncated_model_shares_the_targets_weights(smol) -> None:  # type: ignore[no-untyped-def]
    model, config, _ = smol
    draft = truncated_model(model, 4)
    assert type(draft) is type(model) and len(draft.layers) == 4 and draft.config.num_layers == 4
    assert len(model.layers) == config.num_layers == 30  # the target is untouched
    shared = {p.data_ptr() for p in model.parameters()}
    assert all(p.data_ptr() in shared for p in draft.parameters())
    assert draft.layers[3] is model.layers[3] and draft.lm_head is model.lm_head and draft.norm is model.norm
    with pytest.raises(ValueError, match="num_layers"):
        truncated_model(model, 31)
    selfspec = DraftModelProposer.self_speculative(model, config, 3, max_total_tokens=64)
    assert len(selfspec.model.layers) == 3 and len(selfspec.kv_pool.k) == 3  # a pool for its own layers only


def test_draft_chain_equals_the_truncated_models_greedy_continuation(smol) -> None:  # type: ignore[no-untyped-def]
    model, config, prompts = smol
    draft = truncated_model(model, 6)
    p = proposer(draft, draft.config, config.vocab_size, num_steps=4)
    for rid, prompt in enumerate(prompts):
        p.start(rid, prompt)
    trees = p.propose([0, 1, 2], 8)  # one batch of three prompts of different lengths
    for tree, prompt in zip(trees, prompts):
        assert tree == DraftTree.chain(greedy(draft, config.vocab_size, prompt, 4))
    # max_tokens caps the chain below num_steps.
    assert p.propose([1], 2)[0] == DraftTree.chain(trees[1].tokens[:2])  # type: ignore[union-attr]


def test_a_draft_of_every_layer_is_the_targets_greedy_continuation(smol) -> None:  # type: ignore[no-untyped-def]
    model, config, prompts = smol
    full = truncated_model(model, config.num_layers)
    p = proposer(full, full.config, config.vocab_size, num_steps=3)
    p.start(0, prompts[1])
    (tree,) = p.propose([0], 3)
    assert tree == DraftTree.chain(greedy(model, config.vocab_size, prompts[1], 3))  # acceptance would be 100%


def test_extend_after_partial_acceptance_equals_proposing_from_scratch(smol) -> None:  # type: ignore[no-untyped-def]
    model, config, prompts = smol
    draft = truncated_model(model, 6)
    live = proposer(draft, draft.config, config.vocab_size, num_steps=4)
    live.start(0, prompts[0])
    live.start(1, prompts[2])
    first = live.propose([0, 1], 4)
    # Request 0 accepts two drafts and gets a different bonus token; request 1 accepts nothing.
    appended = {0: [*first[0].tokens[:2], 11], 1: [13]}  # type: ignore[union-attr]
    for rid, tokens in appended.items():
        live.extend(rid, tokens)
    for rid in (0, 1):  # the drafted tokens' KV is gone: the draft holds KV of accepted tokens only
        assert len(live.reqs[rid].slots) <= len(live.reqs[rid].tokens)
    used = live.allocator.capacity_pages - live.allocator.num_free_pages
    assert used == sum(len(r.slots) for r in live.reqs.values())
    again = live.propose([0, 1], 4)
    fresh = proposer(draft, draft.config, config.vocab_size, num_steps=4)
    fresh.start(0, prompts[0] + appended[0])
    fresh.start(1, prompts[2] + appended[1])
    assert again == fresh.propose([0, 1], 4)
    assert live.propose([0, 1], 4) == again  # proposing twice without news: the same draft


def test_draft_tree_nodes_are_the_models_top_k(smol) -> None:  # type: ignore[no-untyped-def]
    model, config, prompts = smol
    draft = truncated_model(model, 4)
    p = proposer(draft, draft.config, config.vocab_size, num_steps=3, topk=2)
    p.start(0, prompts[0])
    p.start(1, prompts[1])
    trees = p.propose([0, 1], 6)
    assert trees == p.propose([0, 1], 6)  # deterministic
    for tree, prompt in zip(trees, prompts):
        assert tree is not None and len(tree) == 6 and max(tree.depths()) >= 2
        assert tree.parents[0] == -1  # the best node of all is the root's most likely child
        built: list[list[int]] = []
        for tok, parent in zip(tree.tokens, tree.parents):
            path = built[parent] if parent >= 0 else []
            fb = ForwardBatch.for_full_sequences([prompt + path], NoCacheAttentionBackend())
            with torch.inference_mode():
                logits = draft.compute_logits(draft(fb.input_ids, fb.positions, fb)[-1:])
            assert tok in logits.topk(2, dim=-1).indices[0].tolist()
            built.append(path + [tok])
    # Unbounded: every scored candidate, topk at the first level and topk * topk per later level.
    whole = p.propose([0], 100)[0]
    assert whole is not None and len(whole) == 2 + 2 * 4 and len(whole.children(-1)) == 2
    assert p.req_to_token.num_free == p.req_to_token.max_requests - 2  # the branch rows went back


def test_sampled_chains_carry_their_distributions(smol) -> None:  # type: ignore[no-untyped-def]
    model, config, prompts = smol
    draft = truncated_model(model, 4)
    a = proposer(draft, draft.config, config.vocab_size, num_steps=3, temperature=0.8, seed=5)
    b = proposer(draft, draft.config, config.vocab_size, num_steps=3, temperature=0.8, seed=5)
    for p in (a, b):
        p.start(0, prompts[0])
    (tree,) = a.propose([0], 3)
    assert tree is not None and tree.probs is not None and tree.probs.shape == (3, config.vocab_size)
    assert torch.allclose(tree.probs.sum(-1), torch.ones(3))
    assert all(tree.probs[i, t] > 0 for i, t in enumerate(tree.tokens))
    (twin,) = b.propose([0], 3)
    assert twin is not None and twin.tokens == tree.tokens  # the same seed draws the same chain


def test_the_draft_pool_is_idle_after_finish(smol) -> None:  # type: ignore[no-untyped-def]
    model, config, prompts = smol
    draft = truncated_model(model, 2)
    for topk in (1, 2):
        p = proposer(draft, draft.config, config.vocab_size, num_steps=3, topk=topk)
        for rid, prompt in enumerate(prompts):
            p.start(rid, prompt)
        p.propose([0, 1, 2], 4)
        p.extend(1, [5, 6])
        p.start(2, prompts[0])  # started again (a retraction): replaces what it held
        p.propose([1, 2], 4)
        for rid in (0, 1, 2):
            p.finish(rid)
        # What is not free is the radix cache's, and none of it is pinned: evicting it all empties the pool.
        assert p.cache is not None and p.cache.protected_size == 0 and p.cache.evictable_size > 0
        assert p.allocator.num_free_pages + p.cache.evictable_size == p.allocator.capacity_pages
        p.cache.evict(p.allocator.capacity_pages)
        assert p.allocator.num_free_pages == p.allocator.capacity_pages
        assert p.req_to_token.num_free == p.req_to_token.max_requests
        assert not p.reqs


def test_without_a_radix_cache_finish_frees_everything(smol) -> None:  # type: ignore[no-untyped-def]
    from minisgl_ref.core.config import EngineConfig

    model, config, prompts = smol
    draft = truncated_model(model, 2)
    p = DraftModelProposer(draft, draft.config, target_vocab_size=config.vocab_size, num_steps=3,
                           max_total_tokens=256, max_requests=8, config=EngineConfig(disable_radix_cache=True))
    assert p.cache is None
    for rid, prompt in enumerate(prompts):
        p.start(rid, prompt)
    p.propose([0, 1, 2], 4)
    for rid in (0, 1, 2):
        p.finish(rid)
    assert p.allocator.num_free_pages == p.allocator.capacity_pages


def test_a_later_request_drafts_from_an_earlier_one_s_cached_kv(smol) -> None:  # type: ignore[no-untyped-def]
    model, config, prompts = smol
    draft = truncated_model(model, 6)
    p = proposer(draft, draft.config, config.vocab_size, num_steps=3)
    p.start(0, prompts[0])
    (first,) = p.propose([0], 3)
    accepted = [*first.tokens[:2], 11]  # type: ignore[union-attr]
    p.extend(0, accepted)
    p.propose([0], 3)  # computes the KV of the accepted tokens
    p.finish(0)
    # A second turn: the first one's prompt and accepted tokens, then more. Its prefix comes from the cache...
    turn = prompts[0] + accepted + prompts[1]
    p.start(1, turn)
    assert p.reqs[1].cached == len(prompts[0]) + len(accepted)
    assert p.cache is not None and p.cache.protected_size == p.reqs[1].cached  # pinned while it runs
    # ... and drafts exactly what a draft without a cache computes from scratch.
    (again,) = p.propose([1], 3)
    assert again == DraftTree.chain(greedy(draft, config.vocab_size, turn, 3))
    p.finish(1)
    assert p.cache.protected_size == 0


def test_the_draft_cache_is_evicted_when_its_pool_runs_short(smol) -> None:  # type: ignore[no-untyped-def]
    model, config, prompts = smol
    draft = truncated_model(model, 2)
    room = max(len(prompts[0]), len(prompts[1])) + 4
    p = DraftModelProposer(draft, draft.config, target_vocab_size=config.vocab_size, num_steps=2,
                           max_total_tokens=room, max_requests=4)
    p.start(0, prompts[0])
    p.propose([0], 2)
    p.finish(0)
    assert p.cache is not None and p.cache.evictable_size == len(prompts[0])
    p.start(1, prompts[1])  # shares no prefix, and needs the cached slots: they are evicted, not refused
    (tree,) = p.propose([1], 2)
    assert tree == DraftTree.chain(greedy(draft, config.vocab_size, prompts[1], 2))
    assert p.cache.evictable_size < len(prompts[0])


def test_a_draft_with_another_vocabulary_is_refused_by_name(smol) -> None:  # type: ignore[no-untyped-def]
    model, config, _ = smol
    with pytest.raises(ValueError, match="vocab_size"):
        DraftModelProposer(model, config, target_vocab_size=config.vocab_size + 1)


def test_empty_proposals() -> None:
    assert empty(None) and empty(DraftTree((), ())) and not empty(DraftTree.chain([1]))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_draft_proposer_on_cuda_matches_the_oracle(backend: str, tiny_checkpoints: dict) -> None:
    """The chain, rollback and pool checks on a GPU, where the page table lives on the device (every write goes
    through the host copy and a pinned transfer) and the backend may be a real kernel. A small random Llama in
    float32, so that the draft's argmax and the oracle's agree."""
    from minisgl_ref.core.config import EngineConfig
    from minisgl_ref.models.loader import load_model

    model, config, _ = load_model(str(tiny_checkpoints["llama"]), dtype="float32", device="cuda")
    draft = truncated_model(model, 1)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, config.vocab_size, (n,), generator=gen).tolist() for n in (5, 17, 9)]

    def make() -> DraftModelProposer:
        return DraftModelProposer(draft, draft.config, target_vocab_size=config.vocab_size, num_steps=3,
                                  max_total_tokens=512, max_requests=4, device="cuda",
                                  config=EngineConfig(attention_backend=backend))

    p = make()
    for rid, prompt in enumerate(prompts):
        p.start(rid, prompt)
    first = p.propose([0, 1, 2], 3)
    for tree, prompt in zip(first, prompts):
        assert tree == DraftTree.chain(greedy(draft, config.vocab_size, prompt, 3, "cuda"))
    appended = [*first[0].tokens[:1], 11]  # type: ignore[union-attr]
    p.extend(0, appended)
    fresh = make()
    fresh.start(0, prompts[0] + appended)
    assert p.propose([0], 3) == fresh.propose([0], 3)
    for rid in range(3):
        p.finish(rid)
    assert p.cache is not None and p.cache.protected_size == 0
    assert p.allocator.num_free_pages + p.cache.evictable_size == p.allocator.capacity_pages



def test_a_draft_pool_too_small_fails_the_propose_and_keeps_nothing(smol) -> None:  # type: ignore[no-untyped-def]
    from minisgl_ref.kvcache.allocator import OutOfPages

    model, config, prompts = smol
    draft = truncated_model(model, 2)
    p = DraftModelProposer(draft, draft.config, target_vocab_size=config.vocab_size, num_steps=2,
                           max_total_tokens=len(prompts[0]) + 4, max_requests=4)
    p.start(0, prompts[0])
    p.start(1, prompts[1])  # too long for what is left once request 0 is in
    with pytest.raises(OutOfPages):
        p.propose([0, 1], 2)
    assert p.allocator.num_free_pages == p.allocator.capacity_pages  # nothing half-computed was kept
    assert all(not r.slots for r in p.reqs.values())
    p.finish(1)
    (tree,) = p.propose([0], 2)  # the request that fits still drafts, and its draft is the oracle's
    assert tree == DraftTree.chain(greedy(draft, config.vocab_size, prompts[0], 2))
