"""OpenAI's Responses API, ``POST /v1/responses`` (chapter 10; minisgl_ref/server/responses.py).

The first part needs no model: output items built from a text with tool calls, in text order, however the text is
split into chunks; the chat route's field names renamed for this API; the store's bounds; input items as chat
messages.

The second part (``slow``) drives a real ``python -m minisgl_ref serve`` on the embedded SmolLM2-135M-Instruct with
the official ``openai`` client (``client.responses.create``, ``.stream``, ``.parse``, ``.retrieve``) and raw HTTP.
Since the route is the chat route under other names, a greedy Responses answer is checked against the chat route's
answer to the same conversation: the same prompt tokens, the same text, the same calls. A stream's events are
checked against each other and against the final response object (:func:`check_events`).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import pytest

from minisgl_ref.server.protocol import APIError
from minisgl_ref.server.responses import (
    OutputItems,
    ResponseStore,
    item_messages,
    responses_name,
)
from minisgl_ref.server.tools import ToolCallParser
from tests.server_utils import error_body_problem, running_server, wait_idle

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                  "required": ["city"], "additionalProperties": False}
ADD_PARAMS = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "b": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["a", "b"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": WEATHER_PARAMS}
ADD = {"type": "function", "name": "add", "description": "Add two numbers", "parameters": ADD_PARAMS}
SCHEMAS = {"get_weather": WEATHER_PARAMS, "add": ADD_PARAMS}


# ================================================================================ without a model

MIXED = ('Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\nDone, both.')


def build(chunks: list[str], status: str = "completed") -> OutputItems:
    items = OutputItems(ToolCallParser({"get_weather", "add"}))
    for chunk in chunks:
        items.feed(chunk)
    items.finish(status)
    return items


def shape(items: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Output items without their random ids."""
    return [("message", i["status"], i["content"][0]["text"]) if i["type"] == "message" else
            ("function_call", i["status"], i["name"], i["arguments"]) for i in items]


def test_output_items_follow_the_text_in_order_however_it_is_split():
    """Text, call, call, text: four items in that order, the same for the whole text, every split in two and one
    character at a time; and the events, replayed, give the same items."""
    expected = [("message", "completed", "Let me look that up."),
                ("function_call", "completed", "get_weather", '{"city": "Paris"}'),
                ("function_call", "completed", "add", '{"a": 1, "b": 2}'),
                ("message", "completed", "Done, both.")]
    whole = build([MIXED])
    assert shape(whole.items) == expected
    assert whole.items[1]["call_id"] != whole.items[2]["call_id"]
    splits = [[MIXED[:k], MIXED[k:]] for k in range(len(MIXED) + 1)] + [list(MIXED)]
    for chunks in splits:
        items = build(chunks)
        assert shape(items.items) == expected, chunks
        assert replay(items.take()) == items.items


def test_output_items_of_a_cut_answer_and_of_an_empty_one():
    cut = build(['Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1'], status="incomplete")
    assert shape(cut.items) == [("message", "completed", "Sure."), ("function_call", "incomplete", "add", '{"a": 1')]
    assert shape(build([]).items) == [("message", "completed", "")]  # nothing said is still one (empty) message
    plain = OutputItems(None)
    for piece in ["Hello", " <tool_call> is", " just text"]:  # no tools: every character is the message's
        plain.feed(piece)
    plain.finish("completed")
    assert shape(plain.items) == [("message", "completed", "Hello <tool_call> is just text")]


