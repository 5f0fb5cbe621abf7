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
# # Chapter 15 — Quantization
#
# **What you will build.** The scales that let a tensor live in one byte per number (`minisgl_ref/quant/fp8.py`),
# and see them at work in the engine's two largest streams of bytes: the weights of every projection (an FP8
# linear layer) and the KV cache (an FP8 pool).
#
# **Why it matters.** Chapter 11 showed that a decode step is bound by memory: it must read every weight once,
# and every token's context from the KV cache, and at a few thousand tokens a second the GPU spends its time
# waiting for those bytes, not multiplying them. Store each number in one byte instead of two and the floor of a
# step halves. The price is precision: an FP8 number keeps three bits of mantissa where bfloat16 keeps seven. This
# chapter measures that price on real text and shows where it is paid.
#
# In this chapter you will:
#
# 1. take apart the two FP8 formats (e4m3, e5m2) next to bfloat16: range, precision, the smallest numbers;
# 2. scale real weights into e4m3 per tensor, per channel and per block, and measure the error of each;
# 3. build an FP8 projection: the weight stored in e4m3, activations quantized on the fly, and the matmul of the
#    two (the dequantizing reference, and a Triton kernel that applies the scales group by group);
# 4. store the KV cache in FP8 and see which keys and values a fixed scale cannot hold;
# 5. measure what it costs: the perplexity of a fixed text with FP8 weights, an FP8 cache and both;
# 6. compute what it buys: the floor of chapter 11's canonical workload with half the bytes.
#
# Modules: `minisgl_ref/quant/` (`fp8.py` the formats and scales, `linear.py` FP8 projections, `fp8_gemm.py` the
# Triton matmul, `kv_cache.py` the FP8 pool, `registry.py` their registration with the core's seams) and
# `minisgl_ref/bench/perplexity.py`. The core declares three seams and never imports this package: a linear layer's
# `quant_method`, the loader's `register_quantization`, and the pool's `register_kv_cache_dtype`.

# %% tags=["setup"]
import json
import os
import time
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm's widget bar; its text bar is enough here

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernel below runs in Triton's interpreter on a CPU

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import display

from minisgl_ref import LLM
from minisgl_ref.bench.offline import roofline_floor_seconds, weight_bytes
from minisgl_ref.bench.workloads import canonical_workload
from minisgl_ref.book import setup_chapter, show_code, show_table, wrap
from minisgl_ref.models import ModelConfig, load_model
from minisgl_ref.models.embedded import embedded_model_path
from minisgl_ref.models.loader import SHIPPED_CONFIGS
from minisgl_ref.quant.fp8 import (
    E4M3,
    E5M2,
    dequantize_weight,
    expand_block_scale,
    quantize_activation,
    quantize_weight,
    scale_per_tensor,
)
from minisgl_ref.quant.fp8_gemm import group_scaled_gemm
from minisgl_ref.quant.kv_cache import Fp8KVPool
from minisgl_ref.quant.linear import Fp8LinearMethod, linear_layers
from minisgl_ref.quant.registry import register_quantizations

CHAPTER_START = time.perf_counter()
ROOT = setup_chapter()
register_quantizations()  # what build_runtime does; load_model below is called directly

# %% [markdown]
# ## 1. Numbers in one byte
#
# A floating-point number is a sign, an exponent and a mantissa: `(-1)^s * 2^(e - bias) * 1.m`. How the bits are
# shared between exponent and mantissa decides the format's range (the exponent) and its precision (the mantissa).
# bfloat16 gives 8 bits to the exponent, like float32, and 7 to the mantissa. The two FP8 formats have 7 bits for
# both together:

# %%
rows = []
for name, dtype, bits in [("bfloat16", torch.bfloat16, (8, 7)), ("e4m3 (float8_e4m3fn)", E4M3, (4, 3)),
                          ("e5m2 (float8_e5m2)", E5M2, (5, 2))]:
    info = torch.finfo(dtype)
    rows.append([name, f"1 + {bits[0]} + {bits[1]}", f"{info.max:,.0f}" if info.max < 1e6 else f"{info.max:.2e}",
                 f"{info.smallest_normal:.2e}",
                 f"{info.smallest_normal * 2.0 ** -bits[1]:.2e}", f"{2.0 ** -bits[1]:.1%}"])
