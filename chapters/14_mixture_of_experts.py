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
# # Chapter 14 — Mixture of experts
#
# **What you will build.** The two small decisions on which a mixture-of-experts layer rests: the router's
# weights (task 14.2, `route` in `minisgl_ref/moe/router.py`: softmax, top-k, renormalisation) and the layout
# that lets one kernel run every expert of a layer at once (task 14.1, `align_by_expert` in
# `minisgl_ref/moe/fused_moe.py`: the (token, expert) pairs sorted by expert and padded to whole blocks).
#
# **Why it matters.** A dense model's decode step reads all of its weights for every step, whatever the batch. An
# MoE model replaces each MLP by `E` smaller MLPs (the *experts*) and a *router* that sends every token to `k` of
# them. Qwen3-30B-A3B holds 30.5 billion parameters but runs 3.3 billion per token: the knowledge of a large model
# at the arithmetic of a small one. What it costs to serve is a different question, because a batch of tokens
# chooses different experts, and the bytes a step reads grow with the batch until every expert is hit.
#
# In this chapter you will:
#
# 1. count Qwen3-30B-A3B's parameters from its config and work out the bytes of a decode step: how many distinct
#    experts a batch reaches, against a dense 3B and a dense 30B model;
# 2. write the router (task 14.2): softmax over all experts, the top `k`, and the two families' normalisations,
#    shown equal where they should be; and look at how a real prompt spreads over the experts;
# 3. compute the experts: the reference loop, then the sort-and-pad layout (task 14.1) and the fused grouped-GEMM
#    kernel that reads it, checked equal on the CPU through Triton's interpreter;
# 4. load Qwen3-MoE and Mixtral checkpoints, check their logits and greedy text against transformers, and see how
#    they join the engine through the loader's `register_architecture` seam;
# 5. split an MoE layer over GPUs, by expert (expert parallelism) or by width, and compare what each cut reads;
# 6. count which experts a run really routes to, and read the fused kernel's and the engine's measurements on an
#    H200 against the floor of those experts.
#
# Modules: `minisgl_ref/moe/` (`router.py` the router, `config.py` the MoE fields of a config, `experts.py` the
# reference loop, `fused_moe.py` the layout and the Triton kernel, `layer.py` the `MoEBlock` that replaces a dense
# MLP, `model.py` the shared loading, `qwen3_moe.py` and `mixtral.py` the two families, `registry.py` their
# registration, `ep.py` the split over GPUs, `distribution.py` the routing counter). The chapter-01 models and the
# loader do not import this package.

# %% tags=["setup"]
import json
import math
import os
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm's widget bar; its text bar is enough here

import torch

if not torch.cuda.is_available():
    # The fused kernel runs on the CPU only in Triton's interpreter, and triton.jit reads this variable when it
    # decorates a kernel: it must be set before anything imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import display
from matplotlib.patches import Rectangle

from minisgl_ref import LLM, SamplingParams
from minisgl_ref.attention.torch_native import NoCacheAttentionBackend
from minisgl_ref.bench.offline import routed_floor_seconds
from minisgl_ref.book import show_code, show_table, wrap
from minisgl_ref.core.forward_batch import ForwardBatch
from minisgl_ref.models import ModelConfig, load_model
from minisgl_ref.models.embedded import embedded_model_path
from minisgl_ref.models.loader import MODEL_REGISTRY, SHIPPED_CONFIGS, register_architecture
from minisgl_ref.moe import fused_moe
from minisgl_ref.moe.distribution import ExpertDistribution
from minisgl_ref.moe.ep import local_experts, local_width, localize_routing
from minisgl_ref.moe.experts import reference_experts
from minisgl_ref.moe.fused_moe import align_by_expert, fused_experts
from minisgl_ref.moe.layer import MoEBlock
from minisgl_ref.moe.qwen3_moe import Qwen3MoeDecoderLayer
from minisgl_ref.moe.registry import register_moe_models
from minisgl_ref.moe.router import route
from minisgl_ref.tokenizer import Tokenizer

CHAPTER_START = time.perf_counter()
# One torch thread, as in the other chapters: on a small shared CPU two threads that wait for each other at
# every matmul make step times erratic. Set MINISGL_THREADS to try more.
torch.set_num_threads(int(os.environ.get("MINISGL_THREADS", "1")))


def find_root() -> Path:
    here = Path.cwd().resolve()
    for p in [here, *here.parents]:
        if (p / "docs" / "data").is_dir() and (p / "minisgl_ref").is_dir():
            return p
    return Path(__file__).resolve().parents[1]


ROOT = find_root()
register_moe_models()  # what build_runtime does before it loads a model; load_model below is called directly

# %% [markdown]
# ## 1. Why MoE: the bytes of a decode step
#
# A dense SwiGLU MLP applies the same three matrices to every token. An MoE layer holds `E` such triples, each of a
# smaller width, and a router, one linear map from the token's hidden state to `E` logits. Each token runs through
# the `k` experts with the largest router weights, and the layer's output is their weighted sum. Qwen3-30B-A3B
# (its config ships with the engine, without weights) has 48 layers, all of them MoE, with 128 experts of width
# 768 and `k = 8`. Its parameters, counted from the checkpoint's tensor shapes as the loader would allocate them:

# %%
CONFIG = ModelConfig.from_file(SHIPPED_CONFIGS / "qwen3-30b-a3b.json")
CLS = MODEL_REGISTRY[CONFIG.architecture]
MOE = CLS.moe_config(CONFIG)
SHAPES = CLS.checkpoint_shapes(CONFIG)
H, LAYERS, E, K, I_EXP = CONFIG.hidden_size, CONFIG.num_layers, MOE.num_experts, MOE.top_k, MOE.intermediate_size
TOTAL = sum(math.prod(s) for s in SHAPES.values())
EXPERT_PARAMS = 3 * I_EXP * H  # gate, up and down of one expert
ALL_EXPERTS = LAYERS * E * EXPERT_PARAMS
EMBED = math.prod(SHAPES["model.embed_tokens.weight"])
ACTIVE = TOTAL - LAYERS * (E - K) * EXPERT_PARAMS
print(f"{CONFIG.architecture}: {LAYERS} layers, {E} experts of width {I_EXP}, {K} per token, hidden {H}")
print(f"total parameters   {TOTAL / 1e9:6.2f} B   (experts {ALL_EXPERTS / 1e9:.2f} B, "
      f"everything else {(TOTAL - ALL_EXPERTS) / 1e9:.2f} B)")
print(f"active per token   {ACTIVE / 1e9:6.2f} B   ({K} of {E} experts in each layer)")
print(f"one expert         {EXPERT_PARAMS * 2 / 2**20:6.1f} MiB in bfloat16; "
      f"one layer's experts {E * EXPERT_PARAMS * 2 / 1e9:.2f} GB")

# %% [markdown]
# Nearly everything is experts: 29 of the 30.5 billion parameters. A token touches 8 of the 128 experts of each
# layer, so it does the arithmetic of a 3.3B model. But a decode step serves a batch, and each of its tokens picks
# its own 8 experts. If the router spread tokens uniformly, an expert would be missed by one token with probability
# `1 - k/E`, and by a whole batch of `B` tokens with probability `(1 - k/E)^B`; so a step hits, per layer, in
# expectation
#
# $$ \mathbb{E}[\text{distinct experts}] = E \left(1 - \left(1 - \tfrac{k}{E}\right)^{B}\right) $$
#
# experts, and must read all of their weights. The floor of the step's time on a GPU paced by memory is then the
# bytes of those experts, plus the weights every token reads (attention, norms, routers and the LM head; the
# embedding table only for the rows looked up), plus the KV cache of the batch, divided by the bandwidth. A
# simulated router that draws `k` distinct experts at random per token agrees with the formula:

