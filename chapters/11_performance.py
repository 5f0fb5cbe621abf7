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
# # Chapter 11 — Performance: the floor, the ladder, and what each idea bought
#
# **What you will build.** The canonical offline workload (task 11.1) and the decode roofline (task 11.2), the
# yardstick every throughput in this book is divided by; then you will read the engine's numbers against it.
#
# **Why it matters.** "20,000 tokens per second" means nothing on its own. Divided by what the hardware allows on
# *this* workload it says how much is left, and the same division for each stage of the engine says what each
# chapter's idea was worth.
#
# In this chapter you will:
#
# 1. build the canonical workload and count what it asks for (task 11.1);
# 2. derive the roofline floor: the least time any engine needs, bytes over bandwidth (task 11.2);
# 3. climb the ladder of stages, on this CPU and on an H100;
# 4. see what each optimisation the engine kept bought, and why, and where the remaining time goes;
# 5. read a shared prompt prefix once per step instead of once per request (cascade decode attention);
# 6. compile everything at start-up, so that the first request is as fast as the thousandth;
# 7. serve online, and read time to first token and inter-token latency;
# 8. measure the cost of one streamed token on the way to the client.
#
# Modules: `minisgl_ref/bench/workloads.py` (task 11.1), `minisgl_ref/bench/offline.py` (task 11.2, the
# ladder), `scripts/gpu/measure/offline.sh` (the GPU run), and `minisgl_ref/perf/`, the speed-ups themselves, each plugged
# into a seam of the core engine (`perf/model_transforms.py` applies the model's). Every GPU number here is read
# from a committed result file under `docs/data/`; the measurements behind the decisions (A/B series, profiles,
# the variants that lost) are collected on the [performance evidence](../performance-evidence.md) page.

# %% tags=["setup"]
import dataclasses
import json
import textwrap
import time

import matplotlib.pyplot as plt
import torch

from minisgl_ref.bench import offline as bo
from minisgl_ref.bench import workloads
from minisgl_ref.bench.workloads import canonical_workload
from minisgl_ref.book import setup_chapter, show_code, show_table
from minisgl_ref.models.config import ModelConfig
from minisgl_ref.models.loader import resolve_model_path

CHAPTER_START = time.perf_counter()
ROOT = setup_chapter()  # one torch thread (MINISGL_THREADS for more), and the repository root


def load(name: str) -> dict:
    """One committed result file of docs/data."""
    return json.loads((ROOT / "docs" / "data" / name).read_text())


GPU = load("gpu_offline_h100.json")

# %% [markdown]
# ## 1. The canonical offline workload (task 11.1)
#
# The workload nano-vllm and Mini-SGLang publish: 256 requests with random prompt and output lengths, all handed
# to one `generate` call; throughput is output tokens over the wall time of that call. The order of the random
# draws is part of the definition (prompts first, then lengths), so every engine sees the same requests.

# %%
show_code(workloads, task="11.1")

# %%
wl = canonical_workload()
prompt_lens = [len(p) for p in wl.prompts]
output_lens = [p["max_new_tokens"] for p in wl.sampling_params]
print(f"{wl.num_requests} requests, {wl.input_tokens:,} prompt tokens, {wl.output_tokens:,} output tokens")
print(f"prompt lengths {min(prompt_lens)}..{max(prompt_lens)}, output lengths {min(output_lens)}..{max(output_lens)}")
print(f"temperature {wl.sampling_params[0]['temperature']}, ignore_eos {wl.sampling_params[0]['ignore_eos']}")

# %% [markdown]
# ## 2. The roofline floor (task 11.2)
#
# Decode is memory-bound: each step does little arithmetic per byte it reads. A step must read every weight once
# and, for every running request, the K and V of its whole context:
#
# $$\text{bytes per step} = W + \sum_i \text{ctx}_i \cdot b_{kv}, \qquad
#   b_{kv} = 2 \cdot \text{layers} \cdot \text{kv heads} \cdot \text{head dim} \cdot \text{dtype bytes}.$$
#
# Summed over a workload, in the most favourable schedule (every request running from the first step, so
# `max(O_i)` steps read the weights), and with prefill counted as free:

# %%
show_code(bo, task="11.2")

# %%
cfg = dataclasses.replace(ModelConfig.from_file(resolve_model_path("qwen3-0.6b", "dummy").config_file),
                          dtype=torch.bfloat16)
W = bo.weight_bytes(cfg)
kv = cfg.kv_bytes_per_token
ctx = bo.context_token_sum(prompt_lens, output_lens)
print(f"Qwen3-0.6B bf16: weights {W / 1e9:.3f} GB, KV {kv:,} B per token "
      f"(2 x {cfg.num_layers} layers x {cfg.num_kv_heads} heads x {cfg.head_dim} x 2 B)")
print(f"weights: {max(output_lens)} steps x {W / 1e9:.2f} GB = {max(output_lens) * W / 1e12:.2f} TB")
print(f"KV:      {ctx:,} context tokens read x {kv:,} B = {ctx * kv / 1e12:.2f} TB")
measured_bw = GPU["copy_bandwidth_Bps"]
for name, bw in (("measured copy (this H100)", measured_bw), ("datasheet", 3.35e12)):
    floor = bo.roofline_floor_seconds(prompt_lens, output_lens, W, kv, bw)
    print(f"floor at {bw / 1e12:.2f} TB/s ({name}): {floor:.2f} s = {wl.output_tokens / floor:,.0f} output tok/s")

# %% [markdown]
# The KV reads are 92% of the bytes: on this workload the engine's speed is, to first order, the attention
# kernel's bandwidth. "~4.5 s, ~29.7k tok/s" is the datasheet figure; we divide by the bandwidth *measured* on the
# same H100 (a 2 GiB device-to-device copy, bytes read plus written), which gives the slightly higher floor of
# 5.03 s (26.6k tok/s). That is the yardstick of every GPU number below: "77% of the floor" means 0.77 x 26.6k.
#
# ## 3. The ladder of stages
#
# `python -m minisgl_ref bench offline --quick --stage all` rebuilds the engine as it stood after each chapter
# and runs a CPU-sized version of the same workload on a tiny random Qwen3-shaped model. On a CPU the numbers
# teach ratios (the naive oracle recomputes every sequence every step; the cache removes that), not speeds.

# %%
quick_wl = canonical_workload(**bo.QUICK_CANONICAL)  # what --quick runs: 8 short requests
quick = bo.run_ladder(quick_wl, bo.STAGES, bo.quick_model("cpu"), dict(bo.QUICK_BUDGETS))
# The columns of bo.format_table (what the command prints) that a CPU run fills and this section discusses.
SHOWN = ("stage", "reqs", "out tok", "wall s", "out tok/s", "prefill tok", "cached tok", "retract")
columns = [c for c in bo._COLUMNS if c[0] in SHOWN]
show_table([["-" if getattr(r, name) is None else fmt.format(getattr(r, name)) for _, name, fmt in columns]
            for r in quick], headers=[header for header, _, _ in columns])

# %% [markdown]
# ### The same ladder on an H100
#
# `bash scripts/gpu/measure/offline.sh` on an H100 80GB HBM3 (Qwen3-0.6B config, bf16, dummy weights). The early stages
# loop over requests in Python and are far too slow for the full workload, so the first six rows run 8 requests
# (the last of them with the full engine, like for like); the others run the full canonical workload with each
# attention backend, CUDA graphs off and on. (The ladder was measured partway along the history that section 4
# tells: its best row, about 17,800 tokens/s, is some 14% below where the engine stands now.)

