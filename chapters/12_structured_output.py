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
# # Chapter 12 — Structured output
#
# **What you will build.** Jump-forward decoding's plan (task 12.1, `plan_jump` in
# `minisgl_ref/constrained/jump_forward.py`): when the grammar leaves the model no choice, append the forced text
# at once, re-tokenized together with the end of the output so that the model sees the tokens it would have
# written itself.
#
# **Why it matters.** A program that asks a model for JSON needs JSON: not JSON inside a code fence, not JSON
# followed by a friendly explanation, not an object cut off half-way. Prompting makes valid output likely;
# *constraining the sampler* makes invalid output impossible. Before each token is sampled, every token that
# would take the output out of the grammar gets a logit of `-inf`. The model still chooses, but only among
# tokens that keep the output valid.
#
# In this chapter you will:
#
# 1. see the problem: a small model asked for JSON, without a constraint;
# 2. build a token mask by hand, from a regular expression through a hand-written automaton, and decode a toy
#    model with it; then see why real engines precompute masks, and why JSON needs a stack;
# 3. use the engine's grammars (xgrammar): JSON schemas, regexes and EBNF on the embedded model, a mask row
#    step by step, and a batch that mixes constrained and free requests;
# 4. see where the mask is filled in the overlapped loop, and what it costs on this CPU;
# 5. write jump-forward's plan (task 12.1) and count the decode steps it saves;
# 6. turn tool calls into a grammar;
# 7. run the oracle: a fresh matcher re-checks every sampled token.
#
# Modules: `minisgl_ref/constrained/` (grammar specs, compiling, matchers, the bitmask, jump-forward), and in it
# `constrained/extension.py` (`StructuredOutput`: what the engine's loop does for a constrained request, plugged
# into the engine's seam of chapter 06, `minisgl_ref/engine/extension.py`), `minisgl_ref/server/tools.py` (tool
# calls). The [structured output reference](../structured-output-reference.md) lists every JSON-schema keyword
# and holds the GPU measurements in full.

# %% tags=["setup"]
import json
import re
import time
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm's widget bar; its text bar is enough here

import jsonschema
import matplotlib.pyplot as plt
import numpy as np
import regex as regex_pkg
import torch
import xgrammar as xgr
from IPython.display import Markdown, display
from xgrammar.testing import _is_grammar_accept_string

from minisgl_ref import LLM, SamplingParams
from minisgl_ref.book import setup_chapter, shorten, show_code, show_table, wrap
from minisgl_ref.constrained import ANY_JSON, spec_of
from minisgl_ref.constrained import jump_forward
from minisgl_ref.constrained.bitmask import TokenBitmask
from minisgl_ref.constrained.extension import StructuredOutput
from minisgl_ref.constrained.jump_forward import plan_jump
from minisgl_ref.constrained.schema_support import unsupported_keyword
from minisgl_ref.core.config import EngineConfig
from minisgl_ref.engine.engine import Engine
from minisgl_ref.engine.extension import HOOKS, overrides
from minisgl_ref.constrained.structural_tag import to_xgrammar
from minisgl_ref.server.tools import Function, ToolCallParser, call_schema, call_structural_tag, plan_tools

CHAPTER_START = time.perf_counter()
ROOT = setup_chapter()  # one torch thread (MINISGL_THREADS for more), and the repository root

# %% [markdown]
# ## 1. The problem
#
# The embedded SmolLM2-135M-Instruct, asked twice for a JSON object, greedy. Can a program read what it writes?

# %%
llm = LLM(device="cpu")
tok = llm.tokenizer
VOCAB = llm.config.vocab_size


def chat(text: str) -> list[int]:
    return llm.chat_prompt_ids([{"role": "user", "content": text}])


def parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


QUESTIONS = ["Describe Ada Lovelace as a JSON object with the keys name and birth_year.",
             "Give me a JSON object with a person's name and age. Only JSON."]
free_outs = llm.generate([chat(q) for q in QUESTIONS], SamplingParams(temperature=0, max_new_tokens=48),
                         use_tqdm=False)
for o in free_outs:
    print(f"{o.finish_reason:<6} parses as JSON: {parses(o.text)!s:<5} {shorten(repr(o.text), 70)}")

# %% [markdown]
# Both are *nearly* JSON: a code fence around the object, a sentence after it, or an object still open when the
# token budget ran out. A person reads past that; `json.loads` does not. Stripping fences with a regular
# expression and retrying fixes some cases and not others. The fix that always works is to never sample a token
# that breaks the format. The rest of the chapter is how.
#
# ## 2. From a regex to a token mask, by hand
#
# Take a format small enough to check by eye: a signed integer, `-?(0|[1-9][0-9]*)` (`-7`, `0`, `42`, but not
# `007` or `-`). A regular expression is a finite automaton: a few states and, for each state and character, the
# next state. Here is one for our regex, written as a table (a missing entry is the dead state: no match can
# follow):

# %%
INT_REGEX = r"-?(0|[1-9][0-9]*)"
DIGITS19 = "123456789"
DFA = {  # state -> {character: next state}
    "start": {"-": "minus", "0": "zero", **{d: "digits" for d in DIGITS19}},
    "minus": {"0": "zero", **{d: "digits" for d in DIGITS19}},
    "zero": {},  # a leading 0 ends the number
    "digits": {d: "digits" for d in "0123456789"},
}
ACCEPTING = {"zero", "digits"}  # the text read so far is a whole match: the output may end here
EOS = "<eos>"


def walk(state: str | None, text: str) -> str | None:
    """The state after reading ``text`` from ``state``, or None (dead) as soon as a character has no edge."""
    for ch in text:
        if state is None:
            return None
        state = DFA[state].get(ch)
    return state


for s, edges in DFA.items():
    targets = {}
    for ch, t in edges.items():
        targets.setdefault(t, []).append(ch)
    shown = ", ".join(f"{''.join(chs) if len(chs) < 4 else chs[0] + '..' + chs[-1]} -> {t}" for t, chs in targets.items())
    print(f"{s:<7} {'(accepting)' if s in ACCEPTING else '':<11} {shown or 'no edges'}")

# %% [markdown]
# A model does not write characters, it writes *tokens*, and a token may be several characters. A token is
# allowed in a state if walking all its characters through the automaton never reaches the dead state; the end
# of the output (`<eos>`) is allowed only in an accepting state. That gives one mask per state. A toy vocabulary
# of twelve tokens:

# %%
TOY_VOCAB = ["-", "0", "1", "7", "42", "-5", "00", "10", "3-", "x", " ", EOS]


def mask_of(state: str, vocab: list[str]) -> list[bool]:
    """Which tokens of ``vocab`` keep the output inside the regex from ``state``."""
    return [state in ACCEPTING if t == EOS else walk(state, t) is not None for t in vocab]


MASKS = {s: mask_of(s, TOY_VOCAB) for s in DFA}


# %% alt="Grid of the integer automaton's states (rows) against twelve toy tokens (columns), a tick where the token is allowed and a dot where it is not: '-5' is allowed only in the start state, '3-' in none, '00' only after a non-zero digit, and the end of output only in accepting states." caption="The token mask of each state of the automaton for an integer regex, over a toy vocabulary of twelve tokens." tags=["hide-input"]
fig, ax = plt.subplots(figsize=(7, 2.2))
ax.imshow(np.array([MASKS[s] for s in DFA], dtype=float), cmap="Greens", vmin=-0.2, vmax=1.2, aspect="auto")
ax.set_xticks(range(len(TOY_VOCAB)), [repr(t) if t != EOS else t for t in TOY_VOCAB], fontsize=8)
ax.set_yticks(range(len(DFA)), list(DFA), fontsize=8)
for i, s in enumerate(DFA):
    for j, ok in enumerate(MASKS[s]):
        ax.text(j, i, "✓" if ok else "·", ha="center", va="center", fontsize=9)
