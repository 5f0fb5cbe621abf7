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
# # Chapter 08 — CUDA graphs and the other per-token costs
#
# **What you will build.** A `CudaGraphRunner` that records a decode step once per batch size and replays it
# (`minisgl_ref/engine/cuda_graph.py`, tasks 8.1 and 8.2), and the cheap per-step path around it: one
# host-to-device copy per step, no hidden syncs, sampling state reused across decode steps, fused kernels for
# the small element-wise ops.
#
# **Why it matters.** Once attention is fast (chapter 07), a decode step of a small model is *short*: Qwen3-0.6B
# reads 1.2 GB of weights per step, 0.4 ms of HBM time on an H100. But that step is ~370 kernel launches (28
# layers x ~16 kernels), and launching a kernel costs the CPU 5-10 µs through PyTorch. At batch 1 the CPU cannot
# launch kernels as fast as the GPU finishes them, so the GPU waits between kernels: the step takes ~9 ms
# instead of ~1 ms. A CUDA graph records the launches once and replays the whole sequence with one call.
#
# In this chapter you will:
#
# 1. count the kernels of a decode step and turn launch overhead into a time budget;
# 2. build the batch-size ladder and capture a graph per size (task 8.1), then replay a padded batch (task
#    8.2), on this CPU with stand-in graphs that re-run what they captured on the same static buffers;
# 3. read the three attention-backend hooks that let a graph's metadata change between replays;
# 4. read the GPU measurements: decode step time with and without graphs, per batch size (H100);
# 5. look at the other per-token costs of a step, and what removing each one bought.
#
# Modules: `minisgl_ref/engine/cuda_graph.py` (tasks 8.1, 8.2), `minisgl_ref/engine/model_runner.py` (the step's
# host path), `minisgl_ref/engine/graphs.py` and `minisgl_ref/engine/attention_planner.py` (which graphs replay
# a step), `minisgl_ref/engine/sampling_state.py` (sampling state reused across steps),
# `minisgl_ref/layers/kernel_table.py` (the per-token ops' seam) with `minisgl_ref/perf/kernels.py` and
# `minisgl_ref/perf/fused_ops.py` (the fused kernels installed there), `minisgl_ref/attention/base.py` (the hooks).

# %% tags=["setup"]
import inspect
import json
import tempfile
import textwrap
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from IPython.display import display
from torch.profiler import ProfilerActivity, profile

from minisgl_ref import LLM, SamplingParams
from minisgl_ref.attention.base import AttentionBackend
from minisgl_ref.attention.torch_native import TorchStaticBackend
from minisgl_ref.bench.offline import QUICK_MODEL_CONFIG
from minisgl_ref.book import setup_chapter, show_code, show_table, wrap
from minisgl_ref.engine import cuda_graph
from minisgl_ref.engine.cuda_graph import CudaGraphRunner, RerunGraphFactory, capture_batch_sizes, padded_batch_size
from minisgl_ref.engine.model_runner import ModelRunner

CHAPTER_START = time.perf_counter()
ROOT = setup_chapter()  # one torch thread (MINISGL_THREADS for more), and the repository root
GPU = json.loads((ROOT / "docs" / "data" / "gpu_offline_h100.json").read_text())


# %% [markdown]
# ## 1. How many kernels is a decode step?
#
# We cannot launch CUDA kernels here, but every kernel of an eager step is one PyTorch operator call, and those
# we can count on the CPU: build a model with Qwen3-0.6B's *structure* (28 layers, QK-norm, GQA) but tiny widths,
# run one decode step of one request under the profiler, and count the operator calls that do work (leaves of
# the call tree, leaving out the ones that only make views).

# %%
cfg = dict(QUICK_MODEL_CONFIG, num_hidden_layers=28, hidden_size=64, intermediate_size=128,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=10240)
folder = Path(tempfile.mkdtemp(prefix="ch08_"))
(folder / "config.json").write_text(json.dumps(cfg))
llm = LLM(folder, load_format="dummy", device="cpu", max_total_tokens=4096, disable_overlap_schedule=True)
engine = llm.engine
greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
engine.add_request(llm.make_request(list(range(10, 40)), greedy))
engine.step()  # prefill
one = engine.runner.prepare(engine.scheduler.schedule())  # a decode step of that one request
with profile(activities=[ProfilerActivity.CPU]) as prof:
    engine.runner.forward(one)
