"""Structured output and tool calling on the server (chapters 10 and 12).

The first half needs no model: the tool-call parser of ``minisgl_ref/server/tools.py`` on whole answers and on
streams cut at arbitrary places (a hypothesis test), the tool plan's checks, the schema that forces a call, and
how a conversation with tool calls is written for a template that knows nothing of tools.

The second half (``slow``) drives one real ``python -m minisgl_ref serve`` on the embedded SmolLM2-135M-Instruct
with the official ``openai`` client and raw HTTP: ``response_format`` (a pydantic model through the client's
``parse``, ``json_object``, ``json_schema``), SGLang's ``json_schema`` / ``regex`` / ``ebnf`` on ``/generate`` and
the OpenAI routes, every ``tool_choice`` streamed and not, and the 400s for bad grammars and bad tools, with the
server still serving around them. Greedy decoding (``temperature=0``) keeps every answer reproducible.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl_ref.server.protocol import APIError
from minisgl_ref.server.tools import (
    Function,
    ToolCallParser,
    call_schema,
    call_structural_tag,
    plan_tools,
    render_messages,
    template_renders_tools,
    tool_prompt,
)
from tests.server_utils import error_body_problem, parse_sse, running_server

MODEL = "SmolLM2-135M-Instruct"

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                  "required": ["city"], "additionalProperties": False}
ADD_PARAMS = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "b": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["a", "b"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                            "parameters": WEATHER_PARAMS}}
ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD_PARAMS}}
FUNCTIONS = [Function("get_weather", "Get the weather", WEATHER_PARAMS), Function("add", None, ADD_PARAMS)]
NAMES = {"get_weather", "add"}


# ================================================================================ the parser, without a model


def parse(text: str, form: str = "tagged", chunks: list[str] | None = None) -> tuple[ToolCallParser, list[Any]]:
    """Run the parser over ``chunks`` (default: the whole text at once); the parser and the deltas it gave."""
    p = ToolCallParser(NAMES, form)  # type: ignore[arg-type]
    deltas = [p.feed(c) for c in (chunks if chunks is not None else [text])]
    deltas.append(p.finish())
    return p, [d for d in deltas if d]


def assemble(deltas: list[Any]) -> tuple[str, list[dict[str, Any]]]:
    """Content and calls from streamed deltas, the way an OpenAI client puts a stream together: by ``index``,
    with ``id``, ``type`` and ``name`` from a call's first piece and ``arguments`` concatenated."""
    content, calls = "", {}  # type: ignore[var-type]
    for d in deltas:
        content += d.content
        for piece in d.tool_calls:
            call = calls.setdefault(piece["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in piece:
                assert call["id"] is None and piece["type"] == "function", "a call's head comes once, first"
                call["id"], call["name"] = piece["id"], piece["function"]["name"]
            else:
                assert call["id"] is not None, "arguments before the call's head"
            call["arguments"] += piece["function"].get("arguments", "")
    assert sorted(calls) == list(range(len(calls))), "indexes count up from 0"
    return content, [calls[i] for i in sorted(calls)]


def calls_of(p: ToolCallParser) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in p.calls]


def test_parser_whole_answers():
    p, _ = parse('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n')
    assert p.content == "Let me look." and calls_of(p) == [("get_weather", {"city": "Paris"})]
    assert p.calls[0].arguments == '{"city": "Paris"}'  # passed through as the model wrote it
    assert re.fullmatch(r"call_[0-9a-f]{24}", p.calls[0].id)

    # Two calls; one with its keys the other way round (parsed whole at its closing tag); braces inside strings.
    p, _ = parse('<tool_call>{"name": "get_weather", "arguments": {"city": "a}b{"}}</tool_call>\n'
                 '<tool_call>{"arguments": {"a": 1, "b": 2}, "name": "add"}</tool_call>')
    assert p.content == "" and calls_of(p) == [("get_weather", {"city": "a}b{"}), ("add", {"a": 1, "b": 2})]
    assert len({c.id for c in p.calls}) == 2

    # No call: every character is content, whitespace included.
    text = "  Paris is sunny today.\n\n  "
    p, _ = parse(text)
    assert p.content == text and p.calls == []

    # Not calls: an unknown function, broken JSON, a tag that never opens: content exactly as written.
    for text in ['<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "<tool_call>{oops}</tool_call> ok",
                 "a < b and <tool_cal", "<tool_call>"]:
        p, _ = parse(text)
        assert p.content == text and p.calls == [], text

    # A call the output ended inside of (cut by max_tokens, or EOS before the closing tag).
    p, _ = parse('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}')
    assert calls_of(p) == [("add", {"a": 1, "b": 2})]
    # A call closed without its tag, then prose: the prose is content again.
    p, _ = parse('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}\nThat adds them.')
    assert calls_of(p) == [("add", {"a": 1, "b": 2})] and p.content == "That adds them."
    p, _ = parse('<tool_call>{"name": "add", "arguments": {"a": 1, "b"')
    assert [c.name for c in p.calls] == ["add"] and p.calls[0].arguments == '{"a": 1, "b"'


def test_parser_grammar_shaped_answers():
    """What the grammar of "required" (an array, or one object) and of a named function produces."""
    p, _ = parse('[{"name": "add", "arguments": {"a": 1, "b": 2}}, \n {"name": "get_weather", "arguments": '
                 '{"city": "Oslo"}}]', form="array")
    assert p.content == "" and calls_of(p) == [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]
    p, _ = parse('{ "name" : "get_weather" , "arguments" : { "city" : "[Oslo]" } }', form="object")
    assert calls_of(p) == [("get_weather", {"city": "[Oslo]"})]
    p, _ = parse('{"arguments": {"city": "Oslo"}, "name": "get_weather"}', form="object")
    assert calls_of(p) == [("get_weather", {"city": "Oslo"})]


# Pieces of model output for the hypothesis test: prose, whitespace, things that look like tags, calls of each
# kind (passed through, parsed whole, refused), and unclosed ends.
PIECES = [
    "Sure.", " ", "\n", "Paris", "a < b", "<", "<tool", "</tool_call>", "{}", '"', "\\",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    '<tool_call>{"name":"add","arguments":{"a":1,"b":{"x":[1,"}"]}}}</tool_call>',
    '<tool_call>{"arguments": {"a": 2, "b": 3}, "name": "add"}</tool_call>',
    '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "add", "arguments": "{\\"a\\": 5, \\"b\\": 6}"}</tool_call>',
    "<tool_call>not json</tool_call>",
    '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}\nDone, no closing tag.',
    '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}, "id": 7}</tool_call>',
]
TAILS = ["", '<tool_call>{"name": "add", "arguments": {"a": 1', "<tool_ca", '<tool_call>{"name": "get_']


@st.composite
def split_text(draw: Any) -> tuple[str, list[str]]:
    text = "".join(draw(st.lists(st.sampled_from(PIECES), max_size=8))) + draw(st.sampled_from(TAILS))
    cuts = sorted(draw(st.sets(st.integers(1, max(len(text) - 1, 1)), max_size=12)))
    cuts = [c for c in cuts if 0 < c < len(text)]
    return text, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@settings(max_examples=300, deadline=None)
@given(split_text())
def test_parser_stream_matches_whole_answer(case):
    """However the text is cut into chunks, the stream says what the whole answer says: the same content, the
    same calls with the same arguments, each call's head first and its arguments after."""
    text, chunks = case
    whole, _ = parse(text)
    streamed, deltas = parse(text, chunks=chunks)
    content, calls = assemble(deltas)
    assert content == streamed.content == whole.content
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in streamed.calls] \
        == [(c.name, c.arguments) for c in whole.calls]
    assert [c["id"] for c in calls] == [c.id for c in streamed.calls]
    if not whole.calls:
        assert whole.content == text  # an answer without calls is the model's text, untouched


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([("add", {"a": 1, "b": 22}), ("get_weather", {"city": 'N"Y{'})]), min_size=1,
                max_size=3), st.data())
