"""Which JSON-schema keywords the grammar enforces, and the refusal of the others (chapter 12), without a model.

``minisgl_ref/constrained/schema_support.py`` claims two things, and each is checked against xgrammar itself:

* **Refused keywords are real holes.** For every refused keyword there is a text that xgrammar's grammar for the
  schema accepts and that is *not* a valid instance (``jsonschema`` says so, or it is not even JSON): the refusal
  is what stands between the client and that output. (Where no such text can exist -- an unknown keyword, an
  annotation-only one -- the row has none, and the refusal is the allow-list's.) If a future xgrammar starts
  enforcing one, its row fails here, and the keyword can move to the allow-list.
* **Allowed keywords are enforced.** Each schema of a corpus that uses every allowed keyword is compiled the way
  the engine compiles it, for a vocabulary of single characters, and random walks through the grammar (at each
  step, any character the grammar allows) write hundreds of documents: every one that ends is valid JSON and
  validates against its schema with ``jsonschema``.

The last part covers the tool-call schema: tools with ``$defs`` (from ``openai.pydantic_function_tool``, two of
them with a definition of the same name and a different shape) nested in the call grammar, for every
``tool_choice`` that builds one.
"""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest
import torch
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from minisgl_ref import SamplingParams
from minisgl_ref.constrained import validate_grammar
from minisgl_ref.constrained.backend import JSON_ANY_WHITESPACE, GrammarBackend
from minisgl_ref.constrained.schema_support import (
    check_schema_support,
    hoist_definitions,
    regex_problem,
    unsupported_keyword,
)
from minisgl_ref.constrained.spec import GrammarSpec
from minisgl_ref.server.tools import Function, call_schema, plan_tools

# ------------------------------------------------------------------------------------------ refused keywords

OBJ_AB = {"a": {"type": "integer"}, "b": {"type": "integer"}}
DRAFT7 = "http://json-schema.org/draft-07/schema#"