# %%
DENSE_READ = TOTAL - ALL_EXPERTS - EMBED  # attention, norms, routers, LM head: read by every step
KV_PER_TOKEN = LAYERS * 2 * CONFIG.num_kv_heads * CONFIG.head_dim * 2  # K and V, bfloat16
HBM_BPS = 4.8e12  # an H200's datasheet memory bandwidth


def expected_experts(batch: int | np.ndarray) -> np.ndarray:
    return E * (1 - (1 - K / E) ** np.asarray(batch, dtype=float))


def moe_step_bytes(batch: int, context: int = 0) -> float:
    """Weights (and KV at ``context`` tokens per request) one decode step of ``batch`` tokens reads."""
    return 2 * (DENSE_READ + LAYERS * expected_experts(batch) * EXPERT_PARAMS) + batch * context * KV_PER_TOKEN


gen = torch.Generator().manual_seed(0)
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
simulated = {b: np.mean([len(torch.rand(b, E, generator=gen).topk(K, dim=1).indices.unique()) for _ in range(200)])
             for b in BATCHES}
rows = []
for b in BATCHES:
    rows.append([b, f"{expected_experts(b):.1f}", f"{simulated[b]:.1f}", f"{moe_step_bytes(b) / 1e9:.2f}",
                 f"{moe_step_bytes(b, 2048) / 1e9:.2f}", f"{moe_step_bytes(b, 2048) / HBM_BPS * 1e3:.2f}"])
display(show_table(rows, headers=["batch", "experts per layer (formula)", "(simulated)", "weights read (GB)",
                                  "+ KV at 2,048 tokens (GB)", "floor on an H200 (ms)"]))
print(f"KV per token: {KV_PER_TOKEN / 1024:.0f} KiB; weights every step reads: {2 * DENSE_READ / 1e9:.2f} GB")

# %% alt="Two panels against batch size on a log scale from 1 to 512. Left: expected distinct experts per layer rises from 8 at batch 1 to 52 at batch 8, 112 at batch 32 and 126 at batch 64, flattening at 128; simulated dots sit on the curve. Right: gigabytes of weights read per decode step: the MoE model's line starts at 6.1 GB at batch 1, just under the dense 3.3B model's flat 6.7 GB line, crosses it before batch 2, reaches 26 GB at batch 8 and 60 GB from batch 64 on, just under the dense 30.5B model's flat 61 GB line." caption="Qwen3-30B-A3B under uniform routing: distinct experts a decode step reaches per layer, and the weight bytes it reads, against a dense model of its active and of its total size." tags=["hide-input"]
fig, (ax_e, ax_b) = plt.subplots(1, 2, figsize=(9, 3.3))
xs = np.unique(np.logspace(0, 9, 80, base=2).astype(int))
ax_e.plot(xs, expected_experts(xs), label="E (1 - (1 - k/E)^B)")
ax_e.plot(BATCHES, [simulated[b] for b in BATCHES], "o", ms=4, label="simulated router")
ax_e.axhline(E, color="0.5", ls="--", lw=1)
ax_e.set_xscale("log", base=2)
ax_e.set_xlabel("batch size (tokens per step)")
ax_e.set_ylabel("distinct experts per layer")
ax_e.legend(fontsize=8)
ax_b.plot(xs, [moe_step_bytes(int(b)) / 1e9 for b in xs], label="Qwen3-30B-A3B (MoE)")
ax_b.axhline(2 * ACTIVE / 1e9, color="tab:green", ls="--", label=f"dense {ACTIVE / 1e9:.2f}B (its active size)")
ax_b.axhline(2 * TOTAL / 1e9, color="tab:red", ls="--", label=f"dense {TOTAL / 1e9:.2f}B (its total size)")
ax_b.set_xscale("log", base=2)
ax_b.set_ylim(0, 66)
ax_b.set_xlabel("batch size (tokens per step)")
ax_b.set_ylabel("weights read per step (GB)")
ax_b.legend(fontsize=8)
for a in (ax_e, ax_b):
    a.set_xticks([1, 4, 16, 64, 256], ["1", "4", "16", "64", "256"])
fig.tight_layout()
plt.show()

# %% [markdown]
# Figure 14.1 is the serving economics of an MoE model. At batch 1 a step reads 6.1 GB of weights, about what a
# dense model of its active size reads (6.7 GB, counted whole): 2.5 GB that every step reads (attention, norms,
# routers, the LM head) and 8 experts in each of 48 layers (3.6 GB), while the 0.6 GB embedding table is only
# looked up. That is 1.3 ms on an H200's 4.8 TB/s. But each extra token reaches new experts: at batch 8 a layer reads 52 experts on
# average and the step 26 GB, four times the dense 3.3B model's bytes; from batch 64 on nearly every expert is hit
# and the step reads 60 GB, as much as a dense 30B model. So while a step is paced by memory, an MoE model costs
# what a small model costs only at batch 1 or 2, and what the large one costs from a few dozen tokens on. Its
# advantage returns at large batches, where steps are bound by arithmetic: there it does the work of a 3.3B model
# per token, a ninth of a dense 30B's. Real routers are not uniform: a batch of similar text concentrates on fewer
# experts, which saves bytes, and loads some experts much more than others, which matters once experts live on
# different GPUs (section 5).

# %% [markdown]
# ## 2. The router
#
# The router's linear map gives each token `E` logits. Both families turn them into `k` weights the same way:
# a softmax over all `E` experts (in float32: 128 logits that differ by less than bfloat16's resolution would tie),
# the `k` largest probabilities, and, if the config asks, a rescaling of those `k` to sum to 1. Qwen3-MoE
# renormalises when `norm_topk_prob` is true (Qwen3-30B-A3B: true); without it a token whose router is unsure (its
# `k` probabilities small) gets a smaller MLP update. This is task 14.2:

# %%
show_code(route, task="14.2")

# %% [markdown]
# On one token with eight experts and `k = 2`:

# %%
logits = torch.tensor([[1.0, 3.0, -0.5, 2.5, 0.0, 0.2, -2.0, 1.2]])
probs = torch.softmax(logits, dim=-1)
w_raw, ids = route(logits, 2, renormalize=False)
w_norm, _ = route(logits, 2, renormalize=True)
print("softmax over the 8 experts:", [f"{p:.3f}" for p in probs[0].tolist()])
print(f"top 2: experts {ids[0].tolist()}, weights {[round(w, 3) for w in w_raw[0].tolist()]} "
      f"(sum {w_raw.sum():.3f}) -> renormalised {[round(w, 3) for w in w_norm[0].tolist()]}")
mixtral_style = torch.softmax(torch.topk(logits, 2, dim=-1).values, dim=-1)
print(f"Mixtral's softmax over the top-2 logits: {[round(w, 3) for w in mixtral_style[0].tolist()]}")
many = torch.randn(1000, 8, generator=gen) * 3
top_logits, top_ids = torch.topk(many, 2, dim=-1)
w, i = route(many, 2, renormalize=True)
print(f"1,000 random tokens: same experts {torch.equal(i, top_ids)}, largest weight difference "
      f"{(w - torch.softmax(top_logits, dim=-1)).abs().max():.1e}")