def test_parser_grammar_stream(calls, data):
    text = json.dumps([{"name": n, "arguments": a} for n, a in calls], indent=data.draw(st.sampled_from([None, 2])))
    cuts = sorted(data.draw(st.sets(st.integers(1, len(text) - 1), max_size=10)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    p, deltas = parse(text, "array", chunks)
    content, streamed = assemble(deltas)
    assert content == "" and calls_of(p) == calls
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == calls


# ====================================================================== plans, schemas and prompts, no model


def test_tool_plan_checks():
    assert plan_tools(FUNCTIONS, None).mode == "auto" and plan_tools([], None).mode == "none"
    named = plan_tools(FUNCTIONS, {"type": "function", "function": {"name": "add"}})
    assert named.mode == "named" and named.named == "add" and named.constrained
    for tools, choice, fragment in [
        ([], "required", "needs tools"), ([], {"type": "function", "function": {"name": "add"}}, "not among"),
        (FUNCTIONS, {"type": "function", "function": {"name": "nope"}}, "not among"),
        (FUNCTIONS, "sometimes", "must be"), (FUNCTIONS, {"function": {"name": "add"}}, "must be"),
        (FUNCTIONS + FUNCTIONS[:1], "auto", "more than once"),
    ]:
        with pytest.raises(APIError) as e:
            plan_tools(tools, choice)
        assert e.value.status == 400 and fragment in e.value.message
        assert e.value.param in ("tool_choice", "tools")


def test_call_schema_forces_the_shape():
    jsonschema = pytest.importorskip("jsonschema")
    required = call_schema(plan_tools(FUNCTIONS, "required"))
    one = call_schema(plan_tools(FUNCTIONS, "required", parallel=False))
    named = call_schema(plan_tools(FUNCTIONS, {"type": "function", "function": {"name": "add"}}))
    good = {"name": "add", "arguments": {"a": 1, "b": 2}}
    jsonschema.validate([good, {"name": "get_weather", "arguments": {"city": "Oslo"}}], required)
    jsonschema.validate(good, one)
    jsonschema.validate(good, named)
    for bad, schema in [([], required), ({"name": "add", "arguments": {"a": "1", "b": 2}}, one),
                        ({"name": "get_weather", "arguments": {"city": "Oslo"}}, named),
                        ({"arguments": {"a": 1, "b": 2}, "name": "add", "extra": 1}, named)]:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert list(named["properties"]) == ["name", "arguments"]  # the name is written first


def test_structural_tag_of_strict_tools_under_auto():
    """The grammar of strict tools under "auto", compiled by xgrammar for a one-character-per-token vocabulary:
    text is free until ``<tool_call>``, then only a listed function's head, arguments that fit its schema and the
    closing tag, then free text again. What it lets through is a call the parser reads."""
    import xgrammar as xgr

    from minisgl_ref.constrained import validate_grammar
    from minisgl_ref.constrained.structural_tag import to_xgrammar
    from minisgl_ref.sampling.params import SamplingParams
    from tests.test_schema_support import EOS, VOCAB

    params = SamplingParams(structural_tag=json.dumps(call_structural_tag(plan_tools(FUNCTIONS, "auto"))))
    validate_grammar(params)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS]), cache_enabled=False)
    compiled = compiler.compile_structural_tag(to_xgrammar(params.structural_tag))

    def accepts(text: str, *, ends: bool = False) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return matcher.accept_string(text) and (not ends or (matcher.accept_token(EOS) and matcher.is_terminated()))

    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert accepts("Sure, no function is needed: it is 4. <tool> and {json} are just text.", ends=True)
    assert accepts("<tool_call>\n") and accepts('<tool_call>\n{"name": "get_weather", "arguments": ')
    for head in ('<tool_call>\n{"name": "get_time"', '<tool_call>\n{"name": "ad"}', "<tool_call>hello",
                 '<tool_call>\n{"arguments": {'):
        assert not accepts(head), head  # only a listed function's head may follow the trigger
    for args in ('{"a": "1"', '{"a": 1, "b": 1000', '{"b": 2', '{"a": 1}', '{"a": 1, "b": 2, "c"'):
        assert not accepts('<tool_call>\n{"name": "add", "arguments": ' + args), args  # breaks ADD_PARAMS
    assert not accepts('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')  # the newline
    assert not accepts(call[:-3], ends=True)  # a call cut short cannot end the answer
    answer = f"Let me add them. {call} And the weather: " + call.replace(
        '"add", "arguments": {"a": 1, "b": 2}', '"get_weather", "arguments": {"city": "Oslo"}') + " Done."
    assert accepts(answer, ends=True)
    parser, _ = parse(answer)
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [
        ("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]
    assert "".join(parser.content.split()) == "Letmeaddthem.Andtheweather:Done."  # the text around the calls


def test_structural_tag_sampling_param_is_checked():
    """SGLang's ``structural_tag`` sampling parameter: a bad shape, or a schema with a keyword the grammar would
    not enforce, is a ``ValueError`` that starts with the field's name."""
    from minisgl_ref.constrained import validate_grammar
    from minisgl_ref.sampling.params import SamplingParams

    item = {"begin": "<f>", "schema": WEATHER_PARAMS, "end": "</f>"}
    good = {"type": "structural_tag", "structures": [item], "triggers": ["<f"]}
    validate_grammar(SamplingParams(structural_tag=good))
    validate_grammar(SamplingParams(structural_tag=json.dumps(good)))
    for bad in ["{", "[]", {**good, "type": "tag"}, {**good, "triggers": []}, {**good, "structures": []},
                {**good, "structures": [{"begin": "<f>", "schema": WEATHER_PARAMS}]},
                {**good, "triggers": ["<g"]}, {**good, "extra": 1}]:
        with pytest.raises(ValueError, match="^structural_tag"):
            SamplingParams(structural_tag=bad)
    with pytest.raises(ValueError, match="^only one of"):
        SamplingParams(structural_tag=good, regex="a")
    unique = {"type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(ValueError, match=r"^structural_tag: structures\[0\]\.schema: the keyword 'uniqueItems'"):
        validate_grammar(SamplingParams(structural_tag={**good, "structures": [{**item, "schema": unique}]}))


def test_history_for_a_template_without_tools():
    plan = plan_tools(FUNCTIONS, "auto")
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo and 2+3?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        {"role": "tool", "tool_call_id": "call_2", "content": "5"},
    ]
    out, tools = render_messages(history, plan, template_tools=False)
    assert tools is None
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and '"name": "add"' in out[0]["content"]
    assert out[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
                                 '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>')
    assert out[3]["content"] == "<tool_response>\nrain\n</tool_response>\n<tool_response>\n5\n</tool_response>"
    assert all(set(m) == {"role", "content"} for m in out)

    # A template that renders tools gets them as they are, with the arguments as objects.
    out, tools = render_messages(history, plan, template_tools=True)
    assert tools == [t.spec() for t in FUNCTIONS] and out[3]["role"] == "tool"
    assert out[2]["tool_calls"][1]["function"]["arguments"] == {"a": 2, "b": 3}
    # "none": the tools stay out of the prompt.
    out, tools = render_messages(history[:2], plan_tools(FUNCTIONS, "none"), template_tools=False)
    assert tools is None and "# Tools" not in out[0]["content"]
    assert "<tool_call>" in tool_prompt(plan) and "JSON array" in tool_prompt(plan_tools(FUNCTIONS, "required"))


def test_which_templates_render_tools():
    """A template that reads a ``tools`` variable renders the tools itself; the others get the tool prompt."""
    class Tokenizer:
        def __init__(self, template: Any) -> None:
            self.chat_template = template

    with_tools = "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% endfor %}"
    assert template_renders_tools(Tokenizer(with_tools))
    assert not template_renders_tools(Tokenizer(plain)) and not template_renders_tools(Tokenizer(None))
    assert template_renders_tools(Tokenizer({"default": plain, "tool_use": with_tools}))
    assert not template_renders_tools(Tokenizer("{% if %}"))  # a template that does not even parse


# ============================================================================ the server, with the real model

CHAT = [{"role": "user", "content": "Give me a city and its country."}]
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]
# One example of a call in the history is enough for the 135M model to answer the next question with a call of
# its own in the tagged format (checked: greedy, it calls get_weather for Paris).
ONE_SHOT = [
    {"role": "user", "content": "Weather in London?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "London"}'}}]},
    {"role": "user", "content": "Weather in Paris?"},
]


@pytest.fixture(scope="module")
def server():
    with running_server("--log-level", "warning") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def chat_stream(server, body: dict[str, Any]) -> tuple[str | None, list[dict[str, Any]], str]:
    """Content, tool calls and finish reason of a streamed chat answer, put together from raw SSE events."""
    r = server.post("/v1/chat/completions", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    content, calls, finish = "", {}, None
    for e in events[:-1]:
        choice = e["choices"][0]
        delta = choice["delta"]
        content += delta.get("content") or ""
        for piece in delta.get("tool_calls") or []:
            call = calls.setdefault(piece["index"], {"id": piece.get("id"), "type": piece.get("type"),
                                                     "function": {"name": piece["function"].get("name"),
                                                                  "arguments": ""}})
            call["function"]["arguments"] += piece["function"].get("arguments", "")
        finish = choice["finish_reason"] or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


def assert_error(r: httpx.Response, param: str, fragment: str = "") -> None:
    assert r.status_code == 400, r.text
    assert error_body_problem(r.content) is None, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert fragment in err["message"], err


@pytest.mark.slow
def test_parse_into_a_pydantic_model(client):
    """The openai client's ``parse`` sends the model's JSON schema as ``response_format`` and reads the answer
    back into the model: the grammar makes it valid whatever the model would have written."""
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)
        population: int = Field(ge=0, le=10**9)

    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    resp = parse(model=MODEL, messages=CHAT, response_format=City, max_tokens=60, temperature=0)
    city = resp.choices[0].message.parsed
    assert isinstance(city, City) and city.name and city.country
    assert resp.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_json_object_and_json_schema(client):
    jsonschema = pytest.importorskip("jsonschema")
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0,
                                          response_format={"type": "json_object"})
    assert resp.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(resp.choices[0].message.content), dict)  # JSON mode: an object

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                               "country": {"type": "string", "enum": ["France", "Italy", "Japan"]},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "country", "sunny"], "additionalProperties": False}
    body = dict(model=MODEL, messages=CHAT, max_tokens=60, temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema,
                                                                        "strict": True}})
    text = client.chat.completions.create(**body).choices[0].message.content
    jsonschema.validate(json.loads(text), schema)
    # Streamed, the same greedy answer, chunk by chunk.
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**body, stream=True)
                       if c.choices)
    assert streamed == text

    # SGLang's spelling on the OpenAI routes: json_schema as a string, regex, ebnf (extra body fields).
    comp = client.completions.create(model=MODEL, prompt="The year the Eiffel Tower was built:", max_tokens=8,
                                     temperature=0, extra_body={"regex": r" [12][0-9]{3}"})
    assert re.fullmatch(r" [12][0-9]{3}", comp.choices[0].text)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0,
                                          extra_body={"json_schema": json.dumps(schema)})
    jsonschema.validate(json.loads(chat.choices[0].message.content), schema)