display(show_table(rows, headers=["format", "sign + exponent + mantissa", "largest", "smallest normal",
                                  "smallest subnormal", "step / value (worst)"]))

# %% [markdown]
# e4m3 reaches only 448 (it gives up infinities to keep one more binade), and between two neighbouring numbers
# there is a gap of up to 12.5% of their size: rounding to the nearest costs at most half of that, 6.25%, and
# about 2.6% on average for normally distributed weights (section 2 measures it). e5m2 reaches 57,344 with half
# the precision. The numbers are not evenly spread: every binade `[2^e, 2^(e+1))` holds the same eight e4m3 values,
# so the *relative* gap is the same at every size, down to the smallest normal number, 2^-6. Below it the
# subnormals keep a fixed absolute gap (2^-9), so small numbers lose their relative precision, and anything below
# half of 2^-9 is zero:

# %% alt="Log-log scatter plot of every positive finite e4m3 value (x, from about 0.002 to 448) against the gap to the next value divided by the value (y). From 2^-6 = 0.0156 up to 448 the points form a sawtooth between 6.25% and 12.5%; below 2^-6, in the subnormal range, the relative gap rises steeply to 100% at the smallest value 2^-9." caption="The relative spacing of the positive e4m3 values: a constant sawtooth over the normal range, rising steeply among the subnormals below 2^-6." tags=["hide-input"]
values = torch.arange(1, 127, dtype=torch.uint8).view(E4M3).float()  # bit patterns 1..126: every positive finite
gaps = (values[1:] - values[:-1]) / values[:-1]
fig, ax = plt.subplots(figsize=(6.2, 3.0))
ax.loglog(values[:-1].numpy(), gaps.numpy(), ".", ms=4)
ax.axvline(2.0**-6, color="0.5", ls="--", lw=1)
ax.text(2.0**-6 * 1.15, 0.5, "smallest normal, 2^-6", fontsize=8)
ax.set_xlabel("e4m3 value")
ax.set_ylabel("gap to the next / value")
fig.tight_layout()
plt.show()

# %% [markdown]
# Figure 15.1 is the whole story of e4m3 in one picture: wherever a number lands in the normal range it keeps the
# same relative precision, so what matters is only that it lands there. That is what a *scale* does: store
# `q = fp8(x / s)` and `s` beside it, choosing `s` so that the numbers fill the range.

# %% [markdown]
# ## 2. Scales
#
# The common choice is `s = amax(|x|) / 448`: the largest number of a group lands exactly on the format's top, the
# rest below it. How many numbers share one scale is the design decision:

# %%
show_code(quantize_weight)

# %% [markdown]
# One scale per tensor is the cheapest and the most fragile: a single outlier sets the scale for everything, and a
# row of small weights next to a row of large ones is pushed below 2^-6, into the subnormals or to zero. One scale
# per output row (per channel) gives each row its own range. One scale per tile (DeepSeek-V3's and Qwen3's FP8
# checkpoints use 128 x 128) or per row and 128-column group is finer still. On the embedded model's projections:

# %%
dense, _, _ = load_model(str(embedded_model_path()), dtype="float32")


def rel_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx - exact).norm() / exact.norm()).item()


schemes = {"per tensor": "tensor", "per channel": None, "128 x 128 tiles": (128, 128), "row x 128 groups": (1, 128)}
rows = []
for name, layer in [(n, m) for n, m in linear_layers(dense) if n.startswith(("layers.0.", "layers.15."))]:
    w = layer.weight.data
    row = [name]
    for block in schemes.values():
        if block == "tensor":
            s = scale_per_tensor(w)
            row.append(f"{rel_error((w / s).to(E4M3).float() * s, w):.2%}")
        else:
            q, s = quantize_weight(w, block)
            row.append(f"{rel_error(dequantize_weight(q, s, block), w):.2%}")
    rows.append(row)
display(show_table(rows, headers=["projection"] + list(schemes)))

# %% [markdown]
# Every scheme lands near 2.6%, the average rounding error of a 3-bit mantissa: this model's weights have no
# outliers that one scale per tensor would suffer from, so finer scales buy little here. What they buy elsewhere
# is safety against the rows and features whose range differs from the rest: activations have such features
# (a few hidden dimensions of most LLMs carry values a hundred times larger than the others), which is why they
# are scaled per token, or per token and group.