def replay(events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The items that a client rebuilds from the events (type, fields) of :class:`OutputItems`, checked by
    :func:`check_events` between the lifecycle events of a stream (which :class:`OutputItems` does not make)."""
    opening = [{"type": kind, "response": {"id": "r", "status": "in_progress", "output": []}}
               for kind in ("response.created", "response.in_progress")]
    closing = {"type": "response.completed", "response": {"id": "r", "status": "completed", "output": None}}
    stream = opening + [{"type": kind, **fields} for kind, fields in events] + [closing]
    return check_events([{**e, "sequence_number": i} for i, e in enumerate(stream)])["rebuilt"]


def test_chat_field_names_read_as_responses_names():
    assert responses_name("messages") == "input" and responses_name("messages.3.content") == "input"
    assert responses_name("max_completion_tokens") == responses_name("max_tokens") == "max_output_tokens"
    assert responses_name("response_format.json_schema.schema") == "text.format.schema"
    assert responses_name("response_format") == "text.format"
    assert responses_name("tools.2.function.parameters") == "tools.2.parameters"
    assert responses_name("temperature") == "temperature" and responses_name("tool_choice") == "tool_choice"


def test_the_store_forgets_the_oldest_past_its_bounds():
    def obj(i: int) -> dict[str, Any]:
        return {"id": f"resp_{i}"}

    store = ResponseStore(max_count=3, max_chars=1000)
    for i in range(5):
        store.put(obj(i), [{"role": "user", "content": str(i)}], 10)
    with pytest.raises(APIError) as e:
        store.get("resp_1")
    assert e.value.status == 404 and e.value.param == "response_id"
    assert [store.get(f"resp_{i}")["id"] for i in (2, 3, 4)] == ["resp_2", "resp_3", "resp_4"]
    assert store.conversation("resp_4") == [{"role": "user", "content": "4"}]
    store.put(obj(5), [], 995)  # past max_chars: the older ones go, the newest always stays
    with pytest.raises(APIError):
        store.get("resp_4")
    store.put(obj(6), [], 5000)  # larger than the whole bound alone: kept, alone
    assert store.get("resp_6") and len(store._entries) == 1
    with pytest.raises(APIError) as e:
        store.conversation("resp_5")
    assert e.value.status == 400 and e.value.param == "previous_response_id"
    store.delete("resp_6")
    with pytest.raises(APIError):
        store.get("resp_6")


def test_input_items_as_chat_messages():
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Be "},
                                          {"type": "input_text", "text": "brief."}]},
        {"type": "message", "role": "user", "content": "Weather in Paris and in Rome?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking.",
                                                               "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
    ]
    calls = [{"id": c, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
             for c, city in (("c1", "Paris"), ("c2", "Rome"))]
    assert item_messages(items) == [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and in Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": calls},  # the calls join the turn before them
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]
    for bad, param in [([{"role": "tool", "content": "x"}], "input.0.role"),
                       ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input.0.call_id"),
                       ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}],
                        "input.0.content.0.type"),
                       (["just a string"], "input.0"),
                       ([{"type": "item_reference", "id": "x"}], "input.0.type")]:
        with pytest.raises(APIError) as e:
            item_messages(bad)
        assert e.value.status == 400 and e.value.param == param, (bad, e.value.message)


# ================================================================================ events, checked


def check_events(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Check a Responses stream's events against each other, and return the final response object (with the items
    rebuilt from the events under ``"rebuilt"``).

    Sequence numbers count 0, 1, 2, ...; the stream opens with response.created and response.in_progress and ends
    with response.completed or response.incomplete, all of one response id; items are written one at a time, each
    announced at the next output_index, a message as added, content_part.added, output_text.delta*,
    output_text.done, content_part.done, output_item.done and a function call as added,
    function_call_arguments.delta*, function_call_arguments.done, output_item.done; each ``.done`` repeats what
    the deltas built; and the items built from the events are the final object's output."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"], types
    assert types[-1] in ("response.completed", "response.incomplete"), types
    final = events[-1]["response"]
    assert {e["response"]["id"] for e in events if "response" in e} == {final["id"]}
    for e in events[:2]:
        assert e["response"]["status"] == "in_progress" and e["response"]["output"] == []
    assert final["status"] == types[-1].split(".")[1]

    short = {"response.output_item.added": "A", "response.content_part.added": "P",
             "response.output_text.delta": "t", "response.output_text.done": "T", "response.content_part.done": "Q",
             "response.function_call_arguments.delta": "a", "response.function_call_arguments.done": "F",
             "response.output_item.done": "D"}
    middle = events[2:-1]
    letters = "".join(short[e["type"]] for e in middle)
    assert re.fullmatch(r"(?:APt*TQD|Aa*FD)*", letters), letters

    rebuilt: list[dict[str, Any]] = []
    for e in middle:
        kind = e["type"]
        if kind == "response.output_item.added":
            assert e["output_index"] == len(rebuilt) and e["item"]["status"] == "in_progress"
            rebuilt.append(json.loads(json.dumps(e["item"])))
            continue
        item = rebuilt[-1]
        assert e["output_index"] == len(rebuilt) - 1
        if kind != "response.output_item.done":
            assert e["item_id"] == item["id"]
        if kind == "response.content_part.added":
            assert e["part"]["text"] == "" and e["content_index"] == 0
            item["content"].append(dict(e["part"]))
        elif kind == "response.output_text.delta":
            item["content"][0]["text"] += e["delta"]
        elif kind == "response.output_text.done":
            assert e["text"] == item["content"][0]["text"]
        elif kind == "response.content_part.done":
            assert e["part"] == item["content"][0]
        elif kind == "response.function_call_arguments.delta":
            item["arguments"] += e["delta"]
        elif kind == "response.function_call_arguments.done":
            assert e["arguments"] == item["arguments"]
        else:  # output_item.done: the item as built, with its final status
            item["status"] = e["item"]["status"]
            assert e["item"] == item and item["status"] in ("completed", "incomplete")
    if final["output"] is not None:  # None: replayed events, with no final object to compare
        assert rebuilt == final["output"]
    return {**final, "rebuilt": rebuilt}


def raw_events(server, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A stream's events from raw HTTP: each an ``event:`` line naming its type and a ``data:`` line."""
    r = server.post("/v1/responses", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.text.endswith("\n\n")
    events = []
    for block in r.text.split("\n\n")[:-1]:
        head, data = block.split("\n")
        assert head.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data[len("data: "):])
        assert event["type"] == head[len("event: "):]
        events.append(event)
    return events


def calls(output: list[Any]) -> list[tuple[str, str]]:
    return [(o.name, o.arguments) for o in output if o.type == "function_call"]


# ================================================================================ the server, with the real model


@pytest.fixture(scope="module")
def server():
    with running_server("--enable-metrics", "--log-level", "warning") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.slow
def test_a_plain_response_is_the_chat_answer(client):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=32, temperature=0)
    resp = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=32, temperature=0)
    assert resp.object == "response" and re.fullmatch(r"resp_\w+", resp.id) and resp.model == MODEL
    assert resp.status == "completed" and resp.incomplete_details is None and resp.error is None
    assert "Paris" in resp.output_text and resp.output_text == chat.choices[0].message.content
    [message] = resp.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert re.fullmatch(r"msg_\w+", message.id)
    assert [(p.type, p.annotations) for p in message.content] == [("output_text", [])]
    usage = resp.usage
    assert usage.input_tokens == chat.usage.prompt_tokens and usage.output_tokens == chat.usage.completion_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert usage.input_tokens_details.cached_tokens == usage.input_tokens - 1  # the chat request's prompt, cached
    # The request's settings come back (sampling ones as the engine applies them).
    assert (resp.temperature, resp.top_p, resp.max_output_tokens) == (0.0, 1.0, 32)
    assert resp.tools == [] and resp.tool_choice == "auto" and resp.parallel_tool_calls is True
    assert resp.text.format.type == "text" and resp.instructions is None and resp.store is True

    # instructions: a system message in front.
    brief = client.responses.create(model=MODEL, input=QUESTION, instructions="Answer in one word.",
                                    max_output_tokens=16, temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=16, temperature=0, messages=[
        {"role": "system", "content": "Answer in one word."}, {"role": "user", "content": QUESTION}])
    assert brief.output_text == chat.choices[0].message.content and brief.instructions == "Answer in one word."
    assert brief.usage.input_tokens == chat.usage.prompt_tokens

    # SGLang's sampling fields pass through: a seed makes a sampled answer repeatable.
    seeded = [client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=12, temperature=1.0,
                                      extra_body={"seed": 1234}).output_text for _ in range(2)]
    assert seeded[0] == seeded[1]


