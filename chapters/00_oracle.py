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
# # Chapter 00 — The oracle
#
# **What you will build.** The simplest engine that can serve a language model: it takes a request (prompt
# token ids plus sampling parameters), runs the model over the *whole* sequence to get one new token, appends
# it, and repeats until a stop rule fires. No KV cache, no scheduler, no kernels, no cleverness.
#
# **Why it matters.** Every later chapter makes this loop faster: a KV cache (03), prefix sharing (04), chunked
# prefill (05), overlap (06), custom kernels (07), CUDA graphs (08), tensor parallelism (09). Each of those is an
# opportunity to get something subtly wrong: a page aliased between two requests, a position off by one, a
# cached prefix that is not quite the same prefix. The naive loop has none of those moving parts, so it is easy
# to convince yourself that it is right, and then it becomes the **oracle**: on CPU in float32, every faster
# engine in this book must produce exactly the same greedy tokens as the loop you run here.
#
# In this chapter you will:
#
# 1. see what a serving engine does;
# 2. get a first greedy answer out of one, one step at a time;
# 3. follow a request through its life and the rules that end it (task 0.2);
# 4. read the naive generation loop and its flat, unpadded batch (task 0.3);
# 5. look at the attention it runs: the causal mask and grouped-query heads (task 0.1);
# 6. check the loop against Hugging Face `transformers`, token for token;
# 7. batch prompts of different lengths without padding, and check that batching changes nothing;
# 8. measure why this loop is slow, which is the whole motivation for chapter 03.

# %% [markdown]
# ## 1. What a serving engine does
#
# From the outside an LLM serving engine is simple: **requests go in, tokens come out.** A request is a prompt
# (already turned into token ids by a tokenizer) plus a handful of knobs: how many tokens at most, how random,
# when to stop. The engine's job is to produce each request's next token, over and over, for many requests at
# once, until each of them is done.
#
# ```mermaid
# flowchart LR
#     P(["prompt text"]) --> T["tokenizer<br/>text → ids"]
#     T --> R["Req<br/>ids + SamplingParams"]
#     R --> E
#     subgraph E["engine step (repeat)"]
#         direction TB
#         F["model forward<br/>ids → logits"] --> S["sampler<br/>logits → one id per request"]
#     end
#     E -->|append id, check stop rules| R
#     R -->|finished| D["detokenizer<br/>ids → text"]
#     D --> O(["answer text"])
# ```
#
# **Prefill and decode, as a preview.** While it reads a prompt, the model computes in every layer a *key* and a
# *value* vector for every token; attention is how later tokens consult them. Those vectors never change once
# computed, because no token may look at the tokens after it. A real engine therefore works in two phases: a
# **prefill** that runs the whole prompt once and stores its keys and values (the *KV cache*), then many
# **decode** steps that each feed a single new token and read everything earlier from the cache. Prefill
# processes many tokens per request and is limited by arithmetic; decode processes one token per request and is
# limited by how fast the weights and the cache can be read from memory. This chapter does *neither*: it stores
# nothing, so every step is a prefill of the whole sequence. That is wasteful, and section 8 measures exactly how
# wasteful; it is also trivially correct, which is the point.

# %% tags=["setup"]
import os
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import display

from minisgl_ref import LLM, SamplingParams
from minisgl_ref.attention.torch_native import NoCacheAttentionBackend, reference_attention
from minisgl_ref.book import show_code, show_table, wrap
from minisgl_ref.core.forward_batch import ForwardBatch
from minisgl_ref.core.request import FinishReason, Req
from minisgl_ref.engine.naive import NaiveEngine
from minisgl_ref.tokenizer import IncrementalDetokenizer

CHAPTER_START = time.perf_counter()

# Timings in this chapter use one CPU thread. On a small shared machine (ours has 2 cores, shared with other
# jobs), two OpenMP threads that must wait for each other at every matmul make step times erratic, often slower
# than one thread. Set MINISGL_THREADS to try more.
torch.set_num_threads(int(os.environ.get("MINISGL_THREADS", "1")))


# %%
t0 = time.perf_counter()
# The embedded SmolLM2-135M-Instruct in float32. engine="naive" picks this chapter's loop; LLM's default is the
# paged engine of chapters 03-06, which must give the same greedy tokens.
llm = LLM(device="cpu", engine="naive")
cfg = llm.config
print(f"loaded {cfg.architecture} from {llm.model_path} in {time.perf_counter() - t0:.1f} s")
print(f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} query heads / {cfg.num_kv_heads} KV heads "
      f"of dim {cfg.head_dim}, vocab {cfg.vocab_size}")
print(f"dtype {cfg.dtype}, {torch.get_num_threads()} CPU thread(s)")
assert isinstance(llm.engine, NaiveEngine)
print("engine:", type(llm.engine).__name__, "| EOS ids:", sorted(llm.eos_token_ids))