# %% [markdown]
# Mixtral is usually described as a softmax over the top-`k` logits. It is the same function as softmax, top-`k`,
# renormalise: softmax is monotone, so the top `k` probabilities belong to the top `k` logits, and
# `exp(l_i) / sum_{j in top-k} exp(l_j)` equals `p_i / sum_{j in top-k} p_j` because the full softmax's common
# denominator cancels. So the engine serves Mixtral as `route(..., renormalize=True)`, and the 1,000 tokens above
# agree to rounding.
#
# How evenly does a model spread a real prompt? A tiny Qwen3-MoE with random weights (8 experts, `k = 2`, two
# layers, the embedded model's vocabulary) routes the tokens of a paragraph; a hook on each layer's router records
# its choice:

# %%
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig  # noqa: E402

WORK = Path(tempfile.mkdtemp(prefix="ch14_"))
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1)


def save_tiny(name: str, hf_config) -> Path:  # type: ignore[no-untyped-def]
    """A random checkpoint saved by transformers itself: one tensor per expert, as released checkpoints are."""
    torch.manual_seed(0)
    folder = WORK / name
    AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).save_pretrained(folder)
    return folder


tok = Tokenizer.from_pretrained(embedded_model_path())  # the embedded model's tokenizer, for real text
VOCAB = tok.vocab_size
QWEN = save_tiny("qwen3_moe", Qwen3MoeConfig(**SMALL, vocab_size=VOCAB, head_dim=16, intermediate_size=96,
                                            moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                            norm_topk_prob=True))
MIXTRAL = save_tiny("mixtral", MixtralConfig(**SMALL, vocab_size=VOCAB, intermediate_size=32,
                                             num_local_experts=8, num_experts_per_tok=2))

PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He wound the clockwork, "
             "trimmed the wick and watched the beam sweep across the grey water, counting the ships that passed.")
prompt_ids = tok.encode(PARAGRAPH)
qwen_model, _, _ = load_model(str(QWEN), dtype="float32")
chosen: dict[int, torch.Tensor] = {}
for n, layer in enumerate(qwen_model.layers):
    def record(module, inputs, output, n=n, block=layer.mlp):  # type: ignore[no-untyped-def]
        chosen[n] = route(output, block.top_k, block.renormalize)[1]
    layer.mlp.gate.register_forward_hook(record)