@pytest.mark.slow
def test_streamed_events(server, client):
    body = dict(model=MODEL, input=QUESTION, max_output_tokens=32, temperature=0)
    whole = client.responses.create(**body)
    events = [e.model_dump() for e in client.responses.create(**body, stream=True)]
    final = check_events(events)
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert len(deltas) > 3 and "".join(deltas) == whole.output_text
    assert final["status"] == "completed" and final["usage"]["output_tokens"] == whole.usage.output_tokens
    assert shape(final["output"]) == shape([o.model_dump() for o in whole.output])
    # The raw bytes: `event:` lines as OpenAI sends them, the same events.
    raw = raw_events(server, body)
    assert [e["type"] for e in raw] == [e["type"] for e in events]
    check_events(raw)
    # The SDK's own stream helper puts the same response together.
    with client.responses.stream(**body) as stream:
        for _ in stream:
            pass
        assert stream.get_final_response().output_text == whole.output_text


@pytest.mark.slow
def test_max_output_tokens_makes_it_incomplete(server, client):
    full = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=32, temperature=0)
    cut = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=3, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].status == "incomplete" and cut.usage.output_tokens == 3
    assert full.output_text.startswith(cut.output_text) and len(cut.output_text) < len(full.output_text)
    final = check_events(raw_events(server, dict(model=MODEL, input=QUESTION, max_output_tokens=3, temperature=0)))
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert shape(final["output"]) == shape([o.model_dump() for o in cut.output])


