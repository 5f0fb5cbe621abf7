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
# # Chapter 06 — Overlap scheduling
#
# **What you will build.** The engine loop that prepares step N+1 on the CPU *while the device is still running
# step N*, and looks at step N's tokens only afterwards: the overlapped step (`Engine._step_overlap`, which
# `Engine.step` runs when overlap is on, the default), the processing of the step in flight one call late
# (`Engine._finish_inflight`), and the frees that wait for that step (`InflightFrees`): together, task 6.1.
#
# **Why it matters.** Every step has a CPU part that is pure Python bookkeeping: choose the batch (chapters
# 03-05), build its metadata, read the sampled tokens back and apply the stop rules. In a plain loop the device
# waits while the CPU does that, at every step. On a GPU a decode step of a small model takes a few
# milliseconds, and the bookkeeping of a large batch takes about as long, so a plain loop can leave the GPU idle
# half of the time. Overlapping the two hides the shorter one behind the longer one.
#
# The price is that the CPU now plans a step without knowing the outcome of the step before it. That opens three
# races, and most of this chapter is about how the code closes them:
#
# 1. a request that finished at step N already has a row in step N+1, which computes **one token too many**;
# 2. the KV slots of a request that finished at step N may **still be written by step N+1**, so they must not be
#    handed to anybody else yet;
# 3. when memory runs out, **retraction** frees KV that the step in flight is using.
#
# In this chapter you will:
#
# 1. measure the CPU work of a step against its forward pass, on this CPU;
# 2. read the overlapped loop, the device-side token buffer and the one host sync per step (task 6.1);
# 3. draw the two timelines, sequential and overlapped, from the measured times, and estimate what overlap would
#    save on a GPU (an estimate: on a CPU nothing overlaps, and we say exactly why);
# 4. watch each of the three races happen, and be defused, in real runs;
# 5. check that overlap on and off both give exactly the chapter-00 oracle's tokens, including requests that
#    stop on EOS, stop strings and stop tokens in the middle of a batch.
#
# Modules: `minisgl_ref/engine/engine.py` (task 6.1, `Engine.step`), `minisgl_ref/engine/model_runner.py` (the
# token buffer, `StepOutput`), `minisgl_ref/kvcache/inflight.py` (task 6.1, `InflightFrees`: frees that wait for
# the step in flight), `minisgl_ref/scheduler/scheduler.py` (`NEED_SYNC`).

# %% tags=["setup"]
import ast
import inspect
import os
import random
import statistics
import tempfile
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.utils import logging as hf_logging

from minisgl_ref import LLM, SamplingParams, book
from minisgl_ref.book import show_code
from minisgl_ref.core.config import EngineConfig
from minisgl_ref.engine.engine import Engine
from minisgl_ref.engine.extension import HOOKS, EngineExtension
from minisgl_ref.engine.model_runner import ModelRunner, StepOutput
from minisgl_ref.kvcache.inflight import InflightFrees
from minisgl_ref.scheduler.scheduler import NeedSync

CHAPTER_START = time.perf_counter()
hf_logging.disable_progress_bar()

# Timings in this chapter use one CPU thread, as in chapters 00-05: on a small shared machine (ours has 2 cores,
# shared with other jobs) two OpenMP threads that wait for each other at every matmul make step times erratic.
# Set MINISGL_THREADS to try more.
torch.set_num_threads(int(os.environ.get("MINISGL_THREADS", "1")))


def wrap(obj, name: str, before=None, after=None) -> None:
    """Instrument (not part of the package): call ``before(*args)`` and ``after(result, *args)`` around the method
    ``name`` of this one object. The chapter uses it to time and to watch the engine without changing it."""
    method = getattr(obj, name)

    def wrapped(*args, **kwargs):
        if before:
            before(*args)
        result = method(*args, **kwargs)
        if after:
            after(result, *args)
        return result

    setattr(obj, name, wrapped)


class StepClock:
    """Instrument: wall-clock time of the CPU-side pieces of every step, and of the model runner's whole run."""

    PARTS = ("schedule", "prepare", "sampling_info", "process", "run")

    def __init__(self, engine: Engine) -> None:
        self.times = {p: [] for p in self.PARTS}
        for obj, method, part in [(engine.scheduler, "schedule", "schedule"), (engine.runner, "prepare", "prepare"),
                                  (engine.runner.sampling, "info", "sampling_info"), (engine, "_process", "process"),
                                  (engine.runner, "run", "run")]:
            self._time(obj, method, part)

    def _time(self, obj, method: str, part: str) -> None:
        start = {}
        wrap(obj, method, before=lambda *a: start.__setitem__(part, time.perf_counter()),
             after=lambda *a: self.times[part].append(time.perf_counter() - start[part]))

    def medians_ms(self) -> dict:
        """Per step: the CPU pieces, and the forward (the runner's run minus the CPU pieces inside it)."""
        t = {p: np.array(v) for p, v in self.times.items()}
        forward = t["run"] - t["prepare"] - t["sampling_info"]
        out = {p: float(np.median(t[p])) * 1e3 for p in ("schedule", "prepare", "sampling_info", "process")}
        out["cpu"] = float(np.median(t["schedule"] + t["prepare"] + t["sampling_info"] + t["process"])) * 1e3
        out["forward"] = float(np.median(forward)) * 1e3
        return out


