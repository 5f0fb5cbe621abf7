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
# # Chapter 05 — Chunked prefill
#
# **What you will build.** The part of the scheduler that decides *how much prompt* to prefill in one step:
# token budgets (`max_prefill_tokens`, `chunked_prefill_size`, `max_running_requests`), the admission loop that
# applies them (`Scheduler._schedule_prefill`; how much of a prompt one step takes and what it costs the step,
# `Scheduler._admit_chunk`, is task 5.1), prompts cut into chunks that are prefilled over several steps, and
# *mixed* steps in which those chunks share a forward pass with the decode tokens of the requests that are
# already generating (`enable_mixed_chunk`).
#
# **Why it matters.** Chapter 03's scheduler gives prefill priority: whenever a new request fits, the next step
# prefills it, and the running requests wait for that step to finish. For a short prompt that costs them one
# step. For a long prompt it costs them the whole prefill, and a prefill of tens of thousands of tokens takes
# seconds. Every user whose answer is streaming sees it freeze. This chapter measures that freeze on a real run,
# then removes it, and checks that the answers do not change by a single token.
#
# In this chapter you will:
#
# 1. see the problem, in a published measurement and then in our own engine;
# 2. read the token budgets and the admission loop (task 5.1);
# 3. run one scenario three ways (no chunking, chunking, chunking with mixed steps) and draw, step by step,
#    which request got tokens;
# 4. measure the longest stall of the running requests in steps and in seconds, and the price the long prompt
#    pays for the others' comfort as the chunk size changes;
# 5. check all of it against the chapter-00 oracle;
# 6. measure the same stall with the real SmolLM2-135M.
#
# Modules: `minisgl_ref/scheduler/scheduler.py` (task 5.1, and `Scheduler.schedule`),
# `minisgl_ref/core/config.py` (the knobs, named as in SGLang), `minisgl_ref/engine/engine.py`.

# %% tags=["setup"]
import os
import random
import tempfile
import time
from dataclasses import dataclass, field

import matplotlib.pyplot as plt
import torch
from IPython.display import display
from matplotlib.patches import Patch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.utils import logging as hf_logging

from minisgl_ref import LLM, SamplingParams
from minisgl_ref.book import show_code, wrap
from minisgl_ref.core.config import EngineConfig
from minisgl_ref.engine.engine import Engine
from minisgl_ref.scheduler.scheduler import Scheduler

CHAPTER_START = time.perf_counter()
hf_logging.disable_progress_bar()

# Timings in this chapter use one CPU thread, as in chapters 00-04: on a small shared machine (ours has 2 cores,
# shared with other jobs) two OpenMP threads that wait for each other at every matmul make step times erratic.
# Set MINISGL_THREADS to try more.
torch.set_num_threads(int(os.environ.get("MINISGL_THREADS", "1")))


# %% [markdown]
# ## 1. The problem: one long prompt freezes everyone
#
# Mini-SGLang chooses each step's batch in one line of `Scheduler._schedule_next_batch`
# (`python/minisgl/scheduler/scheduler.py`): ask the prefill manager for a batch, and only if it has none, ask
# the decode manager. A prefill batch, when there is one, always wins. Mini-SGLang does cut long prompts into
# chunks, but a chunked prompt has a prefill batch ready at every step until its last chunk, so the decode
# manager is not asked for all that time.
#
# A bug report against FreeToken, an engine that picks batches with exactly this rule
# ([FlashML-org/FreeToken#483](https://github.com/FlashML-org/FreeToken/issues/483)), measured what that means
# for a user. A request that decodes 699 tokens in 11.8 s on its own took 90.4 s when a 200,019-token prompt
# arrived 6 s after it: the server's log shows 58 prefill steps in a row, 77 s in total, and not a single decode
# step in between. The running request simply stopped for 77 seconds.
#
# The fix has two halves, and this chapter builds both:
#
# - **Chunking** bounds how much prompt one step may process (`chunked_prefill_size` tokens of one request,
#   `max_prefill_tokens` over all requests), so that no single step is huge.
# - **Mixing** (`enable_mixed_chunk`) puts the running requests' decode tokens *into* the prefill steps, so that
#   they get a token at every step, chunk or no chunk.
#
# Chunking alone is not enough, and the experiment below shows why: with prefill priority, a chunked prompt
# simply occupies several steps in a row instead of one.
#
# ```mermaid
# flowchart LR
#     S["Scheduler.<br/>schedule()"] --> P{"_schedule_prefill():<br/>a chunk to continue,<br/>or waiting prompts<br/>that fit?"}
#     P -->|no| D["decode step:<br/>one token for every<br/>running request"]
#     P -->|yes| B["prefill rows<br/>(budgets:<br/>task 5.1)"]
#     B --> M{"enable_<br/>mixed_chunk?"}
#     M -->|no| PB["prefill-only step:<br/>running requests<br/>wait"]
#     M -->|yes| MB["mixed step:<br/>prefill rows + one<br/>decode row per<br/>running request"]
# ```
#
# ## 2. A small model and a scenario
#
# To run the same scenario many times in a few seconds we use a *tiny* Llama with random weights (the one the
# tests use: 2 layers, hidden size 64, vocabulary 320). Its outputs are gibberish, but it runs through exactly
# the code paths of a real model, and the oracle does not care what the tokens mean, only that every engine
# produces the same ones. Section 7 repeats the measurement with the real SmolLM2-135M.
#
# The scenario: three short requests (A, B, C) are decoding when a 2048-token prompt (L) arrives, at step 6.