# %% [markdown]
# ## 2. A first answer, one step at a time
#
# `llm.make_request(prompt_ids, params)` wraps a prompt into a `Req`; `llm.engine.step(reqs)` advances every
# unfinished request by exactly one token and returns the text each one produced. Driving the loop by hand
# shows what one step is: below, `fed` is how many tokens went through the model to produce that single new
# token. Watch it grow.

# %%
question = "What is the capital of France?"
prompt_ids = llm.chat_prompt_ids([{"role": "user", "content": question}])
print(f"prompt: {len(prompt_ids)} tokens after the chat template")

greedy = SamplingParams(temperature=0, max_new_tokens=32)  # temperature 0 = greedy: always take the argmax
req = llm.make_request(prompt_ids, greedy)
print(f"{'step':>4} {'fed':>4} {'token id':>8}  {'token':<12} text so far")
step = 0
while not req.finished:
    fed = len(req.all_ids)  # the naive engine feeds the whole sequence, every step
    llm.engine.step([req])  # returns [(req, text this step made final)] for every request still running
    token = req.output_ids[-1]
    piece = llm.tokenizer.decode([token], skip_special_tokens=False)
    print(f"{step:>4} {fed:>4} {token:>8}  {piece!r:<12} {req.output_text!r}")
    step += 1
print("finish reason:", req.finish_reason)
answer_ids = list(req.output_ids)
assert "Paris" in req.output_text

# %% [markdown]
# The model answered in a handful of tokens and stopped by itself: its last token is the end-of-sequence id
# (`<|im_end|>` in SmolLM2's chat format), which ended the request with reason `stop` and did not become part of
# the text. Which brings us to the request itself.
#
# ## 3. A request's life
#
# `minisgl_ref/core/request.py` holds two small classes:
#
# - **`Req`**: the prompt ids (`input_ids`), the `SamplingParams`, the EOS ids of the model, an
#   `IncrementalDetokenizer` that turns ids into text as they arrive (chapter 02), the model's context window
#   (`context_len`), and the request's growing `output_ids`. `all_ids` is prompt + output: exactly what the naive
#   engine feeds each step.
# - **`FinishReason`**: why it stopped, in OpenAI's vocabulary: `stop` (EOS, a stop token, a stop string; with
#   the id or string that `matched`), `length` (`max_new_tokens` or the context window) or `abort`.
#
# Today a request is *running* from the moment it exists, and *finished* once it has a finish reason. Chapter 03
# puts a *waiting* state in front of running (a request must wait for free KV-cache memory) and lets the
# scheduler send a running request back to waiting when memory runs out. A request with `max_new_tokens == 0` is
# finished at birth, unless it asks for its prompt's log probabilities (chapter 10): then its prefill computes
# them, and it ends right after, with no token appended.
#
# ```mermaid
# stateDiagram-v2
#     [*] --> running: Req(...)
#     [*] --> finished: max_new_tokens == 0 (nothing to score)
#     running --> running: append_token, no rule fired
#     running --> finished: EOS, stop token id or stop string (stop)
#     running --> finished: max_new_tokens or context window (length)
#     running --> finished: abort(message) (abort)
#     finished --> [*]
# ```
#
# All the stop rules live in one method, `Req.append_token`, which every engine calls once per sampled token.
# Keeping them in the request rather than in the engine is a design decision with a payoff: every engine in the
# book, however it computes the next token, ends requests in exactly the same place, so their outputs can be
# compared token for token. This is **task 0.2**:

# %%
show_code(Req.append_token, task="0.2")

# %% [markdown]
# The order of the checks matters, and each answers a question an API user would ask:
#
# 1. **Stop token ids and EOS** are checked on the *id*, before any text is made, so the stop token never shows
#    up in the text. `ignore_eos=True` switches the EOS check off (benchmarks use it to get fixed-length outputs);
#    `min_new_tokens` delays both checks.
# 2. **Stop strings** are found in the *text*, by the detokenizer, because a string like `"###"` can be split over
#    several tokens. The text returned stops just before the match.
# 3. **Length**: `max_new_tokens`, or the context window (prompt + output may not exceed the model's
#    `max_position_embeddings`, or a smaller `context_length` given to `LLM`).
#
# The request does not care who computed its tokens. So we can test every rule without running the model at
# all: take the ids of the answer above and *replay* them into fresh requests with different parameters.

# %%
def replay(params: SamplingParams, context_len: int | None = None) -> Req:
    """Feed the greedy answer's ids into a fresh request until one of its stop rules fires."""
    r = Req(
        input_ids=prompt_ids,
        params=params,
        eos_token_ids=llm.eos_token_ids,
        detokenizer=IncrementalDetokenizer(llm.tokenizer, stop=params.stop),
        context_len=context_len if context_len is not None else llm.context_length,
    )
    for token in answer_ids:
        if r.finished:
            break
        r.append_token(token)
    return r


