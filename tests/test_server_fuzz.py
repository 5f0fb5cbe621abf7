"""Property-based fuzzing of the HTTP API: no request, valid or not, may crash, stall or corrupt the server.

What it proves, against a real ``python -m minisgl_ref serve`` on the embedded model:

* **No 5xx, ever.** Hypothesis builds requests for ``/v1/chat/completions``, ``/v1/completions`` and
  ``/generate`` from strategies that follow the fields of ``minisgl_ref/server/protocol.py``, mixing valid values
  with wrong types, 64-bit edges and beyond (``2**70``), ``NaN``/``Infinity``/``1e400`` and lone surrogates written
  as raw JSON, deep nesting, duplicate and unknown keys, odd unicode, long strings and bodies over the size limit.
  Every answer must be 2xx or 4xx, and every non-2xx an OpenAI-style error whose message says something.
* **Answers are well formed.** A 2xx body parses; it has one choice per prompt and sample, each finished with
  "stop" or "length" (never an abort) within its token limit; a stream is SSE ending in ``data: [DONE]``, with no
  error event inside.
* **No one else is disturbed.** A canary (a greedy 48-token completion with ``ignore_eos``) streams again and again
  for the whole run, and must always give exactly the text it gives on an idle server.
* **Nothing leaks.** Afterwards the scheduler holds no request and the KV pool is whole again.

The run is bounded: ``MAX_EXAMPLES`` examples or ``FUZZ_SECONDS`` of wall time, whichever comes first, with fixed
choices (``derandomize=True``) so that CI sends the same requests. A valid request costs at most ``BUDGET`` tokens
(max tokens x samples x prompts), so that the CPU can afford it: a field that bounds a request's length always
holds either a small value or one that is certain to be refused. Each example sends 1-3 requests at once, so
valid ones also share batches with each other and with the canary.

Failures are collected rather than raised at the first one (so that one run reports every distinct kind) and are
printed as reproducers: the shortest failing body of each kind.

Not fuzzed, because a single such request would stall the shared server for the rest of the run: ``stop_regex``
patterns with catastrophic backtracking (the fuzzer's come from a fixed list of cheap ones) and chat templates with
long loops in ``chat_template_kwargs`` (the server refuses any template there; the fuzzer's are short).
``test_one_client_cannot_stall_the_server`` sends those to servers of their own.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.server_utils import ServerProcess, error_body_problem, running_server, sse_problem, wait_idle

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
VOCAB = 49152
BODY_LIMIT_MB = 1  # the server's --max-request-body-mb: small, so that a body over it is cheap to send
FUZZ_SECONDS = 75.0
MAX_EXAMPLES = 500
REQUEST_TIMEOUT_S = 90.0  # a valid request costs <= BUDGET tokens: seconds, even on a busy CPU
BUDGET = 16  # the most tokens a valid fuzz request may generate, over all of its choices
CANARY = {"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True}
PATHS = ("/v1/chat/completions", "/v1/completions", "/generate")


@pytest.fixture(scope="module")
def server():
    with running_server("--log-level", "warning", "--max-request-body-mb", str(BODY_LIMIT_MB)) as srv:
        yield srv


# ------------------------------------------------------------------------------------------- raw JSON


class Raw(str):
    """JSON text written verbatim into a body: ``NaN``, ``1e400``, ``"\\ud800"``, 5,000 digits, deep nesting."""


class Obj(list):
    """A JSON object as a list of (key, value) pairs, so that a key may repeat (JSON parsers keep the last)."""


def to_json(value: Any) -> str:
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, Obj):
        return "{" + ", ".join(f"{to_json(k)}: {to_json(v)}" for k, v in value) + "}"
    if isinstance(value, dict):
        return to_json(Obj(value.items()))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(to_json, value)) + "]"
    return json.dumps(value)  # a lone surrogate in a str becomes its \udXXX escape


# ---------------------------------------------------------------------------------------- value strategies

SURROGATES = ["\ud800", "\udbff", "\udc00", "\udfff"]
PIECES = [" hello", " world", "The", " capital", " of", " France", "\n", "<|im_start|>", "<|im_end|>",
          "<|endoftext|>", "日本語", "é", "🙂", "\u200b", "\x00", "\ufeff", "\ufffd", "\\", '"', "{{", "}}"]
HUGE_INTS = [2**70, -(2**70), 2**64, 2**64 - 1, 2**63, -(2**63), -(2**63) - 1, 10**30, -1, 0]
RAW_NUMBERS = [Raw(s) for s in ("NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1E999999", "-0", "1.0",
                                "9" * 5000, "0." + "0" * 5000 + "1")]
RAW_STRINGS = [Raw(s) for s in ('"\\ud800"', '"a\\udfffb"', '"\\ud800\\udc00"', '"\\u0000"', '"\\udc00\\ud800"')]

clean_text = st.lists(st.one_of(st.characters(), st.sampled_from(PIECES)), max_size=10).map("".join)
words = st.lists(st.sampled_from(PIECES[:6]), min_size=1, max_size=8).map("".join)
surrogate_text = st.tuples(clean_text, st.sampled_from(SURROGATES), clean_text).map("".join)
long_prompt = st.sampled_from([300, 1200]).map(lambda n: " word" * n)  # valid, but a long prefill
over_context = st.just(" hello" * 9000)  # > 8192 tokens: refused after tokenizing
over_limit = st.sampled_from([BODY_LIMIT_MB * 2**20 + 1, 2 * BODY_LIMIT_MB * 2**20]).map(lambda n: "x" * n)
token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=16)
bad_id = st.sampled_from([VOCAB, -1, 10**6, *HUGE_INTS[:7], 1.5, "3", True, None, Raw("NaN")])
bad_ids = st.tuples(token_ids, bad_id, st.integers(0, 15)).map(lambda t: t[0][:t[2]] + [t[1]] + t[0][t[2]:])
deep = st.sampled_from([32, 63, 64, 65, 200, 999, 1000, 1001, 5000, 100_000]).flatmap(
    lambda d: st.sampled_from([Raw("[" * d + "]" * d), Raw('{"a": ' * d + "1" + "}" * d)]))
scalar_junk = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**80), 2**80), st.sampled_from(HUGE_INTS),
    st.floats(allow_nan=False, allow_infinity=False), clean_text, st.sampled_from(RAW_NUMBERS + RAW_STRINGS))
junk = st.recursive(scalar_junk, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(clean_text, kids,
                                                                                             max_size=3),
                    max_leaves=8)
clean_junk = st.recursive(  # what a valid request may carry in a field the server ignores
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63), st.floats(allow_nan=False,
                                                                                 allow_infinity=False), clean_text),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(clean_text, kids, max_size=3), max_leaves=8)
wrong = st.one_of(junk, junk, deep, surrogate_text)  # a value of the wrong type, or not even valid text


def number(lo: float, hi: float, *, exclude_lo: bool = False, beyond: tuple[Any, ...] = ()) -> tuple[Any, Any]:
    """(valid, invalid) strategies of a number field in ``[lo, hi]`` (``(lo, hi]`` with ``exclude_lo``)."""
    ints = [i for i in range(int(lo), int(hi) + 1) if not (exclude_lo and i == lo)]
    valid = st.one_of(st.floats(lo, hi, exclude_min=exclude_lo), st.sampled_from(ints or [hi]))
    invalid = st.one_of(st.sampled_from([*beyond, hi + 0.5, lo - 0.5, 1e300, "0.5", True, None]),
                        st.sampled_from(RAW_NUMBERS[:6]), wrong)
    return valid, invalid


def choose(*values: Any) -> Any:
    return st.sampled_from(values)


def one_in(draw: Any, k: int) -> bool:
    """True about once in ``k`` draws. (Not ``integers(0, k - 1) == 0``: Hypothesis favours the ends of a range.)"""
    return draw(st.integers(0, k - 1)) == k // 2


SAFE_STOP_REGEX = ["[0-9]", r"\.\s", "the", "(?i)paris", "^$", "a{3}", r"\w+ \w+ \w+ \w+ \w+ \w+ \w+ \w+ \w+ \w+"]
# The sampling fields shared by both OpenAI routes, and SGLang's native names: name -> (valid, invalid). The fields
# that bound a request's cost (n, max_tokens, min_tokens) are drawn apart, from the request's budget.
SHARED_SAMPLING = {
    "temperature": number(0, 2, beyond=(2.0001, -1e-9)),
    "top_p": number(0, 1, exclude_lo=True, beyond=(0, 1.0000001)),
    "top_k": (choose(-1, 1, 5, 50, VOCAB, 10**6), st.one_of(choose(0, -2, 2.5, "5", *HUGE_INTS[:7]), wrong)),
    "min_p": number(0, 1, beyond=(1.01, -0.01)),
    "presence_penalty": number(-2, 2),
    "frequency_penalty": number(-2, 2),
    "repetition_penalty": number(0, 2, exclude_lo=True, beyond=(0, 2.01)),
    "seed": (st.one_of(st.integers(-(2**63), 2**64 - 1), choose(0, -1, 2**64 - 1, -(2**63))),
             st.one_of(choose(2**64, -(2**63) - 1, 2**70, -(2**70), 1.5, "1", True), wrong)),
    "stop": (st.one_of(words, st.lists(words, max_size=4), st.lists(words, min_size=20, max_size=60),
                       st.sampled_from(PIECES).filter(bool), st.just("x" * 20_000)),
             st.one_of(choose("", [""], ["a", ""], [1], [None], 12), surrogate_text,
                       st.lists(surrogate_text, min_size=1, max_size=2), wrong)),
    "stop_token_ids": (st.one_of(st.lists(st.integers(0, VOCAB - 1), max_size=5), st.just(list(range(0, VOCAB, 7)))),
                       st.one_of(bad_ids, choose("1", 5, [[1]]), wrong)),
    "ignore_eos": (st.booleans(), st.one_of(choose(1, 0, "true", None), wrong)),
    "skip_special_tokens": (st.booleans(), st.one_of(choose(1, "false", None), wrong)),
    "logit_bias": (st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=5),
                   st.one_of(choose({str(VOCAB): 1}, {"-1": 1}, {"x": 1}, {"1": 100.5}, {"1": "a"}, {"1": None},
                                    {"1": Raw("NaN")}, {"1": Raw("1e400")}, {str(2**70): 1}, [1, 2], "1"), wrong)),
}
OPENAI_SAMPLING = {
    **SHARED_SAMPLING,
    "model": (choose(MODEL, "default", None), st.one_of(clean_text, wrong)),
    "stream_options": (st.one_of(st.none(), st.fixed_dictionaries({"include_usage": st.booleans()},
                                                                  optional={"continuous_usage_stats": st.booleans()})),
                       st.one_of(choose({"include_usage": "yes"}, {"include_usage": None}, "x", [], 1,
                                        {"continuous_usage_stats": 1}), wrong)),
    "user": (clean_text, st.one_of(surrogate_text, choose(1, [], {}))),
    "cache_salt": (st.one_of(st.none(), clean_text), st.one_of(choose(1, [], {}), surrogate_text)),
    "stop_regex": (st.one_of(choose(*SAFE_STOP_REGEX), st.lists(choose(*SAFE_STOP_REGEX), max_size=3)),
                   st.one_of(choose("(", "[", "*", "a{2,1}", "", [""], 5, ["("]), surrogate_text)),
}
CHAT_ONLY = {
    "logprobs": (st.booleans(), st.one_of(choose(None, 1, 5, "yes"), wrong)),
    "continue_final_message": (choose(False), st.one_of(choose(True, 1, None), wrong)),
    "top_logprobs": (st.one_of(st.none(), st.integers(0, 20)), st.one_of(choose(21, -1, 2**70, True), wrong)),
    "chat_template_kwargs": (  # variables for the model's template; a template of the client's own is refused
        st.one_of(choose({}, {"enable_thinking": False}),
                  st.dictionaries(st.sampled_from(["custom", "enable_thinking", "date"]), clean_junk, max_size=2)),
        st.one_of(choose({"chat_template": "{{ messages[0]['role'] }}: hi"}, {"tokenize": True},
                         {"tokenize": False}, {"add_generation_prompt": False}, {"return_dict": True},
                         {"continue_final_message": True}, {"chat_template": "{{"},
                         {"chat_template": "{{ 1 / 0 }}"}, {"chat_template": ""}, {"chat_template": 5},
                         {"return_tensors": "np"}, {"tools": [{"x": 1}]}, {"messages": []}), wrong)),
}
COMPLETION_ONLY = {
    "logprobs": (st.one_of(st.none(), st.integers(0, 20)), st.one_of(choose(21, -1, 2**70, True, "1"), wrong)),
    "echo": (st.booleans(), st.one_of(choose(1, "true", None), wrong)),
    "suffix": (choose(None, ""), st.one_of(clean_text.filter(bool), wrong)),
}
# Fields this server knows and refuses unless set to their "not used" value; valid: that value.
UNSUPPORTED = {
    "no_stop_trim": (choose(None, False), choose(True)),
    "spaces_between_special_tokens": (choose(None, True), choose(False)),
    "lora_path": (st.none(), choose("adapter")),
    "return_hidden_states": (choose(None, False), choose(True)),
    "custom_logit_processor": (st.none(), choose("{}")),
}
CHAT_UNSUPPORTED = {
    "modalities": (choose(None, ["text"]), choose(["text", "audio"])),
}
# Constrained decoding (SGLang's names; at most one per request, so a valid request that draws two is refused):
# cheap grammars, and ones that xgrammar or the JSON parser refuses.
GRAMMARS = {
    "regex": (choose(None, "[0-9]{1,3}", "(yes|no)"), st.one_of(choose("(", "[z-a]", "", 5), surrogate_text)),
    "json_schema": (choose(None, '{"type": "object"}', '{"type": "integer"}'),
                    choose("{not json", '{"type": "nope"}', "[1]", 5, "")),
    "ebnf": (choose(None, 'root ::= "a" | "b"'), choose("root ::= ", "start ::= 'a'", "", 5)),
}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}
CHAT_FORMAT = {
    "tools": (choose(None, [], [TOOL]), choose([{"type": "function", "function": {"name": "bad name"}}],
                                               [{"x": 1}], "f", [{"type": "function", "function": {
                                                   "name": "f", "parameters": {"type": "nope"}}}])),
    "tool_choice": (choose(None, "none", "auto"), choose("always", 5, {"type": "function", "function": {
        "name": "nope"}})),
    "response_format": (choose(None, {"type": "text"}, {"type": "json_object"}),
                        choose({"type": "yaml"}, {"type": "json_schema"}, "json", {"type": "json_schema",
                               "json_schema": {"name": "x", "schema": {"type": "nope"}}})),
}
NATIVE_SAMPLING = {
    **SHARED_SAMPLING,
    "stop_regex": (st.one_of(choose(*SAFE_STOP_REGEX), st.lists(choose(*SAFE_STOP_REGEX), max_size=3)),
                   st.one_of(choose("(", "[", "*", "a{2,1}", "", [""], 5), surrogate_text)),
    **GRAMMARS,
    **{k: v for k, v in UNSUPPORTED.items() if k == "no_stop_trim"},
}
GENERATE_OTHER = {
    "rid": (st.one_of(st.none(), clean_text), st.one_of(choose(1, {}, [1], ["a", "b", "c", "d"]), surrogate_text)),
    "return_logprob": (choose(False), st.one_of(choose(True, 1, None), wrong)),
    "logprob_start_len": (st.integers(-1, 10_000), st.one_of(choose(2**70, -5, "0", None), wrong)),
    "top_logprobs_num": (st.integers(0, 20), st.one_of(choose(-1, 21, 2**70, 10**6, "1", None), wrong)),
    "return_text_in_logprobs": (st.booleans(), wrong),
    "image_data": (st.none(), choose("cat.png")),
    "input_embeds": (st.none(), choose([[0.5, 0.25]])),
}


class Draw:
    """Draws the fields of one request. Mode "valid": only valid values; "one_bad": one chosen field gets an invalid
    value; "chaos": any field may, with probability 1/3. Optional fields are sent about a quarter of the time."""

    def __init__(self, draw: Any, names: list[str]) -> None:
        self.draw = draw
        self.mode = draw(st.sampled_from(["valid", "valid", "one_bad", "one_bad", "chaos"]))
        self.bad = draw(st.sampled_from(names)) if self.mode == "one_bad" else None

    def is_bad(self, name: str) -> bool:
        if self.mode == "one_bad":
            return name == self.bad
        return self.mode == "chaos" and one_in(self.draw, 3)

    def value(self, name: str, valid: Any, invalid: Any) -> Any:
        return self.draw(invalid if self.is_bad(name) else valid)

    def optional(self, name: str, spec: tuple[Any, Any], pairs: list) -> None:
        if name == self.bad or one_in(self.draw, 4):
            pairs.append((name, self.value(name, *spec)))

    def fields(self, table: dict[str, tuple[Any, Any]], pairs: list) -> None:
        for name, spec in table.items():
            self.optional(name, spec, pairs)

    def extras(self, pairs: list) -> None:
        """Unknown fields (ignored), and a duplicate of a key already sent, with a junk value *before* it (a JSON
        parser keeps the last one, so the budget fields at the end still bound the request)."""
        if one_in(self.draw, 4):
            key = self.draw(st.one_of(clean_text, choose("metadata", "store", "service_tier", "__proto__")))
            pairs.append((key, self.draw(clean_junk if self.mode == "valid" else junk)))
        if self.mode != "valid" and one_in(self.draw, 6):
            pairs.append((self.draw(surrogate_text), 1))  # a key that is not valid text
        self.draw(st.randoms(use_true_random=False)).shuffle(pairs)
        if pairs and one_in(self.draw, 4):
            key = self.draw(st.sampled_from([k for k, _ in pairs]))
            pairs.insert(0, (key, self.draw(clean_junk if self.mode == "valid" else junk)))


# What certainly gets a request refused in a field that bounds its length (so that no accepted request costs more
# than BUDGET tokens). Omitting the field is not one of them: each route has a default (16, 128, the context).
BAD_LENGTH = st.one_of(choose(-1, -(2**70), 2**70, 2**64, 10**6, 10**12, 1.0, 8.5, "8", True, [8], {"n": 8}),
                       st.sampled_from(RAW_NUMBERS), deep)
BAD_N = st.one_of(choose(0, -1, 129, 10**9, 2**70, 1.0, "2", True, None, [2]), st.sampled_from(RAW_NUMBERS), deep)


def budget(fields: Draw, prompts: int, *, length: str, n_name: str = "n", allow_none: bool = False) -> list:
    """The (name, value) pairs of ``n`` and the length field, valid within BUDGET tokens or certainly refused."""
    pairs = []
    n = fields.draw(choose(1, 1, 1, 2, 3))
    if fields.is_bad(n_name):
        pairs.append((n_name, fields.draw(BAD_N)))
    elif n != 1 or fields.draw(st.booleans()):
        pairs.append((n_name, n))
    cap = max(1, BUDGET // (n * prompts))
    valid_len = st.integers(0 if length == "max_new_tokens" else 1, cap)
    if allow_none and cap >= BUDGET:
        valid_len = st.one_of(valid_len, st.none())  # None means the route's default, 16 for /v1/completions
    pairs.append((length, fields.value(length, valid_len, BAD_LENGTH)))
    return pairs


# --------------------------------------------------------------------------------------- request strategies


@dataclass
class FuzzRequest:
    method: str
    path: str
    body: bytes
    content_type: str | None = "application/json"
    chunked: bool = False  # sent with Transfer-Encoding: chunked instead of a Content-Length
    mode: str = "?"  # how it was drawn: valid, one_bad, chaos (see Draw), junk body, or edge (edge_cases)

    def show(self, limit: int = 400) -> str:
        body = self.body if len(self.body) <= limit else self.body[:limit] + b"...(%d bytes)" % len(self.body)
        how = " [chunked]" if self.chunked else ""
        return f"{self.method} {self.path}{how} content-type={self.content_type!r} body={body!r}"


@st.composite
def messages(draw: Any, fields: Draw) -> Any:
    if fields.is_bad("messages"):
        return draw(st.one_of(choose([], "hi", [{}], [{"role": "user"}], None), st.lists(wrong, min_size=1,
                                                                                          max_size=2), wrong))
    out = []
    for _ in range(draw(st.integers(1, 3))):
        role = fields.value("role", choose("user", "user", "system", "assistant", "developer", "tool"),
                            st.one_of(choose("wizard", "USER", "", None, 1), surrogate_text))
        content = fields.value("content", st.one_of(
            words, clean_text, st.none(), st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": words}),
                                                   max_size=2),
            long_prompt if one_in(draw, 10) else words),
            st.one_of(choose([{"type": "image_url", "image_url": {"url": "x"}}], [{"type": "text", "text": 1}],
                             [{"text": "hi"}], [1], 5), over_context, over_limit, surrogate_text, wrong))
        msg: list = [("role", role), ("content", content)]
        if one_in(draw, 5):
            msg.append(("name", fields.value("name", clean_text, wrong)))
        if one_in(draw, 7):
            # extra keys go to the chat template (but for the server's own "_" markers and the refused ones)
            msg.append((draw(clean_text.filter(lambda k: not k.startswith("_"))), draw(clean_junk)))
        out.append(Obj(msg))
    return out


@st.composite
def chat_body(draw: Any) -> tuple[str, Any, str]:
    fields = Draw(draw, ["messages", "role", "content", "name", "n", "max_tokens", "max_completion_tokens",
                         *OPENAI_SAMPLING, *CHAT_ONLY, "stream", "min_tokens", *UNSUPPORTED, *CHAT_UNSUPPORTED,
                         *GRAMMARS, *CHAT_FORMAT])
    pairs: list = [("messages", draw(messages(fields)))]
    fields.fields(OPENAI_SAMPLING, pairs)
    fields.fields(CHAT_ONLY, pairs)
    fields.fields({**UNSUPPORTED, **CHAT_UNSUPPORTED, **GRAMMARS, **CHAT_FORMAT}, pairs)
    fields.optional("min_tokens", (choose(0, 1), choose(-1, 10**6, 2**70, "1")), pairs)
    fields.optional("stream", (st.booleans(), st.one_of(choose("true", 1, None), wrong)), pairs)
    fields.extras(pairs)
    tail = budget(fields, 1, length="max_tokens")
    if one_in(draw, 4):  # max_completion_tokens wins over max_tokens: bounded the same way
        n, max_tokens = dict(tail).get("n", 1), dict(tail)["max_tokens"]
        cap = BUDGET // n if type(n) is int and 1 <= n <= 3 else 1
        valid = st.one_of(st.none(), st.integers(1, cap)) if type(max_tokens) is int else st.none()
        tail.append(("max_completion_tokens", fields.value("max_completion_tokens", valid, BAD_LENGTH)))
    return "/v1/chat/completions", Obj(pairs + tail), fields.mode


@st.composite
def prompt(draw: Any, fields: Draw, name: str) -> tuple[Any, int]:
    """A completion prompt, or /generate's text or input_ids, and how many prompts it holds."""
    if fields.is_bad(name):
        value = draw(st.one_of(choose("", [], [[]], [""], [1, "a"], [[1], "a"], None, 5), bad_ids,
                               st.lists(bad_ids, min_size=1, max_size=2), over_context, over_limit, surrogate_text,
                               st.lists(surrogate_text, min_size=1, max_size=2), wrong))
        return value, 1
    kind = draw(st.sampled_from(["text", "text", "texts", "ids", "id_lists", "long"]))
    if name == "input_ids":
        kind = {"text": "ids", "texts": "id_lists", "long": "ids"}.get(kind, kind)
    if name == "text":
        kind = {"ids": "text", "id_lists": "texts"}.get(kind, kind)
    if kind == "text":
        return draw(st.one_of(words, clean_text.filter(lambda s: s.strip()))), 1
    if kind == "long":
        return draw(long_prompt), 1
    if kind == "ids":
        return draw(token_ids), 1
    if kind == "texts":
        texts = draw(st.lists(words, min_size=1, max_size=3))
        return texts, len(texts)
    lists = draw(st.lists(token_ids, min_size=1, max_size=3))
    return lists, len(lists)