# %% [markdown]
# ## 1. Where a step's time goes
#
# Two models: the real SmolLM2-135M (embedded, float32) and the tiny random Llama of the tests (2 layers, hidden
# size 64), whose forward is cheap enough that the CPU bookkeeping shows. Both run on this CPU.

# %%
t0 = time.perf_counter()
real = LLM(device="cpu", engine="naive")  # the chapter-00 oracle; the paged engines below share its weights
tiny_dir = tempfile.mkdtemp(prefix="tiny-llama-")
torch.manual_seed(0)
AutoModelForCausalLM.from_config(LlamaConfig(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=320, max_position_embeddings=1024, rms_norm_eps=1e-6), dtype=torch.float32).save_pretrained(tiny_dir)
tiny = LLM(tiny_dir, device="cpu", engine="naive")
print(f"loaded SmolLM2-135M and built the tiny model in {time.perf_counter() - t0:.1f} s")


def make_engine(model_llm: LLM, **kwargs) -> Engine:
    return Engine(model_llm.model, model_llm.config, EngineConfig(**kwargs), device="cpu",
                  context_length=model_llm.context_length)


def decode_clock(model_llm: LLM, batch_size: int, steps: int, prompt_len: int = 32) -> dict:
    """Prefill ``batch_size`` random prompts, then time ``steps`` pure decode steps (overlap off)."""
    engine = make_engine(model_llm, disable_overlap_schedule=True,
                         max_total_tokens=batch_size * (prompt_len + steps + 4))
    gen = random.Random(batch_size)
    params = SamplingParams(temperature=0, max_new_tokens=steps + 2, ignore_eos=True)
    reqs = [model_llm.make_request([gen.randrange(model_llm.config.vocab_size) for _ in range(prompt_len)], params)
            for _ in range(batch_size)]
    for r in reqs:
        engine.add_request(r)
    while not all(r.output_ids for r in reqs):  # prefill steps, not timed
        engine.step()
    clock = StepClock(engine)
    for _ in range(steps):
        engine.step()
    engine.run_until_done()
    return clock.medians_ms()


print(f"{'model':<10} {'batch':>5} | {'schedule':>8} {'prepare':>8} {'sampling':>8} {'process':>8} | "
      f"{'CPU total':>9} {'forward':>9} | CPU share")
clocks = {}
for name, model_llm, sizes, steps in [("SmolLM2", real, (8,), 4), ("tiny", tiny, (1, 16, 64, 256), 6)]:
    for b in sizes:
        m = clocks[name, b] = decode_clock(model_llm, b, steps)
        print(f"{name:<10} {b:>5} | {m['schedule']:>8.2f} {m['prepare']:>8.2f} {m['sampling_info']:>8.2f} "
              f"{m['process']:>8.2f} | {m['cpu']:>9.2f} {m['forward']:>9.2f} | "
              f"{m['cpu'] / (m['cpu'] + m['forward']):>8.0%}")
print("(medians per decode step, in ms)")

# %% [markdown]
# What the columns are: `schedule` is `Scheduler.schedule` (pick the rows, allocate a KV slot for each new token,
# write the page table); `prepare` is `ModelRunner.prepare` (flatten the rows into `[T]` ids, positions and slots,
# chapter 03); `sampling` is `SamplingState.info` (pack every request's sampling parameters into tensors,
# chapter 02, or move the last decode step's tensors one step on: `minisgl_ref/engine/sampling_state.py`);
# `process` is `Engine._process` (read the tokens back, append them, apply the stop rules, release finished
# requests). `forward` is everything else in the model runner: the model, the logits, the sampler.
#
# Two things to take away:
#
# - On a real model on a CPU, the forward dwarfs everything: the bookkeeping is a rounding error. That is why
#   overlap buys nothing on a CPU even in principle.
# - The bookkeeping grows with the batch (Python loops over requests; `schedule` is the biggest: one slot
#   allocation and one page-table write per request per step), and does *not* depend on the model. On a GPU the
#   forward of a decode step shrinks by two or three orders of magnitude; the bookkeeping does not shrink at all.
#
# ## 2. The overlapped loop (task 6.1)
#
# Without overlap a step is strictly sequential: schedule N, run N, wait for N's tokens, process N. With overlap
# the engine launches N+1 *before* it processes N:
#
# ```mermaid
# sequenceDiagram
#     participant CPU as CPU (Engine.step)
#     participant Dev as device
#     Note over CPU,Dev: step() call k
#     CPU->>CPU: schedule(N+1)  (N is still running)
#     CPU->>Dev: launch(N+1): inputs of decode rows come from token_buffer
#     CPU->>Dev: wait for N's tokens (.tolist(): the one sync)
#     Dev-->>CPU: tokens of N
#     CPU->>CPU: process(N): append, stop rules, release finished requests
#     CPU->>CPU: frees.processed(N): give back the slots that waited for N
#     Note over CPU,Dev: step() call k+1
#     CPU->>CPU: schedule(N+2)  (N+1 is still running)
# ```
#
# `Engine.step` runs `_step_sync` without overlap (chapter 03's loop) and `_step_overlap` with it. Here is the
# overlapped step, with `_finish_inflight`, which processes the step in flight one call late: they are the
# engine's part of **task 6.1** (the frees of race 2 below are the rest).

# %%
show_code(Engine.step, task="6.1")

# %% [markdown]
# Processing a step is the same with and without overlap, so `_process` is shared by both loops:

# %%
show_code(Engine._process)

