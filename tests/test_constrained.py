"""Structured output (chapter 12): json_schema, regex and ebnf constrained decoding with xgrammar.

The fast tests check the pieces on their own: parameter checks, the admission check's messages, the compile cache,
and the bitmask (padding ids banned, free rows untouched). The slow ones run the embedded SmolLM2-135M-Instruct on
the CPU and check outcomes: every constrained output is complete (finish reason ``stop``) and valid -- it parses
and validates against its schema with ``jsonschema``, fully matches its regex, or is a sentence of its grammar --
for greedy and seeded sampled decoding, in batches that also hold free requests whose outputs must equal a run
without the constrained ones; no sampled token is ever one the grammar rejects (re-checked token by token by an
independent matcher, and for regexes by the ``regex`` package's partial matching); overlap on and off give the
same greedy outputs; jump-forward keeps outputs valid and saves decode steps; bad grammars are refused by name
and do not disturb other requests.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import jsonschema
import pytest
import regex as regex_pkg
import torch
import xgrammar as xgr

from minisgl_ref import LLM, SamplingParams
from minisgl_ref.constrained import ANY_JSON, GrammarSpec, spec_of, validate_grammar
from minisgl_ref.constrained.backend import GrammarBackend
from minisgl_ref.constrained.bitmask import TokenBitmask
from minisgl_ref.constrained.extension import StructuredOutput
from minisgl_ref.constrained.matcher import GrammarState
from minisgl_ref.core.config import EngineConfig
from minisgl_ref.core.request import Req
from minisgl_ref.engine.engine import Engine

# ------------------------------------------------------------------------------------------------ workloads

# Small enough that SmolLM2-135M completes each within MAX_NEW_TOKENS (strings and arrays are bounded), varied
# enough to cover what JSON schemas are made of.
SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                               "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}},
        "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["score"]},
    {"type": "object", "properties": {"value": {"type": "null"}}, "required": ["value"]},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}}, "required": ["id"]},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date"}}, "required": ["when"]},
    {"type": "object", "properties": {"answer": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                                                           {"type": "boolean"}]}}, "required": ["answer"]},
    {"$defs": {"pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                                         "legs": {"type": "integer", "minimum": 0, "maximum": 4}},
                       "required": ["kind", "legs"]}},
     "type": "object", "properties": {"pet": {"$ref": "#/$defs/pet"}}, "required": ["pet"]},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 10},
                                      "note": {"type": "string", "maxLength": 10}}, "required": ["title"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                      "country": {"type": "string", "maxLength": 8},
                                      "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
     "required": ["city", "country", "population"]},
    {"type": "object", "properties": {"level": {"type": "string", "enum": ["low", "medium", "high"]},
                                      "urgent": {"type": "boolean"}}, "required": ["level", "urgent"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
     "required": ["matrix"]},
    {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
     "required": ["email"]},
    {"type": "object", "properties": {"maybe": {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "null"}]}},
     "required": ["maybe"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10}, "admin": {"type": "boolean"}}, "required": ["name", "admin"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
    {"type": "object", "properties": {"rating": {"type": "integer", "enum": [1, 2, 3, 4, 5]},
                                      "comment": {"type": "string", "maxLength": 10}},
     "required": ["rating", "comment"]},
    {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 50},
                                      "unit": {"const": "C"}}, "required": ["temperature", "unit"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/item"}}},
     "required": ["items"], "$defs": {"item": {"type": "object", "properties": {
         "sku": {"type": "string", "pattern": "^[a-z]{3}$"}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["sku", "qty"]}}},
]

# (pattern, a question that makes the model want to answer in that shape)
REGEXES: list[tuple[str, str]] = [
    (r"(yes|no)\.", "Is the sky blue? Answer yes or no."),
    (r"[0-9]{4}-[0-9]{2}-[0-9]{2}", "What is today's date?"),
    (r"\+1 [0-9]{3}-[0-9]{3}-[0-9]{4}", "Give me a phone number."),
    (r"[A-Z][a-z]{1,12}, [A-Z][a-z]{1,12}", "Name a city and its country."),
    (r"(red|green|blue)( and (red|green|blue)){0,2}", "Name some colors."),
    (r"[a-z]{2,10}@[a-z]{2,10}\.(com|org)", "Give me an email address."),
]

# EBNF (xgrammar's dialect, start rule ``root``) with tiny hand parsers below.
SUM_EBNF = 'root ::= num (" + " num){0,3}\nnum ::= [1-9] [0-9]?'
LIST_EBNF = 'root ::= "[" item (", " item){0,2} "]"\nitem ::= "apple" | "pear" | "plum"'
EBNFS: list[tuple[str, str, str]] = [
    (SUM_EBNF, r"[1-9][0-9]?( \+ [1-9][0-9]?){0,3}", "Write a sum of small numbers."),
    (LIST_EBNF, r"\[(apple|pear|plum)(, (apple|pear|plum)){0,2}\]", "List some fruit."),
]

MAX_NEW_TOKENS = 64
FREE_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3,"]


def _chat(llm: LLM, text: str) -> list[int]:
    return llm.chat_prompt_ids([{"role": "user", "content": text}])


def _schema_prompt(llm: LLM, schema: dict) -> list[int]:
    return _chat(llm, f"Reply with a JSON value for this JSON schema, nothing else:\n{json.dumps(schema)}")


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=MAX_NEW_TOKENS, **kw)


def _sampled(seed: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_new_tokens=MAX_NEW_TOKENS, **kw)


def _free_params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_new_tokens=24), SamplingParams(temperature=0, max_new_tokens=24),
            SamplingParams(temperature=0.9, seed=7, max_new_tokens=24),
            SamplingParams(temperature=0.7, top_k=40, seed=8, max_new_tokens=24)]


def _structured(engine: Engine) -> StructuredOutput:
    """The engine's structured-output extension."""
    found = engine.extensions.find(StructuredOutput)
    assert found is not None, "build_runtime gives every paged engine structured output"
    return found