@st.composite
def completion_body(draw: Any) -> tuple[str, Any, str]:
    fields = Draw(draw, ["prompt", "n", "max_tokens", *OPENAI_SAMPLING, *COMPLETION_ONLY, "stream", "min_tokens",
                         "best_of", *UNSUPPORTED, *GRAMMARS])
    value, prompts = draw(prompt(fields, "prompt"))
    pairs: list = [("prompt", value)]
    fields.fields(OPENAI_SAMPLING, pairs)
    fields.fields(COMPLETION_ONLY, pairs)
    fields.fields({**UNSUPPORTED, **GRAMMARS}, pairs)
    fields.optional("best_of", (choose(None, 1), choose(2, 5, 0, -1, 2**70, "1")), pairs)
    fields.optional("min_tokens", (choose(0, 1), choose(-1, 10**6, 2**70, "1")), pairs)
    fields.optional("stream", (st.booleans(), st.one_of(choose("true", 1, None), wrong)), pairs)
    fields.extras(pairs)
    return "/v1/completions", Obj(pairs + budget(fields, prompts, length="max_tokens", allow_none=True)), fields.mode


@st.composite
def native_params(draw: Any, fields: Draw, prompts: int) -> Any:
    if fields.is_bad("sampling_params"):  # never null or {}: those mean the default, 128 tokens
        return draw(st.one_of(choose("x", 5, True, 1.5, [], [{}] * (prompts + 1), [[{}]], {"max_new_tokens": -1},
                                     {"top-p": 0.5, "max_new_tokens": 1}), deep, surrogate_text))
    pairs: list = []
    fields.fields(NATIVE_SAMPLING, pairs)
    fields.optional("min_new_tokens", (choose(0, 1), choose(-1, 10**6, 2**70, "1", None)), pairs)
    if fields.is_bad("unknown sampling param"):
        pairs.append((draw(choose("top-p", "max_tokens", "foo", "")), 1))
    return Obj(pairs + budget(fields, prompts, length="max_new_tokens"))


