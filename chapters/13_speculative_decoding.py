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
# # Chapter 13 — Speculative decoding
#
# **What you will build.** The two pieces of speculative decoding that decide whether the output stays exactly
# what plain decoding gives: a draft tree's depths and attention mask (task 13.2, `DraftTree.depths` and
# `DraftTree.mask` in `minisgl_ref/speculative/tree.py`), and the acceptance rule (task 13.1, `walk` and its two
# rules in `minisgl_ref/speculative/accept.py`). A cheap *proposer* guesses the next few tokens of a request, the
# target model checks all of them in one forward pass, and the request keeps the guesses the target agrees with,
# plus one token of the target's own.
#
# **Why it matters.** At small batch a decode step is paced by reading the model's weights, not by arithmetic
# (chapter 11): the step that scores one token per request could score five per request for about the same time.
# If four of those five were good guesses, one step would do the work of several. The trick is to use that idle
# arithmetic without changing a single output token: greedy text stays the same text, and sampled text keeps
# exactly the distribution the model gives it.
#
# In this chapter you will:
#
# 1. work out, from bytes and FLOPs, when verifying several tokens costs one decode step, and what speed-up to
#    expect from an accept length and a batch size;
# 2. build a draft tree, its attention mask and its positions (task 13.2), and check that one masked verify row
#    gives every path's logits;
# 3. derive the acceptance rule, greedy and sampled (task 13.1), and check by drawing that the sampled one is
#    lossless;
# 4. meet the proposers: n-gram lookup in the request's own tokens, a draft model, and self-speculation by the
#    target's first layers, with their measured accept lengths;
# 5. follow a verify row through the engine (scheduling, logits, appending, KV rollback) and run it;
# 6. read the measurements on an H200: where speculation wins, and where it does not.
#
# Modules: `minisgl_ref/speculative/` (`tree.py` the draft tree, `accept.py` the acceptance rule, `proposer.py` the
# proposer contract, `ngram.py` and `draft_model.py` two proposers, `extension.py` the engine extension, `config.py`
# and `build.py` the settings and how they become an extension). It plugs into the core through seams the core
# declares without knowing what speculation is: `Row.guess` (`core/batch.py`), the scheduler's `guesser`, the
# engine extension's `row_tokens` hook (`engine/extension.py`), `ForwardBatch.extend_masks` and the attention
# backend's `supports_custom_mask`.

# %% tags=["setup"]
import json
import time
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm's widget bar; its text bar is enough here

import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import display

from minisgl_ref import LLM, SamplingParams
from minisgl_ref.book import setup_chapter, shorten, show_code, show_table, wrap
from minisgl_ref.speculative.accept import TargetView, accept, walk
from minisgl_ref.speculative.draft_model import truncated_model
from minisgl_ref.speculative.extension import SpeculativeExtension
from minisgl_ref.speculative.ngram import NgramProposer, NgramSettings
from minisgl_ref.speculative.tree import DraftTree
from minisgl_ref.speculative.tree_logits import path_logits, path_to, verify_row_logits

CHAPTER_START = time.perf_counter()
ROOT = setup_chapter()  # one torch thread (MINISGL_THREADS for more), and the repository root


def draw_tree(ax, tree: DraftTree, labels: list[str], root_label: str) -> None:  # type: ignore[no-untyped-def]
    """A draft tree, root at the top, each level one row lower; node i is labelled ``i: token``."""
    depths, xs = tree.depths(), {}

    def place(node: int, left: float) -> float:  # leaves get consecutive x; a parent sits over its children
        kids = tree.children(node)
        if not kids:
            xs[node] = left
            return left + 1
        for c in kids:
            left = place(c, left)
        xs[node] = sum(xs[c] for c in kids) / len(kids)
        return left

    place(-1, 0.0)
    ys = {-1: 0, **{i: -d for i, d in enumerate(depths)}}
    for i, p in enumerate(tree.parents):
        ax.plot([xs[p], xs[i]], [ys[p], ys[i]], color="0.6", zorder=1)
    box = dict(boxstyle="round", fc="white", ec="tab:blue")
    ax.text(xs[-1], 0, root_label, ha="center", va="center", bbox={**box, "ec": "black"}, fontsize=8)
    for i, label in enumerate(labels):
        ax.text(xs[i], ys[i], f"{i}: {label}", ha="center", va="center", bbox=box, fontsize=8)
    ax.set_ylim(-max(depths) - 0.5, 0.5)
    ax.set_xlim(min(xs.values()) - 0.8, max(xs.values()) + 0.8)
    ax.axis("off")


# %% [markdown]
# ## 1. Why guessing pays: the arithmetic of a decode step
#
# Take the model of chapter 12's GPU measurements: the embedded SmolLM2-135M zero-padded to the width of a 1.7B
# model, about 2.1 billion parameters in bfloat16 (two bytes each). It writes the 135M model's text while the GPU
# reads and multiplies a 2.1B model's bytes. A decode step at batch `B` reads every weight once and does about
# `2 x parameters` FLOPs per token (one multiply and one add per weight):

# %%
HIDDEN, LAYERS, INTER, VOCAB_PADDED = 2048, 30, 8192, 49152  # scripts/gpu/measure/padded_model.py's shape
PARAMS = LAYERS * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTER) + VOCAB_PADDED * HIDDEN  # q k v o, gate up down, embed
WEIGHT_BYTES = 2 * PARAMS
HBM_BPS, BF16_FLOPS = 4.8e12, 989e12  # an H200's datasheet: memory bandwidth, dense bfloat16 tensor-core FLOP/s
t_read = WEIGHT_BYTES / HBM_BPS
t_flops_per_token = 2 * PARAMS / BF16_FLOPS
print(f"parameters {PARAMS / 1e9:.2f} B, weights {WEIGHT_BYTES / 1e9:.2f} GB")
print(f"reading the weights once: {t_read * 1e3:.2f} ms; arithmetic per token: {t_flops_per_token * 1e6:.1f} µs")
print(f"tokens per step before arithmetic outlasts the read: {t_read / t_flops_per_token:.0f}")

