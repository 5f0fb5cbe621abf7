"""Per-request sampling parameters (chapter 02).

A request arrives with a bag of knobs -- how many tokens, how random, when to stop. ``SamplingParams`` is that
bag, with SGLang's field names and defaults so that a client written for SGLang (or for OpenAI, after the server
renames ``max_tokens`` to ``max_new_tokens``) means the same thing here.

Why validate so eagerly? A bad value that slips through does not fail where it was written: ``top_p=0`` only
blows up deep inside a batched sort, ``top_k=2.5`` silently changes what ``ranks < k`` means, and one request
with ``temperature=float('nan')`` poisons nothing but its own row -- which is worse, because nobody notices. The
server turns the ``ValueError`` raised here into an HTTP 400 whose message names the offending field, so every
message below says *which* field and *what* value.

The ranges follow SGLang and the OpenAI API:

=====================  ======================================================
field                  allowed
=====================  ======================================================
max_new_tokens         int >= 0
temperature            finite number >= 0 (0 means greedy)
top_k                  -1 (off) or int >= 1
top_p                  number in (0, 1]
min_p                  number in [0, 1]
frequency_penalty      number in [-2, 2]
presence_penalty       number in [-2, 2]
repetition_penalty     number in (0, 2]
stop                   None, a non-empty string, or a list of them
stop_token_ids         None or a list of ints >= 0
stop_regex             None, a regular expression, or a list of them
logit_bias             None or {token id: bias in [-100, 100]} (OpenAI's; JSON keys may be strings)
min_new_tokens         int in [0, max_new_tokens]
n                      int >= 1
seed                   None or an int
json_schema            None, a JSON schema (a JSON string; a dict is serialised), or ANY_JSON (any object)
regex                  None or a regular expression the whole output must match
ebnf                   None or a grammar in xgrammar's EBNF dialect (its start rule is ``root``)
structural_tag         None or SGLang's structural tag (a JSON string; a dict is serialised), see below
=====================  ======================================================

**Structured output (chapter 12).** ``json_schema``, ``regex``, ``ebnf`` and ``structural_tag`` are SGLang's names
for constrained decoding: at most one may be set. A structural tag, ``{"type": "structural_tag", "structures":
[{"begin": ..., "schema": {...}, "end": ...}], "triggers": [...]}``, leaves the text free until one of the triggers
is written, then forces one of the structures (its begin string, JSON for its schema, its end string), then frees
the text again: each begin must start with a trigger. Here they are only checked for shape (a string, valid JSON for a schema); whether
the grammar itself is valid is xgrammar's call, made by :func:`minisgl_ref.constrained.validate_grammar` (the
server's admission check, an HTTP 400; ``LLM.generate``'s, a ``ValueError``) and again when the engine compiles
it. The same check refuses a schema that uses a keyword the grammar would not enforce, by name
(:mod:`minisgl_ref.constrained.schema_support`). ``json_schema=ANY_JSON`` asks for any
JSON object, whatever its properties: that is what OpenAI's ``response_format={"type": "json_object"}`` means, and
it is *not* ``'{"type": "object"}'``, which a strict schema compiler reads as "an object with no properties at
all".

``bool`` is rejected wherever a number is expected: ``True`` is an ``int`` in Python, but ``n=True`` is a bug,
not a request for one completion.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import regex

#: Temperatures below this count as greedy. Dividing logits by 1e-40 overflows float32 to inf and turns the
#: softmax into NaN; SGLang draws the same line. ``temperature=0`` is the documented way to ask for greedy.
GREEDY_TEMPERATURE_EPS = 1e-6

#: Temperatures above this are sampled at this one. 1e300 is a valid temperature but infinite in float32, and a
#: grammar's ``-inf`` logit divided by inf (or times 1/inf = 0) is NaN. At 1e30 the distribution over the finite
#: logits is already uniform to float32 precision, and 1/T is still a normal float32 that no GPU flushes to 0.
MAX_TEMPERATURE = 1e30


#: ``json_schema=ANY_JSON``: any JSON object, whatever its properties (OpenAI's
#: ``response_format={"type": "json_object"}``). The same sentinel string as SGLang's, so a client that sends it to
#: SGLang's ``/generate`` means the same here.
ANY_JSON = "$$ANY$$"

#: The sampling parameters that constrain the output with a grammar; at most one of them may be set.
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
#: The sampling parameters that the core engine cannot honour by itself: an engine extension must claim them
#: (``EngineExtension.claims``), or a request that sets one is refused at the door, naming it (chapter 12).
EXTENSION_FIELDS = GRAMMAR_FIELDS


def _describe(value: Any) -> str:
    """``'hot' (str)``: the value and its type, for error messages about wrong types."""
    return f"{value!r} ({type(value).__name__})"


def _check_int(name: str, value: Any) -> int:
    """Accept Python and NumPy integers, reject ``bool`` and floats (``top_k=2.0`` is not silently truncated)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {_describe(value)}")
    return int(value)