# %%
tiny_dir = tempfile.mkdtemp(prefix="tiny-llama-")
torch.manual_seed(0)
tiny_hf = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=320, max_position_embeddings=4096, rms_norm_eps=1e-6)
AutoModelForCausalLM.from_config(tiny_hf, dtype=torch.float32).save_pretrained(tiny_dir)
# engine="naive": this LLM object is the chapter-00 oracle; the paged engines below share its model weights.
tiny = LLM(tiny_dir, device="cpu", engine="naive")

rng = random.Random(0)
SHORT_PROMPTS = [[rng.randrange(320) for _ in range(rng.randint(12, 24))] for _ in range(3)]
LONG_PROMPT = [rng.randrange(320) for _ in range(2048)]
SHORT_PARAMS = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)  # greedy, fixed length
LONG_PARAMS = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)
ARRIVAL_STEP = 6
print(f"short prompts: {[len(p) for p in SHORT_PROMPTS]} tokens, {SHORT_PARAMS.max_new_tokens} new tokens each")
print(f"long prompt: {len(LONG_PROMPT)} tokens, arrives before step {ARRIVAL_STEP}")


# %% [markdown]
# A small harness drives the engine one step at a time and writes down, for every step, when it started and
# ended and which rows its batch had (request, number of tokens, prefill or decode, whether the row produced a
# token). It wraps `Scheduler.schedule` on this one engine object to see each batch; nothing in the package
# changes. We build the engines with `disable_overlap_schedule=True`, so a step's tokens come back in the same
# step; overlapping is the subject of chapter 06 and does not change which rows a step contains.

# %%
@dataclass
class StepRecord:
    start: float  # seconds since the run began
    end: float
    rows: list  # (name, tokens, is_decode, emits) per batch row
    batch: object = None  # the scheduler's plan
    forward_batch: object = None  # what the model runner ran


@dataclass
class Trace:
    label: str
    steps: list = field(default_factory=list)
    token_steps: dict = field(default_factory=dict)  # name -> [(step index, time)] of each token it received
    outputs: dict = field(default_factory=dict)  # name -> output ids
    arrival_time: float = 0.0


def run_scenario(model_llm: LLM, label: str, short_prompts, long_prompt, short_params, long_params,
                 arrival_step: int, **engine_kwargs) -> Trace:
    engine = Engine(model_llm.model, model_llm.config,
                    EngineConfig(disable_overlap_schedule=True, **engine_kwargs),
                    device="cpu", context_length=model_llm.context_length)
    names = {}
    for name, prompt in zip("ABC", short_prompts):
        req = model_llm.make_request(prompt, short_params)
        names[req] = name
        engine.add_request(req)
    long_req = model_llm.make_request(long_prompt, long_params)
    names[long_req] = "L"

    launched = []  # every (batch, forward batch) the model runner ran; one per step, since nothing overlaps
    run = engine.runner.run

    def recording_run(batch):
        out = run(batch)
        launched.append((batch, out.forward_batch))
        return out

    engine.runner.run = recording_run

    trace = Trace(label, token_steps={n: [] for n in names.values()})
    t0 = time.perf_counter()
    while engine.has_work:
        i = len(trace.steps)
        if i == arrival_step:
            engine.add_request(long_req)
            trace.arrival_time = time.perf_counter() - t0
        n_before = len(launched)
        start = time.perf_counter() - t0
        events = engine.step()
        end = time.perf_counter() - t0
        batch, fb = launched[-1] if len(launched) > n_before else (None, None)
        rows = [] if batch is None else [
            (names[row.req], row.extend_len, row.is_decode, row.emits) for row in batch.rows
        ]
        trace.steps.append(StepRecord(start, end, rows, batch, fb))
        for ev in events:
            trace.token_steps[names[ev.req]].append((i, end))
    trace.outputs = {n: list(r.output_ids) for r, n in names.items()}
    return trace