ax.set_title(f"allowed tokens per automaton state, regex {INT_REGEX}", fontsize=9)
fig.tight_layout()
plt.show()

# %% [markdown]
# Read a column of Figure 12.1: `"3-"` is never allowed (its `-` can only come first), `"-5"` only at the start,
# `"00"` only once a non-zero digit has been written, and `<eos>` only after a whole number. Now a toy "model": at
# every step it produces random logits over the twelve tokens. Masking sets the forbidden ones to `-inf`, the sampler
# draws from the rest, and the automaton advances by the token drawn. We decode 200 outputs with the mask and 200
# without it.

# %%
def toy_decode(gen: torch.Generator, masked: bool, max_tokens: int = 30) -> tuple[str, bool]:
    """One output of the random toy model: (text, ended with <eos>)."""
    state, text = "start", ""
    for _ in range(max_tokens):
        logits = torch.randn(len(TOY_VOCAB), generator=gen)
        if masked:
            logits[~torch.tensor(MASKS[state])] = float("-inf")
        token = TOY_VOCAB[int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))]
        if token == EOS:
            return text, True
        text, state = text + token, walk(state, token)
    return text, False


gen = torch.Generator().manual_seed(0)
for masked in (False, True):
    outs = [toy_decode(gen, masked) for _ in range(200)]
    done = [t for t, ended in outs if ended]
    valid = [t for t in done if re.fullmatch(INT_REGEX, t)]
    prefixes = all(regex_pkg.fullmatch(INT_REGEX, t, partial=True) for t, ended in outs if not ended)
    print(f"{'masked  ' if masked else 'unmasked'}: {len(done)}/200 ended, {len(valid)} of them match the regex"
          + (f"; the {200 - len(done)} cut off are prefixes of a match: {prefixes}" if masked else ""))
    print("          e.g. " + shorten(str([t for t, _ in outs[:6]]), 85))
    if masked:
        assert len(valid) == len(done) and prefixes

# %% [markdown]
# Without the mask almost nothing is a number; with it, every output that ended is one, and an output cut off by
# the length limit is still on its way to one (it just had no room to finish: a real engine reports that as
# `finish_reason="length"`).
#
# **Why real engines precompute.** Computing a mask means walking every token of the vocabulary through the
# automaton: 49,152 tokens for SmolLM2, 151,936 for Qwen, at every step of every constrained request. For a
# regular expression the mask depends only on the automaton's state, so it can be computed once per state, when
# the grammar is compiled, and only *looked up* while decoding. Here is our hand-written automaton run over
# SmolLM2's real vocabulary:

# %%
t0 = time.perf_counter()
token_texts = [tok.hf.decode([i]) for i in range(len(tok.hf))]
t_decode = time.perf_counter() - t0
t0 = time.perf_counter()
REAL_MASKS = {s: [walk(s, t) is not None and t != "" for t in token_texts] for s in DFA}
t_masks = time.perf_counter() - t0
for s, m in REAL_MASKS.items():
    ex = [token_texts[i] for i in np.flatnonzero(m)[:: max(1, sum(m) // 6)][:6]]
    print(f"{s:<7} {sum(m):>3} of {len(token_texts):,} tokens allowed (plus EOS if accepting), e.g. {ex}")
print(f"all four masks in {t_masks * 1e3:.0f} ms of Python ({t_decode:.1f} s to decode the vocabulary once)")

# %% [markdown]
# About ten allowed tokens out of 49,152 in each state (SmolLM2 writes numbers one digit per token, so no token
# holds two digits), computed in tens of milliseconds of Python for this four-state automaton. A JSON schema's
# automaton has hundreds or thousands of positions, and the engine decodes with hundreds of requests at once:
# computed once per grammar, the table is cheap; recomputed at every step of every request, it would cost more
# than the forward pass.
#
# **Why JSON needs a stack.** Every `{` must be closed by a `}` in the right order, at any depth, and no finite
# automaton can count unbounded nesting. JSON schemas and EBNF grammars compile to a *pushdown* automaton, an
# automaton plus a stack of "where to return to" entries; its states (position, whole stack) are infinitely many,
# so one mask per state is out of reach. xgrammar, SGLang's default grammar backend, splits the vocabulary per
# grammar *position* instead:
#
# - **context-independent tokens** can be decided from the position alone, because they stay inside the rule
#   being matched: inside a JSON string, `abc` is allowed and `"\n` is not, whatever the stack holds. These are
#   the vast majority, and their verdict is precomputed when the grammar is compiled;
# - **context-dependent tokens** run past the end of the current rule (`"}` closes a string *and* an object),
#   so their verdict depends on what the stack says comes next. There are few, and only those are checked at run
#   time, by walking them through the automaton with the real stack.
#
# Filling a mask row is then "copy the precomputed bits of this position, then check a handful of tokens", a
# few microseconds to tens of microseconds, and the per-token work moves to compile time (milliseconds for a
# small schema, cached per grammar: `minisgl_ref/constrained/backend.py`).
#
# ## 3. xgrammar in the engine
#
# A request asks for a grammar with one sampling parameter: `json_schema` (a schema, or `ANY_JSON` for "any
# object"), `regex` or `ebnf`. The engine compiles it in the background (the request waits in the queue until its
# grammar is ready, never the other requests), gives the request a matcher, and masks its row of the logits at
# every step. The same two questions as in section 1, now with a schema:

# %%
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "birth_year": {"type": "integer", "minimum": 1000, "maximum": 2100}},
          "required": ["name", "birth_year"]}
PERSON_AGE = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"]}
SCHEMAS = [PERSON, PERSON_AGE]
params = [SamplingParams(temperature=0, max_new_tokens=48, json_schema=json.dumps(s)) for s in SCHEMAS]
json_outs = llm.generate([chat(q) for q in QUESTIONS], params, use_tqdm=False)
for schema, o in zip(SCHEMAS, json_outs):
    jsonschema.validate(json.loads(o.text), schema)
    print(f"{o.finish_reason:<6} valid for its schema: True  {o.text!r}")

# %% [markdown]
# The model wrote the same kind of content, but every token it picked was allowed by the schema, so the output is
# a complete, valid instance (`jsonschema.validate` would have raised otherwise). JSON is compiled *compact*
# (`", "` and `": "` between items, no newlines): with free whitespace a small model can loop on newlines inside
# the object until its tokens run out (`backend.py` explains). Regexes and EBNF grammars work the same way:

# %%
SUM_EBNF = 'root ::= num (" + " num){1,3} " = " num\nnum ::= [1-9] [0-9]?'
other = [("regex", r"(yes|no)\. [A-Z][a-z ]{3,30}\.", "Is the sky blue? Answer yes or no, then explain."),
         ("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}", "When did the first person walk on the moon? Give the date."),
         ("ebnf", SUM_EBNF, "Write an addition of small numbers and its result.")]
outs = llm.generate([chat(q) for _, _, q in other],
                    [SamplingParams(temperature=0, max_new_tokens=32, **{kind: g}) for kind, g, _ in other],
                    use_tqdm=False)
for (kind, g, _), o in zip(other, outs):
    print(f"{kind:<5} {o.finish_reason:<6} {o.text!r}")
assert re.fullmatch(other[0][1], outs[0].text) and re.fullmatch(other[1][1], outs[1].text)
assert re.fullmatch(r"[1-9][0-9]?( \+ [1-9][0-9]?){1,3} = [1-9][0-9]?", outs[2].text)

# %% [markdown]
# The grammar guarantees the *form*, not the *truth*: the arithmetic may well be wrong. A grammar cannot make a
# 135M-parameter model smarter; it only removes the outputs a program could not read.
#
# **A mask row, step by step.** The engine's matcher (`constrained/matcher.py`) wraps xgrammar's; `fill` writes
# one row of a packed bitmask (bit `v` set: token `v` allowed; 32 tokens per int32, so 6 KB per row for 49,152
# tokens). We replay the first output above through a fresh matcher and count the allowed tokens before each
# token.

# %%
def allowed_count(state) -> int:
    """How many of the vocabulary's tokens ``state`` allows next (the set bits of its mask row)."""
    mask = xgr.allocate_token_bitmask(1, VOCAB)
    state.fill(mask, 0)
    bits = (mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return int(bits.sum())


structured = llm.engine.extensions.find(StructuredOutput)  # the engine's structured-output extension
backend = structured.backend  # its grammar backend: compiled grammars are cached per (kind, source)
state = backend.matcher(backend.compile(spec_of(params[0])), llm.eos_token_ids)
counts, pieces = [], []
for t in json_outs[0].output_ids:
    counts.append(allowed_count(state))
    pieces.append(tok.hf.decode([t]))
    assert state.accept(t)
print(wrap(" ".join(f"{p!r}:{c}" for p, c in zip(pieces, counts)), indent=""))


# %% alt="Bar chart with a log y axis, one bar per output token of a JSON object: one or a few allowed tokens at the braces, keys and punctuation, tens of thousands inside the name string, and about ten inside the integer." caption="Allowed tokens before each output token of a JSON object for the PERSON schema, out of a vocabulary of 49,152." tags=["hide-input"]
fig, ax = plt.subplots(figsize=(8, 2.6))
ax.bar(range(len(counts)), counts, color="tab:green")
ax.set_yscale("log")
ax.set_xticks(range(len(pieces)), pieces, rotation=60, fontsize=7)
ax.set_ylabel("allowed tokens")
ax.set_title(f"allowed tokens before each output token (vocabulary {VOCAB:,}), schema PERSON", fontsize=9)
fig.tight_layout()
plt.show()

# %% [markdown]
# In Figure 12.2, where the schema fixes the text (the opening brace, the keys, the punctuation) one or a handful of
# tokens are allowed: the tokens that are a *prefix* of the fixed text, like `{"` and `{`. (Look at what the model
# chose there: `{` and then `"`, two tokens where the tokenizer would write one, `{"`. The mask allows both spellings;
# section 5 comes back to this.) Inside the name string tens of
# thousands are (any token without a quote or a control character, within the length limit); inside the integer
# only the digits. Those runs of one allowed token are what jump-forward will skip (section 5).
#
# **Only constrained rows pay.** A batch can mix constrained and free requests. Only the constrained rows get a
# mask row (`TokenBitmask.apply` gets their indices): a free row's logits are never read, so its output is what it
# would have been without the constrained requests beside it.

# %%
FREE_PROMPTS = ["The capital of France is", "def fibonacci(n):"]
free_params = SamplingParams(temperature=0, max_new_tokens=16)
mixed = llm.generate([chat(q) for q in QUESTIONS] + [tok.encode(p) for p in FREE_PROMPTS],
                     params + [free_params] * 2, use_tqdm=False)
alone = llm.generate([tok.encode(p) for p in FREE_PROMPTS], free_params, use_tqdm=False)
for o in mixed:
    print(repr(o.text))
assert [o.output_ids for o in mixed[2:]] == [o.output_ids for o in alone]
assert [o.text for o in mixed[:2]] == [o.text for o in json_outs]
print("free requests identical to a run without the constrained ones: True")

# %% [markdown]
# **The mask against the sampler's other rules.** The grammar's `-inf` meets the sampler's own rules (chapter 02),
# which can ban what the grammar allows: `min_new_tokens` bans EOS where a complete grammar allows nothing else,
# and stop ids that are text tokens can corner a grammar. In the first case the grammar wins, in the second the
# stop ids do; the [structured output reference](../structured-output-reference.md#the-mask-against-the-samplers-other-rules)
# shows both.
#
# **What a schema may ask for.** The grammar is the only thing that holds the model to a schema, so a keyword
# xgrammar does not turn into grammar is not a hint the model may follow, it is a hole: xgrammar logs a warning
# at most, and the output can be `["a", "a"]` under `uniqueItems`, or a bare `12321` where an `allOf` of two
# object schemas asked for an object. So before a schema is compiled, the engine reads it the way xgrammar's
# converter does (`constrained/schema_support.py`) and refuses it if any keyword would be skipped, naming the
# keyword and where it sits: a `ValueError` offline, an HTTP 400 on the server.

# %%
TAGS = {"type": "object", "required": ["tags"],
        "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}
print("xgrammar's grammar for TAGS accepts a repeated tag:",
      _is_grammar_accept_string(xgr.Grammar.from_json_schema(json.dumps(TAGS)), '{"tags": ["a", "a"]}'))
try:
    llm.generate(chat("List three tags."), SamplingParams(max_new_tokens=8, json_schema=TAGS), use_tqdm=False)
except ValueError as e:
    print(wrap(f"refused: {e}"))
display(show_table([(f"`{json.dumps(schema)}`", unsupported_keyword(schema))
                    for schema in [{"type": "number", "multipleOf": 0.5},
                                   {"allOf": [{"type": "object"}, {"required": ["a"]}]},
                                   {"type": "string", "pattern": "^(?!admin)[a-z]+$"}, {"minimum": 5}]],
                   headers=["schema", "why the engine refuses it"]))
assert unsupported_keyword(PERSON) is None and unsupported_keyword(TAGS).startswith("the keyword 'uniqueItems'")

# %% [markdown]
# What passes is an allow-list, in short:
#
# | kind | examples |
# | --- | --- |
# | enforced | `type`, `enum`, `const`, `anyOf`, `$ref`, `properties`, `items`, bounds on numbers, lengths and counts, `pattern`, the common `format`s |
# | enforced under conditions | `required`, `allOf` of one schema, `oneOf` with disjoint options, `multipleOf` on integers |
# | ignored (they only describe) | `title`, `description`, `examples`, `default` |
# | refused | `not`, `if`/`then`/`else`, `uniqueItems`, `contains`, `dependentRequired`, `multipleOf` on numbers, lookaround in a `pattern` |
#
# The [structured output reference](../structured-output-reference.md) lists every keyword and its conditions.
# Why refuse rather than do one's best? `uniqueItems` over strings needs an automaton that remembers every item
# written so far, and `not` asks for the complement of a context-free language, which need not be context-free.
# An approximation that lets one bad output through breaks the same promise as ignoring the keyword; a client
# that gets a 400 can rewrite its schema, a client that gets a 200 with a duplicate in its "unique" list never
# finds out.

# %% [markdown]
# ## 4. Where the mask is filled: the overlap
#
# **How structured output plugs into the engine.** None of what follows is written into the engine's loop: the
# loop of chapter 06 declares a seam (`EngineExtension`), and `StructuredOutput` (`constrained/extension.py`) is an
# extension that `build_runtime` gives every paged engine. A grammar request meets it at these hooks:
#
# | hook | what structured output does there |
# | --- | --- |
# | `check` | refuses a grammar when the engine has no tokenizer (naming the field) |
# | `admit` | starts the grammar's compile on the backend's threads |
# | `ready` | holds the request in the queue while its grammar compiles |
# | `before_step` | polls the compiles: a matcher for each one done, an abort for each one that failed |
# | `logits_processor` | advances the matchers by the step in flight's tokens, fills and applies the masks (below) |
# | `before_token` | the matcher accepts the token (or its earlier outcome counts); a refused token aborts |
# | `after_token` | a grammar that has ended ends the request; jump-forward (section 5) |
# | `after_step` | forgets the outcomes it kept for the step just processed |

# %%
print(wrap(f"StructuredOutput overrides: {[hook for hook in HOOKS if overrides(structured, hook)]}"))

# %% [markdown]
# A mask depends on every token the request has accepted so far, including the one sampled at the previous step.
# Under overlap scheduling (chapter 06) that token is still on the device when the next step is launched. Filling
# the mask *before* launching the next forward would make the device wait for the CPU at every step. The engine
# instead splits a step with constrained rows in two (`StructuredOutput.logits_processor`, and the
# `before_sampling` callback of `ModelRunner.run`):
#
# 1. launch the forward of step N+1 (it needs no mask: the mask only acts on its logits);
# 2. meanwhile on the CPU, wait for step N's tokens, advance the matchers with them
#    (`StructuredOutput._accept_early`), fill step N+1's mask rows;
# 3. copy the mask to the device, apply it to the constrained rows' logits, launch step N+1's sampling;
# 4. only then process step N as any step is processed (chapter 06): detokenize its tokens, check the stop rules,
#    finish the requests that are done, jump forward (section 5). When a token reaches `Req.append_token`, its
#    matcher has already accepted it in step 2, and the engine uses that outcome instead of accepting it twice.
#
# Step 2 needs only step N's tokens in the matchers, not the text or the stop strings, so the rest of processing
# step N (around a millisecond of host work for a few dozen rows) waits until sampling is launched. A row in step
# N+1 of a request that step N finished or moved by jump-forward may get a mask from an outdated state; its token is
# discarded when step N+1 is processed, as every token of a finished request is (the
# [structured output reference](../structured-output-reference.md#the-overlap-in-detail) has the details).
#
# The timelines of Figure 12.3 are a schematic (lengths in arbitrary units, not measured) of the two orders.

# %% alt="Two schematic timelines, each with a CPU lane and a device lane. Top: after sampling step N the device waits while the CPU accepts the tokens and fills the mask, then runs forward N+1. Bottom: forward N+1 starts right after sampling N; accepting, filling and processing happen on the CPU during it, and only the sampling of N+1 waits for the mask." caption="Two orders for a constrained decode step (a schematic): the mask filled before the next forward, and this engine's order, where the next forward runs while the CPU fills the mask." tags=["hide-input"]
def lane_bars(ax, y: float, bars: list[tuple[str, float, float, str]]) -> None:
    for label, start, length, color in bars:
        ax.broken_barh([(start, length)], (y - 0.35, 0.7), facecolor=color, edgecolor="white", lw=0.5)
        ax.text(start + length / 2, y, label, ha="center", va="center", fontsize=7,
                color="white" if color in ("tab:blue", "tab:purple", "tab:red") else "black")


FWD, SAMPLE, ACCEPT, PROC, FILL, SCHED = 6.0, 1.0, 0.5, 1.5, 1.5, 1.0
fig, axes = plt.subplots(2, 1, figsize=(10, 3.4), sharex=True)
# Mask first: the CPU must see N's tokens and fill N+1's mask before N+1's forward is launched.
t, cpu, dev = 0.0, [], []
dev.append(("forward N", t, FWD, "tab:blue")), dev.append(("sample N", t + FWD, SAMPLE, "tab:cyan"))
t_done = t + FWD + SAMPLE
start = t_done + ACCEPT + FILL
cpu += [("schedule N+1", 0.5, SCHED, "tab:green"), ("acc", t_done, ACCEPT, "tab:red"),
        ("fill N+1", t_done + ACCEPT, FILL, "tab:orange"), ("process N", start, PROC, "tab:purple")]
dev += [("forward N+1", start, FWD, "tab:blue"), ("mask+sample N+1", start + FWD, SAMPLE + 0.4, "tab:cyan")]
lane_bars(axes[0], 1, cpu), lane_bars(axes[0], 0, dev)
axes[0].set_title("mask filled before the forward: the device idles while the CPU accepts N's tokens and fills",
                  fontsize=9)
# This engine: forward N+1 is launched first; accepting N's tokens and filling overlap with it, and step N is
# processed once N+1's sampling has been launched.
cpu, dev = [], [("forward N", 0, FWD, "tab:blue"), ("sample N", FWD, SAMPLE, "tab:cyan")]
cpu += [("schedule N+1", 0.5, SCHED, "tab:green"), ("acc", FWD + SAMPLE, ACCEPT, "tab:red"),
        ("fill N+1", FWD + SAMPLE + ACCEPT, FILL, "tab:orange"),
        ("process N", FWD + SAMPLE + ACCEPT + FILL, PROC, "tab:purple")]
dev += [("forward N+1", FWD + SAMPLE, FWD, "tab:blue"),
        ("mask+sample N+1", 2 * FWD + SAMPLE, SAMPLE + 0.4, "tab:cyan")]
lane_bars(axes[1], 1, cpu), lane_bars(axes[1], 0, dev)
axes[1].set_title("this engine: forward N+1 runs while the CPU accepts N's tokens (acc), fills the mask and "
                  "processes N; only sampling waits, for the mask", fontsize=9)
for ax in axes:
    ax.set_yticks([0, 1], ["device", "CPU"])
axes[1].set_xlabel("time (schematic)")
fig.tight_layout()
plt.show()

# %% [markdown]
# In the lower timeline of Figure 12.3 the device runs forward after forward; the mask is ready before the forward it
# belongs to has finished, as long as accepting and filling take less time than a forward. A step with no constrained
# row gets no callback at all, and runs exactly as in chapter 06.
#
# Keep in mind what this order does not change: the CPU still has to process step N before it can schedule and
# launch step N+2. When the CPU, not the device, is what limits the step (as on a GPU with this small model,
# section 7), the step takes as long as the CPU's work per step, whatever its order: the grammar's own share of
# it is accepting the tokens and filling the masks.
#
# **What it costs, measured on this CPU.** Two numbers. First, the mask work itself, per constrained row: filling
# one row from a JSON matcher and applying it to one row of logits. Second, whole runs: four JSON requests against
# four *free twins* (the same prompts, no grammar, each held to exactly its twin's output length), so that both
# produce the same number of tokens. On a CPU nothing overlaps (chapter 06): the mask work adds to the step.

# %% tags=["hide-input"]
def time_mask_rows(rows: int, repeat: int = 50) -> float:
    """Microseconds per row to fill ``rows`` mask rows from fresh JSON matchers and apply them to the logits."""
    states = [backend.matcher(backend.compile(spec_of(params[0])), llm.eos_token_ids) for _ in range(rows)]
    for s in states:
        s.accepts(json_outs[0].output_ids[:4])  # inside the name string: the biggest allowed set
    mask, logits = TokenBitmask(VOCAB, rows), torch.randn(rows, VOCAB)
    t0 = time.perf_counter()
    for _ in range(repeat):
        mask.fill(list(enumerate(states)))
        mask.apply(logits, list(range(rows)))
    return (time.perf_counter() - t0) / repeat / rows * 1e6


def engine_run(prompts, params_list, **config) -> tuple[list, float, Engine]:
    """Run the requests in a fresh engine on the embedded model; (requests, wall seconds, engine)."""
    engine = Engine(llm.model, llm.config, EngineConfig(**config), device="cpu", context_length=llm.context_length,
                    extensions=[StructuredOutput(backend)])
    reqs = [llm.make_request(p, sp) for p, sp in zip(prompts, params_list)]
    t0 = time.perf_counter()
    for r in reqs:
        engine.add_request(r)
    engine.run_until_done()
    return reqs, time.perf_counter() - t0, engine


print(f"mask fill + apply: {time_mask_rows(1):.0f} us per row alone, {time_mask_rows(4):.0f} us per row in 4 rows")
BENCH_Q = ["a nurse from Lyon", "a retired pilot", "a young painter in Oslo", "a chess teacher"]
bench_prompts = [chat(f"Describe {who} as a JSON object with a name and an age.") for who in BENCH_Q]
bench_params = [SamplingParams(temperature=0, max_new_tokens=40, json_schema=json.dumps(PERSON_AGE))] * 4
engine_run(bench_prompts[:1], bench_params[:1])  # warm-up: the grammar is compiled and cached
cons, t_cons, _ = engine_run(bench_prompts, bench_params)
twins = [SamplingParams(temperature=0, max_new_tokens=len(r.output_ids), ignore_eos=True) for r in cons]
free, t_free, _ = engine_run(bench_prompts, twins)
n_tok = sum(len(r.output_ids) for r in cons)
assert n_tok == sum(len(r.output_ids) for r in free)
print(f"batch of 4, {n_tok} output tokens each run (this CPU, one thread), ms per output token:\n"
      f"  constrained {t_cons / n_tok * 1e3:.1f}, free {t_free / n_tok * 1e3:.1f} (ratio {t_cons / t_free:.2f})")

# %% [markdown]
# On this CPU a row's mask (fill and apply, over 49,152 logits) costs a fraction of a millisecond, against tens
# of milliseconds of decoding per output token for the 135M model: the two runs differ by the noise of a shared
# machine, not by the grammar. On a GPU the forward of a
# small batch shrinks to a few milliseconds while the mask work stays on the CPU, which is why it must hide behind
# the forward (the overlap above), and why, at large batches, the CPU work per constrained row is what to watch.
#
# ## 5. Jump-forward decoding (task 12.1)
#
# Look again at the mask counts of section 3: after `{` the schema allows only the continuation `"name": "`,
# which the model spends four decode steps to write, one forced token per step. Jump-forward decoding asks the
# matcher for the text that *every* valid continuation starts with (`jump_forward_string`), appends its tokens at
# once, and computes their KV in one extend step (chapter 05's extend rows, riding along with the decode rows).
#
# The catch is tokenization. The forced text tokenized on its own is not always how the model would have written
# it: a BPE tokenizer merges characters across the boundary between what was sampled and what is forced. After
# `"Ada"` the grammar forces `, "age": `; alone, `,` is a token, but SmolLM2 writes `",` (quote and comma) as one
# token. Feeding the model tokens it would never produce pushes it off what it was trained on. So the plan
# re-tokenizes the last few output tokens *together with* the forced text, keeps what did not change, rolls the
# matcher back by the rest, and advances it by the new tokens. Trailing whitespace is left to the model: BPE
# vocabularies glue a space to the word after it (` 36`), so a lone forced space would be a token the model
# rarely writes.
#
# The same problem sits at the far end of the forced text. The grammar stops forcing in the middle of what the
# tokenizer writes as one token: after `"skills":` it forces ` [`, and SmolLM2's own token there is ` ["`. Appending
# ` [` leaves the model to write `"` as a separate token, a sequence it never saw in training, and with real
# weights it then drifted into `["./Lyon/Lyon/...` until its length limit in most of a batch. So the plan holds the
# last forced token back: the model samples it (or a longer token that starts with it) itself, at the price of one
# decode step per jump, and a forced stretch of a single token is not jumped at all. This is task 12.1:

# %%
show_code(jump_forward, task="12.1")

# %% [markdown]
# The example of the docstring, on a real matcher: the output so far is `{"name": "Ada"`.

# %%
state = backend.matcher(backend.compile(spec_of(bench_params[0])), llm.eos_token_ids)
out_ids = tok.hf.encode('{"name": "Ada"', add_special_tokens=False)
assert state.accepts(out_ids)
print(f"output tokens {[tok.hf.decode([t]) for t in out_ids]}, forced: {state.jump_forward_string()!r}")
jump = plan_jump(state, tok.hf, out_ids, max_rollback=4)
print(f"forced text tokenized alone: {[tok.hf.decode([t]) for t in jump.text_ids]}")
print(f"plan: roll back {jump.rollback}, append {[tok.hf.decode([t]) for t in jump.tokens]}")
new_ids = out_ids[: len(out_ids) - jump.rollback] + jump.tokens
print(f"new output {[tok.hf.decode([t]) for t in new_ids]} = {tok.hf.decode(new_ids)!r}")
assert new_ids == tok.hf.encode('{"name": "Ada", "age', add_special_tokens=False)
print(f"still forced, for the model to sample: {state.jump_forward_string()!r}")

# %% [markdown]
# In the engine (`StructuredOutput._jump_forward`, from its `after_token` hook), the request's output is cut by
# `rollback` tokens and grows by the new ones (`Req.replace_tail`), its KV is kept up to where the old and new
# tokens agree, and the scheduler gives it an extend row over the new tokens next.
# We run six JSON requests with jump-forward off and on (`EngineConfig.enable_jump_forward`) and read the engine's
# step counters and the extension's jump counters.

# %%
JF_SCHEMAS = [PERSON_AGE, PERSON,
              {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                "y": {"type": "integer", "minimum": -9, "maximum": 9}},
               "required": ["x", "y"]},
              {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                "country": {"type": "string", "maxLength": 12},
                                                "population": {"type": "integer", "minimum": 0}},
               "required": ["city", "country", "population"]}]
jf_prompts = [chat(f"Reply with a JSON value for this JSON schema, nothing else:\n{json.dumps(s)}") for s in JF_SCHEMAS]
jf_params = [SamplingParams(temperature=0, max_new_tokens=48, json_schema=json.dumps(s)) for s in JF_SCHEMAS]
runs = {}
for jf in (False, True):
    runs[jf] = engine_run(jf_prompts, jf_params, enable_jump_forward=jf)
    for schema, r in zip(JF_SCHEMAS, runs[jf][0]):
        jsonschema.validate(json.loads(r.output_text), schema)
        assert r.output_text == tok.decode(r.output_ids)
print(f"{'':<22}{'steps':>6}{'decode tokens':>14}{'jumps':>6}{'jumped tokens':>14}{'wall s':>8}")
for jf, (reqs, wall, engine) in runs.items():
    s, jumps = engine.stats, engine.extensions.find(StructuredOutput)
    print(f"{'jump-forward ' + ('on' if jf else 'off'):<22}{s.steps:>6}{s.decode_tokens:>14}{jumps.jump_forwards:>6}"
          f"{jumps.jump_forward_tokens:>14}{wall:>8.1f}")
for a, b in zip(runs[False][0], runs[True][0]):
    verdict = "same text" if a.output_text == b.output_text else "DIFFERENT"
    verdict += ", same tokens" if a.output_ids == b.output_ids else ", other tokens"
    print(f"{verdict:<25} {a.output_text!r}" + ("" if a.output_text == b.output_text else f"  vs  {b.output_text!r}"))
assert runs[True][2].stats.steps < runs[False][2].stats.steps

# %% [markdown]
# Every output is still valid, and the jumping engine took fewer steps: every forced key and separator was
# appended in one extend row instead of one decode step per token. On a GPU, where a small model's decode step
# costs about the same at batch 1 as at batch 64, fewer steps is directly less time for a single request; for a
# full batch the extend rows are extra work in the steps that carry them, and the gain is smaller.
#
# **Why it is off by default.** Greedy outputs with and without jump-forward may differ (here the texts agree; the
# tokens that spell them need not). The forced tokens are the canonical tokenization of the text, while the mask
# also allows its *non-canonical* pieces, which the model sometimes prefers (section 3's output started with `{`
# then `"`, where jump-forward appends `{"`), and after other tokens its next choice can differ. The output is
# valid either way, but it is not the oracle's, and on a GPU it is slower (section 7); so jumping is opt-in
# (`EngineConfig(enable_jump_forward=True)`, `--enable-jump-forward`).
#
# ## 6. Tool calls as a grammar
#
# A model "calls a function" by writing text in an agreed shape; the server recognises the shape and returns a
# structured call (`minisgl_ref/server/tools.py`). OpenAI's `tool_choice` decides how much is promised:
#
# - `"required"` or a named function promises that the answer *is* a call with valid arguments. A prompt cannot
#   promise that for a 135M model, so the server turns the tools into a JSON schema (`call_schema`: the name
#   pinned with `const`, the arguments by the function's parameter schema) and constrains decoding with it;
# - `"auto"` leaves the choice to the model: whether to call is never constrained, and a parser
#   (`ToolCallParser`) finds `<tool_call>` blocks in whatever the model wrote. Once a tool is `strict`, the
#   calls' *arguments* are held to their schemas all the same, by a structural tag (below).

# %%
weather = Function("get_weather", "Current weather in a city.",
                   {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
                    "required": ["city", "unit"]})
clock = Function("get_time", "Current time in a time zone.",
                 {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}}, "required": ["zone"]})