@pytest.mark.slow
def test_generate_with_grammars(server):
    """``/generate``'s ``sampling_params``: ``json_schema`` (a string), ``regex`` and ``ebnf``, one at a time."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 100}},
              "required": ["answer"]}
    cases = [
        ({"json_schema": json.dumps(schema)}, lambda t: jsonschema.validate(json.loads(t), schema)),
        ({"regex": r"(yes|no), because [a-z ]{1,30}\."}, lambda t: re.fullmatch(r"(yes|no), because [a-z ]{1,30}\.", t)),
        ({"ebnf": 'root ::= "The answer is " digit digit? "."\ndigit ::= [0-9]'},
         lambda t: re.fullmatch(r"The answer is [0-9]{1,2}\.", t)),
    ]
    tag = {"type": "structural_tag", "triggers": ["<answer>"],
           "structures": [{"begin": "<answer>", "schema": schema, "end": "</answer>"}]}

    def tagged(text: str) -> None:  # free text, and every tagged answer fits the schema
        for m in re.finditer(r"<answer>(.*?)</answer>", text, re.S):
            jsonschema.validate(json.loads(m.group(1)), schema)
        assert "<answer>" not in re.sub(r"<answer>(.*?)</answer>", "", text, flags=re.S)

    cases.append(({"structural_tag": json.dumps(tag)}, tagged))
    for grammar, check in cases:
        r = server.post("/generate", json={"text": "Is 2 + 2 equal to 4? Answer:", "sampling_params": {
            "max_new_tokens": 48, "temperature": 0, **grammar}})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["meta_info"]["finish_reason"]["type"] in (("stop", "length") if "structural_tag" in grammar
                                                             else ("stop",)), out
        assert check(out["text"]) is not False, (grammar, out["text"])
    for bad, fragment in [("{", "not valid JSON"), (json.dumps({**tag, "triggers": []}), "triggers")]:
        r = server.post("/generate", json={"text": "hi", "sampling_params": {"structural_tag": bad}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "structural_tag", r.text
        assert fragment in r.json()["error"]["message"], r.text


@pytest.mark.slow
def test_tool_choice_required_and_named(client, server):
    """A forced call is valid by construction: a known function, arguments that follow its schema."""
    jsonschema = pytest.importorskip("jsonschema")
    schemas = {"get_weather": WEATHER_PARAMS, "add": ADD_PARAMS}
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        body = dict(model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER, ADD], tool_choice=choice,
                    max_tokens=60, temperature=0, parallel_tool_calls=False)
        resp = client.chat.completions.create(**body)
        choice0 = resp.choices[0]
        assert choice0.finish_reason == "tool_calls", choice0
        calls = choice0.message.tool_calls
        assert len(calls) == 1 and calls[0].type == "function" and re.fullmatch(r"call_\w+", calls[0].id)
        name = calls[0].function.name
        assert name in schemas and (choice == "required" or name == "get_weather")
        jsonschema.validate(json.loads(calls[0].function.arguments), schemas[name])
        # Streamed: the same call, the head (id, type, name) first and the arguments in fragments after it.
        content, streamed, finish = chat_stream(server, body)
        assert finish == "tool_calls" and not content
        assert [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in streamed] == \
            [("function", name, calls[0].function.arguments)]

    # "required" with parallel calls allowed: a non-empty array of calls, each valid.
    resp = client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER, ADD],
                                          tool_choice="required", max_tokens=80, temperature=0)
    calls = resp.choices[0].message.tool_calls
    assert calls, resp
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.slow
def test_tool_choice_auto_and_none(client, server):
    """"auto": the model's own tagged call is returned as a call; an answer without one as content. "none":
    never a call, whatever the model writes."""
    body = dict(model=MODEL, messages=ONE_SHOT, tools=[WEATHER, ADD], max_tokens=40, temperature=0)
    resp = client.chat.completions.create(**body)  # tool_choice defaults to "auto" when tools are given
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    content, streamed, finish = chat_stream(server, body)
    assert finish == "tool_calls" and content is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]

    plain = dict(model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER], tool_choice="auto", max_tokens=24,
                 temperature=0)
    resp = client.chat.completions.create(**plain)
    assert resp.choices[0].message.tool_calls is None and resp.choices[0].message.content
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert chat_stream(server, plain)[:2] == (resp.choices[0].message.content, [])

    none = client.chat.completions.create(**{**body, "tool_choice": "none"})
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason != "tool_calls"


@pytest.mark.slow
def test_history_with_tool_results(client):
    """A whole round: the assistant's call, the function's result (``role: "tool"``), and the answer after it."""
    history = WEATHER_QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": '{"temperature_c": 21, "sky": "clear"}'},
    ]
    resp = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                          max_tokens=24, temperature=0)
    assert resp.choices[0].message.content and resp.choices[0].message.tool_calls is None
    assert resp.usage.prompt_tokens > 60  # the call and its result are in the prompt


BAD = [
    # (path, body, param, fragment)
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}}},
     "response_format.json_schema.schema", "not a valid grammar"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type", ""),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "regex": "a+"}, "regex", "only one of"),
    ("/v1/chat/completions", {"json_schema": "{not json"}, "json_schema", "not valid JSON"),
    ("/v1/completions", {"regex": "(unclosed"}, "regex", "not a valid grammar"),
    ("/v1/completions", {"ebnf": "root ::= "}, "ebnf", "not a valid grammar"),
    ("/generate", {"sampling_params": {"regex": "[z-a]"}}, "regex", "not a valid grammar"),
    ("/generate", {"sampling_params": {"json_schema": "[1, 2]"}}, "json_schema", ""),
    ("/generate", {"sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "ebnf", "only one of"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "no-such-type"}}}}}]}, "tools.0.function.parameters",
     "not a valid grammar"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]}, "tools.0.function.parameters", "type 'object'"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools.0.function.name", ""),
    ("/v1/chat/completions", {"tools": [{"type": "retrieval"}]}, "tools.0.type", ""),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "add"}}},
     "tool_choice", "not among the tools"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice", "needs tools"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "must be"),
    ("/v1/chat/completions", {"tools": [WEATHER], "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0", "assistant"),
]


@pytest.mark.slow
def test_bad_grammars_and_tools_are_400s(server, client):
    """Each refusal names its field, in OpenAI's error shape, and touches nothing else: the same greedy request
    answers the same before, between and after them."""
    good = {"model": MODEL, "messages": CHAT, "max_tokens": 12, "temperature": 0,
            "response_format": {"type": "json_object"}}
    before = server.post("/v1/chat/completions", json=good)
    assert before.status_code == 200, before.text
    for path, extra, param, fragment in BAD:
        body = {"text": "hi", **extra} if path == "/generate" else (
            {"prompt": "hi", **extra} if path == "/v1/completions" else {"messages": CHAT, **extra})
        assert_error(server.post(path, json=body), param, fragment)
    between = server.post("/v1/chat/completions", json=good)
    assert between.json()["choices"][0]["message"] == before.json()["choices"][0]["message"]
    assert server.get("/health").status_code == 200


# ============================================================ JSON-schema keywords the grammar would not enforce


@pytest.mark.slow
def test_unenforced_keywords_are_400s_naming_the_keyword_and_its_place(server, client):
    """Every refused keyword of tests/test_schema_support.py (each with an output the grammar would have let
    through) is a 400 on every route a schema comes in by, naming the keyword and where it sits in the schema --
    never a 200 whose output may break the schema. The server answers the same before and after."""
    from tests.test_schema_support import REFUSED

    good = {"model": MODEL, "messages": CHAT, "max_tokens": 12, "temperature": 0,
            "response_format": {"type": "json_object"}}
    before = server.post("/v1/chat/completions", json=good)
    assert before.status_code == 200, before.text
    for schema, keyword, path, _ in REFUSED:
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        r = server.post("/v1/chat/completions", json={"messages": CHAT, "response_format": fmt})
        assert_error(r, "response_format.json_schema.schema", f"the keyword {keyword!r} at {path} is not supported")
    schema, keyword, path, _ = REFUSED[0]  # uniqueItems at #/properties/tags
    fragment = f"the keyword {keyword!r} at {path} is not supported"
    for route, body, param in [
        ("/generate", {"text": "hi", "sampling_params": {"json_schema": json.dumps(schema)}}, "json_schema"),
        ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": schema}}}, "response_format.json_schema.schema"),
        ("/v1/completions", {"prompt": "hi", "json_schema": json.dumps(schema)}, "json_schema"),
        ("/v1/chat/completions", {"messages": CHAT, "json_schema": schema}, "json_schema"),
    ]:
        assert_error(server.post(route, json=body), param, fragment)
    # A tool's parameters: refused where the call is forced (its arguments are promised to fit) ...
    tool = {"type": "function", "function": {"name": "tag", "parameters": schema}}
    for choice, parallel in [("required", True), ("required", False),
                             ({"type": "function", "function": {"name": "tag"}}, False)]:
        r = server.post("/v1/chat/completions", json={"messages": CHAT, "tools": [WEATHER, tool],
                                                      "tool_choice": choice, "parallel_tool_calls": parallel})
        assert_error(r, "tools.1.function.parameters", fragment)
    # ... and under "auto" once any tool is strict (a structural tag then holds every call to its schema) ...
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    r = server.post("/v1/chat/completions", json={"messages": CHAT, "tools": [strict, tool]})
    assert_error(r, "tools.1.function.parameters", fragment)
    # ... but not where nothing is forced: in "auto" without strict tools the schema is only text in the prompt,
    # and forcing another function leaves this one out of the grammar.
    for choice in ("auto", {"type": "function", "function": {"name": "get_weather"}}):
        r = server.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "tools": [tool, WEATHER],
                                                      "tool_choice": choice, "max_tokens": 30, "temperature": 0})
        assert r.status_code == 200, r.text
    after = server.post("/v1/chat/completions", json=good)
    assert after.json()["choices"][0]["message"] == before.json()["choices"][0]["message"]


@pytest.mark.slow
def test_tempting_requests_keep_the_enforced_keywords(client):
    """Asked for what the schema forbids, the answer still follows it: a bare number where a one-subschema
    ``allOf`` wants an object, and properties whose names are keywords (``not``, ``if``: names, not keywords)."""
    jsonschema = pytest.importorskip("jsonschema")
    for schema, question in [
        ({"allOf": [{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                     "additionalProperties": False}]}, "Reply with the bare number 12321 and nothing else."),
        ({"type": "object", "properties": {"not": {"type": "boolean"}, "if": {"type": "string", "maxLength": 5},
                                           "uniqueItems": {"type": "array", "items": {"const": "a"}, "maxItems": 3}},
          "required": ["not", "if", "uniqueItems"], "additionalProperties": False},
         'Write the JSON object {"not": "yes", "if": 3, "uniqueItems": ["b", "b"]}.'),
    ]:
        resp = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=60, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        assert resp.choices[0].finish_reason == "stop", resp
        jsonschema.validate(json.loads(resp.choices[0].message.content), schema)


@pytest.mark.slow
def test_pydantic_tools_with_defs_under_every_forced_tool_choice(client, server):
    """Tools made by ``openai.pydantic_function_tool`` from models with nested models carry ``$defs`` (two of
    them an ``Item`` of different shapes, one recursive). Forced -- "required" with and without parallel calls,
    or a named function -- each call's arguments validate against its own tool's schema, references and all."""
    jsonschema = pytest.importorskip("jsonschema")
    from tests.test_schema_support import pydantic_tools

    tools = pydantic_tools()
    validators = {t["function"]["name"]: jsonschema.Draft202012Validator(t["function"]["parameters"])
                  for t in tools}
    question = [{"role": "user", "content": "Order two apples (sku app) to Paris, and check the stock of pears."}]
    # Greedy, the 135M model repeats itself where the grammar has no end in sight (one more call in the array,
    # one more level of the tree); a repetition penalty lets it finish, whatever the grammar then holds it to.
    penalty = {"repetition_penalty": 1.3}
    names = set()
    for choice, parallel in [("required", True), ("required", False), ("PlaceOrder", False), ("CheckStock", False),
                             ("Node", False)]:
        tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
        resp = client.chat.completions.create(model=MODEL, messages=question, tools=tools, tool_choice=tool_choice,
                                              parallel_tool_calls=parallel, max_tokens=200, temperature=0,
                                              extra_body=penalty)
        answer = resp.choices[0]
        assert answer.finish_reason == "tool_calls", answer
        calls = answer.message.tool_calls
        assert calls and (parallel or len(calls) == 1)
        for call in calls:
            assert choice == "required" or call.function.name == choice
            validators[call.function.name].validate(json.loads(call.function.arguments))
            names.add(call.function.name)
    assert names == {"PlaceOrder", "CheckStock", "Node"}  # both tools that define an Item were called
    # pydantic_function_tool marks its tools strict: under "auto" (the default) a structural tag keeps every call
    # the model chooses to make to its own tool's schema, references and all, and the rest of the text free.
    calls = []
    for choice in (None, "auto"):
        resp = client.chat.completions.create(model=MODEL, messages=question, tools=tools, max_tokens=200,
                                              temperature=0, extra_body=penalty,
                                              **({"tool_choice": choice} if choice else {}))
        answer = resp.choices[0]
        assert answer.finish_reason in ("stop", "length", "tool_calls"), answer
        calls += answer.message.tool_calls or []
    for call in calls:
        validators[call.function.name].validate(json.loads(call.function.arguments))
    # The same tools without the promise are accepted under "auto" too (their schemas only text in the prompt).
    loose = [{**t, "function": {k: v for k, v in t["function"].items() if k != "strict"}} for t in tools]
    resp = client.chat.completions.create(model=MODEL, messages=question, tools=loose, max_tokens=20, temperature=0)
    assert resp.choices[0].finish_reason in ("stop", "length", "tool_calls")