# (schema, the keyword refused, where it sits, a text the grammar accepts that is no valid instance, or None)
REFUSED: list[tuple[dict[str, Any], str, str, str | None]] = [
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
      "required": ["tags"]}, "uniqueItems", "#/properties/tags", '{"tags": ["a", "a"]}'),
    ({"$defs": {"Tags": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}, "type": "object",
      "properties": {"t": {"$ref": "#/$defs/Tags"}}, "required": ["t"]}, "uniqueItems", "#/$defs/Tags",
     '{"t": [1, 1]}'),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf", "#", "0.3"),
    ({"type": "integer", "minimum": 0, "multipleOf": 3}, "multipleOf", "#", "4"),
    ({"type": "integer", "multipleOf": 5000}, "multipleOf", "#", "4"),
    ({"type": "integer", "multipleOf": 1.5}, "multipleOf", "#", "1"),
    ({"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 100000}, "multipleOf", "#", "4"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "p": {"type": "integer"}},
      "not": {"required": ["p"]}}, "not", "#", '{"a": 1, "p": 2}'),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]},
     "allOf", "#", "12321"),
    ({"allOf": [{"type": "integer"}], "minimum": 5}, "minimum", "#", "1"),
    ({"type": "object", "properties": OBJ_AB, "if": {"required": ["a"]}, "then": {"required": ["b"]}},
     "if", "#", '{"a": 1}'),
    ({"type": "object", "properties": OBJ_AB, "required": ["a"], "else": {"required": ["b"]},
      "if": {"required": ["x"]}}, "else", "#", '{"a": 1}'),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}}, "contains", "#", "[1, 2]"),
    ({"type": "array", "items": {"type": "integer"}, "minContains": 2, "contains": {"const": 7}}, "minContains",
     "#", "[7, 1]"),
    ({"type": "array", "items": {"type": "integer"}, "maxContains": 1, "contains": {"const": 7}}, "maxContains",
     "#", "[7, 7]"),
    ({"type": "array", "prefixItems": [{"type": "string"}], "additionalItems": False}, "additionalItems", "#",
     None),
    ({"type": "object", "properties": OBJ_AB, "dependentRequired": {"a": ["b"]}}, "dependentRequired", "#",
     '{"a": 1}'),
    ({"type": "object", "properties": OBJ_AB, "dependentSchemas": {"a": {"required": ["b"]}}}, "dependentSchemas",
     "#", '{"a": 1}'),
    ({"$schema": DRAFT7, "type": "object", "properties": OBJ_AB, "dependencies": {"a": ["b"]}}, "dependencies", "#",
     '{"a": 1}'),
    ({"type": "object", "properties": {"zz": {"type": "integer"}}, "required": ["zz"],
      "propertyNames": {"pattern": "^[ab]$"}}, "propertyNames", "#", '{"zz": 1}'),
    ({"type": "object", "propertyNames": {"pattern": "^a$"}, "additionalProperties": False}, "propertyNames", "#",
     '{"a": 1}'),
    ({"type": "object", "properties": {"xa": {"type": "integer"}}, "patternProperties": {"^x": {"type": "string"}}},
     "patternProperties", "#", '{"xa": 1}'),
    ({"type": "object", "patternProperties": {"^x": {"type": "string"}, "^x$": {"maxLength": 1}}},
     "patternProperties", "#", '{"x": "ab"}'),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2}, "minProperties", "#",
     '{"x": 1, "x": 2}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}, "required", "#", '{"a": 1}'),
    ({"type": "object", "properties": {"a": {"required": ["x"]}}, "required": ["a"]}, "required",
     "#/properties/a", '{"a": {}}'),
    ({"minimum": 5}, "minimum", "#", "1"),
    ({"type": "string", "format": "frobnicate"}, "format", "#", None),
    ({"type": "integer", "format": "int32"}, "format", "#", None),
    ({"type": "string", "format": "json-pointer"}, "format", "#", '"/a"b"'),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "maxLength", "#", '"abcdef"'),
    ({"type": "string", "format": "date", "maxLength": 4}, "maxLength", "#", '"2020-01-01"'),
    ({"type": "string", "minLength": 11, "format": "date"}, "minLength", "#", '"2020-01-01"'),
    ({"type": "string", "format": "date", "pattern": "^1"}, "pattern", "#", '"2020-01-01"'),
    ({"type": "string", "pattern": "^(?!a)[a-z]+$"}, "pattern", "#", '"ab"'),
    ({"type": "string", "pattern": "a$b"}, "pattern", "#", '"ab"'),
    ({"const": "x", "type": "integer"}, "type", "#", '"x"'),
    ({"enum": ["ab", "abc"], "maxLength": 2}, "maxLength", "#", '"abc"'),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}], "minimum": 5}, "minimum", "#", "1"),
    ({"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n", "minimum": 5}, "minimum", "#", "1"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf", "#", "1"),
    ({"$defs": {"a": {"$anchor": "foo", "type": "integer"}}, "$ref": "#foo"}, "$ref", "#", '"s"'),
    ({"$defs": {"n": {"type": "integer"}}, "type": "object", "required": ["a"], "properties": {"a": {
        "$id": "https://example.com/inner", "$defs": {"n": {"type": "string"}}, "type": "object", "required": ["b"],
        "properties": {"b": {"$ref": "#/$defs/n"}}}}}, "$id", "#/properties/a", '{"a": {"b": 1}}'),
    ({"type": []}, "type", "#", None),
    ({"type": "string", "nullable": True}, "nullable", "#", None),
    ({"type": "string", "contentEncoding": "base64"}, "contentEncoding", "#", None),
    ({"$dynamicRef": "#x"}, "$dynamicRef", "#", None),
    ({"type": "object", "properties": {"a~b/c": {"type": "string", "x-order": 1}}}, "x-order", "#/properties/a~0b~1c",
     None),
]


def _holds(schema: dict[str, Any], text: str) -> bool:
    """Is ``text`` a valid instance of ``schema`` (JSON, and valid for the validator its ``$schema`` names)?"""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return jsonschema.validators.validator_for(schema)(schema).is_valid(value)


@pytest.mark.parametrize("schema, keyword, path, breaking", REFUSED,
                         ids=[f"{k}@{p}" for _, k, p, _ in REFUSED])
def test_a_keyword_the_grammar_skips_is_refused_by_name_and_place(schema, keyword, path, breaking):
    reason = unsupported_keyword(schema)
    assert reason is not None and reason.startswith(f"the keyword {keyword!r} at {path} "), reason
    with pytest.raises(ValueError, match=r"^json_schema: the keyword " + repr(keyword).replace("$", r"\$")):
        validate_grammar(SamplingParams(json_schema=schema))
    with pytest.raises(ValueError, match="json_schema: the keyword"):
        check_schema_support(json.dumps(schema))
    if breaking is not None:  # the hole the refusal closes: the grammar takes an output that breaks the schema
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema))
        assert _is_grammar_accept_string(grammar, breaking), "xgrammar enforces it now: allow the keyword"
        assert not _holds(schema, breaking)