named = plan_tools([weather, clock], {"type": "function", "function": {"name": "get_weather"}})
schema = call_schema(named)
print(wrap(f"named function -> schema: {json.dumps(schema)}"))
out = llm.generate(chat("What is the weather like in Paris?"),
                   SamplingParams(temperature=0, max_new_tokens=64, json_schema=json.dumps(schema)), use_tqdm=False)[0]
parser = ToolCallParser(named.names, form="object")
parser.feed(out.text), parser.finish()
print(wrap(f"model output: {out.text!r}\nparsed calls: {[c.openai()['function'] for c in parser.calls]}"))
assert out.finish_reason == "stop" and parser.calls[0].name == "get_weather"
jsonschema.validate(json.loads(parser.calls[0].arguments), weather.parameters)

auto = ToolCallParser(plan_tools([weather, clock], "auto").names, form="tagged")
for piece in ['Let me check. <tool_call>{"name": "get_time", ', '"arguments": {"zone": "Europe/Paris"}}</tool_call>']:
    auto.feed(piece)
auto.finish()
print(wrap(f"auto: content {auto.content!r}, calls {[c.openai()['function'] for c in auto.calls]}"))

# %% [markdown]
# With a named function the model could not write anything but a `get_weather` call with a city and a unit;
# `"required"` with several tools gives an `anyOf` over them (and an array of calls when parallel calls are
# allowed). In `"auto"` mode the second snippet is hand-written text, fed in two pieces as a stream would deliver
# it: the parser sends the content and, once the head `{"name": "get_time", "arguments": ` has been read, the
# call.
#
# **Strict tools under `"auto"`: a structural tag.** A function marked `strict: true` promises arguments that
# follow its schema, even when the model decides for itself whether to call. A grammar can keep that promise
# without taking the decision away, by constraining only *part* of the output. A structural tag (SGLang's
# `structural_tag` sampling parameter) lists a *trigger*, `<tool_call>`, and one *structure* per function: a fixed
# begin string naming the function, its parameter schema, and a fixed end string. The text is free until the
# trigger is written; from there the grammar allows only one of the structures, and after its end the text is free
# again. The server builds it with `call_structural_tag` once any tool is strict.