@st.composite
def generate_body(draw: Any) -> tuple[str, Any, str]:
    fields = Draw(draw, ["text", "input_ids", "both", "neither", "sampling_params", "n", "max_new_tokens",
                         *NATIVE_SAMPLING, "min_new_tokens", "unknown sampling param", "stream", *GENERATE_OTHER])
    which = "text" if draw(st.booleans()) else "input_ids"
    value, prompts = draw(prompt(fields, which))
    pairs: list = [(which, value)]
    if fields.is_bad("both"):
        other = "input_ids" if which == "text" else "text"
        pairs.append((other, draw(prompt(fields, other))[0]))
    if fields.is_bad("neither"):
        pairs = []
    if one_in(draw, 5) and not fields.is_bad("sampling_params"):
        sp: Any = [draw(native_params(fields, prompts)) for _ in range(prompts)]  # one per prompt
    else:
        sp = draw(native_params(fields, prompts))
    pairs.append(("sampling_params", sp))
    fields.fields(GENERATE_OTHER, pairs)
    fields.optional("stream", (st.booleans(), st.one_of(choose("true", 1, None), wrong)), pairs)
    fields.extras(pairs)
    if ("sampling_params", sp) in pairs:  # it bounds the request's length: keep it last, so it wins
        pairs.remove(("sampling_params", sp))
        pairs.append(("sampling_params", sp))
    return "/generate", Obj(pairs), fields.mode


