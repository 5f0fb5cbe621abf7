# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 04 — Radix cache
#
# **What you will build.** A cache of KV that outlives the requests that computed it. When a request finishes,
# its tokens' keys and values stay in the pool, indexed by a *radix tree* keyed on token ids; when a new request
# begins with tokens the tree already holds, it reuses their KV instead of computing it again. The tree must
# find the longest cached prefix quickly, store new sequences without duplicating what it has, keep what running
# requests depend on, and give memory back, least recently used first, when the pool runs short.
#
# **Why it matters.** Real traffic repeats itself at the start. Every request to a chatbot begins with the same
# system prompt; every turn of a conversation resends the whole conversation so far; few-shot prompts share
# their examples; `n > 1` samples share the entire prompt. Chapter 03's engine recomputes all of it for every
# request. With a radix cache the shared part costs nothing after the first time: less prefill compute, a
# shorter time to first token, and one copy of the shared KV in memory instead of many. SGLang introduced the
# idea as *RadixAttention* (Zheng et al., "SGLang: Efficient Execution of Structured Language Model Programs",
# NeurIPS 2024); it is on by default there and here.
#
# The oracle does not move: with the radix cache on, the engine must still produce exactly the greedy tokens of
# chapter 00's loop, and the keys and values it reuses must be the ones a fresh computation would give.
#
# In this chapter you will:
#
# 1. see why a shared prefix has shared KV;
# 2. build a radix tree by hand: match, insert, split (tasks 4.1, 4.2);
# 3. pin what running requests use and evict the rest, least recently used first (task 4.3);
# 4. round everything to whole pages;
# 5. plug the tree into the engine: match, commit, release (task 4.4), and draw it before and after a request;
# 6. meet the pitfall of two requests computing the same new prefix in one batch;
# 7. read the hit rate, and order the queue by it (`lpm`);
# 8. check outputs and reused KV against the oracle, and measure prefill saved on a shared-prefix workload.

# %% tags=["setup"]
import json
import os
import random
import sys
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import Markdown, display

from minisgl_ref import LLM, SamplingParams
from minisgl_ref.book import show_code, show_table, wrap
from minisgl_ref.core.config import EngineConfig
from minisgl_ref.engine.engine import Engine
from minisgl_ref.kvcache import PageAllocator, RadixCache
from minisgl_ref.scheduler.cache_manager import CacheManager
from minisgl_ref.scheduler.scheduler import Scheduler

CHAPTER_START = time.perf_counter()

# Timings in this chapter use one CPU thread, as in chapters 00-03: on a small shared machine (ours has 2 cores,
# shared with other jobs) two OpenMP threads that wait for each other at every matmul make step times erratic.
# Set MINISGL_THREADS to try more.
torch.set_num_threads(int(os.environ.get("MINISGL_THREADS", "1")))


def edge_text(tokenizer, ids, limit: int = 28) -> str:
    """An edge's tokens as text (special tokens shown, newlines as ⏎), shortened to ``limit`` characters."""
    text = tokenizer.decode(ids, skip_special_tokens=False).replace("\n", "⏎")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def tree_as_text(tree: RadixCache, tokenizer) -> str:
    """Like ``RadixCache.pretty()``, with each edge's tokens decoded to text."""
    lines = []

    def walk(node, depth):
        for child in sorted(node.children.values(), key=lambda n: n.key):
            lines.append(f"{'    ' * depth}{edge_text(tokenizer, child.key)!r:<32} {len(child.key):>3} tok  "
                         f"lock={child.lock_ref}  slots {child.value[0].item()}..{child.value[-1].item()}")
            walk(child, depth + 1)

    walk(tree.root, 0)
    return "\n".join(lines) or "(empty)"


def tree_as_mermaid(tree: RadixCache, tokenizer) -> str:
    """The tree as mermaid source (paste it into a ```mermaid block or https://mermaid.live to draw it)."""
    out, ids = ["flowchart LR", '    n0(("root"))'], {id(tree.root): 0}

    def walk(node):
        for child in sorted(node.children.values(), key=lambda n: n.key):
            ids[id(child)] = len(ids)
            label = edge_text(tokenizer, child.key)
            label = label.replace('"', "#quot;").replace("<", "#lt;").replace(">", "#gt;")
            out.append(f'    n{ids[id(child)]}["{label}<br/>{len(child.key)} tok, lock {child.lock_ref}"]')
            out.append(f"    n{ids[id(node)]} --> n{ids[id(child)]}")
            walk(child)

    walk(tree.root)
    return "\n".join(out)


def show_mermaid(source: str) -> None:
    """Draw mermaid source: as a diagram in a notebook (and on this book's page), as text in a terminal."""
    if "ipykernel" in sys.modules:
        display(Markdown(f"```mermaid\n{source}\n```"))
    else:
        print(source, end="\n\n")


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, **kw)


# %%
# This chapter's engines: the radix cache on (the default), without what chapters 05 and 06 add. No chunked
# prefill, so a prompt is prefilled whole; no overlap scheduling, so each step() is schedule, run, process, and the
# tree we print is the tree after that step.
PLAIN = dict(chunked_prefill_size=-1, disable_overlap_schedule=True)

t0 = time.perf_counter()
naive = LLM(device="cpu", engine="naive")  # the chapter-00 oracle
llm = LLM(device="cpu", **PLAIN)  # the paged engine, radix cache on
tok, cfg = llm.tokenizer, llm.config
print(f"loaded the oracle and the paged engine in {time.perf_counter() - t0:.1f} s; "
      f"paged engine cache manager: {type(llm.engine.cache).__name__}")


def engine(**overrides) -> Engine:
    """A fresh paged engine around the same weights: radix cache on, no chunking, no overlap, a 4,096-token pool
    unless told otherwise."""
    config = PLAIN | dict(max_total_tokens=4096) | overrides
    return Engine(llm.model, cfg, EngineConfig(**config), context_length=llm.context_length)


warm = engine(disable_radix_cache=True)  # one-time costs out of later timings, before any cache is involved
warm.add_request(llm.make_request([1, 2, 3], greedy(2)))
warm.run_until_done()


# %% [markdown]
# ## 1. Shared prefixes, shared KV
#
# Here are three questions to the same assistant, written in SmolLM2's chat format:

# %%
SYSTEM = "You are a patient physics tutor. Answer in one short sentence."
QUESTIONS = ["What is gravity?", "Why is the sky blue?", "What is an atom?"]


def chat_ids(system: str, question: str) -> list[int]:
    return llm.chat_prompt_ids([{"role": "system", "content": system}, {"role": "user", "content": question}])


physics = [chat_ids(SYSTEM, q) for q in QUESTIONS]
shared = 0
while all(p[shared] == physics[0][shared] for p in physics):
    shared += 1