# %%
strict = SamplingParams(structural_tag=call_structural_tag(plan_tools([weather, clock], "auto")))
print("begin:", repr(json.loads(strict.structural_tag)["structures"][0]["begin"]))
tagged = xgr.Grammar.from_structural_tag(to_xgrammar(strict.structural_tag))
call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n</tool_call>'
for text in ["No call is needed.", f"Let me check. {call} Done.",
             call.replace("get_time", "get_date"), call.replace('"Europe/Paris"', "42")]:
    print(f"{_is_grammar_accept_string(tagged, text)!s:5}  {shorten(repr(text), 93)}")
assert _is_grammar_accept_string(tagged, f"Let me check. {call} Done.")
assert not _is_grammar_accept_string(tagged, call.replace('"Europe/Paris"', "42"))

# %% [markdown]
# Free text passes, and so does a well-formed call amid it; a call to a function that is not among the tools, or
# with a number where the schema asks for a string, cannot be written.
#
# **Definitions move to the root.** A tool made from a pydantic model keeps nested models in `$defs`, and a
# reference is resolved from the root of the *whole* schema, so `call_schema` moves each function's definitions to
# the root under names that start with the function's (the reference page has an example). The forced modes, and
# `"auto"` with a strict tool, refuse a tool whose schema uses a refused keyword; in `"auto"` without strict tools
# nothing is enforced, and the schema is only text in the prompt.