# %% [markdown]
# (The inner loop is for speculative decoding, chapter 13: a row that fed the model a guess of several tokens
# appends the ones the model agreed with, which `row_tokens` names. Every row of this chapter appends exactly the
# one token it sampled.)
#
# Four mechanisms make this possible.
#
# **The device-side token buffer.** Step N+1's decode rows need step N's sampled tokens as input, and the CPU has
# not seen them. It does not need to: `ModelRunner.run` writes every emitted token into `token_buffer[row]` (one
# slot per page-table row, on the device), and `ModelRunner.prepare` puts a placeholder in each decode row's input
# and fills it from that buffer, a device-to-device gather. The CPU knows *which* row each request uses, never
# *what* token is in it:

# %%
show_code(ModelRunner.run)

# %% [markdown]
# **One host sync per step, on the right event.** The only place the CPU waits for the device is the first line
# of `_process`, `out.tokens()`. Everything before it (scheduling, metadata, launching) is work the device can
# run ahead of. *What* it waits for matters as much as how often. The obvious `batch.next_tokens.tolist()` queues
# its device-to-host copy on the stream **behind step N+1**, which was launched a moment earlier; the CPU then
# waits for N+1 to finish before it can process N, and the GPU sits idle while the CPU processes, schedules and
# launches: overlap in name only. So `ModelRunner.run` starts the copy into pinned host memory right after
# sampling and records a CUDA event behind it, and returns both in its result, a `StepOutput`; `out.tokens()`
# waits for that event alone. On an H100 this one line was a quarter of every decode step (chapter 11):

# %%
show_code(StepOutput.tokens)

# %% [markdown]
# **Bookkeeping that runs ahead.** The scheduler updates `kv_scheduled_len` when it *schedules* a row, not when
# the row's tokens come back, and counts tokens sampled but not yet appended in `req.num_inflight`. So at
# schedule time it knows how long each request will be once the step in flight lands. It uses that to skip
# requests that will certainly have reached `max_new_tokens` (the `decodable` filter in `Scheduler.schedule`), and
# the model runner uses it to count the in-flight token in seeded sampling and penalties
# (`SamplingState.info`), so that overlap changes no random stream.
#
# **Sharing that runs ahead.** The radix tree (chapter 04) learns a prompt's tokens when its request *commits*
# them. If that happened in `_process`, it would be one step late under overlap: step N+1 is scheduled before
# step N is processed, so a request admitted to N+1 could not reuse the prefix that step N computes. The engine
# commits a step's prefill rows right after launching it instead:

# %%
show_code(Engine._commit_launched)

# %% [markdown]
# (A row that feeds a guess, chapter 13, is left out: its guessed tokens become the request's only if the model
# agrees with them, once the step has been processed.)

# %% [markdown]
# It is safe because of the order in which steps run: a request that matches those slots is admitted to a later
# step, and every later step runs after this one (on one CUDA stream in launch order; on the CPU synchronously),
# so it reads the KV after it was written. Two subtleties remain, both handled there: the page-table rows of
# this step were already read by `runner.run`, so repointing them at the tree's slots changes nothing for it;
# and duplicate copies (two rows of one step computing the same new prefix, chapter 04) are written *by this
# step*, so their frees wait, like every free, until it has been processed (race 2 below).
#
# What `_process` has to guard against is the rest of this chapter: a row whose request finished (or was
# retracted, which bumps `req.epoch`) after the row was scheduled is skipped, so its token is dropped; a
# partial prefill chunk (chapter 05) emits nothing. (The `prefill_only` branch ends a request that only wanted its
# prompt scored, chapter 10, at its prefill row: the scheduler never gives it a decode row, so overlap computes no
# extra token for it.)
#
# **Where later chapters plug in.** This loop knows nothing of grammars or step traces. Features that later
# chapters add reach into it through a declared seam, `EngineExtension` (`minisgl_ref/engine/extension.py`): a
# few named moments of the loop, each a method whose default does nothing, and an engine calls only the methods
# an extension overrides. Two of them are shaped by overlap. `logits_processor` is asked at launch, with the step
# still in flight: the function it returns runs between the new step's forward pass and its sampling, and may
# wait there for the previous step's tokens while the forward pass is already queued on the device (chapter 12's
# grammar masks need exactly that). The token hooks run inside `_process`, around `req.append_token`, so they see
# each token when the loop appends it, one step late under overlap like everything else there; a hook that
# makes a request's rows in flight obsolete (chapter 12's jump-forward) bumps `req.epoch`, as a retraction does.
# An engine given no extension runs exactly this chapter's loop. The moments, in the order of a step:
#
# %%
for hook in HOOKS:
    print(book.wrap(f"{hook:<17} {inspect.getdoc(getattr(EngineExtension, hook)).splitlines()[0]}", indent=" " * 18))

# %% [markdown]
# ## 3. Two timelines, and what overlap would save
#
# First, the honest part. On a CPU, `ModelRunner.run` does not *launch* work: it computes it, synchronously, on
# the same core that runs the scheduler. There is no second processor to keep busy, so overlap cannot save
# anything here; every code path of the overlapped loop still runs, which is what the tests and section 4 need.
# Measured, alternating the two loops on the same batch:

# %%
def ms_per_step(overlap: bool, batch_size: int = 32, steps: int = 12) -> float:
    engine = make_engine(tiny, disable_overlap_schedule=not overlap)
    gen = random.Random(0)
    params = SamplingParams(temperature=0, max_new_tokens=steps + 4, ignore_eos=True)
    reqs = [tiny.make_request([gen.randrange(320) for _ in range(32)], params) for _ in range(batch_size)]
    for r in reqs:
        engine.add_request(r)
    while not all(r.output_ids for r in reqs):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - t0
    engine.run_until_done()
    return elapsed / steps * 1e3


