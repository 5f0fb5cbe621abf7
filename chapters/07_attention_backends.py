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
# # Chapter 07 — Attention backends
#
# **What you will build.** The layer between the model and the attention kernels. Until now every step ran
# `torch_native`: gather each request's keys and values through its page-table row, then a plain masked softmax,
# one request at a time. It is the oracle, and it is slow. This chapter adds three fast *backends* behind one
# interface, and the flags that choose them:
#
# | backend | kernels | where |
# | --- | --- | --- |
# | `torch_native` | plain PyTorch, one request at a time | CPU and GPU: the reference |
# | `triton` | written in this project, in Triton: split-KV decode, paged extend | any GPU; CPU through Triton's interpreter (tests) |
# | `flashinfer` | flashinfer-python's paged prefill and decode wrappers; decode batches of 48+ rows on chapter 11's split-KV CUDA kernel when the engine hands it one | NVIDIA GPUs |
# | `fa3` | FlashAttention-3's `flash_attn_with_kvcache` (FA2's paged call where only FA2 is installed) | Hopper (FA2: Ampere+) |
#
# **Why it matters.** Attention is the only part of the model whose cost depends on the *context*: the weights
# are read once per step whatever the batch, but decode must stream every running request's whole KV cache once
# per generated token. With long contexts that is most of the bytes a step moves, so the attention kernel
# decides how close a step gets to the memory roofline. A serving engine therefore treats attention as a plug-in:
# the model says *what* to attend to, the backend decides *how*, and each backend can plan once per step what all
# layers then reuse.
#
# In this chapter you will:
#
# 1. read the interface (`init_forward_metadata` once per step, `attend_extend` / `attend_decode` per layer, and
#    three CUDA-graph hooks) and see what each backend plans per step (task 7.2 is the Triton backend's plan);
# 2. take the split-KV ("flash-decoding") decode kernel apart: why the context is cut into pieces and why the
#    pieces can be merged exactly (a figure and a numerical check), then the merge as a Triton kernel (task 7.1);
# 3. run our Triton kernels on this CPU in Triton's interpreter against `torch_native`, on tiny shapes;
# 4. choose backends with SGLang's flags, including a different backend per phase;
# 5. read the H100 results: every backend against `torch_native` on a grid of shapes, and each backend's decode
#    bandwidth against the measured copy bandwidth (the roofline), our Triton kernel as a fraction of FlashInfer.
#
# Modules: `minisgl_ref/attention/` (`base.py`, `torch_native.py`, `triton_backend.py` + `triton_kernels/`,
# `flashinfer_backend.py`, `fa3_backend.py`, `registry.py`), `benchmarks/kernels.py`.

# %% tags=["setup"]
import inspect
import json
import math
import os
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Our Triton kernels run on the CPU only in Triton's interpreter, and triton.jit reads this variable when it
    # decorates a kernel: it must be set before anything imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import display
from matplotlib.patches import FancyArrowPatch, Rectangle

from minisgl_ref.attention.base import AttentionBackend
from minisgl_ref.book import show_code, show_table, shorten, wrap
from minisgl_ref.attention.registry import (
    HybridAttnBackend,
    create_attention_backend,
    default_backends,
)
from minisgl_ref.attention.torch_native import TorchNativeBackend
from minisgl_ref.attention.triton_backend import TritonAttnBackend
from minisgl_ref.attention.triton_kernels import decode_attention, merge_kv_splits
from minisgl_ref.core.config import ATTENTION_BACKENDS, EngineConfig
from minisgl_ref.core.forward_batch import ForwardBatch, ForwardMode
from minisgl_ref.kvcache.allocator import PageAllocator
from minisgl_ref.kvcache.pool import KVPool
from minisgl_ref.kvcache.req_to_token import ReqToTokenPool
from minisgl_ref.layers.attention import AttentionLayer

CHAPTER_START = time.perf_counter()
torch.set_num_threads(int(os.environ.get("MINISGL_THREADS", "1")))
ROOT = next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "minisgl_ref").is_dir())
RESULTS = ROOT / "docs" / "data" / "gpu_kernels_h100.json"


