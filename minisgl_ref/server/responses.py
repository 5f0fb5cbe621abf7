"""OpenAI's Responses API, ``POST /v1/responses``, built on the chat route (chapter 10).

The Responses API is OpenAI's newer spelling of a chat turn: the conversation is ``input`` (a string, or a list of
*items*: messages, the model's earlier function calls, the results of those calls) with the system prompt apart as
``instructions``; the answer is ``output``, a list of items too (a ``message`` holding ``output_text`` parts, and a
``function_call`` item per call); and a stream is a sequence of named events rather than one kind of chunk. Under
the new names it asks exactly what a chat request asks, so this module *translates* and leaves the work to the chat
route's own code (:func:`~minisgl_ref.server.http_server.chat_request`):

* ``instructions`` is a system message in front of the conversation;
* ``input`` items are messages (a string, or ``input_text`` / ``output_text`` parts), and a ``function_call`` item
  is one of the assistant's ``tool_calls``, a ``function_call_output`` item a ``tool`` message with its result;
* ``max_output_tokens`` is ``max_completion_tokens``;
* ``text.format`` (``text``, ``json_object``, or ``json_schema`` with ``name`` and ``schema``) is
  ``response_format``: the same grammar (chapter 12);
* a tool ``{"type": "function", "name": ..., "parameters": ...}`` is chat's ``{"type": "function", "function":
  {"name": ..., "parameters": ...}}``, and ``tool_choice: {"type": "function", "name": ...}`` likewise.

So the prompt, the chat template, the tools' prompt and grammar, the sampling parameters and every check are the
chat route's, and an error it raises is renamed to the field the client sent (``messages`` -> ``input``,
``response_format.json_schema.schema`` -> ``text.format.schema``, ...). SGLang's extra sampling fields (``seed``,
``top_k``, ``stop``, ``ignore_eos``, ...) pass through unchanged. What the engine cannot honour is refused by name
(``background``, ``reasoning``, ``include``, ``top_logprobs``, ``truncation: "auto"``, ``conversation``, tools
other than functions, image, file and audio inputs), as are the chat fields that have a Responses name
(``max_tokens``, ``response_format``, ...); other unknown fields are ignored, as on every route. A function's
``strict`` means what it means on chat: a call that ``tool_choice`` forces (``"required"`` or a named function)
follows the parameters' schema by grammar, and under ``"auto"`` a strict tool puts the answer under a structural
tag, so that a call the model chooses to write follows its schema too.

**Output items.** The answer's text goes through the chat's :class:`~minisgl_ref.server.tools.ToolCallParser`
when tools are active, and :class:`OutputItems` turns what the parser makes certain, in text order, into items:
text opens (or continues) a ``message``, a call's head opens a ``function_call`` whose ``call_id`` is the parser's
call id, and its arguments follow. A stream sends the same items as events (``response.output_item.added``,
``response.output_text.delta``, ``response.function_call_arguments.delta``, ``...done``) between
``response.created`` / ``response.in_progress`` and ``response.completed`` (or ``response.incomplete``, when
``max_output_tokens`` cut the answer), each event with its ``type`` and a ``sequence_number`` counting from 0. The
answer without streaming is the same code fed the whole text, so the two agree however the text was chunked.

**Stored responses.** As on OpenAI, a response is stored unless the request says ``store: false``: ``GET`` and
``DELETE /v1/responses/{id}`` read and remove it, and ``previous_response_id`` continues its conversation (its
input and output, without its instructions or tools, which a request gives again). The store is in memory and
bounded (:class:`ResponseStore`): past its size the oldest responses are forgotten, and a restart forgets them
all; behind ``--dp-size``'s router each worker has its own.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, model_validator

from minisgl_ref.server.http_server import (
    SSE_HEADERS,
    ServerState,
    Sub,
    _collect,
    _final,
    _tool_parser,
    _usage,
    chat_request,
    validated,
)
from minisgl_ref.server.protocol import (
    NAME_PATTERN,
    UNSET,
    APIError,
    ChatCompletionRequest,
    _Strict,
    validate,
)
from minisgl_ref.server.tokenizer_manager import Chunk, RequestOptions, TokenizerManager
from minisgl_ref.server.tools import Delta, ToolCallParser, ToolPlan

router = APIRouter()

# ------------------------------------------------------------------------------------------------ the request


class TextFormat(_Strict):
    """``text.format``: free text, any JSON object, or JSON that follows a named schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # "follow the schema exactly": a grammar always does

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError('type "json_schema" needs a name and a schema: {"type": "json_schema", "name": ..., '
                             '"schema": {...}}')
        return self


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class FunctionTool(_Strict):
    """One function the model may call, in the Responses shape (no ``function`` wrapper)."""

    type: Literal["function"]
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Strict):
    """``tool_choice`` naming the one function to call."""

    type: Literal["function"]
    name: str