@pytest.mark.slow
def test_text_format(server, client):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                               "country": {"type": "string", "enum": ["France", "Italy", "Japan"]},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "country", "sunny"], "additionalProperties": False}
    body = dict(model=MODEL, input="Give me a city and its country.", max_output_tokens=60, temperature=0,
                text={"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}})
    resp = client.responses.create(**body)
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), schema)
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "place"
    final = check_events(raw_events(server, body))
    assert shape(final["output"]) == shape([o.model_dump() for o in resp.output])

    obj = client.responses.create(model=MODEL, input="Give me a city and its country.", max_output_tokens=40,
                                  temperature=0, text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(obj.output_text), dict)

    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)

    parsed = client.responses.parse(model=MODEL, input="Give me a city and its country.", text_format=City,
                                    max_output_tokens=60, temperature=0)
    assert isinstance(parsed.output_parsed, City) and parsed.output_parsed.name


@pytest.mark.slow
def test_forced_function_calls(server, client):
    """tool_choice "required" and a named function: function_call items whose arguments follow the schema, the
    same streamed."""
    jsonschema = pytest.importorskip("jsonschema")
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        body = dict(model=MODEL, input="What is the weather like in Paris today?", tools=[WEATHER, ADD],
                    tool_choice=choice, max_output_tokens=60, temperature=0, parallel_tool_calls=False)
        resp = client.responses.create(**body)
        assert resp.status == "completed" and resp.output_text == ""
        [call] = resp.output
        assert call.type == "function_call" and call.status == "completed"
        assert re.fullmatch(r"fc_\w+", call.id) and re.fullmatch(r"call_\w+", call.call_id)
        assert call.name in SCHEMAS and (choice == "required" or call.name == "get_weather")
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        assert [t.name for t in resp.tools] == ["get_weather", "add"]
        assert resp.tool_choice == choice if isinstance(choice, str) else resp.tool_choice.name == "get_weather"
        final = check_events(raw_events(server, body))
        assert shape(final["output"]) == shape([o.model_dump() for o in resp.output])
        assert any(e["type"] == "response.function_call_arguments.delta" for e in raw_events(server, body))

    # "auto": the model's own call (it follows the example in the history), as a function_call item.
    one_shot = [{"role": "user", "content": "Weather in London?"},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                 "arguments": '{"city": "London"}'},
                {"role": "user", "content": "Weather in Paris?"}]
    auto = client.responses.create(model=MODEL, input=one_shot, tools=[WEATHER, ADD], max_output_tokens=40,
                                   temperature=0)
    assert calls(auto.output) == [("get_weather", '{"city": "Paris"}')] and auto.output_text == ""
    # Strict tools under the default "auto": a structural tag holds every call the model writes to its schema.
    strict = client.responses.create(model=MODEL, input=one_shot, tools=[{**WEATHER, "strict": True}, ADD],
                                     max_output_tokens=40, temperature=0)
    assert strict.status == "completed" and calls(strict.output)
    for name, arguments in calls(strict.output):
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    none = client.responses.create(model=MODEL, input=one_shot, tools=[WEATHER, ADD], tool_choice="none",
                                   max_output_tokens=40, temperature=0)
    assert calls(none.output) == [] and none.output[0].type == "message"