runs = {False: [], True: []}
for _ in range(3):
    for overlap in (False, True):
        runs[overlap].append(ms_per_step(overlap))
seq_ms, ovl_ms = statistics.median(runs[False]), statistics.median(runs[True])
print(f"tiny model, 32 requests decoding, this CPU: {seq_ms:.1f} ms/step without overlap, {ovl_ms:.1f} ms/step "
      f"with overlap")
print(f"(medians of 3 alternating runs: {[round(x, 1) for x in runs[False]]} vs {[round(x, 1) for x in runs[True]]})")

# %% [markdown]
# The same, within the noise of a shared machine. Now suppose the forward ran on a separate device while the CPU
# carried on. The timelines below are *computed* from the times measured in section 1 (tiny model, 64 requests):
# the CPU pieces as measured, and the forward as measured here, but placed on a device lane. They show what the
# two loops would do with a device that is as slow as this CPU.

# %%
def simulate(cpu_ms: dict, forward_ms: float, n_steps: int, overlap: bool):
    """Gantt bars [(lane, label, start, length)] of n_steps steps, and the steady-state time per step.

    Sequential: schedule, prepare (+ sampling info), launch; the device runs the forward; process once it is done.
    Overlapped: schedule and prepare step N+1 and launch it, then process step N (waiting for N's forward only)."""
    sched, prep, proc = cpu_ms["schedule"], cpu_ms["prepare"] + cpu_ms["sampling_info"], cpu_ms["process"]
    bars, cpu_t, dev_free, ends, pending = [], 0.0, 0.0, [], None
    for n in range(n_steps + (1 if overlap else 0)):
        if n < n_steps:
            bars += [("CPU", f"schedule {n}", cpu_t, sched), ("CPU", f"prepare {n}", cpu_t + sched, prep)]
            cpu_t += sched + prep
            start = max(cpu_t, dev_free)
            bars.append(("device", f"forward {n}", start, forward_ms))
            dev_free = start + forward_ms
        todo = pending if overlap else n  # which step's tokens the CPU processes now
        if todo is not None and todo < n_steps:
            t = max(cpu_t, [b[2] + b[3] for b in bars if b[1] == f"forward {todo}"][0])  # wait for its tokens
            bars.append(("CPU", f"process {todo}", t, proc))
            cpu_t = t + proc
            ends.append(cpu_t)
        pending = n
    return bars, (ends[-1] - ends[0]) / (len(ends) - 1)


measured = clocks["tiny", 64]
timelines = {overlap: simulate(measured, measured["forward"], 5, overlap) for overlap in (False, True)}
per_step = {overlap: ms for overlap, (_, ms) in timelines.items()}
print(f"measured in section 1 (tiny model, 64 requests): CPU work {measured['cpu']:.1f} ms "
      f"+ forward {measured['forward']:.1f} ms per step")
print(f"computed from them, not measured: sequential {per_step[False]:.1f} ms per step, "
      f"overlapped {per_step[True]:.1f} ms per step")

# %% alt="Two Gantt charts over milliseconds, each with a CPU lane and a device lane for five steps: schedule in green, prepare in olive, forward in blue, process in purple. The CPU's pieces are thin slivers next to the forwards; in the sequential chart the device lane has a narrow gap at every step, in the overlapped one the forwards run back to back." caption="The sequential and the overlapped loop on a device as slow as this CPU, computed from the measured times of a step's parts." tags=["hide-input"]
def draw_gantt(ax, bars, title: str) -> None:
    colors = {"schedule": "tab:green", "prepare": "tab:olive", "process": "tab:purple", "forward": "tab:blue"}
    for lane, label, start, length in bars:
        kind, step = label.split()
        y = 1 if lane == "CPU" else 0
        ax.broken_barh([(start, length)], (y - 0.35, 0.7), facecolor=colors[kind], edgecolor="white", lw=0.5)
        if kind == "forward":
            ax.text(start + length / 2, y, f"step {step}", ha="center", va="center", color="white", fontsize=8)
    ax.set_yticks([0, 1], ["device", "CPU"])
    ax.set_title(title, fontsize=9)


fig, axes = plt.subplots(2, 1, figsize=(12, 3.8), sharex=True)
for ax, overlap in zip(axes, (False, True)):
    title = f"{'overlapped' if overlap else 'sequential'}: {per_step[overlap]:.1f} ms per step"
    draw_gantt(ax, timelines[overlap][0], title)
axes[1].set_xlabel("ms (computed from the times measured in section 1: tiny model, 64 requests)")
handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("tab:green", "tab:olive", "tab:blue", "tab:purple")]
fig.legend(handles, ["schedule", "prepare + sampling info", "forward", "process"], loc="lower center", ncol=4,
           fontsize=8)
fig.tight_layout(rect=(0, 0.08, 1, 1))
plt.show()