for p in physics:
    print(f"{len(p)} tokens: {edge_text(tok, p[:shared], 40)!r} + {edge_text(tok, p[shared:], 40)!r}")
print(f"the first {shared} tokens of all three are identical ({shared / np.mean([len(p) for p in physics]):.0%} "
      f"of each prompt)")

# %% [markdown]
# The key and value of token `i`, in every layer, are a function of tokens `0..i` and nothing else: that is the
# causal mask of chapter 00 again. So the K and V of those shared tokens are *the same numbers* in all three
# requests, and computing them three times is pure waste. With long system prompts (hundreds or thousands of
# tokens), multi-turn chats (each turn resends everything before it) or few-shot prompts, the shared part is most
# of the prompt.
#
# What we need is a dictionary from token *sequences* to the slots that hold their KV, which answers one question
# fast: *what is the longest prefix of this new request that is already cached?* A hash table of whole prompts
# cannot answer it; a **trie** (a prefix tree) can, by walking down from the root one token at a time. A **radix
# tree** is a trie whose edges hold whole runs of tokens instead of single ones, so that a 2,000-token system
# prompt is one edge and not 2,000 nodes:
#
# ```mermaid
# flowchart LR
#     root(("root")) --> S["⟨im_start⟩system⏎You are a patient physics tutor.<br/>Answer in one short sentence.⟨im_end⟩⏎⟨im_start⟩user⏎<br/>(shared by all three)"]
#     S --> W["What is"]
#     W --> G["gravity?⟨im_end⟩⏎⟨im_start⟩assistant⏎"]
#     W --> A["an atom?⟨im_end⟩⏎⟨im_start⟩assistant⏎"]
#     S --> B["Why is the sky blue?⟨im_end⟩⏎⟨im_start⟩assistant⏎"]
# ```
#
# Each node stores the KV slots of the tokens on the edge that leads into it, so the slots of any cached sequence
# are the concatenation of the values along its path. Section 5 builds exactly this tree from the three requests.
#
# ## 2. A radix tree by hand: match, insert, split (tasks 4.1, 4.2)
#
# `RadixCache` (`minisgl_ref/kvcache/radix.py`) needs only a `PageAllocator` (chapter 03), which it uses to give
# memory back when it evicts. We can play with it without a model: small integers stand in for token ids, and
# slots come from a real allocator, as they would from a prefill.

# %%
toy_alloc = PageAllocator(num_pages=64, page_size=1)
toy = RadixCache(toy_alloc)


def computed(tokens: list[int]) -> int:
    """Pretend a request just computed the KV of ``tokens``: give them slots and insert them into the toy tree.
    The tree keeps its own copy of any prefix it already had, so our slots for those are freed again."""
    slots = toy_alloc.alloc_tokens(0, 0, len(tokens))
    already = toy.insert(tokens, slots)
    toy_alloc.free_slots(slots[:already])
    return already


print("insert [1 2 3 4 5 6]   -> already cached:", computed([1, 2, 3, 4, 5, 6]))
print(toy.pretty())
print("insert [1 2 3 7 8]     -> already cached:", computed([1, 2, 3, 7, 8]))
print(toy.pretty())
match = toy.match_prefix([1, 2, 3, 4, 9])
print(f"match  [1 2 3 4 9]     -> {match.length} tokens cached, slots {match.slots.tolist()}, "
      f"node key {match.node.key}")
print(toy.pretty())
print("slots per edge:", {tuple(n.key): n.value.tolist() for n in toy._all_nodes()})
assert toy.pretty() == "\n".join([
    "[1, 2, 3] (3 tok, lock=0)",
    "  [4] (1 tok, lock=0)",
    "    [5, 6] (2 tok, lock=0)",
    "  [7, 8] (2 tok, lock=0)",
])

# %% [markdown]
# Three things happened:
#
# 1. The first insert made one edge, `[1 2 3 4 5 6]`, holding six slots.
# 2. The second sequence agrees with it for 3 tokens and then differs. The edge is **split** after its third
#    token: a new node `[1 2 3]` takes the first three tokens (and their slots), the old node keeps `[4 5 6]` and
#    becomes its child, and the new tokens `[7 8]` hang off the split point as a second child. `insert` returned
#    3: the caller's slots for those three tokens are duplicates and must be freed (our `computed` helper did).
# 3. The match of `[1 2 3 4 9]` walked `[1 2 3]`, then went one token into `[4 5 6]` and stopped. It splits that
#    edge too, so that the node it returns covers *exactly* the matched prefix: a request can then pin that node
#    (section 3) without pinning tokens it does not use.
#
# ```mermaid
# flowchart LR
#     root(("root")) --> a["1 2 3<br/>slots 1-3"]
#     a --> b["4<br/>slot 4"]
#     b --> c["5 6<br/>slots 5-6"]
#     a --> d["7 8<br/>slots 10-11"]
# ```
#
# (The second request's slots were 7-11; the three it had for `[1 2 3]` went back to the allocator, so the new
# edge `[7 8]` keeps slots 10 and 11.)
#
# Children are found by their first token (`_child_key`), so each step down the tree is one dictionary lookup
# plus a comparison along the edge. Here are the two operations and the split they share:

# %%
display(show_code(RadixCache.match_prefix, task="4.1"))
display(show_code(RadixCache.insert, task="4.2"))
show_code(RadixCache._split)

# %% [markdown]
# ## 3. Locking and LRU eviction (task 4.3)
#
# Cached KV occupies pool slots that new requests may need. The tree therefore gives memory back when the pool
# runs short: it **evicts** leaves, least recently used first (`last_access` is bumped on every match and insert
# that passes through a node), and a parent whose last child goes becomes a leaf, and a candidate, in turn.
#
# But some cached tokens must not go: those a *running* request is using as its prefix. Its page-table row points
# at the tree's slots, and attention reads them at every step. So a request **locks** the deepest node of its
# match, which pins that node and all its ancestors (`lock_ref` counts the requests pinning a node); eviction only
# considers unlocked leaves. The tree keeps two running totals the scheduler needs: `evictable_size` (tokens in
# unlocked nodes, which could be freed if needed) and `protected_size` (tokens pinned by running requests).

# %%
show_code(RadixCache.inc_lock, task="4.3")

# %% [markdown]
# Continue with the toy tree: one more sequence, then a request that uses `[1 2 3 4]` locks it, then we ask for
# memory.

# %%
print("insert [1 2 9 9]       -> already cached:", computed([1, 2, 9, 9]))
toy.inc_lock(match.node)  # a running request uses [1 2 3 4]
print(toy.pretty())
print(f"evictable {toy.evictable_size} tokens, protected {toy.protected_size}, free slots {toy_alloc.num_free_tokens}")
print(f"\nevict(3) freed {toy.evict(3)} tokens:")
print(toy.pretty())
print(f"\nevict(100) freed {toy.evict(100)} more; the locked path stays:")
print(toy.pretty())
assert toy.total_size == toy.protected_size == 4
toy.dec_lock(match.node)  # the request finished
print(f"\nafter unlocking, evict(100) freed {toy.evict(100)}; tree: {toy.pretty()}; "
      f"free slots {toy_alloc.num_free_tokens} of {toy_alloc.capacity_pages}")