JUNK_BODIES = [b"", b"{", b"}", b"null", b"[]", b"[1, 2]", b'"text"', b"42", b"NaN", b"{}", b'{"a": 1,}',
               b'{"prompt": "\xff\xfe"}', b"\xef\xbb\xbf{}", b'{"prompt": "hi"} trailing', b"{'prompt': 'hi'}",
               b'{"prompt": "hi", "max_tokens": 1}'.decode().encode("utf-16"), b"\x00" * 64,
               b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}']


@st.composite
def request(draw: Any) -> FuzzRequest:
    """One request: a drawn body for one of the three routes, now and then a whole-body oddity instead, sent with an
    unusual method, content type or transfer encoding."""
    path, body, mode = draw(st.one_of(chat_body(), completion_body(), generate_body()))
    raw = to_json(body).encode("ascii")  # to_json escapes every non-ASCII character, lone surrogates included
    if one_in(draw, 12):
        raw, mode = draw(st.one_of(st.sampled_from(JUNK_BODIES), st.binary(max_size=64),
                                   st.integers(1, max(1, len(raw) - 1)).map(lambda k: raw[:k]))), "junk body"
    elif one_in(draw, 8):
        # The same body with its text as UTF-8 rather than escapes (a lone surrogate becomes bytes that are not
        # UTF-8); a body json.loads cannot round-trip (too deep, 5,000 digits) stays as it was.
        try:
            raw = json.dumps(json.loads(raw), ensure_ascii=False).encode("utf-8", "surrogatepass")
        except (ValueError, RecursionError):
            pass
    method = draw(choose("GET", "PUT", "DELETE")) if one_in(draw, 25) else "POST"
    content_type = draw(choose(None, "text/plain", "application/x-www-form-urlencoded")) if one_in(draw, 8) \
        else "application/json"
    return FuzzRequest(method, path, raw, content_type, chunked=one_in(draw, 10), mode=mode)


