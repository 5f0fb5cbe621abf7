"""Options of the OpenAI routes that must not be accepted and then ignored (chapter 10).

``stream_options.continuous_usage_stats`` puts the usage so far on every chunk; ``strict`` function schemas are
honoured by a grammar under every tool_choice (a structural tag under "auto"); a chat message's extra fields go
to the chat template, except those no template here can render, which are refused by name.
"""

from __future__ import annotations

import json

import pytest

from minisgl_ref.server.protocol import APIError, ChatMessage
from tests.server_utils import parse_sse, running_server

MODEL = "default"
CHAT = [{"role": "user", "content": "Name three colours."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}, "strict": True}}


@pytest.fixture(scope="module")
def server():
    with running_server() as srv:
        yield srv


def stream(server, path: str, **body) -> list:
    r = server.post(path, json={"model": MODEL, "stream": True, **body})
    assert r.status_code == 200, r.text
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    return events[:-1]


def error(server, path: str, body: dict) -> dict:
    r = server.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    return r.json()["error"]


# --------------------------------------------------------------------------------------- continuous usage


@pytest.mark.slow
@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", dict(messages=CHAT)),
    ("/v1/completions", dict(prompt="Once upon a time")),
], ids=["chat", "completions"])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(server, path, body):
    body = dict(body, max_tokens=12, temperature=0, ignore_eos=True, n=2)
    events = stream(server, path, **body, stream_options={"include_usage": True, "continuous_usage_stats": True})
    *chunks, final = events
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 24
    prompt = final["usage"]["prompt_tokens"]
    seen = {0: 0, 1: 0}
    per_choice = {0: 0, 1: 0}
    for c in chunks:
        (choice,) = c["choices"]
        usage = c["usage"]
        i = choice["index"]
        assert usage["prompt_tokens"] == prompt
        assert usage["total_tokens"] == prompt + usage["completion_tokens"]
        # The choice's own tokens so far: never fewer than before, and more after every chunk with text.
        assert seen[i] <= usage["completion_tokens"] <= 12
        text = choice.get("text") if "text" in choice else choice["delta"].get("content")
        if text:
            assert usage["completion_tokens"] > seen[i]
        seen[i] = usage["completion_tokens"]
        per_choice[i] += 1
    assert seen == {0: 12, 1: 12}
    # Several chunks per choice, each with the usage so far. Not necessarily one per token: a stream whose reader
    # falls behind (a busy machine) gets the tokens of several steps in one chunk, with their count.
    assert min(per_choice.values()) >= 2, per_choice

    # Without include_usage: usage on every chunk still, and no final usage-only chunk.
    events = stream(server, path, **body, stream_options={"continuous_usage_stats": True})
    assert all(e["choices"] and "usage" in e for e in events)
    # Without either: no usage anywhere, as before.
    assert all("usage" not in e for e in stream(server, path, **body))
    assert all("usage" not in e for e in stream(server, path, **body, stream_options={"include_usage": False}))