# %% [markdown]
# This is chapter 11's roofline floor applied to one step: at batch 1 the step cannot take less than the 0.88 ms
# it needs to stream 4.2 GB through the memory system, while the arithmetic for one token would take 4 µs. Until a
# step holds about two hundred tokens, adding tokens to it adds no time on this idealised machine: the tensor cores
# are waiting for bytes anyway. (The engine measured 2.04 ms per token at batch 1 on an H200 with this model,
# `docs/data/spec_bench_h200.json`: the floor plus attention, small kernels that do not reach full bandwidth, and host
# work, none of which grows much with a few more tokens.)
#
# Speculation spends that slack. With `k` drafted tokens per request, a *verify row* feeds the request's last
# token and the `k` guesses, `k + 1` tokens, and gets the target's logits at every one of them. If on average the
# step appends `a` tokens per row (the *accept length*: accepted guesses plus the target's own token after them,
# so `1 <= a <= k + 1`), speculation divides the number of steps by `a`, and each step costs `t(B (k + 1))` instead
# of `t(B)`:
#
# $$ \text{speed-up}(B, a, k) = a \cdot \frac{t(B)}{t(B\,(k+1))}, \qquad t(T) = \max\!\Big(\frac{\text{bytes}}{\text{bandwidth}},\; T \cdot \frac{2\,\text{params}}{\text{FLOP/s}}\Big). $$
#
# The model leaves out the KV cache's bytes, the host's work and every real kernel's inefficiency; it says what
# the shape of the answer is, not its exact numbers.

# %%
def step_time(tokens: int) -> float:
    return max(t_read, tokens * t_flops_per_token)


def model_speedup(batch: int, accept_len: float, drafts: int) -> float:
    return accept_len * step_time(batch) / step_time(batch * (drafts + 1))


BATCHES = [1, 8, 32, 64, 128, 256]
ACCEPT_LENS = [1.3, 2.5, 4.0]
display(show_table([[f"{a}"] + [f"{model_speedup(b, a, 4):.2f}" for b in BATCHES] for a in ACCEPT_LENS],
                   headers=["accept length (4 drafts)"] + [f"batch {b}" for b in BATCHES]))

# %% alt="Line chart of the modelled speed-up (log x axis, batch size 1 to 512) for accept lengths 1.3, 2.5 and 4 with four drafted tokens per request: each line is flat at its accept length up to a batch of about 40, then falls as the verify step becomes bound by arithmetic, crossing 1.0 (the dashed line) at a batch of about 50 for 1.3 and about 100 for 2.5, and settling beyond a batch of about 200 at a fifth of the accept length, 0.8 for 4." caption="Modelled speed-up of speculation with four drafted tokens per request against batch size, for three accept lengths, on an H200's roofline for the 2.1B model." tags=["hide-input"]
fig, ax = plt.subplots(figsize=(6.5, 3.2))
xs = np.unique(np.logspace(0, np.log2(512), 60, base=2).astype(int))
for a in ACCEPT_LENS:
    ax.plot(xs, [model_speedup(int(b), a, 4) for b in xs], label=f"accept length {a}")
ax.axhline(1.0, color="0.4", ls="--", lw=1)
ax.set_xscale("log", base=2)
ax.set_xlabel("batch size (requests per step)")
ax.set_ylabel("modelled speed-up")
ax.legend(fontsize=8)
ax.set_title("speculation, 4 drafts per request: a x t(B) / t(5B)", fontsize=9)
fig.tight_layout()
plt.show()

# %% [markdown]
# Figure 13.1 has the whole economics in it. At small batch the speed-up *is* the accept length: the extra tokens
# are free. Past the batch where `B (k + 1)` tokens fill the tensor cores (about 200 / 5 = 40 requests here), every
# drafted token costs arithmetic, the rejected ones are pure waste, and a poor proposer (accept length 1.3) makes
# the engine slower than without speculation. That is why the engine speculates only while at most
# `speculative_max_batch` requests run (4 by default: section 6 measures why so few), and why the accept length,
# not the number of drafts, is the figure of merit of a proposer.

# %% [markdown]
# ## 2. The draft tree
#
# A proposer does not have to commit to one guess per position. If it is unsure whether the next word is "cat" or
# "dog", it may propose both, and a continuation of each: a *tree* of guesses rooted at the request's last known
# token. `DraftTree` stores it as two tuples, each node's token and its parent (`-1` for the root), with parents
# numbered before their children. Each node's depth and the verify row's attention mask follow from the parents;
# this is task 13.2:

# %%
show_code(DraftTree, task="13.2")

# %%
llm = LLM(device="cpu")
tok = llm.tokenizer
WORDS = ["dog", "cat", "ran", "was", "slept", "away"]  # each one token, with its leading space
TREE = DraftTree(tuple(tok.encode(" " + w)[0] for w in WORDS), (-1, -1, 0, 0, 1, 2))
ROOT_WORD = "The"
print("tokens   ", TREE.tokens)
print("parents  ", TREE.parents)
print("depths   ", TREE.depths())
print("positions", TREE.positions(root_position=7), "(the root at position 7)")
print("children of the root:", TREE.children(-1), " of node 0:", TREE.children(0))

# %% alt="Left: a tree with root 'The', children 0 'dog' and 1 'cat'; 'dog' has children 2 'ran' and 3 'was'; 'cat' has child 4 'slept'; 'ran' has child 5 'away'. Right: a 7 by 7 grid, rows are queries and columns keys in row order root, 0 to 5; the first column is filled, the diagonal is filled, and each node's row also fills its ancestors: row 5 fills root, 0, 2 and 5." caption="A draft tree of six nodes and the attention mask of its verify row: a node sees the root, its ancestors and itself." tags=["hide-input"]
fig, (ax_tree, ax_mask) = plt.subplots(1, 2, figsize=(9, 3.4), gridspec_kw={"width_ratios": [1.2, 1]})
draw_tree(ax_tree, TREE, WORDS, ROOT_WORD)
ax_tree.set_title("draft tree (node: token)", fontsize=9)
names = ["root"] + [f"{i} {w}" for i, w in enumerate(WORDS)]
ax_mask.imshow(TREE.mask().float().numpy(), cmap="Blues", vmin=-0.2, vmax=1.2)
ax_mask.set_xticks(range(len(names)), names, rotation=60, fontsize=7)
ax_mask.set_yticks(range(len(names)), names, fontsize=7)
ax_mask.set_xlabel("key (may be attended to)", fontsize=8)
ax_mask.set_ylabel("query", fontsize=8)
ax_mask.set_title("mask [n + 1, n + 1]", fontsize=9)
fig.tight_layout()
plt.show()