def _backend(llm: LLM) -> GrammarBackend:
    backend = _structured(llm.engine).backend
    assert backend is not None
    return backend


def _engine(llm: LLM, **config) -> Engine:
    """A fresh paged engine on ``llm``'s model and grammar backend (the compile cache is shared)."""
    return Engine(llm.model, llm.config, EngineConfig(**config), device="cpu", context_length=llm.context_length,
                  extensions=[StructuredOutput(_backend(llm))])


def _run(llm: LLM, engine: Engine, prompts: Sequence[list[int]], params: Sequence[SamplingParams]) -> list[Req]:
    reqs = [llm.make_request(p, sp) for p, sp in zip(prompts, params)]
    for r in reqs:
        engine.add_request(r)
    engine.run_until_done()
    return reqs


def _assert_json_valid(schema: dict, req: Req) -> None:
    assert req.finish_reason is not None and req.finish_reason.kind == "stop", (req.finish_reason, req.output_text)
    value = json.loads(req.output_text)
    jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())


def _accepts_all(compiled: xgr.CompiledGrammar, ids: list[int], stops: Sequence[int]) -> tuple[bool, int]:
    """Feed ``ids`` to a fresh matcher: (all accepted and the grammar terminated, how many were accepted)."""
    m = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stops))
    for n, t in enumerate(ids):
        if not m.accept_token(t):
            return False, n
    return m.is_terminated(), len(ids)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu")


# ------------------------------------------------------------------------------------------------ fast tests


def test_sampling_params_take_one_grammar_and_name_the_fields():
    assert SamplingParams(json_schema={"type": "string"}).json_schema == '{"type": "string"}'
    assert spec_of(SamplingParams(json_schema=ANY_JSON)) == GrammarSpec("json_object", "")
    assert spec_of(SamplingParams(regex="a+")) == GrammarSpec("regex", "a+")
    assert spec_of(SamplingParams()) is None
    with pytest.raises(ValueError, match="json_schema and regex"):
        SamplingParams(json_schema="{}", regex="a")
    with pytest.raises(ValueError, match="regex and ebnf"):
        SamplingParams(regex="a", ebnf='root ::= "a"')
    with pytest.raises(ValueError, match="json_schema is not valid JSON"):
        SamplingParams(json_schema="{nope")
    with pytest.raises(ValueError, match="regex must be a non-empty string"):
        SamplingParams(regex="")
    p = SamplingParams(ebnf='root ::= "a"')
    assert SamplingParams.from_dict(p.to_dict()) == p  # survives the trip between server processes


@pytest.mark.parametrize("kw,field,reason", [
    (dict(json_schema={"type": "objekt"}), "json_schema", "Unsupported type"),
    (dict(json_schema={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}), "json_schema", ""),
    (dict(regex="a(b"), "regex", "parenthesis"),
    (dict(ebnf="root ::= foo"), "ebnf", "not defined"),
    (dict(ebnf="root ::= "), "ebnf", ""),
])
def test_validate_grammar_names_the_field_and_gives_the_reason(kw, field, reason):
    with pytest.raises(ValueError, match=f"^{field} is not a valid grammar: .*{reason}"):
        validate_grammar(SamplingParams(**kw))