META_ONLY = {"aten::view", "aten::reshape", "aten::split", "aten::split_with_sizes", "aten::chunk", "aten::slice",
             "aten::unsqueeze", "aten::t", "aten::transpose", "aten::as_strided", "aten::select", "aten::expand",
             "aten::_unsafe_view", "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::detach",
             "aten::alias", "aten::lift_fresh", "aten::flatten", "aten::contiguous", "aten::to", "aten::_to_copy",
             "aten::resolve_conj", "aten::resolve_neg", "aten::numpy_T", "aten::item", "aten::_local_scalar_dense"}


def is_work(e) -> bool:
    return e.name.startswith("aten::") and e.name not in META_ONLY


counted = [e for e in prof.events() if is_work(e) and not any(is_work(c) for c in e.cpu_children)]
print(f"plain-PyTorch decode step, 28 layers, 1 request: {len(counted)} kernel-sized operators, "
      f"{len(counted) / 28:.0f} per layer")
gpu_kernels = GPU.get("profile", {}).get("eager_bs256_kernels_per_forward")
if gpu_kernels:
    print(f"measured on the H100 (fused ops, one attention kernel): {gpu_kernels:.0f} kernels per decode step")

# %% [markdown]
# Dozens of operators per layer in the plain-PyTorch path, and still ~15 per layer on the GPU path with fused
# kernels (section 6): several hundred launches per step. At 5-10 µs of CPU time per launch that is milliseconds
# of pure launching, against 0.4 ms of memory traffic for the weights. That is the whole argument for CUDA
# graphs at small batch.

# %%
launches = int(gpu_kernels or 370)
for us_per_launch in (5, 8, 10):
    print(f"{launches} launches x {us_per_launch:2d} us = "
          f"{launches * us_per_launch / 1000:.1f} ms of CPU time per step")
weight_bytes = 1.19e9  # Qwen3-0.6B in bf16 (chapter 11 counts it exactly)
print(f"reading the weights once at 3.0 TB/s: {weight_bytes / 3.0e12 * 1e3:.2f} ms")
engine.abort(engine.scheduler.running[0])
while engine.has_work:
    engine.step()

# %% [markdown]
# ## 2. Capture sizes, padding, and the capture itself (task 8.1)
#
# A graph has fixed shapes, so it is captured per batch size. Capturing every size from 1 to 256 would take
# hundreds of captures and memory for each; SGLang captures a ladder instead and pads: a batch of 13 runs in
# the graph for 16, with 3 padding rows. The ladder is the first part of task 8.1:

# %%
show_code(capture_batch_sizes)

# %%
sizes = capture_batch_sizes(256)
print(wrap(f"{len(sizes)} graphs for max batch 256: {sizes}"))
for n in (1, 3, 5, 13, 100, 250):
    p = padded_batch_size(sizes, n)
    print(f"batch {n:3d} -> graph {p:3d}  ({p - n} padding rows, {100 * (p - n) / p:.0f}% of the rows wasted)")

# %% [markdown]
# The waste is largest for small odd batches, but there a step is launch-bound, not compute-bound, so the extra
# rows cost almost nothing; at large batches the ladder steps by 8, so padding stays under 8 rows.
#
# **Padding is data.** The padding rows are not a special case inside the kernels or the attention backends: the
# graph runner appends *dummy requests* to the batch itself, and from then on everybody sees an ordinary decode
# batch of the captured size. A dummy request runs through every kernel like a real one, so it writes K and V for
# its "token" and reads a context. Both must be harmless, which decides its values (`DUMMY_ROW`):
#
# * its KV goes to **slot 0**, which the allocator never hands out (page 0 is reserved, chapter 03);
# * it reads **page-table row 0** with **length 1** (prefix 0, one new token): one valid slot, whatever it holds;
# * its token id and position are 0; its logits row is dropped.