# %% [markdown]
# In Figure 13.2 each row of the mask is one token of the verify row, and its filled cells are what it may attend
# to among the row's own tokens: the root (everyone sees it), its ancestors and itself. Node 5 ("away") sees "The
# dog ran away" and nothing of "cat" or "was": it is computed as if the sequence were that path alone. Every token also
# sees the whole cached prefix before the root, which the mask leaves out. Two more things make the row equal to the
# separate paths:
#
# * **Positions by depth.** Siblings are guesses for the same place in the text, so they share a position: the
#   root's plus their depth (`positions` above: `dog` and `cat` both at 8). RoPE rotates each as if it stood
#   there alone.
# * **Slots in row order.** Each node still gets its own KV slot, the next one in the row, whatever its depth;
#   the mask, not the slot order, says who sees whom.
#
# A chain is the tree where each node's parent is the one before it; its mask is the ordinary causal one, so a chain
# needs no mask at all and runs on every attention backend. A tree needs a backend whose `supports_custom_mask` is
# true: `torch_native`, the Triton kernels and FlashInfer's FA2 kernels take the mask through
# `ForwardBatch.extend_masks`; FA3 takes none: there asking for trees (`speculative_eagle_topk > 1`) is refused, and
# a tree a proposer returns anyway is cut to its longest chain before it is verified.
#
# Let us check the claim on the embedded model: a prefix, then one verify row of the root and the six nodes with
# the mask and the depth positions, through the `torch_native` backend; then, for each node, the whole sequence
# ending in that node's path run from scratch by the chapter-00 oracle. The logits must agree at every node.

# %%
model, cfg = llm.model, llm.config
prefix = tok.encode("My neighbour has a pet.")
root = tok.encode(" " + ROOT_WORD)[0]
display(show_code(verify_row_logits))
row = verify_row_logits(model, cfg, prefix, root, TREE)
worst = 0.0
for offset in range(len(TREE) + 1):
    seq = prefix + [root] + path_to(TREE, offset - 1)
    want = path_logits(model, seq)  # the whole sequence from scratch, by the chapter-00 oracle's attention
    worst = max(worst, float((row[offset] - want).abs().max()))
    top = tok.decode([int(row[offset].argmax())])
    print(f"offset {offset} {shorten(tok.decode(seq[len(prefix):]), 30):<30} next (argmax): {top!r}")
print(f"largest logit difference, verify row vs separate paths: {worst:.2e}")
assert worst < 1e-3

# %% [markdown]
# One forward pass of seven tokens gave the next-token logits after each of seven different texts. (The small
# differences are float32 rounding: the oracle sums the attention in another order.) Without the mask, "cat" would
# see "dog" before it and every node after the first sibling would be computing a sentence nobody wrote.
#
# ## 3. The acceptance rule
#
# The verify row's logits at offset `j` are the target's distribution of the next token after the path to `j`.
# `minisgl_ref/speculative/accept.py` turns them into a `Verdict`: the accepted nodes (a path from the root) and
# the tokens to append (their tokens, then one more).
#
# **Greedy.** Start at the root. Take the target's argmax there; if a child of the current node carries that
# token, accept the child and move to it; otherwise stop and append the argmax itself (the *bonus* token, or a
# *correction* when a guess was wrong). Every appended token is the argmax after the tokens before it, which is
# exactly what plain greedy decoding would have written, one step at a time. On our tree, with the model's own
# logits from section 2:

# %%
greedy = SamplingParams(temperature=0)
verdict = accept(TREE, row, greedy, prompt_ids=prefix + [root])
print("accepted nodes:", verdict.nodes, "  appended:", repr(tok.decode(verdict.tokens)))
# The same row, but pretend the target preferred the tokens of the path 0 -> 2 -> 5 ("dog ran away"):
forced = row.clone()
for offset, node in [(0, 0), (1, 2), (3, 5)]:
    forced[offset, TREE.tokens[node]] = forced[offset].max() + 5
verdict = accept(TREE, forced, greedy, prompt_ids=prefix + [root])
print("accepted nodes:", verdict.nodes, "  appended:", repr(tok.decode(verdict.tokens)))

# %% [markdown]
# The first verdict is what the real model chose: the argmax after "The" is no word of the tree (it is " neighbour"),
# so the row appends that one token, as a plain decode step would have. In the second the target agrees with the path
# "dog ran away" and the row appends four tokens: three accepted guesses and the bonus after "away". A verify row
# always appends at least one token and at most its tree's depth plus one.
#
# **Sampling: the rule that changes nothing.** With `temperature > 0` the target does not have one right answer;
# what must be preserved is the *distribution*. Suppose the proposer drew its guess `x` from a distribution `q` it
# knows (a draft model sampling), and the target's distribution at that node is `p`. The rule is:
#
# * accept `x` with probability `min(1, p(x) / q(x))`;
# * if rejected, draw the token from the *residual* `r = max(p - q, 0)`, renormalised.
#
# Why the token that comes out has distribution exactly `p`: it is `y` *by acceptance* with probability
# `q(y) min(1, p(y)/q(y)) = min(p(y), q(y))`. Rejection happens with probability
# `1 - sum_z min(p(z), q(z)) = sum_z max(p(z) - q(z), 0)`, which is precisely the normaliser of `r`, so the path
# through rejection gives `y` probability `max(p(y) - q(y), 0)`. And `min(p, q) + max(p - q, 0) = p`. If `y`
# was accepted, the walk continues at the child with the target's distribution after it, and the same argument
# applies one token later: by induction, every sequence comes out with the probability plain sampling gives it.
#
# When the guesses are deterministic (an n-gram lookup, a draft model's top-k), or a node has several children,
# there is no `q` to divide by, and `accept.py` uses the point-mass version: try the children in order, accept
# candidate `x_1` with probability `p(x_1)`; on rejection remove `x_1` from `p` and renormalise, try the next
# candidate against that, and if all are rejected draw from what is left. With one candidate, `y = x_1` comes out
# with probability `p(x_1)`, any other `y` with `(1 - p(x_1)) · p(y) / (1 - p(x_1)) = p(y)`; more candidates
# follow by induction. It accepts less often than the `p / q` rule (`p(x) <= min(1, p(x)/q(x))` since `q <= 1`),
# which is why the `p / q` rule is used whenever `q` is known.
#
# In `accept.py` the walk and its two rules are task 13.1. At each node the walk picks the rule that fits how the
# node's children were drafted (by the tree's shape, never by the drafted token), and where it stops it still
# emits the token decided there:

# %%
show_code(walk, task="13.1")