class ResponsesRequest(_Strict):
    """The body of ``POST /v1/responses``: the fields this server reads, the ones it refuses by name, and (as on
    every route) unknown ones ignored. SGLang's sampling extensions are read from the body by :func:`prepare`."""

    unsupported = {
        "background": (None, False),  # answered later, polled by id: every answer here is given at once
        "conversation": UNSET,  # OpenAI's stored Conversations (previous_response_id is served)
        "include": (None, []),  # extra output data: logprobs, encrypted reasoning, tool results, ...
        "reasoning": (None, {}),  # a reasoning model's effort and summaries
        "top_logprobs": (None, 0),
        "prompt": UNSET,  # a reusable prompt stored at OpenAI
        "truncation": (None, "disabled"),  # "auto" would drop the middle of a conversation that does not fit
        "max_tool_calls": UNSET,
        "context_management": (None, []),
        "moderation": UNSET,
    }
    model: str | None = None
    input: str | list[Any] = Field(union_mode="left_to_right")  # items: checked by item_messages
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = None
    stream: bool = False
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = Field(None, union_mode="left_to_right")
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True  # OpenAI's default
    metadata: dict[str, str] | None = None
    user: str | None = None


#: Chat fields a client may send here by habit. Each would change the answer, so it is refused with its
#: Responses spelling rather than ignored.
_GRAMMARS_ELSEWHERE = "on this server regex and ebnf are served by /v1/chat/completions and /v1/completions"
CHAT_SPELLINGS: dict[str, tuple[tuple[Any, ...], str]] = {  # field: (its "not used" values, what to do instead)
    "messages": (UNSET, "give the conversation as input (and a system prompt as instructions)"),
    "max_tokens": (UNSET, "use max_output_tokens"), "max_completion_tokens": (UNSET, "use max_output_tokens"),
    "response_format": (UNSET, "use text.format"), "json_schema": (UNSET, "use text.format"),
    "regex": (UNSET, _GRAMMARS_ELSEWHERE), "ebnf": (UNSET, _GRAMMARS_ELSEWHERE),
    "n": ((None, 1), "a response is one answer: send n requests"),
    "logprobs": ((None, False), "log probabilities are not served on this route"),
}
#: SGLang's sampling extensions, and the chat's own refusals, passed to the chat request under the same names.
PASSED_TO_CHAT = ("seed", "stop", "presence_penalty", "frequency_penalty", "logit_bias", "top_k", "min_p",
                  "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "stop_regex",
                  "skip_special_tokens", "cache_salt", "chat_template_kwargs", *ChatCompletionRequest.unsupported)
#: Content parts read as text. ``refusal`` is an assistant's earlier refusal, sent back as part of the history.
TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}


def refuse_foreign_fields(body: dict[str, Any]) -> None:
    """400 for chat's spellings, for tools that are not functions and for a ``tool_choice`` naming one.

    Checked before the schema so that the message says what is wrong ("web_search tools are not supported"),
    not only that a value failed to match a type."""
    for name, (unused, hint) in CHAT_SPELLINGS.items():
        if body.get(name) not in unused:
            raise APIError(400, f"{name} is not a field of the Responses API: {hint}", param=name)
    tools = body.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise APIError(400, f"tools.{i}.type: {kind} tools are not supported by this server (only function "
                                "tools are)", param=f"tools.{i}.type")
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and isinstance(choice.get("type"), str) and choice["type"] != "function":
        raise APIError(400, f"tool_choice.type: {choice['type']!r} is not supported by this server (give 'none', "
                            "'auto', 'required' or {\"type\": \"function\", \"name\": ...})", param="tool_choice")