def test_validate_grammar_accepts_good_grammars():
    for kw in (dict(json_schema=s) for s in SCHEMAS):
        validate_grammar(SamplingParams(**kw))
    for pattern, _ in REGEXES:
        validate_grammar(SamplingParams(regex=pattern))
    for grammar, _, _ in EBNFS:
        validate_grammar(SamplingParams(ebnf=grammar))
    validate_grammar(SamplingParams(json_schema=ANY_JSON))
    validate_grammar(SamplingParams())


@pytest.fixture(scope="module")
def tokenizer():
    from minisgl_ref.models.embedded import embedded_model_path
    from minisgl_ref.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(embedded_model_path())


def test_backend_compiles_once_per_grammar_and_caches_failures(tokenizer):
    backend = GrammarBackend(tokenizer.hf, len(tokenizer.hf))
    spec = GrammarSpec("regex", "[0-9]+")
    futures = [backend.compile_async(spec) for _ in range(5)]
    assert all(f is futures[0] for f in futures) and backend.num_compiles == 1
    assert isinstance(backend.compile(spec), xgr.CompiledGrammar)
    bad = GrammarSpec("regex", "(")
    for _ in range(2):
        with pytest.raises(ValueError, match="^regex is not a valid grammar"):
            backend.validate(bad)
    assert backend.num_compiles == 2
    backend.shutdown()


def test_bitmask_bans_padding_ids_and_leaves_free_rows_alone(tokenizer):
    """A model whose vocabulary is padded past the tokenizer's: the padding ids are banned in constrained rows,
    and a free row of the same batch is not touched at all."""
    vocab = len(tokenizer.hf) + 100
    backend = GrammarBackend(tokenizer.hf, vocab)
    state = backend.matcher(backend.compile(GrammarSpec("json_object", "")), stop_token_ids=tokenizer.eos_token_ids)
    mask = TokenBitmask(vocab, 4)
    logits = torch.randn(3, vocab)
    before = logits.clone()
    mask.fill([(1, state)])
    mask.apply(logits, [1])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = (logits[1] > float("-inf")).nonzero().flatten().tolist()
    assert allowed and max(allowed) < len(tokenizer.hf)
    assert all(tokenizer.decode([t], skip_special_tokens=False)[:1] == "{" for t in allowed)
    backend.shutdown()


@pytest.mark.parametrize("pooled", [False, True])
def test_a_grammar_cornered_by_its_stop_ids_allows_them_and_ends(tokenizer, monkeypatch, pooled):
    """Stop ids are never text to the grammar. When they cover every token the grammar allows next (here: the
    regex wants digits, and every token made of digits is a stop id), the filled row allows nothing;
    the stop ids are allowed instead, and accepting one ends the grammar. A row with a way on is left alone."""
    from minisgl_ref.constrained import bitmask as bm

    if pooled:  # the same on xgrammar's thread pool
        monkeypatch.setattr(bm, "FILL_THREADS", 4)
        monkeypatch.setattr(bm, "POOL_HANDOFF_US", 0.0)
    vocab = len(tokenizer.hf)
    backend = GrammarBackend(tokenizer.hf, vocab)
    digits = [t for t in range(vocab) if (text := tokenizer.decode([t])).isascii() and text.isdigit()]
    compiled = backend.compile(GrammarSpec("regex", "[0-9]+"))
    cornered = backend.matcher(compiled, [*tokenizer.eos_token_ids, *digits])
    free = backend.matcher(compiled, tokenizer.eos_token_ids)
    mask = TokenBitmask(vocab, 4)
    for _ in range(2):  # twice, so the pool's cost estimate sends the second fill there
        mask.fill([(0, cornered), (2, free)])
    logits = torch.zeros(3, vocab)
    mask.apply(logits, [0, 2])
    allowed = (logits[0] > float("-inf")).nonzero().flatten().tolist()
    assert cornered.can_be_cornered and not free.can_be_cornered  # only the first pays for the check
    assert cornered.at_dead_end and not free.at_dead_end
    assert allowed == sorted([*tokenizer.eos_token_ids, *digits])  # every stop id, nothing else
    assert (logits[2] > float("-inf")).nonzero().flatten().tolist() == digits  # a way on: digits, no EOS yet
    assert not cornered.is_terminated and cornered.accept(digits[-1]) and cornered.is_terminated
    assert not free.accept(min(tokenizer.eos_token_ids))  # not at a dead end, EOS is refused before a digit
    backend.shutdown()