# %% [markdown]
# Proofs are good; draws are better. A toy model over a four-token vocabulary whose next-token distribution
# depends only on the previous token (a bigram table `P`) plays the target, another table `Q` the draft. Each trial
# generates two tokens after token 0, in three ways: plainly from `P`; with a chain of two guesses drawn from `Q`
# and verified by the `p / q` rule; and with a tree of two deterministic sibling guesses (tokens 1 and 2) verified by
# the point-mass rule. When a verify row appends fewer than two tokens, the trial continues plainly from `P`, as
# the next step would. All three must give each pair `(a, b)` the probability `P[0, a] P[a, b]`.

# %%
V, TRIALS = 4, 8000
g = torch.Generator().manual_seed(13)
P = torch.softmax(1.5 * torch.randn(V, V, generator=g), dim=-1)
Q = torch.softmax(1.5 * torch.randn(V, V, generator=g), dim=-1)
exact = (P[0][:, None] * P).flatten()  # probability of the pair (a, b) = P[0, a] * P[a, b]


def finish_plainly(tokens: list[int], gen: torch.Generator) -> tuple[int, int]:
    while len(tokens) < 2:
        tokens.append(int(torch.multinomial(P[tokens[-1] if tokens else 0], 1, generator=gen)))
    return tokens[0], tokens[1]


def plain_pair(gen: torch.Generator) -> tuple[int, int]:
    return finish_plainly([], gen)


def chain_pair(gen: torch.Generator) -> tuple[int, int]:
    x1 = int(torch.multinomial(Q[0], 1, generator=gen))
    x2 = int(torch.multinomial(Q[x1], 1, generator=gen))
    tree = DraftTree.chain([x1, x2], probs=torch.stack([Q[0], Q[x1]]))
    view = TargetView(greedy=False, scores=torch.stack([P[0], P[x1], P[x2]]), reachable=(True,) * 3)
    return finish_plainly(walk(tree, view, gen).tokens, gen)


SIBLINGS = DraftTree((1, 2), (-1, -1))  # two guesses for the same position, no q


def sibling_pair(gen: torch.Generator) -> tuple[int, int]:
    view = TargetView(greedy=False, scores=torch.stack([P[0], P[1], P[2]]), reachable=(True,) * 3)
    return finish_plainly(walk(SIBLINGS, view, gen).tokens, gen)