def test_the_engine_refuses_a_skipped_keyword_even_without_the_admission_check():
    """A request that reaches the engine with such a schema (an engine driven directly) ends in its compile's
    ``ValueError``, the same message, instead of a grammar with a hole."""
    backend = GrammarBackend(tokenizer=None, vocab_size=8)  # the check comes before any tokenizer is needed
    with pytest.raises(ValueError, match="'uniqueItems' at #/properties/tags"):
        backend.compile(GrammarSpec("json_schema", json.dumps(REFUSED[0][0])))
    backend.shutdown()


def test_keyword_checks_can_be_skipped_for_a_schema_nothing_enforces():
    validate_grammar(SamplingParams(json_schema=REFUSED[0][0]), keywords=False)  # a tool's in "auto" mode
    with pytest.raises(ValueError, match="not a valid grammar"):  # xgrammar's own verdict still holds
        validate_grammar(SamplingParams(json_schema={"type": "no-such-type"}), keywords=False)


def test_regex_problem_reads_classes_and_escapes():
    for ok in ("^[a-z]+$", "^[^$]+$", r"^a\$b$", "[]^$]", r"\^x", "(?:ab)+", "(?i)abc", "a|b"):
        assert regex_problem(ok) is None, ok
    for bad in ("a^b", "a$b", "(?=a)a", "(?!a)b", "(?<=a)b", "(?<!a)b", "(a$)", "^(^a)"):
        assert regex_problem(bad), bad


# ------------------------------------------------------------------------------------------ allowed keywords

STR3 = {"type": "string", "maxLength": 3}
ALLOWED: list[dict[str, Any]] = [
    # numbers
    {"type": "integer", "minimum": -5, "maximum": 40},
    {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 3},
    {"type": "integer", "multipleOf": 7},
    {"type": "integer", "multipleOf": 3, "minimum": -10, "maximum": 50},
    {"type": "integer", "multipleOf": 4, "exclusiveMinimum": 1, "exclusiveMaximum": 30},
    {"type": "number", "minimum": -1.5, "maximum": 2.25},
    {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    {"type": "number", "minimum": 0.1234567, "maximum": 0.2},
    # strings
    {"type": "string", "minLength": 2, "maxLength": 5},
    {"type": "string", "pattern": "^[a-c]{2}-[0-9]+$"},
    {"type": "string", "pattern": "[^$]x"},
    {"type": "string", "format": "date"},
    {"type": "string", "format": "date-time"},
    {"type": "string", "format": "email"},
    {"type": "string", "format": "uuid"},
    {"type": "string", "format": "ipv4"},
    # arrays
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False, "minItems": 1},
    {"type": "array", "prefixItems": [{"type": "boolean"}], "items": STR3, "maxItems": 3},
    {"type": "array", "prefixItems": [{"type": "null"}], "unevaluatedItems": {"type": "integer"}, "maxItems": 3},
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": False, "maxItems": 4},
    # objects
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": STR3}, "required": ["b"],
     "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "boolean"}}, "additionalProperties": {"type": "integer"},
     "maxProperties": 3},
    {"type": "object", "properties": {"a": {"type": "null"}}, "unevaluatedProperties": {"type": "boolean"},
     "maxProperties": 2},
    {"type": "object", "properties": {"a": {"type": "null"}}, "unevaluatedProperties": False},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}},
     "minProperties": 2, "maxProperties": 2},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "minProperties": 1,
     "additionalProperties": {"type": "boolean"}},
    {"type": "object", "propertyNames": {"pattern": "^[a-c]{1,2}$"}, "additionalProperties": {"type": "integer"},
     "maxProperties": 3},
    {"type": "object", "propertyNames": {"enum": ["x", "y"]}, "maxProperties": 2},
    {"type": "object", "patternProperties": {"^k[0-9]$": {"type": "boolean"}}, "maxProperties": 3},
    {"properties": {"not": {"type": "integer"}, "uniqueItems": {"const": True}, "$ref": STR3,
                    "allOf": {"type": "null"}}, "required": ["not", "$ref"]},
    # values, choices and references
    {"type": "string", "enum": ["a", "b"]},
    {"const": 3, "type": "integer", "title": "three"},
    {"enum": [1, "x", None, {"a": [1]}, [True]]},
    {"const": "c", "enum": ["a", "c"]},
    {"anyOf": [{"type": "integer", "maximum": 3}, STR3, {"type": "null"}]},
    {"oneOf": [{"type": "integer"}, STR3, {"type": "array", "maxItems": 1}]},
    {"oneOf": [{"enum": [1, 2]}, {"const": "x"}, {"type": "boolean"}]},
    {"discriminator": {"propertyName": "k"}, "oneOf": [
        {"$ref": "#/$defs/A"},
        {"type": "object", "properties": {"k": {"enum": ["b", "c"]}, "w": STR3}, "required": ["k", "w"]}],
     "$defs": {"A": {"type": "object", "properties": {"k": {"const": "a"}, "v": {"type": "integer"}},
                     "required": ["k", "v"]}}},
    {"allOf": [{"type": "integer", "minimum": 5, "maximum": 9}], "description": "one subschema"},
    {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                     "required": ["x"]}}, "type": "array", "items": {"$ref": "#/$defs/p"}, "maxItems": 2},
    {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                      "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["v", "next"]},
    {"type": ["string", "integer", "null"], "minimum": 3, "maxLength": 2},
    {"type": "string", "minimum": 3, "uniqueItems": True, "properties": {"x": {"not": {}}}},  # all vacuous here
    {"$defs": {"unused": {"not": {"uniqueItems": True}}}, "type": "boolean"},
    True,
]