def test_bitmask_fill_moves_to_the_thread_pool_only_when_the_rows_are_dear(tokenizer, monkeypatch):
    """Cheap fills stay on the calling thread, a step whose rows would take one thread longer than twice the
    pool's hand-off goes to xgrammar's pool, and both ways write the same masks."""
    from minisgl_ref.constrained import bitmask as bm

    monkeypatch.setattr(bm, "FILL_THREADS", 4)
    backend = GrammarBackend(tokenizer.hf, len(tokenizer.hf))
    compiled = backend.compile(GrammarSpec("json_object", ""))
    states = [backend.matcher(compiled, stop_token_ids=tokenizer.eos_token_ids) for _ in range(6)]
    prefixes = ['{', '{"a"', '{"a": ', '{"a": "x', '{"a": 1', '{"a": [']
    for state, prefix in zip(states, prefixes):  # rows at different points of an object
        assert state.accepts(tokenizer.hf.encode(prefix, add_special_tokens=False))
    used = []
    real = xgr.BatchGrammarMatcher.batch_fill_next_token_bitmask
    monkeypatch.setattr(xgr.BatchGrammarMatcher, "batch_fill_next_token_bitmask",
                        lambda self, *a, **k: used.append(len(a[0])) or real(self, *a, **k))
    rows = list(enumerate(states))
    alone = bm.TokenBitmask(len(tokenizer.hf), 8)
    alone.fill(rows)  # nothing measured yet: one thread
    assert used == [] and alone.us_per_row > 0
    pooled = bm.TokenBitmask(len(tokenizer.hf), 8)
    pooled.us_per_row = 2 * bm.POOL_HANDOFF_US  # as if the last step's rows had been dear
    pooled.fill(rows)
    assert used == [6]
    assert torch.equal(pooled.host[:6], alone.host[:6])
    assert len(set(map(tuple, alone.host[:6].tolist()))) > 1  # the rows really differ
    pooled.us_per_row = 1.0  # cheap again: back to one thread
    pooled.fill(rows)
    assert used == [6]
    backend.shutdown()


def test_grammar_host_benchmark_replays_valid_documents(tokenizer):
    """``benchmarks/grammar_host.py`` times the grammar's host work on documents its rows write: each is a valid
    instance of the typical schema, and replaying them through the matchers (one call per row, or xgrammar's batch
    call) accepts every token and ends every grammar, so every part is timed over real steps."""
    from benchmarks.grammar_host import document, measure, typical_schema

    schema = typical_schema()
    eos = min(tokenizer.eos_token_ids)
    backend = GrammarBackend(tokenizer.hf, len(tokenizer.hf), stop_token_ids=[eos])
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps(schema)))
    texts = [document(i) for i in range(4)]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    docs = [tokenizer.hf.encode(t, add_special_tokens=False) for t in texts]
    result = measure(3, backend, compiled, docs, eos)  # raises if a token is refused
    assert result["steps"] == max(len(d) for d in docs[:3]) + 1
    assert all(result[part] > 0 for part in ("accept", "accept_batch", "fill", "apply"))
    backend.shutdown()


# ------------------------------------------------------------------------------------------------ the engine


@pytest.mark.slow
def test_json_schemas_greedy_and_sampled_beside_free_requests(llm):
    """Every schema, greedy and seeded-sampled, in one batch with free requests: each constrained output is a
    complete, valid instance of its schema, and the free outputs equal a run without the constrained ones."""
    free_prompts = [llm.tokenizer.encode(p) for p in FREE_PROMPTS]
    schema_prompts = [_schema_prompt(llm, s) for s in SCHEMAS]
    prompts = schema_prompts + schema_prompts + free_prompts
    params = ([_greedy(json_schema=s) for s in SCHEMAS] + [_sampled(i, json_schema=s) for i, s in enumerate(SCHEMAS)]
              + _free_params())
    reqs = _run(llm, llm.engine, prompts, params)
    alone = _run(llm, _engine(llm), free_prompts, _free_params())
    for schema, req in zip(SCHEMAS + SCHEMAS, reqs):
        _assert_json_valid(schema, req)
    assert [r.output_ids for r in reqs[-len(FREE_PROMPTS):]] == [r.output_ids for r in alone]


@pytest.mark.slow
def test_any_json_object(llm):
    prompt = _chat(llm, 'Reply with a short JSON object like {"title": "...", "year": 1999}, nothing else.')
    for params in (_greedy(json_schema=ANY_JSON), _sampled(3, json_schema=ANY_JSON)):
        params.max_new_tokens = 200
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        assert out.finish_reason == "stop", out
        assert isinstance(json.loads(out.text), dict)