def longest_gaps(trace: Trace, who="ABC") -> tuple[int, float]:
    """The longest wait between two consecutive tokens of a running request, in steps and in seconds."""
    steps, seconds = [], []
    for name in who:
        toks = trace.token_steps[name]
        steps += [b[0] - a[0] for a, b in zip(toks, toks[1:])]
        seconds += [b[1] - a[1] for a, b in zip(toks, toks[1:])]
    return max(steps), max(seconds)


def first_token_after_arrival(trace: Trace) -> float:
    """Seconds from the long prompt's arrival to its first output token (its time to first token, TTFT)."""
    return trace.token_steps["L"][0][1] - trace.arrival_time


# %% [markdown]
# ## 3. Token budgets and admission (task 5.1)
#
# Three knobs, named as in SGLang's server arguments (`minisgl_ref/core/config.py`):
#
# | knob | meaning | default here |
# | --- | --- | --- |
# | `max_prefill_tokens` | new prompt tokens per step, summed over all requests in it | 16384 |
# | `chunked_prefill_size` | new prompt tokens per step for *one* request; longer prompts are cut into chunks (`-1`: never cut) | 8192 |
# | `max_running_requests` | requests holding KV at once (running + the one being chunked) | 256 |
#
# A fourth limit is not a knob but memory: a request is admitted only if the KV pool can hold its new tokens
# *and* a reserve for the tokens it will still generate (`max_new_tokens` scaled by `new_token_ratio`, which
# starts at 0.7 and decays while nothing goes wrong). The running requests' reserves are subtracted first.
# Reserving less than the worst case is a bet; when it is lost, chapter 03's retraction pays for it.
#
# `Scheduler._schedule_prefill` applies all of them: a short loop over the candidates, a small function per
# request (`_admit`: how many tokens, does the memory fit, allocate, add a row), and a `PrefillAdder` that carries
# what the step still has room for (its token budget, the KV slots left after the reserves, and the tokens its
# rows are computing). Without chunking (`chunked_prefill_size=-1`, chapter 03's engine) `_admit` sends the rest
# of a prompt whole; with chunking it hands over to `_admit_chunk`. Read the loop and the whole-prompt admission
# first:

# %%
display(show_code(Scheduler._schedule_prefill))
show_code(Scheduler._admit)

# %% [markdown]
# and then the chunked admission, task 5.1 (its docstring, in `minisgl_ref/scheduler/scheduler.py`, says what it
# must decide and why; `_add_prefill_row` allocates the slots, adds the row and moves the request on):

# %%
show_code(Scheduler._admit_chunk, task="5.1")

# %% [markdown]
# The loop in words:
#
# 1. **Candidates.** The request being chunked comes first (its next chunk must follow its previous one; there
#    is at most one such request), then the waiting queue in policy order (FCFS, or longest cached prefix first,
#    chapter 04).
# 2. **Slots.** A *new* request needs a free request slot (`max_running_requests`, and a free row in the page
#    table). Admission also looks up its cached prefix (`cache.match`), which pins it. If a request admitted
#    earlier in this same step is computing at least `in_batch_prefix_threshold` (32) of this request's uncached
#    prompt tokens, the request waits one step and finds them in the radix tree then (chapter 04, task 4.5);
#    the loop moves on to the next candidate.
# 3. **How many tokens.** With chunking, `n = min(what is left of the prompt, the step's remaining budget, the
#    chunk cap)`. Without it (`chunked_prefill_size=-1`) a prompt is never cut: it goes whole if it fits the
#    remaining budget, and a prompt larger than the whole budget goes *alone*, as the first row of a step of its
#    own (SGLang does the same), rather than being chunked behind the user's back.
# 4. **Memory.** The pages for those `n` tokens, plus the output reserve if this chunk finishes the prompt, must
#    fit in what is free after the running requests' reserves. If not, the request gives its pinned prefix back
#    and stays in the queue, and admission stops for this step: FCFS does not let a later, smaller request
#    overtake. (One exception keeps the engine from stalling: a request that would run alone reserves only what
#    the pool has left, so even a request whose `max_new_tokens` exceeds the pool is started, and aborted with
#    a clear message if it really outgrows it.)
# 5. **Commit to the plan.** Allocate the slots, charge the budget, add a row. A row that finishes the prompt
#    *emits* a token (its last position's logits are sampled) and its request joins `running`. A row that does
#    not (a partial chunk) emits nothing; the request becomes `self.chunked` and the loop ends, so that only one
#    request is ever half-prefilled.
#
# Watch the two budgets bind on four waiting prompts of 100, 300, 600 and 40 tokens with
# `max_prefill_tokens=512` and `chunked_prefill_size=256`:

# %%
demo = Engine(tiny.model, tiny.config, EngineConfig(max_prefill_tokens=512, chunked_prefill_size=256,
                                                    disable_overlap_schedule=True), device="cpu")
demo_names = {}
for name, n in zip(["P1", "P2", "P3", "P4"], [100, 300, 600, 40]):
    req = tiny.make_request([rng.randrange(320) for _ in range(n)], SamplingParams(temperature=0, max_new_tokens=4))
    demo_names[req] = name
    demo.add_request(req)
demo_batches = []
demo_schedule = demo.scheduler.schedule


def demo_recording_schedule():
    batch = demo_schedule()
    demo_batches.append(batch)
    return batch


demo.scheduler.schedule = demo_recording_schedule
print(f"{'step':>4}  {'rows (request: new tokens, [prefix already computed])':<70} prefill tokens")
for step in range(6):
    demo.step()
    b = demo_batches[-1]
    rows = []
    for row in b.rows:
        pre, n, emits = row.prefix_len, row.extend_len, row.emits
        kind = "decode" if row.is_decode else ("whole" if pre == 0 and emits else ("last chunk" if emits else "chunk"))
        rows.append(f"{demo_names[row.req]}: {n} [{pre}] {kind}")
    print(f"{step:>4}  {', '.join(rows):<70} {b.num_prefill_tokens}")
    assert b.num_prefill_tokens <= 512 and all(row.extend_len <= 256 for row in b.rows if not row.is_decode)
demo.run_until_done()

# %% [markdown]
# Step 0 admits P1 whole (100 tokens), then gives P2 a first chunk of 256 (the chunk cap binds) and stops: P2
# is now the chunked request. Step 1 finishes P2 (44 tokens) and starts P3 with 256 tokens. Step 2 is P3's
# second chunk; step 3 its last 88 tokens, and P4 (40) fits in the same step. Only then, in step 4, does anybody
# decode: P1 has had its first token since step 0 and waited three steps for its second. That wait is the
# subject of the rest of the chapter.
#
# `Scheduler.schedule`, which calls the admission loop, is where prefill priority and mixing live:

# %%
show_code(Scheduler.schedule)

# %% [markdown]
# If `_schedule_prefill` returns a batch, the step is a prefill step. With `enable_mixed_chunk` the running
# requests are added to that same batch as one-token *decode rows* (`_add_decode_rows(..., allow_retract=False)`:
# a mixed step never retracts anybody; if memory is short, the decode rows simply wait). Only when there is no
# prefill work at all does the step decode, and only then may it retract requests to make room (chapter 03).
# (SGLang subtracts the decode tokens of a mixed step from the step's prefill budget; here they come on top, a
# difference of one token per running request.)
#
# ## 4. Three schedules of the same scenario
#
# Same requests, same weights, three configurations:
#
# - **no chunking** (`chunked_prefill_size=-1`): L is prefilled in one 2048-token step;
# - **chunking** (`chunked_prefill_size=256`): L is prefilled in eight 256-token steps;
# - **chunking + mixing** (`chunked_prefill_size=256, enable_mixed_chunk=True`): the same eight chunks, each with a
#   decode row for A, B and C.

# %%
CONFIGS = {
    "no chunking": dict(chunked_prefill_size=-1),
    "chunking (256)": dict(chunked_prefill_size=256),
    "chunking (256) + mixing": dict(chunked_prefill_size=256, enable_mixed_chunk=True),
}
traces = {}
for label, kwargs in CONFIGS.items():
    t0 = time.perf_counter()
    traces[label] = run_scenario(tiny, label, SHORT_PROMPTS, LONG_PROMPT, SHORT_PARAMS, LONG_PARAMS, ARRIVAL_STEP,
                                 **kwargs)
    print(f"{label:<24} {len(traces[label].steps)} steps in {time.perf_counter() - t0:.2f} s")

# %% [markdown]
# The timelines of Figure 5.1 have one lane per request. On the left, the x-axis counts steps: a coloured cell means
# the request had a row in that step (orange: prompt tokens, hatched if the chunk did not finish the prompt; blue: a
# decode token). On the right, the same steps drawn at their measured wall-clock width. The dotted line is L's
# arrival.