assert toy_alloc.num_free_tokens == toy_alloc.capacity_pages

# %% [markdown]
# Read the first eviction carefully. The unlocked leaves were `[5 6]`, `[7 8]` and `[9 9]`; `[5 6]` had not been
# touched since the first insert, `[7 8]` since the second, and `[9 9]` was brand new, so `evict(3)` took `[5 6]`
# (2 tokens, not enough) and then `[7 8]`. Eviction frees whole leaves, so it may free a little more than asked.
# The second eviction took everything unlocked; the locked path `[1 2] → [3] → [4]` survived until its request
# let go. Notice also that inserting `[1 2 9 9]` split `[1 2 3]` into `[1 2]` and `[3]`. The node the request
# holds, `[4]`, did not change, and locking walks up through parent pointers, so the lock covered the new nodes
# too. (When an edge that is already locked gets split, the new upper node copies the lock count, for the same
# reason: every request that pinned the edge pins both halves.)
#
# ## 4. Whole pages
#
# With `page_size > 1` (chapter 03), the pool hands out memory in pages, and a page can have only one owner. The
# tree therefore works in whole pages: it stores, matches and evicts only multiples of `page_size` tokens, and
# children are keyed by their whole first page rather than their first token. A request whose prompt shares 7
# tokens with a cached one reuses only the first 4, with pages of 4:

# %%
paged_alloc = PageAllocator(num_pages=16, page_size=4)
paged_tree = RadixCache(paged_alloc)
seq = list(range(100, 110))  # 10 tokens: two whole pages and a half-full third
slots = paged_alloc.alloc_tokens(0, 0, len(seq))
print("insert 10 tokens -> already cached:", paged_tree.insert(seq, slots),
      "| stored:", paged_tree.total_size, "tokens")
paged_alloc.free_slots(slots[8:])  # the tree did not take the partial page: it is still ours to free
print(paged_tree.pretty())
for query in [seq[:7] + [0, 0], seq[:9] + [0]]:
    m = paged_tree.match_prefix(query)
    print(f"a query sharing {sum(a == b for a, b in zip(query, seq))} tokens -> matched {m.length}: "
          f"slots {m.slots.tolist()}")
assert paged_tree.match_prefix(seq[:7]).length == 4 and paged_tree.match_prefix(seq).length == 8

# %% [markdown]
# Larger pages make the cache coarser: up to `page_size - 1` tokens of a shared prefix are recomputed. With
# prompts of hundreds of tokens that is little; it is one of the trade-offs of chapter 03's page size.
#
# ## 5. The radix cache in the engine (task 4.4)
#
# The `CacheManager` (`minisgl_ref/scheduler/cache_manager.py`) connects the tree to the scheduler and the page
# table. For each request:
#
# ```mermaid
# ---
# config:
#   sequence:
#     mirrorActors: false
# ---
# sequenceDiagram
#     participant S as Scheduler
#     participant C as CacheManager
#     participant T as RadixCache
#     participant P as page table row
#     S->>C: match(req) on admission
#     C->>T: match_prefix(all tokens<br/>but the last)
#     T-->>C: slots of the longest cached<br/>prefix, deepest node
#     C->>T: inc_lock(node)
#     C->>P: write the prefix's slots<br/>(tree_len = matched length)
#     S->>C: alloc(req, n) for the tokens<br/>to compute (evicts if short)
#     Note over S: the prefill step is launched:<br/>it computes only the new tokens
#     S->>C: commit(req) right after the<br/>launch (the engine, chapter 06)
#     C->>T: insert(computed tokens, row),<br/>then free our duplicates
#     C->>P: repoint the row at the tree's<br/>slots, then move the lock down
#     S->>C: release(req) when it finishes<br/>(or is retracted)
#     C->>T: commit what was computed,<br/>then dec_lock
#     C->>C: free the slots the<br/>tree did not take
# ```
#
# Two details. `match` never matches the *last* token of a request, even if it is cached: the step needs that
# token's logits to produce the next token, so at least one token must go through the model. And the first
# `tree_len` slots of a row belong to the tree (shared, pinned), the rest to the request alone; `commit` is what
# moves the boundary:

# %%
show_code(CacheManager.commit, task="4.4")

# %% [markdown]
# Now the real thing: the three physics questions, one after the other, on an engine with the radix cache on.
# The first request finds nothing and computes everything; what the tree holds after it finishes, and how the
# second request uses it while it runs:

# %%
eng = engine()
first = llm.make_request(physics[0], greedy(8))
eng.add_request(first)
eng.run_until_done()
print(f"request 1: {len(first.input_ids)} prompt tokens, {first.cached_tokens} cached -> {first.output_text!r}")
print("tree after request 1 (RadixCache.pretty()):")
print(eng.cache.tree.pretty())
print("the same tree, decoded:")
print(tree_as_text(eng.cache.tree, tok))
tree_before = tree_as_mermaid(eng.cache.tree, tok)

second = llm.make_request(physics[1], greedy(8))
eng.add_request(second)
eng.step()  # the prefill of request 2
print(f"\nrequest 2 after its prefill: {second.cached_tokens} of {len(second.input_ids)} prompt tokens were cached; "
      f"the step computed {eng.stats.prefill_tokens - len(first.input_ids)} tokens")
print(tree_as_text(eng.cache.tree, tok))
eng.run_until_done()
third = llm.make_request(physics[2], greedy(8))
eng.add_request(third)
eng.run_until_done()
print(f"\nrequest 3: {third.cached_tokens} of {len(third.input_ids)} prompt tokens cached -> {third.output_text!r}")
print("tree after all three (locks released):")
print(tree_as_text(eng.cache.tree, tok))
tree_after = tree_as_mermaid(eng.cache.tree, tok)
assert second.cached_tokens == shared and third.cached_tokens > shared  # 3 also shares "What is" with 1
assert eng.cache.tree.protected_size == 0

# %% [markdown]
# Follow the locks. While request 2 runs, the path it uses has `lock=1`: the shared system-prompt edge (split
# off request 1's edge at the first token where the prompts differ) and its own new tokens, which `commit`
# inserted right after its prefill so that any later request could already share them. Request 1's branch,
# finished, sits there unlocked, evictable if memory runs short. Request 3 shares `What is` with request 1 as
# well, so it matched two more tokens and split that branch once more. Drawn from the live tree by the helper
# `tree_as_mermaid` (mermaid source, printed as text when the chapter runs in a terminal), before request 2 and
# after request 3:

# %%
show_mermaid(tree_before)
show_mermaid(tree_after)

# %% [markdown]
# ```mermaid
# ---
# config:
#   flowchart:
#     rankSpacing: 30
# ---
# flowchart TB
#     subgraph before["after request 1"]
#         direction LR
#         r1(("root")) --> a1["⟨im_start⟩system⏎You are a patient physics tutor. …<br/>… user⏎What is gravity?⟨im_end⟩⏎⟨im_start⟩assistant⏎<br/>31 tok, slots 1-31"]
#         a1 --> b1["Gravity is a fundamental concept in<br/>7 tok, slots 32-38"]
#     end
#     subgraph after["after requests 2 and 3"]
#         direction LR
#         r2(("root")) --> s2["⟨im_start⟩system⏎You are a patient physics tutor. …<br/>… ⟨im_start⟩user⏎<br/>21 tok, slots 1-21"]
#         s2 --> w2["What is<br/>2 tok, slots 22-23"]
#         w2 --> g2["gravity?⟨im_end⟩⏎⟨im_start⟩assistant⏎<br/>8 tok, slots 24-31"]
#         g2 --> ga2["Gravity is a fundamental concept in<br/>7 tok, slots 32-38"]
#         w2 --> at2["an atom?⟨im_end⟩⏎⟨im_start⟩assistant⏎<br/>9 tok"]
#         at2 --> aa2["An atom is the smallest unit of<br/>7 tok"]
#         s2 --> y2["Why is the sky blue?⟨im_end⟩⏎⟨im_start⟩assistant⏎<br/>12 tok"]
#         y2 --> ya2["The answer to this question is a<br/>7 tok"]
#     end
#     before ~~~ after
# ```
#
# Note that no slot moved: splitting an edge only cuts its list of slots in two. Request 1's 31 prompt slots
# are now spread over three nodes, still holding the same K and V.
#
# Finished requests also leave their *answers* in the tree (`release` commits every token whose KV was computed:
# the prompt and all but the last output token). That is what makes multi-turn chat cheap: the next turn's prompt
# is the previous prompt, the previous answer and the new user message, and all but the last part is a cache hit.
#
# ## 6. The pitfall: a new prefix shared inside one batch
#
# The tree learns a prefix only when a request that computed it *commits*, after its prefill step. If two
# requests with the same *new* system prompt arrive together, both are matched against a tree that does not have
# it yet, both are admitted to the same prefill step, and both compute it. The compute is wasted, and we cannot
# get it back; memory is another matter. Here is what `commit` does about the duplicate copies:

# %%
COOKING = "You are a friendly cooking assistant. Suggest one simple recipe."
pair = [llm.make_request(chat_ids(COOKING, q), greedy(4)) for q in ["I have eggs and rice.", "I have pasta."]]
eng = engine(in_batch_prefix_threshold=-1)  # the in-batch check of task 4.5 (below) off: the pitfall on its own
rows_log = []
run = eng.runner.run
# instrument: the rows of every step
eng.runner.run = lambda batch: rows_log.append([row.extend_len for row in batch.rows]) or run(batch)
for r in pair:
    eng.add_request(r)
free_before = eng.allocator.num_free_tokens
eng.step()  # one prefill step for both
common = next(i for i, (a, b) in enumerate(zip(pair[0].input_ids, pair[1].input_ids)) if a != b)
row_a = eng.req_to_token.read(pair[0].req_pool_idx, pair[0].kv_allocated_len)
row_b = eng.req_to_token.read(pair[1].req_pool_idx, pair[1].kv_allocated_len)
print(f"prompts of {len(pair[0].input_ids)} and {len(pair[1].input_ids)} tokens, the first {common} shared, "
      f"neither cached:")
print(f"the prefill step computed {rows_log[0]} tokens")
print(f"slots in use after the step: {free_before - eng.allocator.num_free_tokens} "
      f"(= {len(pair[0].input_ids)} + {len(pair[1].input_ids)} - {common} duplicates freed by commit)")
print(f"row A: {row_a[:4].tolist()} ... {row_a[common - 2:common + 2].tolist()} ...")
print(f"row B: {row_b[:4].tolist()} ... {row_b[common - 2:common + 2].tolist()} ...")
assert torch.equal(row_a[:common], row_b[:common])  # both rows now point at one copy of the shared KV
assert free_before - eng.allocator.num_free_tokens == len(pair[0].input_ids) + len(pair[1].input_ids) - common
print(tree_as_text(eng.cache.tree, tok))
eng.run_until_done()

# %% [markdown]
# Both requests computed the shared tokens (the step's rows are the two full prompts). Then, after the step,
# `commit` ran for each. Request A inserted its prompt into an empty tree. Request B's `insert` found the first
# `common` tokens already there and returned that count; `commit` freed B's own slots for them and rewrote B's
# page-table row to point at A's slots, holding identical K and V. From then on, one copy. (With overlap
# scheduling, chapter 06, B's freed slots wait one more step, because the step in flight may still read them.)
#
# The compute, though, was spent twice. It can be avoided at admission time: while the scheduler fills a prefill
# step, it also compares each candidate with the requests it has *already admitted to this step*. If one of
# them is computing a long stretch of the candidate's uncached prompt, the candidate waits one step: the engine
# commits a prefill row's tokens to the tree as soon as its step is launched (`Engine._commit_launched`, chapter
# 06 explains why that is safe), so one step later the candidate finds them cached. This is SGLang's *in-batch
# prefix caching* (the `IN_BATCH_PREFIX_CACHING_*` thresholds of its `schedule_policy.py`, used there under
# `lpm`; here under both policies). Task 4.5:

# %%
show_code(Scheduler._defer_for_in_batch_prefix, task="4.5")

# %% [markdown]
# Waiting costs the held-back request one step of latency, which is only worth it for a long shared stretch:
# `EngineConfig.in_batch_prefix_threshold` (32 tokens, as in SGLang; `-1` switches the check off, as we did for
# the cooking pair above). That pair shares only 22 tokens, below the threshold: with the check on, both would
# still have computed them. With a longer system prompt the second request is held back (and keeps its request
# slot for the next step, so that requests of other prompts do not take it meanwhile, chapter 11):

# %%
LONG_COOKING = COOKING + " Always list the ingredients first, then the steps, and keep every step short and clear."
long_pair_ids = [chat_ids(LONG_COOKING, q) for q in ["I have eggs and rice.", "I have pasta."]]
long_common = next(i for i, (a, b) in enumerate(zip(*long_pair_ids)) if a != b)
in_batch = {}
for threshold in (32, -1):
    eng = engine(in_batch_prefix_threshold=threshold)
    prefill_rows, run = [], eng.runner.run
    eng.runner.run = lambda b, run=run, rows=prefill_rows: rows.append(
        [row.extend_len for row in b.rows if not row.is_decode]) or run(b)  # instrument
    reqs = [llm.make_request(ids, greedy(3)) for ids in long_pair_ids]
    for r in reqs:
        eng.add_request(r)
    eng.run_until_done()
    in_batch[threshold] = (eng.stats.prefill_tokens, [r.output_ids for r in reqs])
    print(f"threshold {threshold:>2}: prefill rows per step {[rows for rows in prefill_rows if rows]}, "
          f"cached {[r.cached_tokens for r in reqs]}, prefill tokens {eng.stats.prefill_tokens}")