# %% [markdown]
# ## 7. The oracle
#
# The tests' oracle for constrained decoding (`tests/test_constrained.py`) does not trust the engine's masks: it
# samples *hot* (temperature 1.5, so the model wants to stray), then replays every output through a **fresh**
# xgrammar matcher, token by token. Every token must be accepted, and an output that ended with a stop must leave
# the matcher terminated; for regexes, the independent `regex` package checks that every decoded prefix can still
# be extended to a full match. A small version:

# %%
cases = [("json_schema", json.dumps(PERSON_AGE)), ("json_schema", ANY_JSON), ("regex", other[0][1]),
         ("regex", other[1][1]), ("ebnf", SUM_EBNF)]
hot = [SamplingParams(temperature=1.5, seed=100 + i, max_new_tokens=40, **{k: src}) for i, (k, src) in enumerate(cases)]
hot_reqs, _, _ = engine_run([chat("Say anything you like.")] * len(cases), hot)
for (kind, src), r in zip(cases, hot_reqs):
    fresh = xgr.GrammarMatcher(backend.compile(spec_of(r.params)), override_stop_tokens=sorted(llm.eos_token_ids))
    accepted = 0
    for t in r.output_ids:
        assert fresh.accept_token(t), (kind, r.output_ids[: accepted + 1])
        accepted += 1
    assert fresh.is_terminated() if r.finish_reason.kind == "stop" else r.finish_reason.kind == "length"
    if kind == "regex":
        assert all(regex_pkg.fullmatch(src, tok.decode(r.output_ids[:k]), partial=True)
                   for k in range(1, len(r.output_ids) + 1) if "\ufffd" not in tok.decode(r.output_ids[:k]))
    print(f"{kind:<11} {r.finish_reason.kind:<6} {accepted:>2}/{len(r.output_ids)} tokens re-accepted  "
          f"{r.output_text[:60]!r}")

# %% [markdown]
# Every token of every output passes a matcher that never saw the engine. A hot sampler happily writes odd names
# and odd numbers, but never a token outside its grammar.

# %%
BENCHES = {"bounded strings": ROOT / "docs" / "data" / "constrained_bench_h100.json",
           "no length bounds": ROOT / "docs" / "data" / "constrained_bench_typical_h100.json"}