# %% alt="Six timeline panels in three rows (no chunking, chunking 256, chunking 256 with mixing) and two columns (by engine step, by wall-clock time), each with lanes for requests A, B, C and the long prompt L. Blue cells are decode tokens, orange cells prompt tokens, hatched where a chunk did not finish the prompt; a dotted line marks L's arrival. Only with mixing do A, B and C have a cell in every step." caption="Three short requests and a long prompt L: without chunking, with chunking, and with chunking and mixing; by step (left) and by wall-clock time (right)." tags=["hide-input"]
LANES = ["A", "B", "C", "L"]
COLORS = {"prefill": "tab:orange", "decode": "tab:blue"}


def draw_timeline(ax, trace: Trace, by: str) -> None:
    for i, step in enumerate(trace.steps):
        x0, width = (i, 1.0) if by == "step" else (step.start, step.end - step.start)
        for name, n, is_decode, emits in step.rows:
            y = LANES.index(name)
            ax.broken_barh([(x0, width)], (y - 0.4, 0.8), facecolor=COLORS["decode" if is_decode else "prefill"],
                           edgecolor="white" if by == "step" else "none", linewidth=0.5,
                           hatch=None if emits else "///")
    arrival = ARRIVAL_STEP if by == "step" else trace.arrival_time
    ax.axvline(arrival, color="k", ls=":", lw=1)
    ax.set_yticks(range(len(LANES)), LANES)
    ax.set_ylim(len(LANES) - 0.4, -0.6)
    gap_steps, gap_s = longest_gaps(trace)
    ax.set_title(f"{trace.label}: longest gap of A-C = {gap_steps} steps / {gap_s * 1e3:.0f} ms", fontsize=9)


fig, axes = plt.subplots(3, 2, figsize=(13, 7), sharex="col")
for row, trace in enumerate(traces.values()):
    draw_timeline(axes[row, 0], trace, by="step")
    draw_timeline(axes[row, 1], trace, by="time")
axes[-1, 0].set_xlabel("step")
axes[-1, 1].set_xlabel("wall-clock time (s)")
fig.legend(handles=[Patch(facecolor="tab:orange", label="prompt tokens (finishes the prompt)"),
                    Patch(facecolor="tab:orange", hatch="///", label="prompt chunk (no token yet)"),
                    Patch(facecolor="tab:blue", label="decode token")],
           loc="lower center", ncol=3, fontsize=9)
fig.tight_layout(rect=(0, 0.05, 1, 1))
plt.show()

# %% [markdown]
# In Figure 5.1, follow lanes A, B and C across L's arrival, the dotted line: without chunking they skip one step, the
# long prefill; with chunking alone they skip one step per chunk; with mixing they get a token at every step. The
# table counts the steps and the seconds:

# %%
print(f"{'configuration':<26} {'steps':>5} {'longest gap (steps)':>20} {'longest gap (s)':>16} {'L: TTFT (s)':>12}")
summary = {}
for label, trace in traces.items():
    gap_steps, gap_s = longest_gaps(trace)
    summary[label] = (gap_steps, gap_s, first_token_after_arrival(trace))
    print(f"{label:<26} {len(trace.steps):>5} {gap_steps:>20} {gap_s:>16.3f} {summary[label][2]:>12.3f}")

assert summary["no chunking"][0] == 2  # one step without a token: the long prefill
assert summary["chunking (256)"][0] == len(LONG_PROMPT) // 256 + 1  # eight chunk steps without a token
assert summary["chunking (256) + mixing"][0] == 1  # a token at every single step

# %% [markdown]
# Read the step counts first; they are the scheduling, independent of any clock:
#
# - **No chunking:** A, B and C skip exactly one step (gap 2), but that step is the whole 2048-token prefill.
# - **Chunking alone:** they skip *eight* steps, one per chunk. Prefill priority hands every step to L until its
#   last chunk. This is the FreeToken log of section 1 in miniature.
# - **Chunking + mixing:** they never skip a step. Each chunk step is longer than a decode step, but it carries a
#   token for everyone.
#
# The seconds need one honest remark. Here "chunking alone" also *shortened* the stall in seconds compared with no
# chunking, which a GPU would not show. The reason is our attention oracle: `reference_attention` computes the
# full `Lq x Lk` score matrix and masks the upper triangle afterwards, so one 2048-token prefill computes
# 2048 x 2048 scores per head, while eight chunks compute only the rows they need (256 x 256, 256 x 512, ...,
# 256 x 2048), about half as many. Attention kernels (chapter 07) skip masked blocks; with them the chunks add up
# to about one full prefill plus a little overhead per step, and chunking alone saves the running requests
# nothing. The step counts above are the part that carries over.
#
# A mixed step, seen by the model runner (chapter 03's flat batch): one extend row with a cached prefix and
# three one-token decode rows, all in one `[T]` tensor.