def histogram(draw, seed: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    gen, counts = torch.Generator().manual_seed(seed), torch.zeros(V * V)
    for _ in range(TRIALS):
        a, b = draw(gen)
        counts[a * V + b] += 1
    return counts


def chi_square_p_value(counts: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic against ``exact`` and its p-value (chi-square with V*V - 1 degrees of freedom)."""
    expected = exact * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    return stat, float(torch.special.gammaincc(torch.tensor((V * V - 1) / 2), torch.tensor(stat / 2)))


HISTS = {"plain": histogram(plain_pair, 1), "chain, p/q rule": histogram(chain_pair, 2),
         "siblings, point-mass rule": histogram(sibling_pair, 3)}
ALPHA = 0.01
for name, counts in HISTS.items():
    stat, pv = chi_square_p_value(counts)
    print(f"{name:<26} chi-square {stat:5.1f} on {V * V - 1} d.o.f., p-value {pv:.2f}")
    assert pv > ALPHA, f"{name}: the draws do not follow P at the {ALPHA} level"

# %% alt="Grouped bar chart over the sixteen token pairs (0,0) to (3,3): black outlined bars give the exact probability P[0,a] P[a,b], and three coloured bars per pair give the observed frequencies of plain sampling, the chain verified by the p over q rule, and two sibling guesses verified by the point-mass rule; all three sit on the exact bars within a few thousandths." caption="Frequencies of the first two tokens from 8,000 trials each of plain sampling and of two speculative variants, against the exact probabilities of a toy bigram model." tags=["hide-input"]
fig, ax = plt.subplots(figsize=(9, 3.2))
pairs = np.arange(V * V)
ax.bar(pairs, exact.numpy(), width=0.85, fill=False, edgecolor="black", label="exact P[0,a] P[a,b]")
for k, (name, counts) in enumerate(HISTS.items()):
    ax.bar(pairs - 0.27 + 0.27 * k, (counts / TRIALS).numpy(), width=0.25, label=name, alpha=0.8)
ax.set_xticks(pairs, [f"({a},{b})" for a in range(V) for b in range(V)], fontsize=7, rotation=45)
ax.set_xlabel("first two tokens (a, b)")
ax.set_ylabel("frequency")
ax.legend(fontsize=7, ncol=2)
fig.tight_layout()
plt.show()

# %% [markdown]
# In Figure 13.3 the three coloured bars of every pair stand on the black outline of its exact probability, and
# the test above puts a number on it: Pearson's chi-square statistic over the sixteen pairs, whose p-value is the
# probability that honest sampling from `P` would look at least this far off. At a significance level of 1% we
# would reject "this follows `P`" if the p-value fell below 0.01; none does, for the plain draws or for either
# speculative rule. (The seeds are fixed, so the notebook gives the same numbers every run; a biased rule, such as
# accepting with `p(x)` but drawing rejections from `p` instead of the residual, fails this test by a wide margin:
# try it in exercise 5.)
#
# In the engine, the target's `p` at each offset is the distribution a plain step would draw from: the sampler's
# own penalties (which count the path's tokens as generated), temperature, top-k, top-p and min-p, built by the
# sampler's own functions (`target_view`). The random numbers come from a generator seeded by the request's seed
# and its step (`request_generator`), so a seeded request replays the same accept and reject draws in any batch.
#
# ## 4. Proposers
#
# A proposer answers four calls (`minisgl_ref/speculative/proposer.py`): `start(rid, tokens)` when a request
# begins, `extend(rid, tokens)` with the tokens it appended (its only way to learn what was accepted),
# `propose(rids, max_tokens)` for one draft tree per request, batched, and `finish(rid)`. Two are in the engine.
#
# **N-gram lookup** (`ngram.py`, SGLang's `NGRAM`). Much of what a model writes repeats its context: a quoted
# paragraph, the code being edited, a name. If the last few tokens occurred earlier in the request, whatever
# followed them then is a good guess now, and looking it up needs no model at all. Each request keeps a trie of its
# own n-grams, grown by a constant amount of work per appended token; the longest suffix of the request found in
# the trie with something after it is the match, and its subtree, cut to `max_tokens` nodes level by level (most
# frequent continuation first), is the draft tree. Here it is on a request that asks to repeat a paragraph, when
# the answer so far is "The lighthouse keeper climbed the":

# %%
PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
             "polished the great lens until it gleamed, and wrote the weather in a leather logbook: wind from the "
             "north-west, a heavy swell, two fishing boats returning late. In forty years the light had never once "
             "gone dark.")


def chat(text: str) -> list[int]:
    return llm.chat_prompt_ids([{"role": "user", "content": text}])


COPY_PROMPT = chat("Repeat the following paragraph exactly, word for word:\n\n" + PARAGRAPH)
so_far = COPY_PROMPT + tok.encode("The lighthouse keeper climbed the")  # the answer so far
NGRAM_TREES = {}
for label, settings in [("default windows (1 to 12 tokens)", NgramSettings(max_bfs_breadth=4)),
                        ("a window of 1 token", NgramSettings(max_match_window_size=1, max_bfs_breadth=4))]:
    ngram = NgramProposer(settings)
    ngram.start(0, so_far)
    window, node = ngram.match(ngram.indexes[0])
    NGRAM_TREES[label] = ngram.propose([0], 8)[0]
    print(f"{label}: matched the last {window} token(s): {shorten(repr(tok.decode(so_far[-window:])), 40)}")
    print("   draft:", [tok.decode([t]) for t in NGRAM_TREES[label].tokens])
    print("   parents:", list(NGRAM_TREES[label].parents))

# %% alt="Two draft trees rooted at the request's last token ' the'. Left, default windows: a single chain ' spiral', ' stairs', ' every', ' evening', ' at', ' dusk', '.', ' He' copied from the paragraph. Right, a window of one token: four children of the root (' light', ' north', ' weather', ' great'), the words that followed ' the' most recently in the prompt, each with a chain of one more token below it; ' spiral' is not among them." caption="The n-gram proposer's draft trees of at most eight nodes on a request that repeats a paragraph, with the default match windows and with a window of one token." tags=["hide-input"]
fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [0.8, 1.2]})
for ax, (label, tree) in zip(axes, NGRAM_TREES.items()):
    draw_tree(ax, tree, [repr(tok.decode([t])) for t in tree.tokens], repr(tok.decode(so_far[-1:])))
    ax.set_title(label, fontsize=9)
fig.tight_layout()
plt.show()

# %% [markdown]
# In Figure 13.4 the default proposer matched the longest suffix it could, six tokens that occur once in the prompt:
# what followed them there, the rest of the sentence, is the only continuation the trie knows, so the tree is a
# single chain of eight guesses. (A long match is a confident one, and the proposer also narrows its breadth per node
# as the match grows, giving the budget to depth.) If the model copies faithfully, the whole chain is accepted and
# the step appends nine tokens. Restricted to a window of one token, the proposer only knows that the last token is "
# the", which the paragraph follows with six different words: the tree spends its eight nodes on the four most recent
# of them, and the right one, " spiral", is not even there. That is what the lookup looks like on a chat answer that
# quotes nothing: short, common n-grams ("of the") whose continuations are coin flips, and an accept length near 1.
#
# **A draft model** (`draft_model.py`, SGLang's `STANDALONE`). A smaller model of the same vocabulary runs a few
# cheap decode steps of its own and proposes what it would write: a chain of its greedy or sampled tokens (with
# their distributions `q`, for the `p / q` rule), or, with `speculative_eagle_topk > 1`, a tree of its most likely
# branches. It runs on the engine's own parts (model classes, a paged KV pool of its own, the attention backend,
# the model runner's forward), laying out its own batches rather than going through the engine's scheduler, and
# it keeps KV only for tokens the target accepted. It also keeps a radix cache of its own (chapter 04's, over its
# own pool): when a request finishes, its accepted tokens' KV goes into the tree, so the next request that shares a
# prefix with it (the same system prompt, the earlier turns of a chat) drafts from that KV instead of running the
# draft over the prefix again, and the least recently used prefixes are evicted when the draft's pool runs short.
#
# **Self-speculation.** The draft need not be a separate model: `truncated_model(model, k)` is the target's first
# `k` decoder layers with its embedding, final norm and LM head, sharing every weight tensor (no copy), selected by
# `--speculative-draft-model-path self:K`:

# %%
shallow = truncated_model(model, 10)
print(f"layers: target {len(model.layers)}, draft {len(shallow.layers)}; same tensors for layer 0's weights: "
      f"{shallow.layers[0].self_attn.o_proj.weight.data_ptr() == model.layers[0].self_attn.o_proj.weight.data_ptr()}")

# %% [markdown]
# How well do these guess? `scripts/spec_accept_rates.py` answers without running the engine: under greedy
# verification the target accepts the longest drafted path that matches its own greedy continuation. So it
# generates each prompt's greedy output once, then replays it: at every simulated verify step it asks the proposer
# for a draft from the true prefix, counts the matching path and moves on by that path plus the bonus token. The
# accept lengths it measured on the embedded model, three copy-heavy prompts (repeat or lightly edit a paragraph or
# a function) and three open chat prompts, 64 output tokens each:

# %%
ACCEPT = json.loads((ROOT / "docs" / "data" / "spec_accept_cpu.json").read_text())["results"]
rows = []
for name, entry in ACCEPT["copy"]["proposers"].items():
    rows.append([shorten(entry["what"], 56), f"{entry['accept_length']:.2f}",
                 f"{ACCEPT['chat']['proposers'][name]['accept_length']:.2f}"])
display(show_table(rows, headers=["proposer (docs/data/spec_accept_cpu.json)", "copy", "chat"]))

# %% [markdown]
# * **The n-gram tree** yields 3.25 tokens per verify step on the copy prompts (6.4 on the verbatim copy alone)
#   and 1.30 on chat; a chain of 4 yields 2.49 and 1.23. It costs microseconds per request and no device work:
#   the right first proposer for editing, retrieval answers and code.
# * **Self-drafts are poor.** Ten or twenty of thirty layers yield 1.04-1.19: almost nothing is accepted. Even 27
#   layers yield under 2, while each draft token costs 27/30 of a target step, so the draft costs more than it
#   saves. The reason is that the final norm and the LM head were trained to read the *last* layer's hidden state;
#   an early layer's state lives in a different basis, and read through the same head it names different tokens.
#   Self-speculation works with models trained to exit early (LayerSkip) or with a small trained head that predicts
#   from the target's features (EAGLE). The all-30-layer control accepts every draft (4.83 and 4.89, the most 4
#   drafts and a bonus allow when outputs end), which checks the replay itself.
#
# ## 5. Verification inside the engine
#
# Speculation reaches the engine through `SpeculativeExtension` (`speculative/extension.py`), built by
# `build_runtime` when `speculative_algorithm` is set. Follow one request through one step.
#
# **Planning.** While the scheduler lays out a step it asks its `guesser` (the extension; the core's default has
# none) whether to guess at all (`active`: at most `speculative_max_batch` running requests, and at least one that
# may draft) and then for each decode row's guess (`guesses`). The extension tells the proposer about the tokens
# each request appended since it last saw it (`extend`), asks for trees of at most `speculative_num_draft_tokens`
# minus one nodes, and hands each back as a `Guess`: the drafted tokens, their depths and, for a real tree, the mask. The
# scheduler turns that decode row into a *verify row* (`Row.guess`): the last known token and the guesses, with a KV
# slot for every one of them, allocated like the tokens of an extend row.
#
# Requests that follow a grammar (chapter 12) draft too. `build_runtime` hands the structured-output extension to
# speculation as its `constraint`, and the acceptance rule walks under the grammar's mask at every drafted offset:
# the request's matcher accepts the path's draft tokens, fills its mask and rolls them back (`allowed_after`). A
# drafted token the grammar forbids is never accepted, nor anything below it; the tokens that are appended advance
# the matcher one by one, as decoded ones do. Only with jump-forward on do they not draft: forced text would land
# in the middle of a run verified without it. Requests that want log probabilities draft as well: each token a
# verify row appends gets the log probability a plain step would give it, computed from the row's logits at the
# offset the token was chosen at.
#
# **The forward pass.** A verify row is an extend row whose positions come from the depths and whose attention may
# carry a mask. The model runner computes the logits at every position of such a row (`StepOutput.row_logits`), not
# only at the last; on a GPU a verify step replays the extend CUDA graphs, which keep every token's hidden state,
# and the LM head then runs on the drafted positions only (`engine/extend_graph.py`).
#
# **Processing.** For a row that fed a guess, the engine asks its extensions which tokens to append
# (`row_tokens`); the extension that made the guess runs the acceptance rule and gives back the KV of rejected
# tokens:

# %%
show_code(SpeculativeExtension.row_tokens)

# %%
show_code(SpeculativeExtension._keep_accepted_kv)

# %% [markdown]
# The rollback is short because of how slots were handed out: the row's KV slots follow the row's order, so a
# chain's accepted prefix already sits at the right slots and everything after it is cut off (whole pages past the
# kept tokens go back to the allocator; the request's allocated length is rewound). A tree's accepted path may be
# nodes 0, 2, 5: their keys and values are copied to the first three slots with `KVPool.move`, and the rest is
# dropped the same way.
#
# The tokens returned then go through the request's ordinary append path *one by one*: stop tokens, stop
# strings, `max_new_tokens` and the detokenizer see each of them, and a token that ends the request drops the
# rest of the run. Nothing of a verify row is committed to the radix cache at launch (chapter 04): only after
# processing, when the request's tokens are the accepted ones, can their KV be shared with later requests. A
# rejected guess leaves nothing behind anywhere.
#
# **What it costs.** A verify row's request does not know its own length until its step is processed, and the
# next draft hangs off its last token. So while speculation is on, the scheduler asks for the step in flight to be
# processed before it plans the next (`NEED_SYNC`), and the overlap of chapter 06 is off: the host's scheduling and
# processing no longer hide behind the device. That is the second reason to stop speculating at large batch, and
# the extension does: above `speculative_max_batch` requests it pauses and steps overlap again; a request whose
# recent drafts were mostly rejected drafts fewer tokens, then none for `speculative_cooldown_steps` steps.
#
# Now run it: the copy-heavy prompt of section 4, greedy, through a plain engine and through one with
# `speculative_algorithm="NGRAM"` (a chain of `speculative_num_steps = 4` drafts, the default).

# %%
COPY_PARAMS = SamplingParams(temperature=0, max_new_tokens=64)


def run_counting_steps(engine_llm: LLM) -> tuple[object, int, float]:
    before, start = engine_llm.engine.stats.steps, time.perf_counter()
    out = engine_llm.generate([COPY_PROMPT], COPY_PARAMS, use_tqdm=False)[0]
    return out, engine_llm.engine.stats.steps - before, time.perf_counter() - start


plain_out, plain_steps, plain_s = run_counting_steps(llm)
spec_llm = LLM(device="cpu", speculative_algorithm="NGRAM")
spec_out, spec_steps, spec_s = run_counting_steps(spec_llm)
ext = next(e for e in spec_llm.engine.extensions.all if isinstance(e, SpeculativeExtension))
print(wrap(f"output: {plain_out.text!r}"))
print(f"same greedy text: {spec_out.text == plain_out.text}, same token ids: "
      f"{spec_out.output_ids == plain_out.output_ids} ({len(plain_out.output_ids)} tokens)")
print(f"plain engine:        {plain_steps:3d} steps, {plain_s:.1f} s")
print(f"n-gram speculation:  {spec_steps:3d} steps, {spec_s:.1f} s; {ext.verify_ct} verify rows, "
      f"accept length {ext.accept_length:.2f} tokens per verify row")
assert spec_out.output_ids == plain_out.output_ids

# %% [markdown]
# The same 64 tokens, in about a quarter of the steps: the prefill, one plain decode step, and verify rows that
# each append about four tokens, the most a chain of four drafts and a bonus
# can when nearly everything is accepted. On this CPU a step of five tokens costs little more than a step of one,
# for the same reason as on a GPU at small batch (the weights are read once per step), so the wall time falls
# with the step count.
#
# ## 6. Measurements on a GPU
#
# `scripts/gpu/measure/spec_bench.py` runs a copy-heavy greedy workload on an H200 with the padded 2.1B model of
# section 1: chat prompts that ask to repeat a paragraph word for word, to rewrite it in another tense, or to add
# type hints to a small function, numbered so that no two are the same text, up to 67 output tokens each. It
# measures batches of 1 to 64 such requests in several configurations, each engine started once and each batch
# run three times after a warm-up (`docs/data/spec_bench_h200.json`): no speculation; no speculation and no
# overlap; n-gram chains of 4 and of 8 drafts that never pause, to see where speculation stops paying; the same
# chain of 4 with the default pause above 4 running requests; and an n-gram tree of up to 11 drafted tokens with up
# to 4 children per node (FlashInfer for its masks). The last configuration run is a second engine without
# speculation: the two plain engines differ by a few per cent at the same batch (about 4% at batch 64), which is
# the noise of comparing separately started engines, so every ratio below takes the faster of the two. A second
# measurement removes that noise for the default configuration: both engines side by side in one process, their
# runs alternated, nine per batch size (`docs/data/spec_interleaved_h200.json`).

# %%
BENCH = json.loads((ROOT / "docs" / "data" / "spec_bench_h200.json").read_text())["runs"]
SIDE = json.loads((ROOT / "docs" / "data" / "spec_interleaved_h200.json").read_text())["interleaved"]
GPU_BATCHES = list(BENCH["plain"]["batches"])
CONFIGS = {"plain_sync": "no speculation, no overlap", "ngram_b64": "n-gram chain of 4, never paused",
           "ngram_chain8_b64": "n-gram chain of 8, never paused", "ngram_b4": "n-gram chain of 4, paused above 4",
           "ngram_tree": "n-gram tree (11 nodes, top-4), paused above 4"}


def best(config: str, batch: str) -> float:
    return BENCH[config]["batches"][batch]["best_ms_per_token"]


def plain_ms(batch: str) -> float:
    return min(best("plain", batch), best("plain_again", batch))


def speedup(config: str, batch: str) -> float:
    return plain_ms(batch) / best(config, batch)


rows = [["no speculation (the faster engine)"] + [f"{plain_ms(b):.2f}" for b in GPU_BATCHES]]
for c, label in CONFIGS.items():
    rows.append([label] + [f"{best(c, b):.2f} ({speedup(c, b):.2f}x)" for b in GPU_BATCHES])
rows.append(["chain of 4, paused above 4, side by side"]
            + [f"{SIDE[b]['speedup_of_medians']:.2f}x" for b in GPU_BATCHES])
display(show_table(rows, headers=["ms per output token (speed-up)"] + [f"batch {b}" for b in GPU_BATCHES]))

# %% alt="Line chart of the speed-up over no speculation against batch size (1 to 64, log scale). The chain of 8 that never pauses starts at 3.5x, the chain of 4 at 2.3x, both stay high at batch 2, fall to about 1.1x at batch 4 and 8, below 1 at batch 16, and to 0.2-0.3x at batch 64. The default, the chain of 4 paused above four requests, measured side by side with the plain engine, is 2.39x at batch 1, 2.28x at batch 2, 1.05x at batch 4 and 1.00-1.01x from batch 8 to 64. The tree is 1.25x at batches 1 and 2 and below 1 at 4 and 8. Dashed lines mark 1.0 and 0.95." caption="Speed-up per output token of n-gram speculation over no speculation on an H200, 2.1B padded model, copy-heavy greedy workload, by batch size." tags=["hide-input"]
fig, ax = plt.subplots(figsize=(6.8, 3.4))
xs = [int(b) for b in GPU_BATCHES]
for c, style in [("ngram_chain8_b64", "s--"), ("ngram_b64", "o--"), ("ngram_tree", "^:")]:
    ax.plot(xs, [speedup(c, b) for b in GPU_BATCHES], style, label=CONFIGS[c], lw=1)
ax.plot(xs, [SIDE[b]["speedup_of_medians"] for b in GPU_BATCHES], "D-", color="black", lw=2,
        label="default: chain of 4, paused above 4 (side by side)")
ax.axhline(1.0, color="0.4", ls="--", lw=1)
ax.axhline(0.95, color="0.7", ls=":", lw=1)
ax.set_xscale("log", base=2)
ax.set_xticks(xs, [str(x) for x in xs])
ax.set_xlabel("batch size (requests)")
ax.set_ylabel("speed-up per output token")
ax.legend(fontsize=7)
fig.tight_layout()
plt.show()

# %% [markdown]
# Figure 13.5 holds four lessons.
#
# * **One or two requests: the win section 1 promised, about halved.** The chain of 4 takes 0.88 ms per output
#   token against 2.04 without speculation (2.3x; 2.39x side by side), the chain of 8 0.58 ms (3.5x), with 4.2 and
#   6.6 tokens appended per verify row. A verify step costs about twice a decode step (a request's 66 tokens took
#   15 verify steps of 3.9 ms against 66 decode steps of 2.0), for three reasons: the host waits for each verify
#   step before planning the next, since the draft needs the tokens the step accepted (without overlap the plain
#   engine too is 1.3x slower: 2.67 ms against 2.04 at batch 1); a verify step replays an extend graph of 64 tokens
#   rather than the decode graph; and the LM head runs on every drafted position.
# * **Batch 4 to 8: the slowest drafter sets the pace.** Each verify row still appends 3.6-3.7 tokens on average,
#   but a batch lasts until its last request finishes. The requests that repeat the paragraph verbatim need 15
#   steps each; the one that adds type hints and a docstring to the function (50 tokens) writes mostly new text,
#   which its prompt cannot predict, and needs 47, while the plain engine needs 66 for the longest request of the
#   batch. So the batch takes 47 steps at a verify step's cost instead of 66 at a decode step's: about even.
# * **Batch 16 and more: a loss, then a rout.** With sixteen requests the chain of 4 is 0.75x; at 64 it is 0.30x
#   (9.8 ms per output token against 2.9): 64 verify rows of 5 tokens are 320 tokens a step, past the point where the
#   step is bound by arithmetic (section 1), and the host processes 64 verify rows without overlap. This is why
#   speculation pauses above `speculative_max_batch` running requests (4 by default): side by side with the plain
#   engine, the default is 1.00-1.01x from 8 to 64 requests, where it makes no verify row at all, and keeps its
#   wins below.
# * **Trees are held back by the kernels.** The tree appends the most tokens per verify row (8.4 at batch 1), yet
#   it is only 1.25x faster there. A step with a tree mask runs eagerly, launching every kernel of the forward pass
#   from Python, because the kernels that take a mask (FlashInfer's FA2 prefill, the Triton extend kernel) have no
#   extend graphs in this engine, and FA3, whose extend graphs the chains replay, takes no mask. On this workload
#   the tree's extra acceptance does not pay for that launch cost.
#
# So: on a GPU, speculation pays for single requests and small batches on text that repeats its context, pays
# nothing and costs nothing at larger batches once paused, and its next gains are overlapping verify steps with the
# host's work and capturing masked steps in graphs.

# %% [markdown]
# ## Summary
#
# * **Why it works.** At small batch a decode step is paced by reading the weights (0.88 ms for 4.2 GB on an
#   H200), while the arithmetic of one token takes microseconds: a step can score `k + 1` tokens per request for
#   the price of one. The speed-up is the accept length times `t(B) / t(B (k + 1))`, which falls below 1 once
#   the verify step is bound by arithmetic.
# * **Draft trees.** `DraftTree` holds tokens and parents; its verify row puts siblings at the same position
#   (root + depth) and a mask that lets a node see only its ancestors, so one forward pass gives every path's
#   logits (checked against the oracle on the embedded model).
# * **The acceptance rule.** Greedy: follow the argmax down the tree, then append it. Sampled: accept with
#   `min(1, p/q)` and draw rejections from `norm(max(p - q, 0))`, or, without `q`, the point-mass rule over the
#   candidates; either emits tokens distributed exactly as `p` (a chi-square test at the 1% level found no
#   difference from plain sampling).
# * **Proposers.** N-gram lookup in the request's own tokens: 3.25 tokens per verify step on copy-heavy prompts,
#   1.30 on chat, for microseconds of host work. A draft model runs on the engine's parts; self-speculation by the
#   target's first layers accepts almost nothing, since the LM head reads only the last layer's state.
# * **In the engine.** The scheduler's `guesser` turns decode rows into verify rows (`Row.guess`), the runner
#   returns logits at every drafted position, `row_tokens` decides what to append, one token at a time through the
#   usual stop rules, and the rejected KV is freed (a tree's path moved with `KVPool.move`). Overlap is off while
#   speculation runs; it pauses above `speculative_max_batch`.
# * **On an H200** with a 2.1B model on copy-heavy requests, n-gram chains are 2.3x (4 drafts) and 3.5x (8 drafts)
#   faster per token at batch 1. A verify step costs about two decode steps (no overlap, an extend graph), and a
#   batch moves at the pace of its slowest drafter, so from 4 requests on the gain is gone and from 16 on it turns
#   into a loss (0.3x at 64). Paused above 4 requests, the default is 2.4x at batch 1 and 1.00-1.01x from 8 to 64.
#   Trees run eagerly and gain 1.25x.

# %% [markdown]
# ## Exercises
#
# 1. **Task 13.2.** Write `DraftTree.depths` and `DraftTree.mask` in `minisgl_ref/speculative/tree.py`, then run
#    section 2 again: Figure 13.2's mask and the verify row's logits against each path are now your code's. If
#    every node saw the root, its parent and itself only, at which offsets of section 2's tree would the logits
#    stop matching the separate paths, and why only there?
# 2. **Task 13.1.** Write `walk`, `_try_candidates` and `_try_proposal` in `minisgl_ref/speculative/accept.py`.
#    Grade both tasks with `python -m minisgl_ref.course grade --chapter 13`. Then, in your `_try_candidates`,
#    accept each candidate with its original `p(x)` instead of its share of what is left, and grade again: which
#    check fails, and which tokens come out too rarely?
# 3. **Tune the depth.** Run section 5 with `speculative_num_steps` of 1, 2, 4, 8 and 16. How do the step count
#    and the accept length change? With section 1's model and the accept lengths you measure, which depth would be
#    best at batch 1 on an H200, and which at batch 32?
# 4. **Write a proposer.** Implement the four calls of `Proposer` for a "repeat the last line" guesser that proposes
#    the tokens that followed the previous newline, as a chain. Check it with `scripts/spec_accept_rates.py`'s replay
#    idea on the copy prompt, then plug it in as `SpeculativeExtension(your_proposer, SpeculativeConfig("NGRAM"))`
#    in an engine's `extensions` (as `tests/test_spec_engine.py` does), and check that the greedy text does not
#    change.
# 5. **Break the rule.** In `chain_pair` of section 3, replace the residual draw by a draw from `p` itself (write your
#    own walk for one node). Run the chi-square test again: what p-value do you get, and which pairs are over- or
#    under-represented? Explain why from the derivation.
# 6. **Two siblings, by hand.** A node has two deterministic candidates `x_1` and `x_2` and target distribution `p`.
#    Write the probability that the rule emits `x_1`, `x_2` and any other `y`, and show that they are `p(x_1)`,
#    `p(x_2)` and `p(y)`. What happens when `x_1 = x_2`?
# 7. **Mask or no mask.** Run section 2's verify row without its mask (`extend_masks=None`). At which offsets do the
#    logits still match the separate paths, and why exactly those?
#
# ## Reproduce
#
# ```bash
# python chapters/13_speculative_decoding.py                     # this chapter, end to end (CPU)
# python -m minisgl_ref.course grade --chapter 13                # the tests of tasks 13.1 and 13.2
# python -m pytest tests/test_notebooks.py -q -k 13              # the notebook runs top to bottom
# python -m pytest tests/test_spec_tree_attention.py tests/test_spec_accept.py -q   # masks and the rule
# python -m pytest tests/test_spec_proposers.py tests/test_spec_engine.py tests/test_spec_grammar.py -q
# PYTHONPATH=. python scripts/spec_accept_rates.py --output docs/data/spec_accept_cpu.json   # section 4's table
# python3 scripts/gpu/measure/padded_model.py /tmp/padded        # on a GPU machine: the 135M model padded to 2.1B
# python3 scripts/gpu/measure/spec_bench.py OUT.json --model-path /tmp/padded --batch-sizes 1 2 4 8 16 64 \
#     --repeats 3 --configs plain ngram_b64 ngram_chain8_b64 ngram_b4 ngram_tree plain_sync plain_again
# python3 scripts/gpu/measure/spec_bench.py OUT2.json --model-path /tmp/padded --batch-sizes 1 2 4 8 16 64 \
#     --repeats 9 --interleave plain ngram_b4                    # section 6, the default side by side
# ```
#
# Expected on a 2-core x86_64 CPU: the chapter in under a minute; the accept-rate replay in about a quarter of an
# hour (almost all of it the self-drafts), with the accept lengths of section 4's table. On one H200
# (`docs/data/spec_bench_h200.json`, `docs/data/spec_interleaved_h200.json`, 256 new tokens at most): about 2.04,
# 0.88 and 0.58 ms per output token at batch 1 without speculation, with the chain of 4 and with the chain of 8;
# the default within 1% of no speculation from batch 8 to 64.

# %%
print(f"chapter ran in {time.perf_counter() - CHAPTER_START:.0f} s")