period_id = llm.tokenizer.encode(".", add_special_tokens=False)[0]
cases = {
    "plain greedy (EOS ends it)": replay(SamplingParams(temperature=0)),
    "max_new_tokens=3": replay(SamplingParams(temperature=0, max_new_tokens=3)),
    'stop=["Paris"]': replay(SamplingParams(temperature=0, stop=["Paris"])),
    f"stop_token_ids=[{period_id}] ('.')": replay(SamplingParams(temperature=0, stop_token_ids=[period_id])),
    "context window = prompt + 4": replay(SamplingParams(temperature=0), context_len=len(prompt_ids) + 4),
    "ignore_eos=True (runs out of ids)": replay(SamplingParams(temperature=0, ignore_eos=True)),
}
display(show_table([
    (name, len(r.output_ids), "" if r.finish_reason is None else str(r.finish_reason.to_dict()), repr(r.output_text))
    for name, r in cases.items()
], headers=["rule", "tokens", "finish reason", "text"]))

assert cases["plain greedy (EOS ends it)"].finish_reason == FinishReason("stop", matched=answer_ids[-1])
assert cases["max_new_tokens=3"].finish_reason.kind == "length" and len(cases["max_new_tokens=3"].output_ids) == 3
assert cases['stop=["Paris"]'].finish_reason.matched == "Paris" and "Paris" not in cases['stop=["Paris"]'].output_text
assert len(cases["context window = prompt + 4"].output_ids) == 4
assert not cases["ignore_eos=True (runs out of ids)"].finished  # EOS was just another token

# %% [markdown]
# Two details worth noticing. The stop *token* (`.` or EOS) is counted in `output_ids` (it was generated, and
# the `matched` field names it) but never appears in the text. And with `ignore_eos=True` the EOS id is an
# ordinary token: the request is still running after it, waiting for more.
#
# ## 4. The naive loop
#
# `NaiveEngine.step` in `minisgl_ref/engine/naive.py` is **task 0.3**. It is the whole engine:

# %%
show_code(NaiveEngine.step, task="0.3")

# %% [markdown]
# Line by line:
#
# 1. **Pack.** `ForwardBatch.for_full_sequences` (`minisgl_ref/core/forward_batch.py`) lays the requests'
#    sequences *back to back* in one flat tensor of `T` token ids, with a matching tensor of positions that
#    restarts at 0 for each request. No padding: a 5-token and a 40-token request cost 45 tokens, not 80.
#    `extend_lens_cpu` records where each request's tokens end; `prefix_lens_cpu` is all zeros (nothing is cached).
# 2. **Forward.** The model runs once over all `T` tokens. Every layer except attention treats the tokens
#    independently, so it does not care which request a token belongs to; attention does, and asks the batch.
# 3. **Logits.** Only each request's *last* position predicts its next token, so only those rows
#    (`last_token_indices`) go through the LM head: `[B, vocab]` instead of `[T, vocab]`.
# 4. **Sample.** `sampling_batch` (`minisgl_ref/core/request.py`) packs every request's knobs into the tensors of
#    a `SamplingBatchInfo`; the `Sampler` takes an argmax for greedy rows and draws for the others (chapter 02).
#
# Here is the packing for three toy sequences:

# %%
toy = ForwardBatch.for_full_sequences([[11, 12, 13], [21, 22, 23, 24, 25], [31, 32]], NoCacheAttentionBackend())
print("input_ids         ", toy.input_ids.tolist())
print("positions         ", toy.positions.tolist())
print("extend_lens_cpu   ", toy.extend_lens_cpu, f"  (T = {toy.input_ids.numel()} tokens, batch size {toy.batch_size})")
print("prefix_lens_cpu   ", toy.prefix_lens_cpu)
last = toy.last_token_indices
print("last_token_indices", last.tolist(), "-> tokens", toy.input_ids[last].tolist())

# %% [markdown]
# ```mermaid
# flowchart LR
#     subgraph flat["input_ids [T = 10], no padding"]
#         direction LR
#         a["request 0<br/>11 12 13"] --- b["request 1<br/>21 22 23 24 25"] --- c["request 2<br/>31 32"]
#     end
#     a -.->|"logits row 0<br/>(token 13)"| L["LM head<br/>[3, vocab]"]
#     b -.->|"logits row 1<br/>(token 25)"| L
#     c -.->|"logits row 2<br/>(token 32)"| L
# ```
#
# ## 5. Attention without a cache
#
# Attention is the one layer that mixes tokens, so it is the one that must respect the boundaries between
# requests and the order within one. `NoCacheAttentionBackend` (in `minisgl_ref/attention/torch_native.py`) cuts
# the flat q, k, v back into one slice per request using `extend_lens_cpu`, and hands each slice to
# `reference_attention`, **task 0.1**:

# %%
show_code(reference_attention, task="0.1")