def edge_cases() -> list[FuzzRequest]:
    """Hand-picked requests sent before the fuzzing: the extremes each route must refuse (or serve) cleanly."""
    chat, comp, gen = '"messages": [{"role": "user", "content": "hi"}]', '"prompt": "hi"', '"text": "hi"'
    bodies: list[tuple[str, str]] = []
    for path, head, length in (("/v1/chat/completions", chat, '"max_tokens": 2'),
                               ("/v1/completions", comp, '"max_tokens": 2'),
                               ("/generate", gen, '"sampling_params": {"max_new_tokens": 2}')):
        def body(field: str, value: str, nested: bool = path == "/generate") -> str:
            if nested:
                return "{" + head + ', "sampling_params": {"max_new_tokens": 2, "' + field + '": ' + value + "}}"
            return "{" + head + ", " + length + ', "' + field + '": ' + value + "}"

        for name in ("temperature", "top_p", "top_k", "seed", "n", "presence_penalty", "min_p"):
            for value in ("NaN", "Infinity", "-Infinity", "1e400", "-1e400", str(2**70), str(-(2**70)), "9" * 5000,
                          '"\\ud800"', "[" * 100 + "]" * 100):
                bodies.append((path, body(name, value)))
        for value in (str(2**70), str(-(2**70)), str(2**64), "0", "-1", "1e400", "NaN", "[]"):
            bodies.append((path, body("max_new_tokens" if path == "/generate" else "max_tokens", value)))
        # Valid extremes, alone and under a grammar: values that are 0 or infinite in float32 must not turn into a
        # NaN that lets the draw pick a token the grammar forbids.
        grammar = ('"response_format": {"type": "json_object"}' if path == "/v1/chat/completions"
                   else '"json_schema": "{\\"type\\": \\"object\\"}"')
        hottest = "1e300" if path == "/generate" else "2"
        for name, values in (("temperature", ("5e-324", "1e-6", hottest)), ("top_p", ("5e-324",)),
                             ("min_p", ("5e-324", "1")), ("repetition_penalty", ("5e-324", "1e-40", "2")),
                             ("presence_penalty", ("-2", "2")), ("frequency_penalty", ("-2", "2"))):
            for value in values:
                bodies += [(path, body(name, value)), (path, body(name, value + ", " + grammar))]
        for value in ('["\\ud800"]', '"\\udfff"', '["a\\ud800\\udc00b"]', '[""]', '["x", ""]',
                      '["' + "x" * 100_000 + '"]', "[" + ", ".join(['"ab"'] * 5000) + "]"):
            bodies.append((path, body("stop", value)))
        for value in ("[" + str(2**70) + "]", "[-1]", "[49152]", "[1.5]", '["1"]', "[" + "1, " * 20000 + "1]"):
            bodies.append((path, body("stop_token_ids", value)))
        for value in ('{"49152": 1}', '{"-1": 1}', '{"1": NaN}', '{"1": 1e400}', '{"' + str(2**70) + '": 1}',
                      '{"x": 1}', '{"\\ud800": 1}', "{" + ", ".join(f'"{i}": 1' for i in range(0, 49152, 3)) + "}"):
            bodies.append((path, body("logit_bias", value)))
        for value in ("true", "5", "21", "-1", str(2**70)):
            bodies.append((path, body("top_logprobs_num" if path == "/generate" else "top_logprobs", value,
                                      nested=False)))
            bodies.append((path, body("return_logprob" if path == "/generate" else "logprobs", value, nested=False)))
        bodies += [(path, "{" + head + ", " + length + ', "\\ud800": 1}'),
                   (path, "{" + head + ", " + length + ', "stream": true, "stream": false, "stream": true}'),
                   (path, "{" + head + ", " + length + ', "' + "k" * 200_000 + '": 1}'),
                   (path, "{" + head + ", " + length + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}"),
                   (path, "{" + head + ", " + length + ', "x": ' + '{"a": ' * 63 + "1" + "}" * 63 + "}"),
                   (path, "{" + head + ", " + length + ', "x": "' + "y" * (2 * BODY_LIMIT_MB * 2**20) + '"}'),
                   (path, "{" + head + ", " + length + ', "cache_salt": "' + "s" * 10_000 + '"}')]
    bodies += [
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
                                 '"chat_template_kwargs": {"chat_template": "{% for m in messages %}{{ m.content }}'
                                 '{% endfor %}"}}'),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
                                 '"chat_template_kwargs": {"chat_template": "{{ raise_exception(\'no\') }}"}}'),
        ("/v1/chat/completions", '{"messages": [{"role": "tool", "content": null, "tool_call_id": "1"}], '
                                 '"max_tokens": 2}'),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
                                 '"max_completion_tokens": ' + str(2**70) + "}"),
        ("/v1/completions", '{"prompt": [[1, 2], [' + str(2**70) + "]], \"max_tokens\": 1}"),
        ("/v1/completions", '{"prompt": [], "max_tokens": 1}'),
        ("/v1/completions", '{"prompt": [[]], "max_tokens": 1}'),
        ("/v1/completions", '{"prompt": "", "max_tokens": 1}'),
        ("/v1/completions", '{"prompt": "hi", "max_tokens": 1, "n": 2, "best_of": 2}'),
        ("/generate", '{"input_ids": [], "sampling_params": {"max_new_tokens": 1}}'),
        ("/generate", '{"input_ids": [[]], "sampling_params": {"max_new_tokens": 1}}'),
        ("/generate", '{"text": [], "sampling_params": {"max_new_tokens": 1}}'),
        ("/generate", '{"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}]}'),
        ("/generate", '{"text": "a", "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 1}]}'),
        ("/generate", '{"text": "hi", "sampling_params": {"max_new_tokens": 0}}'),
        ("/generate", '{"text": "hi", "sampling_params": {"max_new_tokens": 2, "stop_regex": "("}}'),
        ("/generate", '{"text": "hi", "sampling_params": {"max_new_tokens": 2, "n": 2, "seed": '
                      + str(2**64 - 1) + "}}"),
        ("/generate", '{"text": "hi", "rid": ' + "[" * 63 + "]" * 63 + ', "sampling_params": {"max_new_tokens": 1}}'),
    ]
    out = [FuzzRequest("POST", path, b.encode("ascii"), mode="edge") for path, b in bodies]
    big = ('{"prompt": "' + "x" * (BODY_LIMIT_MB * 2**20 + 10) + '", "max_tokens": 1}').encode()
    out += [FuzzRequest("POST", "/v1/completions", big, mode="edge"),
            FuzzRequest("POST", "/v1/completions", big, chunked=True, mode="edge"),
            FuzzRequest("POST", "/v1/completions", '{"prompt": "hi", "max_tokens": 1}'.encode("utf-16"),
                        mode="edge"),
            FuzzRequest("POST", "/v1/completions", b'{"prompt": "\xed\xa0\x80", "max_tokens": 1}', mode="edge"),
            *[FuzzRequest("POST", path, raw, mode="edge") for path in PATHS for raw in JUNK_BODIES]]
    return out