# %%
print(wrap(f"DUMMY_ROW = {cuda_graph.DUMMY_ROW}"))

# %% [markdown]
# **Capturing.** The runner allocates its static inputs once, `max_bs` rows each, all dummy rows at rest. For
# each size of the ladder, largest first (the graphs share one memory pool, which the largest sizes), it builds a
# decode batch of dummy requests whose tensors are *views* of those buffers, lets the attention backend point its
# metadata at its own static buffers (`prepare_capture`), runs the step twice outside any graph (the warm-up:
# library handles, kernel compilation and autotuning must not happen while recording), then records it. The
# recorded graph keeps the addresses of those views and of its output, which is why every later step has to be
# copied *into* them. Task 8.1 is both parts, the ladder and this loop:

# %%
show_code(cuda_graph, task="8.1")

# %% [markdown]
# The graphs come from a *graph factory*. On a GPU, `CudaGraphFactory` records real CUDA graphs on a side stream
# into one shared pool. Here there is no GPU, so we use the stand-in `RerunGraphFactory`: "capturing" runs the
# step once and keeps the function and its batch, and "replaying" runs the same function on the same batch again
# and writes the result into the output tensor returned at capture. Since that batch's tensors are the static
# buffers, a stand-in replay sees exactly what was copied into them, as a real one would. The model is section
# 1's; the attention backend is `TorchStaticBackend`, `torch_native` with its decode metadata in static buffers
# (section 4 shows its hooks), over the engine's own KV pool and page table.

# %%
static_backend = TorchStaticBackend(engine.runner.attn_backend.kv_pool, engine.runner.req_to_token)
factory = RerunGraphFactory()
graphs = CudaGraphRunner(engine.runner.model, static_backend, torch.device("cpu"), max_bs=8,
                         graph_factory=factory)  # fmt: skip
print(f"captured sizes {graphs.batch_sizes} in {graphs.capture_seconds:.2f} s; the factory saw, in order:")
print(wrap("  " + ", ".join(f"{what} {bs}" for what, bs in factory.log), indent="  "))
print("static inputs at rest:")
for name, buf in graphs.static.items():
    print(f"{name:>17}: {buf.tolist()}")

# %% [markdown]
# ## 3. What a replay copies (task 8.2)
#
# A replay picks the graph of the smallest captured size that holds the batch, copies the batch into the first
# rows of the static inputs and the dummy request into the rest, lets the backend refill its metadata
# (`prepare_replay`), replays, and returns the real rows of the graph's output:

# %%
show_code(cuda_graph, task="8.2")

# %% [markdown]
# Five requests of 30 prompt tokens: prefill them with the engine, schedule their decode step, and run it
# through the graph for 8 (stand-in) and eagerly (the engine's own `torch_native` step).

# %%
for i in range(5):
    engine.add_request(llm.make_request(list(range(10 + i, 40 + i)), greedy))
engine.step()
fb = engine.runner.prepare(engine.scheduler.schedule())
with torch.inference_mode():
    replayed = graphs.replay(fb).clone()
    eager, _ = engine.runner.forward(fb)
print(f"replayed logits {tuple(replayed.shape)} (a view of the graph's {tuple(graphs.outputs[8].shape)} output); "
      f"max |replay - eager| = {(replayed - eager).abs().max().item():.1e}")
assert replayed.shape == eager.shape and torch.allclose(replayed, eager, atol=1e-4, rtol=1e-4)
for name, buf in graphs.static.items():
    print(f"{name:>17}: {buf.tolist()}")

# %% [markdown]
# Rows 0-4 of the static inputs are the real requests (their token from the device token buffer, their position
# = context length - 1, a freshly allocated KV slot, their page-table row, their length); rows 5-7 are dummy
# requests again. The replay is the same computation as the eager step (two attention implementations, so the
# logits agree to rounding); the tests of task 8.2 also replay smaller batches after larger ones, where a
# forgotten refill of the dummy rows would leave an earlier request's slot in a padding row.
#
# ## 4. The attention backend's three hooks
#
# The model's own tensors are covered by the static buffers, but attention also reads per-step *metadata*
# (`kv_indptr` / `kv_indices` for the Triton and FlashInfer kernels, a page table for FA3). A backend that
# supports graphs implements three hooks, declared on the base class. The capture and replay hooks receive the
# padded batch, an ordinary decode batch, so none of them knows about padding:

# %%
for hook in ("init_graph_buffers", "prepare_capture", "prepare_replay"):
    doc = inspect.getdoc(getattr(AttentionBackend, hook)).split("\n\n")[0]
    print(wrap(f"{hook}{inspect.signature(getattr(AttentionBackend, hook))}", indent=" " * 8))
    print(wrap("    " + " ".join(doc.split()), indent="    "), end="\n\n")

# %% [markdown]
# The smallest example is the `TorchStaticBackend` of sections 2 and 3: its decode reads two device tensors,
# each request's page-table row and length, and under graphs those are views of two buffers of `max_bs` entries:

# %%
show_code("\n\n".join(textwrap.dedent(inspect.getsource(getattr(TorchStaticBackend, hook)))
                       for hook in ("init_graph_buffers", "prepare_capture", "prepare_replay")))

# %% [markdown]
# The replay hook runs before *every* graphed decode step, so it must refill the buffers in place and must not
# wait for the GPU: the Triton backend does it with a cumsum and one small kernel (`build_kv_indices`); the
# FlashInfer backend also re-plans its split-KV schedule on the host, from the lengths the scheduler already
# knows (`seq_lens_cpu`), so that no device-to-host copy is needed.
#
# Correctness checks (`tests/test_cuda_graph.py`). On the CPU, with stand-in graphs and a toy model: the capture
# records every size, largest first, each after its backend hook and a warm-up, on the static buffers; a replay
# returns the eager step's logits for batches of every size, in an order where smaller batches follow larger
# ones, and leaves dummy rows in the padding. On the GPU, with real graphs: a replay gives **bit-identical**
# logits to the same padded batch run eagerly (Triton and FlashInfer backends, batch sizes 1, 3, 8, 13, 16), and
# a whole engine with graphs generates exactly the same greedy tokens as without.
#
# **From the backend to the graphs the engine replays.** The model runner does not hold one `CudaGraphRunner`. It
# holds a list of *graph runners* (`minisgl_ref/engine/graphs.py`), each a set of captured graphs with two
# methods, `can_run(fb)` and `replay(fb)`, and offers every step to them in order: the first that takes the step
# replays it, and a step that none takes runs eagerly. Chapter 11 adds graphs of extend steps as one more graph
# runner, without a line of this method changing:

# %%
show_code(ModelRunner.forward)

# %% [markdown]
# Which attention backend a step runs on is decided just before, by the engine's *attention planner*
# (`minisgl_ref/engine/attention_planner.py`). The planner lists every backend a decode step may run on
# (`decode_backends`); the runner captures one `CudaGraphRunner` per backend that has the three hooks, and a
# `CudaGraphRunner` takes only the steps whose `fb.attn_backend` is the backend it captured (`can_run`), so the
# planner's choice of backend is also its choice of graphs. The core's planner has one backend, the engine's, and
# so one set of decode graphs. The planner that `LLM` and the server get (chapter 11's) adds a second decode
# backend, cascade attention for batches whose requests share a cached prefix, and with it a second set of
# graphs. This CPU engine captures nothing, but its planner is there:

# %%
planner = engine.runner.planner
print(f"{type(planner).__name__}: decode backends {[type(b).__name__ for b in planner.decode_backends]}, "
      f"graph runners {engine.runner.graph_runners}")

# %% [markdown]
# ## 5. GPU results: decode step time, eager vs graph
#
# Measured on an H100 80GB HBM3 with `bash scripts/gpu/measure/offline.sh` (see Reproduce); Qwen3-0.6B config, bf16, dummy
# weights, every request at a context of 512 tokens, default attention backends (FA3 prefill, FlashInfer
# decode). Step = attention metadata + model forward + logits, timed with CUDA events over 50 steps (launch
# gaps included: they are the point).