@pytest.mark.slow
def test_regex_and_ebnf_outputs_match(llm):
    """Regexes fully match (``re.fullmatch``), EBNF outputs parse (by a regex equivalent to each tiny grammar),
    greedy and sampled, next to a free request."""
    prompts, params, checks = [], [], []
    for i, (pattern, question) in enumerate(REGEXES):
        for p in (_greedy(regex=pattern), _sampled(10 + i, regex=pattern)):
            prompts.append(_chat(llm, question)), params.append(p), checks.append(pattern)
    for i, (grammar, equivalent, question) in enumerate(EBNFS):
        for p in (_greedy(ebnf=grammar), _sampled(20 + i, ebnf=grammar)):
            prompts.append(_chat(llm, question)), params.append(p), checks.append(equivalent)
    prompts.append(llm.tokenizer.encode(FREE_PROMPTS[0])), params.append(_free_params()[0])
    reqs = _run(llm, llm.engine, prompts, params)
    for pattern, req in zip(checks, reqs):
        assert req.finish_reason.kind == "stop", (pattern, req.finish_reason, req.output_text)
        assert re.fullmatch(pattern, req.output_text), (pattern, req.output_text)


@pytest.mark.slow
def test_no_sampled_token_is_ever_rejected_by_the_grammar(llm):
    """The oracle: hot sampling (temperature 1.5, so the model wants to stray) under a mask never emits a token
    the grammar rejects. Every output is re-checked token by token by a fresh matcher; regex outputs also by
    the ``regex`` package: every decoded prefix must still be extendable to a full match."""
    backend = _backend(llm)
    stops = sorted(llm.eos_token_ids)
    cases = [("json_schema", json.dumps(s)) for s in SCHEMAS[:6]] + [("regex", p) for p, _ in REGEXES]
    cases += [("ebnf", g) for g, _, _ in EBNFS]
    prompts = [_chat(llm, "Say anything you like.")] * len(cases)
    params = [SamplingParams(temperature=1.5, seed=100 + i, max_new_tokens=MAX_NEW_TOKENS, **{kind: src})
              for i, (kind, src) in enumerate(cases)]
    reqs = _run(llm, llm.engine, prompts, params)
    for (kind, src), req in zip(cases, reqs):
        compiled = backend.compile(spec_of(req.params))
        ok, n = _accepts_all(compiled, req.output_ids, stops)
        if req.finish_reason.kind == "stop":
            assert ok, (kind, src, req.output_ids[: n + 1])
        else:  # cut by max_new_tokens: every token accepted, the grammar simply not finished yet
            assert req.finish_reason.kind == "length" and n == len(req.output_ids), (kind, src, n)
        if kind == "regex":
            for k in range(1, len(req.output_ids) + 1):
                prefix = llm.tokenizer.decode(req.output_ids[:k])
                if "\ufffd" not in prefix:
                    assert regex_pkg.fullmatch(src, prefix, partial=True), (src, prefix)


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_grammars_hold_under_every_sampling_rule_at_its_valid_extreme(llm, overlap):
    """Each request brings a grammar and one sampling rule at a valid extreme: numbers that are 0 or infinite in
    float32, filters that keep one token, biases against what the grammar wants, and bans on its stop ids (EOS by
    ``min_new_tokens``, and ``stop_token_ids`` over a seventh of the vocabulary). No request is aborted, and every
    token is one the grammar allows, but for a stop id that ends the output where the grammar could go on only
    through one of the request's stop ids (a dead end: a stop token is never text to the grammar)."""
    backend, stops = _backend(llm), sorted(llm.eos_token_ids)
    every_seventh = list(range(0, llm.config.vocab_size, 7))
    rules = [dict(temperature=1e300), dict(temperature=1e-6, seed=1), dict(repetition_penalty=5e-324),
             dict(repetition_penalty=1e-40, temperature=1.0, seed=2), dict(top_p=5e-324, temperature=1.0, seed=3),
             dict(min_p=1.0, temperature=1.0, seed=4), dict(frequency_penalty=2.0, presence_penalty=-2.0),
             dict(logit_bias={str(t): -100.0 for t in range(30, 60)}),
             dict(min_new_tokens=24, temperature=1.0, seed=5),
             dict(min_new_tokens=24, stop_token_ids=every_seventh, temperature=1.0, seed=6)]
    grammars = [("regex", r"(yes|no)\."), ("json_schema", json.dumps(SCHEMAS[1])), ("ebnf", SUM_EBNF)]
    cases = [(kind, src, rule) for rule in rules for kind, src in grammars]
    params = [SamplingParams(**{"max_new_tokens": 24, **rule, kind: src}) for kind, src, rule in cases]
    reqs = _run(llm, _engine(llm, disable_overlap_schedule=not overlap),
                [_chat(llm, "Is the sky blue? Answer in the form you must.")] * len(cases), params)
    dead_ends = 0
    for (kind, src, rule), req in zip(cases, reqs):
        assert req.finish_reason.kind in ("stop", "length"), (kind, rule, req.finish_reason)
        compiled = backend.compile(spec_of(req.params))
        request_stops = sorted(set(req.params.stop_token_ids or ()) | set(stops))  # what ends this grammar
        ok, n = _accepts_all(compiled, req.output_ids, request_stops)
        if req.finish_reason.kind == "length":
            assert n == len(req.output_ids), (kind, rule, req.output_ids[: n + 1])
        elif not ok:  # a dead end: the tokens before the stop id were allowed, and then nothing was
            *text, last = req.output_ids
            assert last in req.params.stop_token_ids and n == len(text), (kind, rule, req.output_ids[: n + 1])
            state = backend.matcher(compiled, request_stops)
            assert state.accepts(text)
            mask = xgr.allocate_token_bitmask(1, llm.config.vocab_size)
            state.fill(mask, 0)
            assert not mask.any(), (kind, rule, req.output_ids)
            dead_ends += 1
    assert dead_ends > 0  # the stop ids over a seventh of the vocabulary do corner some grammar