def our_logits(model, sequences: list[list[int]]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The model's logits at every position of each sequence, without a KV cache (chapter 01's check)."""
    batch = ForwardBatch.for_full_sequences(sequences, NoCacheAttentionBackend())
    with torch.inference_mode():
        return model.compute_logits(model(batch.input_ids, batch.positions, batch))


our_logits(qwen_model, [prompt_ids])
counts = {n: torch.bincount(ids.reshape(-1), minlength=8) for n, ids in chosen.items()}
for n, c in counts.items():
    print(f"layer {n}: {len(prompt_ids)} tokens x 2 choices, pairs per expert {c.tolist()}, "
          f"busiest/mean {c.max().item() / c.float().mean().item():.2f}")

# %% alt="Grouped bar chart: for each of 8 experts, two bars (layer 0 and layer 1) giving how many of the paragraph's 74 token-choice pairs went to that expert, with a dashed line at the uniform share of about 9. Layer 0 is uneven (2 to 15 pairs per expert); layer 1 is lopsided: expert 0 takes 33 pairs and expert 7 takes 20, while experts 1 and 6 get one each." caption="How a tiny random Qwen3-MoE (8 experts, k = 2) spreads one paragraph's tokens over its experts, per layer." tags=["hide-input"]
fig, ax = plt.subplots(figsize=(6.5, 2.8))
for n, c in counts.items():
    ax.bar(np.arange(8) + 0.38 * (n - 0.5), c.numpy(), width=0.38, label=f"layer {n}")
ax.axhline(2 * len(prompt_ids) / 8, color="0.4", ls="--", lw=1, label="uniform")
ax.set_xticks(range(8), [f"expert {e}" for e in range(8)], fontsize=8)
ax.set_ylabel("(token, choice) pairs")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# Figure 14.2 shows that even a router with random weights is far from uniform on real text: tokens whose hidden
# states look alike go to the same experts, and in layer 1 expert 0 takes 33 of the 74 pairs, 3.6 times its share,
# while two experts get a single pair each.
# Trained routers are pushed towards balance during training by an auxiliary loss (`router_aux_loss_coef` in
# Qwen3's config), but not to perfect balance. The layout of section 3 must therefore handle any distribution,
# from every expert equally loaded to one expert taking every token and others none.

# %% [markdown]
# ## 3. The expert computation
#
# Given the router's choice, the layer's output is, for each token `t` and each of its `k` choices `(e, w)`,
# `w * W2[e] @ (silu(W1[e] @ x_t) * (W3[e] @ x_t))`, summed over the choices. The weights are kept stacked as the
# fused kernels of SGLang and vLLM read them: `w13 [E, 2I, H]` (each expert's gate rows, then its up rows) and
# `w2 [E, H, I]`. The reference is a loop over the experts that received a token:

# %%
show_code(reference_experts)

# %% [markdown]
# It is obviously right, and slow on a GPU: one pair of small matmuls per expert used, up to 256 launches per layer
# for Qwen3-30B-A3B, each reading an expert's 9 MiB of weights for a handful of rows. A fused MoE does the layer in
# two launches of one *grouped GEMM*: each program of the kernel takes a block of `BLOCK_M` rows that all belong to
# the *same* expert, so it can read one weight tile per step of the inner dimension and use it for every row of
# the block. Building those blocks is `align_by_expert`: number the `T * k` (token, choice) pairs `p = t * k + j`,
# sort them by expert, and pad each expert's group to a multiple of `BLOCK_M` with a sentinel, `T * k`, that the
# kernel skips. This is task 14.1:

# %%
show_code(align_by_expert, task="14.1")

# %%
EXAMPLE = torch.tensor([[2, 0], [0, 3], [2, 0], [1, 2], [0, 2]])  # 5 tokens, k = 2, experts 0..3
rows_sorted, expert_of_block, used = align_by_expert(EXAMPLE, num_experts=4, block_m=2)
SENTINEL = EXAMPLE.numel()
print("pair -> expert:       ", EXAMPLE.reshape(-1).tolist())
print("sorted rows (pair ids):", rows_sorted.tolist(), f"(sentinel {SENTINEL})")
print("expert of each block:  ", expert_of_block.tolist())
print("rows in use:           ", int(used.item()))

# %% alt="Two rows of cells. Top: the ten (token, choice) pairs in pair order, each coloured by its expert (0 blue, 1 orange, 2 green, 3 red) and labelled with its pair id. Bottom: the sorted and padded rows in blocks of two: expert 0's pairs 1, 2, 5, 8 in two blocks, expert 1's pair 6 and a grey sentinel cell, expert 2's pairs 0, 4, 7, 9 in two blocks, expert 3's pair 3 and a sentinel, then unused grey rows up to the worst-case size; block boundaries are drawn as thick lines and each block is labelled with its expert." caption="align_by_expert on five tokens with k = 2, four experts and blocks of two rows: the pairs grouped by expert, each group padded to whole blocks with the sentinel." tags=["hide-input"]
COLOURS = plt.get_cmap("tab10").colors
fig, ax = plt.subplots(figsize=(9, 2.4))
flat = EXAMPLE.reshape(-1).tolist()
for p, e in enumerate(flat):
    ax.add_patch(Rectangle((p, 1.6), 1, 0.8, fc=COLOURS[e], ec="white", alpha=0.8))
    ax.text(p + 0.5, 2.0, str(p), ha="center", va="center", fontsize=8, color="white")
ax.text(-0.3, 2.0, "pairs", ha="right", va="center", fontsize=8)
for r, p in enumerate(rows_sorted.tolist()):
    sentinel = p == SENTINEL
    ax.add_patch(Rectangle((r, 0.2), 1, 0.8, fc="0.85" if sentinel else COLOURS[flat[p]], ec="white",
                           hatch="//" if sentinel else None, alpha=0.8))
    ax.text(r + 0.5, 0.6, "s" if sentinel else str(p), ha="center", va="center", fontsize=8,
            color="0.3" if sentinel else "white")
for b, e in enumerate(expert_of_block.tolist()):
    ax.plot([2 * b, 2 * b], [0.1, 1.1], color="black", lw=1.5)
    ax.text(2 * b + 1, -0.15, f"expert {e}" if e >= 0 else "unused", ha="center", va="center", fontsize=7)
ax.plot([int(used.item())] * 2, [0.05, 1.25], color="black", lw=2.5)
ax.text(-0.3, 0.6, "sorted rows", ha="right", va="center", fontsize=8)
ax.set_xlim(-2.2, len(rows_sorted) + 0.2)
ax.set_ylim(-0.4, 2.5)
ax.axis("off")
fig.tight_layout()
plt.show()

# %% [markdown]
# In Figure 14.3 every block of two sorted rows belongs to one expert; the hatched cells are the sentinel, which the
# kernel neither reads nor writes; expert 1, with one pair, gets one block of which half is padding. The row count
# is sized for the worst case (every used expert one row short of a full block) and the number of rows in use is a
# tensor, not a Python integer: all sizes follow from `T` alone, so the layer never waits for the host and can be
# recorded in a CUDA graph (chapter 08) and replayed with any routing. The padding costs arithmetic, never weight
# traffic: at decode (`T = 1`, `k = 8`) each used expert has one row in a block of 16, so fifteen sixteenths of the
# tensor-core work is padding, but the kernel is waiting for the weights anyway.
#
# The kernel itself is a tiled matmul whose program reads its block's expert, gathers its rows' inputs through the
# pair ids, and multiplies them by that expert's weight tiles:

# %%
KERNEL_SOURCE = Path(fused_moe.__file__).read_text()
start = KERNEL_SOURCE.index("    # axis 0 varies fastest")
stop = KERNEL_SOURCE.index("#: Block sizes.")
show_code("def _grouped_gemm_kernel(A, B, C, topk_weights, sorted_token_ids, expert_of_block, ...):\n"
          + KERNEL_SOURCE[start:stop].rstrip() + "\n")

# %% [markdown]
# What is fused: the first launch runs over `w13` and computes the gate tile and the matching up tile from the
# same gathered rows, applying `silu(gate) * up` in registers before anything is stored, so only the `[T * k, I]`
# activation is written, never the `[T * k, 2I]` gate and up. The second launch runs over `w2` with the same
# layout and multiplies each row by its routing weight. The `k` rows of each token are then summed in a fixed
# order by a reshape and a sum, which keeps the result deterministic (no atomic adds), so a CUDA-graph replay and
# an eager call agree bit for bit.
#
# On the CPU the kernel runs in Triton's interpreter (the setup cell set `TRITON_INTERPRET=1` before anything
# imported `triton`). A small layer, with one expert that every token chooses and an expert no token chooses:

# %%
g = torch.Generator().manual_seed(3)
T_DEMO, H_DEMO, I_DEMO, E_DEMO, K_DEMO = 37, 64, 32, 8, 2
x = torch.randn(T_DEMO, H_DEMO, generator=g)
w13 = torch.randn(E_DEMO, 2 * I_DEMO, H_DEMO, generator=g) / H_DEMO**0.5
w2 = torch.randn(E_DEMO, H_DEMO, I_DEMO, generator=g) / I_DEMO**0.5
scores = torch.rand(T_DEMO, E_DEMO, generator=g)
scores[:, 3], scores[:, 5] = 2.0, -1.0  # expert 3: everyone's first choice; expert 5: nobody's
topk_w, topk_ids = route(scores * 4, K_DEMO, renormalize=True)
print(f"Triton interpreted: {fused_moe.interpreted(fused_moe._grouped_gemm_kernel)}; "
      f"pairs per expert {torch.bincount(topk_ids.reshape(-1), minlength=E_DEMO).tolist()}")
t0 = time.perf_counter()
out_fused = fused_experts(x, w13, w2, topk_w, topk_ids)
t_fused = time.perf_counter() - t0
out_ref = reference_experts(x, w13, w2, topk_w, topk_ids)
print(f"fused vs reference (float32): max |difference| {(out_fused - out_ref).abs().max():.1e}, "
      f"mean |output| {out_ref.abs().mean():.2f}")
print(f"{t_fused:.1f} s in Triton's interpreter")
assert torch.allclose(out_fused, out_ref, rtol=1e-5, atol=1e-5)

# %% [markdown]
# The two agree to float32 rounding: the products are the same, only the order of the sums differs (the inner
# dimension in `BLOCK_K` steps, a token's `k` choices in slot order). `tests/test_fused_moe.py` checks the same on
# decode shapes, `k` up to 8, token counts and widths that are not multiples of the blocks, and in bfloat16, and,
# on a GPU, at Qwen3-30B-A3B's layer shape and through a CUDA graph replayed with a new routing.

# %% [markdown]
# ## 4. The models
#
# An MoE model is a dense model whose MLPs are (some or all) `MoEBlock`s. Qwen3-MoE keeps Qwen3's attention
# (QK-norm, no bias); Mixtral keeps Llama's. So each family is a decoder layer that builds the chapter-01 layer and
# swaps its `mlp`:

# %%
show_code(Qwen3MoeDecoderLayer)

# %% [markdown]
# What differs is the checkpoint: a released MoE checkpoint stores each expert's three matrices as separate tensors
# (`model.layers.3.mlp.experts.17.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.5.w1.weight`), and
# `MoEForCausalLM.load_weights` writes each one into its slot of the stacks as the tensors stream by, handing every
# other tensor to the chapter-01 loader. The two tiny checkpoints of section 2 were saved by transformers in exactly
# that form. Their logits, against transformers' own models:

# %%
SEQS = [prompt_ids[:24], tok.encode("Mixture of experts: each token runs through two of eight MLPs.")]
for name, folder in [("Qwen3-MoE", QWEN), ("Mixtral", MIXTRAL)]:
    model, config, _ = load_model(str(folder), dtype="float32")
    ours = our_logits(model, SEQS)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    start, errors = 0, []
    for seq in SEQS:
        with torch.inference_mode():
            ref = hf(torch.tensor([seq])).logits[0]
        errors.append(((ours[start:start + len(seq)] - ref).norm() / ref.norm()).item())
        start += len(seq)
    blocks = sum(isinstance(m, MoEBlock) for m in model.modules())
    print(f"{name:9s} ({config.architecture}): {blocks} MoE blocks, relative error of the logits "
          f"{max(errors):.1e}")

# %% [markdown]
# And through the engine, the paged KV cache and the scheduler of chapters 03-06, several prompts batched together,
# greedy, against transformers' `generate` one prompt at a time:

# %%
PROMPTS = [tok.encode(p) for p in ["The lighthouse keeper", "Once upon a time", "Experts, routers and"]]
for name, folder in [("Qwen3-MoE", QWEN), ("Mixtral", MIXTRAL)]:
    llm = LLM(folder, device="cpu", dtype="float32", attention_backend="torch_native", max_total_tokens=2048)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    same = []
    for prompt, out in zip(PROMPTS, outs):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10, min_new_tokens=10,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):]
        same.append(out.output_ids == ref.tolist())
    print(f"{name:9s}: greedy tokens equal to transformers' for {sum(same)} of {len(same)} prompts")
    print(f"  first prompt's tokens: {outs[0].output_ids}")
    llm.shutdown()

# %% [markdown]
# The random weights write nonsense, but the same nonsense token for token. Two things make this possible without
# touching chapter 01's code:
#
# * **The registration seam.** The loader keeps a table from a config's `architectures[0]` to a model class and
#   exports `register_architecture(name, cls)`. This package registers its two classes with it;
#   `build_runtime` calls `register_moe_models()` before it loads a model, so the offline `LLM`, the server and the
#   benchmarks all know them, while the loader itself never imports `minisgl_ref/moe/`. A second class under a
#   name already taken is refused, so a plug-in cannot silently replace a model that has a meaning:

# %%
show_code(register_moe_models)
try:
    register_architecture("LlamaForCausalLM", MODEL_REGISTRY["MixtralForCausalLM"])
except ValueError as err:
    print(wrap(f"refused: {err}"))

# %% [markdown]
# * **A hook for the experts.** `MoEBlock.experts` is the function that computes the experts: the float32 reference
#   loop by default; on a GPU the runtime installs the fused kernel with `use_experts(model, fused_experts)`
#   (`install_moe_kernels`) before the engine captures its CUDA graphs. Both read the same stacks, so swapping
#   them moves no weight.
#
# The dense model of chapter 01 stays as it was: the MoE layer is a different module in the same place, its loading
# a filter in front of the same loader, and its architectures entries in a table. How an MoE layer is split over
# several GPUs is the subject of the next section.

# %% [markdown]
# ## 5. Expert parallelism
#
# Tensor parallelism (chapter 09) cuts a dense MLP along its width: each of `N` ranks holds `1/N` of the columns
# of the gate and up matrices and the same rows of the down matrix, computes its slice of the activation (SwiGLU
# is elementwise, so a slice of the input width gives a slice of the output) and an all-reduce sums the `N` partial
# outputs. An MoE layer can be cut the same way, every expert sliced over all ranks. It can also be cut along the
# other axis: give each rank `E / N` *whole* experts. That is **expert parallelism**, SGLang's `--ep-size`.
#
# The tokens still have to meet their experts, and there are two ways to arrange it:
#
# * **All-to-all dispatch** (SGLang's DeepEP and its `moe_a2a_backend`, with attention run data-parallel, each rank
#   on its own requests). After routing, each rank sends every token's hidden state to the ranks that hold its
#   chosen experts, the experts run on what arrived, and a second all-to-all sends the weighted results back. Each
#   rank moves only the rows its tokens need, which scales to many GPUs and to several machines, at the price of
#   two irregular exchanges per layer whose sizes depend on the routing.
# * **All-reduce** (attention under tensor parallelism: after it, every rank holds every token's hidden state
#   anyway). Every rank runs the whole router, computes the pairs routed to its own experts, leaves the others at
#   zero, and one all-reduce of `[T, H]` sums the partial outputs: the same collective as a tensor-parallel MLP.
#   No token is sent anywhere.
#
# This engine does the second, and it does both cuts with one mechanism. The `tp` ranks form `ep_size` groups of
# `tp / ep_size` ranks: a group holds a block of `E / ep_size` experts, and each rank of a group holds a slice of
# the width of each of them (SGLang's `moe_tp_size = tp / ep_size`). `ep_size = 1` is the tensor-parallel cut,
# `ep_size = tp` keeps every expert whole. Every (pair, slice) is computed on exactly one rank, and the layer's
# output is the sum of them all, so the one all-reduce at the end is exact whichever cut is chosen:

# %%
show_code(MoEBlock.forward)

# %%
show_code(localize_routing)

# %% [markdown]
# `localize_routing` keeps the router's choices that fall on this rank's experts, renumbered to their rows in the
# local stacks, and turns every other pair into expert `-1` with weight 0, which both expert functions skip (the
# fused kernel's layout puts those pairs in a bucket that gets no block). It is elementwise on the device, so the
# layer still replays in a CUDA graph with any routing. In one process we can play all the ranks of a layer and
# check that their partial outputs add up to the whole layer, for both cuts:

# %%
g = torch.Generator().manual_seed(5)
E_EP, K_EP, H_EP, I_EP, T_EP = 8, 2, 32, 16, 6
x_ep = torch.randn(T_EP, H_EP, generator=g)
w13_ep = torch.randn(E_EP, 2 * I_EP, H_EP, generator=g) / H_EP**0.5
w2_ep = torch.randn(E_EP, H_EP, I_EP, generator=g) / I_EP**0.5
weights_ep, ids_ep = route(torch.randn(T_EP, E_EP, generator=g), K_EP, renormalize=True)
whole = reference_experts(x_ep, w13_ep, w2_ep, weights_ep, ids_ep)


def rank_part(rank: int, tp: int, ep: int) -> torch.Tensor:
    """What rank ``rank`` of ``tp`` computes with ``ep`` expert groups: its block of experts, its slice of each."""
    moe_tp = tp // ep
    block = local_experts(rank // moe_tp, ep, E_EP)
    width = local_width(I_EP, moe_tp)
    cols = slice((rank % moe_tp) * width, (rank % moe_tp + 1) * width)
    w13 = torch.cat([w13_ep[block.start:block.stop, cols], w13_ep[block.start:block.stop, I_EP:][:, cols]], dim=1)
    w2 = w2_ep[block.start:block.stop, :, cols]
    return reference_experts(x_ep, w13, w2, *localize_routing(weights_ep, ids_ep, block))


rows = []
for tp, ep in [(2, 2), (2, 1), (4, 2), (4, 4)]:
    parts = [rank_part(r, tp, ep) for r in range(tp)]
    rows.append([tp, ep, tp // ep, f"{E_EP // ep} of {E_EP}", f"{I_EP // (tp // ep)} of {I_EP}",
                 f"{(sum(parts) - whole).abs().max().item():.1e}"])
display(show_table(rows, headers=["tp", "ep", "moe_tp", "experts per rank", "width per expert",
                                  "max |sum of partials - whole layer|"]))

# %% [markdown]
# The engine's tests run the same check with real processes: two and four CPU ranks over gloo (logits within 1e-5
# of one process at `tp = ep = 2`, at `tp = 2, ep = 1` and at `tp = 4, ep = 2`, and equal greedy tokens through
# the engine) and two GPUs over NCCL.
#
# **Which cut reads less?** Both hold `1/N` of the expert weights per rank, and both end with the same all-reduce
# of `T x H`. They differ in what a decode step *reads*. Under the tensor-parallel cut a rank reads `1/N` of every
# expert the batch hit, so the ranks share the bytes exactly. Under expert parallelism a rank reads only its own
# experts that were hit, and the layer waits for the rank whose block was hit most. Uniform routing, Qwen3-30B-A3B's
# 128 experts and 8 choices, simulated:

# %%
gen_ep = torch.Generator().manual_seed(11)


def busiest_share(batch: int, ranks: int, draws: int = 300) -> float:
    """Expert parallelism over ``ranks``: the busiest rank's hit experts over the hit experts' mean per rank."""
    ratios = []
    for _ in range(draws):
        hit = torch.zeros(E, dtype=torch.bool)
        hit[torch.rand(batch, E, generator=gen_ep).topk(K, dim=1).indices.reshape(-1)] = True
        per_rank = hit.reshape(ranks, E // ranks).sum(dim=1).float()
        ratios.append((per_rank.max() / per_rank.mean()).item())
    return float(np.mean(ratios))


EP_BATCHES = [1, 2, 4, 8, 16, 32, 64, 128]
EP_RANKS = [2, 4, 8]
share = {n: [busiest_share(b, n) for b in EP_BATCHES] for n in EP_RANKS}
display(show_table([[b, f"{expected_experts(b):.0f}"] + [f"{share[n][i]:.2f}x" for n in EP_RANKS]
                    for i, b in enumerate(EP_BATCHES)],
                   headers=["batch", "experts hit"] + [f"busiest rank, ep = {n}" for n in EP_RANKS]))

# %% alt="Line chart against the batch size (1 to 128, log scale): the expert bytes the busiest rank reads under expert parallelism, as a multiple of what every rank reads under the tensor-parallel cut. With 2 ranks it starts at 1.26 and is within 3% of 1.0 by batch 32; with 4 ranks it starts at 1.75; with 8 ranks at 2.57 at batch 1 and 1.43 at batch 8; all reach 1.0 by batch 64 to 128, where every expert is hit." caption="Uniform routing at Qwen3-30B-A3B's shape: the expert weights the busiest rank reads per decode step under expert parallelism, relative to the even share of the tensor-parallel cut." tags=["hide-input"]
fig, ax = plt.subplots(figsize=(5.4, 3.0))
for n in EP_RANKS:
    ax.plot(EP_BATCHES, share[n], "o-", label=f"{n} ranks")
ax.axhline(1.0, color="0.4", ls="--", lw=1, label="tensor-parallel cut")
ax.set_xscale("log", base=2)
ax.set_xticks(EP_BATCHES, [str(b) for b in EP_BATCHES])
ax.set_xlabel("decode batch (tokens per step)")
ax.set_ylabel("busiest rank's expert bytes")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# Figure 14.4: at small batches expert parallelism reads more on its busiest rank: at batch 1 the 8 chosen experts fall unevenly
# on the ranks' blocks, and with 8 ranks the busiest holds 2.6 of them on average while the even share is one;
# with 2 ranks it is 26% over its share. From about 64 tokens a step every expert is hit and the two cuts read the same bytes. What the bytes do
# not show is the kernel's side: under the tensor-parallel cut at `N = 8`, each rank's slice of an expert is 96
# columns of 768, tiles too thin to keep a GPU's programs busy, while expert parallelism keeps every expert whole.
# And routing on real text is not uniform (section 2): a popular expert makes its rank the straggler under expert
# parallelism and costs nothing extra under the tensor-parallel cut, which is why SGLang's expert-parallel load
# balancer replicates hot experts.
#
# On two GPUs the two cuts are one flag apart (`--tp-size 2 --ep-size 2` against `--tp-size 2 --ep-size 1`), on
# the same canonical workload as section 6:
#
# ```bash
# python -m minisgl_ref bench offline --model-path qwen3-30b-a3b --load-format dummy --tp-size 2 --ep-size 2
# python -m minisgl_ref bench offline --model-path qwen3-30b-a3b --load-format dummy --tp-size 2 --ep-size 1
# ```

# %% [markdown]
# ## 6. Measurements on a GPU
#
# `scripts/gpu/measure/moe_kernel.py` times one MoE layer at Qwen3-30B-A3B's shape (hidden 2,048, experts of width
# 768, 128 experts, 8 per token, bfloat16) on an H200, for `T` from 1 to 1,024 tokens with uniform random routing:
# the fused kernel replayed from a CUDA graph, the fused kernel called eagerly (the `align_by_expert` launches
# included), and the reference loop (`docs/data/moe_kernel_h200.json`, 50 repetitions each). The bytes are those of
# the experts the routing touched, which the kernel must read at least once; the achieved bandwidth is those bytes
# over the fused time.

# %%
KERNEL = json.loads((ROOT / "docs" / "data" / "moe_kernel_h200.json").read_text())
KROWS = KERNEL["rows"]
display(show_table([[r["tokens"], r["block_m"], r["experts_touched"], f"{r['weight_bytes'] / 1e6:.0f}",
                     f"{r['fused_us']:.0f}", f"{r['fused_eager_us']:.0f}", f"{r['reference_us']:.0f}",
                     f"{r['speedup_vs_reference']:.0f}x", f"{r['fused_weight_gbps'] / 1e3:.2f}",
                     f"{r['max_abs_diff_vs_reference']:.4f}"] for r in KROWS],
                   headers=["T", "BLOCK_M", "experts hit", "expert MB", "fused, graph (µs)", "fused, eager (µs)",
                            "reference (µs)", "speed-up", "TB/s", "max diff"]))

# %% alt="Two panels against tokens per layer call (1 to 1,024, log scale). Left: time in microseconds on a log scale: the reference loop rises from 1,450 to 46,000 µs, the eager fused kernel stays between 620 and 1,530 µs, the graph-replayed fused kernel rises from 98 µs at T = 1 to 692 µs at T = 1,024. Right: the fused kernel's achieved bandwidth on the touched experts' weights: 0.77 TB/s at T = 1, 1.95 at T = 8, 2.19 at T = 64, 1.96 at 256 and 1.75 at 1,024, against a dashed line at the H200's 4.8 TB/s." caption="One MoE layer at Qwen3-30B-A3B's shape on an H200: time of the fused kernel (graph-replayed and eager) and of the reference loop, and the fused kernel's achieved bandwidth on the expert weights it must read." tags=["hide-input"]
fig, (ax_t, ax_bw) = plt.subplots(1, 2, figsize=(9, 3.3))
ts = [r["tokens"] for r in KROWS]
ax_t.plot(ts, [r["reference_us"] for r in KROWS], "s--", label="reference loop")
ax_t.plot(ts, [r["fused_eager_us"] for r in KROWS], "^:", label="fused, eager")
ax_t.plot(ts, [r["fused_us"] for r in KROWS], "o-", label="fused, CUDA graph")
ax_t.set_xscale("log", base=2)
ax_t.set_yscale("log")
ax_t.set_xlabel("tokens T")
ax_t.set_ylabel("time per layer (µs)")
ax_t.legend(fontsize=8)
ax_bw.plot(ts, [r["fused_weight_gbps"] / 1e3 for r in KROWS], "o-", label="fused kernel")
ax_bw.axhline(HBM_BPS / 1e12, color="0.4", ls="--", lw=1, label="H200 datasheet, 4.8 TB/s")
ax_bw.set_xscale("log", base=2)
ax_bw.set_ylim(0, 5.2)
ax_bw.set_xlabel("tokens T")
ax_bw.set_ylabel("TB/s on the touched experts")
ax_bw.legend(fontsize=8)
for a in (ax_t, ax_bw):
    a.set_xticks(ts, [str(t) for t in ts])
fig.tight_layout()
plt.show()

# %% [markdown]
# Figure 14.5 in three observations.
#
# * **The fused kernel is 15x to 67x faster than the loop.** At `T = 1` the loop launches 16 small matmuls and
#   pays for each; from `T = 256` it runs all 128 experts one after the other (46 ms at `T = 1,024`), while the
#   fused kernel, replayed from a graph, takes 0.1 to 0.7 ms. Called eagerly it is 0.6 to 1.5 ms: the layout's
#   twenty-odd small torch launches (section 3) dominate at small `T`, which is why a decode step should replay
#   the layer from a CUDA graph, and why SGLang does the layout in one small CUDA kernel.
# * **At decode it is far from the roofline.** Eight experts are 75 MB per layer, 16 µs at 4.8 TB/s; the kernel
#   takes 98 µs (0.77 TB/s). With one row per expert, each program streams one `BLOCK_N` slice of one expert's
#   weights: too little work per program to keep enough loads in flight. From `T = 8` to `T = 256` it reaches
#   2.0-2.2 TB/s, about 45% of the datasheet figure, with untuned block sizes (vLLM's and SGLang's defaults,
#   without their per-shape tuned tables).
# * **The bytes follow section 1.** The benchmark draws one uniform routing per `T`; the experts it hits (8, 44,
#   123, 128, 128) are close to the formula's averages (8, 52, 126, 128, 128). From `T = 64` the layer reads nearly
#   all of its 1.2 GB, and its time grows by only 1.3x from `T = 64` to `T = 1,024` while the tokens grow 16-fold.
#   (At `T = 1` part of the 75 MB may still sit in the H200's 60 MB L2 cache from the previous replay of the same
#   routing, so the smallest `T` can read slightly fast.)
#
# **End to end.** `python -m minisgl_ref bench offline --model-path qwen3-30b-a3b --load-format dummy
# --enable-expert-distribution-metrics --hbm-bandwidth 4.278e12` serves the whole model (48 layers, random
# weights of the real shapes, so routing is close to uniform) on chapter 11's canonical workload on one H200, with
# the fused kernel replayed in CUDA graphs and the routing counted (below). The bandwidth is the H200's measured
# copy bandwidth (`scripts/gpu/measure/hbm_bandwidth.py`, `docs/data/hbm_bandwidth_h200.json`;
# `docs/data/moe_canonical_h200.json`):

# %%
E2E = json.loads((ROOT / "docs" / "data" / "moe_canonical_h200.json").read_text())
run = E2E["results"][0]
bw = E2E["provenance"]["settings"]["bandwidth"]
HBM = json.loads((ROOT / "docs" / "data" / "hbm_bandwidth_h200.json").read_text())["bandwidth_bytes_per_s"]
dist = run["expert_distribution"]
active = sum(dist["active_expert_steps"]) / (dist["steps"] * len(dist["layer_ids"]))
print(f"{run['output_tokens']:,} output tokens in {run['wall_s']:.1f} s: {run['output_throughput']:,.0f} output tok/s, "
      f"{run['decode_steps']:,} decode steps, start-up {run['startup_s']:.0f} s")
print(f"floor at {bw / 1e12:.2f} TB/s (measured: {HBM / 1e12:.2f}), every weight read per step: "
      f"{run['roofline_floor_s']:.1f} s ({run['roofline_fraction']:.1%} of it reached)")
print(wrap(f"experts routed to per layer and step: {active:.1f} of {dist['num_experts']}; the floor of reading "
           f"only those: {run['routed_floor_s']:.1f} s ({run['routed_floor_fraction']:.1%} of it reached)"))

# %% [markdown]
# The first floor is chapter 11's: each decode step reads every weight once, plus the KV. Against it the engine
# reaches under half. Much of the gap is the expert layer: the kernel above reads the experts at 2.0-2.2 TB/s,
# half of what the memory system can do.
#
# For an MoE model "every weight once" is right only while a step reaches every expert, which section 1 says
# happens from about 64 tokens a step on. The tail of a run, when few requests are left, and every small batch read
# less. The honest floor counts the experts each step really routed to, and only a run can say which those were.
#
# **Counting the routing.** `ExpertDistribution` (`minisgl_ref/moe/distribution.py`, SGLang's expert distribution
# record) keeps two device counters per sparse layer: the (token, choice) pairs each expert received, and the sum
# over steps of the distinct experts a step picked. It is built with `enable_expert_distribution_metrics=True` (or
# `bench offline --enable-expert-distribution-metrics`) and counts between `start_expert_distribution_record()` and
# `stop_expert_distribution_record()`:

# %%
show_code(ExpertDistribution.record)

# %% [markdown]
# Everything is a tensor operation on fixed-size buffers, so the counting is captured into the decode steps' CUDA
# graphs like the rest of the layer. A graph replays a batch padded to a captured size, and the padding rows route
# like any token; they write their KV to the reserved slot 0, which no real token uses, so `out_cache_loc != 0`
# tells the counter which rows to count. On the tiny Qwen3-MoE of section 4 (8 experts, 2 per token), the same
# prompts run one at a time and then together:

# %%
counted = LLM(QWEN, device="cpu", dtype="float32", attention_backend="torch_native", max_total_tokens=4096,
              disable_radix_cache=True, enable_expert_distribution_metrics=True)
greedy_8 = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
rows = []
for label, batches in [("one at a time", [[p] for p in PROMPTS]), ("together", [PROMPTS])]:
    counted.start_expert_distribution_record()
    for batch in batches:
        counted.generate(batch, greedy_8, use_tqdm=False)
    counted.stop_expert_distribution_record()
    rec = counted.dump_expert_distribution_record()
    rows.append([label, rec["steps"], rec["tokens"],
                 " / ".join(f"{a:.2f}" for a in rec["active_experts_per_step"]),
                 " ".join(str(c) for c in rec["pairs"][0])])
counted.shutdown()
display(show_table(rows, headers=["prompts", "steps", "tokens", "experts per step (layer 0 / 1)",
                                  "pairs per expert, layer 0"]))

# %% [markdown]
# Run one at a time, a decode step's single token reads 2 of the 8 experts (the prefill steps, with many tokens,
# read more); run together, a decode step's three tokens reach more of them, in fewer steps. The floor of a counted
# run charges each step the weights that are not experts, the experts it routed to, and the KV it read
# (`routed_floor_seconds` in `minisgl_ref/bench/offline.py`; the benchmark reports it as "of routed floor"):

# %%
show_code(routed_floor_seconds)

# %% [markdown]
# If every step hit every expert, it would be chapter 11's floor of as many steps, and each expert a step leaves
# unread takes one expert's bytes (9.4 MB at Qwen3-30B-A3B's shape) off it; the tests check both.
#
# On the canonical run above the counter found 120 of the 128 experts per layer in an average step: with up to 256
# requests a step, most steps reach nearly every expert (section 1's formula gives 128 from about 64 tokens on), and
# only the run's tail reads fewer. So the routed floor is only 4% below the every-expert one, and the engine reaches
# 43% of it. The floor that counts routing earns its keep at small batches, where a step reads a fraction of the
# experts; on this workload the distance to the floor is the kernel's.
#
# **The fused kernel in the engine.** `scripts/gpu/measure/moe_endtoend.py` builds the same model once, CUDA graphs
# off (the reference loop reads the routing back to the host, which a graph cannot hold), and runs a 16-request
# canonical workload with each experts function in turn (`docs/data/moe_endtoend_h200.json`):

# %%
ENDTOEND = json.loads((ROOT / "docs" / "data" / "moe_endtoend_h200.json").read_text())
display(show_table([[r["experts"], f"{r['wall_s']:.2f}", f"{r['output_throughput']:.0f}"] for r in ENDTOEND["runs"]],
                   headers=["experts function", "wall (s)", "output tok/s"]))
print(f"fused {ENDTOEND['speedup_fused_over_reference']:.1f}x the reference (median of each); identical greedy "
      f"tokens in {ENDTOEND['requests_with_identical_greedy_tokens']} of {ENDTOEND['requests']} requests")

# %% [markdown]
# The fused kernel makes the whole model 8.4 times faster than the loop over experts. The two compute the same
# layer up to the order of bf16 additions, and on random weights that is enough to flip a near-tie now and then:
# four of the sixteen requests part after some tokens, the rest agree to the last token (on the CPU, in float32,
# the tests find them equal to rounding).

# %% [markdown]
# ## Summary
#
# * **Why MoE.** Qwen3-30B-A3B has 30.5 billion parameters and runs 3.3 billion per token. A decode step reads the
#   experts its batch reaches, `E (1 - (1 - k/E)^B)` per layer under uniform routing: 6.1 GB of weights at batch 1
#   (a dense 3.3B model reads 6.7 GB), 26 GB at batch 8, and as much as a dense 30B model from about 64 tokens on.
# * **The router** (task 14.2): softmax over all experts in float32, the top `k`, and a renormalisation of those `k`
#   when the config asks (`norm_topk_prob`); Mixtral's "softmax of the top-`k` logits" is the same function.
#   Routing on real text is uneven even with random weights.
# * **The expert computation.** The reference loops over experts. The fused kernel sorts the `T * k` pairs by
#   expert and pads each group to whole blocks (task 14.1, `align_by_expert`), so that one grouped GEMM gives each
#   program one expert's rows and one weight tile per step; SiLU-times-up is fused into the first launch, the
#   routing weight into the second, and the `k` rows of a token are summed deterministically. All sizes follow from
#   `T`, so the layer replays in a CUDA graph with any routing. It equals the reference on the CPU through Triton's
#   interpreter.
# * **The models.** Qwen3-MoE and Mixtral are chapter-01 decoder layers with an `MoEBlock` as their MLP, loaded
#   expert by expert into stacks, registered with the loader through `register_architecture`; their logits and
#   greedy text match transformers'. The dense models are untouched.
# * **Splitting over GPUs.** `--ep-size` groups the ranks: each group holds a block of whole experts, each rank of
#   a group a slice of their width (`ep_size = 1`: every expert sliced, as chapter 09 slices an MLP; `ep_size =
#   tp`: every expert whole). Every rank holds every token after attention, so one all-reduce of partial outputs
#   combines them, exact for either cut. Under uniform routing expert parallelism's busiest rank reads 1.26x (2
#   ranks) to 2.57x (8 ranks) the even share at batch 1, and the same from about 64 tokens a step.
# * **Counting the routing.** An on-device counter, captured in the CUDA graphs and blind to their padding rows,
#   gives the experts each step read, and with them the floor of a run that reads only those.
# * **On an H200** the fused layer is 15x to 67x faster than the loop (98 µs at `T = 1`, 692 µs at `T = 1,024`),
#   reaching 2.0-2.2 TB/s on the touched experts from `T = 8` to 256 and 0.77 TB/s at decode.

# %% [markdown]
# ## Exercises
#
# 1. **Task 14.2.** Write the router's weights in `route` (`minisgl_ref/moe/router.py`) and grade it with
#    `python -m minisgl_ref.course grade --task 14.2`. Then take the softmax over the top-`k` logits for every
#    family: which test fails, and which released checkpoint would your engine now serve wrongly?
# 2. **Task 14.1.** Write `align_by_expert` in `minisgl_ref/moe/fused_moe.py` and grade both tasks with
#    `python -m minisgl_ref.course grade --chapter 14`. Run section 3 again: Figure 14.3 and the fused kernel's
#    agreement with the reference are now your layout's. Why must an expert that no token chose get no block at all,
#    and what would the kernel compute for such a block?
# 3. **The expected experts.** Derive `E (1 - (1 - k/E)^B)`, then compute how many experts per layer Mixtral-8x7B
#    (`E = 8`, `k = 2`) reaches at batches 1, 4 and 16, and the weight bytes of its decode step from its shipped
#    config (`minisgl_ref/models/configs/mixtral-8x7b.json`). At what batch does it read as much as a dense model
#    of its total size?
# 4. **Skewed routing.** Redo section 1's simulation with a router that prefers some experts (draw the scores with
#    a fixed per-expert bias). How do the distinct experts and the bytes per step change, and how does the busiest
#    expert's share change? Which of the two matters for one GPU, and which under expert parallelism?
# 5. **Block size.** Call `align_by_expert` on uniform routing at Qwen3-30B-A3B's `E = 128`, `k = 8` for
#    `T = 1, 16, 256, 1024` with `block_m` 16 and 64, and count the padding rows. Compare with
#    `default_block_m`'s rule and its docstring's reasoning.
# 6. **No renormalisation.** Load section 2's tiny Qwen3-MoE checkpoint with `norm_topk_prob` switched off in its
#    `config.json`. How much do the logits change, and which tokens' MLP updates shrink most?
#
# ## Reproduce
#
# ```bash
# python chapters/14_mixture_of_experts.py                      # this chapter, end to end (CPU)
# python -m minisgl_ref.course grade --chapter 14               # the tests of tasks 14.1 and 14.2
# python -m pytest tests/test_notebooks.py -q -k 14             # the notebook runs top to bottom
# python -m pytest tests/test_fused_moe.py tests/test_moe_models.py -q   # the kernel, the layout, the models
# python -m pytest tests/test_moe_ep.py tests/test_moe_distribution.py -q   # the split over ranks, the counter
# python -m pytest tests/test_fused_moe.py -q -m gpu            # on a GPU: Qwen3-30B-A3B's shape, CUDA graphs
# PYTHONPATH=$PWD python3 scripts/gpu/measure/moe_kernel.py --out results   # on a GPU: section 6's table
# PYTHONPATH=$PWD python3 scripts/gpu/measure/moe_endtoend.py --out results  # on a GPU: fused against the loop
# python -m minisgl_ref bench offline --model-path qwen3-30b-a3b --load-format dummy \
#     --enable-expert-distribution-metrics --hbm-bandwidth 4.28e12                # on an H200: the routed floor
# ```
#
# Expected on a 2-core x86_64 CPU: the chapter in about a minute (most of it transformers' models and the kernel in
# Triton's interpreter); logits within 1e-5 of transformers' and equal greedy tokens. On one H200
# (`docs/data/moe_kernel_h200.json`): about 98, 213, 531, 616 and 692 µs per layer for the fused kernel replayed
# from a graph at `T` = 1, 8, 64, 256 and 1,024, against 1.4 to 46 ms for the reference loop; the canonical
# workload at about 3,400 output tok/s, 43% of its routed floor (`docs/data/moe_canonical_h200.json`), and the
# whole model 8.4 times faster with the fused kernel than with the loop (`docs/data/moe_endtoend_h200.json`).

# %%
print(f"chapter ran in {time.perf_counter() - CHAPTER_START:.0f} s")