# %%
prov = GPU["provenance"]
print(f"{prov['hardware']['gpu']}, driver {prov['hardware']['nvidia_driver']}, torch {prov['software']['torch']},")
print(f"flashinfer {prov['software']['packages']['flashinfer-python']}, measured {prov['date'][:10]}")
rows = GPU["decode_steps"]
print(f"{'batch':>5} {'eager ms':>9} {'graph ms':>9} {'speedup':>8}")
for r in rows:
    print(f"{r['batch_size']:>5} {r['eager_ms']:>9.3f} {r['graph_ms']:>9.3f} {r['speedup']:>7.2f}x")

# %% alt="Line chart with a log-2 x axis of batch size from 1 to 256: the eager line rises from about 11 to 19 ms per decode step; the CUDA-graph line starts near 1.4 ms at batch 1, stays under 3 ms up to 64 and reaches about 9 ms at 256, about half of eager." caption="Qwen3-0.6B decode step time on an H100, eager and replayed from CUDA graphs, against batch size (context 512)." tags=["hide-input"]
fig, ax = plt.subplots(figsize=(6.5, 3.6))
bs = [r["batch_size"] for r in rows]
ax.plot(bs, [r["eager_ms"] for r in rows], "o-", label="eager")
ax.plot(bs, [r["graph_ms"] for r in rows], "s-", label="CUDA graph")
ax.set_xscale("log", base=2)
ax.set_xlabel("decode batch size (requests)")
ax.set_ylabel("ms per decode step")
ax.set_title("Qwen3-0.6B decode step on H100 (context 512)")
ax.grid(alpha=0.3)
ax.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# Read Figure 8.1 from the left. Eager steps cost ~10-20 ms whatever the batch: that is the CPU launching ~310
# kernels through Python (how long depends on the host: the same step measured 9-15 ms in different calls); the
# GPU work underneath is a fraction of it. With graphs a batch-1 step is ~1.4 ms, about eight times faster (the
# target was 2x). From there the graphed step grows with the batch because the KV cache read grows (at batch 256
# x 512 tokens that is 15 GB per step), and at batch 256 eager and graph come within 2x: the GPU is busy for most
# of the step either way, so launch overhead hides behind it.
#
# The remaining ~1.4 ms at batch 1 is still ~3.5x the 0.4 ms weight-read floor. Inside a graph each of the ~310
# kernels still costs at least ~2-3 µs of GPU time (launch latency and tail of tiny kernels), which is why
# fusing kernels matters even with graphs: merging Qwen3's two QK-norms and RoPE into one Triton kernel and the
# K and V stores into another (`minisgl_ref/perf/triton_ops.py`) took 56 kernels out of each step and batch-1
# decode from 1.62 to 1.40 ms (measured in two runs; the earlier numbers are kept in
# `docs/data/gpu_offline_h100.json`).

