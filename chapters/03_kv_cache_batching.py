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
# # Chapter 03 — KV cache and continuous batching
#
# **What you will build.** The engine that every later chapter makes faster. It keeps each token's keys and
# values in a *KV cache* instead of recomputing them, so a request costs one forward pass over its prompt and
# then one single-token pass per output token. The cache lives in one preallocated *pool* of token slots, handed
# out a *page* at a time and reached through a *page table*, so requests of any length share the memory without
# fragmenting it. And a *scheduler* decides at every step which requests run: new ones join the batch as soon
# as memory allows, finished ones leave at once, and when memory runs out the newest request is sent back to
# wait.
#
# **Why it matters.** Chapter 00 measured the naive loop pushing 34 times more tokens through the model than
# necessary for a 64-token answer, and the ratio grows with the length. The KV cache removes that waste. What it
# costs is memory: on a GPU the KV pool is the resource that decides how many requests can run at once, and the
# whole scheduler is built around not running out of it. The oracle does not change: on CPU in float32, the
# engine of this chapter must give exactly the greedy tokens of chapter 00's loop, whatever the page size, the
# pool size or the order in which requests come and go.
#
# In this chapter you will:
#
# 1. measure why decode needs batching (prefill is compute-bound, decode memory-bound);
# 2. meet the three data structures of the KV cache: `KVPool`, `PageAllocator`, `ReqToTokenPool`;
# 3. draw a live pool: pages coloured by request, a page table pointing into them;
# 4. allocate slots a page at a time (task 3.1) and weigh the page size;
# 5. turn a scheduled step into one flat forward batch (task 3.3) and attend through the page table;
# 6. give memory back without sharing it (the naive cache manager; chapter 04 adds sharing);
# 7. watch continuous batching and retraction (task 3.2) in a real run, step by step;
# 8. check the engine against the oracle, token for token, and measure what it saves.

# %% tags=["setup"]
import os
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import display
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch
from matplotlib.ticker import ScalarFormatter

from minisgl_ref import LLM, SamplingParams
from minisgl_ref.attention.torch_native import TorchNativeBackend
from minisgl_ref.book import show_code, wrap
from minisgl_ref.core.config import EngineConfig
from minisgl_ref.core.forward_batch import ForwardBatch
from minisgl_ref.engine.engine import Engine
from minisgl_ref.engine.model_runner import ModelRunner
from minisgl_ref.kvcache import KVPool, PageAllocator
from minisgl_ref.scheduler.cache_manager import NaiveCacheManager
from minisgl_ref.scheduler.scheduler import Scheduler

CHAPTER_START = time.perf_counter()

# Timings in this chapter use one CPU thread, as in chapters 00-02: on a small shared machine (ours has 2 cores,
# shared with other jobs) two OpenMP threads that wait for each other at every matmul make step times erratic.
# Set MINISGL_THREADS to try more.
torch.set_num_threads(int(os.environ.get("MINISGL_THREADS", "1")))


def record_batches(engine: Engine) -> list:
    """Instrument (not part of the package): keep every step the engine's model runner executes, as
    ``(batch, forward_batch)``: the scheduler's plan (one row per request: prefix and extend lengths, decode flag)
    and the ForwardBatch the runner built from it (returned inside the runner's ``StepOutput``)."""
    log = []
    run = engine.runner.run

    def recording_run(batch):
        out = run(batch)
        log.append((batch, out.forward_batch))
        return out

    engine.runner.run = recording_run
    return log


# %%
# The engine as this chapter builds it. The three switches turn off what the next chapters add: prefix sharing
# (the radix cache, chapter 04), chunked prefill (05) and overlap scheduling (06); with all three off, each
# engine.step() is simply schedule, run, process, and a prompt is always prefilled whole.
CH03 = dict(disable_radix_cache=True, chunked_prefill_size=-1, disable_overlap_schedule=True)

t0 = time.perf_counter()
# Two engines around the same weights file: the chapter-00 oracle, and LLM's paged engine in this chapter's
# configuration. Every other engine in this chapter is built around llm.model, so weights load only twice.
naive = LLM(device="cpu", engine="naive")
llm = LLM(device="cpu", **CH03)
cfg = llm.config
n_params = sum(p.numel() for p in llm.model.parameters())
print(f"loaded two copies of {cfg.architecture} in {time.perf_counter() - t0:.1f} s: {n_params / 1e6:.0f}M parameters,")
print(f"{cfg.num_layers} layers, {cfg.num_kv_heads} KV heads of dim {cfg.head_dim}, {cfg.dtype}")
print(f"paged engine: {type(llm.engine).__name__} with " + ", ".join(f"{k}={getattr(llm.engine.config, k)}"
                                                            for k in ("disable_radix_cache", "chunked_prefill_size")))
print(f"and disable_overlap_schedule={llm.engine.config.disable_overlap_schedule}")
# A first request on each engine, so that one-time costs (allocations, lazy initialisation) stay out of timings.
naive.generate("Hi", SamplingParams(temperature=0, max_new_tokens=2), use_tqdm=False)
_ = llm.generate("Hi", SamplingParams(temperature=0, max_new_tokens=2), use_tqdm=False)

# %% [markdown]
# ## 1. Prefill and decode: why a KV cache, and why batching
#
# Chapter 00's loop fed the *whole* sequence through the model at every step, so producing `N` tokens cost work
# that grows like `N²`. Yet the causal mask guarantees that a token's key and value, in every layer, depend only
# on the token and those before it: once computed, they never change. Keep them, and a request's life splits
# into two phases of very different character:
#
# * **prefill**: one forward pass over the whole prompt (hundreds or thousands of tokens), which writes every
#   prompt token's K and V into the cache and yields the first output token;
# * **decode**: one forward pass per output token that feeds a *single* new token, writes its K and V, and
#   attends to everything in the cache.
#
# Total work becomes linear in the length. But the two phases use the hardware very differently. Every forward
# pass must read every weight of the model once, whatever the number of tokens it processes. With `T` tokens it
# does about `2 × parameters × T` floating-point operations for those `parameters × bytes` it reads: a prefill of
# hundreds of tokens has plenty of arithmetic per byte (it is **compute-bound**), a decode pass of one token
# almost none (it is **memory-bound**: the time goes into reading weights). Let us time one forward pass of `T`
# new tokens on this CPU.