print(f"the two prompts share their first {long_common} tokens")
assert in_batch[32][0] == in_batch[-1][0] - long_common and in_batch[32][1] == in_batch[-1][1]

# %% [markdown]
# With the check on, the first step prefills one prompt and the second request, one step later, computes only
# its own question; with it off, both compute the shared prompt in one step and `commit` frees the duplicate.
# Same tokens either way. Pairs like this one are common under load: many users of one application send the
# same new system prompt within milliseconds of each other, right after a deployment or a cache flush.
#
# ## 7. Hit rate, and longest-prefix-match scheduling
#
# The tree counts, at every admission, how many prompt tokens were asked for and how many were found
# (`RadixCache.record_lookup`, called by the scheduler), and each request remembers its own `cached_tokens`
# (returned by `LLM.generate` as `GenerateOutput.cached_tokens`, like SGLang's `cached_tokens` in the usage
# of its OpenAI API). The hit rate is token-weighted: the fraction of all prompt tokens that did not have to be
# computed.
#
# The *order* in which waiting requests are admitted affects that rate. First come, first served (`fcfs`) ignores
# the cache. **Longest prefix match** (`schedule_policy="lpm"`) admits first the requests with the longest cached
# prefix: they are cheap to prefill, and serving them *now* uses their prefix before eviction can take it away.

# %%
show_code(Scheduler._ordered_waiting)

# %% [markdown]
# A small stress test shows the difference. Two groups of requests, A and B, each with its own 48-token system
# prompt, arrive interleaved `A B A B A B`. The engine runs one request at a time (`max_running_requests=1`) and
# its pool (96 tokens) can keep only one group's prompt cached while the next request runs, so every switch of
# group evicts the other one.

# %%
random.seed(1)
group_prompts = {g: [random.randint(1000, 20000) for _ in range(48)] for g in "AB"}
interleaved = [(g, group_prompts[g] + [random.randint(1000, 20000) for _ in range(8)]) for g in "ABABAB"]


def run_policy(policy: str):
    e = engine(max_total_tokens=96, max_running_requests=1, schedule_policy=policy)
    order, run = [], e.runner.run
    reqs = [llm.make_request(ids, greedy(3, ignore_eos=True)) for _, ids in interleaved]
    group_of = {r.rid: g for r, (g, _) in zip(reqs, interleaved)}
    e.runner.run = lambda b: order.extend(group_of[row.req.rid] for row in b.rows if not row.is_decode) or run(b)
    for r in reqs:
        e.add_request(r)
    e.run_until_done()
    return e, reqs, "".join(order)


policy_rows = []
for policy in ["fcfs", "lpm"]:
    e, reqs, order = run_policy(policy)
    policy_rows.append((policy, " ".join(order), str([r.cached_tokens for r in reqs]), e.stats.prefill_tokens,
                        f"{e.cache.hit_rate:.0%}"))
    if policy == "fcfs":
        fcfs_prefill, fcfs_out = e.stats.prefill_tokens, [r.output_ids for r in reqs]
    else:
        lpm_prefill, lpm_out = e.stats.prefill_tokens, [r.output_ids for r in reqs]
assert lpm_out == fcfs_out and lpm_prefill < fcfs_prefill
display(show_table(policy_rows, headers=["policy", "admitted in order", "cached tokens per request (arrival order)",
                                         "prefill tokens", "hit rate"]))
print(f"lpm computed {fcfs_prefill / lpm_prefill:.1f}x fewer prefill tokens, same outputs")

# %% [markdown]
# With `fcfs` every request finds the other group's prompt in the cache and nothing of its own: zero hits. `lpm`
# notices, after the first A, that the other two A requests have 48 cached tokens and B requests none, serves
# the As back to back, then the Bs. Same outputs, far less prefill. The price of `lpm` is fairness (a request
# with no cached prefix can wait while luckier ones overtake it) and a tree lookup per waiting request per step;
# SGLang switches from `lpm` to `fcfs` while more than 128 requests wait, for that reason.

# ### A cache shared by strangers: `cache_salt`
#
# A shared cache leaks a little information: a request whose prefix was cached answers its first token sooner,
# so a client who can time the server can learn whether *someone else* recently sent the same system prompt
# or document. Servers used by several tenants therefore let a request carry a `cache_salt` (SGLang and vLLM
# both accept the field): requests share cached prefixes only with requests of the same salt. Here each salt
# gets a root of its own (`RadixCache.root_for`); matching, insertion, locking and eviction work below any root
# exactly as below the common one, and a salt's root goes away when eviction has taken its last prefix.

# %%
salted = engine()
prompt = [random.randint(1000, 20000) for _ in range(40)]
for salt in ["tenant-a", "tenant-b", "tenant-a", None]:
    r = llm.make_request(prompt, greedy(2, ignore_eos=True), cache_salt=salt)
    salted.add_request(r)
    salted.run_until_done()
    print(f"salt {salt!s:<9} -> cached tokens {r.cached_tokens}")
    if salt == "tenant-b":
        assert r.cached_tokens == 0  # the same prompt, sent by another tenant a moment earlier: not shared
print("salted roots:", sorted(salted.cache.tree.salted_roots))

# %% [markdown]
# ## 8. The oracle check
#
# Two checks. First, the tokens: the three physics questions and the two cooking questions go to `llm`'s engine
# (radix cache on) one after another, so that the later ones hit the cache; and again to an engine with pages of
# 4. Both must give exactly the naive loop's greedy tokens, which has no cache at all.

# %%
oracle_prompts = physics + [chat_ids(COOKING, q) for q in ["I have eggs and rice.", "I have pasta."]]
params = greedy(6)
oracle = naive.generate(oracle_prompts, params, use_tqdm=False)  # all at once: batching changes nothing (ch. 00)
default_out = [llm.generate([p], params, use_tqdm=False)[0] for p in oracle_prompts]  # one after another
page4 = engine(page_size=4)
page4_reqs = [llm.make_request(p, params) for p in oracle_prompts]
for r in page4_reqs:
    page4.add_request(r)
    page4.run_until_done()
display(show_table([
    (o.prompt_tokens, d.cached_tokens, r.cached_tokens, d.output_ids == o.output_ids, r.output_ids == o.output_ids,
     repr(o.text)) for o, d, r in zip(oracle, default_out, page4_reqs)
], headers=["prompt tokens", "cached (page 1)", "cached (page 4)", "same as oracle (page 1)",
            "same as oracle (page 4)", "text"]))