# %% [markdown]
# ## 6. The other per-token costs
#
# A CUDA graph removes launch overhead *inside* the forward. What remains per step is host work around it, and
# the element-wise kernels themselves:
#
# | cost | before | after (this chapter) |
# | --- | --- | --- |
# | page-table bookkeeping | the scheduler read one entry of the **GPU** page table per request per step (`int(table[r, i])`: a device sync each) and wrote its new slot with one tiny copy each | a host copy of the page table (`ReqToTokenPool.host`); the runner writes all of a step's new slots to the GPU table with **one scatter** |
# | step inputs | one `torch.tensor(list).to(device)` per field, per-request slices of the page table | one int64 host tensor (ids, positions, slots, rows, lengths, last-token index) in pinned memory, **one** non-blocking H2D copy, then views |
# | sampling state | `SamplingBatchInfo.build` (~10 small H2D copies) every step | reused across decode steps of the same requests: only `steps += 1` on the device (a row filter when some finished) |
# | RMSNorm (+ residual) | 8 kernels per norm | 1 FlashInfer kernel (`fused_add_rmsnorm`, and `rmsnorm` on `[T, heads, d]` views for QK-norm, no copies); chapter 11 later folds the layers' norms into the kernels around them (`perf/norm_folding.py`): none left |
# | SiLU-and-mul | 3 kernels | 1 FlashInfer kernel |
# | RoPE | gather cos/sin, ~10 element-wise kernels, 2 copies | 1 FlashInfer kernel, in place on the q/k views |
# | QK-norm + RoPE, KV store | 2 norm kernels + 1 RoPE kernel; 2 indexing kernels | 1 Triton kernel each, our own (`perf/triton_ops.py`), first in the graphed decode steps; chapter 11 later merges the two into one and runs it in prefill steps too |
# | host syncs per step | one per request (page-table reads) + one for the tokens | **one** (`StepOutput.tokens()`, one step late under overlap, waiting on the step's own copy event) |
#
# The layers reach these ops through the kernel table of chapter 01 (`layers/kernel_table.py`), whose entries are
# the plain PyTorch versions. For an engine on a GPU, `build_runtime` installs the fused ones
# (`perf/kernels.py`: each entry runs its fused kernel on a CUDA tensor in half precision and the plain op on
# anything else), so on the CPU the plain versions run and the chapter-00 oracle tests still compare exact float32
# arithmetic. `tests/test_fused_ops.py` checks each fused kernel against its plain reference on the GPU.
#
# What each change bought on the canonical offline workload (256 requests, H100, full engine; chapter 11 has
# the full table). The history has one row per change, each measured on its own machine as it went in, so read
# it as a trend (the first three rows were each a first run that was still compiling kernels; `docs/data/`
# records how every row was measured); the last three lines are the clean comparison, measured side by side in one
# process: CUDA graphs are worth ~2.2x on this workload and the fused per-token kernels ~24%.

# %%
display(show_table([(f"{h['output_throughput']:,.0f}", h["change"]) for h in GPU.get("history", [])],
                   headers=["output tok/s", "change"]))
print("measured side by side in the final run (canonical workload, default attention backends):")
ladder = {r["label"]: r for r in GPU["ladder"]}
show_table([(f"{ladder[label]['output_throughput']:,.0f}", label)
            for label in ("overlap / fa3+flashinfer (default) / graphs off",
                          "overlap / fa3+flashinfer (default) / graphs on",
                          "overlap / default / graphs on / fused ops off")], headers=["output tok/s", "engine"])

# %% [markdown]
# ## Summary
#
# * **Launches, not bytes.** A decode step of Qwen3-0.6B is about 370 kernel launches at 5-10 µs of CPU each,
#   against 0.4 ms to read its weights: at small batches the GPU waits for the CPU.
# * **Capture a ladder** of batch sizes and pad: a dummy request writes its KV to slot 0 and reads page-table row
#   0, so padding is ordinary data (task 8.1). A replay copies the batch into the static buffers and lets the
#   attention backend refill its metadata in place (task 8.2).
# * **Three backend hooks** (`init_graph_buffers`, `prepare_capture`, `prepare_replay`) keep attention metadata in
#   buffers that never move; the model runner offers each step to a list of graph runners, and the attention
#   planner's choice of backend is also its choice of graphs.
# * **On an H100.** A batch-1 decode step takes about 1.4 ms with graphs against 10-20 ms eager, about eight times
#   faster; at batch 256 the two come within 2x. Fusing QK-norm with RoPE and the K and V stores took 56 kernels
#   out of each step (1.62 to 1.40 ms).
# * **The other per-token costs.** One host-to-device copy and one host sync per step, sampling state reused
#   across decode steps, and fused norm, activation and RoPE kernels installed through the kernel table, while the
#   CPU keeps the plain float32 ops the oracle tests compare.
# * **On the canonical workload,** CUDA graphs are worth about 2.2x and the fused per-token kernels about 24%.
# * **Next.** Chapter 09 runs the graphed engine on several GPUs; chapter 11 adds graphs of extend steps as one
#   more graph runner.