def _check_real(name: str, value: Any) -> float:
    """Accept ints and floats (``top_p=1`` is fine), reject ``bool``, strings and NaN/inf."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {_describe(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {_describe(value)}")
    return value


def _normalize_stop(value: Any, name: str = "stop") -> list[str]:
    """``None`` -> ``[]``, ``"x"`` -> ``["x"]``; every stop string must be non-empty (``""`` would match at once)."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a string or a list of strings, got {_describe(value)}")
    for s in value:
        if not isinstance(s, str):
            raise ValueError(f"{name} must contain only strings, got {_describe(s)}")
        if s == "":
            raise ValueError(f"{name} entries must be non-empty, got ''")
    return list(value)


def _normalize_stop_token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, set, frozenset)):
        raise ValueError(f"stop_token_ids must be a list of ints, got {_describe(value)}")
    ids = [_check_int("stop_token_ids", t) for t in value]
    for t in ids:
        if t < 0:
            raise ValueError(f"stop_token_ids must be >= 0, got {t}")
    return ids


def _normalize_stop_regex(value: Any) -> list[str]:
    patterns = _normalize_stop(value, "stop_regex")
    for pattern in patterns:
        try:
            regex.compile(pattern)  # the regex package (a superset of re's syntax), as the detokenizer uses it
        except regex.error as e:
            raise ValueError(f"stop_regex {pattern!r} is not a valid regular expression: {e}") from e
    return patterns


def _normalize_json_schema(value: Any) -> str | None:
    """A schema arrives as a JSON string (the wire format) or, offline, as a dict: store the string, which is
    what the grammar cache is keyed by. Only JSON syntax is checked here; the schema's meaning is xgrammar's."""
    if value is None or value == ANY_JSON:
        return value
    if isinstance(value, Mapping):
        try:
            return json.dumps(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"json_schema: the dict is not JSON-serialisable: {e}") from e
    if not isinstance(value, str):
        raise ValueError(f"json_schema must be a JSON string or a dict, got {_describe(value)}")
    try:
        parsed = json.loads(value)
    except ValueError as e:
        raise ValueError(f"json_schema is not valid JSON: {e}") from e
    if not isinstance(parsed, (dict, bool)):
        raise ValueError(f"json_schema must be a JSON object (a schema), got {type(parsed).__name__}")
    return value


def _normalize_structural_tag(value: Any) -> str | None:
    """SGLang's structural tag, checked for shape and stored as JSON text (the grammar cache's key). Each schema's
    meaning (and its keywords) is checked later, like ``json_schema``'s."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"structural_tag is not valid JSON: {e}") from e
    if not isinstance(value, Mapping):
        raise ValueError(f"structural_tag must be a JSON object, got {_describe(value)}")
    if value.get("type") != "structural_tag":
        raise ValueError(f'structural_tag: "type" must be "structural_tag", got {value.get("type")!r}')
    unknown = sorted(set(value) - {"type", "structures", "triggers"})
    if unknown:
        raise ValueError(f"structural_tag: unknown key {unknown[0]!r} (expected type, structures and triggers)")
    triggers, structures = value.get("triggers"), value.get("structures")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError(f"structural_tag: triggers must be a non-empty list of non-empty strings, "
                         f"got {_describe(triggers)}")
    if not isinstance(structures, list) or not structures:
        raise ValueError(f"structural_tag: structures must be a non-empty list, got {_describe(structures)}")
    for i, item in enumerate(structures):
        where = f"structural_tag: structures[{i}]"
        if not isinstance(item, Mapping) or set(item) != {"begin", "schema", "end"}:
            raise ValueError(f"{where} must be an object with exactly begin, schema and end, got {_describe(item)}")
        if not isinstance(item["begin"], str) or not isinstance(item["end"], str):
            raise ValueError(f"{where}: begin and end must be strings")
        if not isinstance(item["schema"], (Mapping, bool)):
            raise ValueError(f"{where}.schema must be a JSON schema (an object), got {_describe(item['schema'])}")
        if not any(item["begin"].startswith(t) for t in triggers):
            raise ValueError(f"{where}.begin {item['begin']!r} does not start with any of the triggers")
    try:
        return json.dumps({"type": "structural_tag", "structures": structures, "triggers": triggers})
    except (TypeError, ValueError) as e:
        raise ValueError(f"structural_tag: not JSON-serialisable: {e}") from e


def _check_grammar_fields(params: SamplingParams) -> None:
    for name in ("regex", "ebnf"):
        value = getattr(params, name)
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"{name} must be a non-empty string, got {_describe(value)}")
    params.json_schema = _normalize_json_schema(params.json_schema)
    params.structural_tag = _normalize_structural_tag(params.structural_tag)
    given = [name for name in GRAMMAR_FIELDS if getattr(params, name) is not None]
    if len(given) > 1:
        raise ValueError(f"only one of json_schema, regex, ebnf and structural_tag may be set, "
                         f"got {' and '.join(given)}")


#: OpenAI's range for a logit bias: -100 bans a token in practice, +100 all but forces it.
LOGIT_BIAS_LIMIT = 100.0


def _normalize_logit_bias(value: Any) -> dict[int, float]:
    """``{token id: bias}``; JSON objects have string keys, so ``{"42": -100}`` means token 42."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"logit_bias must map token ids to numbers, got {_describe(value)}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        if isinstance(key, str) and key.isascii() and key.strip().lstrip("-").isdigit():
            key = int(key)
        token = _check_int("logit_bias", key)
        if token < 0:
            raise ValueError(f"logit_bias keys must be token ids >= 0, got {token}")
        bias = _check_real("logit_bias", bias)
        if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}")
        out[token] = bias
    return out


