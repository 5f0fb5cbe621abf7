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
# # Chapter 09 — Tensor parallelism
#
# **What you will build.** One model spread over several devices, Megatron-style: every rank holds a slice of
# every weight matrix, computes with its slice, and the ranks add up their partial results with an
# **all-reduce** twice per decoder layer. Around it, one engine per rank, kept in lock-step: rank 0 receives the
# requests and broadcasts them; every rank schedules exactly the same batches. Two tasks: splitting the attention
# heads (task 9.1, `shard_heads`) and the follower loop that replays rank 0's steps (task 9.2, `TPEngine.follow`).
#
# **Why it matters.** A decode step reads every weight once (chapter 11's roofline). Qwen3-14B in bf16 is 29.6 GB:
# at 4.8 TB/s an H200 needs 6.2 ms just to read it, for every token of every running request batch. Split over two
# GPUs, each reads half, in parallel: the floor drops to 3.1 ms. And a model bigger than one GPU's memory has no
# other way to run. The price is communication: the ranks exchange activations at every layer, and the engine
# must never let the ranks disagree about what to run next, or their collectives stop matching and the group
# hangs.
#
# In this chapter you will:
#
# 1. draw the sharding of one decoder layer and print each rank's weight shapes for Qwen3-14B at tp=2;
# 2. split attention heads, including SmolLM2's 9 heads / 3 KV heads over 2 ranks, and KV heads replicated when
#    there are fewer of them than ranks (task 9.1);
# 3. run two real ranks (processes talking through `torch.distributed`, gloo on this CPU) and check their logits
#    against the unsharded model;
# 4. read the lock-step engine (task 9.2) and check that `LLM(tp_size=2)` gives exactly `LLM()`'s tokens;
# 5. count the bytes every collective moves per step, check the count against the formula, and time it;
# 6. read the GPU results (2 x H200, Qwen3-14B) if they have been measured;
# 7. see two bugs that only two real GPUs showed (a thread on the wrong GPU, a graph that held the communicator)
#    and the start, disconnect storm and shutdown of `serve --tp-size 2` on two H200s.
#
# Modules: `minisgl_ref/layers/linear.py` (column- and row-parallel layers, `shard_heads`),
# `minisgl_ref/layers/embedding.py` (vocabulary-parallel embedding and LM head),
# `minisgl_ref/distributed/` (`parallel_state.py`: the collectives; `group.py`: the process group),
# `minisgl_ref/tp/` (`engine.py`: the lock-step engine; `launch.py`: run a function on every rank),
# `minisgl_ref/models/weights.py` (reading only a rank's slice of a checkpoint).

# %% tags=["setup"]
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from IPython.display import display
from transformers import AutoModelForCausalLM, Qwen3Config
from transformers.utils import logging as hf_logging

from minisgl_ref import LLM, SamplingParams
from minisgl_ref.book import show_code, show_table, wrap
from minisgl_ref.distributed import set_tp_info
from minisgl_ref.layers.linear import shard_heads
from minisgl_ref.models.config import ModelConfig
from minisgl_ref.models.loader import MODEL_REGISTRY, SHIPPED_CONFIGS
from minisgl_ref.tp.engine import TPEngine
from minisgl_ref.tp.launch import call_each, run_on_ranks

CHAPTER_START = time.perf_counter()
hf_logging.disable_progress_bar()
ROOT = Path.cwd() if (Path.cwd() / "minisgl_ref").is_dir() else Path.cwd().parent
sys.path.insert(0, str(ROOT))  # the measurements live beside the engine, in the repository's benchmarks/ folder
from benchmarks.tp import comm_profile, expected_bytes, model_logits, relative_error  # noqa: E402
GPU_RESULTS = ROOT / "docs" / "data" / "tp_bench_h200.json"

# One CPU thread per process, as in the other chapters: here every rank is a process, and two ranks on a small
# shared machine must not fight over its cores. Set MINISGL_THREADS to try more.
torch.set_num_threads(int(os.environ.get("MINISGL_THREADS", "1")))


def shipped(name: str) -> ModelConfig:
    config = ModelConfig.from_file(SHIPPED_CONFIGS / f"{name}.json")
    config.dtype = torch.bfloat16
    return config