@pytest.mark.slow
def test_overlap_on_and_off_give_the_same_greedy_outputs(llm):
    """Under overlap a constrained row's mask needs the previous step's token: the engine processes that step
    between the next forward pass and its sampling. The outputs must equal the non-overlapped engine's."""
    schemas = SCHEMAS[:8]
    prompts = [_schema_prompt(llm, s) for s in schemas] + [_chat(llm, q) for _, q in REGEXES[:3]]
    prompts += [llm.tokenizer.encode(p) for p in FREE_PROMPTS[:2]]
    params = [_greedy(json_schema=s) for s in schemas] + [_greedy(regex=p) for p, _ in REGEXES[:3]]
    params += _free_params()[:2]
    on = _run(llm, _engine(llm), prompts, params)
    off = _run(llm, _engine(llm, disable_overlap_schedule=True), prompts, params)
    assert [r.output_ids for r in on] == [r.output_ids for r in off]
    for schema, req in zip(schemas, on):
        _assert_json_valid(schema, req)


@pytest.mark.slow
def test_overlap_samples_a_constrained_step_before_processing_the_step_in_flight(llm, monkeypatch):
    """Under overlap, step N+1's masks need step N's tokens in the matchers, and nothing else of step N: those
    tokens are accepted before N+1's masks are filled, N+1 is sampled, and only then is step N processed
    (detokenized, its stop rules checked, its finished requests ended). Each token enters its request's matcher
    exactly once, including a request whose grammar ended in step N while its row of N+1 was already running."""
    engine = _engine(llm)
    structured = _structured(engine)
    prompts = [_schema_prompt(llm, SCHEMAS[1]), _chat(llm, REGEXES[0][1]), llm.tokenizer.encode(FREE_PROMPTS[0])]
    params = [_greedy(json_schema=SCHEMAS[1]), _greedy(regex=REGEXES[0][0]), _free_params()[0]]
    reqs = [llm.make_request(p, sp) for p, sp in zip(prompts, params)]
    log: list[tuple[str, int]] = []  # (event, step): the step launched at that moment, or the step processed
    accepts: dict[int, int] = {}  # id(GrammarState) -> tokens accepted
    matchers: dict[str, GrammarState] = {}  # rid -> its matcher (kept: the extension drops it after the end)
    stale: list[tuple[str, int, int]] = []  # masks filled from a matcher that had not seen every sampled token

    real_accept, real_fill = GrammarState.accept, TokenBitmask.fill
    sampler, real_sample, real_process = engine.runner.sampler, engine.runner.sampler.sample, engine._process

    def accept(self, token):
        accepts[id(self)] = accepts.get(id(self), 0) + 1
        return real_accept(self, token)

    def fill(self, rows):
        log.append(("fill", engine.frees.launched))
        for _, state in rows:
            req = next(r for r in reqs if structured.matcher(r) is state)
            matchers[req.rid] = state
            sampled = len(req.output_ids) + req.num_inflight - 1  # every token sampled before this step
            if state.num_accepted != sampled:
                stale.append((req.rid, state.num_accepted, sampled))
        return real_fill(self, rows)

    def sample(*args, **kwargs):
        log.append(("sample", engine.frees.launched))
        return real_sample(*args, **kwargs)

    def process(launched):
        log.append(("process", launched.step))
        return real_process(launched)

    monkeypatch.setattr(GrammarState, "accept", accept)
    monkeypatch.setattr(TokenBitmask, "fill", fill)
    monkeypatch.setattr(sampler, "sample", sample)
    monkeypatch.setattr(engine, "_process", process)
    for r in reqs:
        engine.add_request(r)
    engine.run_until_done()

    assert not stale, stale
    where = {event: i for i, event in enumerate(log)}
    checked = [step for kind, step in log if kind == "fill" and ("process", step - 1) in where]
    assert len(checked) >= 5, log
    for step in checked:  # step N+1 = ``step`` was sampled before step N was processed
        assert where[("fill", step)] < where[("sample", step)] < where[("process", step - 1)], (step, log)
    constrained = reqs[:2]
    assert all(r.finish_reason.kind == "stop" for r in constrained), [r.finish_reason for r in constrained]
    assert reqs[2].finish_reason.kind == "length" and len(reqs[2].output_ids) > len(constrained[0].output_ids)
    assert [accepts[id(matchers[r.rid])] for r in constrained] == [len(r.output_ids) for r in constrained]
    _assert_json_valid(SCHEMAS[1], constrained[0])
    assert re.fullmatch(REGEXES[0][0], constrained[1].output_text), constrained[1].output_text


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [True, False])
def test_jump_forward_keeps_outputs_valid_and_saves_decode_steps(llm, overlap):
    """With jump-forward the forced parts of the JSON (keys, punctuation) are appended without decode steps:
    outputs stay valid, their text is the decode of their tokens, and on fixed-key schemas steps are saved."""
    schemas = [SCHEMAS[0], SCHEMAS[4], SCHEMAS[10], SCHEMAS[13], SCHEMAS[18]]
    prompts = [_schema_prompt(llm, s) for s in schemas] * 2 + [llm.tokenizer.encode(FREE_PROMPTS[1])]
    params = [_greedy(json_schema=s) for s in schemas] + [_sampled(i, json_schema=s) for i, s in enumerate(schemas)]
    params += _free_params()[:1]
    plain = _engine(llm, disable_overlap_schedule=not overlap)
    jumping = _engine(llm, disable_overlap_schedule=not overlap, enable_jump_forward=True)
    without = _run(llm, plain, prompts, params)
    reqs = _run(llm, jumping, prompts, params)
    for schema, req in zip(schemas + schemas, reqs):
        _assert_json_valid(schema, req)
        assert req.output_text == llm.tokenizer.decode(req.output_ids)
    assert reqs[-1].output_ids == without[-1].output_ids  # the free request is not affected
    assert _structured(jumping).jump_forwards > 0 and _structured(jumping).jump_forward_tokens > 0
    # Fewer steps in all: the forced tokens were appended in the extend rows that ride along with decode steps.
    assert jumping.stats.steps < plain.stats.steps, (jumping.stats, plain.stats)