@pytest.mark.slow
def test_stream_options_and_user_are_no_ops_without_a_stream(server):
    """A non-streamed answer always carries its usage, which is all ``stream_options`` asks for; ``user`` is
    for a provider's abuse monitoring. Both are accepted and change nothing."""
    base = dict(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)
    plain = server.post("/v1/chat/completions", json=base).json()
    extra = server.post("/v1/chat/completions", json={**base, "user": "someone", "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}}).json()
    assert extra["choices"] == plain["choices"] and extra["usage"] == plain["usage"]


# ------------------------------------------------------------------------------------- strict function schemas


@pytest.mark.slow
def test_strict_tools_are_honoured_under_every_tool_choice(server):
    # Under "auto" (the default, and explicit) a structural tag keeps every call the model writes to its schema.
    weather = [{"role": "user", "content": "What is the weather in Paris? Call the function."}]
    get_time = {**WEATHER, "function": {**WEATHER["function"], "name": "get_time", "strict": False}}
    for tools, choice in [([WEATHER], None), ([get_time, WEATHER], "auto")]:
        body = dict(model=MODEL, messages=weather, tools=tools, max_tokens=60, temperature=0,
                    repetition_penalty=1.3, **({"tool_choice": choice} if choice else {}))
        r = server.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        for c in r.json()["choices"][0]["message"].get("tool_calls") or []:
            assert c["function"]["name"] in {"get_weather", "get_time"}
            args = json.loads(c["function"]["arguments"])
            assert list(args) == ["city"] and isinstance(args["city"], str)
    # What cannot hold together is still refused: a response_format besides tools that may be called.
    err = error(server, "/v1/chat/completions", dict(messages=CHAT, tools=[WEATHER], max_tokens=8,
                                                     response_format={"type": "json_object"}))
    assert err["param"] == "tool_choice"
    # Enforced by a grammar: a required or named call follows the schema, so strict is honoured.
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = server.post("/v1/chat/completions", json=dict(model=MODEL, messages=[
            {"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER], tool_choice=choice,
            max_tokens=40, temperature=0))
        assert r.status_code == 200, r.text
        calls = r.json()["choices"][0]["message"]["tool_calls"]
        assert calls and all(c["function"]["name"] == "get_weather" for c in calls)
        for c in calls:  # the schema, exactly: one string property, nothing else
            args = json.loads(c["function"]["arguments"])
            assert list(args) == ["city"] and isinstance(args["city"], str)
    # With tool_choice "none" the tools are not used at all, strict or not.
    r = server.post("/v1/chat/completions", json=dict(model=MODEL, messages=CHAT, tools=[WEATHER],
                                                      tool_choice="none", max_tokens=4))
    assert r.status_code == 200, r.text
    # A strict response_format schema is what a grammar always gives: accepted.
    r = server.post("/v1/chat/completions", json=dict(model=MODEL, messages=CHAT, max_tokens=30, temperature=0,
                                                      response_format={"type": "json_schema", "json_schema": {
                                                          "name": "c", "strict": True, "description": "colours",
                                                          "schema": {"type": "object"}}}))
    assert r.status_code == 200, r.text


# ----------------------------------------------------------------------------------- chat messages' extra fields


def test_message_extras_go_to_the_chat_template():
    from minisgl_ref.server.http_server import _message

    m = ChatMessage.model_validate({"role": "assistant", "content": "Hi", "reasoning_content": "greet back",
                                    "refusal": None, "audio": None, "function_call": None})
    assert _message(m, 0) == {"role": "assistant", "content": "Hi", "reasoning_content": "greet back"}
    # Declared fields win over nothing: an extra cannot smuggle in another role or content.
    assert _message(ChatMessage.model_validate({"role": "user", "content": "x"}), 1) == {"role": "user",
                                                                                        "content": "x"}


@pytest.mark.parametrize("field, value", [
    ("function_call", {"name": "f", "arguments": "{}"}),
    ("audio", {"id": "audio_1"}),
    ("_tool_results", True),
])
def test_message_fields_no_template_renders_are_refused_by_name(field, value):
    m = ChatMessage.model_validate({"role": "assistant", "content": "Hi", field: value})
    with pytest.raises(APIError) as e:
        m.template_fields(3)
    assert e.value.status == 400 and e.value.param == f"messages.3.{field}" and field in e.value.message


@pytest.mark.slow
def test_message_extras_through_the_server(server):
    err = error(server, "/v1/chat/completions", dict(messages=[
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": None,
                                            "function_call": {"name": "f", "arguments": "{}"}},
        {"role": "user", "content": "Again"}], max_tokens=4))
    assert err["param"] == "messages.1.function_call"
    # What the openai client sends back for an earlier answer (its null fields) is accepted.
    r = server.post("/v1/chat/completions", json=dict(model=MODEL, max_tokens=4, messages=[
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "refusal": None, "audio": None, "function_call": None,
         "tool_calls": None, "annotations": None},
        {"role": "user", "content": "Again"}]))
    assert r.status_code == 200, r.text