def fmt_bytes(n: float) -> str:
    """Decimal units (1 KB = 1000 B), as bandwidths are quoted."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{n:,.0f} B"
        n /= 1000
    return f"{n} B"


print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU thread(s) per process")

# %% [markdown]
# ## 1. The sharding, layer by layer
#
# Chapter 01 introduced the two ways to split a matrix multiply $y = xW^T$ over ranks: **column-parallel** (each
# rank owns some output features, needs all of $x$, no communication) and **row-parallel** (each rank owns some
# input features, produces a partial sum of $y$; an all-reduce adds the partial sums). A decoder layer pairs them
# so that what one column-parallel layer leaves on a rank is exactly what the following row-parallel layer needs:
#
# ```mermaid
# flowchart LR
#     subgraph embed["embedding"]
#         direction TB
#         emb["embed_tokens:<br/>vocabulary-parallel;<br/>rank r looks up ids<br/>in its V/N rows,<br/>zeros elsewhere"]
#         ar0(("all-reduce<br/>T x h"))
#         emb --> ar0
#     end
#     subgraph attn["attention block"]
#         direction TB
#         n1["input_layernorm<br/>(replicated)"]
#         qkv["qkv_proj:<br/>column-parallel;<br/>rank r: its query heads<br/>+ their KV heads"]
#         at["attention over<br/>local heads; the<br/>KV cache holds only<br/>local KV heads"]
#         o["o_proj: row-parallel;<br/>input columns =<br/>rank r's query heads"]
#         ar1(("all-reduce<br/>T x h"))
#         n1 --> qkv --> at --> o --> ar1
#     end
#     subgraph mlp["MLP block"]
#         direction TB
#         n2["post_attention_<br/>layernorm<br/>(replicated)"]
#         gu["gate_up_proj:<br/>column-parallel;<br/>rank r: I/N gate<br/>+ I/N up rows"]
#         act["SiluAndMul,<br/>I/N channels"]
#         d["down_proj:<br/>row-parallel; input<br/>columns = rank r's<br/>I/N channels"]
#         ar2(("all-reduce<br/>T x h"))
#         n2 --> gu --> act --> d --> ar2
#     end
#     subgraph out["LM head"]
#         direction TB
#         head["lm_head:<br/>vocabulary-parallel;<br/>rank r: logits of<br/>its V/N tokens"]
#         ag(("all-gather<br/>B x V/N<br/>per rank"))
#         s["sampler: the same<br/>full logits<br/>on every rank"]
#         head --> ag --> s
#     end
#     embed --> attn --> mlp -- "x L layers" --> out
# ```
#
# Everything between two all-reduces is local: attention works head by head, SiLU-and-multiply channel by
# channel, and the norms act on the full hidden vector, which every rank has after each all-reduce (the norm
# weights are simply replicated). So a forward pass over $T$ tokens costs $2L + 1$ all-reduces of a $T \times h$
# tensor, plus one all-gather of the logits of the $B$ rows that are sampled.
#
# The layers find their rank when they are built (`get_tp_info()`), which lets us build the model *as rank r sees
# it* right here, on PyTorch's `meta` device (shapes only, no memory), even for a 14-billion-parameter model:

# %%
def rank_view(config: ModelConfig, rank: int, size: int) -> torch.nn.Module:
    set_tp_info(rank, size)
    try:
        with torch.device("meta"):
            return MODEL_REGISTRY[config.architecture](config)
    finally:
        set_tp_info(0, 1)


q14 = shipped("qwen3-14b")
views = {(size, rank): rank_view(q14, rank, size) for size, rank in ((1, 0), (2, 0), (2, 1))}
layer = {k: dict(v.named_parameters()) for k, v in views.items()}
names = ["embed_tokens.weight", "layers.0.self_attn.qkv_proj.weight", "layers.0.self_attn.o_proj.weight",
         "layers.0.mlp.gate_up_proj.weight", "layers.0.mlp.down_proj.weight", "layers.0.input_layernorm.weight",
         "lm_head.weight"]
print(f"Qwen3-14B: hidden {q14.hidden_size}, {q14.num_heads} heads / {q14.num_kv_heads} KV heads of "
      f"{q14.head_dim}, MLP {q14.intermediate_size}, vocabulary {q14.vocab_size}, {q14.num_layers} layers\n")
print(f"{'parameter':38s} {'tp=1':>14s} {'tp=2, rank 0':>14s} {'tp=2, rank 1':>14s}")
for n in names:
    print(f"{n:38s} " + " ".join(f"{str(tuple(layer[k][n].shape)):>14s}" for k in views))
param_bytes = {k: sum(p.numel() for p in v.parameters()) * 2 for k, v in views.items()}
print(f"\nweights per rank (bf16): tp=1 {param_bytes[1, 0] / 1e9:.1f} GB; tp=2 {param_bytes[2, 0] / 1e9:.1f} GB "
      f"and {param_bytes[2, 1] / 1e9:.1f} GB")
assert param_bytes[2, 0] == param_bytes[2, 1] and abs(2 * param_bytes[2, 0] - param_bytes[1, 0]) < 1e6

# %% [markdown]
# Each rank holds almost exactly half (the norms, a few KB, are replicated). The fused `qkv_proj` of rank 0 has
# 20 query heads and 4 KV heads: (20 + 2 x 4) x 128 = 3584 rows. The KV cache shrinks the same way: each rank
# stores only its own KV heads, so at tp=2 a token's KV costs each GPU half as many bytes, and the pool holds
# twice as many tokens in the same memory.
#
# **Reading only your slice.** A checkpoint stores full matrices. With tp=8, reading all of every matrix on every
# rank would read the checkpoint eight times. The loaders of the parallel layers only ever call
# `full.narrow(dim, start, length)` on the tensor they are given, so at tp > 1 the checkpoint reader hands them a
# lazy `CheckpointTensor`, whose `narrow` reads just those rows or columns from the file through safetensors'
# `get_slice`:

# %%
from minisgl_ref.models.weights import CheckpointTensor  # noqa: E402

show_code(CheckpointTensor.narrow)

# %% [markdown]
# ## 2. Splitting the heads (task 9.1)
#
# Attention must stay local, so a rank must hold whole **GQA groups**: a KV head together with the query heads
# that read it. Two cases:
#
# * **At least as many KV heads as ranks**: give each rank a contiguous run of KV heads and their query heads.
#   When the KV heads do not divide evenly (SmolLM2-135M has 3 of them), the first ranks take one group more:
#   SmolLM2 at tp=2 puts 6 query heads on rank 0 and 3 on rank 1. Row-parallel `o_proj` then takes exactly the
#   input columns of its rank's query heads (`QKVParallelLinear.q_shard`), so the split need not be even.
# * **Fewer KV heads than ranks**: each KV head is **replicated** on `tp / kv_heads` ranks, which split its query
#   heads. Replicated KV heads cost memory (every copy caches the same K and V) but no communication.
#
# At tp=1 there is nothing to split: `shard_heads` returns the whole model before the split begins, so every
# chapter before this one loads its models without ever running it.

# %%
show_code(shard_heads, task="9.1")

# %%
cases = [("SmolLM2-135M", 9, 3, 2), ("Qwen3-0.6B", 16, 8, 2), ("Qwen3-0.6B", 16, 8, 16), ("Qwen3-14B", 40, 8, 2),
         ("one KV head (MQA)", 8, 1, 4)]
head_rows = []
for model, heads, kv, size in cases:
    shards = [shard_heads(heads, kv, r, size) for r in range(size)]
    desc = ", ".join(f"r{r}: q{s.q_start}-{s.q_start + s.num_q - 1} kv{s.kv_start}-{s.kv_start + s.num_kv - 1}"
                     for r, s in enumerate(shards[:4]))
    more = " ..." if size > 4 else ""
    copies = sum(s.num_kv for s in shards) / kv
    head_rows.append((model, heads, kv, size, desc + more, f"{copies:g}x"))
show_table(head_rows, headers=["model", "heads", "KV heads", "tp", "rank: query heads, KV heads", "KV stored"])

# %% [markdown]
# ## 3. Two real ranks
#
# Now for real processes. `run_on_ranks(fn, 2, ...)` spawns two fresh Python processes, makes them the two ranks
# of a `torch.distributed` process group (the **gloo** backend on a CPU; on GPUs it would be NCCL, one GPU per
# rank), and runs `fn` in each. Here `fn` is `model_logits`: load the model (each rank builds and loads only its
# slices), run a prefill of a few sequences, return the logits. Each rank ends up with the *same* full logits,
# because the LM head all-gathers them. We compare with the unsharded model, in float32, on a small random Qwen3
# (4 heads, 2 KV heads, 2 layers, checkpoint saved the way Hugging Face saves real ones) and on the embedded
# SmolLM2-135M with its uneven head split. (Starting processes is the slow part on a small machine, so while the
# two ranks are up they also run section 5's communication count: `call_each` runs a list of experiments.)

# %%
work = Path(tempfile.mkdtemp(prefix="ch09_"))
tiny_cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, vocab_size=320, max_position_embeddings=512)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(tiny_cfg, dtype=torch.float32).save_pretrained(work / "tiny-qwen3")
tiny = str(work / "tiny-qwen3")
seqs = [[1, 5, 9, 200, 17, 3, 44], [7, 8], list(range(100, 130))]
emb_seqs = [[1, 504, 3000, 17, 9, 42000, 123], [49151, 0, 77]]

t0 = time.perf_counter()
ref = {"tiny Qwen3": model_logits(tiny, "auto", "float32", seqs),
       "SmolLM2-135M": model_logits(None, "auto", "float32", emb_seqs)}
t_ref = time.perf_counter() - t0
t0 = time.perf_counter()
experiments = [(model_logits, (tiny, "auto", "float32", seqs)), (model_logits, (None, "auto", "float32", emb_seqs)),
               (comm_profile, (tiny, "auto", "float32", 64, 8, "cpu"))]  # the last one is for section 5
ranks = run_on_ranks(call_each, 2, experiments)
per_rank = {"tiny Qwen3": [r[0] for r in ranks], "SmolLM2-135M": [r[1] for r in ranks]}
profile = [r[2] for r in ranks]
t_tp = time.perf_counter() - t0
for name, (r0, r1) in per_rank.items():
    err = relative_error(r0, ref[name])
    print(f"{name:13s} logits {tuple(r0.shape)}: rank 0 == rank 1: {torch.equal(r0, r1)}; "
          f"relative error vs tp=1: {err:.1e}")
    assert torch.equal(r0, r1) and err <= 1e-5
print(f"(tp=1 in this process {t_ref:.1f} s; tp=2, two processes started, loaded and run: {t_tp:.1f} s)")

# %% [markdown]
# The error is not zero: a row-parallel layer adds two partial sums of 32 products each, where the unsharded one
# adds 64 products in a different order, and float32 addition is not associative. It is at the level of float32
# rounding (a few 1e-7 for 2 layers, about 2e-6 after SmolLM2's 30), far below anything that could change a token.
#
# ## 4. One engine per rank, in lock-step (task 9.2)
#
# Every rank runs the whole engine of chapters 03-06: a scheduler, a radix cache, a page table, a KV pool with its
# own KV heads. The collectives inside the model make every rank take part in every forward pass, so all ranks
# must run the same batches in the same order. We do not send batches around. Instead:
#
# 1. the scheduler is **deterministic**: the same requests, added at the same moments, give the same batches;
# 2. every rank **samples the same tokens**: the logits are all-gathered, the sampler is seeded per request, and
#    `RankZeroTokens` broadcasts rank 0's tokens anyway (one `[B]` int64 tensor per step), so a rounding
#    difference between ranks can never split their schedulers apart;
# 3. everything else that changes an engine between steps (a new request, an abort, a cache flush) happens only
#    on rank 0, the **leader**, which records it as an *op* and broadcasts the step's ops at the top of its
#    `step()`. The **followers** replay them and step too:

# %%
display(show_code(TPEngine.step))
show_code(TPEngine, task="9.2")

# %% [markdown]
# The ops travel as a pickled Python list over a separate **control group** (gloo, on the CPU, even when the
# model's collectives use NCCL), so that a follower waiting for the next step blocks in a socket read rather than
# in a GPU collective. A step with no news costs one 8-byte broadcast.
#
# Offline, `LLM(tp_size=2)` keeps rank 0 in your process and spawns rank 1; `serve --tp-size 2` starts one
# scheduler process per rank, where only rank 0 reads requests from the tokenizer process and sends results on;
# `python -m minisgl_ref generate --tp-size 2` goes through `LLM`. Across machines the flags are SGLang's: on each
# of two nodes, `--tp-size 16 --nnodes 2 --node-rank {0,1} --dist-init-addr HOST0:PORT`.
#
# A follower that fails (an exception in its loop, a `NotImplementedError` in an unfinished one) cannot tell the
# leader through the broadcast, which only goes from rank 0 outwards, and the leader would otherwise see only
# its own socket closing ("connection closed by peer"). So before it exits, the follower writes its error into
# the process group's key-value store (the one the ranks met through, hosted by rank 0's process), and the
# leader, when a broadcast or a collective fails, reads it and raises `FollowerFailed` with the follower's own
# message.
#
# Greedy, seeded sampling and a stop token, at tp=2 against tp=1:

# %%
prompts = [[3, 14, 15, 92, 65], list(range(40, 90)), [2, 71, 82, 81, 82, 84, 59, 4, 52, 35]]
params = [SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_new_tokens=16, ignore_eos=True),
          SamplingParams(temperature=0, max_new_tokens=16, stop_token_ids=[231, 17], ignore_eos=True)]
expected = LLM(tiny, device="cpu").generate(prompts, params, use_tqdm=False)
t0 = time.perf_counter()
with LLM(tiny, device="cpu", tp_size=2) as llm:
    t_start = time.perf_counter() - t0
    got = llm.generate(prompts, params, use_tqdm=False)
    steps = llm.engine.stats.steps
for e, g in zip(expected, got):
    print(f"tp=1 {e.output_ids} ({e.finish_reason})\ntp=2 {g.output_ids} ({g.finish_reason})")
assert [g.output_ids for g in got] == [e.output_ids for e in expected]
print(f"identical; rank 1 started and loaded in {t_start:.1f} s, {steps} lock-step engine steps")

# %% [markdown]
# ## 5. Communication, counted and measured
#
# Per forward pass over $T$ new tokens with $B$ sampled rows, each rank contributes
#
# * to the all-reduces: $(2L + 1) \cdot T \cdot h \cdot b$ bytes ($b$ bytes per value: 2 in bf16): two per layer and
#   one for the embedding;
# * to the all-gather: $B \cdot \lceil V/N \rceil \cdot b$ bytes of logits;
# * to the broadcasts: the ops (a few bytes, or a prompt's ids when a request arrives) and $8B$ bytes of tokens.
#
# Per token and per layer that is $2hb$: 20 KB for Qwen3-14B. How much actually crosses the wire depends on the
# algorithm: a ring all-reduce over $N$ ranks sends $2(N-1)/N$ times the tensor from every rank (once for the
# reduce-scatter half, once for the all-gather half), i.e. exactly the tensor's size at $N = 2$.

# %%
print(f"{'model':14s} {'bytes all-reduced per token':>28s} {'decode step, batch 64':>22s} {'all-reduces / pass':>19s}")
for name in ("qwen3-0.6b", "qwen3-14b", "llama-3.1-8b"):
    c = shipped(name)
    per_token = expected_bytes(c.hidden_size, c.num_layers, c.vocab_size, 2, 1, 0, 2)["all_reduce"]
    step = expected_bytes(c.hidden_size, c.num_layers, c.vocab_size, 2, 64, 64, 2)
    print(f"{name:14s} {fmt_bytes(per_token):>28s} {fmt_bytes(step['all_reduce'] + step['all_gather']):>22s} "
          f"{2 * c.num_layers + 1:>19d}")

# %% [markdown]
# At batch 64 a Qwen3-14B decode step moves about 63 MB per rank (53 MB all-reduced, 10 MB of logits gathered):
# over NVLink (about 450 GB/s each way on an H200) that is about 0.15 ms of transfer. The cost that matters at
# small batches is *latency*: 81 all-reduces per step at roughly 10-20 µs each is 1-2 ms, against the 3.1 ms it
# takes each H200 to read its half of the weights. That is why tensor parallelism helps decode less than the halved
# weight reads promise, and why real engines fuse the all-reduce with the next norm, or use custom one-shot all-
# reduce kernels for small tensors.
#
# Now measured on this CPU: `comm_profile` (run on both ranks in section 3) counts the collectives from the
# outside (`count_communication` in `benchmarks/tp.py` stands in for `torch.distributed` inside `parallel_state.py`
# while it runs, so the collectives themselves carry no measuring code), runs one prefill pass of 64 tokens and one
# decode-shaped pass of 8 rows on each rank, and reports the bytes, the calls and the time spent inside them. The byte counts must equal
# the formula:

# %%
c = profile[0]
print(f"tiny Qwen3 (h={c['hidden_size']}, L={c['num_layers']}, V={c['vocab_size']}), float32, tp=2, gloo:")
print(f"{'pass':8s} {'tokens':>6s} {'all-reduce':>22s} {'all-gather':>18s} {'broadcast':>10s} "
      f"{'time in collectives':>20s} {'forward':>9s}")
for name in ("prefill", "decode"):
    run = c[name]
    exp = expected_bytes(c["hidden_size"], c["num_layers"], c["vocab_size"], c["dtype_bytes"], run["tokens"],
                         run["rows"], 2)
    assert run["bytes"]["all_reduce"] == exp["all_reduce"] and run["bytes"]["all_gather"] == exp["all_gather"]
    comm_s = sum(run["seconds"].values())
    print(f"{name:8s} {run['tokens']:>6d} "
          f"{run['calls']['all_reduce']:>3d} x = {fmt_bytes(run['bytes']['all_reduce']):>12s} "
          f"{run['calls']['all_gather']:>3d} x = {fmt_bytes(run['bytes']['all_gather']):>9s} "
          f"{run['calls'].get('broadcast', 0):>10d} {comm_s * 1e3:>17.2f} ms {run['forward_s'] * 1e3:>6.2f} ms")
print("byte counts match (2L+1) T h b and B ceil(V/N) b exactly")

# %% [markdown]
# On a CPU a gloo collective between two processes costs tens of microseconds even for a few KB (a round trip
# through the kernel's loopback), so for a model this small the collectives take a large share of the pass: tensor
# parallelism only pays when each rank's share of the work is much bigger than the cost of talking. (The engine
# broadcast of sampled tokens does not appear above: `comm_profile` runs the model without the engine.)
#
# ## 6. On two H200 GPUs
#
# `scripts/gpu/measure/tp_bench.sh` runs on a machine with two H200s (NVLink, NCCL with NVLink multicast off) and writes
# one JSON file, committed as `docs/data/tp_bench_h200.json`: the check of tp=2 against tp=1 in bf16 (a small
# Qwen3, dummy weights), the decode step time at batch 1 and 64, and the canonical offline workload (chapter 11)
# on a Qwen3-14B config with dummy weights, at tp=1 and tp=2. The numbers are read here, not measured again.

# %% alt="Grouped bar chart of milliseconds per decode step at batch 1 and batch 64, a tp=1 bar and a tp=2 bar for each: about 12 against 10 ms at batch 1 and 16 against 13 ms at batch 64, so two GPUs shorten a step by only about a fifth." caption="Decode step time of Qwen3-14B on H200 GPUs, on one GPU (tp=1) and split over two (tp=2), at batch 1 and 64."
if GPU_RESULTS.is_file():
    gpu = json.loads(GPU_RESULTS.read_text())
    prov = gpu.get("provenance", {})
    hw = prov.get("hardware", {})
    sw = prov.get("software", {})
    print(f"measured on {len(hw.get('gpus') or [])} x {hw.get('gpu')} (driver {hw.get('nvidia_driver')}), torch "
          f"{sw.get('torch')}, {prov.get('date')}, commit {str(sw.get('git_commit'))[:10]}")
    check = gpu.get("tp_check", {})
    if check and not check.get("missing"):
        print(f"check ({check.get('model')}, {check.get('dtype')}): logits relative error "
              f"{check.get('logits_rel_err_norm', float('nan')):.2e} (norm; tolerance {check.get('tolerance')}), "
              f"worst element {check.get('logits_rel_err_max', float('nan')):.2e}, greedy "
              f"tokens identical: {check.get('greedy_identical')}, common prefixes {check.get('greedy_common_prefix')}")
        if "tp1_vs_float32" in check:
            print(f"       distance from float32 logits: tp=1 {check['tp1_vs_float32']:.2e}, tp=2 "
                  f"{check.get('tp2_vs_float32', float('nan')):.2e} (bf16 rounding noise, for scale)")
    rows = []
    for tp, key in ((1, "tp1_run"), (2, "tp2_run"), (2, "tp2_run_eager")):  # eager: the retry without CUDA graphs
        run = gpu.get(key, {})
        for d in run.get("decode", []):
            rows.append((tp, f"decode step, batch {d['batch_size']}", f"{d['step_s'] * 1e3:.2f} ms"))
        canon = run.get("canonical")
        if canon:
            rows.append((tp, f"canonical workload ({canon['requests']} requests)",
                         f"{canon['output_throughput']:,.0f} tok/s ({canon['wall_s']:.1f} s)"))
    for tp, what, value in rows:
        print(f"tp={tp}  {what:40s} {value}")
    comm = gpu.get("tp_comm", {}).get("ranks")
    if comm:
        c0 = comm[0]
        for name in ("prefill", "decode"):
            run = c0[name]
            print(f"tp=2  one {name} pass ({run['tokens']} tokens): {run['calls']['all_reduce']} all-reduces of "
                  f"{fmt_bytes(run['bytes']['all_reduce'])} in total took {run['seconds']['all_reduce'] * 1e3:.2f} ms "
                  f"of a {run['forward_s'] * 1e3:.2f} ms pass (each collective timed alone, with syncs)")
    decode = {tp: {d["batch_size"]: d["step_s"] for d in gpu.get(f"tp{tp}_run", {}).get("decode", [])} for tp in (1, 2)}
    if decode[1] and decode[2]:
        import matplotlib.pyplot as plt

        sizes = sorted(set(decode[1]) & set(decode[2]))
        fig, ax = plt.subplots(figsize=(6, 3))
        width = 0.35
        for i, tp in enumerate((1, 2)):
            ax.bar([x + (i - 0.5) * width for x in range(len(sizes))], [decode[tp][b] * 1e3 for b in sizes], width,
                   label=f"tp={tp}")
        ax.set_xticks(range(len(sizes)), [f"batch {b}" for b in sizes])
        ax.set_ylabel("ms per decode step")
        ax.set_title("Qwen3-14B (bf16, dummy weights), H200")
        ax.legend()
        plt.tight_layout()
        plt.show()
    print("both runs: FA3 attention and plain element-wise ops (MINISGL_FUSED=0), the same settings at tp=1 and "
          f"tp=2; {GPU_RESULTS.relative_to(ROOT)} records how each number was measured")
else:
    print(f"not measured yet: {GPU_RESULTS.relative_to(ROOT)} does not exist. Run scripts/gpu/chapter.sh 09 on a "
          "machine with two GPUs and commit its tp_bench.json there.")

# %% [markdown]
# How to read it. Figure 9.1 shows the decode steps: two GPUs make a step only about a fifth shorter, at batch 1
# as at batch 64.
#
# **Correctness:** in bf16 the tp=2 logits are exactly as far from float32 as the tp=1 logits
# (1.39e-2 against 1.38e-2): splitting the matmuls and summing partial results in a different order adds nothing
# beyond bf16's own rounding. Greedy tokens then agree until the first near-tie of two logits, where either
# rounding may win; random weights make near-ties common (two of three prompts agree for all 32 tokens, the third
# for 7). On the CPU, in float32, the same comparison is exact (section 4).
#
# **Speed:** two GPUs make the canonical workload 1.36x faster (5,400 against 4,000 tok/s) and a decode step
# 1.2x faster at batch 1 and 64, far from 2x. Each rank reads half the weights and half the KV, but a decode step
# of Qwen3-14B also pays 81 all-reduces (2 per layer + the LM head's gather) of a few kilobytes each, whose cost is
# latency, not bandwidth (exercise 5); and with half the weights per GPU each rank's matmuls are smaller and less
# efficient. Tensor parallelism buys memory first (the KV pool grows from 594k to 681k tokens per GPU, 1.36M in
# all) and speed second.
#
# **Shutting down** taught a lesson of its own. On the CPU the leader stopped its followers, waited for them to
# exit, then left the process group. On two GPUs that hung for the 30 s join time-out: NCCL's teardown waits for
# every rank of the communicator, so the follower sat in its teardown waiting for the leader, which was waiting
# for the follower. Now every rank drops its CUDA graphs (their captured all-reduces use the communicator),
# synchronises, and leaves the group before anyone joins anyone (`TPGroup.close` and `TPGroup.leave` in `tp/group.py`).
#
# ## 7. Starting and stopping, as a user does
#
# Two more bugs only showed when two GPUs ran the engine the way a user runs it, and both are instructive.
#
# **A thread starts on GPU 0.** Start-up compiles its kernels in a pool of threads (chapter 11), and PyTorch's
# "current device" belongs to a thread: rank 0 had set `cuda:0` and rank 1 `cuda:1`, but the pool's threads of
# *both* ranks started on GPU 0. Rank 1's sampler compile then launched a Triton kernel on GPU 0 with pointers into
# GPU 1, which Triton refused ("cannot be accessed from Triton"), so that kernel compiled later inside a timed
# step, and rank 1 had made a CUDA context on the wrong GPU for nothing. Each compile job now runs inside
# `torch.cuda.device(device)` (`engine/warmup.py`), and both ranks' logs say what they compiled.
#
# **A graph holds the communicator.** The leader's shutdown dropped the decode CUDA graphs before leaving the group,
# but the engine also captures graphs of extend steps (chapter 08), and those captured all-reduces too. NCCL keeps
# a communicator alive while any graph that used it exists, so destroying it waited for ever: the check above
# finished its work and then never exited. The model runner now keeps every set of graphs in one list of graph
# runners (decode, a cascade's decode, extend: `engine/graphs.py`), `ModelRunner.release_graphs` drops the list,
# and a test checks that nothing of the runner still refers to one afterwards.
#
# The cell below reads `docs/data/parallel_serving_h200.json`, written by `scripts/gpu/measure/parallel_serving.py` on two
# H200s: the check as a process (how long it lives after its result), `serve --tp-size 2` with a storm of clients
# that disconnect mid-stream, and SIGTERM to a server and to an offline `LLM(tp_size=2)` in the middle of work.

# %%
PARALLEL_RESULTS = ROOT / "docs" / "data" / "parallel_serving_h200.json"
if PARALLEL_RESULTS.is_file():
    runs = json.loads(PARALLEL_RESULTS.read_text())["runs"]
    phases = {name: (run, phase) for run in runs for name, phase in run["phases"].items()
              if "error" not in phase and not phase.get("check", {}).get("killed")}
    if "tp_exit" in phases:
        run, ph = phases["tp_exit"]
        c = ph["check"]
        print(wrap(f"{run['provenance']['gpus'][0].split(',')[0]} x {len(run['provenance']['gpus'])}, torch "
                   f"{run['provenance']['torch']}: the check wrote its result after {c['result_after_s']:.0f} s and "
                   f"exited {c['exit_after_result_s']:.1f} s later (status {c['exit_code']}); tp=2 shutdown "
                   f"{c['result']['shutdown_s']['tp2']:.2f} s; greedy tokens in common with tp=1: "
                   f"{c['result']['greedy_common_prefix']} of 32; failed start-up compiles: "
                   f"{len(c['compile_failures'])}"))
    if "tp_serve" in phases:
        ph = phases["tp_serve"][1]
        storm, stop = ph["storm"], ph["stop"]
        print(wrap(f"serve --tp-size 2: ready in {ph['ready_s']:.0f} s; the same prompt twice: identical tokens "
                   f"{ph['greedy']['repeat_identical']}, {ph['greedy']['repeat_cached_tokens']} prompt tokens cached; "
                   f"{storm['clients']} clients that leave mid-stream -> nothing left running after "
                   f"{storm['idle_after_s']:.2f} s, /health {ph['after_storm']['health']}, same greedy tokens after: "
                   f"{ph['after_storm']['greedy_again_identical']}; SIGTERM -> all {stop['processes']} processes gone "
                   f"in {stop['all_exited_s']:.1f} s (exit status {stop['exit_code']})"))
        for line in ph["compile_lines"]:
            print(wrap("   " + line[line.index("scheduler"):], indent=" " * 6))
        sigterm = next((r["phases"]["tp_exit"].get("sigterm") for r in runs
                        if r["phases"].get("tp_exit", {}).get("sigterm")), None)
        if sigterm:
            print(wrap(f"offline LLM(tp_size=2), SIGTERM in the middle of generate: all {sigterm['processes']} "
                       f"processes gone in {sigterm['all_exited_s']:.1f} s"))
else:
    print(f"not measured yet: {PARALLEL_RESULTS.relative_to(ROOT)} does not exist")

# %% [markdown]
# ## Summary
#
# * **Sharding.** Column-parallel layers (QKV, gate/up) feed row-parallel ones (o_proj, down), so a forward pass
#   costs `2L + 1` all-reduces plus one all-gather of the sampled rows' logits; each rank reads only its slice of
#   the checkpoint.
# * **Heads in whole GQA groups** (task 9.1). When KV heads do not divide, the first ranks take one group more
#   (SmolLM2 at tp=2: 6 and 3 query heads); with fewer KV heads than ranks, they are replicated.
# * **Two real ranks on the CPU** agree with the unsharded model to float32 rounding (about 2e-6 after SmolLM2's
#   30 layers).
# * **Lock-step engines** (task 9.2). A deterministic scheduler on every rank, rank 0 broadcasting each step's ops
#   and its sampled tokens: `LLM(tp_size=2)` gives exactly `LLM()`'s tokens, and a failing follower's own error
#   reaches the leader.
# * **Communication.** `2hb` bytes per token per layer, 20 KB for Qwen3-14B; at small batches the latency of 81
#   all-reduces per step, not their bytes, is the cost.
# * **On two H200s.** Qwen3-14B's canonical workload runs 1.36x faster (5,400 against 4,000 tok/s) and a decode
#   step 1.2x, far from 2x; the KV pool grows from 594k to 681k tokens per GPU. Tensor parallelism buys memory
#   first and speed second.
# * **Next.** Chapter 10 serves the engine over HTTP, with one scheduler process per rank.

# %% [markdown]
# ## Exercises
#
# 1. **Task 9.1.** Rewrite the split in `shard_heads` (`minisgl_ref/layers/linear.py`) and grade it with
#    `python -m minisgl_ref.course grade --task 9.1` (the head tables first, then the logits of real ranks at
#    tp=2 and tp=4). Why must the first ranks (not the last) take the extra group when the KV heads do not
#    divide, for `RowParallelLinear`'s `shard` to line up? (Hint: it does not matter, as long as `q_shard` follows
#    the same rule. Check that claim by flipping the rule.)
# 2. **Task 9.2.** Rewrite `TPEngine.follow` (`minisgl_ref/tp/engine.py`) and grade it with
#    `python -m minisgl_ref.course grade --task 9.2`. The first checks run a leader and a follower in one process
#    (the follower is fed exactly what the leader broadcast, and must add, abort, flush and step as the leader
#    did); the others start real ranks. Then remove `RankZeroTokens` from `TPEngine.__init__`: do the tests
#    still pass on this CPU? Argue why they would, and name something on a GPU that could make them fail.
# 3. **An op we forgot.** The server's `/flush_cache` empties the radix cache on rank 0. Trace how the followers
#    learn of it. What would happen, several requests later, if they did not?
# 4. **Vocabulary padding.** Qwen3's vocabulary (151,936) divides by 2, 4 and 8, but not by 3. Build
#    `rank_view(shipped("qwen3-0.6b"), r, 3)` for r = 0, 1, 2 and read `VocabParallelEmbedding`: which rows does
#    each rank hold, what is in the rows past the end of the vocabulary, and why must every rank hold the same
#    number of rows for the all-gather? (Qwen3-0.6B's 16 heads do not divide by 3 either: what does
#    `shard_heads` do with its 8 KV heads?)
# 5. **Latency, not bandwidth.** Using the formula of section 5 and a latency of 15 µs per all-reduce, predict the
#    decode step time of Qwen3-14B at tp=2 and batch 1 from the tp=1 time in section 6, and compare with the
#    measured tp=2 time.

# %% [markdown]
# ## Reproduce
#
# ```bash
# python chapters/09_tensor_parallel.py                 # this chapter, end to end, on CPU (gloo, 2 ranks)
# python -m minisgl_ref.course grade --chapter 9        # tasks 9.1 and 9.2, about a minute
# python -m pytest tests/test_tensor_parallel.py        # every test, ~2 min: logits at tp=2/4, LLM, 2 nodes, server
# python -m minisgl_ref generate --tp-size 2 "What is the capital of France?"
# python -m minisgl_ref serve --tp-size 2               # one scheduler process per rank
# # two GPUs with flashinfer-python and FlashAttention-3 installed:
# export NCCL_NVLS_ENABLE=0 && bash scripts/gpu/chapter.sh 09 tp   # scripts/gpu/measure/tp_bench.sh
# NCCL_NVLS_ENABLE=0 bash scripts/gpu/chapter.sh 09 serving      # parallel_serving.py --phases tp_exit,tp_serve
# ```
#
# Measured on a 2-core x86_64 CPU shared with other jobs, no GPU, Python 3.11, torch 2.13 (CPU), one torch
# thread per rank, gloo.
#
# | what | measured |
# | --- | --- |
# | logits at tp=2 vs tp=1, float32: tiny Qwen3 / SmolLM2 (6 + 3 heads) | ranks identical; rel. error 4e-7 / 2e-6 |
# | `LLM(tp_size=2)` vs `LLM()`: greedy, seeded sampling, stop token | identical tokens |
# | bytes per pass counted by wrapping the collectives | equal to $(2L+1)Th b$ and $B\lceil V/N\rceil b$ |
# | tiny Qwen3, gloo, in collectives / whole pass: prefill of 64 tokens | 14-46 / 18-51 ms (load average 6-10) |
# | the same, decode of 8 rows | 10-12 / 16-23 ms |
# | whole chapter, `python chapters/09_tensor_parallel.py` | 47 s (load average ~6) |
#
# Expected on 2 x H200 (`docs/data/tp_bench_h200.json`; Qwen3-14B config, bf16, dummy weights, FA3 attention):
#
# | what | tp=1 | tp=2 |
# | --- | --- | --- |
# | canonical workload (256 requests, 133,966 output tokens), output tok/s | 3,979 (33.7 s) | 5,394 (24.8 s), 1.36x |
# | decode step, batch 1, prompt 256 | 12.1 ms | 9.8 ms |
# | decode step, batch 64, prompt 256 | 15.6 ms | 12.8 ms |
# | tp=2 vs tp=1 logits, Qwen3-0.6B bf16 | | max relative error 1.9e-2 (tolerance 2e-2), ranks identical |
#
# Expected on 2 x H200 (`docs/data/parallel_serving_h200.json`; `NCCL_NVLS_ENABLE=0 python3
# scripts/gpu/measure/parallel_serving.py --out results`; Qwen3-0.6B config, bf16, dummy weights, FlashInfer attention):
#
# | what | measured |
# | --- | --- |
# | the tp=2 check as a process: exit after its result | 1.0 s (status 0); tp=2 greedy tokens equal tp=1 for 32/32/32 |
# | `serve --tp-size 2`: start-up compiles failed, on either rank | none |
# | 64 streaming clients that disconnect at random moments | nothing running 0.04 s later; `/health` 200 |
# | SIGTERM to `serve --tp-size 2` / to an offline `LLM(tp_size=2)` mid-generate | all processes gone in 1.8 s / 1.3 s |

# %%
print(f"chapter ran in {time.perf_counter() - CHAPTER_START:.0f} s")