# %% [markdown]
# ## 3. FP8 projections
#
# A projection becomes FP8 in place: its `weight` is replaced by an e4m3 tensor of the same shape, a float32 scale
# tensor joins it, and its `quant_method` (the seam that `ColumnParallelLinear` and `RowParallelLinear` call for
# their product) becomes an `Fp8LinearMethod`. The activation is quantized on the fly, from its own amax, and the
# product is of two FP8 operands (W8A8). The reference computes it by dequantizing both:

# %%
show_code(Fp8LinearMethod.reference)

# %% [markdown]
# On a Hopper GPU the same product runs on the FP8 tensor cores. With one scale per output channel and one per
# token, the scales factor out of the sum entirely (`C[t, o] = s_x[t] s_w[o] sum_k q_x[t, k] q_w[o, k]`), which is
# what `torch._scaled_mm`'s row-wise scaling computes (`--quantization w8a8_fp8`, SGLang's name). With a scale per
# 128-column group they change along the sum, so the kernel must step through K one group at a time and scale each
# group's partial product before adding it; `minisgl_ref/quant/fp8_gemm.py` does that in Triton. Its inner loop:

# %%
KERNEL = (ROOT / "minisgl_ref" / "quant" / "fp8_gemm.py").read_text()
show_code("def _group_scaled_gemm_kernel(A, B, C, As, Bs, M, N, K, ...):  # one tile of C, one group of K a step\n"
          + KERNEL[KERNEL.index("    acc = tl.full("):KERNEL.index("    tl.store(C")].rstrip() + "\n")

# %%
g = torch.Generator().manual_seed(0)
x = torch.randn(5, 300, generator=g) * torch.logspace(-2, 2, 300)  # features of very different sizes
w = torch.randn(70, 300, generator=g)
qx, sx = quantize_activation(x, 128)
qw, sw = quantize_weight(w, (1, 128))
reference = (qx.float() * expand_block_scale(sx, (1, 128), (5, 300))) @ dequantize_weight(qw, sw, (1, 128)).t()
kernel = group_scaled_gemm(qx, sx, qw, sw, 128, torch.float32)
print(wrap(f"kernel against the dequantized product: max |difference| {(kernel - reference).abs().max():.1e} "
           f"(largest output {reference.abs().max():.0f}); against full precision: "
           f"{rel_error(kernel, x @ w.t()):.2%} relative error"))

# %% [markdown]
# There are two ways in, both through the loader's `register_quantization` seam. `--quantization fp8` quantizes an
# ordinary checkpoint as it loads (one scale per row and 128-column group). A checkpoint stored in FP8 (its
# `config.json` has `quantization_config` with `quant_method: fp8` and `weight_block_size: [128, 128]`) loads as
# stored: each projection's `weight` in e4m3 and its `weight_scale_inv` tiles, spread over the rows as the layer
# needs them. A fused layer such as q/k/v cannot keep the checkpoint's tiles: SmolLM2's k rows start at row 576,
# in the middle of a tile. Anything the engine cannot load as stored (a static activation scale, e5m2 weights,
# stacked MoE experts) is refused by name. The model after `--quantization fp8`:

# %%
fp8_model, _, _ = load_model(str(embedded_model_path()), dtype="float32", quantization="fp8")
qkv = fp8_model.layers[0].self_attn.qkv_proj
print(wrap(f"layers.0.self_attn.qkv_proj: weight {tuple(qkv.weight.shape)} {qkv.weight.dtype}, "
           f"weight_scale_inv {tuple(qkv.weight_scale_inv.shape)} {qkv.weight_scale_inv.dtype}"))
before = sum(p.numel() * 2 for p in dense.parameters())  # as bfloat16
after = sum(p.numel() * (1 if p.dtype == E4M3 else 4 if name.endswith("weight_scale_inv") else 2)
            for name, p in fp8_model.named_parameters())
print(wrap(f"weights: {before / 1e6:.0f} MB in bfloat16, {after / 1e6:.0f} MB with FP8 projections (the "
           f"embedding, tied to the LM head, stays in bfloat16: {dense.embed_tokens.weight.numel() * 2 / 1e6:.0f} MB "
           f"of it)"))