def make_step(specs, *, kv_heads=2, gqa=2, head_dim=64, page_size=4, dtype=torch.float32, decode=False, seed=0):
    """One attention call laid out as the engine lays it out (chapter 03's pool, allocator and page table):
    ``specs`` is (cached prefix, new tokens) per request. Returns (batch, pool, table, layer, q, k, v)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(p + e for p, e in specs)
    allocator = PageAllocator(total // page_size + 2 * len(specs) + 2, page_size, "cpu")
    table = ReqToTokenPool(len(specs) + 1, max(p + e for p, e in specs) + 1, "cpu")
    pool = KVPool(1, allocator.capacity_pages * page_size + page_size, kv_heads, head_dim, dtype, "cpu")
    pool.k[0].normal_(generator=gen)
    pool.v[0].normal_(generator=gen)
    new_slots = []
    for row, (prefix, extend) in enumerate(specs):
        pre = allocator.alloc_tokens(0, 0, prefix)
        table.write(row, 0, pre)
        new = allocator.alloc_tokens(prefix, int(pre[-1]) if prefix else 0, extend)
        table.write(row, prefix, new)
        new_slots.append(new)
    n = sum(e for _, e in specs)
    q = torch.randn(n, kv_heads * gqa, head_dim, generator=gen, dtype=dtype)
    k = torch.randn(n, kv_heads, head_dim, generator=gen, dtype=dtype)
    v = torch.randn(n, kv_heads, head_dim, generator=gen, dtype=dtype)
    batch = ForwardBatch(
        mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
        input_ids=torch.zeros(n, dtype=torch.int64),
        positions=torch.tensor([p + i for p, e in specs for i in range(e)]),
        extend_lens_cpu=[e for _, e in specs], prefix_lens_cpu=[p for p, _ in specs], attn_backend=None,
        req_pool_indices=torch.arange(len(specs)), out_cache_loc=torch.cat(new_slots),
    )  # fmt: skip
    return batch, pool, table, AttentionLayer(0, kv_heads * gqa, kv_heads, head_dim), q, k, v


def attend(backend, batch, layer, q, k, v):
    """What the model runner and one attention layer do: plan once for the step, then run the layer."""
    batch.attn_backend = backend
    backend.init_forward_metadata(batch)
    return backend.forward(q, k, v, layer, batch)


def rel_error(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


# %% [markdown]
# ## 1. The interface
#
# A model's attention layer computes q, k and v for the step's new tokens and calls `batch.attn_backend.forward`.
# That one method is the same for every backend: it stores the new K/V into the pool at the slots `out_cache_loc`
# (decode steps with one kernel for K and V) and then calls the backend's attention for the step's mode. How the
# context is found (the page table) and which kernel runs is the backend's business. So a new backend is one file
# of about four methods: a constructor, `init_forward_metadata`, `attend_extend` and `attend_decode` (plus three
# small hooks if it wants CUDA graphs):

# %%
display(show_code(AttentionBackend.forward))
for name in ["init_forward_metadata", "attend_extend", "attend_decode", "init_graph_buffers", "prepare_capture",
             "prepare_replay"]:  # fmt: skip
    doc = (inspect.getdoc(getattr(AttentionBackend, name)) or "").split("\n\n")[0].replace("\n", " ")
    print(wrap(f"{name}{inspect.signature(getattr(AttentionBackend, name))}", indent=" " * 8))
    print(wrap(f"    {shorten(doc, 226)}", indent="    "), end="\n\n")

# %% [markdown]
# Three rules follow from "once per step, then once per layer":
#
# * **Plan once.** A model has 28 layers (Qwen3-0.6B) that all attend over the same contexts. Anything that
#   depends only on the batch (which slots each request's context occupies, how to cut the work over the SMs)
#   is computed in `init_forward_metadata` and reused 28 times.
# * **Extend vs decode.** `forward` dispatches on the batch mode. Extend rows (a prefill, a prefill behind a
#   cached prefix, a chunk of a chunked prefill, a mixed batch) have many new tokens per request and need a
#   causal mask over them; decode rows have exactly one, which allows a much simpler, memory-bound kernel.
# * **CUDA graphs (chapter 08).** A graph replays recorded kernels with recorded addresses, so the metadata must
#   live in buffers that never move: allocated once (`init_graph_buffers`), pointed at before capture
#   (`prepare_capture`), refilled *in place* before each replay (`prepare_replay`). Both hooks receive an
#   ordinary decode batch (the graph runner pads it with dummy requests itself), so they need no special case.
#   `torch_native` cannot be recorded (a Python loop over requests with host-side lengths) and keeps
#   `supports_cuda_graph = False`; the engine then runs decode eagerly.
#
# What each backend plans per step, for the same batch:
#
# | backend | per-step metadata | why that form |
# | --- | --- | --- |
# | `torch_native` | a list of slot tensors, one per request | a Python loop gathers each context |
# | `triton` | CSR `kv_indptr` [B+1] + `kv_indices` (slots laid end to end), `qo_indptr`, split count, float32 scratch | one flat index array serves any page size; built by one small kernel, no host sync |
# | `flashinfer` | the same CSR arrays (pool shown as pages of one token), then `wrapper.plan(...)`: the work split and workspace layout | the planner balances requests over SMs on the host, once per step |
# | `fa3` | dense `page_table` [B, max_len] (the batch's page-table rows) + `cache_seqlens` | FA3 reads a block table, like vLLM's |
#
# Task 7.2 is the Triton plan:

# %%
show_code(TritonAttnBackend, task="7.2")

# %% [markdown]
# Here are the two layouts for a small batch of two requests on pages of 4 tokens (the second request's context
# continues in a page that is not adjacent to its first: the page table hides that):

# %%
batch, pool, table, layer, q, k, v = make_step([(5, 1), (9, 1)], decode=True)
triton_backend = TritonAttnBackend(pool, table)
triton_backend.init_forward_metadata(batch)
md = triton_backend.forward_metadata
print("seq_lens              ", batch.seq_lens_cpu)
print("page-table rows       ",
      [table.table[r, :n].tolist() for r, n in zip(batch.req_pool_indices.tolist(), batch.seq_lens_cpu)])
print("triton/flashinfer CSR  kv_indptr =", md.kv_indptr.tolist())
print("                       kv_indices =", md.kv_indices.tolist())
fa3_page_table = table.table[batch.req_pool_indices, : max(batch.seq_lens_cpu)]
print("fa3 page_table (pages of one token; entries past a length are never read):")
print(fa3_page_table)

# %% [markdown]
# ## 2. Split-KV decode, taken apart
#
# A decode step has one query per request. The obvious grid (one program per request and KV head) is small: 64
# requests x 8 KV heads is 512 programs for 132 SMs, each streaming a 2048-token context alone with few loads in
# flight. Decode is memory bound, so that leaves bandwidth unused. **Split-KV** (flash-decoding) cuts each context
# into `S` pieces and gives each piece its own program (stage 1), then merges the pieces (stage 2).
#
# The merge is exact. Over a piece `s` with scores `x_j` (already scaled), stage 1 keeps its normalised output and
# its log-sum-exp:
#
# $$o_s = \frac{\sum_{j \in s} e^{x_j} v_j}{\sum_{j \in s} e^{x_j}}, \qquad \ell_s = \log \sum_{j \in s} e^{x_j}.$$
#
# The softmax over the whole context gives piece `s` the share $e^{\ell_s} / \sum_t e^{\ell_t}$ of the total mass,
# so
#
# $$o = \sum_s \frac{e^{\ell_s - m}}{\sum_t e^{\ell_t - m}}\, o_s, \qquad m = \max_s \ell_s,$$
#
# where subtracting `m` changes nothing mathematically and keeps every exponent at most 0. Our kernels use base 2
# (`exp2` is one instruction) and choose the pieces from each request's length inside the kernel, so short
# requests use fewer pieces and a CUDA graph needs no per-request split metadata.

# %% alt="Diagram: a row of 24 key/value cells of one request in four coloured pieces; an arrow from each piece to its program s = 0 to 3, which produces a partial output and its log-sum-exp; grey arrows from the four programs to a stage-2 box that sums the partial outputs weighted by exp(l_s - max l)." caption="Split-KV decode: each program attends over one piece of a request's context, and a second stage merges the pieces by their log-sum-exp." tags=["hide-input"]
fig, ax = plt.subplots(figsize=(11, 3.2))
n_tok, pieces = 24, 4
colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]
for j in range(n_tok):
    s = j * pieces // n_tok
    ax.add_patch(Rectangle((j, 2.0), 0.9, 0.8, color=colors[s], alpha=0.75))
ax.text(-0.5, 2.4, "K/V of one request\n(through kv_indices)", ha="right", va="center", fontsize=9)
for s in range(pieces):
    x0 = s * n_tok / pieces + 1.2
    ax.add_patch(Rectangle((x0, 0.6), 3.4, 0.7, color=colors[s], alpha=0.35))
    ax.text(x0 + 1.7, 0.95, f"program s={s}\n$o_{s}$, $\\ell_{s}$", ha="center", va="center", fontsize=9)
    ax.add_patch(FancyArrowPatch((x0 + 1.7, 2.0), (x0 + 1.7, 1.32), arrowstyle="->", mutation_scale=12))
    ax.add_patch(FancyArrowPatch((x0 + 1.7, 0.6), (12, -0.35), arrowstyle="->", mutation_scale=12, color="gray"))
ax.add_patch(Rectangle((9.5, -1.0), 5, 0.65, color="black", alpha=0.12))
ax.text(12, -0.67, r"stage 2: $o=\sum_s w_s o_s$, $w_s \propto e^{\ell_s - \max \ell}$", ha="center", va="center")
ax.text(-0.5, 0.95, "stage 1\n(B x KV heads x S programs)", ha="right", va="center", fontsize=9)
ax.set_xlim(-7, 25)
ax.set_ylim(-1.2, 3.0)
ax.axis("off")
ax.set_title("Split-KV decode: one query, its context cut into pieces, merged by log-sum-exp weights")
plt.show()

# %% [markdown]
# Figure 7.1's merge in ten lines of PyTorch, against one softmax over the whole context:

# %%
gen = torch.Generator().manual_seed(0)
scores = 3 * torch.randn(1000, dtype=torch.float64, generator=gen)  # one query's scaled scores
values = torch.randn(1000, 64, dtype=torch.float64, generator=gen)
full = torch.softmax(scores, 0) @ values
outs, lses = [], []
for piece in torch.arange(1000).tensor_split(7):  # 7 uneven pieces, as a kernel's programs see them
    outs.append(torch.softmax(scores[piece], 0) @ values[piece])
    lses.append(torch.logsumexp(scores[piece], 0))
lse = torch.stack(lses)
merged = (torch.softmax(lse, 0)[:, None] * torch.stack(outs)).sum(0)  # softmax(lse) = exp(lse - max) / sum
print(f"max |merged - full| = {(merged - full).abs().max().item():.1e} (float64)")
assert torch.allclose(merged, full, atol=1e-12)

# %% [markdown]
# ### The merge as a kernel (task 7.1)
#
# Stage 2 of our decode kernel is exactly that merge, for every request and head at once: grid `(B, H)`, one
# program per request and head, all of its pieces loaded in one tile. Two details make it a kernel rather than
# the ten lines above. It does not receive the pieces' boundaries: it recomputes from the context length how
# stage 1 cut it (`min(max_splits, cdiv(n, min_split_len))` pieces of `cdiv(n, pieces)` tokens, the last one
# shorter), so a CUDA graph needs no per-request split metadata; a short request uses fewer pieces, and the
# scratch slots of the pieces it did not use hold garbage that must get weight 0. And it works in base 2 like
# stage 1: `lse` is a log2-sum-exp2 and the weights are `exp2(lse - max)`.

# %%
show_code(decode_attention, task="7.1")

# %% [markdown]
# The same 1000 scores, cut the way stage 1 cuts a context of 1000 tokens with `max_splits=8` and
# `min_split_len=150`: 7 pieces (six of 143 tokens and one of 142), the 8th scratch slot unused (NaN here), then
# merged by the kernel (in Triton's interpreter on this CPU):

# %%
n_ctx, max_splits, min_split_len = 1000, 8, 150
split_len = -(-n_ctx // min(max_splits, -(-n_ctx // min_split_len)))
mid_o = torch.full((1, 1, max_splits, 64), float("nan"))  # [B, H, splits, D]; unused slots hold garbage
mid_lse = torch.full((1, 1, max_splits), float("nan"))
for i, lo in enumerate(range(0, n_ctx, split_len)):
    piece = slice(lo, min(lo + split_len, n_ctx))
    mid_o[0, 0, i] = (torch.softmax(scores[piece], 0) @ values[piece]).float()
    mid_lse[0, 0, i] = torch.logsumexp(scores[piece], 0) / math.log(2)  # log2 units, as stage 1 stores it
out = torch.empty(1, 1, 64)
merge_kv_splits(mid_o, mid_lse, out, torch.tensor([0, n_ctx], dtype=torch.int32), max_splits, min_split_len)
print(f"{len(range(0, n_ctx, split_len))} pieces of up to {split_len} tokens; max |kernel - full softmax| = "
      f"{(out[0, 0].double() - full).abs().max().item():.1e} (float32 pieces)")
assert torch.allclose(out[0, 0].double(), full, atol=1e-5)

# %% [markdown]
# ## 3. Our Triton kernels on this CPU
#
# With `TRITON_INTERPRET=1` set before `triton` is imported, `@triton.jit` kernels run in Triton's interpreter:
# every program of the grid executes one after another in NumPy. That is thousands of times slower than a GPU,
# but it runs the *same kernel source*, masks, index arithmetic and online softmax included, so tiny shapes check
# it exactly against `torch_native` in float32. Decode below uses several KV pieces per request and extend mixes
# a plain prefill, a cached prefix that is not page aligned and a decode-like row.

# %%
checks = []
for label, specs, decode, splits in [
    ("decode, 3 requests, up to 4 pieces", [(40, 1), (99, 1), (6, 1)], True,
     dict(max_kv_splits=4, min_kv_split_len=16)),
    ("extend, prefill + prefix + 1-token row", [(0, 30), (13, 20), (50, 1)], False, {}),
]:  # fmt: skip
    for dtype in (torch.float32, torch.bfloat16):
        batch, pool, table, layer, q, k, v = make_step(specs, gqa=2, head_dim=64, page_size=4, dtype=dtype,
                                                       decode=decode, seed=len(checks))  # fmt: skip
        ref_pool = KVPool(1, pool.num_slots, 2, 64, torch.float32, "cpu")
        ref_pool.k[0].copy_(pool.k[0])
        ref_pool.v[0].copy_(pool.v[0])
        t0 = time.perf_counter()
        out = attend(TritonAttnBackend(pool, table, **splits), batch, layer, q, k, v)
        seconds = time.perf_counter() - t0
        ref = attend(TorchNativeBackend(ref_pool, table), batch, layer, q.float(), k.float(), v.float())
        err = rel_error(out, ref)
        checks.append((label, str(dtype).replace("torch.", ""), err, seconds))
        print(f"{label:42s} {checks[-1][1]:9s} relative error {err:.1e}   (interpreter: {seconds:.2f} s)")
        assert err < (1e-5 if dtype == torch.float32 else 1e-2)

# %% [markdown]
# Float32 agrees to rounding (the kernels sum in a different order); bf16 is within its tolerance of 1e-2 (8
# bits of mantissa: each stored value is off by up to 2^-9 relative). The tests run many more shapes
# (`tests/test_attention_backends.py`, page sizes 1 and 16, GQA 1/2/4, head dims 16-128, the CUDA-graph hooks,
# whole engines).
#
# ## 4. Choosing backends
#
# SGLang's three flags, on every command (`generate`, `bench offline`, `serve`) and as `LLM(...)` keywords:
# `--attention-backend` for both phases, `--prefill-attention-backend` / `--decode-attention-backend` to override
# one phase. With no flag the device decides:

# %%
show_code(default_backends)

# %% [markdown]
# Why two backends by default on a Hopper GPU? Prefill is matrix work, where FA3's Hopper kernels (warpgroup
# MMA, TMA loads) lead (section 5 measures it); decode is streaming, where FlashInfer's planner keeps every SM
# busy for any mix of context lengths. When the phases differ the engine gets a `HybridAttnBackend`: extend steps
# go to one backend, decode steps (and the CUDA-graph hooks) to the other; both read and write the same KV pool.
# Whoever needs one half asks `phase_backend(decode)`, which every backend answers (itself, or a hybrid's half):
# the base class declares every hook the engine calls, each with a default that means "not supported", so the
# engine never has to ask what kind of backend it holds. Chapter 11 adds two more of them: extend steps in CUDA
# graphs (`supports_extend_graph` and three hooks like the decode ones) and `use_decode_kernel`, through which
# the engine hands the `flashinfer` backend a decode kernel of its own for large batches. Chapter 13 adds a
# capability, `supports_custom_mask`: whether an extend step may narrow, row by row, which of its new tokens each
# new token sees (`ForwardBatch.extend_masks`, a draft tree's ancestor mask). `torch_native`, `triton` and
# `flashinfer` have it; FA3's kernels mask only causally, so it refuses such a step rather than ignore the mask.
# On this CPU:

# %%
print("default on this machine:", default_backends(torch.device("cuda" if torch.cuda.is_available() else "cpu")))
batch, pool, table, layer, q, k, v = make_step([(12, 5), (0, 9)], page_size=4)
hybrid = create_attention_backend(
    EngineConfig(prefill_attention_backend="torch_native", decode_attention_backend="triton"), pool, table,
    num_q_heads=4, device="cpu",
)  # fmt: skip
print(f"{type(hybrid).__name__}: {hybrid.name}; CUDA graphs follow decode: {hybrid.supports_cuda_graph}")
assert isinstance(hybrid, HybridAttnBackend)

# %% [markdown]
# A backend that is asked for but cannot run stops the engine at start-up with one line, never a traceback from
# deep inside a kernel library:

# %%
device = torch.device("cpu")
for bad in [dict(attention_backend="flashattention"), dict(attention_backend="flashinfer"),
            dict(decode_attention_backend="fa3")]:  # fmt: skip
    try:
        config = EngineConfig(**bad)
        create_attention_backend(config, pool, table, num_q_heads=4, device=device)
    except ValueError as e:
        print(f"{bad}")
        print(wrap(f"    -> {e}", indent=" " * 7))
print("valid names:", ", ".join(ATTENTION_BACKENDS))

# %% [markdown]
# From the command line the same errors end in one `error:` line with exit status 2, e.g.
# `./minisgl generate --attention-backend flashinfer "hi"` on a CPU. Whole engines with the Triton backend
# generate exactly the naive oracle's greedy tokens on the CPU (`test_engine_triton_matches_the_naive_oracle`).
#
# ## 5. On an H100: correctness and the roofline
#
# Everything in this section was measured on an H100 80GB HBM3 by `scripts/gpu/chapter.sh 07` and is read from
# `docs/data/gpu_kernels_h100.json` (the numbers are not measured again here; the file carries the GPU, driver,
# versions, commit and command).
#
# **Correctness.** `pytest -m gpu tests/test_attention_backends.py` runs every backend against `torch_native`'s
# math (float32) on the same pool: batch sizes 1-256, contexts 1-8192, GQA 1/2/4/8, head dims 64/128, page
# sizes 1/16/64, bf16 and fp16, decode and extend with cached prefixes; CUDA-graph capture and replay of each
# backend's decode; and the whole engine on a 4-layer Qwen3-0.6B with dummy weights against the torch_native
# engine. The largest relative error of each backend over all shapes:

# %%
results = json.loads(RESULTS.read_text())
prov = results["provenance"]
print(wrap(f"{prov['hardware']['gpu']}, driver {prov['hardware']['nvidia_driver']}, torch {prov['software']['torch']}, "
           f"{', '.join(f'{k} {v}' for k, v in prov['settings']['kernel_packages'].items() if v)}"))  # fmt: skip
print(f"commit {prov['software']['git_commit']}; {results['correctness']['summary']}")
worst: dict[str, dict[str, float]] = {}
for entry in results["correctness"]["max_rel_error"]:
    dtype = "bf16" if "bf16" in entry["test"] else "fp16"
    for name, err in entry["max_rel_error"].items():
        worst.setdefault(name, {}).setdefault(dtype, 0.0)
        worst[name][dtype] = max(worst[name][dtype], err)
for name, errs in worst.items():
    print(f"  {name:10s} " + "  ".join(f"{d}: {e:.1e}" for d, e in sorted(errs.items())) + "   (limit 1e-2)")

# %% [markdown]
# The bf16 errors (~2e-3) are bf16's own rounding of the inputs and output, the fp16 ones eight times smaller
# (3 more mantissa bits); no backend is an outlier.
#
# **The roofline of decode.** A decode kernel must read every context token's K and V once: at batch 64 and
# context 2048 with 8 KV heads of 128 in bf16 that is 537 MB per layer and step. No kernel can read faster than
# memory delivers, so its *achieved bandwidth* (bytes it must move / its time) against the device's bandwidth says
# how close it is to the best possible. Two yardsticks are drawn: the device-to-device copy bandwidth measured in
# the same run (bytes read + written), and the datasheet's 3.35 TB/s of HBM3. The copy reached 2.44 TB/s on this
# H100 while the best decode kernels read at up to 3.10 TB/s: a copy mixes reads and writes, and every switch of
# the memory bus between the two costs cycles, whereas decode attention only reads (its output is a few KB). So
# for a read-only kernel the copy is a floor of what is possible rather than a ceiling, and the datasheet figure
# is the real ceiling (about 93% of it is reached).

# %% alt="Three panels. Left: achieved bandwidth in GB/s against context per request, 512 to 8,192 tokens, at batch 64 and 256, all three backends (Triton, FlashInfer, FA3) between about 2,300 and 3,100 GB/s, rising slightly with the context. Middle: bandwidth against batch size at context 2,048, rising from under 1,000 GB/s at batch 1 to about 3,000 from batch 64 on. Dotted lines mark the measured copy bandwidth, 2,438 GB/s, and the 3,350 GB/s datasheet. Right: a heat map of Triton's decode throughput over FlashInfer's by batch and context, ratios between 0.86 and 1.16." caption="Decode attention on an H100: bandwidth of each backend by context and by batch, and Triton's throughput relative to FlashInfer's." tags=["hide-input"]
copy_gbps = results["copy_bandwidth_GBps"]
DATASHEET_GBPS = 3350  # H100 SXM5 80GB HBM3
decode_rows = [r for r in results["decode"] if "bandwidth_GBps" in r]
names = [n for n in ("triton", "flashinfer", "fa3") if any(r["backend"] == n for r in decode_rows)]
contexts = sorted({r["context"] for r in decode_rows if r["gqa"] == 2})
batches = sorted({r["batch"] for r in decode_rows if r["gqa"] == 2})
style = {"triton": ("#c44e52", "o"), "flashinfer": ("#4c72b0", "s"), "fa3": ("#55a868", "^")}

fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
for name in names:
    color, marker = style[name]
    for bs, ls in ((64, "-"), (batches[-1], "--")):
        pts = sorted((r["context"], r["bandwidth_GBps"]) for r in decode_rows
                     if r["backend"] == name and r["batch"] == bs and r["gqa"] == 2)  # fmt: skip
        if pts:
            axes[0].plot(*zip(*pts), ls, color=color, marker=marker, label=f"{name}, batch {bs}")
    pts = sorted((r["batch"], r["bandwidth_GBps"]) for r in decode_rows
                 if r["backend"] == name and r["context"] == 2048 and r["gqa"] == 2)  # fmt: skip
    axes[1].plot(*zip(*pts), "-", color=color, marker=marker, label=name)
for ax in axes[:2]:
    ax.set_xscale("log", base=2)
    for level, label in ((copy_gbps, "copy (read + write), measured"), (DATASHEET_GBPS, "HBM3 datasheet")):
        ax.axhline(level, color="black", lw=1, ls=":")
        ax.text(ax.get_xlim()[0], level * 1.01, f" {label}: {level:.0f} GB/s", va="bottom", fontsize=8)
    ax.set_ylabel("achieved bandwidth (GB/s)")
    ax.set_ylim(0, DATASHEET_GBPS * 1.15)
    ax.legend(fontsize=7, loc="lower right")
axes[0].set_xlabel("context per request (tokens)")
axes[0].set_title("decode, GQA 2, by context")
axes[1].set_xlabel("batch size")
axes[1].set_title("decode, GQA 2, context 2048, by batch")
ratio_rows = results["decode_triton_over_flashinfer"]
grid = np.full((len(batches), len(contexts)), np.nan)
for r in ratio_rows:
    if r["gqa"] == 2 and r["batch"] in batches and r["context"] in contexts:
        grid[batches.index(r["batch"]), contexts.index(r["context"])] = r["triton_over_flashinfer"]
im = axes[2].imshow(grid, cmap="RdYlGn", vmin=0.5, vmax=1.2, aspect="auto")
for i in range(len(batches)):
    for j in range(len(contexts)):
        if not np.isnan(grid[i, j]):
            axes[2].text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8)
axes[2].set_xticks(range(len(contexts)), contexts)
axes[2].set_yticks(range(len(batches)), batches)
axes[2].set_xlabel("context")
axes[2].set_ylabel("batch")
axes[2].set_title("triton / flashinfer decode throughput")
fig.colorbar(im, ax=axes[2], fraction=0.05)
fig.suptitle(f"{prov['hardware']['gpu']}: decode attention, Qwen3-0.6B heads (16 q / 8 kv, head dim 128, bf16)")
fig.tight_layout()
plt.show()

# %% [markdown]
# In Figure 7.2 the batch matters far more than the context: from batch 64 on, every backend reads at 2,300 to
# 3,100 GB/s, closer to the datasheet line as the context grows, while a single request leaves most of the GPU
# idle. The heat map keeps the Triton kernel within 0.86 and 1.16 of FlashInfer everywhere, its weakest row at
# batch 32.
#
# Figure 7.3 puts the same measurements on a roofline: each point is one kernel call, placed by its arithmetic
# intensity (FLOPs per byte moved) and the FLOP/s it achieved. The slanted line is what the measured copy bandwidth
# allows, the flat one what the dense matmul measured in the same run reaches. Decode (filled markers) sits far left,
# under the bandwidth line: it can only go as fast as it reads the KV cache. Prefill (open markers) does far more work
# per byte and climbs toward the compute roof.

# %% alt="Log-log scatter of achieved TFLOP/s against arithmetic intensity, one point per kernel call, filled for decode and open for prefill, under a slanted roof for memory bandwidth (solid: the measured copy, dotted: the datasheet) that turns flat at the 682 TFLOP/s of the matmul. Decode points sit at 1 to 8 FLOP per byte, the best of them between the two slanted lines; prefill points sit at 60 to 3,000 FLOP per byte, between about 80 and 600 TFLOP/s." caption="The attention kernels of each backend on the H100's roofline, decode and prefill." tags=["hide-input"]
peak_tflops = results["matmul_tflops"]
fig, ax = plt.subplots(figsize=(8, 5))
for phase, rows, fill in (("decode", results["decode"], True), ("prefill", results["prefill"], False)):
    for name in names:
        pts = [(r["tflops"] * 1e12 / (r["bandwidth_GBps"] * 1e9), r["tflops"]) for r in rows
               if r["backend"] == name and r.get("bandwidth_GBps") and r.get("tflops")]  # fmt: skip
        if pts:
            color, marker = style[name]
            ax.scatter(*zip(*pts), color=color if fill else "none", edgecolors=color, marker=marker, s=28,
                       label=f"{name} {phase}")
intensity = np.logspace(-1, 4, 200)
for gbps, ls, label in ((copy_gbps, "-", "measured copy"), (DATASHEET_GBPS, ":", "HBM3 datasheet")):
    ax.plot(intensity, np.minimum(intensity * gbps / 1e3, peak_tflops), "k", ls=ls, lw=1,
            label=f"roof: {label} {gbps:.0f} GB/s, matmul {peak_tflops:.0f} TFLOP/s")
ax.set_xscale("log")
ax.set_yscale("log")
ax.set_xlabel("arithmetic intensity (FLOP per byte of Q, K, V and output moved)")
ax.set_ylabel("achieved TFLOP/s")
ax.set_title(f"{prov['hardware']['gpu']}: attention kernels on the roofline", fontsize=10)
ax.grid(alpha=0.3, which="both")
ax.legend(fontsize=7, loc="upper left")
fig.tight_layout()
plt.show()

# %% [markdown]
# Figure 7.3 places every decode call at a few FLOPs per byte, on or under the slanted lines and far from the flat
# roof: a decode kernel can only get faster by reading the KV cache faster. The numbers behind the target:

# %%
target = results["target"]
print(f"target: batch {target['batch']}, context {target['context']}, GQA {target['gqa']}: triton / flashinfer = "
      f"{target['triton_over_flashinfer']:.3f} (required >= {target['required']})")
print("\ndecode at batch 64, context 2048, by GQA ratio (16 query heads):")
gqa_rows = []
for gqa in sorted({r["gqa"] for r in decode_rows}):
    row = {r["backend"]: r for r in decode_rows if r["batch"] == 64 and r["context"] == 2048 and r["gqa"] == gqa}
    gqa_rows.append([gqa] + [f"{row[n]['time_us']:.1f} us, {row[n]['bandwidth_GBps']:.0f} GB/s" if n in row else "-"
                             for n in names])
display(show_table(gqa_rows, headers=["GQA"] + list(names)))
best = max(decode_rows, key=lambda r: r["bandwidth_GBps"])
print(f"\nhighest decode bandwidth: {best['backend']} {best['bandwidth_GBps']:.0f} GB/s "
      f"({best['bandwidth_GBps'] / DATASHEET_GBPS:.0%} of the datasheet) at batch {best['batch']}, "
      f"context {best['context']}")  # fmt: skip

# %% [markdown]
# **Prefill** is compute bound: each key is used by all the queries after it, so the kernels are measured in
# TFLOP/s against a bf16 matmul measured in the same run. Here our simple Triton extend kernel (one query head
# per program, no warp specialisation, no Hopper-specific instructions) is well behind; FA3, written for
# Hopper's warpgroup MMA and TMA, leads, which is why it is the default prefill backend on Hopper.

# %%
prefill_rows = [r for r in results["prefill"] if "tflops" in r]
print(f"bf16 matmul in the same run: {results['matmul_tflops']:.0f} TFLOP/s")
print(f"{'batch x (prefix + new)':>24s}  " + "".join(f"{n:>12s}" for n in names) + "   triton/flashinfer")
for shape in sorted({(r["batch"], r["prefix"], r["extend"]) for r in prefill_rows}):
    row = {r["backend"]: r for r in prefill_rows if (r["batch"], r["prefix"], r["extend"]) == shape}
    both = {"triton", "flashinfer"} <= row.keys()
    ratio = row["flashinfer"]["time_us"] / row["triton"]["time_us"] if both else math.nan
    print(f"{shape[0]:>10d} x ({shape[1]:>4d} + {shape[2]:>4d})  "
          + "".join(f"{row[n]['tflops']:>9.0f} TF" if n in row else f"{'-':>12s}" for n in names) + f"   {ratio:8.2f}")

# %% [markdown]
# ## Summary
#
# * **One interface, four implementations** (`torch_native`, `triton`, `flashinfer`, `fa3`): plan once per step in
#   `init_forward_metadata` (task 7.2 is the Triton plan), attend once per layer, and keep graph metadata in
#   buffers that never move.
# * **Split-KV decode** cuts each context into pieces so that a small batch can use the whole GPU, and its
#   log-sum-exp merge is exact (task 7.1).
# * **The oracle stays.** Every fast backend is tested against `torch_native`: our Triton kernels in Triton's
#   interpreter on the CPU, all of them on the GPU, where the largest bf16 errors are about 2e-3 and the fp16 ones
#   eight times smaller.
# * **Decode is a memory-streaming problem.** On an H100 the best decode kernels read the KV cache at up to 3.10
#   TB/s, about 93% of the 3.35 TB/s datasheet bandwidth and more than the 2.44 TB/s a device copy reaches.
# * **Prefill is compute-bound** and wants other kernels (FA3 leads on Hopper), so the two phases may use
#   different backends, joined by a `HybridAttnBackend` over one KV pool.
# * **Next.** Chapter 08 uses the backends' three graph hooks to record whole decode steps in CUDA graphs.

# %% [markdown]
# ## Exercises
#
# 1. **Task 7.1 (the merge).** Rewrite the `TASK 7.1` region of `_decode_stage2_kernel` in
#    `minisgl_ref/attention/triton_kernels/decode_attention.py` from its docstring and section 2. Work one request
#    through on paper first: 10 tokens, `max_splits=4`, `min_split_len=4`; how many pieces, of which lengths,
#    and which scratch slots must get weight 0? Grade it with `python -m minisgl_ref.course grade --task 7.1`
#    (on the CPU, in Triton's interpreter: the checks feed the merge pieces computed in float64, with NaN in the
#    slots it must not read).
# 2. **Task 7.2 (the plan).** Rewrite `TritonAttnBackend.init_forward_metadata` (section 1 shows what it builds).
#    Why does decode read `seq_lens` through the page table but extend only `prefix_lens`? Grade it with
#    `python -m minisgl_ref.course grade --task 7.2`.
# 3. **Splits.** `TritonAttnBackend.num_kv_splits` aims at 4 programs per SM. Time the decode kernel at batch 1
#    and 64 (context 2048) with `max_kv_splits=1` and with the default on a GPU. Where does splitting pay, and why
#    does it matter less at batch 256?
# 4. **GQA.** At GQA 4 our decode kernel reaches a lower fraction of FlashInfer than at GQA 2 (section 5). Count
#    the programs of stage 1 at batch 64 for both ratios and propose a change to `num_kv_splits`.
# 5. **Pages.** The FlashInfer and FA3 backends show the pool as pages of one token. Write the metadata for real
#    pages of 16 tokens (FA3: `table[rows, ::16] // 16`; FlashInfer: page indices and `last_page_len`) and
#    check it against `torch_native` in `tests/test_attention_backends.py`.
# 6. **A fifth backend.** Add `sdpa` (PyTorch's `scaled_dot_product_attention` over gathered K/V): one file,
#    `minisgl_ref/attention/sdpa_backend.py`, with a constructor, `init_forward_metadata`, `attend_extend` and
#    `attend_decode` (the base class already stores K/V), one entry in `registry.BACKENDS` and its name in
#    `ATTENTION_BACKENDS`. Check it against `torch_native` as the tests do. Which of the three CUDA-graph hooks
#    could it support?
#
# ## Reproduce
#
# ```bash
# python chapters/07_attention_backends.py                                  # this chapter (CPU, interpreter)
# python -m minisgl_ref.course grade --chapter 7                            # tasks 7.1 and 7.2 (CPU checks)
# python -m pytest tests/test_attention_backends.py -q -p no:cacheprovider  # every CPU test of the backends
# ./minisgl generate --attention-backend triton "Hello"                     # on a GPU (CPU: TRITON_INTERPRET=1)
# # on an H100 with flashinfer-python and FlashAttention-3 installed:
# bash scripts/gpu/chapter.sh 07                           # pytest -m gpu + python -m benchmarks.kernels
# python -m benchmarks.kernels --output docs/data/gpu_kernels_h100.json
# ```
#
# Measured on an NVIDIA H100 80GB HBM3 (driver 580.159.04, torch 2.11.0+cu130, triton 3.6.0, flashinfer-python
# 0.7.2.post1, tokenspeed-fa3 3.0.0.post20260810), from `docs/data/gpu_kernels_h100.json`:
#
# | what | measured |
# | --- | --- |
# | GPU tests: every backend vs torch_native (18 grid tests x 3 backends, 3 CUDA-graph tests, 4 engine tests) | 25/25 passed; worst relative error bf16 3.1e-3, fp16 4.0e-4 (limit 1e-2) |
# | copy bandwidth (read + write), same run; bf16 8192^3 matmul | 2.44 TB/s; 682 TFLOP/s |
# | decode, batch 64, context 2048, GQA 2: triton / flashinfer / fa3 | 184 / 184 / 189 us = 2.91 / 2.93 / 2.84 TB/s |
# | target: triton / flashinfer decode throughput at that shape (>= 0.8) | 0.996 |
# | triton / flashinfer decode over batch 1-256 x context 512-8192 (GQA 2) | 0.86-1.16, median 0.98 (weakest at batch 32) |
# | decode at GQA 4 (batch 64, context 2048): triton / flashinfer | 112 / 95 us: 0.85 (the known gap) |
# | highest decode bandwidth measured | 3.10 TB/s (fa3, batch 256, context 8192): 93% of the 3.35 TB/s datasheet |
# | prefill 1 x 4096 tokens: triton / flashinfer / fa3 | 235 / 408 / 550 TFLOP/s |
# | this chapter on a 2-core CPU (interpreter checks included) | about 15 s |

# %%
print(f"chapter ran in {time.perf_counter() - CHAPTER_START:.0f} s")