agree = sum(d.output_ids == o.output_ids for o, d in zip(oracle, default_out))
agree4 = sum(r.output_ids == o.output_ids for o, r in zip(oracle, page4_reqs))
print(f"identical greedy outputs: radix (page 1) {agree}/{len(oracle)}, radix (page 4) {agree4}/{len(oracle)}; "
      f"hit rate {llm.engine.cache.hit_rate:.0%} / {page4.cache.hit_rate:.0%}")
assert agree == agree4 == len(oracle)
assert sum(d.cached_tokens for d in default_out) > 0 and all(r.cached_tokens % 4 == 0 for r in page4_reqs)

# %% [markdown]
# Second, the cache itself. The physics system prompt is now in `llm`'s tree, its KV computed as
# part of the first question's prefill. We compute it again from scratch, alone, in a fresh engine without a
# radix cache, and compare the two copies in the pool, layer by layer.

# %%
prefix = physics[0][:shared]
cached = llm.engine.cache.tree.match_prefix(prefix)
assert cached.length == shared
fresh_engine = engine(disable_radix_cache=True, max_total_tokens=256)
fresh_req = llm.make_request(prefix, greedy(2))
fresh_engine.add_request(fresh_req)
fresh_engine.step()  # its prefill: the KV of exactly these tokens, computed in one pass of their own
fresh_slots = fresh_engine.req_to_token.read(fresh_req.req_pool_idx, shared)
cached_pool, fresh_pool = llm.engine.kv_pool, fresh_engine.kv_pool
kv_err = max(
    max((cached_pool.k[layer][cached.slots] - fresh_pool.k[layer][fresh_slots]).abs().max().item(),
        (cached_pool.v[layer][cached.slots] - fresh_pool.v[layer][fresh_slots]).abs().max().item())
    for layer in range(cfg.num_layers)
)
scale = max(cached_pool.k[layer][cached.slots].abs().max().item() for layer in range(cfg.num_layers))
print(f"{shared} cached tokens x {cfg.num_layers} layers: max |K or V difference| {kv_err:.1e} "
      f"(largest |K| is {scale:.0f})")
assert kv_err < 1e-3
fresh_engine.run_until_done()

# %% [markdown]
# The cached copy was computed inside a longer prefill (the 31 tokens of the first question), the fresh one in a
# pass of its own, with other matrix shapes. On this CPU the two agree to the last bit; in general (other
# kernels, a GPU, bf16) a different shape may change the order of additions and so the last bits, which is why
# the check allows float32 rounding. What the oracle promises is equality of the greedy tokens, and that holds.
#
# ## 9. Measure: a shared-prefix workload
#
# SGLang's shared-prefix workload: `G` groups of `P` requests; each prompt is its group's system prompt of `S`
# tokens followed by a question of `Q` tokens; `O` output tokens each. Requests arrive one per engine step, in
# random order, the way a server receives them. We serve it through `LLM`'s engine twice, with
# `disable_radix_cache=True` and with the radix cache on (no chunking, no overlap, as everywhere in this
# chapter), and compare the tokens prefilled (`engine.stats.prefill_tokens`) and the time. If each system prompt
# were computed exactly once, prefill would be `G(S+Q) + (GP-G)Q` tokens; that is the ideal to compare with.

# %%
G, P, S, Q, O = 3, 3, 192, 8, 3
random.seed(0)
systems = [[random.randint(1000, 20000) for _ in range(S)] for _ in range(G)]
workload = [(g, systems[g] + [random.randint(1000, 20000) for _ in range(Q)]) for g in range(G) for _ in range(P)]
random.shuffle(workload)
work_params = greedy(O, ignore_eos=True)


def serve(**config):
    """Arrivals one per step, through an LLM whose engine is rebuilt around the same weights."""
    llm.engine = Engine(llm.model, cfg, EngineConfig(**config), context_length=llm.context_length)
    reqs = [llm.make_request(ids, work_params) for _, ids in workload]
    pending = list(reqs)
    w0, c0 = time.perf_counter(), time.process_time()
    while pending or llm.engine.has_work:
        if pending:
            llm.engine.add_request(pending.pop(0))
        llm.engine.step()
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    hit = llm.engine.cache.hit_rate if llm.engine.cache.shares_prefixes else 0.0
    return dict(reqs=reqs, prefill=llm.engine.stats.prefill_tokens, wall=wall, cpu=cpu, hit=hit)


runs = {"radix off": serve(**PLAIN, disable_radix_cache=True), "radix on": serve(**PLAIN)}
off, on = runs["radix off"], runs["radix on"]
ideal = G * (S + Q) + (G * P - G) * Q
print(f"{G} groups x {P} requests, system prompt {S} + question {Q} tokens, {O} output tokens")
print(f"arrival order by group: {' '.join(str(g) for g, _ in workload)}")
display(show_table([
    (name, r["prefill"], f"{r['wall']:.1f}", f"{r['cpu']:.1f}", f"{r['hit']:.0%}",
     str([q.cached_tokens for q in r["reqs"]]))
    for name, r in runs.items()
], headers=["run", "prefill tokens", "wall s", "CPU s", "hit rate", "cached per request"]))
print(f"ideal: {ideal} prefill tokens (each system prompt computed once)")
print(f"radix on vs off: {off['prefill'] / on['prefill']:.1f}x fewer prefill tokens, "
      f"{off['wall'] / on['wall']:.1f}x wall, {off['cpu'] / on['cpu']:.1f}x CPU time")
for r in runs.values():
    assert [q.output_ids for q in r["reqs"]] == [q.output_ids for q in off["reqs"]]
assert on["prefill"] < off["prefill"] and off["prefill"] == G * P * (S + Q)
assert on["prefill"] == ideal  # true for this arrival order: see the note about overlap below

# %% alt="Horizontal bar chart of prompt tokens computed: 1,800 without the radix cache, 648 with it, the same as the ideal bar where each system prompt is computed once." caption="Prefill tokens on the shared-prefix workload: radix cache off, on, and the ideal of one computation per system prompt." tags=["hide-input"]
fig, ax = plt.subplots(figsize=(8, 2.8))
bars = {name: r["prefill"] for name, r in runs.items()}
bars["ideal: each system\nprompt once"] = ideal
ax.barh(list(bars), list(bars.values()), color=["gray", "C0", "lightgray"])
for i, v in enumerate(bars.values()):
    ax.text(v, i, f" {v}", va="center", fontsize=9)
ax.invert_yaxis()
ax.set_xlabel("prompt tokens computed (prefill)")
ax.set_title(f"shared-prefix workload: {G} groups x {P} requests, S={S}, Q={Q}, one arrival per step", fontsize=10)
fig.tight_layout()
plt.show()