GPU_BENCH = {name: json.loads(path.read_text()) for name, path in BENCHES.items() if path.exists()}
if len(GPU_BENCH) == len(BENCHES):  # GPU results, written by scripts/gpu/measure/constrained_bench.py
    display(Markdown("**On a GPU.** `scripts/gpu/measure/constrained_bench.py` on an H100, default engine: random "
                     "weights in SmolLM2-135M's shape with its real tokenizer (the cost of a grammar depends on the "
                     "vocabulary and the grammar, not on the weights), the five-field schema of the script with "
                     "bounded strings, then the same fields without bounds. Time per decode step for constrained "
                     "requests, their free twins (same prompts, same output lengths) and jump-forward."))
    for name, gpu in GPU_BENCH.items():
        by = {(r["batch_size"], r["run"]): r for r in gpu["results"]}
        for summary in gpu["summary"]:
            b = summary["batch_size"]
            print(f"{name:<16} batch {b:>3}: constrained/free {summary['constrained_over_free_time_per_token']:.2f}, "
                  f"jump-forward/constrained {summary['jump_forward_over_constrained_wall']:.2f}, valid "
                  f"{b - by[(b, 'constrained')]['invalid']}/{b}")


# %% alt="Two grouped bar charts of milliseconds per decode step at batch 1, 64 and 256, with bars for free, constrained and jump-forward requests. Bounded strings: at batch 256 the free step takes about 10 ms, the constrained one about 60 and jump-forward about 185. No length bounds: the three bars stay within about 25 percent of each other, about 12 to 15 ms at batch 256." caption="Decode step time on an H100 for constrained requests, their free twins and jump-forward, with bounded strings and without length bounds." tags=["hide-input"]
if len(GPU_BENCH) == len(BENCHES):
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.2))
    for ax, (name, gpu) in zip(axes, GPU_BENCH.items()):
        by = {(r["batch_size"], r["run"]): r for r in gpu["results"]}
        sizes = sorted({r["batch_size"] for r in gpu["results"]})
        width = 0.27
        for k, (run, color) in enumerate([("free", "tab:gray"), ("constrained", "tab:green"),
                                          ("jump_forward", "tab:orange")]):
            ax.bar(np.arange(len(sizes)) + (k - 1) * width, [by[(b, run)]["ms_per_step"] for b in sizes], width,
                   label=run.replace("_", "-"), color=color)
        ax.set_xticks(range(len(sizes)), [f"batch {b}" for b in sizes])
        ax.set_ylabel("ms per decode step")
        ax.set_title(f"H100, {name}", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()

# %% [markdown]
# Figure 12.4 gives two very different answers, and the difference is the schema. With **bounded strings**
# (`maxLength` on every string, as in the script's schema) every output is a complete, valid object, and the grammar
# is cheap at batch 1 (about 10% per token) but 4.4x the free time per token at batch 64: filling a row cost about 0.9
# ms of CPU per step on average on that machine, and even spread over xgrammar's threads, 64 rows take longer than the
# 5 ms forward pass the fill overlaps with, so the device waits. **Without length bounds** a row inside a string costs
# about 0.01 ms and the grammar adds 4-11% per token; but with random weights these outputs never closed their
# first string within 600 tokens, so this measures the cheap state only, not a whole object. Jump-forward saves
# decode steps on structure (the bounded run's keys and punctuation: 65-70% fewer steps), and with random weights
# the few jumps cost little; with real weights they cost a lot (above).
#
# Where inside a bounded string does the time go? The cell below fills one mask row after a growing number of
# characters of a string of at most 40, on this CPU.

# %%
def fill_ms(schema: dict, text: str, repeat: int = 30) -> float:
    """Milliseconds to fill one mask row once the output so far is ``text``."""
    state = backend.matcher(backend.compile(spec_of(SamplingParams(json_schema=json.dumps(schema)))),
                            llm.eos_token_ids)
    assert state.accepts(llm.tokenizer.encode(text))
    mask = TokenBitmask(VOCAB, 1)
    mask.fill([(0, state)])
    t0 = time.perf_counter()
    for _ in range(repeat):
        mask.fill([(0, state)])
    return (time.perf_counter() - t0) / repeat * 1e3


NAME = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
NAME40 = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}}, "required": ["name"]}
written = list(range(0, 41, 2))
bounded_ms = [fill_ms(NAME40, '{"name": "' + "a" * n) for n in written]
free_ms = [fill_ms(NAME, '{"name": "' + "a" * n) for n in written]
print(f"maxLength 40: {min(bounded_ms):.3f}-{max(bounded_ms):.3f} ms per row (peak after "
      f"{written[int(np.argmax(bounded_ms))]} characters); no bound: at most {max(free_ms):.3f} ms")


# %% alt="Line chart of milliseconds to fill one mask row against the characters of the string written so far, 0 to 40: the unbounded line stays flat near zero; the maxLength 40 line also stays near zero for the first two dozen characters, then climbs to a peak of a few milliseconds around the thirtieth and falls back to zero at the bound." caption="Time to fill one mask row inside a JSON string, with a bound of 40 characters and without one, on this CPU." tags=["hide-input"]
fig, ax = plt.subplots(figsize=(7, 2.8))
ax.plot(written, bounded_ms, marker="o", label="maxLength 40")
ax.plot(written, free_ms, marker="s", label="no bound")
ax.set_xlabel("characters of the string written so far")
ax.set_ylabel("ms to fill one mask row")
ax.set_title("one mask row inside a JSON string, this CPU", fontsize=9)
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# In Figure 12.5, far from the bound a row costs a few hundredths of a millisecond (ten times an unbounded row, still
# nothing). The cost is in the last fifteen or so characters, where it climbs about a hundredfold: there, whether a
# token fits depends on its length against the characters left, which a table computed once per grammar state cannot
# know, and the curve has the shape of checking, one by one, the tokens long enough to cross the bound (SmolLM2
# has about 5,500 tokens longer than 10 characters; 99% of its tokens have at most 14). A real model names a person in a few characters
# and closes the string long before the bound; random weights write until the bound stops them, so every string
# of the GPU run passed through the expensive stretch. The bounded GPU measurement is therefore the worst case,
# not a typical one.
#
# The lesson for schemas: length bounds, like regex patterns on strings, are where constrained decoding gets
# expensive, because near them the mask cannot be looked up.

# %% [markdown]
# **The everyday cost.** The bounded run is the worst case; the typical schema with the embedded model's real
# weights is the everyday one. Here is what it costs per output token against free twins on one H100, read from
# three result files: the float32 model, the same model in bfloat16 (five alternating runs per kind, medians), and
# the 135M model padded with zeros to 2.1B parameters, which writes the same JSON while the device does a 2.1B
# model's work.

# %% tags=["hide-input"]
GPU_RUNS = [("135M, float32", "constrained_bench_real_typical_h100.json"),
            ("135M, bfloat16", "constrained_bench_typical_adaptive_h100.json"),
            ("135M padded to 2.1B, bfloat16", "constrained_bench_typical_padded_rustdecode_h100.json")]
gpu_rows = []
for label, name in GPU_RUNS:
    by_batch = {x["batch_size"]: x for x in json.loads((ROOT / "docs" / "data" / name).read_text())["summary"]}
    gpu_rows.append([label] + [f"{by_batch[b]['constrained_over_free_time_per_token']:.2f}" for b in (1, 64, 256)])
display(show_table(gpu_rows, headers=["model (typical schema)", "batch 1", "batch 64", "batch 256"]))