# %%
def forward_cpu_ms(num_tokens: int, reps: int) -> float:
    """Best-of-``reps`` CPU time of one forward pass over ``num_tokens`` new tokens, plus one row of logits."""
    batch = ForwardBatch.for_full_sequences([list(range(1000, 1000 + num_tokens))], naive.engine.backend)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(reps):
            c0 = time.process_time()
            hidden = naive.model(batch.input_ids, batch.positions, batch)
            naive.model.compute_logits(hidden[batch.last_token_indices])
            best = min(best, time.process_time() - c0)
    return best * 1e3


sizes = [1, 4, 16, 64, 256]
fwd_ms = np.array([forward_cpu_ms(n, reps=3 if n <= 16 else 1) for n in sizes])
weight_bytes = n_params * torch.finfo(cfg.dtype).bits // 8
print(f"{'tokens':>6} {'ms / pass':>10} {'ms / token':>10}")
for n, ms in zip(sizes, fwd_ms):
    print(f"{n:>6} {ms:>10.1f} {ms / n:>10.2f}")
print(f"one token: {fwd_ms[0]:.0f} ms to read {weight_bytes / 1e6:.0f} MB of weights = "
      f"{weight_bytes / fwd_ms[0] / 1e6:.1f} GB/s effective")
print(f"{sizes[-1]} tokens cost {fwd_ms[-1] / fwd_ms[0]:.0f}x one token, not {sizes[-1]}x")
assert fwd_ms[-1] / sizes[-1] < fwd_ms[0] / 4  # per token, a big pass is far cheaper than a one-token pass

# %% alt="Two line charts with a log-2 x axis of new tokens in the pass. Left: milliseconds per forward pass, rising slowly for small passes and faster for large ones. Right, on a log y axis: milliseconds per token, falling steeply as the pass grows." caption="Cost of one forward pass on this CPU against the number of new tokens in it: in total and per token." tags=["hide-input"]
fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
axes[0].plot(sizes, fwd_ms, "o-")
axes[0].set_ylabel("CPU ms per forward pass")
axes[0].set_title("a pass costs a fixed part (reading the weights)\nplus a part per token", fontsize=10)
axes[1].plot(sizes, fwd_ms / np.array(sizes), "o-", color="C1")
axes[1].set_ylabel("CPU ms per token")
axes[1].set_yscale("log")
axes[1].yaxis.set_major_formatter(ScalarFormatter())
axes[1].set_title("per token, big passes (prefill, or a batch of\nmany decodes) are far cheaper", fontsize=10)
for ax in axes:
    ax.set_xscale("log", base=2)
    ax.set_xlabel("new tokens in the pass")
fig.tight_layout()
plt.show()

# %% [markdown]
# Figure 3.1 shows it: sixteen tokens cost only about twice as much as one. That is the whole case for **batching
# decode**: one decode step for `B` requests is a forward pass of `B` new tokens, which reads the weights once for all
# of them, so the step takes barely longer than for one request while producing `B` tokens. (Attention is the
# exception: each request reads its own cached K and V, so that part does grow with the batch and with the context.)
#
# On a GPU the gap is much wider. An H100 does about 990 TFLOP/s of dense bf16 math but reads only ~3.35 TB/s
# from its memory (the yardsticks of chapter 11), so a pass is memory-bound until it carries roughly
# `990 / 3.35 ≈ 300` tokens (in bf16 a pass does about one FLOP per weight byte per token). A decode batch needs
# hundreds of requests before the arithmetic units are even busy. And each of those requests holds its KV cache
# in GPU memory the whole time: *memory for the KV cache is what limits the batch*, which is why the rest of this
# chapter is about managing it well.
#
# ## 2. Where the cache lives: three data structures
#
# The KV cache of one token is, for every layer, one key and one value vector per KV head. For our model:

# %%
per_token = KVPool.bytes_per_slot(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype)
print(f"KV per token: 2 (K and V) x {cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x {cfg.head_dim} dims x "
      f"{torch.finfo(cfg.dtype).bits // 8} bytes = {per_token:,} bytes")
pool = llm.engine.kv_pool
print(f"LLM's CPU pool: {llm.engine.max_total_tokens:,} token slots (+ the dummy page) = "
      f"{pool.num_slots * per_token / 2**20:,.0f} MiB, allocated once;")
print(f"per layer K and V are {tuple(pool.k[0].shape)} tensors")
print("for comparison, Qwen3-0.6B in bf16 needs 114,688 bytes per token (chapter 01):")
print(f"10 GiB of KV holds {10 * 2**30 // 114688:,} tokens, e.g. 45 requests of 2,048 tokens")