# %% [markdown]
# In Figure 4.1 the radix cache cuts prefill by the factor printed above: every request after the first of its group
# recomputes only its question. The time drops by less, because decode steps and the fixed cost of each forward
# pass are unchanged; with longer system prompts (thousands of tokens are common) prefill dominates and the
# time ratio approaches the token ratio.
#
# How much the cache saves depends on how much the requests share. The toy tree of section 2 shows it without a
# model: groups of `P` requests whose prompts (128 tokens) start with a common part, a fraction `f` of the
# prompt, arrive in random order; each is matched against the tree, then inserted. In Figure 4.2, compare the dots
# with the lines `(P-1)/P x f`: the first request of a group always misses, every later one hits its whole shared
# part.

# %% alt="Line chart of the radix hit rate against the shared fraction f of each prompt, from 0 to 1: for 1, 2, 4 and 8 requests per prefix the measured dots sit on straight lines of slope (P-1)/P, from a flat zero for single requests up to 0.875 at f = 1 for groups of 8." caption="Radix-cache hit rate against the shared fraction of each prompt, for groups of 1 to 8 requests per prefix (the tree alone, no model)."
def sharing_hit_rate(group_size: int, shared_frac: float, groups: int = 4, length: int = 128) -> float:
    """Token-weighted hit rate of a RadixCache on a shared-prefix workload (no model: the tree alone)."""
    rng = random.Random(group_size * 1000 + round(100 * shared_frac))
    shared = round(shared_frac * length)
    heads = [[rng.randint(1000, 20000) for _ in range(shared)] for _ in range(groups)]
    prompts = [h + [rng.randint(1000, 20000) for _ in range(length - shared)]
               for h in heads for _ in range(group_size)]
    rng.shuffle(prompts)
    alloc = PageAllocator(num_pages=len(prompts) * length + 1, page_size=1)  # page 0 is reserved
    tree, hits = RadixCache(alloc), 0
    for tokens in prompts:
        hits += tree.match_prefix(tokens).length
        slots = alloc.alloc_tokens(0, 0, len(tokens))
        alloc.free_slots(slots[: tree.insert(tokens, slots)])
    return hits / (len(prompts) * length)


fracs = [0.0, 0.25, 0.5, 0.75, 0.9, 1.0]
fig, ax = plt.subplots(figsize=(7, 3.8))
for i, group_size in enumerate((1, 2, 4, 8)):
    ax.plot(fracs, [(group_size - 1) / group_size * f for f in fracs], color=f"C{i}", lw=1, alpha=0.6)
    ax.plot(fracs, [sharing_hit_rate(group_size, f) for f in fracs], "o", color=f"C{i}",
            label=f"{group_size} request{'s' if group_size > 1 else ''} per prefix")
ax.set_xlabel("shared fraction of each prompt, f")
ax.set_ylabel("radix hit rate (prompt tokens)")
ax.set_title("Radix cache hit rate against sharing (dots: measured on the tree; lines: (P-1)/P x f)",
             fontsize=9)
ax.legend(fontsize=8)
ax.grid(alpha=0.3)
fig.tight_layout()
plt.show()

# %% [markdown]
# Every dot of Figure 4.2 sits on its line: the tree finds each shared prefix, in whatever order the requests
# come.
#
# One detail matters once overlap scheduling (chapter 06) is on, as it is by default: the CPU then schedules step
# `N+1` *before* it processes step `N`'s results. Had `commit` waited for that processing, a request would be
# matched against a tree that does not yet hold the prefix computed one step earlier, and two requests of one
# group arriving back to back would both miss. The engine therefore commits prefill rows when their step is
# *launched*: any later step that reads those slots runs after the step that writes them. With overlap on, this
# workload reaches the ideal all the same.
#
# The same comparison at a larger scale, and across the whole stage ladder of chapter 11, comes from the offline
# benchmark: `python -m minisgl_ref bench offline --quick --workload shared-prefix --stage all` (4 groups x 8
# requests, 480-token system prompts, 32-token questions, 4 output tokens, all submitted at once to
# `LLM.generate`). One CPU run of it is committed in `docs/data/bench_offline_quick_shared_prefix_cpu.json`,
# with the machine and the command that made it; we read it rather than run it again:

# %%
bench_file = next(p / "docs/data/bench_offline_quick_shared_prefix_cpu.json" for p in [Path.cwd(), *Path.cwd().parents]
                  if (p / "docs/data/bench_offline_quick_shared_prefix_cpu.json").is_file())
bench = json.loads(bench_file.read_text())
prov = bench["provenance"]
print(wrap(prov["command"]))
print(f"{prov['hardware']['cpu']} ({prov['hardware']['cpu_count']} cores), torch "
      f"{prov['software']['torch']}, {prov['date'][:10]}; workload: {bench['workload']['requests']} requests, "
      f"{bench['workload']['input_tokens']:,} prompt tokens")
print(f"{'stage':<8} {'prefill tokens':>14} {'cached':>7} {'hit rate':>8} {'wall s':>7} {'out tok/s':>9}")
by_stage = {r["stage"]: r for r in bench["results"]}
for r in bench["results"]:
    hit = "-" if r["radix_hit_rate"] is None else f"{r['radix_hit_rate']:.0%}"
    print(f"{r['stage']:<8} {r['prefill_tokens']:>14,} {r['cached_tokens']:>7,} {hit:>8} {r['wall_s']:>7.2f} "
          f"{r['output_throughput']:>9.1f}")
paged_run, radix_run = by_stage["paged"], by_stage["radix"]
print(f"radix vs paged: {paged_run['prefill_tokens'] / radix_run['prefill_tokens']:.1f}x fewer prefill tokens, "
      f"{radix_run['output_throughput'] / paged_run['output_throughput']:.1f}x the throughput, in one run")
assert paged_run["prefill_tokens"] >= 3 * radix_run["prefill_tokens"]

# %% [markdown]
# The radix stage computes each system prompt once (4 x 480 tokens) plus every question (32 x 32): the ideal.
# That is thanks to both mechanisms of this chapter's last sections: the requests of one group that land in the
# same prefill step are held back a step by the in-batch check, and the prefix is in the tree by the time they
# come back. (The naive stage recomputes every sequence at every step, chapter 00. The chunked and overlap
# stages, chapters 05 and 06, compute the same tokens; on a CPU they cannot make this workload faster, only a
# little slower: more, smaller steps, and nothing for overlap to run in parallel with.)