# %% [markdown]
# * **The host paces the small model.** In bfloat16 a decode step of the 135M model takes 1.2-1.6 ms, and even a
#   free step is bound by the host's own work (chapter 11). Accepting a token and filling a mask row cost 3-6 µs
#   each per row inside xgrammar, holding Python's lock, so they add to the step instead of hiding behind the
#   forward pass. (In float32 the step was twice as long and hid them.)
# * **A larger forward pass hides them.** Behind the padded model's 2.6-5 ms step the grammar costs 2% at batch 64
#   and 7% at 256: the overlap of section 4 works once the device, not the host, sets the pace.
# * **Jump-forward loses on the GPU.** It saves decode steps (38% at batch 64 with bounded strings), but a step
#   with extend rows that no captured CUDA graph fits runs eagerly, and such steps took 1.7-2.5 times as long at
#   batch 64-256; its canonical tokens also sent more outputs to the length limit. On the CPU, with no graph to
#   lose, it wins (section 5). It stays off by default.
#
# The [structured output reference](../structured-output-reference.md) has the tables behind each point: real
# weights in float32 and bfloat16, the grammar's host work per row, repeated runs of several engine versions, and
# the padded model against the 135M one.

# %% [markdown]
# ## Summary
#
# * **Constrain the sampler.** Before each draw, every token that would leave the grammar gets a logit of `-inf`:
#   the model still chooses, among valid tokens only.
# * **From regex to mask.** A finite automaton gives one mask per state, computed once (about ten allowed tokens
#   out of 49,152 for an integer); JSON needs a stack, and xgrammar precomputes the context-independent tokens per
#   grammar position and checks the few context-dependent ones at run time.
# * **In the engine.** `json_schema`, `regex` and `ebnf` compile in the background while only their request waits;
#   a packed bitmask (6 KB a row) masks only the constrained rows; schemas with keywords the grammar would not
#   enforce are refused. All of it plugs into chapter 06's `EngineExtension` seam as `StructuredOutput`.
# * **Masks under overlap.** Step N+1's forward is launched first; meanwhile the CPU advances the matchers by step
#   N's tokens and fills the masks, which are applied just before sampling.
# * **Jump-forward** (task 12.1) appends text the grammar forces, re-tokenized with the end of the output and
#   holding the last forced token back. It saves decode steps on the CPU; on the GPU it saved 38% of the steps at
#   batch 64 but made each three times as long, and it can change the output, so it is off by default.
# * **Tool calls** become a grammar: a JSON schema when a call is required, a structural tag around `<tool_call>`
#   for strict tools under `"auto"`.
# * **The oracle and the cost.** A fresh matcher accepts every token sampled at temperature 1.5. On the GPU the
#   135M model's steps are paced by the host, and a constrained step costs 1.3x a free one at batch 1; behind a
#   larger model's forward pass the grammar hides (2% at batch 64, 7% at 256).

# %% [markdown]
# ## Exercises
#
# 1. **Task 12.1.** Write `plan_jump` in `minisgl_ref/constrained/jump_forward.py`. Grade it with
#    `python -m minisgl_ref.course grade --chapter 12`. Then remove the `.rstrip()` and run section 5 again:
#    which outputs change, and what does the model do after the lone space token?
# 2. **A DFA for a token-level JSON fragment.** Extend section 2's automaton to the pattern `{"a": [0-9]}` (seven
#    fixed characters, one digit, one brace). Which toy tokens would you add so that some token is allowed in
#    one state only because it *finishes* the pattern? Which states have exactly one allowed continuation, and
#    what would jump-forward append there?
# 3. **Context-dependent tokens.** In a grammar `root ::= "[" root? "]"` (nested brackets), which single tokens
#    among `[`, `]`, `]]`, `[]` and `]]]` can be decided without the stack, and which cannot? How deep does the
#    stack have to be for `]]]` to be allowed?
# 4. **Where the mask waits.** With overlap on, add a `time.sleep(0.002)` to `TokenBitmask.fill`. On this CPU,
#    how much slower is section 4's constrained run, and why exactly that much? On a GPU with a 3 ms forward,
#    what would you expect, and at what sleep would the device start to idle?
# 5. **Why not always jump?** Find, in section 5's table or with your own schemas, a greedy output that differs
#    with jump-forward on. Print the two token sequences and the mask counts around the first difference, and
#    explain which piece the model preferred.
#
# ## Reproduce
#
# ```bash
# python chapters/12_structured_output.py                     # this chapter, end to end
# python -m minisgl_ref.course grade --chapter 12             # the tests of task 12.1
# python -m pytest tests/test_constrained.py -q               # structured output in the engine (slow: the model)
# python -m pytest tests/test_notebooks.py -q -k 12           # the notebook runs top to bottom
# FOLDER=... bash scripts/gpu/chapter.sh 12                  # every GPU run below, in turn (scripts/gpu/README.md)
# python3 scripts/gpu/measure/constrained_bench.py docs/data/constrained_bench_h100.json \
#     --model-path FOLDER --load-format dummy --max-new-tokens 400   # on a GPU; FOLDER: SmolLM2's config and tokenizer
# python3 scripts/gpu/measure/constrained_bench.py docs/data/constrained_bench_typical_h100.json --schema typical \
#     --model-path FOLDER --load-format dummy --max-new-tokens 600
# python3 scripts/gpu/measure/constrained_bench.py docs/data/constrained_bench_real_typical_h100.json --schema typical \
#     --max-new-tokens 320                                    # the embedded model's real weights (and bounded)
# python3 scripts/gpu/measure/constrained_bench.py docs/data/constrained_bench_typical_mixed_h100.json --schema typical \
#     --max-new-tokens 320 --batch-sizes 1 32 64 256 --mixed   # with mixed steps (and without, for _plain)
# python -m benchmarks.grammar_host --output docs/data/grammar_host_cpu.json   # the grammar's host work per step
# python3 scripts/gpu/measure/constrained_bench.py results/adaptive.json --schema typical --max-new-tokens 320 \
#     --batch-sizes 1 32 64 256 --repeats 5                  # five alternating runs per kind, medians
# OUT=results OVERLAYS="old/pool" bash scripts/gpu/measure/constrained_ab.sh   # versions side by side, one machine
# python -m benchmarks.h2d_copy --output results/h2d_copy.json   # a mask's copy, pageable against pinned
# python3 scripts/gpu/measure/padded_model.py /tmp/padded             # the 135M model zero-padded to 2.1B (about 40 s)
# python3 scripts/gpu/measure/constrained_bench.py results/padded.json --schema typical --max-new-tokens 160 \
#     --batch-sizes 1 64 256 --repeats 5 --skip-jump-forward --model-path /tmp/padded   # then without --model-path
# python3 scripts/gpu/measure/smollm2_1p7b_folder.py /tmp/random17   # SmolLM2-1.7B's shape for random weights:
# python3 scripts/gpu/measure/constrained_bench.py results/random.json --schema typical --max-new-tokens 160 \
#     --batch-sizes 1 64 256 --repeats 5 --skip-jump-forward --model-path /tmp/random17 --load-format dummy
# ```
#
# Expected on a 2-core x86_64 CPU: the chapter in about 40 s; `benchmarks.grammar_host` in about a minute, with
# 3-6 µs per row both to accept a token and to fill a mask (one thread). On an H100 with the real weights in
# bfloat16 (`docs/data/constrained_bench_typical_adaptive_h100.json`): the typical schema at about 1.06, 1.16-1.21,
# 1.30-1.38 and 1.42 times the free time per output token at batch 1, 32, 64 and 256; the padded 2.1B model
# (`constrained_bench_typical_padded_rustdecode_h100.json`) at about 1.02, 1.02 and 1.07 at batch 1, 64 and 256.
# The [structured output reference](../structured-output-reference.md#expected-numbers-at-a-glance) lists the
# expected numbers of every other run above.

# %%
print(f"chapter ran in {time.perf_counter() - CHAPTER_START:.0f} s")