@pytest.mark.slow
def test_bad_grammars_are_refused_by_name_and_the_engine_keeps_serving(llm):
    prompt = llm.tokenizer.encode("Hello")
    for kw, field in [(dict(json_schema={"type": "objekt"}), "json_schema"), (dict(regex="a(b"), "regex"),
                      (dict(ebnf="root ::= foo"), "ebnf")]:
        with pytest.raises(ValueError, match=f"^{field}"):
            llm.generate([prompt, prompt], [SamplingParams(max_new_tokens=4), SamplingParams(**kw)], use_tqdm=False)
    with pytest.raises(ValueError, match="json_schema and regex"):
        llm.generate(prompt, {"json_schema": "{}", "regex": "a", "max_new_tokens": 4}, use_tqdm=False)
    assert not llm.engine.has_work  # nothing was queued
    # A grammar that reaches the engine without the admission check aborts its own request only.
    bad = Req(input_ids=prompt, params=SamplingParams(regex="a(b", max_new_tokens=4),
              eos_token_ids=llm.eos_token_ids)
    good = llm.make_request(_chat(llm, "Is water wet?"), _greedy(regex=r"(yes|no)\."))
    free = llm.make_request(prompt, SamplingParams(temperature=0, max_new_tokens=4))
    for r in (bad, good, free):
        llm.engine.add_request(r)
    llm.engine.run_until_done()
    assert bad.finish_reason.kind == "abort" and "regex is not a valid grammar" in bad.finish_reason.message
    assert good.finish_reason.kind == "stop" and re.fullmatch(r"(yes|no)\.", good.output_text)
    assert free.finish_reason.kind == "length" and len(free.output_ids) == 4