# %% [markdown]
# Two ideas are packed into those lines.
#
# **The causal mask.** A token may only look at itself and at tokens before it; the scores of later tokens are set
# to `-inf`, so the softmax gives them weight exactly 0. The function is written for the general case that
# chapter 03 needs: `Lq` *new* queries (the last `Lq` positions of the sequence) over all `Lk` keys. Query `i`
# sits at absolute position `Lk - Lq + i` and may see keys `0 .. Lk - Lq + i`. In this chapter `Lq == Lk`
# (the whole sequence is new every step) and the mask is the familiar lower triangle; with a KV cache, a decode
# step has `Lq = 1` and its single query sees every key.
#
# **Grouped-query attention (GQA).** SmolLM2-135M has 9 query heads but only 3 key/value heads: each KV head is
# shared by a *group* of 3 consecutive query heads (query head `h` reads KV head `h // 3`). That shrinks the KV
# cache threefold, which matters a lot from chapter 03 on. The reference implementation just repeats each KV
# head 3 times (`repeat_interleave`) and then does ordinary multi-head attention.

# %% alt="Three grids. Left: an 8 by 8 mask of queries against keys, a tick on and below the diagonal and minus infinity above it. Middle: 3 new queries over 8 keys, where the first 5 keys are visible to every query. Right: 9 query heads mapped to 3 KV heads in groups of 3." caption="The causal mask without a cache and with one, and how SmolLM2-135M's 9 query heads share its 3 KV heads."
def causal_mask(lq: int, lk: int) -> np.ndarray:
    """True where query i (at position lk - lq + i) may see key j: the same rule as reference_attention."""
    q_pos = np.arange(lk - lq, lk)[:, None]
    return np.arange(lk)[None, :] <= q_pos


fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), gridspec_kw={"width_ratios": [1, 1, 1.1]})
for ax, (lq, lk), title in [
    (axes[0], (8, 8), "this chapter: Lq = Lk = 8\n(every token is new)"),
    (axes[1], (3, 8), "chapter 03: Lq = 3 new over Lk = 8\n(5 keys come from a cache)"),
]:
    ax.imshow(causal_mask(lq, lk), cmap="Blues", vmin=0, vmax=1.4)
    ax.set_xticks(range(lk))
    ax.set_yticks(range(lq), [f"q@{lk - lq + i}" for i in range(lq)])
    ax.set_xlabel("key position")
    ax.set_title(title, fontsize=10)
    for i in range(lq):
        for j in range(lk):
            ax.text(j, i, "✓" if causal_mask(lq, lk)[i, j] else "−∞", ha="center", va="center", fontsize=7)

group = cfg.num_heads // cfg.num_kv_heads
gqa = np.zeros((cfg.num_heads, cfg.num_kv_heads))
gqa[np.arange(cfg.num_heads), np.arange(cfg.num_heads) // group] = 1
axes[2].imshow(gqa, cmap="Oranges", vmin=0, vmax=1.4, aspect="auto")
axes[2].set_xticks(range(cfg.num_kv_heads), [f"KV {j}" for j in range(cfg.num_kv_heads)])
axes[2].set_yticks(range(cfg.num_heads), [f"q head {h}" for h in range(cfg.num_heads)])
axes[2].set_title(f"GQA in SmolLM2-135M: {cfg.num_heads} query heads,\n{cfg.num_kv_heads} KV heads (groups of {group})",
                  fontsize=10)
fig.tight_layout()
plt.show()

# %% [markdown]
# In Figure 0.1, the middle grid is the bottom three rows of the left one: a query sees the same keys whether the
# keys before it were just computed or come from a cache. Only the shapes differ.
#
# Is `reference_attention` right? It is itself an oracle (the [method page](../method.md#oracles-what-correct-means): *torch_native is the
# reference for every kernel backend*), so we check it against the most independent thing at hand, PyTorch's fused
# `scaled_dot_product_attention`, with the shapes of this model, both for a full sequence and for "3 new
# queries over 8 keys":

# %%
torch.manual_seed(0)
for lq, lk in [(37, 37), (3, 8), (1, 50)]:
    q = torch.randn(lq, cfg.num_heads, cfg.head_dim)
    k = torch.randn(lk, cfg.num_kv_heads, cfg.head_dim)
    v = torch.randn(lk, cfg.num_kv_heads, cfg.head_dim)
    ours = reference_attention(q, k, v, scale=cfg.head_dim**-0.5)
    mask = torch.from_numpy(causal_mask(lq, lk))
    kk, vv = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask).transpose(0, 1)
    err = (ours - sdpa).abs().max().item()
    print(f"Lq={lq:>2} Lk={lk:>2}: max |reference_attention - SDPA| = {err:.2e}")
    assert err < 1e-5

# %% [markdown]
# The mask is not just a drawing; the model really lives under it. A *probe* backend (toy code for Figure 0.2
# only: it records the queries and keys that two layers hand to the backend, then attends exactly like
# `NoCacheAttentionBackend`) lets us draw the attention probabilities of two heads of the real model over a short
# prompt. Everything above the diagonal is exactly zero: no token ever saw its future.