#: One character per token (printable ASCII, a newline, an accented letter) and an end token.
VOCAB = [chr(c) for c in range(0x20, 0x7F)] + ["\n", "é", "<eos>"]
EOS = len(VOCAB) - 1
CLOSERS = frozenset('"}]0123456789el')  # characters that end strings, containers, numbers, true/false/null
SHIFTS = torch.arange(32, dtype=torch.int32)


@pytest.fixture(scope="module")
def char_compiler() -> xgr.GrammarCompiler:
    return xgr.GrammarCompiler(xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS]), cache_enabled=False)


def compile_like_the_engine(compiler: xgr.GrammarCompiler, schema: Any) -> xgr.CompiledGrammar:
    return compiler.compile_json_schema(json.dumps(schema), any_whitespace=JSON_ANY_WHITESPACE)


def random_document(compiled: xgr.CompiledGrammar, rng: random.Random, limit: int = 160) -> str | None:
    """A random walk through the grammar, one character at a time: the text once the grammar lets it end (it
    ends early sometimes, and is steered towards closing characters after a while), or None past ``limit``."""
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, len(VOCAB))
    out: list[str] = []
    for step in range(limit):
        matcher.fill_next_token_bitmask(mask)
        allowed = ((mask[0].unsqueeze(1) >> SHIFTS) & 1).flatten()[:len(VOCAB)].nonzero().flatten().tolist()
        pool = [t for t in allowed if t != EOS]
        if not pool or (EOS in allowed and rng.random() < (0.9 if step > 12 else 0.3)):
            assert EOS in allowed, f"the grammar is stuck after {''.join(out)!r}"
            return "".join(out)
        if step > 24:
            closing = [t for t in pool if VOCAB[t] in CLOSERS]
            if closing and rng.random() < 0.8:
                pool = closing
        token = rng.choice(pool)
        assert matcher.accept_token(token)
        out.append(VOCAB[token])
    return None


def assert_documents_hold(compiler: xgr.GrammarCompiler, grammar_schema: Any, check: Any, n: int = 150,
                          seed: int = 0) -> set[str]:
    """``n`` random walks through ``grammar_schema``'s grammar; every finished document passes ``check``."""
    compiled = compile_like_the_engine(compiler, grammar_schema)
    rng = random.Random(seed)
    finished = [text for text in (random_document(compiled, rng) for _ in range(n)) if text is not None]
    for text in finished:
        check(json.loads(text))
    assert len(finished) >= n // 3, f"too few walks ended for {grammar_schema}: {finished}"
    return set(finished)


@pytest.mark.parametrize("schema", ALLOWED, ids=[str(i) for i in range(len(ALLOWED))])
def test_every_document_an_allowed_schema_grammar_writes_is_valid(char_compiler, schema):
    assert unsupported_keyword(schema) is None
    validate_grammar(SamplingParams(json_schema=schema if schema is not True else "true"))
    validator = jsonschema.validators.validator_for(schema)(schema) if schema is not True else None
    assert_documents_hold(char_compiler, schema, validator.validate if validator else lambda v: None,
                          seed=ALLOWED.index(schema))


# -------------------------------------------------------------------------------- tool schemas with $defs