# Each (schema, a request that tempts the model to break it) for keywords the grammar enforces; the refused
# keywords are tests/test_schema_support.py's REFUSED table, each with the output the grammar would have let out.
TEMPTING: list[tuple[dict, str]] = [
    ({"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 2, "maxItems": 3},
     'Write the JSON list ["cat", "cat", "cat", "cat", "cat"] and nothing else.'),
    ({"allOf": [{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                 "additionalProperties": False}]}, "Reply with the bare number 12321 and nothing else."),
    ({"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}, "Reply with the number 7."),
    ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}, "What is the value of pi?"),
    ({"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 4}]},
     "Reply with the JSON value [1, 2, 3]."),
    ({"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}}, "required": ["name"],
      "additionalProperties": False, "maxProperties": 1}, "Describe a person as JSON with name, age and city."),
    ({"type": "object", "properties": {"not": {"type": "boolean"}, "if": {"type": "string", "maxLength": 5}},
      "required": ["not", "if"]}, "Write a JSON object with the keys not and if."),
    ({"type": "string", "format": "date"}, "What day is it today? Answer in words."),
    ({"type": "string", "pattern": "^[A-Z]{3}$"}, "Write the word hello in lower case."),
    ({"type": "object", "propertyNames": {"pattern": "^[a-c]$"}, "additionalProperties": {"type": "integer"},
      "maxProperties": 2}, 'Write the JSON object {"apple": 1, "zebra": 2}.'),
    ({"type": "string", "enum": ["red", "green"]}, "What color is the sky?"),
    ({"type": "array", "prefixItems": [{"type": "string", "maxLength": 5}, {"type": "integer", "minimum": 0,
                                                                      "maximum": 99}], "items": False, "minItems": 2},
     "Write a JSON list of five fruits."),
]


@pytest.mark.slow
def test_tempting_requests_keep_every_enforced_keyword_and_unenforced_ones_are_refused(llm):
    """Offline, a schema with a keyword the grammar would skip is a ``ValueError`` naming the keyword and its
    place, before anything runs; a schema of enforced keywords holds even when the prompt asks for the opposite."""
    from tests.test_schema_support import REFUSED

    prompt = llm.tokenizer.encode("Hello")
    for schema, keyword, path, _ in REFUSED:
        with pytest.raises(ValueError, match=re.escape(f"json_schema: the keyword {keyword!r} at {path} ")):
            llm.generate([prompt, prompt], [SamplingParams(max_new_tokens=4), _greedy(json_schema=schema)],
                         use_tqdm=False)
    assert not llm.engine.has_work
    prompts = [_chat(llm, question) for _, question in TEMPTING]
    outs = llm.generate(prompts, [_greedy(json_schema=schema) for schema, _ in TEMPTING], use_tqdm=False)
    for (schema, question), out in zip(TEMPTING, outs):
        assert out.finish_reason == "stop", (question, out.text)
        jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.gpu
def test_gpu_constrained_outputs_stay_valid_with_masks_copied_from_pinned_buffers():
    """On a GPU the masks go to the device from two pinned host buffers used in turn, while the forward pass runs
    (overlap on, CUDA graphs, bf16): a buffer refilled before its copy was read would ban the wrong tokens, the
    matcher would then refuse a sampled token and the request would abort. No request may abort, every constrained
    one that ends by its grammar (most must; greedy and sampled) holds a valid instance, free requests share the
    batches, and both ways of filling (one thread, the pool) must have run."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from minisgl_ref.constrained import bitmask as bm

    pooled = []
    real = xgr.BatchGrammarMatcher.batch_fill_next_token_bitmask
    original = bm.TokenBitmask.fill

    def fill(self, rows):  # type: ignore[no-untyped-def]
        self.us_per_row = self.us_per_row if len(pooled) else 10 * bm.POOL_HANDOFF_US  # the first step: the pool
        return original(self, rows)

    def spy(self, *a, **k):  # type: ignore[no-untyped-def]
        pooled.append(len(a[0]))
        return real(self, *a, **k)

    llm = LLM(device="cuda")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(xgr.BatchGrammarMatcher, "batch_fill_next_token_bitmask", spy)
        mp.setattr(bm.TokenBitmask, "fill", fill)
        schemas = SCHEMAS
        prompts = [_schema_prompt(llm, s) for s in schemas] * 2 + [llm.tokenizer.encode(p) for p in FREE_PROMPTS]
        params = ([_greedy(json_schema=s) for s in schemas]
                  + [SamplingParams(temperature=0.8, seed=i, max_new_tokens=MAX_NEW_TOKENS, json_schema=s)
                     for i, s in enumerate(schemas)]
                  + _free_params())
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert pooled, "the pool never filled a step"
    assert all(o.finish_reason != "abort" for o in outs), [o.text for o in outs if o.finish_reason == "abort"]
    stopped = [(schema, out) for schema, out in zip(schemas * 2, outs) if out.finish_reason == "stop"]
    for schema, out in stopped:  # a request cut off by its length limit holds a valid prefix (it never aborted)
        jsonschema.validate(json.loads(out.text), schema, format_checker=jsonschema.FormatChecker())
    assert len(stopped) >= len(schemas), f"only {len(stopped)} of {2 * len(schemas)} constrained requests ended"
    assert all(len(o.output_ids) > 0 for o in outs[2 * len(schemas):])