# ------------------------------------------------------------------------------------------ input items


def item_messages(items: list[Any], where: str = "input") -> list[dict[str, Any]]:
    """Input (or output) items as chat messages, which the chat route validates and renders.

    Consecutive ``function_call`` items join the assistant message before them, as the ``tool_calls`` of one
    turn; each ``function_call_output`` is a ``tool`` message for its ``call_id``."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        at = f"{where}.{i}"
        if not isinstance(item, dict):
            raise APIError(400, f"{at}: an item is an object such as {{\"role\": \"user\", \"content\": ...}} "
                                f"(got {json.dumps(item)[:80]})", param=at)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{at}.role must be 'user', 'system', 'developer' or 'assistant' (got "
                                    f"{json.dumps(role)})", param=f"{at}.role")
            out.append({"role": role, "content": _content_text(item.get("content"), f"{at}.content")})
        elif kind == "function_call":
            function = {"name": _text_field(item, "name", at), "arguments": _text_field(item, "arguments", at)}
            call = {"id": _text_field(item, "call_id", at), "type": "function", "function": function}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _text_field(item, "call_id", at),
                        "content": _content_text(item.get("output"), f"{at}.output")})
        else:
            raise APIError(400, f"{at}.type: {kind!r} items are not supported by this server (message, "
                                "function_call and function_call_output are)", param=f"{at}.type")
    return out


def _text_field(item: dict[str, Any], key: str, at: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{at}.{key}: a {item.get('type')} item needs {key} as a string (got "
                            f"{json.dumps(value)[:80]})", param=f"{at}.{key}")
    return value


def _content_text(content: Any, at: str) -> str:
    """A message's content (or a function's output): a string, or a list of text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{at} must be a string or a list of content parts (got {json.dumps(content)[:80]})",
                       param=at)
    pieces = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = TEXT_PARTS.get(kind)  # type: ignore[arg-type]
        if key is None:
            raise APIError(400, f"{at}.{j}: {kind} parts are not supported by this server (only text: "
                                "input_text, output_text)", param=f"{at}.{j}.type")
        if not isinstance(part.get(key), str):
            raise APIError(400, f"{at}.{j}.{key} must be a string", param=f"{at}.{j}.{key}")
        pieces.append(part[key])
    return "".join(pieces)


# -------------------------------------------------------------------------- the request, as a chat request


@dataclass
class Prepared:
    """A validated and tokenized Responses request."""

    req: ResponsesRequest
    ids: list[int]
    subs: list[Sub]
    plan: ToolPlan
    cache_salt: str | None
    conversation: list[dict[str, Any]]  # the history and this input, as chat messages, without instructions
    settings: dict[str, Any]  # the request's settings, echoed in the response object
    size: int  # characters the stored response would hold, roughly (see ResponseStore)