# %% [markdown]
# An engine cannot allocate a fresh tensor per request per step: allocation is slow, memory fragments, and
# attention kernels want to find a request's K and V from plain integer indices. So the engine allocates one big
# pool up front and manages it itself, with three small structures (all in `minisgl_ref/kvcache/`):
#
# | structure | what it is | shape |
# | --- | --- | --- |
# | `KVPool` (`pool.py`) | per layer, one K and one V buffer; row `s` is token *slot* `s` | `[num_slots, kv_heads, head_dim]` |
# | `PageAllocator` (`allocator.py`) | which *pages* (runs of `page_size` consecutive slots) are free; page 0 is never handed out | a stack of free page ids |
# | `ReqToTokenPool` (`req_to_token.py`) | the *page table*: row `r` belongs to one running request, entry `[r, i]` is the slot of its token `i` | `[max_running_requests + 1, context_len + 1]` int32 |
#
# ```mermaid
# flowchart LR
#     R["Req<br/>req_pool_idx = 1<br/>kv_allocated_len = 6"] --> PT
#     subgraph PT["ReqToTokenPool (page table)"]
#         row1["row 1: 12 13 14 15 | 32 33"]
#     end
#     PT -->|"slot ids"| KV
#     subgraph KV["KVPool, per layer: K and V [num_slots, kv_heads, head_dim]"]
#         p3["page 3: slots 12-15"]
#         p8["page 8: slots 32-35"]
#     end
#     A["PageAllocator<br/>free pages: 4 5 6 7 9 ..."] -.->|"hands out page 8<br/>when token 4 needs a slot"| p8
# ```
#
# Two details of the page table matter. It is **token-granular**: one entry per *token*, not per page. Pages are
# how memory is handed out; the table still says exactly where each token lives, so an attention backend can
# gather a request's keys with one indexing operation, and two requests can share a prefix token by token
# (chapter 04). And **slot 0 is a dummy**: page 0 is never allocated, so a padded batch entry (chapter 08's CUDA
# graphs) can safely write there.
#
# ## 3. A live pool
#
# Let us look at a real pool. We build an engine around the same weights with a small pool (64 slots in pages of
# 4, so that Figure 3.2 fits on a screen), in this chapter's configuration (`CH03`: no prefix sharing, no chunking, no
# overlap). Three requests start together; the third wants only two tokens; after three steps a fourth request
# arrives.

# %%
small = Engine(llm.model, cfg, EngineConfig(page_size=4, max_total_tokens=64, **CH03),
               context_length=llm.context_length)
small_log = record_batches(small)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n)


demo = [llm.make_request(p, greedy(n)) for p, n in [
    ("The capital of France is", 6),
    ("Once upon a time, in a small village by the sea, there lived a", 6),
    ("List three colours:", 2),
]]
for r in demo:
    small.add_request(r)
for step in range(5):
    if step == 3:
        demo.append(llm.make_request("def fibonacci(n):", greedy(6)))
        small.add_request(demo[-1])
    events = small.step()
    print(f"step {step}: " + ", ".join(f"{e.req.rid} +{e.delta!r}" + (" (finished)" if e.finished else "")
                                       for e in events))

print(f"\n{small.allocator.num_pages} pages x {small.allocator.page_size} slots = {small.kv_pool.num_slots} slots; "
      f"free pages now: {small.allocator.num_free_pages} of {small.allocator.capacity_pages}")
for r in demo:
    if r.req_pool_idx is None:
        print(f"{r.rid}: finished, its row and slots are free again")
        continue
    row = small.req_to_token.read(r.req_pool_idx, r.kv_allocated_len)
    print(wrap(f"{r.rid}: page-table row {r.req_pool_idx}, {len(r.all_ids)} tokens, {r.kv_scheduled_len} with K/V "
               f"-> slots {row.tolist()}"))

# %% alt="Grid of the KV pool's slots, one column per page and one row per slot in the page. Page 0 is dark (reserved), free slots are white, and each request's slots have its colour and its token positions; the late request's two pages are out of order." caption="The KV pool after five steps of a small engine: each request's tokens fill whole pages, wherever a page was free." tags=["hide-input"]
def draw_pool(engine: Engine, reqs, ax, title: str) -> None:
    """Slots of the pool, one column per page, coloured by the request whose page-table row points at them."""
    ps, pages = engine.allocator.page_size, engine.allocator.num_pages
    owner = np.full(pages * ps, -1)  # -1 free, -2 dummy page, else request index
    owner[:ps] = -2
    label = {}
    for i, r in enumerate(reqs):
        if r.req_pool_idx is None:
            continue
        slots = engine.req_to_token.read(r.req_pool_idx, r.kv_allocated_len).tolist()
        for pos, s in enumerate(slots):
            owner[s], label[s] = i, str(pos)
        last_page = slots[-1] // ps
        for s in range(last_page * ps, last_page * ps + ps):  # allocated page, slot not used yet
            if owner[s] == -1:
                owner[s] = i
                label[s] = "·"
    colors = ["#444444", "white"] + [plt.cm.tab10(i) for i in range(len(reqs))]
    grid = (owner.reshape(pages, ps).T + 2)
    ax.imshow(grid, cmap=ListedColormap(colors), vmin=0, vmax=len(colors) - 1, aspect="auto")
    for s, text in label.items():
        ax.text(s // ps, s % ps, text, ha="center", va="center", fontsize=7)
    ax.set_xticks(range(pages), [f"p{p}" for p in range(pages)], fontsize=8)
    ax.set_yticks(range(ps), [f"+{i}" for i in range(ps)], fontsize=8)
    ax.set_xticks(np.arange(-0.5, pages), minor=True)
    ax.set_yticks(np.arange(-0.5, ps), minor=True)
    ax.grid(which="minor", color="gray", lw=0.5)
    ax.tick_params(which="minor", length=0)
    ax.set_title(title, fontsize=10)
    handles = [Patch(color=colors[0], label="page 0 (dummy)"), Patch(facecolor="white", edgecolor="gray", label="free")]
    handles += [Patch(color=colors[i + 2], label=r.rid) for i, r in enumerate(reqs) if r.req_pool_idx is not None]
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))


fig, ax = plt.subplots(figsize=(12, 2.4))
draw_pool(small, demo, ax, "KV pool after 5 steps: each cell is a slot, the number is the token's position in "
                           "its request (· = allocated, not written yet)")
fig.tight_layout()
plt.show()

# %% [markdown]
# Read Figure 3.2 column by column. Each request's tokens fill whole pages, in order, but the pages themselves are
# wherever the allocator had one free: the long request crossed into a new page when its 17th token arrived, and the
# late request got exactly the two pages that the short one gave back when it finished (in reverse order: free pages
# are kept on a stack), which is why its first page sits *after* its second. Nothing had to be moved or compacted,
# because nobody needs a request's KV to be contiguous: the page table says where each token is. The only waste is
# the unused tail of each request's last page, at most `page_size - 1` slots.
#
# ## 4. Handing out slots: `alloc_tokens` (task 3.1)
#
# Every step, the scheduler asks the cache manager for slots for each scheduled request's new tokens (the whole
# prompt for a prefill, one token for a decode), and the cache manager asks the allocator. The allocator's job is
# a small calculation: fill what is left of the request's last page, then take fresh pages for the rest. Around
# it sits the free list, a stack of page ids: `alloc_pages` takes pages off its top and `free_slots` pushes the
# pages of a finished request back, each page once however many of its slots the request used. Together they
# are task 3.1.