# %%
mixed_step = next(s for s in traces["chunking (256) + mixing"].steps
                  if any(not d for _, _, d, _ in s.rows) and any(d for _, _, d, _ in s.rows)
                  and s.batch.rows[0].prefix_len > 0)
fb = mixed_step.forward_batch
print("rows            ", [(name, "decode" if d else "prefill") for name, _, d, _ in mixed_step.rows])
print("mode            ", fb.mode.name, " (any prompt row makes the step an extend; decode rows are 1-token extends)")
print("prefix_lens_cpu ", fb.prefix_lens_cpu)
print("extend_lens_cpu ", fb.extend_lens_cpu, f"-> T = {sum(fb.extend_lens_cpu)} tokens")
print("positions       ", fb.positions[:3].tolist(), "...", fb.positions[-4:].tolist())
print("emits           ", [row.emits for row in mixed_step.batch.rows],
      " (a partial chunk's sampled token is thrown away)")

# %% [markdown]
# ## 5. The chunk size is a trade-off
#
# With mixing, the running requests' worst gap is one chunk step, so smaller chunks mean smoother streams. But
# the long prompt pays: every chunk is a separate step with its own fixed cost (the weights are read once per
# step, plus Python overhead), and each chunk re-reads all the KV of the chunks before it. Sweep the chunk size
# with mixing on and measure both sides: the longest gap of A-C, and L's time to first token (TTFT) from its
# arrival.

# %%
sweep = {256: summary["chunking (256) + mixing"][1:]}
for size in (32, 64, 128, 512, 1024):
    tr = run_scenario(tiny, f"{size}", SHORT_PROMPTS, LONG_PROMPT, SHORT_PARAMS, LONG_PARAMS, ARRIVAL_STEP,
                      chunked_prefill_size=size, enable_mixed_chunk=True)
    sweep[size] = (longest_gaps(tr)[1], first_token_after_arrival(tr))
    assert tr.outputs == traces["no chunking"].outputs
sizes = sorted(sweep)
print(f"{'chunk':>6} {'longest gap of A-C (ms)':>24} {'L: TTFT (ms)':>13}")
for size in sizes:
    print(f"{size:>6} {sweep[size][0] * 1e3:>24.0f} {sweep[size][1] * 1e3:>13.0f}")
print(f"{'none':>6} {summary['no chunking'][1] * 1e3:>24.0f} {summary['no chunking'][2] * 1e3:>13.0f}   (no mixing)")

# %% alt="Line chart over chunk sizes 32 to 1024 on a log-2 axis, in milliseconds: the running requests' longest gap rises with the chunk size; the long prompt's time to first token is highest at the smallest chunks and rises again at the largest; a dotted line marks the gap without chunking." caption="The chunk size trade-off, with mixing on: the running requests' longest gap and the long prompt's time to first token." tags=["hide-input"]
fig, ax = plt.subplots(figsize=(7, 3.6))
ax.plot(sizes, [sweep[s][0] * 1e3 for s in sizes], "o-", label="longest gap of the running requests")
ax.plot(sizes, [sweep[s][1] * 1e3 for s in sizes], "s-", label="long prompt: time to first token")
ax.axhline(summary["no chunking"][1] * 1e3, color="tab:blue", ls=":", label="gap without chunking")
ax.set_xscale("log", base=2)
ax.set_xticks(sizes, [str(s) for s in sizes])
ax.set_xlabel("chunked_prefill_size (with enable_mixed_chunk)")
ax.set_ylabel("ms")
ax.set_ylim(bottom=0)
ax.legend(fontsize=8)
ax.set_title("smaller chunks: smoother streams, slower long prompt (tiny model, this CPU)", fontsize=9)
fig.tight_layout()
plt.show()

# %% [markdown]
# In Figure 5.2, the gap grows with the chunk size (one chunk step is what the others wait for). The long prompt's
# TTFT is highest for the smallest chunks (many steps, each with its fixed cost) and, on this engine, also for the
# largest (the quadratic score matrix again). Production engines pick the chunk size per GPU and model so that
# one chunk step stays near a target time; SGLang's default is a few thousand tokens on large GPUs.
#
# ## 6. The oracle check
#
# Chunking changes *when* each part of a prompt is computed and mixing changes *what it is batched with*; neither
# may change a single output token. The chapter-00 naive engine, which recomputes every sequence from scratch at
# every step, is the reference ([method page](../method.md#oracles-what-correct-means), the engine oracle: equal greedy tokens on CPU in
# float32).