def pydantic_tools() -> list[dict[str, Any]]:
    """Three tools from pydantic models: two define an ``Item`` of their own (different shapes), one is
    recursive."""
    openai = pytest.importorskip("openai")
    from pydantic import BaseModel, Field

    class Item(BaseModel):  # the order's item
        sku: str = Field(pattern="^[a-z]{3}$")
        qty: int = Field(ge=1, le=9)

    class Address(BaseModel):
        city: str = Field(max_length=12)

    class PlaceOrder(BaseModel):
        items: list[Item] = Field(min_length=1, max_length=2)
        ship_to: Address
        gift: Address | None

    Order = Item

    class Item(BaseModel):  # noqa: F811 - the stock's item: the same name, another shape
        name: str = Field(max_length=8)
        shelf: int = Field(ge=0, le=99)

    class CheckStock(BaseModel):
        item: Item

    class Node(BaseModel):
        label: str = Field(max_length=4)
        children: list[Node] = Field(max_length=2)

    assert Order is not Item
    return [openai.pydantic_function_tool(m) for m in (PlaceOrder, CheckStock, Node)]


def _functions() -> list[Function]:
    return [Function(t["function"]["name"], None, t["function"]["parameters"]) for t in pydantic_tools()]


def test_pydantic_tools_define_what_their_calls_need():
    """The premise: nested models come as ``$defs`` and ``$ref``s, and two tools share a definition's name."""
    params = [f.parameters for f in _functions()]
    assert set(params[0]["$defs"]) == {"Item", "Address"} and set(params[1]["$defs"]) == {"Item"}
    assert params[0]["$defs"]["Item"] != params[1]["$defs"]["Item"]
    assert "Node" in params[2]["$defs"]


def test_hoisted_definitions_get_fresh_names_and_their_references_follow():
    defs: dict[str, Any] = {}
    first = hoist_definitions({"$defs": {"A": {"type": "integer"}}, "properties": {"a": {"$ref": "#/$defs/A"}},
                               "type": "object"}, "f", defs)
    second = hoist_definitions({"definitions": {"A": {"type": "string"}}, "type": "object",
                                "properties": {"a": {"$ref": "#/definitions/A"}, "d": {"const": {"$ref": "#/x"}}}},
                               "f", defs)
    assert first["properties"]["a"] == {"$ref": "#/$defs/f.A"} and defs["f.A"] == {"type": "integer"}
    assert second["properties"]["a"] == {"$ref": "#/$defs/f.A_2"} and defs["f.A_2"] == {"type": "string"}
    assert second["properties"]["d"] == {"const": {"$ref": "#/x"}}  # data, not a reference: untouched
    # A reference to the schema's own root (or into its body) makes the body a definition of its own.
    recursive = {"$id": "x", "type": "object", "properties": {"up": {"$ref": "#"}, "twin": {"$ref": "#/properties/up"}}}
    moved = hoist_definitions(recursive, "g", defs)
    assert moved == {"$ref": "#/$defs/g"}
    assert defs["g"] == {"type": "object", "properties": {"up": {"$ref": "#/$defs/g"},
                                                          "twin": {"$ref": "#/$defs/g/properties/up"}}}


@pytest.mark.parametrize("choice, parallel", [("required", True), ("required", False), ("PlaceOrder", False),
                                              ("CheckStock", False), ("Node", False)])
def test_call_grammar_of_tools_with_defs_writes_valid_arguments(char_compiler, choice, parallel):
    """The call schema of tools with ``$defs`` is a valid grammar that enforces every keyword, and each call it
    writes has arguments valid against its own tool's schema (refs and all)."""
    functions = _functions()
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    schema = call_schema(plan_tools(functions, tool_choice, parallel))
    validate_grammar(SamplingParams(json_schema=schema))  # parses, and every keyword is enforced
    own = {f.name: jsonschema.Draft202012Validator(f.parameters) for f in functions}

    def check(value: Any) -> None:
        calls = value if isinstance(value, list) else [value]
        assert calls and (parallel or not isinstance(value, list))
        for call in calls:
            assert set(call) == {"name", "arguments"} and (choice == "required" or call["name"] == choice)
            own[call["name"]].validate(call["arguments"])

    docs = assert_documents_hold(char_compiler, schema, check, n=120, seed=len(choice) + parallel)
    if choice == "required":  # the walks reach more than one tool
        assert len({json.loads(d)["name"] if not d.startswith("[") else json.loads(d)[0]["name"] for d in docs}) > 1


def test_a_recursive_tool_schema_stays_recursive_under_the_call(char_compiler):
    params = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
              "required": ["n", "next"], "additionalProperties": False}
    plan = plan_tools([Function("chain", None, params)], {"type": "function", "function": {"name": "chain"}})
    schema = call_schema(plan)
    validate_grammar(SamplingParams(json_schema=schema))
    validator = jsonschema.Draft202012Validator(params)
    docs = assert_documents_hold(char_compiler, schema, lambda v: validator.validate(v["arguments"]), n=150)
    assert any('"next": {' in d for d in docs), "no walk went one level down"