# %%
display(show_code(PageAllocator.alloc_tokens, task="3.1"))
show_code(PageAllocator.pages_needed)

# %% [markdown]
# `seq_len` is how many tokens the request already has slots for, `last_slot` the slot of the last of them. With
# `seq_len % page_size` slots of the last page used, the next `page_size - used` slots of that page follow
# `last_slot` directly (a page is consecutive slots); whatever does not fit there comes from fresh pages, each
# contributing `page * page_size + 0 .. page_size - 1`. A worked example with pages of 4:

# %%
toy_alloc = PageAllocator(num_pages=8, page_size=4)
a = toy_alloc.alloc_tokens(0, 0, 6)  # a 6-token prompt: two fresh pages, 2 slots of the second stay unused
b = toy_alloc.alloc_tokens(6, int(a[-1]), 1)  # a decode token: fits in the last page, no new page
c = toy_alloc.alloc_tokens(7, int(b[-1]), 3)  # 3 more: 1 fills the page, 2 start a fresh one
print("prompt of 6 ->", a.tolist(), "| decode ->", b.tolist(), "| 3 more ->", c.tolist())
print(f"pages in use: {toy_alloc.capacity_pages - toy_alloc.num_free_pages} "
      f"(for 10 tokens in pages of 4), free: {toy_alloc.num_free_pages}")