@pytest.mark.slow
def test_function_call_output_round_trip(client):
    """The call goes back as a function_call item and its result as a function_call_output item: the prompt and
    the answer are the chat route's for the same conversation; previous_response_id gives the same prompt again."""
    question = "What is the weather like in Paris today?"
    first = client.responses.create(model=MODEL, input=question, tools=[WEATHER], tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=40, temperature=0)
    [call] = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature_c": 21}'}
    answer = client.responses.create(model=MODEL, input=[{"role": "user", "content": question}, call, result],
                                     tools=[WEATHER], max_output_tokens=30, temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=30, temperature=0, tools=[
        {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}], messages=[
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"temperature_c": 21}'}])
    assert answer.usage.input_tokens == chat.usage.prompt_tokens > first.usage.input_tokens
    assert answer.output_text == (chat.choices[0].message.content or "")
    assert calls(answer.output) == [(c.function.name, c.function.arguments)
                                    for c in chat.choices[0].message.tool_calls or []]

    # The same turn through the store: only the result is sent, after the stored call.
    follow = client.responses.create(model=MODEL, previous_response_id=first.id, input=[result], tools=[WEATHER],
                                     max_output_tokens=30, temperature=0)
    assert follow.previous_response_id == first.id
    assert follow.usage.input_tokens == answer.usage.input_tokens and follow.output_text == answer.output_text
    assert client.responses.retrieve(first.id).output[0].call_id == call.call_id


@pytest.mark.slow
def test_stored_responses(server, client):
    kept = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=20, temperature=0)
    assert client.responses.retrieve(kept.id).model_dump() == kept.model_dump()
    again = client.responses.create(model=MODEL, previous_response_id=kept.id, input="What is my name?",
                                    max_output_tokens=20, temperature=0)
    history = client.chat.completions.create(model=MODEL, max_tokens=20, temperature=0, messages=[
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": kept.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert again.usage.input_tokens == history.usage.prompt_tokens
    assert again.output_text == history.choices[0].message.content

    unkept = client.responses.create(model=MODEL, input="hi", max_output_tokens=4, temperature=0, store=False)
    assert unkept.store is False
    r = server.get(f"/v1/responses/{unkept.id}")
    assert r.status_code == 404 and error_body_problem(r.content) is None
    assert r.json()["error"]["param"] == "response_id"
    assert_400(server.post("/v1/responses", json={"input": "hi", "previous_response_id": unkept.id}),
               "previous_response_id", "no stored response")
    assert httpx.delete(f"{server.url}/v1/responses/{kept.id}").json() == {"id": kept.id, "object": "response",
                                                                          "deleted": True}
    assert server.get(f"/v1/responses/{kept.id}").status_code == 404


def assert_400(r: httpx.Response, param: str, fragment: str) -> None:
    assert r.status_code == 400, r.text
    assert error_body_problem(r.content) is None, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert fragment in err["message"], err


BAD = [
    # (body fields, param, message fragment)
    ({"background": True}, "background", "not supported"),
    ({"conversation": "conv_1"}, "conversation", "not supported"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "not supported"),
    ({"include": ["message.output_text.logprobs"]}, "include", "not supported"),
    ({"top_logprobs": 3}, "top_logprobs", "not supported"),
    ({"truncation": "auto"}, "truncation", "not supported"),
    ({"max_tool_calls": 2}, "max_tool_calls", "not supported"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "not supported"),
    ({"text": {"verbosity": "low"}}, "text.verbosity", "not supported"),
    ({"structural_tag": "{}"}, "structural_tag", "not supported"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type", "web_search tools are not supported"),
    ({"tools": [WEATHER, {"type": "file_search", "vector_store_ids": ["vs"]}]}, "tools.1.type", "file_search"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input.0.content.0.type", "input_image parts are not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]},
     "input.0.content.0.type", "input_file"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type", "'reasoning' items are not supported"),
    ({"max_tokens": 10}, "max_tokens", "max_output_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "messages", "input"),
    ({"response_format": {"type": "json_object"}}, "response_format", "text.format"),
    ({"n": 2}, "n", "one answer"),
    # the chat route's own checks, under this API's names
    ({"input": []}, "input", "at least 1"),
    ({"input": "hello " * 9000}, "input", "maximum context length"),
    ({"max_output_tokens": 10**9}, "max_output_tokens", "maximum context length"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({"temperature": 3}, "temperature", "less than or equal to 2"),
    ({"top_p": 0}, "top_p", "top_p"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "no-such-type"}}}},
     "text.format.schema", "not a valid grammar"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format", "needs a name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]}, "tools.0.parameters",
     "type 'object'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "add"}}, "tool_choice", "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{**WEATHER, "strict": True, "parameters": {"type": "object", "properties": {
        "t": {"type": "array", "uniqueItems": True}}}}]}, "tools.0.parameters", "'uniqueItems'"),
    ({"tools": [WEATHER], "text": {"format": {"type": "json_object"}}}, "tool_choice", "cannot be combined"),
    ({"previous_response_id": "resp_never"}, "previous_response_id", "no stored response"),
]