@dataclass
class SamplingParams:
    """How one request wants its tokens chosen and when it wants to stop.

    Values are checked and normalised once, at construction; the sampler trusts them afterwards.
    """

    max_new_tokens: int = 128  #: the most output tokens; 0 with prompt log probabilities scores the prompt only
    temperature: float = 1.0  #: 0 means greedy (argmax)
    top_k: int = -1  #: keep the k most likely tokens; -1 means off
    top_p: float = 1.0  #: keep the smallest set of tokens whose probabilities add up to p (nucleus)
    min_p: float = 0.0  #: drop tokens less likely than min_p times the most likely one
    frequency_penalty: float = 0.0  #: subtracted from a logit per earlier output of its token
    presence_penalty: float = 0.0  #: subtracted once from the logit of every token output so far
    repetition_penalty: float = 1.0  #: > 1 discourages tokens of the prompt or output, < 1 favours them
    stop: str | list[str] | None = None  #: stop strings, normalised to list[str]
    stop_token_ids: list[int] | None = None  #: extra stop token ids, normalised to list[int]
    stop_regex: str | list[str] | None = None  #: normalised to list[str]: stop once the output text matches
    logit_bias: dict[int, float] | None = None  #: normalised to {token id: bias}; added to the logits
    ignore_eos: bool = False  #: keep generating past the model's end-of-sequence tokens
    min_new_tokens: int = 0  #: EOS and stop token ids cannot be drawn before this many tokens
    n: int = 1  #: completions of the same prompt (each one a request of its own)
    seed: int | None = None  #: the same seed and prompt give the same tokens (default: one drawn per request)
    skip_special_tokens: bool = True  #: leave special tokens out of the output text
    # Structured output (chapter 12): at most one of these; see the module docstring and minisgl_ref.constrained.
    json_schema: str | None = None  #: a JSON schema as a JSON string (a dict is serialised), or ANY_JSON
    regex: str | None = None  #: the output must match this regular expression, whole
    ebnf: str | None = None  #: the output must be a sentence of this grammar (start rule ``root``)
    structural_tag: str | None = None  #: SGLang's structural tag as JSON text (a dict is serialised)

    def __post_init__(self) -> None:
        # Lengths.
        self.max_new_tokens = _check_int("max_new_tokens", self.max_new_tokens)
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        self.min_new_tokens = _check_int("min_new_tokens", self.min_new_tokens)
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be <= max_new_tokens ({self.max_new_tokens}), got {self.min_new_tokens}"
            )

        # Randomness and truncation.
        self.temperature = _check_real("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        self.top_k = _check_int("top_k", self.top_k)
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        self.top_p = _check_real("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.min_p = _check_real("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

        # Penalties.
        for name in ("frequency_penalty", "presence_penalty"):
            value = _check_real(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _check_real("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")

        # Stopping.
        self.stop = _normalize_stop(self.stop)
        self.stop_token_ids = _normalize_stop_token_ids(self.stop_token_ids)
        self.stop_regex = _normalize_stop_regex(self.stop_regex)
        self.logit_bias = _normalize_logit_bias(self.logit_bias)
        self.ignore_eos = _check_bool("ignore_eos", self.ignore_eos)
        self.skip_special_tokens = _check_bool("skip_special_tokens", self.skip_special_tokens)

        # Fan-out and reproducibility.
        self.n = _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.seed is not None:
            self.seed = _check_int("seed", self.seed)

        # Structured output.
        _check_grammar_fields(self)

    @property
    def grammar_field(self) -> str | None:
        """The name of the grammar field that is set (one of :data:`GRAMMAR_FIELDS`), or None."""
        return next((name for name in GRAMMAR_FIELDS if getattr(self, name) is not None), None)

    @property
    def is_greedy(self) -> bool:
        """Greedy requests skip softmax, filtering and noise: the sampler takes a plain argmax for them.

        ``temperature == 0`` (or below :data:`GREEDY_TEMPERATURE_EPS`) and ``top_k == 1`` both leave exactly one
        candidate, so both are greedy.
        """
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    def to_dict(self) -> dict[str, Any]:
        """Plain-Python dict (lists, not tuples; string keys) that survives JSON, msgpack and pickling between
        server processes."""
        d = dataclasses.asdict(self)
        d["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}  # type: ignore[union-attr]
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingParams:
        """Inverse of :meth:`to_dict`. Unknown keys are errors: a typo like ``top-p`` must not be ignored."""
        if not isinstance(data, Mapping):
            raise ValueError(f"sampling params must be a mapping, got {_describe(data)}")
        known = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key not in known:
                raise ValueError(f"unknown sampling parameter {key!r}")
        return cls(**data)