# %% [markdown]
# In the sequential timeline of Figure 6.1 the device lane has a hole at every step, exactly as long as the CPU work;
# in the overlapped one the CPU's schedule and prepare for step N+1 happen during forward N, and the device runs back
# to back. The time per step drops from `CPU + forward` to about `max(CPU, forward)`.
#
# **An estimate for a GPU.** On a GPU the forward is short. For a lower bound on it we use the book's
# [yardstick](../method.md#yardsticks-physical-limits): a decode step must read every weight once plus each request's KV, at the H100's 3.35 TB/s. For the
# book's benchmark model, Qwen3-0.6B in bf16 (about 1.2 GB of weights, 114,688 bytes of KV per token), with 1,000
# tokens of context per request, that is `(1.2e9 + B * 1000 * 114688) / 3.35e12` seconds. The CPU work is the one
# measured on this CPU in section 1: it depends on the batch size, not on the model. This is an **estimate**, not
# a measurement: a real forward is slower than the floor, and a server's CPU is faster than this shared one.

# %%
H100_BYTES_PER_S = 3.35e12
QWEN3_06B_WEIGHT_BYTES = 1.2e9
KV_BYTES_PER_TOKEN = 114_688  # 2 * 28 layers * 8 KV heads * 128 head dim * 2 bytes (Method page)
CONTEXT = 1000

sizes = [1, 16, 64, 256]
est = []
print(f"{'batch':>5} {'CPU work (measured)':>20} {'GPU forward floor (computed)':>29} {'sequential':>11} "
      f"{'overlapped':>11} {'saved':>6}")
for b in sizes:
    cpu = clocks["tiny", b]["cpu"]
    fwd = (QWEN3_06B_WEIGHT_BYTES + b * CONTEXT * KV_BYTES_PER_TOKEN) / H100_BYTES_PER_S * 1e3
    seq, ovl = cpu + fwd, max(cpu, fwd)
    est.append((b, cpu, fwd, seq, ovl))
    print(f"{b:>5} {cpu:>17.2f} ms {fwd:>26.2f} ms {seq:>8.2f} ms {ovl:>8.2f} ms {1 - ovl / seq:>6.0%}")
below = [b for b, cpu, fwd, *_ in est if cpu < fwd]
above = [b for b, cpu, fwd, *_ in est if cpu >= fwd]
if above:
    print(f"CPU work below the forward floor at batch {below}; at or above it at batch {above}")
else:
    print(f"CPU work below the forward floor at every batch size ({', '.join(map(str, below))})")

# %% alt="Log-log line chart of milliseconds per decode step against batch size, 1 to 256: the CPU work per step and the GPU forward floor both grow with the batch, the floor faster, and the CPU work stays below the floor throughout; the sequential step is their sum and the overlapped step lies on the floor." caption="Estimated decode step time on a GPU with and without overlap, against batch size: CPU work measured here, the forward at its floor." tags=["hide-input"]
fig, ax = plt.subplots(figsize=(7, 3.6))
b_arr = np.array(sizes)
ax.plot(b_arr, [e[1] for e in est], "o-", label="CPU work per step (measured here)")
ax.plot(b_arr, [e[2] for e in est], "s--", label="GPU forward floor, Qwen3-0.6B on H100 (computed)")
ax.plot(b_arr, [e[3] for e in est], "^-", label="sequential step = CPU + forward (estimate)")
ax.plot(b_arr, [e[4] for e in est], "v-", label="overlapped step = max(CPU, forward) (estimate)")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xticks(sizes, [str(s) for s in sizes])
ax.set_xlabel("requests decoding (batch size)")
ax.set_ylabel("ms per decode step")
ax.set_title("ESTIMATE: time per step with and without overlap on a GPU", fontsize=9)
ax.legend(fontsize=7)
fig.tight_layout()
plt.show()

# %% [markdown]
# Two lessons from the estimate of Figure 6.2. First, overlap saves at most half of a step, and only when CPU work and
# forward are about equal; otherwise it hides the smaller of the two. The two are closest at the smallest batches,
# where the saving is largest; it shrinks as the batch grows, because the forward floor grows faster than the CPU work
# (every request adds its 1,000 tokens of KV, about 115 MB, to what the step reads, while the CPU work only adds a
# little bookkeeping per request). Second, look at which of the two is larger. In Figure 6.2 the CPU work stays
# below the forward floor at every batch size from 1 to 256, by a wide margin at 256 (under 2 ms against 9 ms)
# and a thin one at batch 1, so overlap hides all of it: the overlapped line lies on the floor and the GPU runs
# back to back. (A step timed while other jobs load this CPU can come out several times slower than usual; the
# line printed above the figure says where the CPU work fell in the run shown.) The margin is not guaranteed
# either: a smaller model or a faster GPU lowers the floor, and CPU work that grows with each request (a Python
# loop over the batch, a grammar mask per row in chapter 12) raises the other line. Once the CPU work is above
# the floor, the GPU waits for the CPU even with overlap. That is why production engines do both: they overlap,
# *and* they make the CPU work per step small (vectorised scheduling, metadata built with a few tensor operations
# instead of a loop per request, CUDA graphs in chapter 08 that launch a whole forward in one call).
#
# One more condition, easy to break without noticing: overlap works only if nothing before the sync point waits
# for the device. On a GPU, every `int(tensor)`, `.item()` or `.tolist()` of a device tensor in the scheduler or
# the model runner is a hidden sync that waits for the step in flight and silently turns the overlapped loop back
# into a sequential one (exercise 3).
#
# ## 4. The three races, caught in the act
#
# ### Race 1: one token too many
#
# Step N+1 is scheduled before the CPU knows that a request stopped at step N, so the request gets a row in step
# N+1, which computes a token for it. `_process` drops it (`if ... not row.is_live: continue`). Requests that stop by
# *length* never get that row, because the scheduler can predict them (`decodable`); the ones that stop on EOS, a
# stop token or a stop string cannot be predicted. We run a batch of six chat requests that end in all four ways,
# with overlap on and off, and count the rows `_process` finds already finished.