# %%
t0 = time.perf_counter()
oracle_reqs = {name: tiny.make_request(p, SHORT_PARAMS) for name, p in zip("ABC", SHORT_PROMPTS)}
oracle_reqs["L"] = tiny.make_request(LONG_PROMPT, LONG_PARAMS)
tiny.engine.run(list(oracle_reqs.values()))
oracle = {name: r.output_ids for name, r in oracle_reqs.items()}
print(f"naive engine: {time.perf_counter() - t0:.1f} s")
for label, trace in traces.items():
    same = sum(trace.outputs[n] == oracle[n] for n in oracle)
    tokens = sum(a == b for n in oracle for a, b in zip(trace.outputs[n], oracle[n]))
    print(f"{label:<26} requests identical to the oracle: {same}/4, tokens: {tokens}/{sum(map(len, oracle.values()))}")
    assert trace.outputs == oracle, f"{label} differs from the naive engine"

# %% [markdown]
# Identical, token for token, in all three configurations (and in every run of the sweep above, which was
# checked against "no chunking"). This is not a given: a chunk's queries must attend to the KV of the earlier
# chunks, read through the page table, at the right positions; a partial chunk must not emit a token; a mixed
# step must keep each row's positions and prefix lengths straight. Chapter 03's paged attention and this chapter's
# bookkeeping get all of that right, or this cell fails.
#
# ## 7. On a real model
#
# The tiny model makes the scheduling visible; the real SmolLM2-135M shows what the stall costs in seconds on
# this CPU. Three chat requests are generating when a prompt of about 500 tokens arrives, at step 2. We compare no chunking
# with chunks of 128 plus mixing, and check both against the naive engine.

# %%
t0 = time.perf_counter()
real = LLM(device="cpu", engine="naive")  # the embedded SmolLM2-135M-Instruct, float32
print(f"loaded {real.config.architecture} in {time.perf_counter() - t0:.1f} s")
questions = ["Name three colours.", "What is 2 + 2?", "Say hello in French."]
real_short = [real.chat_prompt_ids([{"role": "user", "content": q}]) for q in questions]
doc = " ".join(f"Note {i}: the delivery for order {100 + i} arrives on day {i % 7 + 1}." for i in range(25))
real_long = real.chat_prompt_ids([{"role": "user", "content": "Summarise these notes.\n" + doc}])
print(f"short prompts: {[len(p) for p in real_short]} tokens; long prompt: {len(real_long)} tokens")
real_short_params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
real_long_params = SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True)

real_traces = {}
for label, kwargs in {"no chunking": dict(chunked_prefill_size=-1),
                      "chunking (128) + mixing": dict(chunked_prefill_size=128, enable_mixed_chunk=True)}.items():
    t0 = time.perf_counter()
    real_traces[label] = run_scenario(real, label, real_short, real_long, real_short_params, real_long_params,
                                      arrival_step=2, max_total_tokens=2048, **kwargs)
    print(f"{label:<24} {len(real_traces[label].steps)} steps in {time.perf_counter() - t0:.1f} s")

real_oracle = {name: real.make_request(p, real_short_params) for name, p in zip("ABC", real_short)}
real_oracle["L"] = real.make_request(real_long, real_long_params)
real.engine.run(list(real_oracle.values()))
print(f"{'configuration':<26} {'longest gap (steps)':>20} {'longest gap (s)':>16} {'L: TTFT (s)':>12}  oracle")
real_summary = {}
for label, trace in real_traces.items():
    gap_steps, gap_s = longest_gaps(trace)
    real_summary[label] = (gap_steps, gap_s, first_token_after_arrival(trace))
    same = trace.outputs == {n: r.output_ids for n, r in real_oracle.items()}
    print(f"{label:<26} {gap_steps:>20} {gap_s:>16.2f} {real_summary[label][2]:>12.2f}  "
          f"{'identical' if same else 'DIFFERS'}")
    assert same
print("A's answer:", repr(real.tokenizer.decode(real_oracle["A"].output_ids)))
assert real_summary["chunking (128) + mixing"][0] == 1
stall_none, stall_mixed = real_summary["no chunking"][1], real_summary["chunking (128) + mixing"][1]
print(f"longest stall of a running request: {stall_none:.2f} s without chunking,")
print(f"{stall_mixed:.2f} s with chunks of 128 + mixing ({stall_none / stall_mixed:.1f}x shorter)")

# %% [markdown]
# Without chunking, the running requests froze for the whole prefill of the long prompt; with chunks of 128 riding along
# with their decode tokens, their longest wait is one mixed step. Scale the prompt up a hundredfold and the GPU
# up accordingly, and this is the difference between a stream that stutters for a moment and the 77-second freeze
# of section 1.