def prepare(s: ServerState, body: dict[str, Any], store: ResponseStore) -> Prepared:
    """Validate ``body``, then build the chat request it means and let the chat route check and tokenize it."""
    refuse_foreign_fields(body)
    req = validate(ResponsesRequest, body)
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise APIError(400, "text.verbosity is not supported by this server (the answer's length is the model's, "
                            "up to max_output_tokens)", param="text.verbosity")
    history = store.conversation(req.previous_response_id) if req.previous_response_id else []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else item_messages(req.input)
    fmt = req.text.format if req.text is not None and req.text.format is not None else TextFormat(type="text")
    tool_choice = req.tool_choice if req.tool_choice is not None else "auto"
    if fmt.type != "text" and req.tools and tool_choice != "none":
        raise APIError(400, f"text.format {fmt.type} cannot be combined with tools unless tool_choice is 'none' "
                            "(the answer could not both follow the format and call a tool)", param="tool_choice")
    chat: dict[str, Any] = {
        "messages": ([{"role": "system", "content": req.instructions}] if req.instructions is not None else [])
        + history + items,
        "parallel_tool_calls": req.parallel_tool_calls,
        **{k: body[k] for k in PASSED_TO_CHAT if k in body},
    }
    for theirs, ours in (("model", "model"), ("max_output_tokens", "max_completion_tokens"),
                         ("temperature", "temperature"), ("top_p", "top_p"), ("user", "user")):
        if getattr(req, theirs) is not None:
            chat[ours] = getattr(req, theirs)
    if fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt.type == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_}}
    if req.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    if isinstance(req.tool_choice, FunctionChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        chat["tool_choice"] = req.tool_choice
    with responses_names():
        chat_req, ids, subs, plan = chat_request(s, chat)
    params = subs[0][1]
    settings = {
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "max_tool_calls": None,
        "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None}, "store": req.store, "temperature": params.temperature,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True), "verbosity": "medium"},
        "tool_choice": req.tool_choice.model_dump() if isinstance(req.tool_choice, FunctionChoice) else tool_choice,
        "tools": [t.model_dump() for t in req.tools or []], "top_logprobs": 0, "top_p": params.top_p,
        "truncation": "disabled", "user": req.user, "metadata": req.metadata or {},
    }
    size = len(json.dumps(settings)) + sum(_message_size(m) for m in history + items)
    return Prepared(req, ids, subs, plan, chat_req.cache_salt, history + items, settings, size)


#: How the chat route's field names read in this API (checked in order; the first that matches renames).
_RENAMES = [
    (re.compile(r"messages(\.|$).*"), "input"),
    (re.compile(r"(max_completion_tokens|max_tokens)$"), "max_output_tokens"),
    (re.compile(r"response_format\.json_schema\.schema"), "text.format.schema"),
    (re.compile(r"response_format(\.json_schema)?"), "text.format"),
    (re.compile(r"tools\.(\d+)\.function\."), r"tools.\1."),
]


def responses_name(param: str) -> str:
    for pattern, name in _RENAMES:
        m = pattern.match(param)
        if m is not None:
            return m.expand(name) + param[m.end():]
    return param


@contextmanager
def responses_names() -> Iterator[None]:
    """Errors of the chat route, with their ``param`` (and the message that starts with it) renamed."""
    try:
        yield
    except APIError as e:
        if e.param is not None:
            new = responses_name(e.param)
            message = new + e.message[len(e.param):] if e.message.startswith(e.param) else e.message
            raise APIError(e.status, message, e.type, param=new, code=e.code) from e
        raise


def _message_size(m: dict[str, Any]) -> int:
    calls = m.get("tool_calls") or []
    return len(m.get("content") or "") + sum(len(c["function"]["arguments"]) + 64 for c in calls) + 64


# --------------------------------------------------------------------------------------------- output items


@dataclass
class OutputItems:
    """The answer's output items, built from its text in order, and (with ``events``) the stream events that
    announce them: ``(type, fields)`` pairs, taken with :meth:`take`."""

    parser: ToolCallParser | None  # None: no tools, all text is the message's
    events: bool = True
    items: list[dict[str, Any]] = field(default_factory=list)
    _open: dict[str, Any] | None = None  # the item being written (the last of ``items``)
    _pending: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def feed(self, text: str) -> None:
        if self.parser is None:
            self._text(text)
        else:
            self._delta(self.parser.feed(text))

    def finish(self, status: str) -> None:
        """The text has ended: close the last item with ``status`` ("completed", or "incomplete" when the
        answer was cut short). An answer with no item at all is an empty message."""
        if self.parser is not None:
            self._delta(self.parser.finish())
        if not self.items:
            self._open_message()
        self._close(status)

    def take(self) -> list[tuple[str, dict[str, Any]]]:
        out, self._pending = self._pending, []
        return out

    def text(self) -> str:
        return "".join(part["text"] for item in self.items if item["type"] == "message" for part in item["content"])

    # ---------------------------------------------------------------------------------- machinery

    def _emit(self, kind: str, **fields: Any) -> None:
        if self.events:
            self._pending.append((kind, fields))

    def _delta(self, delta: Delta) -> None:
        for piece in delta.pieces:
            if isinstance(piece, str):
                self._text(piece)
            elif "id" in piece:  # a call's head: its id (the call_id) and name
                self._close("completed")
                self._open_item({"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                                 "call_id": piece["id"], "name": piece["function"]["name"], "arguments": ""})
            else:  # more of the open call's arguments
                item, args = self.items[-1], piece["function"]["arguments"]
                item["arguments"] += args
                self._emit("response.function_call_arguments.delta", item_id=item["id"],
                           output_index=len(self.items) - 1, delta=args)

    def _text(self, text: str) -> None:
        if not text:
            return
        if self._open is None or self._open["type"] != "message":
            self._close("completed")
            self._open_message()
        item = self.items[-1]
        item["content"][0]["text"] += text
        self._emit("response.output_text.delta", item_id=item["id"], output_index=len(self.items) - 1,
                   content_index=0, delta=text, logprobs=[])

    def _open_item(self, item: dict[str, Any]) -> None:
        self.items.append(item)
        self._open = item
        self._emit("response.output_item.added", output_index=len(self.items) - 1, item=copy.deepcopy(item))

    def _open_message(self) -> None:
        item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress", "role": "assistant",
                "content": []}
        self._open_item(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"].append(part)
        self._emit("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                   content_index=0, part=dict(part))

    def _close(self, status: str) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        item["status"] = status
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if item["type"] == "message":
            part = item["content"][0]
            self._emit("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            self._emit("response.content_part.done", **where, content_index=0, part=copy.deepcopy(part))
        else:
            self._emit("response.function_call_arguments.done", **where, name=item["name"],
                       arguments=item["arguments"])
        self._emit("response.output_item.done", output_index=where["output_index"], item=copy.deepcopy(item))


def _parser(plan: ToolPlan) -> ToolCallParser | None:
    return _tool_parser(plan) if plan.active else None


# ------------------------------------------------------------------------------------ the response object


@dataclass
class ResponseShell:
    """What every version of one response object shares: the id, the time, the model and the echoed settings."""

    id: str
    created_at: int
    model: str
    settings: dict[str, Any]

    def object(self, status: str, output: list[dict[str, Any]] | None = None, usage: dict[str, Any] | None = None,
               incomplete: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        obj = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
               "background": False, "error": error,
               "incomplete_details": {"reason": incomplete} if incomplete else None, "model": self.model,
               "output": output or [], **self.settings, "usage": usage}
        if status in ("completed", "incomplete"):
            obj["completed_at"] = int(time.time())
        return obj

    def finished(self, items: OutputItems, last: Chunk | dict[str, Any], prompt_tokens: int) -> dict[str, Any]:
        """The final object: its status from why the answer ended (``last``: the final chunk, or ``_final``'s
        summary of it), its output items and its usage."""
        if isinstance(last, Chunk):
            reason = (last.finish_reason or {}).get("type")
            counts = {"completion_tokens": last.completion_tokens, "cached_tokens": last.cached_tokens}
        else:
            reason, counts = last["finish_reason"], last
        usage = _usage([counts], [prompt_tokens])
        cut = reason == "length"
        return self.object("incomplete" if cut else "completed", items.items, incomplete="max_output_tokens" if cut
                           else None, usage={
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]})


# ------------------------------------------------------------------------------------------------ the store


class ResponseStore:
    """Past responses, for ``GET /v1/responses/{id}`` and ``previous_response_id``: the response object and the
    conversation it ended (its history, its input and its output, as chat messages).

    Bounded by count and by size, oldest forgotten first. A response's size is the characters of its settings and
    its whole conversation: a conversation shares its history's messages with the response before it, so the sum
    counts them more than once, and the bound errs on the safe side. (Handlers write on the event loop and read in
    worker threads: hence the lock.)"""

    def __init__(self, max_count: int = 1024, max_chars: int = 64 * 2**20) -> None:
        self.max_count, self.max_chars = max_count, max_chars
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]], int]] = OrderedDict()
        self._chars = 0

    def put(self, obj: dict[str, Any], conversation: list[dict[str, Any]], size: int) -> None:
        with self._lock:
            self._entries[obj["id"]] = (obj, conversation, size)
            self._chars += size
            while len(self._entries) > 1 and (len(self._entries) > self.max_count or self._chars > self.max_chars):
                self._chars -= self._entries.popitem(last=False)[1][2]

    def get(self, response_id: str) -> dict[str, Any]:
        with self._lock:
            entry = self._entries.get(response_id)
        if entry is None:
            raise APIError(404, f"no stored response has the id {response_id!r} (responses are kept in this "
                                "server's memory, the oldest forgotten first)", "not_found_error",
                           param="response_id", code="not_found")
        return entry[0]

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        with self._lock:
            entry = self._entries.get(response_id)
        if entry is None:
            raise APIError(400, f"previous_response_id: no stored response has the id {response_id!r} (responses are "
                                "kept in this server's memory unless stored with store: false, the oldest forgotten "
                                "first)", param="previous_response_id", code="previous_response_not_found")
        return list(entry[1])

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        with self._lock:
            entry = self._entries.pop(response_id, None)
            if entry is not None:
                self._chars -= entry[2]