# %%
questions = [
    ("What is the capital of France?", {}),  # ends with EOS
    ("What is 2 + 2?", {}),  # ends with EOS
    ("Count from 1 to 20, separated by commas.", {"stop": ["4."]}),  # stop string
    ("Write one sentence about the sea.", {"stop": ["mysterious"]}),  # stop string
    ("Name a famous painter.", {"stop_token_ids": [real.tokenizer.encode(".", add_special_tokens=False)[0]]}),
    ("List three fruits.", {}),  # length
]
PROMPTS = [real.chat_prompt_ids([{"role": "user", "content": q}]) for q, _ in questions]
PARAMS = [SamplingParams(temperature=0, max_new_tokens=20, **kw) for _, kw in questions]


def run_batch(overlap: bool) -> tuple[list, int]:
    """Run the six requests in one engine; return them and the number of rows dropped by _process."""
    engine = make_engine(real, disable_overlap_schedule=not overlap, max_total_tokens=1024)
    dropped = []
    wrap(engine, "_process", before=lambda launched: dropped.append(
        sum(not row.is_live for row in launched.batch.rows)))
    reqs = [real.make_request(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    for r in reqs:
        engine.add_request(r)
    engine.run_until_done()
    return reqs, sum(dropped)


t0 = time.perf_counter()
results = {overlap: run_batch(overlap) for overlap in (False, True)}
print(f"two runs in {time.perf_counter() - t0:.1f} s")
for (q, _), r in zip(questions, results[True][0]):
    print(f"{len(r.output_ids):>3} tokens  {r.finish_reason.kind:<6} {str(r.finish_reason.matched):<10} "
          f"{book.shorten(repr(r.output_text), 70)}")
print(f"rows whose request had already finished when processed: {results[False][1]} without overlap, "
      f"{results[True][1]} with overlap")
assert results[False][1] == 0 and results[True][1] > 0

# %% [markdown]
# With overlap, the extra rows were computed and thrown away, one per request that stopped on a token or string
# while it still had room to go on; without overlap there are none. Section 5 checks that none of those tokens
# leaked into an output.
#
# ### Race 2: slots that the step in flight still writes
#
# When `_process(N)` finds that a request has finished, it releases the request's KV. But step N+1, already
# launched, contains that request's extra row, and that row *writes* the KV of one more token into a slot the
# request owns. If the slot went straight back to the allocator, step N+2 could hand it to a new request while
# step N+1 may still write it.
#
# Every free therefore goes through one object, `InflightFrees`, which the engine owns and hands to the cache
# manager as its way to free. The overlapped engine tells it when a step is launched (`launch()`) and when one has
# been processed (`processed(step)`); a free made while a step is in flight is parked, tagged with the newest
# launched step, and reaches the allocator only once that step has been processed, when the device is certainly
# done with it. Without overlap the engine reports no step to it, nothing is ever in flight, and every free is
# immediate, so one object serves both loops. Parking (`free`, `later`) and releasing (`processed`) are the other
# part of task 6.1:

# %%
def without_docstring(method) -> str:
    """A method's source, dedented, without its docstring (the text above says what it does)."""
    lines = inspect.cleandoc("\n" + inspect.getsource(method)).splitlines()
    body = ast.parse("\n".join(lines)).body[0].body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        lines = lines[: body[0].lineno - 1] + lines[body[0].end_lineno :]
    return "\n".join(lines)


# InflightFrees (minisgl_ref/kvcache/inflight.py): parking, counting launched steps, releasing.
show_code("\n\n".join(without_docstring(getattr(InflightFrees, name))
                       for name in ("free", "later", "launch", "processed")))

# %% [markdown]
# We watch it on the same six requests with overlap on, without the radix cache
# (`disable_radix_cache=True`: with it, a finished request's KV moves into the tree instead of being freed, and
# the question moves with it, see exercise 4). At each `_process` we compare the slots it parked with the slots
# that the step in flight is writing.

# %%
engine = make_engine(real, disable_radix_cache=True, max_total_tokens=1024)
launched = []  # (batch, StepOutput) of every step the runner ran
wrap(engine.runner, "run", after=lambda out, batch: launched.append((batch, out)))
overlapping_slots = []


def check_parked(_, processed) -> None:
    batch, out = launched[-1]  # the newest step: N+1, launched before step N was processed
    if batch is processed.batch:
        return  # nothing was launched after step N
    parked = {s for t in engine.frees.parked_slots for s in t.tolist()}
    written = set(out.forward_batch.out_cache_loc.tolist())
    if parked & written:
        overlapping_slots.append(sorted(parked & written))


wrap(engine, "_process", after=check_parked)
reqs = [real.make_request(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
for r in reqs:
    engine.add_request(r)
engine.run_until_done()
print(book.wrap(f"{len(overlapping_slots)} times a _process parked slots that the step in flight was writing: "
                f"{overlapping_slots}"))
print("free pages after the run:", engine.allocator.num_free_pages, "of", engine.allocator.capacity_pages,
      "| still parked:", engine.frees.num_parked)
assert overlapping_slots and engine.allocator.num_free_pages == engine.allocator.capacity_pages
assert [r.output_ids for r in reqs] == [r.output_ids for r in results[True][0]]

# %% [markdown]
# Each listed slot was released by `_process(N)` *while* step N+1 was writing into it, and it was given back only
# one step later. Nothing leaks: once the engine is idle every page is free again.
#
# How real is the danger? On this CPU none at all: step N+1 has finished before `_process(N)` even starts. On a
# GPU with a single in-order stream (this engine), step N+2 is queued behind step N+1, so N+2's write into a
# reused slot lands after N+1's. The deferral is what keeps the engine correct without leaning on that ordering:
# as soon as the next batch is prepared on a second stream (Mini-SGLang prepares metadata on a stream of its own),
# or copies are issued from reused host buffers, the ordering is gone and a reused slot becomes a real data race.
# The rule "a slot is reused only after every step that may touch it has been processed" holds in all of those
# designs.
#
# ### Race 3: retraction while a step is in flight
#
# When decode needs more KV than is free, the scheduler retracts the newest requests (chapter 03): releases their
# KV and sends them back to the waiting queue. Under overlap that is a problem twice over: the victims' KV is
# still in use by the step in flight, and because frees are deferred, retracting would not even make room for the
# step being scheduled, so the scheduler would keep retracting. Instead `_add_decode_rows` answers `NEED_SYNC`
# when it would retract while a step is in flight (`cache.frees.in_flight`), and `Scheduler.schedule` returns
# that instead of a batch. `Engine.step` then finishes the step in flight first (`_finish_inflight`: process it,
# which releases everything parked) and schedules again with nothing in flight, where retraction frees
# immediately. Often the finished step also ended some requests, and nobody has to be retracted.
#
# We force it with the tiny model: twelve requests of 20-token prompts and 40 new tokens each, in a pool of 360
# KV slots (they need 720).

# %%
gen = random.Random(3)
SQUEEZE_PROMPTS = [[gen.randrange(320) for _ in range(20)] for _ in range(12)]
SQUEEZE_PARAMS = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)


def squeeze(overlap: bool):
    engine = make_engine(tiny, disable_overlap_schedule=not overlap, max_total_tokens=360)
    schedule = engine.scheduler.schedule
    syncs = []

    def count_needsync():
        plan = schedule()
        if isinstance(plan, NeedSync):
            syncs.append(len(syncs))
        return plan

    engine.scheduler.schedule = count_needsync
    reqs = [tiny.make_request(p, SQUEEZE_PARAMS) for p in SQUEEZE_PROMPTS]
    for r in reqs:
        engine.add_request(r)
    engine.run_until_done()
    return reqs, len(syncs), engine.scheduler.num_retractions


oracle_reqs = [tiny.make_request(p, SQUEEZE_PARAMS) for p in SQUEEZE_PROMPTS]
tiny.engine.run(oracle_reqs)
for overlap in (False, True):
    reqs, n_sync, n_retract = squeeze(overlap)
    same = [r.output_ids for r in reqs] == [r.output_ids for r in oracle_reqs]
    print(f"overlap {'on ' if overlap else 'off'}: {n_retract} retractions, {n_sync} NEED_SYNC, "
          f"outputs identical to the naive engine: {same}")
    assert same and n_retract > 0 and (n_sync > 0) == overlap

# %% [markdown]
# Without overlap retraction simply happens; with overlap, each time the scheduler hit the wall while a step was in
# flight it answered `NEED_SYNC`, the engine drained that step, and scheduling continued without it. The retracted
# requests were prefilled again later (reusing what the radix tree still held, chapter 04) and produced exactly
# the oracle's tokens.
#
# ## 5. The oracle check
#
# The [oracle](../method.md#oracles-what-correct-means) for every engine configuration: the chapter-00 naive loop, equal greedy tokens on CPU in
# float32. For the six requests of race 1, with overlap on and off: the same tokens, the same finish reasons and
# matched stops, the same text, and no token after a stop.

# %%
t0 = time.perf_counter()
naive_reqs = [real.make_request(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
real.engine.run(naive_reqs)
print(f"naive engine: {time.perf_counter() - t0:.1f} s")
eos = real.eos_token_ids
for overlap in (False, True):
    reqs = results[overlap][0]
    for r, ref in zip(reqs, naive_reqs):
        assert r.output_ids == ref.output_ids, (overlap, r.output_ids, ref.output_ids)
        assert r.finish_reason == ref.finish_reason and r.output_text == ref.output_text
        if r.finish_reason.kind == "stop" and isinstance(r.finish_reason.matched, int):
            # a stop token ends the output: it is the last id and appears nowhere before it
            assert r.output_ids[-1] == r.finish_reason.matched and r.finish_reason.matched not in r.output_ids[:-1]
        if r.finish_reason.kind == "stop" and isinstance(r.finish_reason.matched, str):
            assert r.finish_reason.matched not in r.output_text  # the text ends before the stop string
    kinds = [r.finish_reason.kind + (f" ({r.finish_reason.matched!r})" if r.finish_reason.matched is not None else "")
             for r in reqs]
    print(book.wrap(f"overlap {'on ' if overlap else 'off'}: 6/6 requests identical to the oracle "
                    f"({sum(len(r.output_ids) for r in reqs)} tokens): {kinds}", indent=" " * 13))
assert any(r.finish_reason.matched in eos for r in naive_reqs)

# %% [markdown]
# The extra tokens of race 1 were computed, and not one reached an output.

# %% [markdown]
# ## Summary
#
# * **The CPU's part of a step.** Scheduling, preparing the batch, packing sampling state and processing the
#   tokens are Python that grows with the batch and not with the model; on a GPU the forward shrinks by orders of
#   magnitude and that work does not.
# * **The overlapped loop** (task 6.1). The engine launches step N+1 before it processes step N: decode inputs
#   come from a token buffer on the device, the one host wait per step is on the step's own copy event, the
#   scheduler counts tokens in flight, and prefill rows are committed to the radix tree at launch.
# * **Three races, closed.** A request that stopped at step N has one token too many in N+1, which is dropped; its
#   slots, still written by N+1, are freed only after that step is processed (`InflightFrees`); and a retraction
#   while a step is in flight becomes `NEED_SYNC`, which drains that step first.
# * **What it saves.** A step costs about `max(CPU, forward)` instead of their sum: at most half a step, when the
#   two are equal. In the estimate the CPU work stays below the forward floor at every batch size, so overlap
#   hides it all; where the CPU work is larger (a smaller model, a faster GPU, more work per request) the GPU
#   still waits, which is why the CPU work per step must also be small.
# * **A seam for later chapters.** `EngineExtension` names the moments of a step where a feature may act; an
#   engine given none runs exactly this loop.
# * **The oracle.** Overlap on and off give the same tokens, finish reasons and text as the naive loop; the extra
#   tokens of race 1 never reach an output.
# * **Next.** Chapter 07 makes attention fast and chapter 08 cuts the launch cost of a step; chapter 12 plugs its
#   grammar masks into the seam.

# %% [markdown]
# ## Exercises
#
# 1. **Task 6.1.** Write `Engine._step_overlap`, `Engine._finish_inflight` and the parking and releasing of
#    `InflightFrees` (`free`, `later`, `processed`). Grade it with `python -m minisgl_ref.course grade --task 6.1`.
#    Then delete the `not row.is_live` check in `_process` and run section 5: what fails, and with which message?
# 2. **Deferred frees.** Make `InflightFrees.free` give slots back at once even while a step is in flight. Do the
#    outputs change on this CPU? Explain why not, using the ordering argument of race 2, and describe a change to
#    the engine (a second stream, or a reused pinned host buffer) after which they could.
# 3. **Hidden syncs.** List every place that `Scheduler.schedule`, `ModelRunner.prepare`,
#    `SamplingState.info` and the attention backend's `init_forward_metadata` turn a device tensor into a
#    Python value (`int(...)`, `.item()`, `.tolist()`). On a GPU each of them waits for the step in flight. Which
#    could you avoid by keeping a CPU copy of the data?
# 4. **The radix tree.** With the radix cache on, a finished request's computed tokens move into the tree, whose
#    LRU eviction frees slots at once, without deferral. So the tree must never hold a slot that the step in
#    flight still writes. `CacheManager.release` commits only up to `len(all_ids) - 1` (not the extra row's
#    token), and `Engine.abort` releases a request whose row is in flight only after that step. Remove the
#    `upto=` cap in `release` and run `python -m pytest tests/test_kvcache_properties.py`: which rule of the
#    state machine finds the bug, and how short is the sequence of operations hypothesis shrinks it to? Why do
#    the oracle tests of this chapter not notice?

# %% [markdown]
# ## Reproduce
#
# ```bash
# python chapters/06_overlap_scheduling.py                      # this chapter, end to end
# python -m minisgl_ref.course grade --task 6.1               # the tests of task 6.1
# python -m pytest tests/test_notebooks.py -q -k 06             # the notebook runs top to bottom
# ```
#
# Measured on a 2-core x86_64 CPU (shared with other jobs), no GPU, Python 3.11, torch 2.13 (CPU), one torch
# thread; SmolLM2-135M-Instruct in float32 and the random 2-layer tiny Llama.
#
# | what | measured |
# | --- | --- |
# | SmolLM2, 8 requests decoding: CPU work / forward per step | 1.0 ms / 292 ms (0%) |
# | tiny model, CPU work per decode step at batch 1 / 16 / 64 / 256 | 0.27 / 0.40 / 0.64 / 1.6 ms |
# | tiny model, 32 requests: ms per step without / with overlap (this CPU) | 15.9 / 16.6 ms (medians of 3 alternating runs: noise, nothing overlaps on a CPU) |
# | estimate, Qwen3-0.6B on an H100 at batch 64: sequential / overlapped step | 3.19 / 2.55 ms (20% saved; computed, not measured) |
# | race 1: extra rows dropped without / with overlap | 0 / 5 (six chat requests, five end on EOS, a stop string or a stop token) |
# | race 3: retractions / NEED_SYNC, overlap off and on | 1 / 0 and 1 / 1; outputs identical to the naive engine |
# | overlap on and off vs the naive engine | 6/6 requests identical, including EOS, stop string and stop token endings |
# | whole chapter, `python chapters/06_overlap_scheduling.py` | 55 s (other jobs loading both cores) |

# %%
print(book.wrap(f"this run: tiny batch 64 CPU work {clocks['tiny', 64]['cpu']:.1f} ms "
                f"vs forward {clocks['tiny', 64]['forward']:.1f} ms; "
                f"overlap off/on on this CPU {seq_ms:.1f}/{ovl_ms:.1f} ms per step; "
                f"chapter ran in {time.perf_counter() - CHAPTER_START:.0f} s"))