# %% [markdown]
# ## 4. An FP8 KV cache
#
# `--kv-cache-dtype fp8_e4m3` stores every key and value in one byte, with one scale per layer for the keys and one
# for the values. The scale is *static*: a key written now must still mean the same thing thousands of steps later,
# when the pool holds many requests' keys under it. SGLang takes the scales from the checkpoint and uses 1 when it
# has none; so does this pool. Writing quantizes, and the reference attention reads through `gather`:

# %%
show_code(Fp8KVPool.store)

# %%
show_code(Fp8KVPool.gather)

# %% [markdown]
# The Triton kernels read the stored numbers directly and cast them as they load a tile; the key scale is folded
# into the softmax scale and the value scale into the output (attention is linear in the values), so the scales
# cost nothing per element. FlashInfer does the same in its own kernels: planned with the FP8 type as the cache's
# type, it converts each number as it loads it and takes the two scales as arguments of its run (its FA2 kernels
# serve the extend steps, since its Hopper kernels want queries and keys of one type). FlashAttention-3 takes FP8
# keys only with FP8 queries, which would round every query too, so with an FP8 cache the Hopper defaults become
# FlashInfer for both phases (chapter 07), and asking for FA3 is refused by name.
#
# With a scale of 1 a stored number is the value itself, so Figure 15.1 says which values suffer: those below 2^-6
# lose precision and those below 2^-10 become zero. The keys and values of one prompt, layer by layer:

# %%
probe = LLM(device="cpu", attention_backend="torch_native", max_total_tokens=2048)
text_ids = probe.tokenizer.encode((ROOT / "minisgl_ref" / "bench" / "texts" / "perplexity.txt").read_text())[:512]
stored: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
plain_store = probe.engine.kv_pool.store


def watch_store(layer_id, slots, k, v):  # type: ignore[no-untyped-def]
    stored[layer_id] = (k.detach().clone(), v.detach().clone())  # what the pool is asked to keep
    plain_store(layer_id, slots, k, v)


probe.engine.kv_pool.store = watch_store
probe.generate([text_ids], {"max_new_tokens": 1, "temperature": 0}, use_tqdm=False)
probe.shutdown()
small = {"keys": [], "values": []}
for layer in sorted(stored):
    for name, t in zip(("keys", "values"), stored[layer]):
        a = t.abs().flatten()
        small[name].append(((a < 2.0**-6).float().mean().item(), (a < 2.0**-10).float().mean().item()))

# %% alt="Two line charts over SmolLM2's 30 layers, on a log scale. Left, keys: about 1% of the elements below 2^-6 (the subnormal range of e4m3 at scale 1) and under 0.1% below 2^-10 in every layer. Right, values: 42% below 2^-6 and 3% below 2^-10 in layer 0, then 1 to 3% and falling slowly in the later layers, close to the keys." caption="Keys and values of a 512-token prompt in SmolLM2-135M: the share of elements that e4m3 at scale 1 keeps with reduced precision (below 2^-6) or stores as zero (below 2^-10), per layer." tags=["hide-input"]
fig, axes = plt.subplots(1, 2, figsize=(9, 3.0), sharey=True)
for ax, name in zip(axes, ("keys", "values")):
    sub, zero = zip(*small[name])
    ax.semilogy(np.array(sub) * 100, "o-", ms=3, label="below 2^-6 (subnormal)")
    ax.semilogy(np.array(zero) * 100, "s--", ms=3, label="below 2^-10 (zero)")
    ax.set_title(name, fontsize=10)
    ax.set_xlabel("layer")
axes[0].set_ylabel("% of elements")
axes[0].legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# Figure 15.2: with a fixed scale of 1, the keys sit in e4m3's normal range in every layer (about 1% of them
# below it). So do the values of every layer but the first, whose values are all small (the largest is about 0.6):
# 42% of them fall into the subnormals, where e4m3 keeps fewer bits, and 3% become zero. A per-layer value scale
# (the largest value over some text, divided by 448) would lift them back into the normal range;
# `Fp8KVPool.set_scales` is the place for it.
#
# Nothing else in the engine changes: the radix cache and the page table move slot numbers, chapter 13's
# rollback moves bytes between slots, and the pool is twice as large in tokens for the same memory.

# %% [markdown]
# ## 5. What it costs
#
# `python -m minisgl_ref bench perplexity` scores a fixed text of 2,548 tokens (prose from this book's early
# chapters, `minisgl_ref/bench/texts/perplexity.txt`) through the engine, with prefill in chunks of 256 tokens so
# that every chunk reads the earlier ones back from the KV cache. Each variant is a fresh engine on the same model
# in bfloat16. Each also answers the four chat questions of the engine's oracle tests greedily (32 tokens), and the
# answers are compared with bf16's token by token (`docs/data/perplexity_cpu.json`):