def response_store(app: FastAPI) -> ResponseStore:
    store = getattr(app.state, "response_store", None)
    if store is None:
        store = app.state.response_store = ResponseStore()
    return store


def _remember(store: ResponseStore, p: Prepared, obj: dict[str, Any]) -> None:
    """Store a finished response (unless it asked not to be), with the conversation that a follow-up continues."""
    if p.req.store:
        output = item_messages(obj["output"], where="output")
        store.put(obj, p.conversation + output, p.size + sum(_message_size(m) for m in output))


# ----------------------------------------------------------------------------------------------- the routes


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    store = response_store(request.app)
    s, p = await validated(request, lambda s, body: prepare(s, body, store))
    manager = s.manager
    manager.check_alive()
    shell = ResponseShell(f"resp_{uuid.uuid4().hex}", int(time.time()), s.model_name, p.settings)
    options = RequestOptions(cache_salt=p.cache_salt)
    if p.req.stream:
        return StreamingResponse(_stream(manager, p, shell, store, options), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    out = (await _collect(manager, p.subs, request, options))[0]
    final = _final(out)
    items = OutputItems(_parser(p.plan), events=False)
    items.feed(final["text"])
    items.finish("incomplete" if final["finish_reason"] == "length" else "completed")
    obj = shell.finished(items, final, len(p.ids))
    _remember(store, p, obj)
    return JSONResponse(obj)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> Response:
    return JSONResponse(response_store(request.app).get(response_id))


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Response:
    response_store(request.app).delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def sse_event(kind: str, seq: int, fields: dict[str, Any]) -> str:
    """One Responses stream event: an ``event:`` line naming it and the ``data:`` line, as OpenAI sends them."""
    data = json.dumps({"type": kind, **fields, "sequence_number": seq}, ensure_ascii=False)
    return f"event: {kind}\ndata: {data}\n\n"


async def _stream(manager: TokenizerManager, p: Prepared, shell: ResponseShell, store: ResponseStore,
                  options: RequestOptions) -> AsyncIterator[str]:
    """The events of one response. A client that leaves cancels this generator inside ``manager.generate``,
    whose ``finally`` aborts the request in the scheduler (as the chat stream's does)."""
    seq = itertools.count()
    yield sse_event("response.created", next(seq), {"response": shell.object("in_progress")})
    yield sse_event("response.in_progress", next(seq), {"response": shell.object("in_progress")})
    items = OutputItems(_parser(p.plan))
    last: Chunk | None = None
    async for _, c in manager.generate(p.subs, options=options):
        if c.finished:
            last = c
            reason = c.finish_reason or {"type": "abort"}
            if reason["type"] == "abort":
                error = {"code": "server_error", "message": f"the request was aborted: {reason.get('message')}"}
                yield sse_event("response.failed", next(seq), {"response": shell.object(
                    "failed", items.items, error=error)})
                return
        items.feed(c.text)
        if c.finished:
            items.finish("incomplete" if reason["type"] == "length" else "completed")
        for kind, fields in items.take():
            yield sse_event(kind, next(seq), fields)
    assert last is not None
    obj = shell.finished(items, last, len(p.ids))
    _remember(store, p, obj)
    yield sse_event(f"response.{obj['status']}", next(seq), {"response": obj})