all_slots = torch.cat([a, b, c])
assert all_slots.unique().numel() == 10 and (all_slots // 4 != 0).all()  # distinct, never the dummy page
assert b.item() == a[-1].item() + 1 and c[0].item() == b.item() + 1  # the last page is filled before a new one
toy_alloc.free_slots(all_slots)
print("after free_slots:", toy_alloc.num_free_pages, "free pages")
assert toy_alloc.num_free_pages == toy_alloc.capacity_pages

# %% [markdown]
# ### Choosing a page size
#
# With `page_size = 1` (SGLang's default) there is no waste at all and prefix sharing works at the granularity of
# single tokens. Larger pages trade a little memory for other things:
#
# * **waste**: each request leaves on average about `(page_size - 1) / 2` slots of its last page unused;
# * **kernels**: an attention kernel that reads K and V in runs of 16 or 64 consecutive slots makes fewer, larger
#   memory accesses than one that gathers token by token, and some kernels only accept certain page sizes
#   (chapter 07);
# * **sharing**: the radix cache of chapter 04 can share only whole pages, so a shared prefix is rounded down to
#   a multiple of the page size.
#
# How much memory is the waste? Take the final lengths (prompt + output) of the 256 requests of the canonical
# workload shared by the book's benchmarks (chapter 11):

# %%
import random

random.seed(0)
prompt_lens = [random.randint(100, 1024) for _ in range(256)]  # the canonical workload: prompts first ...
output_lens = [random.randint(100, 1024) for _ in range(256)]  # ... then max_tokens, in that order
final_lens = np.array(prompt_lens) + np.array(output_lens)
print(f"{'page_size':>9} {'slots allocated':>15} {'unused':>7} {'waste':>6}")
for ps in [1, 16, 64, 256]:
    allocated = int((-(-final_lens // ps) * ps).sum())
    print(f"{ps:>9} {allocated:>15,} {allocated - final_lens.sum():>7,} {1 - final_lens.sum() / allocated:>6.2%}")

# %% [markdown]
# Under one percent at 16-token pages and a few percent at 64: for requests this long, waste is rarely the deciding
# factor; kernel speed and sharing granularity are. (For short chat turns it matters more.) The rest of this chapter
# uses `page_size = 4` for pictures and `16` for the stress test, and the oracle checks that the answer is the same.
#
# ## 5. One step, one flat batch (task 3.3)
#
# The scheduler describes a step as a `ScheduledBatch` (`minisgl_ref/core/batch.py`): a list of `Row`s, one
# per request, each with `prefix_len` (tokens of the request already in the cache), `extend_len` (new tokens
# this step: the whole prompt for a prefill row, 1 for a decode row) and `is_decode`. The batch is only a plan:
# it never changes once scheduled. The model runner turns it into the `ForwardBatch` of chapter 00, now with two
# more fields:
#
# * `out_cache_loc [T]`: the slot each new token's K and V must be written to, read from the page table;
# * `req_pool_indices [B]`: each request's page-table row, through which attention finds its whole context.
#
# Everything that is the same for all layers is computed **once per step**, here and in the backend's
# `init_forward_metadata`, never once per layer (the model has 30 of them). This is `ModelRunner.prepare`:

# %%
show_code(ModelRunner.prepare, task="3.3")

# %% [markdown]
# Two things to notice. **Positions** restart at each request's `prefix_len`, not at 0: a decode token of a
# 16-token prompt sits at position 16, and its rotary embedding must say so. And **decode rows carry no token id
# from the CPU**: the placeholder `-1` is replaced, on the device, by `token_buffer[req_pool_idx]`, where the
# previous step's sampler left that request's token (`ModelRunner.run` writes it there). Here that looks like a
# detour, since the CPU knows the token too; in chapter 06 the CPU schedules step `N+1` *before* it has seen step
# `N`'s tokens, and this buffer is what makes that possible. The batches the small engine ran above:

# %%
for i, (b, fb) in enumerate(small_log):
    print(f"step {i}: {fb.mode.value:<6} rows {[r.rid for r in b.reqs]}")
    print(f"   prefix_lens {fb.prefix_lens_cpu}  extend_lens {fb.extend_lens_cpu}  req_pool_indices "
          f"{fb.req_pool_indices.tolist()}")
    print(wrap(f"   input_ids {fb.input_ids.tolist()}", indent=" " * 6))
    print(wrap(f"   positions {fb.positions.tolist()}", indent=" " * 6))
    print(wrap(f"   out_cache_loc {fb.out_cache_loc.tolist()}", indent=" " * 6))
    assert fb.positions.numel() == fb.out_cache_loc.numel() == sum(fb.extend_lens_cpu)

# The token buffer holds each running request's newest token: the input of its next decode row.
for r in demo:
    if r.req_pool_idx is not None:
        assert small.runner.token_buffer[r.req_pool_idx].item() == r.output_ids[-1]
print("token_buffer[row] == the last sampled token of every running request: OK")

# %% [markdown]
# Step 3 is worth a second look: only the newcomer ran. The scheduler gives **prefill priority**: when a waiting
# request fits, the step prefills it, and the running requests sit out that step (`enable_mixed_chunk`, chapter
# 05, lets their decode rows ride along instead).
#
# ### Attention through the page table: the paged oracle
#
# The attention backend is where the cache is finally used. `TorchNativeBackend` (`minisgl_ref/attention/
# torch_native.py`) is the paged twin of chapter 00's backend and the reference that chapter 07's fast kernels are
# checked against. Once per step it reads each request's context slots out of the page table; in every layer the
# base class's `forward` first stores the new tokens' K and V at `out_cache_loc` (the same for every backend), then
# the backend gathers each request's full context from the pool and runs the same `reference_attention` (task 0.1)
# as chapter 00:

# %%
display(show_code(TorchNativeBackend.init_forward_metadata))
show_code(TorchNativeBackend.attend_extend)

# %% [markdown]
# The new tokens are written *before* the gather, so they see themselves (and, in a prefill, each other) through
# the causal mask of `reference_attention`, whose queries are the last `extend_len` positions of the context. A
# decode step is just an extend of one token per request, which is why `attend_decode` calls `attend_extend` here.
#
# ## 6. Giving memory back: the naive cache manager
#
# Between the scheduler and these structures sits a **cache manager** (`minisgl_ref/scheduler/cache_manager.py`),
# which the scheduler drives through a few calls: `match` when a request is admitted, `alloc` before each step,
# `commit` after a prefill and `release` when a request finishes or is sent back to wait. The default manager
# shares prefixes between requests through a radix tree (chapter 04). With `disable_radix_cache=True` the
# engine uses the simplest one possible: a request gets an empty page-table row, allocates as it goes, and frees
# every slot it ever had when it ends.

# %%
show_code(NaiveCacheManager)

# %% [markdown]
# Let the small engine finish its requests and check that nothing leaked: every page back on the free stack,
# every page-table row back in the pool.

# %%
small.run_until_done()
for r in demo:
    print(f"{r.rid}: {len(r.output_ids)} tokens, {r.finish_reason.kind}: {r.output_text!r}")
print(f"free pages {small.allocator.num_free_pages}/{small.allocator.capacity_pages}, "
      f"free page-table rows {small.req_to_token.num_free}/{small.req_to_token.max_requests}")
assert small.allocator.num_free_pages == small.allocator.capacity_pages
assert small.req_to_token.num_free == small.req_to_token.max_requests

# %% [markdown]
# ## 7. Continuous batching
#
# A GPU is busy only when the batch is big (section 1), so the engine should run as many requests at once as
# memory allows. The old way, *static* batching, collects a batch, runs it until its *longest* request is done
# and only then starts the next one: short requests leave holes that nobody fills, and newcomers wait for the
# whole batch. **Continuous batching** (first described for LLM serving by the Orca paper, OSDI 2022, as
# iteration-level scheduling) decides the batch anew at *every step*: a request that finishes leaves at once and
# frees its memory, a waiting request joins as soon as it fits.
#
# The scheduler (`minisgl_ref/scheduler/scheduler.py`) keeps a `waiting` queue (admitted, no KV yet) and a
# `running` list (prefilled, decoding). Each step:
#
# ```mermaid
# flowchart LR
#     S(["schedule()"]) --> W{"a waiting<br/>request<br/>fits?"}
#     W -- "yes" --> P["prefill step:<br/>admit waiting requests<br/>in order until one does<br/>not fit (token budget,<br/>slots, free KV minus<br/>reserve)"]
#     W -- no --> D{"running<br/>requests?"}
#     D -- yes --> M{"a slot<br/>for each?"}
#     M -- yes --> DS["decode step:<br/>one token for every<br/>running request"]
#     M -- no --> RT["retract the newest<br/>(free its KV, back<br/>to the front of<br/>waiting)"]
#     RT --> M
#     D -- no --> I(["idle"])
#     P --> RUN["run, then process:<br/>append tokens;<br/>finished requests<br/>free their KV"]
#     DS --> RUN
# ```
#
# **Admission is a bet.** When it admits a request, the scheduler needs slots for the prompt now, but the
# request will keep growing by one slot per output token, up to `max_new_tokens`. Reserving all of that would
# be safe and wasteful (most requests stop early); reserving nothing would overcommit. So admission reserves
# `new_token_ratio` (initially `init_new_token_ratio = 0.7`) of each running request's remaining output, and that
# ratio slowly decays while things go well.
#
# **When the bet loses**, a decode step finds that the pool cannot give every running request one more slot.
# Then it **retracts** the most recently admitted request (a prompt still being prefilled in chunks, chapter 05,
# counts too, and is usually the newest): frees its KV, puts it back at the front of the waiting queue, and
# raises the ratio by 0.1 so the next admissions are more careful. The request keeps the tokens it has generated;
# when it is admitted again its prefill covers prompt *and* output so far, and it continues exactly where it
# stopped (which the oracle below checks). If even a single request cannot grow any more, it is aborted
# with a clear message rather than retried forever. Once every remaining request fits, `CacheManager.alloc_decode`
# gives each its one slot in a single numpy operation, and the rows are appended a list at a time: the same as
# calling `alloc(req, 1)` and `_add_row` per request, which is how you may write it, but that per-request Python
# runs for every running request at every step, and on a GPU it was worth 5% of throughput (chapter 11). One case
# only matters from chapter 06 on: while a step is still running on the device, the KV of a retracted request
# could not be freed before it ends, so instead of retracting the method answers `NEED_SYNC` and the engine
# finishes that step first. Without overlap, as here, that never happens. This is task 3.2:

# %%
display(show_code(Scheduler._add_decode_rows, task="3.2"))
show_code(Scheduler.retract)

# %% [markdown]
# Now a real run, under memory pressure. Six requests with different lengths; four arrive at step 0, one at
# step 3 and one at step 6. The pool holds 112 tokens in pages of 16 (7 pages): enough for three or four of these
# requests at a time, not for all six, and not quite for the four the admission bet lets in. We record every
# step: the rows of the batch, the pages in use and the events `engine.step()` returns.

# %%
WORKLOAD = [  # (prompt, max_new_tokens, arrival step)
    ("The capital of France is", 20, 0),
    ("Once upon a time, in a small village by the sea, there lived a", 24, 0),
    ("def fibonacci(n):", 20, 0),
    ("List three colours:", 12, 0),
    ("My favourite food is", 12, 3),
    ("The three laws of robotics are", 12, 6),
]
PARAMS = [greedy(n) for _, n, _ in WORKLOAD]

tight = Engine(llm.model, cfg, EngineConfig(page_size=16, max_total_tokens=112, **CH03),
               context_length=llm.context_length)
tight_log = record_batches(tight)
tight_reqs = [llm.make_request(p, sp) for (p, _, _), sp in zip(WORKLOAD, PARAMS)]
arrival = {r.rid: a for r, (_, _, a) in zip(tight_reqs, WORKLOAD)}
finished_at, holds_kv, pages_used = {}, [], []
step = 0
w0, c0 = time.perf_counter(), time.process_time()
while step <= max(arrival.values()) or tight.has_work:
    for r in tight_reqs:
        if arrival[r.rid] == step:
            tight.add_request(r)
    for event in tight.step():
        if event.finished:
            finished_at[event.req.rid] = step
    holds_kv.append({r.rid for r in tight_reqs if r.req_pool_idx is not None})
    pages_used.append(tight.allocator.capacity_pages - tight.allocator.num_free_pages)
    step += 1
tight_wall, tight_cpu = time.perf_counter() - w0, time.process_time() - c0
assert len(tight_log) == step  # every step ran a batch
print(f"{step} steps, {tight.scheduler.num_retractions} retraction(s), wall {tight_wall:.1f} s, CPU {tight_cpu:.1f} s")
print(wrap(repr(tight.stats)))
for i, (b, _) in enumerate(tight_log):
    rows = ", ".join(f"{row.req.rid}:"
                     + ("decode" if row.is_decode
                        else ("RE-PREFILL" if row.epoch else "prefill") + f" {row.extend_len}")
                     for row in b.rows)
    if not b.is_decode or i in (1, step - 1) or len(b.rows) != len(tight_log[i - 1][0].rows):
        print(f"step {i:>2} ({pages_used[i]}/7 pages): {rows}")
assert tight.scheduler.num_retractions >= 1

# %% alt="Top: one row per request and one column per engine step, coloured by state (waiting, sitting out, prefill, decode, prefill again after retraction), with arrows at arrivals, an x at the retraction and 'done' at each finish. Bottom: a step line of the pages in use, reaching the dashed pool size of 7." caption="Continuous batching in a pool of 7 pages of 16 tokens: the state of each request at every step, and the pages in use." tags=["hide-input"]
STATES = ["waiting (no KV)", "running, sits out this step", "prefill", "decode", "prefill again after retraction"]
state_colors = ["#e8e8e8", "#bcd7ef", "#ff9f1c", "#1f77b4", "#d62728"]
grid = np.full((len(tight_reqs), step), np.nan)
for i, (b, _) in enumerate(tight_log):
    in_batch = {row.req.rid: (row.is_decode, row.epoch) for row in b.rows}
    for j, r in enumerate(tight_reqs):
        if i < arrival[r.rid] or i > finished_at[r.rid]:
            continue
        if r.rid in in_batch:
            is_decode, epoch = in_batch[r.rid]
            grid[j, i] = 3 if is_decode else (4 if epoch else 2)
        else:
            grid[j, i] = 1 if r.rid in holds_kv[i] else 0

fig, (ax, ax2) = plt.subplots(2, 1, figsize=(12, 4.8), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
ax.imshow(grid, cmap=ListedColormap(state_colors), vmin=0, vmax=4, aspect="auto", interpolation="nearest")
for j, r in enumerate(tight_reqs):
    ax.plot(arrival[r.rid] - 0.5, j, ">", color="black", ms=5)
    ax.text(finished_at[r.rid] + 0.6, j, "done", va="center", fontsize=7)
    for i in range(1, step):  # a retraction: held KV after step i-1, holds none after step i, not finished
        if r.rid in holds_kv[i - 1] and r.rid not in holds_kv[i] and finished_at[r.rid] != i:
            ax.plot(i, j, "x", color="black", ms=9, mew=2)
ax.set_yticks(range(len(tight_reqs)), [f"{r.rid} ({len(r.input_ids)}+{r.params.max_new_tokens})" for r in tight_reqs],
              fontsize=8)
ax.set_title("continuous batching, pool of 7 pages x 16 tokens: ▶ arrival, x retraction", fontsize=10)
ax.legend(handles=[Patch(color=c, label=s) for s, c in zip(STATES, state_colors)], fontsize=8,
          loc="upper left", bbox_to_anchor=(1.0, 1.0))
ax2.step(range(step), pages_used, where="mid", label="pages in use after the step")
ax2.axhline(tight.allocator.capacity_pages, color="gray", ls="--", label="pool size")
ax2.set_ylim(0, tight.allocator.capacity_pages + 1)
ax2.set_xlabel("engine step")
ax2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
fig.tight_layout()
plt.show()

# %% [markdown]
# Everything this section described happens in Figure 3.3:
#
# * Three requests start at step 0; the fourth (`List three colours:`) has arrived but must **wait**: with the
#   reserve for the others' future tokens, the pool has no room for it yet.
# * It is admitted in step 10, once the pool can afford it, while the others sit out that prefill step.
# * In step 18 the long request needs its third page and all 7 are taken: the newest request, the fourth, is
#   **retracted** (x), and its page goes to the long one.
# * When two of the first three finish (step 20), the retracted request comes back with a **prefill of its prompt
#   plus the tokens it had already generated** (red), together with the request that arrived at step 3; the last
#   one joins when there is room again.
# * Requests join and leave at every step; the batch size changes all the time, and the pool stays nearly full,
#   which is the point.
#
# The cost of a retraction is the recomputation of the retracted request's tokens (its red cell). Whether the
# result is still right is the question of the next section.
#
# ## 8. The oracle check, and what the cache saves
#
# The engine is right if it produces, on CPU in float32, exactly the greedy tokens of chapter 00's loop. We run
# the same six requests three ways: the naive oracle, all at once; `LLM`'s paged engine, all at once (page size 1
# and a 16,384-token pool, in this chapter's configuration: the later chapters switch on prefix sharing,
# chunking and overlap, and check the same oracle); and the tight run above, with pages of 16, staggered
# arrivals and a retraction.

# %%
prompts = [p for p, _, _ in WORKLOAD]
w0, c0 = time.perf_counter(), time.process_time()
oracle = naive.generate(prompts, PARAMS, use_tqdm=False)
naive_wall, naive_cpu = time.perf_counter() - w0, time.process_time() - c0

stats_before = llm.engine.stats.prefill_tokens + llm.engine.stats.decode_tokens
w0, c0 = time.perf_counter(), time.process_time()
paged = llm.generate(prompts, PARAMS, use_tqdm=False)
paged_wall, paged_cpu = time.perf_counter() - w0, time.process_time() - c0
paged_tokens = llm.engine.stats.prefill_tokens + llm.engine.stats.decode_tokens - stats_before

n_out = sum(len(o.output_ids) for o in oracle)
agree_paged = sum(o.output_ids == p.output_ids for o, p in zip(oracle, paged))
agree_tight = sum(o.output_ids == r.output_ids for o, r in zip(oracle, tight_reqs))
for o, p, r in zip(oracle, paged, tight_reqs):
    text = repr(o.text) if len(repr(o.text)) <= 55 else repr(o.text)[:53] + " …"  # the text's start, spaces kept
    print(f"{o.prompt_tokens:>2}+{o.completion_tokens:<2} paged {'==' if o.output_ids == p.output_ids else '!='} "
          f"naive, tight {'==' if o.output_ids == r.output_ids else '!='} naive  {text}")
print(f"identical greedy outputs: paged {agree_paged}/{len(oracle)}, "
      f"page 16 + 112-token pool + retraction {agree_tight}/{len(oracle)}")
assert agree_paged == agree_tight == len(oracle), "the paged engine disagrees with the naive oracle"
assert all(o.finish_reason == p.finish_reason == r.finish_reason.kind for o, p, r in zip(oracle, paged, tight_reqs))

# %% [markdown]
# Identical, including the retracted request: after losing its cache it recomputed its prompt and its first
# tokens in one prefill and carried on with exactly the tokens it would have produced anyway.
#
# Now the speed. Both runs above generated the same tokens; how many tokens did each push through the model, and
# how long did it take? (The naive count is exact: each of its steps feeds every unfinished sequence whole.)

# %%
naive_tokens = sum(o.prompt_tokens * o.completion_tokens + o.completion_tokens * (o.completion_tokens - 1) // 2
                   for o in oracle)
print(f"{len(oracle)} requests, {n_out} output tokens")
print(f"naive oracle : {naive_tokens:>5} tokens through the model, wall {naive_wall:5.1f} s "
      f"({n_out / naive_wall:5.1f} tok/s), CPU {naive_cpu:5.1f} s ({n_out / naive_cpu:5.1f} tok/s)")
print(f"paged engine : {paged_tokens:>5} tokens through the model, wall {paged_wall:5.1f} s "
      f"({n_out / paged_wall:5.1f} tok/s), CPU {paged_cpu:5.1f} s ({n_out / paged_cpu:5.1f} tok/s)")
print(f"speedup {naive_wall / paged_wall:.1f}x wall, {naive_cpu / paged_cpu:.1f}x CPU, from computing "
      f"{naive_tokens / paged_tokens:.1f}x fewer tokens")
print("tight run (page 16, 112-token pool, staggered arrivals, 1 retraction):")
print(f"    {tight.stats.prefill_tokens + tight.stats.decode_tokens} tokens in {len(tight_log)} steps, "
      f"CPU {tight_cpu:.1f} s ({n_out / tight_cpu:.1f} tok/s)")
assert naive_cpu > paged_cpu

# %% [markdown]
# The paged engine computes every token once: the prompts in one prefill step, then one token per request per
# step. The naive loop recomputes every sequence at every step; here, with short prompts and at most 24 new
# tokens, that is already several times more tokens and a clear difference in time. The time ratio is smaller
# than the token ratio for the reason section 1 measured: a pass has a fixed cost, and the paged engine runs as
# many passes as the naive one (one per output token) — it just makes each of them small. Both ratios grow with
# the length of the requests; at the thousand-token prompts of real workloads, the naive loop is not an option.

# %% [markdown]
# ## Summary
#
# * **A KV cache.** Prefill computes a prompt's keys and values once; each decode step feeds one token per request
#   and reads the rest from the cache. Work becomes linear in the length, removing chapter 00's 34-fold waste for
#   a 64-token answer.
# * **Why batch.** A forward pass reads every weight whatever it carries: on this CPU sixteen tokens cost only
#   about twice as much as one, and an H100 stays memory-bound up to roughly 300 tokens a pass. The batch is
#   limited by the memory for its KV.
# * **Three structures.** `KVPool` (slots), `PageAllocator` (free pages on a stack, page 0 never handed out) and
#   `ReqToTokenPool` (a token-granular page table); `alloc_tokens` fills a request's last page, then takes fresh
#   ones (task 3.1). At 16-token pages the waste is under one percent of the canonical workload.
# * **One flat step.** `ModelRunner.prepare` turns a `ScheduledBatch` into a `ForwardBatch` with each new token's
#   slot and each request's page-table row; decode tokens come from a token buffer on the device (task 3.3).
#   `TorchNativeBackend` attends through the page table and is the reference for later kernels.
# * **Continuous batching.** Requests join as soon as the pool can hold their prompt plus a reserve
#   (`new_token_ratio`, from 0.7) for their future tokens, and leave the moment they finish; when the bet loses,
#   the newest request is retracted and later resumes with a prefill of its prompt and output so far (task 3.2).
# * **The oracle.** The same greedy tokens as chapter 00's loop, at page sizes 1 and 16, with staggered arrivals
#   and a retraction.
# * **Next.** The cache manager is where chapter 04 plugs in a radix tree, so that requests with a common prefix
#   share its KV.

# %% [markdown]
# ## Exercises
#
# 1. **Task 3.1.** Write `PageAllocator.alloc_pages`, `alloc_tokens` and `free_slots` yourself. Edge cases:
#    `new_tokens = 0`, a last page that is exactly full, a request that fits entirely in its last page, a page
#    named by several slots in one free. Grade it with `python -m minisgl_ref.course grade --task 3.1`.
# 2. **Task 3.3.** Write `ModelRunner.prepare`. Then break it on purpose: give decode rows position `0`, or take
#    `out_cache_loc` from the start of the page-table row instead of from `prefix_len`. Which of the two does the
#    oracle of section 8 catch, and why does the other one go unnoticed on a *single* step? Grade it with
#    `python -m minisgl_ref.course grade --task 3.3`.
# 3. **Task 3.2.** Write `Scheduler._add_decode_rows`. What would go wrong if it retracted the *oldest* request
#    instead of the newest? (Think about how much work is thrown away, and about a request that is retracted
#    again and again.) Grade it with `python -m minisgl_ref.course grade --task 3.2`, and the whole chapter with
#    `python -m minisgl_ref.course grade --chapter 3`.
# 4. **Measure.** Rerun section 7 with `max_total_tokens=96`, and then with `init_new_token_ratio=0.3`. How many
#    retractions, how many steps, how many recomputed tokens? Is the output still identical to the oracle?

# %% [markdown]
# ## Reproduce
#
# ```bash
# python chapters/03_kv_cache_batching.py                 # this chapter, end to end
# ./minisgl generate --raw --max-new-tokens 24 --page-size 16 --disable-radix-cache \
#     "Once upon a time, in a small village by the sea, there lived a"   # the paged engine from the CLI
# ./minisgl generate --raw --max-new-tokens 24 --engine naive \
#     "Once upon a time, in a small village by the sea, there lived a"   # the same tokens, from the oracle
# python -m minisgl_ref.course grade --chapter 3          # the tests of tasks 3.1-3.3
# python -m pytest tests/test_engine_core.py tests/test_kvcache_properties.py -q   # and every engine configuration
# ```
#
# Measured on a 2-core x86_64 CPU (shared with other jobs), no GPU, Python 3.11, torch 2.13 (CPU), one torch
# thread, SmolLM2-135M-Instruct in float32.
#
# | what | measured |
# | --- | --- |
# | one forward pass (+ one row of logits), CPU time | 1 token: 69-88 ms; 256 tokens: 1.11-1.19 s (4.5-4.7 ms per token) |
# | what a one-token pass reads | 538 MB of float32 weights: 6-8 GB/s effective |
# | KV cache per token, SmolLM2-135M float32 | 46,080 bytes (2 x 30 layers x 3 KV heads x 64 x 4 B) |
# | page waste, canonical workload (256 requests) | 0 / 0.65% / 2.58% / 9.33% of slots at page size 1 / 16 / 64 / 256 |
# | oracle: 6 requests, 100 greedy tokens, paged engine (page 1) | 6/6 identical to the naive loop |
# | oracle: same, page 16, 112-token pool, staggered arrivals | 6/6 identical; 1 retraction, 37 steps, 146 tokens computed (11 of them twice) |
# | tokens pushed through the model, same 6 requests | naive 1,626; paged 135 (12.0x fewer) |
# | naive vs paged, same 6 requests, CPU time | 8.5-9.2 s (11-12 tok/s) vs 3.8-4.2 s (24-27 tok/s): 2.1-2.3x |
# | whole chapter, `python chapters/03_kv_cache_batching.py` | 37 s wall on a quiet machine; 70-80 s while other jobs loaded both cores |
#
# Wall-clock times on a shared machine vary from run to run (often 1.5-2.5x the CPU time); CPU times much
# less. The last cell prints this run's numbers.

# %%
print(wrap(f"this run: forward {fwd_ms[0]:.0f} ms (1 token) / {fwd_ms[-1]:.0f} ms ({sizes[-1]} tokens); "
           f"naive {n_out / naive_cpu:.1f} tok/s vs paged {n_out / paged_cpu:.1f} tok/s of CPU time "
           f"({naive_cpu / paged_cpu:.1f}x; wall {naive_wall:.1f} s vs {paged_wall:.1f} s); tokens through the model "
           f"{naive_tokens} vs {paged_tokens}; oracle {agree_paged}/{len(oracle)} and {agree_tight}/{len(oracle)}; "
           f"{tight.scheduler.num_retractions} retraction(s); "
           f"chapter ran in {time.perf_counter() - CHAPTER_START:.0f} s"))