# %%
prov = GPU["provenance"]
print(f"{prov['hardware']['gpu']}, driver {prov['hardware']['nvidia_driver']}, torch {prov['software']['torch']}, "
      f"flashinfer {prov['software']['packages']['flashinfer-python']}, {prov['date'][:10]}")
print(f"copy bandwidth measured on this GPU: {GPU['copy_bandwidth_Bps'] / 1e12:.2f} TB/s\n")
print(f"{'configuration':<50} {'reqs':>4} {'out tok/s':>10} {'wall s':>7} {'of floor':>8}")
for r in GPU["ladder"]:
    print(f"{r['label'][:50]:<50} {r['workload_requests']:>4} {r['output_throughput']:>10,.0f} {r['wall_s']:>7.2f} "
          f"{100 * r['roofline_fraction']:>7.1f}%")

# %% alt="Two horizontal bar charts of output tokens per second, each bar labelled with its fraction of the roofline floor. Left, log scale, the reduced workload of 8 requests: the naive oracle and the paged, radix and chunked stages on torch_native all near 100 tokens/s and 1 percent, the default backends with CUDA graphs about thirty times faster at 27 percent. Right, linear, the canonical workload of 256 requests: Triton, FlashInfer and FA3 with FlashInfer, each with graphs off (24 to 31 percent) and on (67 to 68 percent, past the dashed red 17k target), and the default with fused ops off at 54 percent." caption="The stage ladder on an H100: output throughput of each configuration on a reduced workload and on the canonical one." tags=["hide-input"]
full = [r for r in GPU["ladder"] if r["workload_requests"] == 256]
small = [r for r in GPU["ladder"] if r["workload_requests"] != 256]
fig, axes = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [6, 7]})
for ax, rows, title in ((axes[0], small, "reduced workload (8 requests)"),
                        (axes[1], full, "canonical workload (256 requests)")):
    labels = [r["label"].replace("overlap / ", "").replace(" (default)", "*") for r in rows]
    ax.barh(labels, [r["output_throughput"] for r in rows], color="tab:blue")
    for y, r in enumerate(rows):
        ax.text(r["output_throughput"], y, f" {100 * r['roofline_fraction']:.0f}%", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log" if rows is small else "linear")
    ax.set_xlabel("output tokens/s (label: fraction of the roofline floor)")
    ax.set_title(title)
axes[1].axvline(17_000, color="tab:red", ls="--", lw=1)
axes[1].text(17_000, len(full) - 0.5, " target 17k", color="tab:red", fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# What the ladder of Figure 11.1 says:
#
# * **On the CPU the KV cache is the big step** (chapter 03): the naive oracle recomputes every sequence at every
#   step. Radix cache and chunked prefill change little on this workload: random prompts share no prefix, and
#   with 8 requests chunking has nothing to interleave (on a shared-prefix workload the radix cache is what
#   matters, chapter 04 and section 5).
# * **On the GPU, per-request Python loops hide all of that**: with 8 requests the naive oracle and the
#   `torch_native` stages are all launch-bound (thousands of tiny kernels per step, whatever is recomputed), so
#   they land within 20% of each other; the same 8 requests run ~25x faster once attention is one batched kernel
#   and decode a CUDA graph.
# * **On the full workload, CUDA graphs are worth 2.2-2.9x** for every backend (chapter 08), and with graphs the
#   three decode kernels land within 1.5% of each other: the decode step is then dominated by reading the KV
#   cache, which all of them do near the copy bandwidth.
# * **The fused per-token kernels are worth ~24%** (the "fused ops off" row: plain PyTorch RMSNorm, SiLU, RoPE and
#   KV store): with graphs, each of the ~8 plain kernels per RMSNorm still costs a few microseconds of GPU time,
#   56 norms per step.
#
# ## 4. What each optimisation bought
#
# From its first complete GPU run, 8,282 output tokens/s or 31% of the floor, the engine went to about 20,300 after
# twenty-six changes, 76% of the floor: two and a half times as fast, with most of the gain in the first five
# changes. Each bar below is one change, in the order they were made; the dashed line is the floor of section 2. A
# few of the changes were later replaced by better ones (the persistent FlashInfer kernel by a decode kernel of our
# own), so read the bars as a path, not as a list of parts.

# %% alt="Horizontal bar chart, one numbered bar per change in the order it was made, of output tokens per second on the canonical workload, each labelled with its fraction of the roofline: from 8,282 (31 percent) for the first GPU run to about 20,300 (76 percent) after the twenty-sixth, most of the gain in the first five changes; the roofline, 26,626 tokens/s, is a dashed red line." caption="The engine's path on an H100: canonical-workload throughput after each change, in the order the changes were made." tags=["hide-input"]
ceiling = GPU["canonical_output_tokens"] / GPU["roofline_floor_s"]
steps = GPU["history"]
labels = [textwrap.shorten(h["change"].removeprefix("+ ").split(" (")[0], 60, placeholder="...") for h in steps]
fig, ax = plt.subplots(figsize=(10, 1.2 + 0.26 * len(steps)))
ax.barh([f"{i + 1}. {textwrap.fill(t, 42)}" for i, t in enumerate(labels)],
        [h["output_throughput"] for h in steps], color="tab:blue")
for y, h in enumerate(steps):
    ax.text(h["output_throughput"], y, f" {h['output_throughput']:,.0f} ({100 * h['roofline_fraction']:.0f}%)",
            va="center", fontsize=8)
ax.axvline(ceiling, color="tab:red", ls="--", lw=1)
ax.text(ceiling, len(steps) - 0.6, f"roofline {ceiling:,.0f} tok/s ", color="tab:red", fontsize=8, ha="right")
ax.invert_yaxis()
ax.tick_params(axis="y", labelsize=7)
ax.set_xlim(0, ceiling * 1.12)
ax.set_xlabel("output tokens/s, canonical workload (label: fraction of the roofline)")
ax.set_title(f"The engine's path on {GPU['provenance']['hardware']['gpu']}, Qwen3-0.6B bf16", fontsize=10)
fig.tight_layout()
plt.show()

# %% [markdown]
# The later bars of Figure 11.2 differ by little, and two processes on one GPU differ by 1-4% from run to run, more
# than most of the later changes are worth. So each change after the first few was measured as an *interleaved A/B*:
# `scripts/gpu/ab.sh` starts fresh processes of the engine before and after the change, alternating, several
# per side, and compares the medians of their timed runs. The changes the engine kept, one line each:

# %%
KEPT = [  # (result file of an interleaved A/B, the change)
    ("canonical_ab_qview_h100.json", "decode attention reads the query in place"),
    ("canonical_ab_fused_store_h100.json", "KV store inside the decode RoPE kernel"),
    ("canonical_ab_admission_h100.json", "a burst of requests admitted in one step"),
    ("canonical_ab_prefill_rope_store_h100.json", "fused QK-norm/RoPE/store in prefill steps"),
    ("canonical_ab_norm_folding_h100.json", "norms folded into their neighbours"),
    ("canonical_ab_budget_graph_h100.json", "the prefill budget step as a CUDA graph"),
    ("canonical_ab_split_cap_h100.json", "our split-KV decode kernel from 48 rows"),
    ("canonical_ab_loads_first_h100.json", "small kernels issue their loads first"),
    ("canonical_ab_four_blocks_h100.json", "split-KV kernel at four blocks an SM"),
    ("canonical_ab_race_prune_h100.json", "the sampler's race skips hopeless blocks"),
]
floor_tok_s = GPU["canonical_output_tokens"] / GPU["roofline_floor_s"]
print("medians, output tok/s:")
kept_rows = []
for name, what in KEPT:
    ab = load(name)
    settings = ab["provenance"]["settings"]
    before, after = ab["summary"][settings["base"]]["median"], ab["summary"][settings["new"]]["median"]
    kept_rows.append((what, f"{before:,.0f}", f"{after:,.0f}", f"{after / before - 1:+.1%}",
                      f"{after / floor_tok_s:.0%}"))
show_table(kept_rows, headers=["change", "before", "after", "change", "of floor"])

# %% [markdown]
# Most of these are a percent or less, each at or inside the spread between processes; together they are ~10%.
# The ideas behind the large steps, each once:
#
# **CUDA graphs and fused kernels (chapter 08).** A decode step of a 0.6B model is ~300 short kernels; launched one
# by one from Python, the GPU waits for the host. A graph replays them all with one launch (2.2-2.9x), and fusing
# the per-token ops (RMSNorm, SiLU, RoPE, the KV store) removes kernels outright (~24%).
#
# **No hidden waits.** Overlap scheduling (chapter 06) only works if the host never waits for more of the GPU's work
# than it needs. Every host-to-device copy now comes from pinned memory (a pageable one waits for the stream to
# drain), and the sampled tokens are read through a non-blocking copy right after sampling and an event
# (`StepOutput.tokens`), not `next_tokens.tolist()`, whose copy queued behind step N+1: three lines, worth
# 11,700-14,900 → 16,700-17,800 tok/s, the largest single step of the path.
#
# **Less Python per request.** With the GPU step hidden, the host's per-request work is on the critical path
# whenever it outlasts the GPU's step; batched KV allocation in numpy, prompt checks in C and one-step admission of
# a burst each trimmed it.
#
# ### Where a decode step's time goes
#
# `scripts/gpu/measure/decode_anatomy.py` measures windows of decode steps as the running count falls, unprofiled (wall and
# host time) and profiled (GPU time by kernel kind). The KV floor is the running contexts' bytes over 3.0 TB/s.

# %%
AN = load("decode_anatomy_h100.json")
print(f"{'running':>7} {'KV floor':>8} {'attention':>9} {'matmul':>7} {'other':>6} {'GPU step':>8} "
      f"{'gaps':>5} {'host launch':>11}   (ms per decode step)")
for w in AN["windows"]:
    k, u = w["ms_per_step_by_kind"], w["unprofiled"]
    small = k.get("other", 0) + k.get("sampler", 0) + k.get("copies", 0)
    gaps = u["gpu_launch_to_end_ms"] - w["gpu_busy_ms_per_step"]
    print(f"{w['running']:>7} {w['kv_floor_ms_per_step']:>8.2f} {k['attention']:>9.2f} {k['matmul']:>7.2f} "
          f"{small:>6.2f} {u['gpu_launch_to_end_ms']:>8.2f} {gaps:>5.2f} {u['host_ms_per_step']['launch']:>11.2f}")


# %% alt="Stacked bar chart of milliseconds per decode step for 256, 123, 63, 30 and 14 running requests, split into attention, matmul, other kernels and gaps between kernels, with a black tick at the KV floor of each bar: the step falls from about 8 to 3 ms as fewer requests run, the attention part shrinks with them and stays just above its tick, while the rest stays about the same." caption="Where the GPU time of a decode step goes on the canonical workload, by the number of requests running." tags=["hide-input"]
fig, ax = plt.subplots(figsize=(8, 3.6))
labels = [str(w["running"]) for w in AN["windows"]]
parts = {"attention": [], "matmul": [], "other kernels": [], "gaps between kernels": []}
for w in AN["windows"]:
    k, u = w["ms_per_step_by_kind"], w["unprofiled"]
    parts["attention"].append(k["attention"])
    parts["matmul"].append(k["matmul"])
    parts["other kernels"].append(k.get("other", 0) + k.get("sampler", 0) + k.get("copies", 0))
    parts["gaps between kernels"].append(u["gpu_launch_to_end_ms"] - w["gpu_busy_ms_per_step"])
bottom = [0.0] * len(labels)
for name, values in parts.items():
    ax.bar(labels, values, bottom=bottom, label=name)
    bottom = [b + v for b, v in zip(bottom, values)]
ax.plot(labels, [w["kv_floor_ms_per_step"] for w in AN["windows"]], "k_", markersize=28, label="KV floor")
ax.set_xlabel("requests running")
ax.set_ylabel("ms per decode step (GPU)")
ax.set_title(f"A decode step of the canonical workload, {AN['provenance']['hardware']['gpu']}", fontsize=10)
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# Two things to read off Figure 11.3:
#
# * **Attention runs near its floor.** At every stage the attention kernel takes within ~15% of what its KV bytes
#   allow at 3.0 TB/s. The one place it falls short is 256 running, where the contexts run from ~100 to ~1,000
#   tokens and the kernel's one wave of blocks waits for the SM holding the longest ones.
# * **What is left is a fixed cost of ~1.6-1.8 ms per step**: matrix multiplies that read 1.2 GB of weights at
#   only ~1.2-1.6 TB/s (too few rows to keep the GPU fed), ~300 small kernels (norms, RoPE, reductions, the sampler)
#   and the gaps between them. It hardly shrinks with the batch, and the workload runs ~1,020 decode steps, so it
#   is ~1.7 s of the ~7.2 s run. The rest of this section is about those two items.
#
# ### A decode kernel of our own
#
# The uneven contexts call for a kernel that balances its work: many short blocks in several waves, so that the GPU
# hands the next block to whichever SM frees up first. `minisgl_ref/perf/cuda/split_decode.cu` is a CUDA kernel
# written for this one job (bf16, head dim 128, pages of one token, 1, 2 or 4 query heads per KV head), plugged into
# the `flashinfer` backend through its `use_decode_kernel` hook by `build_runtime`'s attention planner
# (`minisgl_ref/perf/attention.py`); the backend never imports it.
#
# It cuts each long context into pieces, gives every (piece, KV head) one block of 128 threads, and merges the
# pieces' partial results by their log-sum-exp (chapter 07's merge) in the last block to finish, so no second
# kernel runs; the [performance evidence](../performance-evidence.md#a-decode-kernel-of-our-own) page walks through
# its design.
#
# Timed in a chain of 28 layers, each attention followed by the layer's four matrix multiplies (as in a real step),
# against FlashInfer's decode kernel:

# %%
chain: dict[int, dict[str, float]] = {}
for name in ("decode_balance_split_cap_h100.json", "decode_balance_split_cap_small_h100.json"):
    for st in load(name)["stages"]:
        for r in st["variants"]:
            if "chain_us_per_layer" in r:
                chain.setdefault(st["running"], {})[r["variant"].removesuffix("_with_matmuls")] = r["chain_us_per_layer"]
print(f"{'running':>7} {'FlashInfer':>10} {'ours':>6} {'change':>7}   (attention + 4 matmuls, us per layer)")
for n in sorted(chain, reverse=True):
    fi, ours = chain[n]["fi_graph"], chain[n]["cudacap_200_4_128"]
    print(f"{n:>7} {fi:>10.1f} {ours:>6.1f} {ours / fi - 1:>+7.1%}")

# %% [markdown]
# Ours is 3-8% faster from 63 to 256 rows and level at 48, so the engine runs it from 48 rows
# (`--split-decode-min-batch`). End to end it is worth about a percent and a half, but it also plans in half the
# host time, needs ~2 MB of workspace where the persistent kernel it replaced reserved 384 MiB, and is a kernel a
# reader can open and change. Where it cannot be built (no nvcc) the engine keeps FlashInfer's kernels.
#
# ### Folding the norms into their neighbours
#
# After the fused kernels a decode step was still ~274 kernels, 56 of them RMSNorms (each layer runs
# `residual += h; x = norm(residual)` twice), each a few microseconds plus a gap whatever the batch. Two identities
# let the kernels around a norm do its work instead. With $\mathrm{norm}(x) = x / \mathrm{rms}(x) \odot g$ and the projection
# $y = \mathrm{norm}(x)\, W^\top$:
#
# $$y \;=\; \frac{1}{\mathrm{rms}(x)} \, \bigl(x\, (W \operatorname{diag} g)^\top\bigr).$$
#
# The norm's weight $g$ is multiplied into $W$ once, at load time; $1 / \mathrm{rms}(x)$ is one number per token,
# which the next kernel (the Triton QK-norm/RoPE/store after `qkv_proj`, SiLU-and-multiply after `gate_up_proj`)
# applies. The residual add moves into the multiply before the norm (`addmm_`: $C = AB + C$). A layer goes from
# nine kernels to seven. `fold_(model)` (`minisgl_ref/perf/norm_folding.py`) transforms a built model, replacing
# each decoder layer by a `FoldedDecoderLayer`, called exactly as chapter 01's layer is. Its forward:

# %%
from minisgl_ref.perf.norm_folding import FoldedDecoderLayer

show_code(FoldedDecoderLayer.forward)

# %% [markdown]
# The fused kernels (`perf/kernels.py`) and the RoPE-and-store attention (`perf/rope_store.py`) plug in the same
# way: `build_runtime` applies all three transforms on a GPU only (`perf/model_transforms.py`). Folding moves bf16's
# roundings rather than adding any; the GPU test holds the folded Qwen3-0.6B to the float32 model as closely as
# the unfolded bf16 model is held:

# %%
gpu_log = (ROOT / "docs" / "data" / "gpu_tests_norm_folding_h100.txt").read_text().splitlines()
print(next(line for line in gpu_log if line.startswith("relative error against float32")))
before = {w["running"]: w for w in load("decode_anatomy_copies_h100.json")["windows"]}
after = {w["running"]: w for w in load("decode_anatomy_folded_h100.json")["windows"]}
print(f"{'running':>7} {'kernels per step':>17}")
for n in before:
    print(f"{n:>7} {before[n]['kernels_per_step']:>8.0f} -> {after[n]['kernels_per_step']:.0f}")

# %% [markdown]
# 56 kernels fewer per step at every batch size, and +2.9% on the canonical workload, every run with folding faster
# than every run without: more than the norms' own GPU time (~0.15 ms a step), because each removed kernel also takes
# its launch gap with it.
#
# ### Smaller steps: the prefill phase, the small kernels, the sampler
#
# Three smaller changes finished the path. Prefill steps use the fused QK-norm/RoPE/store kernel too and replay one
# CUDA graph sized for `--max-prefill-tokens` (the prefill phase went from ~362 to ~305 ms); the small Triton
# kernels issue every load before their first barrier, so a program waits for one memory latency rather than one
# per stage; and the sampler's draw (chapter 02) is split over chunks of the vocabulary and skips the exact noise
# for blocks that cannot win, which took it from ~440 to ~90 µs at 256 rows. The
# [performance evidence](../performance-evidence.md#the-prefill-phase) page has each one's measurements.
#
# ### Where the time of a run goes now
#
# Put together for the first timed run after a cold start, with the engine one sampler change before its last:

# %%
LATEST = load("canonical_cold_start_loads_first_h100.json")
run = LATEST["cold"]["results"][0]
wall, floor, decode_steps = run["wall_s"], run["roofline_floor_s"], run["decode_steps"]
weights_floor_ms = load("decode_matmuls_h100.json")["floor_ms_at_bandwidth"]  # the weights once, at 3.0 TB/s
weights_s = decode_steps * weights_floor_ms / 1e3
kv_s = floor - weights_s  # the rest of the floor: the KV cache, at 3.0 TB/s
prefill_s = load("prefill_anatomy_folded_h100.json")["unprofiled"][-1]["wall_ms"] / 1e3
attention_s = kv_s * 3.0 / 2.9  # our split-KV kernel reads the contexts at ~2.9 TB/s
fixed_s = wall - prefill_s - attention_s
rows = [("prefill phase", prefill_s),
        ("decode attention (KV at ~2.9 TB/s)", attention_s),
        (f"the rest of {decode_steps:,} decode steps", fixed_s),
        ("whole run", wall)]
print(f"{'':<38} {'seconds':>7}")
for what, s in rows:
    print(f"{what:<38} {s:>7.2f}")
print(f"\nfloor {floor:.2f} s = KV {kv_s:.2f} + weights {weights_s:.2f}; "
      f"{run['output_throughput']:,.0f} tok/s, {run['roofline_fraction']:.0%} of the floor")
print(f"fixed cost outside attention: {fixed_s / decode_steps * 1e3:.2f} ms a decode step,")
print(f"of which {weights_floor_ms:.2f} ms is reading the weights at the bandwidth")

# %% [markdown]
# The attention reads the cache within a few percent of what this GPU can read, and the prefill is close to its
# compute floor; what separates the engine from the floor is the ~1.6 ms that every decode step spends outside
# the attention, only ~0.4 ms of which is reading the weights; the rest is ~220-285 short kernels and the gaps
# between them. Attacking it piece by piece bought at most a percent or lost (the evidence page has each attempt);
# what would remove it is the layer's seven kernels fused into a few long ones that stream the weights.

# %% [markdown]
# ## 5. Reading a shared prefix once: cascade decode attention
#
# A decode step costs what it reads, mostly KV. When many requests share a long system prompt, the radix cache
# (chapter 04) stores it once and skips its prefill, but plain decode attention still reads it once *per request*
# on every step: each row walks its own page-table row, though the rows point at the same pages.
#
# Cascade decode attention (`minisgl_ref/perf/cascade.py`) notices, at the start of a decode step, which rows
# share a run of whole pages at the front of their page-table rows (requests matched against the same radix
# node), and splits their attention in three passes: (1) per *group*, every query of the group against the shared
# prefix, read once; (2) per row, the query against its own suffix; (3) the two partial results merged by their
# log-sum-exp, the same merge as the split-KV kernel of chapter 07 (task 7.1). The result is exactly the
# attention over the whole context, up to floating-point rounding; `tests/test_cascade_attention.py` checks it
# against `torch_native`, and greedy tokens with the cascade on and off. The engine picks it by itself, for
# batches with groups whose shared prefix is at least `--cascade-min-prefix-len` tokens (default 256);
# `--disable-cascade-attention` turns it off. It plugs into chapter 08's attention planner as `CascadePlanner`, a
# second decode backend (with decode graphs of its own) that a step uses when its batch has groups.
#
# What it saves is the KV traffic of a step, which the engine counts. Here on the quick model: two groups of four
# requests, each group behind a 320-token system prompt:

# %%
sp_wl = workloads.shared_prefix_workload(num_groups=2, prompts_per_group=4, system_len=320, question_len=16,
                                         output_len=12, temperature=0.0)
sp = bo.run_stage("custom", sp_wl, bo.quick_model("cpu"), dict(bo.QUICK_BUDGETS))
print(f"decode steps {sp.decode_steps}, of which with the cascade {sp.cascade_decode_steps}; "
      f"cached prompt tokens {sp.cached_tokens:,} of {sp.input_tokens:,}")
print(f"KV read per decode step: {sp.kv_bytes_per_decode_step / 1e6:.2f} MB with the cascade, "
      f"{sp.kv_bytes_per_decode_step_plain / 1e6:.2f} MB with plain decode attention "
      f"({sp.kv_bytes_per_decode_step_plain / sp.kv_bytes_per_decode_step:.1f}x less)")

# %% [markdown]
# With `g` groups of `n` requests behind a prefix of `P` tokens and suffixes of `s` tokens, a step reads
# `g * (P + n * s)` tokens of KV instead of `g * n * (P + s)`: close to `n` times less when the prefix dominates.
# On a GPU that is time, because decode reads at the memory bandwidth; on this CPU the step is dominated by Python
# and the small model's matmuls, so only the bytes are worth reading here. The GPU comparison is
# `bash scripts/gpu/measure/cascade_ab.sh` (SGLang's shared-prefix workload: 64 groups of 16 requests, 2,048-token system
# prompts), which runs the radix cache with the cascade, without it, and no radix cache at all.

# %% [markdown]
# The cascade only pays if a step's rows come in large groups. SGLang's shared-prefix workload shuffles its 1,024
# requests, and first-come admission fills the 256 decode slots with about four members of each of 64 groups: a
# saving of about three, not sixteen. So the scheduler admits requests by group (`group_by_prefix` in
# `minisgl_ref/scheduler/scheduler.py`): a waiting request whose first prompt tokens match a request already in the
# engine moves up behind it, and a group loses that precedence once its oldest member has finished, so a busy group
# cannot starve the others. On an H100 (`bash scripts/gpu/measure/cascade_ab.sh`):

# %%
P2 = load("startup_and_cascade_h100.json")
names = {"noradix": "radix cache off", "radix_plain": "radix on, plain decode", "radix_cascade": "radix on + cascade"}
print(f"{'admission':<12} {'engine':<24} {'out tok/s':>9} {'KV GB per step':>14} {'vs radix off':>12}")
for label, key in (("first-come", "cascade_fcfs_admission"), ("grouped", "cascade_grouped_admission")):
    runs = P2[key]
    base = runs["noradix"]["output_throughput"]
    for name, r in runs.items():
        kv = r.get("kv_bytes_per_decode_step")
        print(f"{label:<12} {names[name]:<24} {r['output_throughput']:>9,.0f} "
              f"{f'{kv / 1e9:.1f}' if kv else '-':>14} {r['output_throughput'] / base:>11.2f}x")


# %% alt="Horizontal grouped bar chart of output tokens per second on the shared-prefix workload for three configurations (no radix cache, radix cache, radix cache with the cascade), each with a bar for first-come and one for grouped admission; the cascade with grouped admission has the longest bar, about three times the one without a radix cache." caption="The shared-prefix workload on an H100: no radix cache, the radix cache, and the radix cache with the cascade, under first-come and grouped admission." tags=["hide-input"]
fig, ax = plt.subplots(figsize=(8, 3))
order = ["noradix", "radix_plain", "radix_cascade"]
for i, (label, key) in enumerate((("first-come admission", "cascade_fcfs_admission"),
                                  ("grouped admission", "cascade_grouped_admission"))):
    ax.barh([y + 0.4 * i for y in range(3)], [P2[key][n]["output_throughput"] for n in order], height=0.38,
            label=label)
ax.set_yticks([y + 0.2 for y in range(3)], [names[n] for n in order])
ax.set_xlabel("output tokens/s, shared-prefix workload (H100)")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# In Figure 11.4, grouped, the radix cache with the cascade runs the workload **3.0x** faster than no radix cache
# (22,968 against 7,589 tok/s), where first-come admission reached 2.1x: a decode step reads 11.3 GB of KV instead of
# 22.5 GB (and 67.6 GB without the cascade). The plain radix run gains little from the grouping (1.61x to 1.69x):
# without the cascade every row still reads its own copy of the prefix, whatever its neighbours.
#
# ## 6. From the first request: compiling at start-up
#
# A GPU engine runs code that is compiled on first use (FlashInfer's kernels, Triton's, our split-KV kernel,
# `torch.compile`). Left lazy, that work lands inside the first requests. `minisgl_ref/engine/warmup.py` starts
# every compile at engine start, one thread per kernel family, meets every matrix shape a padded extend step can
# have, and the CUDA-graph capture that follows meets every decode kernel variant; `bench offline` counts the files
# the kernel caches gained *during* the timed run, so a compile that escaped the start-up shows. Two changes made
# most of the difference, measured as a cold start (every disk cache empty) and a warm one: the sampler's draw
# became a Triton kernel of our own (`minisgl_ref/sampling/fused_draw.py`) instead of `torch.compile`, whose tracing
# cost every start ~15 s, and FlashInfer's three fused-op families compile in three threads (72 s instead of 128 s
# on a fresh machine).

# %%
print(f"{'':<16} {'start-up s':>10} {'first run tok/s':>15} {'of floor':>8} {'files compiled in the run':>26}")
for label, key in (("before", "startup_before"), ("after", "startup_after")):
    for start in ("cold", "warm"):
        r = P2[key][start]
        print(f"{label + ', ' + start:<16} {r['startup_s']:>10.1f} {r['output_throughput']:>15,.0f} "
              f"{r['roofline_fraction']:>8.0%} {sum(r['compiled_during_run'].values()):>26}")
tri = P2["triton_backend"]
print(f"\n--attention-backend triton, two fresh processes: {tri[0]['output_throughput']:,.0f} tok/s with "
      f"{sum(tri[0]['compiled_during_run'].values())} files compiled in the run,")
print(f"then {tri[1]['output_throughput']:,.0f}")

# %% [markdown]
# The first timed run of a cold start went from 11.8k to 17.1k tok/s, within 2% of a warm start, with nothing
# compiled inside it, and a warm start-up from 37 s to 11 s. The engine as it now stands, a cold then a warm
# start on three fresh H100 machines (`scripts/gpu/bench.sh`):

# %%
print(f"{'machine':<8} {'start':<5} {'start-up s':>10} {'weights':>8} {'compiles':>9} {'KV + graphs':>11} "
      f"{'tok/s':>7} {'of floor':>8} {'compiled':>8}")
for i, name in enumerate(("canonical_cold_start_prune_3_h100.json", "canonical_cold_start_prune_4_h100.json",
                          "canonical_cold_start_prune_5_h100.json"), 1):
    doc = load(name)
    for start in ("cold", "warm"):
        r = doc[start]["results"][0]
        w, c, e = r["startup_phases"].values()
        print(f"{i:<8} {start:<5} {r['startup_s']:>10.1f} {w:>8.1f} {c:>9.1f} {e:>11.1f} "
              f"{r['output_throughput']:>7,.0f} {r['roofline_fraction']:>8.1%} {sum(r['compiled_during_run'].values()):>8}")

# %% [markdown]
# A cold start compiles for about a minute before its first request, then builds the KV pool and captures the CUDA
# graphs; a warm start takes 12-17 s from the disk caches. Both run the canonical workload at ~20,400-20,500 output
# tokens/s, 77% of the floor, from the first request.
#
# ## 7. Online serving
#
# `bash scripts/gpu/measure/serving_sweep.sh` runs `bench serving` against a `serve` process with the canonical length
# distribution, Poisson arrivals at 8, 16 and 24 requests/s and all at once, 200 requests each, with the default
# engine and with `--enable-mixed-chunk`.

# %%
SV = json.loads((ROOT / "docs" / "data" / "bench_serving_sweep_h100.json").read_text())
print("server ready after: " + ", ".join(f"{k} {v:.0f} s" for k, v in SV["ready_s"].items()))
print("(the first server compiled its decode kernels, the second found them)")
print(f"{'server':<8} {'rate':>5} {'req/s':>6} {'out tok/s':>9} {'TTFT p50/p99 ms':>16} {'TPOT p50/p99 ms':>16} "
      f"{'ITL p50/p99 ms':>15} {'E2E p50/p99 s':>14}")
for r in SV["runs"]:
    print(f"{r['server']:<8} {r['request_rate']:>5} {r['request_throughput']:>6.2f} {r['output_throughput']:>9,.0f} "
          f"{r['median_ttft_ms']:>7.0f}/{r['p99_ttft_ms']:<8.0f} {r['median_tpot_ms']:>7.1f}/{r['p99_tpot_ms']:<8.1f} "
          f"{r['median_itl_ms']:>6.1f}/{r['p99_itl_ms']:<8.1f} {r['median_e2e_latency_ms'] / 1e3:>6.1f}/"
          f"{r['p99_e2e_latency_ms'] / 1e3:<7.1f}")

# %% alt="Three line charts against achieved requests per second, from 8 to about 18: time to first token, time per output token and end-to-end latency in milliseconds, each with solid p50 and dashed p99 lines for the default and the mixed-step server. Time per output token and end-to-end latency rise with the rate, the default server's steeply past 16 requests per second; the p99 time to first token climbs to about 1.4 s (default) and 3 s (mixed) before dropping at the highest rate." caption="Serving latency against the achieved request rate, for the default and the mixed-step server, median and p99." tags=["hide-input"]
fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
for server, marker in (("default", "o"), ("mixed", "s")):
    rows = [r for r in SV["runs"] if r["server"] == server]
    x = [r["request_throughput"] for r in rows]
    for ax, key, title in ((axes[0], "ttft_ms", "time to first token"), (axes[1], "tpot_ms", "time per output token"),
                           (axes[2], "e2e_latency_ms", "end-to-end latency")):
        ax.plot(x, [r[f"median_{key}"] for r in rows], marker=marker, label=f"{server} p50")
        ax.plot(x, [r[f"p99_{key}"] for r in rows], marker=marker, ls="--", label=f"{server} p99")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("achieved requests/s")
        ax.set_ylabel("ms")
axes[0].legend(fontsize=7)
fig.tight_layout()
plt.show()

# %% [markdown]
# In Figure 11.5, throughput saturates near 17-18 requests/s (10-11k output tok/s: fewer than offline, because
# requests arrive over time and the batch is rarely full), and TTFT and TPOT grow with the rate as expected. Read the
# inter-token latency with care: at 16 requests/s and above its median is 0.1 ms, because the client receives several
# tokens of a stream back to back and the gap before each burst carries the whole wait (section 8 finds where the
# bursts come from). TPOT, a request's decode time divided by its tokens, is the measure of decode smoothness here.
#
# ### Where the latency tail comes from
#
# Below saturation the tail is made in the engine. `--step-log FILE` (`minisgl_ref/bench/step_trace.py`) writes one
# JSON line per engine step: nearly every gap over 15 ms sat next to a *prefill*, whose step took 18-47 ms for a
# 1,000-token prompt although the GPU worked under 9 ms in it. The host was launching the prefill's ~400 operators
# eagerly, and every running request paid for it. Three changes took that away:
#
# * **Padding extend steps** to a multiple of 64 tokens (`ModelRunner.pad_extend`), so that cuBLAS, which picks a
#   kernel in host time (~0.3 ms) the first time it meets a shape, meets every padded shape once at start-up.
# * **Extend steps in CUDA graphs** (`minisgl_ref/engine/extend_graph.py`): every multiple of 64 tokens up to
#   `--cuda-graph-max-extend-tokens` (2,048) for 2, 16 and 64 rows. The launching step drops to ~2.5 ms.
# * **Mixed steps by default** on a GPU: the decode rows ride along in the prompt's step, so a running request waits
#   one step at an arrival instead of two.
#
# The sweep again with all three, one server of each kind, 200 requests per rate:

# %%
MX = load("serving_mixed_graphs_h100.json")
print(f"{'server':<8} {'rate':>5} {'req/s':>6} {'TTFT p50/p99 ms':>16} {'ITL p50/p99 ms':>15} {'p99/p50':>8} "
      f"{'TPOT p50 ms':>12}")
for r in MX["summary"]:
    print(f"{r['server']:<8} {r['request_rate']:>5} {r['request_throughput']:>6.2f} {r['median_ttft_ms']:>7.0f}/"
          f"{r['p99_ttft_ms']:<8.0f} {r['median_itl_ms']:>6.1f}/{r['p99_itl_ms']:<8.1f} {r['itl_p99_over_p50']:>8.2f} "
          f"{r['median_tpot_ms']:>12.2f}")

# %% alt="Line chart of inter-token latency in milliseconds against achieved requests per second, at about 8, 15 and 30: the medians stay between 2 and 6 ms; the p99 lines stay close to them up to 15 requests per second, then at saturation rise to about 100 ms for the default server and 36 ms for the mixed-step one. A dotted line marks twice the lowest median." caption="Inter-token latency with extend steps in CUDA graphs, median and p99, for the default and the mixed-step server." tags=["hide-input"]
fig, ax = plt.subplots(figsize=(7, 3.2))
for server, marker in (("default", "o"), ("mixed", "s")):
    rows = [r for r in MX["summary"] if r["server"] == server and r["request_rate"] != float("inf")]
    x = [r["request_throughput"] for r in rows]
    ax.plot(x, [r["median_itl_ms"] for r in rows], marker=marker, label=f"{server}: ITL p50")
    ax.plot(x, [r["p99_itl_ms"] for r in rows], marker=marker, ls="--", label=f"{server}: ITL p99")
ax.axhline(2 * min(r["median_itl_ms"] for r in MX["summary"]), color="grey", lw=0.8, ls=":")
ax.set_xlabel("achieved requests/s")
ax.set_ylabel("ms")
ax.set_title("inter-token latency with extend steps in CUDA graphs (dotted: twice the lowest median)", fontsize=9)
ax.legend(fontsize=7)
fig.tight_layout()
plt.show()

# %% [markdown]
# In Figure 11.6, below saturation the P99 inter-token latency is now **1.6-1.7x its median with mixed steps** (3.4
# and 4.2 ms against 2.0 and 2.6 ms), and 2.2-2.4x without them; before these changes it was 10-15x. At saturation
# (`inf`) mixed steps have more rows than the largest bucket and run eagerly, and the client's ITL there is dominated
# by bursts, the subject of the next section.

# %% [markdown]
# ## 8. The cost of one streamed token
#
# At saturation the engine above produces about 10,000 output tokens a second, and every one of them is an SSE
# event that passes through two single-threaded Python processes: the API server, which turns it into JSON and
# writes it to a socket, and the benchmark client, which reads, splits and parses it. Each has one CPU second per
# second to spend. If either spends more than 100 us per event at 10,000 events a second, events wait in a
# queue, and they come out in bursts: the client timestamps the backlog, not the engine.
#
# That budget can be measured without a GPU, as *CPU time per event*. `scripts/stream_cost.py` streams 128 native
# `/generate` requests of 512 tokens from a tiny model on the CPU and reads the CPU time of the API server and of
# the client per event, before and after three changes, each with two clients, in alternating runs: the client's stream reader (httpx, now aiohttp, whose reader is mostly C), the
# server's event loop and HTTP parser (asyncio and h11, now uvloop and httptools when installed), and the native
# event, which carries all ids so far and was encoded afresh per token (the server now appends to the ids' JSON
# text, `native_sse` in `minisgl_ref/server/http_server.py`).

# %%
SC = json.loads((ROOT / "docs" / "data" / "stream_cost_cpu.json").read_text())
print(f"CPU us per streamed event ({SC['runs'][0]['events']:,} events per run, mean of "
      f"{len(SC['runs']) // len(SC['summary'])} runs)")
print(f"{'server':<8} {'client':<8} {'API server':>10} {'client':>8}")
for key, v in SC["summary"].items():
    server, client = key.split("/")
    print(f"{server:<8} {client:<8} {v['server_us_per_event']:>10.1f} {v['client_us_per_event']:>8.1f}")
before, now = SC["summary"]["before/httpx"], SC["summary"]["current/aiohttp"]
for side in ("server", "client"):
    print(f"{side}: {before[f'{side}_us_per_event']:.0f} -> {now[f'{side}_us_per_event']:.0f} us/event, "
          f"{before[f'{side}_us_per_event'] / now[f'{side}_us_per_event']:.2f}x; budget at 10k events/s: "
          f"{now[f'{side}_us_per_event'] * 1e4 / 1e6:.0%} of a core (was {before[f'{side}_us_per_event'] * 1e4 / 1e6:.0%})")

# %% [markdown]
# On this CPU the old pair needed more than a whole core on the client side at 10,000 events a second, and most
# of one on the server side, and both costs grow with the answer's length (a native event is as long as the
# answer so far). Those are the bursts of section 7. The new pair needs about half a core on the server side and
# two thirds of one on the client side, which leaves room for the engine's rate (a faster host CPU leaves more).
# The client's change alone is the `before/aiohttp` row.
#
# If the API server falls behind all the same, a handler that wakes to find several chunks of its request waiting
# sends them as one event (`coalesce` in `minisgl_ref/server/tokenizer_manager.py`): a backlog costs one encode and
# one write. The first table of section 7 was measured before these changes, so its ITL column still shows the
# bursts.

# %% [markdown]
# ## Summary
#
# * **Divide by the floor.** Decode reads every weight once a step and every running request's KV; summed over the
#   canonical workload (256 requests, 133,966 output tokens) that is 5.03 s at the H100's measured 3.0 TB/s, 26.6k
#   output tokens/s. The KV reads are 92% of it.
# * **The ladder** shows each chapter's idea at work: the KV cache on the CPU, batched attention and CUDA graphs
#   (2.2-2.9x) and fused kernels (~24%) on the GPU.
# * **What was kept, and why.** No hidden host waits (pinned, event-guarded token copies), less Python per
#   request, fewer kernels per layer (fused ops, folded norms), a balanced split-KV decode kernel of our own, graphs
#   for prefill steps and a cheaper sampler took the engine from ~12k to ~20.5k output tokens/s, 77% of the floor.
#   Attention now reads near the bandwidth; the distance left is a fixed ~1.6 ms of short kernels per decode step.
# * **Shared prefixes** are read once per step by cascade decode attention, and admitting a group's requests
#   together makes the groups large: 3.0x over no radix cache on SGLang's shared-prefix workload.
# * **Compile at start-up**, in parallel, so the first request runs as fast as the thousandth: a cold start takes
#   about a minute and a half, a warm start 12-17 s, and nothing compiles inside the timed run.
# * **Online**, the tail of inter-token latency came from eager prefill launches; padded extend shapes, extend
#   graphs and mixed steps bring P99 to 1.6-1.7x the median. Each streamed token costs the API server and the client
#   tens of microseconds of CPU, which a fast engine can exceed: measure it as CPU time per event.

# %% [markdown]
# ## Exercises
#
# 1. **Task 11.1 (the workload).** Rewrite the `TASK 11.1` region of `minisgl_ref/bench/workloads.py` and grade
#    it with `python -m minisgl_ref.course grade --task 11.1`. Then draw each request's output length right after its
#    prompt (interleaved, not all prompts first): how far does the total move from 133,966 output tokens, and
#    why is a workload with the same *distribution* not the same workload for comparing engines?
# 2. **Task 11.2 (the floor).** Rewrite the three `TASK 11.2` regions of `minisgl_ref/bench/offline.py` (the
#    weight bytes, the context sum and the floor) and grade them with
#    `python -m minisgl_ref.course grade --task 11.2`. Then compute the floor of the canonical workload on an
#    H200 (4.8 TB/s) and for Qwen3-14B (`resolve_model_path("qwen3-14b", "dummy")`) on an H100. For which of the
#    two does the weight term stop being negligible?
# 3. **A less favourable schedule.** The floor assumes all 256 requests run from the first step. Redo it with at
#    most 64 requests running at once, taken in order, each new one admitted when one finishes: how many decode
#    steps read the weights now, and how much higher is the floor? Does the KV term change?
# 4. **The ladder on a shared prefix.** Run `python -m minisgl_ref bench offline --quick --workload shared-prefix
#    --stage all` and compare the `radix` row with the `paged` row: prefill tokens, cached tokens, hit rate and
#    throughput. Why did the radix stage gain almost nothing on the canonical workload of section 3?
# 5. **Backends against the floor (GPU).** On a GPU, run `python -m minisgl_ref bench offline` once per
#    `--attention-backend` (`triton`, `flashinfer`, `fa3`) and place each throughput as a fraction of the floor
#    at your GPU's measured copy bandwidth (`--hbm-bandwidth`). Compare with the ladder of section 3: which
#    backend gains most from CUDA graphs, and why?
# 6. **The floor of this CPU.** Measure this machine's memory bandwidth the way the GPU run does (time a copy of
#    a tensor much larger than the caches, count bytes read plus written), then compute the floor of the quick
#    workload on the quick model (`bo.workload_floor_seconds(quick_wl, config, bandwidth)`, with the config
#    written from `bo.QUICK_MODEL_CONFIG`). What fraction of it does the `overlap` row of section 3 reach, and
#    why is a CPU so much further from its floor than the H100 (count the Python work per step against the bytes)?
# 7. **Prefill is not free.** The floor treats prefill as free. Add a compute term: at a sustained rate of F
#    FLOP/s, prefilling P tokens costs about 2 * parameters * P FLOPs (attention aside). Measure F with a large
#    bf16 matmul on the GPU (the H100 SXM datasheet gives 989 TFLOP/s dense): how much does the canonical
#    workload's prefill add to the floor, and at what ratio of prompt to output tokens would it dominate?

# %% [markdown]
# 8. **Start-up for every backend.** Section 6 shows the Triton backend's first process compiling 17 kernel
#    files inside its timed run. Find which kernels they are (run `bench offline --attention-backend triton`
#    twice with `TRITON_CACHE_DIR` pointing at an empty folder and list what the first run adds), then make
#    `minisgl_ref/engine/warmup.py` run them at start-up. What shapes must the warm-up use so that every
#    alignment variant the workload meets is built?
# 9. **The first matmul of a shape, here.** Time `torch.nn.functional.linear` on this CPU for 200 new row counts
#    (1,000 .. 1,199) against a 1,024 x 6,144 weight, then for the same counts again: does this CPU's BLAS pay for
#    a new shape too? With a padding multiple `m`, an extend step computes up to `m - 1` dummy tokens and the
#    warm-up meets `budget / m` shapes per weight: which `m` for prompts of ~100 tokens, and which for ~10,000?
# 10. **How many pieces? (the plan on a CPU, the timing on a GPU).** `plan_pieces` in
#    `minisgl_ref/perf/split_decode.py` cuts a batch of B contexts into up to B + B/8 pieces. Feed it the lengths of
#    the 256-running stage (`benchmarks.decode_balance.canonical_stages`) and of 144 contexts of 500 tokens plus one
#    of 30,000: how long is the longest piece against the mean piece, and what does that predict for the last wave
#    of blocks? On a GPU, time B pieces against B + B/2 (`benchmarks/decode_balance.py --variants
#    cudafixed_0_4_128,cudafixed_50_4_128`). Why does the answer depend on the spread of the lengths more than on
#    their mean?
# 11. **Loads before barriers (the PTX on a CPU).** Triton compiles for a GPU it does not have:
#    `triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32)).asm["ptx"]`. Do it for
#    `qk_norm_rope_kernel` (`_kernels()` in `minisgl_ref/perf/triton_ops.py`, with a decode step's constants) and
#    count the `ld.global` instructions before the first `bar.sync`; then move the residual row's reduction back
#    above the q and k loads and count again. Why does the order not matter for a prefill step of 16,384 tokens?
# 12. **Two logarithms (the PTX on a CPU).** Compile `race_kernel` (`minisgl_ref/sampling/race_kernel.py`) for
#    sm_90 as in exercise 11 (`LOG_SPACE=True`, `BLOCK=2048`), with `FAST_LOG` off and on, and count the `bra` and
#    `lg2.approx` instructions of each PTX. Why must the logarithm inside `log1p` stay exact, while the one in the
#    score may be approximate? Work it out for `u = 2**-20`: what does an absolute error of 2^-22 do to
#    `log2(1 - u)`?

# %% [markdown]
# ## Reproduce
#
# Anywhere, on a CPU, in seconds:
#
# ```bash
# python chapters/11_performance.py
# python -m minisgl_ref bench offline --quick --stage all --cpu-threads 1
# python -m minisgl_ref.course grade --chapter 11       # tasks 11.1 and 11.2
# python -m pytest tests/test_bench.py -q               # every test of the benchmarks
# python scripts/stream_cost.py --output stream_cost.json   # section 8 (about 10 minutes on 2 cores)
# ```
#
# Expected on a 2-core x86_64 CPU, one torch thread (8 requests, 195 output tokens, tiny random Qwen3-shaped
# model): about 110 output tok/s for the naive oracle and 300-370 for every stage with a KV cache, about 10 s for
# the whole command. The canonical workload has 133,966 output tokens on every machine, and its floor is 5.03 s
# (26.6k tok/s) at 3.0 TB/s, 4.50 s at the H100's datasheet 3.35 TB/s. `stream_cost.py`
# (`docs/data/stream_cost_cpu.json`): about 47 µs of API-server CPU and 67 µs of client CPU per streamed token,
# against about 83 and 124 before the changes of section 8.
#
# On one H100 with flashinfer-python and FlashAttention-3 installed:
#
# ```bash
# bash scripts/gpu/chapter.sh 11                     # every GPU run below that measures this engine, in turn
# bash scripts/gpu/chapter.sh 11 offline             # section 3: tests, step times, the ladder, profiles
# python -m minisgl_ref bench offline         # canonical workload, full engine, Qwen3-0.6B dummy bf16
# python -m minisgl_ref bench offline --disable-cuda-graph
# BASE=.baseline bash scripts/gpu/ab.sh     # section 4: interleaved A/B against an older checkout
# python3 scripts/gpu/measure/decode_anatomy.py --out results --at 256,128,64,32,16   # section 4: a step, by stage
# python -m benchmarks.decode_balance --variants fi_graph,cudacap_200_4_128 --marks 256,192,160,128,96,64 \
#     --layers 28 --slot-order canonical --with-matmuls --output results/split_cap.json  # section 4: our kernel
# python -m pytest -m gpu tests/test_norm_folding.py tests/test_triton_fused.py   # section 4: folded vs float32
# bash scripts/gpu/measure/cascade_ab.sh              # section 5: shared prefix, radix off / on / cascade
# bash scripts/gpu/bench.sh results/cold_start.json   # section 6: a cold start, then a warm start
# NUM_PROMPTS=160 OUT=results bash scripts/gpu/measure/serving_sweep.sh   # section 7: client latencies and step gaps
# SERVERS="default mixed" RATES="8 16" OUT=results bash scripts/gpu/measure/serving_sweep.sh   # section 7: mixed steps
# ```
#
# Expected on an H100 80GB HBM3 with the engine as it stands (`bench.sh`,
# `canonical_cold_start_prune_3_h100.json` to `_prune_5_`, about 2.5 minutes): about 20,400-20,500 output tok/s
# on the first timed run of `python -m minisgl_ref bench offline` after a cold start (77% of the 5.03 s floor), a
# start-up of 80-90 s cold and 12-17 s warm, the warm process within 2% of the cold one. The engine of section 3's
# ladder (`docs/data/gpu_offline_h100.json`): about 17,700-17,850 output tok/s, about 8,200 with
# `--disable-cuda-graph`. The shared-prefix workload (`startup_and_cascade_h100.json`): about 23,000 tok/s with the radix cache
# and the cascade, about 7,600 without the radix cache. The serving sweep with mixed steps
# (`serving_mixed_graphs_h100.json`): ITL P99/P50 of 1.67 and 1.61 at 8 and 16 requests/s. The commands behind
# every other measurement are on the [performance evidence](../performance-evidence.md) page.

# %%
print(f"chapter ran in {time.perf_counter() - CHAPTER_START:.1f} s")