# %% alt="Two heat maps of attention probabilities over the tokens of the prompt 'The capital of France is Paris. The capital of Italy is', queries down and keys across. Layer 8 head 0 puts most of its weight on the first token; layer 16 head 0 lights up the cells just below the diagonal. Above the diagonal both are zero." caption="Attention probabilities of two heads of SmolLM2-135M over a short prompt: no token attends to a later one."
class ProbeBackend(NoCacheAttentionBackend):
    """Toy: remember the q and k that some layers hand to the backend, then attend as usual."""

    def __init__(self, layer_ids: set[int]) -> None:
        super().__init__()
        self.layer_ids, self.seen = layer_ids, {}

    def forward(self, q, k, v, layer, batch):
        if layer.layer_id in self.layer_ids:
            self.seen[layer.layer_id] = (q.clone(), k.clone(), layer.scale)
        return super().forward(q, k, v, layer, batch)


def attention_probs(q, k, scale) -> torch.Tensor:
    """[H, L, L] probabilities of one whole sequence: the first half of reference_attention."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores.masked_fill_(~torch.from_numpy(causal_mask(len(q), len(k))), float("-inf"))
    return scores.softmax(-1)


probe_ids = llm.tokenizer.encode("The capital of France is Paris. The capital of Italy is", add_special_tokens=False)
shown = [(8, 0), (16, 0)]  # (layer, query head): two heads with easy-to-read habits
probe = ProbeBackend({layer for layer, _ in shown})
with torch.inference_mode():
    batch = ForwardBatch.for_full_sequences([probe_ids], probe)
    llm.model(batch.input_ids, batch.positions, batch)
probs = {layer: attention_probs(*probe.seen[layer]) for layer, _ in shown}

labels = [llm.tokenizer.decode([t]) for t in probe_ids]
fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
for ax, (layer, head) in zip(axes, shown):
    ax.imshow(probs[layer][head], cmap="viridis", vmin=0, vmax=1)
    ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=8)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_xlabel("key (attended to)")
    ax.set_title(f"layer {layer}, query head {head} (reads KV head {head // group})", fontsize=10)
fig.tight_layout()
plt.show()

prev_share = probs[16][0].diagonal(-1).mean().item()
above = max(p.triu(diagonal=1).max().item() for p in probs.values())
print(f"layer 16, head 0: on average {prev_share:.0%} of a token's attention goes to the token just before it")
print("largest probability above the diagonal, any head of either layer:", above)
assert above == 0.0

# %% [markdown]
# Figure 0.2 shows that even this tiny model has heads with recognisable jobs. Layer 16's head 0 mostly looks at the
# *previous* token. Layer 8's head 0 parks most of its weight on the very first token (a common habit, often called an
# *attention sink*), but the second `capital`, `of` and `is` reach back to their own earlier occurrence in the first
# sentence, which is how a model can copy a pattern it has seen. None of that is our concern as engine builders,
# except for one fact: a token's attention depends only on itself and the tokens before it.

# %% [markdown]
# ## 6. The oracle check: our loop against `transformers`
#
# The naive loop is the reference for every faster engine, but what is *its* reference? The [method page](../method.md#oracles-what-correct-means)
# names one: Hugging Face `transformers` on the same weights, in float32 on CPU, is the oracle for our model code
# (chapter 01 compares their logits at every position). Here we compare what matters to a user: the tokens. We ask both
# for exactly 16 greedy tokens (`min_new_tokens=16` masks EOS in both, so neither can stop early) and require
# them to be identical.

# %%
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()
hf_model = AutoModelForCausalLM.from_pretrained(llm.model_path, dtype=torch.float32).eval()

N_ORACLE = 16
t0 = time.perf_counter()
ours = llm.make_request(prompt_ids, SamplingParams(temperature=0, min_new_tokens=N_ORACLE, max_new_tokens=N_ORACLE))
llm.engine.run([ours])
ours_s = time.perf_counter() - t0

t0 = time.perf_counter()
with torch.inference_mode():
    hf_out = hf_model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        do_sample=False,
        min_new_tokens=N_ORACLE,
        max_new_tokens=N_ORACLE,
    )
hf_s = time.perf_counter() - t0
theirs = hf_out[0, len(prompt_ids):].tolist()

agree = sum(a == b for a, b in zip(ours.output_ids, theirs))
print(wrap(f"naive loop  : {ours.output_ids}", indent=" " * 15))
print(wrap(f"transformers: {theirs}", indent=" " * 15))
print(f"agreement: {agree}/{N_ORACLE} tokens")
print(f"text: {llm.tokenizer.decode(ours.output_ids)!r}")
print(f"time for {N_ORACLE} tokens: naive loop {ours_s:.2f} s, transformers generate (with its KV cache) {hf_s:.2f} s")
assert ours.output_ids == theirs, "the naive loop disagrees with transformers"

# %% [markdown]
# Equal tokens are the requirement; it is also worth knowing *how* close the two models are, because greedy
# decoding turns tiny numerical differences into different tokens whenever two candidates are nearly tied. One
# forward of the prompt through each model:

# %%
with torch.inference_mode():
    batch = ForwardBatch.for_full_sequences([prompt_ids], llm.engine.backend)
    our_logits = llm.model.compute_logits(llm.model(batch.input_ids, batch.positions, batch)[batch.last_token_indices])
    hf_logits = hf_model(torch.tensor([prompt_ids])).logits[:, -1].float()
logit_err = (our_logits - hf_logits).abs().max().item()
top2 = our_logits[0].topk(2).values
print(f"max |logit difference| at the prompt's last position: {logit_err:.2e}")
margin = (top2[0] - top2[1]).item()
print(f"gap between the best and second-best logit there:     {margin:.3f} ({margin / logit_err:.0f}x the difference)")
assert logit_err < 1e-3
del hf_model

# %% [markdown]
# ## 7. Batching without padding
#
# An engine serves many requests at once. The flat layout makes batching prompts of different lengths free of
# padding: the batch is just the concatenation. The requirement for correctness is just as simple to state:
# **a request's output must not depend on who it is batched with.** In greedy mode we can check that exactly.

# %%
prompts = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived a",
    "def fibonacci(n):",
]
batch_params = SamplingParams(temperature=0, max_new_tokens=6)
reqs = [llm.make_request(p, batch_params) for p in prompts]

first = ForwardBatch.for_full_sequences([r.all_ids for r in reqs], llm.engine.backend)
lens = first.extend_lens_cpu
print(f"first step: extend_lens {lens} -> T = {sum(lens)} tokens in one flat batch")
print(f"a padded [B, max_len] batch would hold {len(lens) * max(lens)} ({len(lens) * max(lens) - sum(lens)} padding)")

t0 = time.perf_counter()
steps = 0
while llm.engine.step(reqs):
    steps += 1
batched_s = time.perf_counter() - t0

t0 = time.perf_counter()
alone = []
for p in prompts:
    r = llm.make_request(p, batch_params)
    llm.engine.run([r])
    alone.append(r)
alone_s = time.perf_counter() - t0

for r, a in zip(reqs, alone):
    same = r.output_ids == a.output_ids
    print(f"{len(r.input_ids):>3} prompt tokens -> {len(r.output_ids):>2} tokens, {r.finish_reason.kind:<6} "
          f"same as alone: {same}  {r.output_text!r}")
    assert same
print(f"{steps} batched steps in {batched_s:.2f} s; the same requests one at a time: {alone_s:.2f} s")

# %% [markdown]
# Batching bought time even here, on one CPU thread (compare the two timings above): every step has a cost that
# does not depend on the number of tokens (reading all the weights once, Python and framework overhead), and a
# batch pays it once for all its requests. On a GPU the effect is far larger, and it is the reason engines batch
# at all; chapter 03 turns it into *continuous* batching, where requests join and leave the batch at every step.
#
# ## 8. Why the naive loop is slow
#
# Section 2 showed it: the step that produces output token number `n` feeds `prompt + n` tokens through the
# model. The work of one step therefore grows *linearly* with the length of the sequence (attention grows
# faster still, but for a small model at these lengths the linear layers dominate), and the total work to
# generate `N` tokens grows *quadratically*. Let us time it: one request, 64 greedy tokens (`ignore_eos=True`
# so that it cannot stop early), one timing per step.
#
# We record two clocks per step. **Wall-clock** time is what a user waits; on a shared machine it also counts
# moments when the operating system lent our core to someone else. **CPU time** (`time.process_time`) counts only
# the work done by this process; with one torch thread it equals the wall-clock time of an otherwise idle machine,
# so it is the steadier measure of *work per step*, and the one we fit.

# %%
N_GEN = 64
story_ids = llm.tokenizer.encode("Once upon a time", add_special_tokens=False)
req = llm.make_request(story_ids, SamplingParams(temperature=0, max_new_tokens=N_GEN, ignore_eos=True))
seq_lens, wall_s, cpu_s = [], [], []
while not req.finished:
    seq_lens.append(len(req.all_ids))  # tokens fed this step
    w0, c0 = time.perf_counter(), time.process_time()
    llm.engine.step([req])
    wall_s.append(time.perf_counter() - w0)
    cpu_s.append(time.process_time() - c0)
seq_lens, wall_s, cpu_s = np.array(seq_lens), np.array(wall_s), np.array(cpu_s)

# For comparison: a step that feeds a single token. That is roughly what a decode step costs once a KV cache
# holds everything before the new token (chapter 03; attention over the cached keys comes on top).
one_wall, one_cpu = [], []
for _ in range(5):
    r = llm.make_request(story_ids[:1], SamplingParams(temperature=0, max_new_tokens=1))
    w0, c0 = time.perf_counter(), time.process_time()
    llm.engine.step([r])
    one_wall.append(time.perf_counter() - w0)
    one_cpu.append(time.process_time() - c0)
one_cpu_s = float(np.median(one_cpu))

slope, intercept = np.polyfit(seq_lens, cpu_s, 1)  # CPU seconds = intercept + slope * tokens fed
naive_tokens = int(seq_lens.sum())
cached_tokens = len(story_ids) + N_GEN - 1  # prefill the prompt once, then one new token per decode step
print(f"prompt {llm.tokenizer.decode(story_ids)!r} ({len(story_ids)} tokens) -> "
      f"{llm.tokenizer.decode(req.output_ids)[:50]!r}...")
print(f"{N_GEN} tokens, sequence {seq_lens[0]} -> {seq_lens[-1]} tokens: "
      f"wall {wall_s.sum():.1f} s ({N_GEN / wall_s.sum():.2f} tokens/s), CPU {cpu_s.sum():.1f} s "
      f"({N_GEN / cpu_s.sum():.2f} tokens/s)")
print(f"CPU time per step: {cpu_s[:4].mean() * 1e3:.0f} ms over the first 4 steps, "
      f"{cpu_s[-4:].mean() * 1e3:.0f} ms over the last 4")
print(f"fit: {intercept * 1e3:.0f} ms + {slope * 1e3:.2f} ms per token fed")
print(f"a step that feeds a single token: {one_cpu_s * 1e3:.0f} ms CPU (median of 5)")
print(f"tokens pushed through the model: {naive_tokens} for {N_GEN} generated "
      f"({naive_tokens / N_GEN:.1f} per generated token)")
print(f"with a KV cache: {cached_tokens} ({naive_tokens / cached_tokens:.1f}x fewer)")
assert slope > 0  # longer sequences cost more per step

# %% alt="Two charts. Left: time per step in milliseconds against tokens fed, the points rising along a fitted straight line, above a dashed horizontal line for a step that feeds one token. Right: cumulative tokens pushed through the model against tokens generated; the naive curve bends upward while the KV-cache line stays straight and far below it." caption="The naive loop: each step recomputes the whole sequence, so the time per step grows with its length and the total work grows quadratically." tags=["hide-input"]
fig, axes = plt.subplots(1, 2, figsize=(12, 4))
ax = axes[0]
ax.plot(seq_lens, wall_s * 1e3, ".", color="lightgray", label="wall-clock per step")
ax.plot(seq_lens, cpu_s * 1e3, "o", ms=3, label="CPU time per step")
ax.plot(seq_lens, (intercept + slope * seq_lens) * 1e3, "-",
        label=f"fit: {intercept * 1e3:.0f} ms + {slope * 1e3:.2f} ms × tokens")
ax.axhline(one_cpu_s * 1e3, ls="--", color="gray", label="a step feeding 1 token (CPU)")
ax.set_xlabel("tokens fed this step (= sequence length)")
ax.set_ylabel("time per step (ms)")
ax.set_ylim(bottom=0)
ax.set_title("each naive step recomputes the whole sequence", fontsize=10)
ax.legend(fontsize=8)

ax = axes[1]
generated = np.arange(1, N_GEN + 1)
ax.plot(generated, np.cumsum(seq_lens), label="naive: the whole sequence every step")
ax.plot(generated, len(story_ids) + generated - 1, label="with a KV cache: the prompt once, then 1 per step")
ax.set_xlabel("tokens generated")
ax.set_ylabel("tokens pushed through the model (cumulative)")
ax.set_title("total work: quadratic vs linear", fontsize=10)
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# Read the left panel of Figure 0.3 from the dashed line up. A step is never free: even a single token needs every
# weight of the model once, which is the dashed line. The naive loop pays that *and* a cost for every token of the
# sequence, again at every step, and the sequence only grows. The right panel adds it up: after 64 tokens the
# naive loop has pushed about 34 times more tokens through the model than it had to. The ratio keeps growing
# with the length, and real requests are long (prompts of thousands of tokens, answers of hundreds or more).
#
# The way out is the observation of section 1, made precise by the causal mask of section 5: no token can see a
# later one, so the keys and values of the tokens already processed never change when a new token is appended.
# Compute them once and keep them, and every decode step becomes a one-token forward plus attention over the
# stored keys and values. That is the **KV cache** of chapter 03 — and the first thing that will be checked,
# token for token, against the loop of this chapter.

# %% [markdown]
# ## Summary
#
# * **The naive engine.** A step runs the model over every request's whole sequence (prompt plus output so far),
#   samples one token per request and appends it. Nothing is cached, so nothing can go stale.
# * **One place for the stop rules.** `Req.append_token` checks stop token ids and EOS, then stop strings, then
#   the length limits, so every engine in the book ends a request at exactly the same token.
# * **A flat batch without padding.** Sequences lie back to back in one `[T]` tensor, only each request's last
#   position goes through the LM head, and attention cuts the batch back into requests, under the causal mask and
#   with each of SmolLM2's 3 KV heads shared by 3 of its 9 query heads.
# * **The oracle.** On the CPU in float32 the loop gives the same 16 greedy tokens as Hugging Face `transformers`,
#   and a request's output does not depend on what it is batched with.
# * **The cost.** Every step pays for the whole sequence again: after 64 tokens the naive loop has pushed about 34
#   times more tokens through the model than it needed to, and the ratio grows with the length.
# * **Next.** Keys and values never change once computed, so chapter 03 keeps them in a KV cache, and its engine
#   is checked token for token against this loop. Chapters 01 and 02 first open the model and the text around it.

# %% [markdown]
# ## Exercises
#
# 1. **Task 0.1.** Rewrite the body of `reference_attention` your own way (for example: loop over query heads
#    and index KV head `h // group` instead of repeating the KV heads). Grade it with
#    `python -m minisgl_ref.course grade --task 0.1`.
# 2. **Task 0.2.** Rewrite the stop rules of `Req.append_token`. Before you do: what would go wrong if stop
#    strings were checked before stop token ids, or `max_new_tokens` before both? The replay trick of section 3
#    is a quick way to test your answer. Grade it with `python -m minisgl_ref.course grade --task 0.2`.
# 3. **Task 0.3.** Write `NaiveEngine.step` yourself and grade it with
#    `python -m minisgl_ref.course grade --task 0.3` (its tests drive the loop with a stand-in model whose next
#    token is known in advance). Then break it on purpose (take the logits at each request's *first* position,
#    or feed only the prompt) and watch both those tests and the oracle of section 6 catch it:
#    `python -m pytest tests/test_engine_oracle.py -k transformers`.
# 4. **Measure.** Rerun section 8 with `N_GEN = 256`. Does the CPU time per step stay a straight line in the
#    sequence length, or does attention's quadratic term start to show? (`MINISGL_THREADS=2 python
#    chapters/00_oracle.py` also lets you see what a second thread buys on your machine.)

# %% [markdown]
# ## Reproduce
#
# ```bash
# python chapters/00_oracle.py                          # this chapter, end to end: 34-42 s on a 2-core CPU
# ./minisgl generate "What is the capital of France?"   # same greedy answer, from the CLI's (default) engine
# python -m minisgl_ref.course grade --chapter 0        # grade tasks 0.1-0.3
# python -m pytest tests/test_engine_oracle.py          # the oracle tests of this chapter
# ```
#
# Measured on a 2-core x86_64 CPU (AMD EPYC, shared with other jobs), no GPU, Python 3.11, torch 2.13 (CPU),
# transformers 5.23, one torch thread, SmolLM2-135M-Instruct in float32.
#
# | what | measured |
# | --- | --- |
# | greedy answer (chat template, 37-token prompt) | `The capital of France is Paris.` (8 tokens, `stop`) |
# | naive loop vs `transformers` generate, 16 greedy tokens | 16/16 identical; max logit difference 4.7e-05 |
# | `reference_attention` vs PyTorch SDPA | max difference 4.8e-07 |
# | 3 prompts, 6 tokens each: one flat batch vs one at a time | 1.4-1.7 s vs 2.2-2.5 s, identical tokens |
# | naive loop, 64 tokens after a 4-token prompt | 12.4-14.5 s of CPU time: 4.4-5.2 tokens/s (wall 12.4-18.6 s) |
# | CPU time per naive step | 103-122 ms at 4-7 tokens, about 300 ms at 64-67; fit 77-107 ms + 3.3-3.6 ms per token |
# | a step that feeds a single token | 64-74 ms of CPU time |
# | tokens pushed through the model for 64 generated tokens | 2272 (67 with a KV cache: 33.9x fewer) |
# | whole chapter, `python chapters/00_oracle.py` | 34-42 s wall (60-80 s while other jobs loaded the machine) |
#
# The ranges are three runs. The last cell prints this run's numbers for comparison; wall-clock times on a shared
# machine vary from run to run, CPU times much less.

# %%
print(wrap(f"this run: {N_GEN} tokens at {N_GEN / wall_s.sum():.2f} tokens/s wall ({N_GEN / cpu_s.sum():.2f} "
           f"tokens/s of CPU time); CPU per step {intercept * 1e3:.0f} ms + {slope * 1e3:.2f} ms/token; single-token "
           f"step {one_cpu_s * 1e3:.0f} ms; oracle {agree}/{N_ORACLE} tokens, max logit diff {logit_err:.1e}; "
           f"chapter ran in {time.perf_counter() - CHAPTER_START:.0f} s"))