def server_left_whole(server: ServerProcess) -> list[str]:
    """Problems with the server after the run: it died, or it did not go back to idle (a request or KV leaked)."""
    if server.proc.poll() is not None:
        return [f"the server died with status {server.proc.returncode}:\n{server.log_text()}"]
    try:
        wait_idle(server, timeout=120)
    except (AssertionError, httpx.HTTPError) as e:
        return [f"{type(e).__name__}: {e}"]
    return []


# ----------------------------------------------------------------------------------------- checking answers


def parsed(body: bytes) -> Any:
    """The body as the server parses it (None if it does not), for working out what a 2xx answer must hold."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def expected_choices(path: str, obj: dict[str, Any]) -> int:
    """How many choices (or native outputs) an accepted request must answer with: samples x prompts."""
    if path == "/v1/chat/completions":
        return obj.get("n", 1)
    if path == "/v1/completions":
        p = obj["prompt"]
        prompts = 1 if isinstance(p, str) or isinstance(p[0], int) else len(p)
        return prompts * obj.get("n", 1)
    prompts_value = obj["text"] if obj.get("text") is not None else obj["input_ids"]
    single = isinstance(prompts_value, str) or not prompts_value or isinstance(prompts_value[0], int)
    prompts = 1 if single else len(prompts_value)
    sp = obj.get("sampling_params") or {}
    sps = sp if isinstance(sp, list) else [sp] * prompts
    return sum(s.get("n", 1) for s in sps)


def length_limit(path: str, obj: dict[str, Any]) -> int:
    """The most tokens any one choice of an accepted request may have."""
    if path == "/v1/chat/completions":
        return obj.get("max_completion_tokens") or obj["max_tokens"]
    if path == "/v1/completions":
        return obj.get("max_tokens") or 16
    sp = obj["sampling_params"]
    return max(s["max_new_tokens"] for s in (sp if isinstance(sp, list) else [sp]))


def check_json_answer(path: str, obj: dict[str, Any], answer: Any) -> str | None:
    want, limit = expected_choices(path, obj), length_limit(path, obj)
    if path == "/generate":
        outs = answer if isinstance(answer, list) else [answer]
        if len(outs) != want:
            return f"{len(outs)} outputs for {want} prompts x samples"
        for o in outs:
            reason = o["meta_info"]["finish_reason"]
            if not isinstance(o["text"], str) or reason["type"] not in ("stop", "length"):
                return f"a bad output: {json.dumps(o)[:300]}"
            if len(o["output_ids"]) > limit or o["meta_info"]["completion_tokens"] > limit:
                return f"more than {limit} tokens: {json.dumps(o)[:300]}"
        return None
    kind = {"/v1/chat/completions": "chat.completion", "/v1/completions": "text_completion"}[path]
    choices = answer["choices"]
    if answer["object"] != kind or [c["index"] for c in choices] != list(range(want)):
        return f"want {want} choices of a {kind}: {json.dumps(answer)[:300]}"
    for c in choices:
        text = c["message"]["content"] if kind == "chat.completion" else c["text"]
        calls = c["message"].get("tool_calls") if kind == "chat.completion" else None
        if calls:  # an answer that called a tool: content may be null, and "tool_calls" ends it
            if (text is not None and not isinstance(text, str)) or c["finish_reason"] not in ("tool_calls", "length"):
                return f"a bad tool-call choice: {json.dumps(c)[:300]}"
        elif not isinstance(text, str) or c["finish_reason"] not in ("stop", "length"):
            return f"a bad choice: {json.dumps(c)[:300]}"
    if answer["usage"]["completion_tokens"] > want * limit:
        return f"more than {want} x {limit} tokens: {answer['usage']}"
    return None


def check_stream_answer(path: str, obj: dict[str, Any], events: list[Any]) -> str | None:
    want = expected_choices(path, obj)
    finished: Counter = Counter()
    for e in events[:-1]:
        if path == "/generate":
            reason = e["meta_info"]["finish_reason"]
            if reason is not None:
                if reason["type"] not in ("stop", "length"):
                    return f"a stream ended with {reason}"
                finished[e.get("index", 0)] += 1
            continue
        for c in e["choices"]:
            if c["finish_reason"] is not None:
                if c["finish_reason"] not in ("stop", "length", "tool_calls"):
                    return f"a stream choice ended with {c['finish_reason']!r}"
                finished[c["index"]] += 1
    if sorted(finished) != list(range(want)) or set(finished.values()) != {1}:
        return f"want one finish for each of {want} choices, got {dict(finished)}"
    return None


def check(req: FuzzRequest, status: int, content_type: str, body: bytes) -> str | None:
    """What is wrong with this answer to ``req``, or None."""
    if status >= 500:
        return f"HTTP {status}: {body[:500]!r}"
    if not 200 <= status < 300:
        problem = error_body_problem(body)
        return f"HTTP {status}: {problem}" if problem else None
    obj = parsed(req.body)
    if req.method != "POST" or not isinstance(obj, dict):
        return f"HTTP {status} for a request that cannot be valid: {body[:300]!r}"
    streamed = content_type.startswith("text/event-stream")
    if streamed != (obj.get("stream") is True):
        return f"stream={obj.get('stream')!r} but the answer is {content_type!r}"
    try:
        if streamed:
            events, problem = sse_problem(body.decode("utf-8"))
            return problem or check_stream_answer(req.path, obj, events)
        return check_json_answer(req.path, obj, json.loads(body))
    except (KeyError, TypeError, ValueError, IndexError) as e:
        return f"a malformed 2xx answer ({type(e).__name__}: {e}): {body[:300]!r}"


@dataclass
class Findings:
    statuses: Counter = field(default_factory=Counter)
    failures: list[tuple[FuzzRequest, str]] = field(default_factory=list)
    valid_refused: Counter = field(default_factory=Counter)  # messages of 4xx answers to "valid" requests
    sent: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, req: FuzzRequest, status: int, problem: str | None, body: bytes) -> None:
        with self.lock:
            self.sent += 1
            self.statuses[(req.path, status)] += 1
            if problem is not None:
                self.failures.append((req, problem))
            elif req.mode == "valid" and 400 <= status < 500 and req.method == "POST":
                message = (parsed(body) or {}).get("error", {}).get("message", "")
                self.valid_refused[re.sub(r"\d+", "N", message)[:100]] += 1

    def report(self) -> str:
        """The shortest failing request of each kind of failure (kinds: the problem with numbers blanked)."""
        kinds: dict[str, tuple[FuzzRequest, str]] = {}
        counts: Counter = Counter()
        for req, problem in self.failures:
            kind = req.path + " " + re.sub(r"\d+", "N", problem)[:90]
            counts[kind] += 1
            if kind not in kinds or len(req.body) < len(kinds[kind][0].body):
                kinds[kind] = (req, problem)
        return "\n".join(f"  [{counts[kind]}x] {req.show()}\n    -> {problem[:600]}"
                         for kind, (req, problem) in kinds.items())


def send(http: httpx.Client, url: str, req: FuzzRequest) -> tuple[int, str, bytes]:
    headers = {"Content-Type": req.content_type} if req.content_type else {}
    content: Any = iter([req.body[i:i + 65536] for i in range(0, len(req.body), 65536)]) if req.chunked else req.body
    r = http.request(req.method, url + req.path, content=content, headers=headers)
    return r.status_code, r.headers.get("content-type", ""), r.content


# ------------------------------------------------------------------------------------------------ the canary


def stream_text(http: httpx.Client, url: str, body: dict[str, Any]) -> str:
    """The text of a streamed completion; fails unless it is a 200 SSE stream ending in [DONE]."""
    r = http.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    events, problem = sse_problem(r.text)
    assert problem is None, problem
    return "".join(c["text"] for e in events[:-1] for c in e["choices"])


class Canary(threading.Thread):
    """Streams ``CANARY`` again and again until stopped; every run must give exactly ``reference``."""

    def __init__(self, url: str, reference: str) -> None:
        super().__init__(daemon=True)
        self.url, self.reference = url, reference
        self.stop = threading.Event()
        self.runs, self.problems = 0, []

    def run(self) -> None:
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
            while not self.stop.is_set() and len(self.problems) < 5:
                try:
                    text = stream_text(http, self.url, CANARY)
                except (AssertionError, httpx.HTTPError) as e:
                    self.problems.append(f"the canary failed: {type(e).__name__}: {e}"[:500])
                    continue
                self.runs += 1
                if text != self.reference:
                    self.problems.append(f"the canary's text changed under load:\n  want {self.reference!r}\n"
                                         f"  got  {text!r}")


# ---------------------------------------------------------------------------------------------------- the test


def test_fuzz_http_api(server):
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
        wait_idle(server)
        reference = stream_text(http, server.url, CANARY)
    canary = Canary(server.url, reference)
    findings = Findings()
    local = threading.local()
    deadline = time.monotonic() + FUZZ_SECONDS  # the edge cases and the fuzzing together
    examples = [0]

    def one(req: FuzzRequest) -> None:
        if not hasattr(local, "http"):
            local.http = httpx.Client(timeout=REQUEST_TIMEOUT_S)
        try:
            status, content_type, body = send(local.http, server.url, req)
        except httpx.HTTPError as e:
            findings.record(req, -1, f"no answer: {type(e).__name__}: {e}", b"")
            return
        findings.record(req, status, check(req, status, content_type, body), body)

    pool = ThreadPoolExecutor(3)

    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                                     HealthCheck.large_base_example])
    @given(st.lists(request(), min_size=1, max_size=3))
    def fuzz(batch: list[FuzzRequest]) -> None:
        if time.monotonic() > deadline:
            return  # the wall-clock guard: the remaining examples are drawn but not sent
        examples[0] += 1
        list(pool.map(one, batch))

    canary.start()
    t0 = time.monotonic()
    try:
        list(pool.map(one, edge_cases()))
        fuzz()
    finally:
        canary.stop.set()
        canary.join(REQUEST_TIMEOUT_S + 10)
        pool.shutdown(wait=True)
    elapsed = time.monotonic() - t0

    statuses = Counter()
    for (_, status), count in findings.statuses.items():
        statuses[status] += count
    print(f"\nfuzz: {examples[0]} examples, {findings.sent} requests in {elapsed:.0f} s; statuses "
          f"{dict(sorted(statuses.items()))}; canary runs {canary.runs}")
    if findings.valid_refused:
        print("valid-mode requests refused (check these are right):")
        for message, count in findings.valid_refused.most_common():
            print(f"  {count:4d}  {message}")
    problems = []
    if findings.failures:
        problems.append(f"{len(findings.failures)} bad answers; one reproducer per kind:\n{findings.report()}")
    problems += canary.problems
    if canary.runs == 0:
        problems.append("the canary never completed")
    problems += server_left_whole(server)
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


# ------------------------------------------------------------------------------------- requests that stall

STALL_BOUND_S = 20.0
LOOP_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
STALLERS = {
    # A stop regex with catastrophic backtracking: the scheduler checks it after every token, inside its loop.
    # (/generate's sampling_params.stop_regex reaches the same code.)
    "stop_regex": [("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
                                        "ignore_eos": True, "stop_regex": "(.+)+\u0000"})],
    # A chat template from the client that loops 10**10 times, once per worker thread of the validation pool.
    "chat_template": [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                "chat_template_kwargs": {"chat_template": LOOP_TEMPLATE}})] * 8,
}


@pytest.mark.parametrize("name", list(STALLERS))
def test_one_client_cannot_stall_the_server(name):
    """Small requests (under 200 bytes each) that a fuzzer is unlikely to draw but an attacker would write: after
    they are sent (and their clients gave up), a plain one-token completion must still be answered promptly. Each
    case gets its own server, killed afterwards, since a stalled server cannot be reused."""
    srv = ServerProcess("--log-level", "warning")
    try:
        srv.wait_ready()
        for path, body in STALLERS[name]:
            try:
                srv.post(path, json=body, timeout=2)
            except httpx.TimeoutException:
                pass  # the client gives up; what it started must not hold the server
        t0 = time.monotonic()
        try:
            r = srv.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=STALL_BOUND_S)
            answer: Any = (r.status_code, r.text[:200])
        except httpx.TimeoutException:
            answer = "no answer"
        if answer == "no answer" or answer[0] >= 500:
            pytest.fail(f"after the {name} requests, a plain one-token completion got {answer} within "
                        f"{time.monotonic() - t0:.0f} s", pytrace=False)
    finally:
        srv.kill_all()