# %% [markdown]
# ## Summary
#
# * **KV that outlives requests.** A radix tree keyed on token ids maps every cached sequence to its slots;
#   `match` finds the longest cached prefix and `insert` adds a sequence, both splitting an edge where sequences
#   part (tasks 4.1, 4.2).
# * **Pin and evict.** A running request locks the deepest node of its match and all its ancestors; when the pool
#   runs short, unlocked leaves go, least recently used first (task 4.3). With pages, everything is rounded to
#   whole pages.
# * **In the engine** (task 4.4). `match` never takes a request's last token, `commit` inserts a prefill's tokens,
#   and `release` leaves the answer in the tree too, which makes the next turn of a chat nearly all cache hits.
# * **One new prefix, two requests in one batch.** `commit` frees the duplicate copy; better, admission holds back
#   a request that would compute at least 32 tokens another row of the same step is computing, and it finds them
#   cached one step later (task 4.5).
# * **Order and isolation.** Longest-prefix-match (`lpm`) serves requests whose prefix is cached first, where
#   first come, first served can miss every time; `cache_salt` gives each tenant a root of its own.
# * **The oracle and the gain.** Same greedy tokens as the naive loop, and the reused KV matches a fresh
#   computation. On the shared-prefix benchmark the radix stage computes each of the 4 system prompts once (4 x
#   480 tokens) plus the 32 questions: the ideal.
# * **Next.** Chapter 05 decides how much prompt a step may take; chapter 06 commits prefill rows as soon as their
#   step is launched, so sharing keeps up under overlap.

# %% [markdown]
# ## Exercises
#
# Each task is a marked region (`# BEGIN TASK 4.n` ... `# END TASK 4.n`) whose function's docstring says what
# to write; `python -m minisgl_ref.course grade --task 4.n` runs its tests, and `--chapter 4` runs all five.
#
# 1. **Task 4.1 (match).** Write the body of `RadixCache.match_prefix` (`_split` and `_common_len` are given).
#    Check it against the toy sequences of section 2, then grade it with
#    `python -m minisgl_ref.course grade --task 4.1`. Its tests build small trees by hand, so they do not need
#    your `insert`.
# 2. **Task 4.2 (insert).** Write the body of `RadixCache.insert`, then grade it with
#    `python -m minisgl_ref.course grade --task 4.2`. Why must it return the number of tokens it already had,
#    rather than the number it added?
# 3. **Task 4.3 (locks and eviction).** Write the bodies of `inc_lock`, `dec_lock` and `evict`, then grade them
#    with `python -m minisgl_ref.course grade --task 4.3`. What breaks if `evict` may take a locked leaf?
#    Construct the failure with the toy tree: which request's KV is overwritten, and by whom?
# 4. **Task 4.4 (commit).** Write the body of `CacheManager.commit`, then grade it with
#    `python -m minisgl_ref.course grade --task 4.4` (among its checks, a state machine that checks after every
#    operation that a request's row points at the tree for its shared part, and the engine against the oracle).
#    Then break it on purpose: skip the repointing of the page-table row (`req_to_token.write`). Which check of
#    this chapter fails first, the slot count of section 6 or the oracle of section 8, and what would happen on a
#    long-running server? Once chapter 06's overlap scheduling is in, move the commit from
#    `Engine._commit_launched` to `Engine._process` and rerun section 9 with the arrival order
#    `0 0 1 1 2 2 0 1 2`, with overlap off and on: count the misses.
# 5. **Task 4.5 (in-batch prefix caching).** Write the body of `Scheduler._defer_for_in_batch_prefix`, then grade
#    it with `python -m minisgl_ref.course grade --task 4.5`. Then submit section 9's workload all at once with
#    `generate` of a fresh `LLM(device="cpu", **PLAIN)`, with `in_batch_prefix_threshold` set to -1, 8, 32 and
#    256: how do the prefill tokens and the number of steps change? What would a threshold of 1 cost a request
#    whose only overlap is a one-token chat-template prefix?

# %% [markdown]
# ## Reproduce
#
# ```bash
# python chapters/04_radix_cache.py                       # this chapter, end to end
# python -m minisgl_ref.course grade --chapter 4          # the graded tests of tasks 4.1-4.5
# python -m pytest tests/test_radix.py tests/test_kvcache_properties.py   # the same tests, and the allocator's
# ```
#
# Measured on a 2-core x86_64 CPU (shared with other jobs), no GPU, Python 3.11, torch 2.13 (CPU), one torch
# thread, SmolLM2-135M-Instruct in float32.
#
# | what | measured |
# | --- | --- |
# | three chat prompts with one system prompt (31-33 tokens) | 21 tokens shared; requests 2 and 3 found 21 and 23 cached |
# | two new prompts sharing 22 tokens, one prefill step | 62 tokens computed; 40 slots kept after `commit` (22 duplicates freed) |
# | `lpm` vs `fcfs`, 2 groups x 3 requests, 48-token prefixes, 96-token pool | prefill 144 vs 336 tokens (2.3x), hit rate 57% vs 0%, same outputs |
# | oracle: 5 chat prompts, 6 greedy tokens, radix on, page size 1 and 4 | 5/5 and 5/5 identical to the naive loop (hit rate 46% / 41%) |
# | cached KV of a 21-token prefix vs recomputed, 30 layers | max difference 0.0 (bitwise equal on this CPU) |
# | two new prompts sharing 40 tokens, in-batch check on / off | prefill 58 tokens (the second waits one step, 40 cached) / 98 tokens |
# | offline bench, quick shared-prefix (4 x 8, S=480, Q=32), paged vs radix, one CPU run | prefill 16,384 vs 2,944 tokens (5.6x); 17.5 vs 65.3 output tok/s (3.7x) |
# | shared-prefix workload (3 x 3, S=192, Q=8, O=3), prefill tokens | 1,800 without the radix cache, 648 with it (2.8x; the ideal is 648) |
# | same workload, CPU time | 5.7-5.9 s vs 2.7-2.8 s (2.1-2.2x); wall 2.1-2.2x |
# | whole chapter, `python chapters/04_radix_cache.py` | 33 s of CPU time; 76-118 s wall, the cores heavily shared |
#
# Wall-clock times on a shared machine vary from run to run; token counts do not. The last cell prints this
# run's numbers.

# %%
print(wrap(f"this run: shared-prefix workload prefill {off['prefill']} -> {on['prefill']} tokens "
           f"({off['prefill'] / on['prefill']:.1f}x), wall {off['wall']:.1f} -> {on['wall']:.1f} s "
           f"({off['wall'] / on['wall']:.1f}x), CPU {off['cpu']:.1f} -> {on['cpu']:.1f} s "
           f"({off['cpu'] / on['cpu']:.1f}x), hit rate {on['hit']:.0%} (ideal {ideal}); lpm vs fcfs prefill "
           f"{lpm_prefill} vs {fcfs_prefill}; oracle {agree}/{len(oracle)} and {agree4}/{len(oracle)}, cached KV "
           f"max diff {kv_err:.1e}; chapter ran in {time.perf_counter() - CHAPTER_START:.0f} s"))