@pytest.mark.slow
@pytest.mark.parametrize("extra, param, fragment", BAD, ids=[b[1] for b in BAD])
def test_refusals_name_the_field(server, extra, param, fragment):
    assert_400(server.post("/v1/responses", json={"model": MODEL, "input": "hi", **extra}), param, fragment)


@pytest.mark.slow
def test_unknown_and_harmless_fields_are_ignored(server):
    """As on the chat route: fields that do not change the answer pass (metadata is echoed)."""
    r = server.post("/v1/responses", json={
        "model": MODEL, "input": "hi", "max_output_tokens": 4, "temperature": 0, "metadata": {"k": "v"},
        "service_tier": "auto", "safety_identifier": "u1", "prompt_cache_key": "p", "reasoning": None,
        "include": [], "truncation": "disabled", "background": False, "stream_options": None})
    assert r.status_code == 200, r.text
    assert r.json()["metadata"] == {"k": "v"} and r.json()["status"] in ("completed", "incomplete")


def metrics(server) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: s.value for family in text_string_to_metric_families(server.get("/metrics").text)
            for s in family.samples if not s.name.endswith("_bucket")}


@pytest.mark.slow
def test_leaving_a_stream_aborts_the_request(server):
    """Clients that close a stream after a few deltas: each request is aborted in the scheduler (counted as
    aborted) and the KV pool is whole again, long before 4000 tokens each could have been generated."""
    before = wait_idle(server)
    aborted_before = metrics(server)["sglang:num_aborted_requests_total"]
    n = 8

    async def leave_early(http: httpx.AsyncClient, i: int) -> int:
        body = {"model": MODEL, "input": f"Tell me a very long story about the number {i}.", "stream": True,
                "max_output_tokens": 4000, "temperature": 0.8, "ignore_eos": True}
        deltas = 0
        async with http.stream("POST", "/v1/responses", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                deltas += line == "event: response.output_text.delta"
                if deltas >= 2 + i % 3:
                    break  # leave mid-stream: closing the response closes the connection
        return deltas

    async def main() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
            return await asyncio.gather(*[leave_early(http, i) for i in range(n)])

    assert all(d >= 2 for d in asyncio.run(main()))
    after = wait_idle(server, timeout=120)
    assert after["available_kv_tokens"] == before["available_kv_tokens"] == after["max_total_num_tokens"]
    assert metrics(server)["sglang:num_aborted_requests_total"] - aborted_before == n