# %% [markdown]
# ## Exercises
#
# 1. **Task 8.1 (capture).** Rewrite both `TASK 8.1` regions of `minisgl_ref/engine/cuda_graph.py`: the ladder
#    in `capture_batch_sizes` and the loop in `CudaGraphRunner.capture`. Grade them with
#    `python -m minisgl_ref.course grade --task 8.1` (on the CPU, with the stand-in graphs of section 2). Then
#    try a ladder of powers of two only (1, 2, 4, ..., 256): how many graphs does it capture, and what is the
#    average share of wasted rows over every batch size from 1 to 256, against the ladder above? At which batch
#    sizes would the extra rows cost real GPU time (hint: the graph step time in section 5 starts to grow with
#    batch)?
# 2. **Task 8.2 (replay).** Rewrite the `TASK 8.2` region of `CudaGraphRunner.replay` and grade it with
#    `python -m minisgl_ref.course grade --task 8.2` (the CPU checks; on a GPU the same command also runs the
#    bitwise replay-vs-eager check). Then replay a batch of 13 requests with `max_bs=16` as in section 3: how
#    many dummy rows, and what does each static buffer hold in them? What does a stand-in replay check, and
#    which mistakes would only a real graph expose (think of host-side values read during the step, and tensors
#    allocated anew)?
# 3. **Padding is data.** Change `DUMMY_ROW["out_cache_loc"]` from 0 to 5 and explain, without a GPU, which
#    real request's KV a padded replay would now overwrite, and why page 0 is the only safe slot. What would go
#    wrong with `"seq_lens": 0` instead of 1, for a kernel that divides by the length or reads the last valid
#    slot? (`python -m pytest -m gpu tests/test_cuda_graph.py` compares graphed and eager greedy tokens on a GPU.)
# 4. **Launch cost from the data.** From `GPU["decode_steps"]` (section 5) compute, per batch size,
#    `(eager_ms - graph_ms) / kernels`, with the 369 kernels per step of section 1. Is the result inside the
#    5-10 µs per launch of the introduction? Why does it shrink at batch 256?
# 5. **Where the kernels are.** Rebuild section 1's model with `num_hidden_layers=14` and count again. Fit
#    `count = a * layers + b`: `a` is the per-layer cost, `b` the per-step constant (embedding, final norm,
#    logits). Which of the two does a CUDA graph remove, and which do the fused kernels of section 6 shrink?

# %% [markdown]
# ## Reproduce
#
# On any machine, the CPU part (sections 1-4) and the CPU tests of tasks 8.1 and 8.2:
#
# ```bash
# python chapters/08_cuda_graphs.py
# python -m minisgl_ref.course grade --chapter 8        # tasks 8.1 and 8.2 (their GPU check is blocked on a CPU)
# python -m pytest tests/test_cuda_graph.py -q          # the GPU tests are skipped without CUDA
# ```
#
# Expected anywhere (deterministic): 35 graphs for a maximum batch of 256 (1, 2, 4, 8, then every multiple of
# 8), a batch of 13 padded to 16 and a batch of 100 to 104; with stand-in graphs, four captures (8, 4, 2, 1, each
# after two warm-ups) and a replay of 5 requests in the graph for 8 that matches the eager step to rounding.
#
# On one H100 (or any CUDA GPU with FlashInfer and FlashAttention-3 installed), from the repository root:
#
# ```bash
# bash scripts/gpu/chapter.sh 08              # GPU tests, step times, canonical run, ladder, profiles
# python -m pytest -m gpu tests/test_cuda_graph.py tests/test_fused_ops.py
# python -m minisgl_ref bench offline                           # the canonical workload, graphs on
# python -m minisgl_ref bench offline --disable-cuda-graph      # the same without graphs
# ```
#
# Expected on an H100 80GB HBM3 (`docs/data/gpu_offline_h100.json`, Qwen3-0.6B config, bf16, dummy weights):
# a decode step at batch 1 and context 512 takes 11.1 ms eager (this part depends on the host CPU) and 1.40 ms
# with graphs (7.9x); at batch 256, 19.3 ms against 9.2 ms (2.1x). On the canonical workload the engine makes
# about 17,800 output tok/s with graphs and 8,200 without.

# %%
print(f"chapter ran in {time.perf_counter() - CHAPTER_START:.1f} s")