# %%
PPL = json.loads((ROOT / "docs" / "data" / "perplexity_cpu.json").read_text())
display(show_table([[r["variant"], r["quantization"] or "-", r["kv_cache_dtype"], f"{r['perplexity']:.2f}",
                     f"{r['ratio_to_first'] - 1:+.2%}", f"{r['greedy_identical']} / 4",
                     f"{r['greedy_shared_prefix']:.0%}"] for r in PPL["results"]],
                   headers=["variant", "weights", "KV cache", "perplexity", "against bf16",
                            "greedy answers equal", "shared before they differ"]))

# %% [markdown]
# Three readings of the table.
#
# * **The FP8 cache is nearly free**: +0.95% with e4m3 at scale 1, despite Figure 15.2's small values. e5m2, with
#   one mantissa bit fewer, costs +5.5%: for a cache, precision matters more than range.
# * **FP8 weights cost more than the cache**: +2.3% with one scale per channel (`w8a8_fp8`) and +3.4% with one per
#   row and 128-column group (`fp8`). Both quantize every projection and every activation, and a 135-million
#   parameter model has little redundancy to absorb 2.6% of noise on each weight. That the finer scales do not do
#   better here matches section 2: this model's weights have no outliers for finer scales to protect against,
#   and which rounding errors happen to line up is what is left.
# * **Greedy answers part early.** No variant answers any of the four questions exactly as bf16 does: the answers
#   share their first 16% to 41% of tokens, then one near-tie goes the other way and the rest follows from it. A
#   small perplexity change is an average over the text; greedy decoding amplifies the first flipped choice.
# * **Both together** cost +4.6%, roughly the sum. SmolLM2-135M is a hard case for quantization; larger models,
#   whose weights carry more redundancy, usually lose less; the engine loads their FP8 checkpoints as stored, and
#   scoring them is a matter of running the same command on a GPU.

# %% [markdown]
# ## 6. What it buys: the floor with half the bytes
#
# Chapter 11's floor of the canonical workload (256 requests, up to 1,024 output tokens each) is the bytes it must
# read, weights once per step and every token's context once, over the memory bandwidth. With FP8 projections the
# weights are one byte each (plus a float32 scale per 128 of them), with an FP8 cache the KV is one byte per
# element. For Qwen3-0.6B at the H100's measured 3.0 TB/s:

# %%
QWEN = ModelConfig.from_file(SHIPPED_CONFIGS / "qwen3-0.6b.json")
QWEN.dtype = torch.bfloat16
wl = canonical_workload()
prompt_lens = [len(p) for p in wl.prompts]
output_lens = [p["max_new_tokens"] for p in wl.sampling_params]
h, inter, layers = QWEN.hidden_size, QWEN.intermediate_size, QWEN.num_layers
q, kv = QWEN.num_heads * QWEN.head_dim, QWEN.num_kv_heads * QWEN.head_dim
proj = layers * (h * (q + 2 * kv) + q * h + 2 * h * inter + inter * h)  # qkv, o, gate/up, down
bf16_weights = weight_bytes(QWEN)
fp8_weights = bf16_weights - 2 * proj + proj + 4 * proj // 128  # one byte each, a float32 scale per 128
kv16 = QWEN.kv_bytes_per_token
rows = []
for name, wb, kvb in [("bf16", bf16_weights, kv16), ("FP8 weights", fp8_weights, kv16),
                      ("FP8 KV cache", bf16_weights, kv16 // 2), ("both", fp8_weights, kv16 // 2)]:
    floor = roofline_floor_seconds(prompt_lens, output_lens, wb, kvb, 3.0e12)
    rows.append([name, f"{wb / 1e9:.2f}", f"{kvb:,}", f"{floor:.2f}", f"{sum(output_lens) / floor:,.0f}"])
display(show_table(rows, headers=["Qwen3-0.6B", "weight GB", "KV bytes / token", "floor (s)",
                                  "floor output tok/s"]))

# %% [markdown]
# On this workload the KV reads are most of the floor (chapter 11: 256 requests reading up to 2,000 tokens of
# context each, every step), so the FP8 cache buys more than the FP8 weights of a model this small; the weights
# matter most at small batches and for larger models. Both together halve the floor.
#
# ### Measured on an H200
#
# The same workload on one H200, whose copy bandwidth measures 4.28 TB/s (so every floor below is 30% lower than
# in the table above), one fresh process per variant. Each run's floor is counted from what that engine stores:
# `bench offline` reads the bytes of the built model's parameters and the pool's bytes per token
# (`python -m minisgl_ref bench offline --model-path qwen3-0.6b --load-format dummy --quantization fp8
# --kv-cache-dtype fp8_e4m3 --hbm-bandwidth 4.278e12`, and the same without either flag; a cold round, then a
# warm repeat of four of them; `docs/data/fp8_canonical_h200.json`). An FP8 cache is read by FlashInfer here
# (section 4); bf16 uses the default kernels of chapter 11.

# %%
CANON = json.loads((ROOT / "docs" / "data" / "fp8_canonical_h200.json").read_text())
LABELS = {"bf16": ("bf16", "bf16"), "fp8": ("fp8 (groups)", "bf16"), "w8a8_fp8": ("w8a8_fp8 (channels)", "bf16"),
          "fp8_kv": ("bf16", "fp8_e4m3"), "both": ("fp8 (groups)", "fp8_e4m3")}
runs = {(r["variant"], r["round"]): r for r in CANON["rows"]}
canon_rows = []
for v, (weights, cache) in LABELS.items():
    cold, warm = runs[(v, "cold")], runs.get((v, "warm"))
    best = warm or cold
    canon_rows.append([v, weights, cache, f"{cold['output_throughput']:,.0f}",
                       "-" if warm is None else f"{warm['output_throughput']:,.0f}", f"{best['roofline_floor_s']:.2f}",
                       f"{best['wall_s']:.2f}", f"{best['roofline_fraction']:.0%}",
                       f"{best['kv_bytes_per_decode_step'] / 1e9:.2f}"])
display(show_table(canon_rows, headers=["variant", "projections", "KV cache", "out tok/s cold", "warm", "floor (s)",
                                        "wall (s)", "of its floor", "KV read / decode step (GB)"]))

# %% [markdown]
# The bytes halved as planned: the engine's own count of the KV every decode step reads falls from 13.54 GB to
# 6.77 GB with the FP8 cache, and the floors fall with it (3.53 s to 1.91 s; 1.80 s with both). The time did not
# follow. bf16 runs at 68% of its floor; the FP8 cache, at half the bytes, takes *longer* (28% of its own floor),
# and so do the FP8 projections. Decode steps timed on their own say where (`scripts/gpu/measure/quant_steps.py`,
# `docs/data/fp8_decode_steps_h200.json`; one step replayed from its CUDA graph, every request at the context
# given, against the bytes it must read):

# %%
STEPS = json.loads((ROOT / "docs" / "data" / "fp8_decode_steps_h200.json").read_text())
NAMES = {"none": "bf16 cache, default kernels", "nosplit": "bf16 cache, FlashInfer's kernel",
         "fp8_kv": "FP8 cache, FlashInfer's kernel"}
display(show_table([[NAMES[r["variant"]], r["batch_size"], f"{r['kv_bytes_per_token']:,}", f"{r['floor_ms']:.2f}",
                     f"{r['step_ms']:.2f}", f"{r['of_floor']:.0%}"] for r in STEPS["kv"]["rows"]],
                   headers=["Qwen3-0.6B, contexts of 1,024", "requests", "KV bytes / token", "floor (ms)",
                            "step (ms)", "of floor"]))

# %% [markdown]
# At 256 requests a bf16 step runs at 86% to 89% of its floor, whichever of the two kernels reads the cache. With
# the FP8 cache the step must read 3.8 ms worth of bytes and takes 9.3 ms. The kernel now converts every key and
# value to bf16 before its dot products, and for Qwen3-0.6B's two query heads per KV head FlashInfer runs its
# CUDA-core decode kernel: the bytes no longer set its pace, and exercise 6 asks what does. The FP8 projections show
# the same on the model where weights are most of a step's bytes, Qwen3-14B at a few requests (Figure 15.3, right):

# %%
W14 = {(r["variant"], r["batch_size"]): r for r in STEPS["weights"]["rows"]}
print(wrap(f"Qwen3-14B weights: bf16 {W14[('none', 1)]['weight_bytes'] / 1e9:.1f} GB, fp8 "
           f"{W14[('fp8', 1)]['weight_bytes'] / 1e9:.1f} GB; one request: bf16 {W14[('none', 1)]['step_ms']:.2f} ms "
           f"({W14[('none', 1)]['of_floor']:.0%} of its floor), fp8 {W14[('fp8', 1)]['step_ms']:.2f} ms "
           f"({W14[('fp8', 1)]['of_floor']:.0%}), w8a8_fp8 {W14[('w8a8_fp8', 1)]['step_ms']:.2f} ms "
           f"({W14[('w8a8_fp8', 1)]['of_floor']:.0%})."))

# %% alt="Two panels. Left: for each variant of the canonical workload on Qwen3-0.6B (bf16, fp8, w8a8_fp8, fp8_kv, both), a bar of the measured wall time and beside it a lighter bar of its floor; the floors drop from 3.5 s to about 1.8 to 1.9 s with an FP8 cache while the wall times rise from 5.2 s to 6.7 to 8.0 s. Right: Qwen3-14B decode step time against the number of requests (1, 16, 64) for bf16, fp8 and w8a8_fp8 projections, solid lines, with each one's floor as a dashed line; bf16 runs at about 8 to 10 ms close to its floor of 7 to 8 ms, the FP8 variants at 9 to 15 ms far above their floors of 4 to 5 ms." caption="Left: the canonical workload's wall time and floor by variant (H200). Right: Qwen3-14B decode steps with bf16 and FP8 projections against their floors: the FP8 floors are half as high, the FP8 steps are not faster." tags=["hide-input"]
fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
order = list(LABELS)
walls = [(runs.get((v, "warm")) or runs[(v, "cold")])["wall_s"] for v in order]
floors = [(runs.get((v, "warm")) or runs[(v, "cold")])["roofline_floor_s"] for v in order]
xs = np.arange(len(order))
left.bar(xs - 0.2, walls, 0.4, label="measured wall")
left.bar(xs + 0.2, floors, 0.4, color="0.75", label="its floor")
left.set_xticks(xs, order, fontsize=8)
left.set_ylabel("seconds (256 requests)")
left.legend(fontsize=8)
for variant, color in zip(("none", "fp8", "w8a8_fp8"), ("C0", "C1", "C2")):
    rows_v = [r for r in STEPS["weights"]["rows"] if r["variant"] == variant]
    bs = [r["batch_size"] for r in rows_v]
    right.plot(bs, [r["step_ms"] for r in rows_v], "o-", color=color, label="bf16" if variant == "none" else variant)
    right.plot(bs, [r["floor_ms"] for r in rows_v], "--", color=color, lw=1)
right.set_xscale("log", base=2)
right.set_xlabel("requests (contexts of 512)")
right.set_ylabel("Qwen3-14B decode step (ms)")
right.set_ylim(bottom=0)
right.legend(fontsize=8, title="solid: step, dashed: floor", title_fontsize=7)
fig.tight_layout()
plt.show()

# %% [markdown]
# Figure 15.3 is the chapter's measured answer. Its floors are what section 6's table promised, halved where the
# bytes are halved; its wall times are set by kernels. A bf16 step of the 14B model, its matmuls in cuBLAS, runs at
# 85% of its floor at one request; with FP8 projections, half the bytes to read, the step reaches less than half of
# its floor (44%) with the Triton group kernel and 37% with `torch._scaled_mm` (a scale per token and per channel),
# and at 64 requests the Triton kernel, a plain loop over tiles, falls further behind. So what FP8 buys in this
# engine today is memory: a 14B model in 16.7 GB instead of 29.5 GB, a cache that holds twice the tokens in the same
# bytes, and so room for more running requests or longer contexts. Turning the halved bytes into halved time takes
# decode kernels that convert numbers as fast as the memory delivers them.

# %% [markdown]
# ## Summary
#
# * **Formats.** e4m3 keeps 3 mantissa bits and reaches 448; e5m2 keeps 2 and reaches 57,344. Inside the normal
#   range the relative precision is the same at every size, so a tensor must be *scaled* into it.
# * **Scales.** `amax / 448` per tensor, per channel, per tile or per row and group; on SmolLM2's weights each
#   rounds about 2.6% away, and the finer ones protect against outlier rows and features, which activations have.
# * **FP8 projections.** The weight stored in e4m3 with its scales, the activation quantized per token (and group)
#   at run time, the product through `torch._scaled_mm` (per channel) or a Triton kernel that scales group by group
#   along K; loaded from FP8 checkpoints as stored, or quantized at load.
# * **FP8 KV cache.** One byte per element and a static per-layer scale; the Triton kernels fold the scales into
#   the softmax scale and the output. At scale 1 only the first layer's values fall into e4m3's subnormals.
# * **Cost and gain.** Perplexity on a fixed 2,548-token text rises by the amounts in section 5; the floor of the
#   canonical workload halves with both, and the engine's count of the KV read per decode step halves with the
#   FP8 cache. Measured on an H200 the time does not follow: the FP8 kernels, not the memory, set the pace, so
#   FP8 buys memory (a smaller model, twice the tokens in the cache) before it buys speed.

# %% [markdown]
# ## Exercises
#
# 1. **Rounding error.** Quantize 10,000 standard normal numbers to e4m3 per tensor and measure the relative error.
#    Derive the 2.6% from the gaps of Figure 15.1 (hint: the rounding error is uniform within a gap).
# 2. **An outlier.** Multiply one column of a SmolLM2 projection by 1,000 and redo section 2's table. Which scheme
#    suffers, and which rows?
# 3. **Calibrated KV scales.** Set each layer's value scale to the largest value of section 4's prompt divided by
#    448 (`llm.engine.kv_pool.set_scales`) and rerun `bench perplexity --variants bf16,fp8_kv` with those scales.
#    What does Figure 15.2 look like now?
# 4. **e5m2 for the cache.** Compare `fp8_kv` and `fp8_e5m2_kv` in section 5 and explain the difference with
#    section 1's table.
# 5. **The floor of a larger model.** Redo section 6 for Qwen3-14B (`qwen3-14b.json`). At what batch size do the
#    weights stop being the larger part of a decode step's bytes?
# 6. **Where the FP8 decode step goes.** On a GPU, profile one decode step of Qwen3-0.6B at 256 requests with the
#    FP8 cache and with the bf16 one (`torch.profiler`, as chapter 11 does). How long does the attention kernel
#    take in each, and what does its time per byte say? Try `--decode-attention-backend triton` too.
#
# ## Reproduce
#
# ```bash
# python chapters/15_quantization.py                            # this chapter, end to end (CPU)
# python -m minisgl_ref bench perplexity --output docs/data/perplexity_cpu.json \
#     --variants bf16,fp8,w8a8_fp8,fp8_kv,fp8_e5m2_kv,fp8+fp8_kv      # section 5 (about 10 minutes on a CPU)
# python -m pytest tests/test_fp8_weights.py tests/test_fp8_kv_cache.py tests/test_fp8_gemm.py -q
# python -m pytest tests/test_fp8_weights.py tests/test_fp8_kv_cache.py tests/test_fp8_gemm.py -q -m gpu  # a GPU
# python -m minisgl_ref bench offline --model-path qwen3-0.6b --load-format dummy --hbm-bandwidth 4.278e12 \
#     --kv-cache-dtype fp8_e4m3 --quantization fp8                  # section 6, one variant (drop either flag)
# PART=steps bash scripts/gpu/measure/quantization.sh               # Qwen3-14B decode steps by weight format
# ```
#
# Expected on a 2-core x86_64 CPU: the chapter in about a minute; `bench perplexity` gives 54.38 in bfloat16, +0.95%
# with the FP8 cache, +2.30% (`w8a8_fp8`) and +3.40% (`fp8`) with FP8 weights, +4.64% with both
# (`docs/data/perplexity_cpu.json`). On an H100 or H200 the `gpu` tests check the FP8 tensor-core paths against the
# reference and the FP8 cache, read by FlashInfer and Triton, in CUDA graphs. On one H200
# (`docs/data/fp8_canonical_h200.json`): about 25,800 output tok/s in bf16, 23,000 with `w8a8_fp8`, 20,900 with
# `fp8`, 19,900 with the FP8 cache and 16,800 with both; 6.77 GB of KV read per decode step with the FP8 cache
# against 13.54 GB.

# %%
print(f"chapter ran in {time.perf_counter() - CHAPTER_START:.0f} s")