# %% [markdown]
# ## Summary
#
# * **The freeze.** With prefill priority a long prompt takes every step until it is done, and the running
#   requests stop streaming: in the FreeToken report a 200,019-token prompt froze a running request for 77 s.
# * **Budgets and admission.** `max_prefill_tokens` (16,384 here), `chunked_prefill_size` (8,192) and
#   `max_running_requests` (256), plus memory for each prompt and its output reserve, applied by one loop over the
#   candidates; at most one request is half-prefilled at a time (task 5.1).
# * **Chunking is not enough.** With a 2,048-token prompt cut into chunks of 256, the running requests skip eight
#   steps instead of one; **mixing** (`enable_mixed_chunk`) gives them a decode row in every chunk step, so they
#   never skip one.
# * **A trade-off.** The longest gap of the running requests grows with the chunk size; the long prompt's own time
#   to first token is highest for the smallest chunks, which pay a step's fixed cost many times.
# * **The oracle.** No chunking, chunking, and chunking with mixing give exactly the naive loop's tokens, in every
#   run of the sweep.
# * **On the real model.** With chunks of 128 riding along with the decode tokens, a ~500-token prompt costs the
#   running requests at most one mixed step instead of its whole prefill.
# * **Next.** Chapter 06 hides the CPU's share of every step behind the device's.

# %% [markdown]
# ## Exercises
#
# 1. **Task 5.1.** Write `Scheduler._admit_chunk` from the description in section 3. Before you do, answer: why
#    must the chunked request be the first candidate, why does the loop stop after a partial chunk instead of
#    trying the next waiting request, and why does a partial chunk reserve nothing for the output? Grade it with
#    `python -m minisgl_ref.course grade --task 5.1`.
# 2. **Break it on purpose.** Give a partial chunk `emits=True` in `Scheduler._add_prefill_row` (sample a token
#    after the first chunk). Which assertion of this chapter fails first, and what does the wrong token mean for
#    the user? Put it back and grade again.
# 3. **Starvation without mixing.** Section 4 shows chunking alone starves decode while one prompt is chunked.
#    Add a knob that forces a decode step after every `k` consecutive prefill steps (SGLang has discussed such a
#    "consecutive prefill budget"). Plot the longest gap of A-C and L's TTFT for `k` = 1, 2, 4, and check the
#    oracle still holds.
# 4. **Measure.** Rerun section 5 with `LONG_PROMPT` of 1024 tokens. Where is L's TTFT lowest now, and why
#    does the answer depend on the prompt length on this engine?

# %% [markdown]
# ## Reproduce
#
# ```bash
# python chapters/05_chunked_prefill.py                        # this chapter, end to end
# python -m minisgl_ref.course grade --task 5.1              # the tests of task 5.1
# python -m pytest tests/test_notebooks.py -q -k 05            # the notebook runs top to bottom
# ```
#
# Measured on a 2-core x86_64 CPU (shared with other jobs), no GPU, Python 3.11, torch 2.13 (CPU), one torch
# thread. The tiny model is a random 2-layer Llama (hidden 64); the real one is SmolLM2-135M-Instruct in float32.
#
# | what | measured |
# | --- | --- |
# | tiny model, longest gap of the running requests, no chunking | 2 steps, 0.53 s (the 2048-token prefill) |
# | tiny model, chunking (256) without mixing | 9 steps, 0.25 s |
# | tiny model, chunking (256) + mixing | 1 step, 0.04 s |
# | tiny model, chunk size 64 / 1024 with mixing: longest gap; L's TTFT | 34 / 473 ms; 0.55 / 0.63 s |
# | all configurations vs the naive engine | identical greedy tokens (4/4 requests, 122/122 tokens on the tiny model; SmolLM2 identical) |
# | SmolLM2, longest stall, 502-token prompt: no chunking | 2 steps, 7.8 s |
# | SmolLM2, longest stall: chunks of 128 + mixing | 1 step, 2.9 s (2.7x shorter) |
# | whole chapter, `python chapters/05_chunked_prefill.py` | 59 s (other jobs loading both cores) |
#
# The last cell prints this run's numbers; on a shared machine wall-clock times vary from run to run, step
# counts do not.

# %%
print(wrap(f"this run: tiny model longest gap {summary['no chunking'][1]:.2f} s (no chunking) / "
           f"{summary['chunking (256)'][1]:.2f} s (chunking) / {summary['chunking (256) + mixing'][1]:.2f} s "
           f"(mixing); SmolLM2 longest stall {stall_none:.2f} s -> {stall_mixed:.2f} s; "
           f"chapter ran in {time.perf_counter() - CHAPTER_START:.0f} s"))
