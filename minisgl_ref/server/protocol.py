"""Request schemas of the OpenAI-compatible and SGLang-native APIs, and OpenAI-style errors (chapter 10).

A server's first duty to a bad request is a clear answer: HTTP 4xx and a body that names the problem, in the
shape every OpenAI client already understands::

    {"error": {"message": "temperature: Input should be less than or equal to 2 (got 3.5)",
               "type": "invalid_request_error", "param": "temperature", "code": null}}

A body is checked in three layers, each naming the field it refuses:

1. **JSON** (:func:`parse_json_body`): it must parse, be an object, nest at most ``MAX_JSON_DEPTH`` levels, have
   at most ``MAX_JSON_ITEMS`` items in any array or object but a list of token ids, and hold only Unicode text
   (JSON's ``"\\ud800"`` escape makes a lone surrogate, which no tokenizer, detokenizer or UTF-8 encoder
   accepts) and only integers that fit in 64 bits, signed or unsigned: ``[-2**63, 2**64)``. That is what the
   messages to the scheduler can carry, and it is exactly what ``seed`` means: the engine hashes a seed's low
   64 bits, so any such value is a valid seed (``2**64 - 1`` and ``-1`` are the same one). Tighter ranges
   (token ids against the vocabulary, lengths against the context) are the tokenizer manager's.
2. **Schema** (:func:`validate`): pydantic models in *strict* mode: ``"max_tokens": "10"`` or ``"n": true`` are
   type errors, not silently converted (an int is still accepted where a float is expected). Unknown fields are
   ignored, as clients send metadata this server does not need (``user``, ``metadata``, ``store``, ...); but
   a field that would *change the answer* and is not implemented (``structural_tag``, LoRA, images, ...) is
   refused by name, from the ``unsupported`` table of each schema: an answer that silently ignored it would look
   right and be wrong.
3. **Values**: range rules that the engine also enforces (top_p in (0, 1], ...) are left to
   :class:`SamplingParams`, whose error message names the field; the server translates SGLang's field names
   back to OpenAI's (``max_new_tokens`` -> ``max_tokens``). A grammar (``response_format``, ``json_schema``,
   ``regex``, ``ebnf``, or the schema of a forced tool call) is parsed by xgrammar here too
   (:func:`~minisgl_ref.constrained.validate_grammar`, which remembers its verdicts): a schema it cannot read
   is a 400 naming the field, never a request that fails later inside the scheduler; so is a schema with a
   keyword the grammar would silently skip (``uniqueItems``, ``not``, ...), named with its place in the schema.

Structured output, as each route spells it::

    /v1/chat/completions, /v1/completions   "response_format": {"type": "text" | "json_object"}
                                            "response_format": {"type": "json_schema",
                                                                "json_schema": {"name": ..., "schema": {...}}}
                                            "json_schema": "<schema as a JSON string>" | "regex": ... | "ebnf": ...
    /generate                               "sampling_params": {"json_schema": "...", "regex": ..., "ebnf": ...}

At most one of them per request. Tools (``tools``, ``tool_choice``, ``parallel_tool_calls``, and ``tool`` and
assistant ``tool_calls`` messages in the conversation) are chat's; :mod:`minisgl_ref.server.tools` says how they
become a prompt, a grammar and a parsed answer.
"""

from __future__ import annotations

import gc
import json
import re
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from minisgl_ref.constrained import validate_grammar
from minisgl_ref.core.request import MAX_TOP_LOGPROBS
from minisgl_ref.sampling.params import ANY_JSON, GRAMMAR_FIELDS, SamplingParams


class APIError(Exception):
    """Raised anywhere while handling a request; the app turns it into an OpenAI-style error response."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", *,  # noqa: A002
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,  # noqa: A002
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


#: Deep enough for any JSON schema a client may send, shallow enough that no recursive code downstream
#: (pydantic, the chat template, ``json.dumps`` of our own error messages) nears Python's recursion limit.
MAX_JSON_DEPTH = 64
#: More messages, stop strings, prompts of a batch or dict keys than any client needs. Without a bound, a body
#: under the size limit could hold a million of them, and pydantic (or msgpack) would spend seconds on them
#: holding the GIL, pausing every stream. Lists of token ids may be longer: the context length bounds them, and
#: the tokenizer manager checks a prompt's length before it looks at its ids.
MAX_JSON_ITEMS = 4096
INT_RANGE = (-(2**63), 2**64)  # [low, high): what fits in 64 bits, signed or unsigned
_SURROGATE = re.compile(r"[\ud800-\udfff]")  # json.loads joins valid pairs, so any left is a lone one


class _GCPause:
    """Pauses the cyclic garbage collector while at least one body is being parsed, in any thread.

    Bodies are parsed in worker threads, several at once. Each parse cannot simply disable the collector and
    re-enable it when done: the first parse to finish would switch it back on under a second one still parsing a
    body of millions of small arrays, which then runs full collections, holding the GIL, and pauses every stream
    of the server for seconds. A count of the parses in flight decides instead: the collector goes off with the
    first and back on (if it was on before) with the last."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parses = 0
        self._was_enabled = False

    @contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._parses == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._parses += 1
        try:
            yield
        finally:
            with self._lock:
                self._parses -= 1
                if self._parses == 0 and self._was_enabled:
                    gc.enable()


gc_paused = _GCPause()


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The body as a dict, after the checks of layer 1.

    ``json.loads`` holds the GIL throughout, and a body of many small arrays makes it slow: as millions of new
    containers appear, the cyclic garbage collector runs full passes over the whole heap (4.6 s for 32 MiB of
    ``[[1], [1], ...]`` in the API server, 0.8 s without them). Parsed JSON holds no reference cycles, so the
    collector would find nothing in it: it is paused while any body is being parsed (:data:`gc_paused`)."""
    try:
        with gc_paused():
            body = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError as e:
        raise APIError(400, f"the request body nests more than {MAX_JSON_DEPTH} levels deep",
                       code="invalid_json") from e
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from e
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}",
                       code="invalid_json")
    _check_json_values(body)
    return body


def _check_json_values(body: dict[str, Any]) -> None:
    """Layer 1 of the module docstring, in one walk over the parsed body (a loop, not recursion: the body is the
    client's). Scalars are checked where they sit, so a path is only built for a container or an error."""

    def refuse(path: tuple[Any, ...], problem: str) -> APIError:
        param = ".".join(map(str, path)) or None
        return APIError(400, f"{param}: {problem}" if param else problem, param=param)

    stack: list[tuple[Any, tuple[Any, ...]]] = [(body, ())]
    while stack:
        container, path = stack.pop()
        if len(path) >= MAX_JSON_DEPTH:
            raise refuse(path[:1], f"the request body nests more than {MAX_JSON_DEPTH} levels deep")
        is_dict = isinstance(container, dict)
        if len(container) > MAX_JSON_ITEMS and (is_dict or not all(type(v) is int for v in container)):
            raise refuse(path, f"{len(container)} items are more than the {MAX_JSON_ITEMS} allowed (only a list "
                               "of token ids may be longer)")
        for key, value in container.items() if is_dict else enumerate(container):
            if is_dict and not _is_text(key):
                raise refuse(path, f"the key {key!r} is not valid Unicode text (it holds a lone surrogate)")
            if isinstance(value, (dict, list)):
                stack.append((value, (*path, key)))
            elif isinstance(value, str) and not _is_text(value):
                raise refuse((*path, key), "not valid Unicode text (it holds a lone surrogate, such as "
                                           "the JSON escape \\ud800 without its pair)")
            elif type(value) is int and not INT_RANGE[0] <= value < INT_RANGE[1]:
                raise refuse((*path, key), f"integers must fit in 64 bits (got {_preview(value)})")


def _is_text(s: str) -> bool:
    return s.isascii() or _SURROGATE.search(s) is None


def _preview(value: Any) -> str:
    return json.dumps(value)[:80]


M = TypeVar("M", bound=BaseModel)
_BRANCH_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def validate(model: type[M], body: dict[str, Any]) -> M:
    """``model.model_validate(body)``, with pydantic's errors turned into one 400 naming the first bad field;
    first, any field of the model's ``unsupported`` table that the body sets is refused."""
    refuse_unsupported(body, getattr(model, "unsupported", {}))
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        # A union's error locations name the branch tried (``stop.str``, ``stop.list[str]``): drop those.
        path = [str(p) for p in err["loc"] if not (isinstance(p, str) and (
            "[" in p or p.lower() in _BRANCH_TAGS or p.startswith("function-")))]
        param = ".".join(path) or None
        msg = err["msg"]
        if err["type"] != "missing" and "input" in err:
            msg += f" (got {_preview(err['input'])})"
        raise APIError(400, f"{param}: {msg}" if param else msg, param=param) from e


def sampling_params(kwargs: dict[str, Any], *, names: dict[str, str] | None = None,
                    keywords: bool = True) -> SamplingParams:
    """Build :class:`SamplingParams`, turning its ``ValueError`` into a 400 whose ``param`` is the field named at
    the start of the message (translated through ``names`` for OpenAI's spelling). ``keywords=False`` skips the
    check that a JSON schema's keywords are all enforced (for a schema that only goes into a prompt)."""
    names = names or {}
    try:
        params = SamplingParams(**kwargs)
        validate_grammar(params, keywords=keywords)  # is the grammar valid, and all of a schema enforced?
        return params
    except (ValueError, TypeError) as e:
        message = str(e)
        field = message.split(" ", 1)[0].rstrip(":")
        param = names.get(field, field) if field in kwargs else None
        if param is not None and field != param:
            message = param + message[len(field):]
        raise APIError(400, message, param=param) from e


OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
TEMPLATE_RENDERER_ARGUMENTS = frozenset({
    "chat_template", "tokenize", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "add_generation_prompt", "continue_final_message", "conversation",
})
MAX_N = 128  # samples per prompt (OpenAI's limit)


# ----------------------------------------------------------------------------------- unsupported fields

#: What a field's "not used" values are: absent always counts as not used.
UNSET: tuple[Any, ...] = (None,)


def refuse_unsupported(body: Mapping[str, Any], table: Mapping[str, tuple[Any, ...]], where: str = "") -> None:
    """400 for the first field of ``table`` that ``body`` sets to anything but one of its "not used" values."""
    for name, unused in table.items():
        if name in body and body[name] not in unused:
            raise APIError(400, f"{where}{name} is not supported by this server", param=where + name)


# Fields of SGLang's and OpenAI's APIs that would change the answer and that this server does not implement yet,
# with their "not used" values.
_DECODING_UNSUPPORTED = {  # SGLang's sampling parameters: top-level on the OpenAI routes, in /generate's
    "structural_tag": UNSET,  # constrained decoding by tags: /generate's sampling_params has it, OpenAI routes not
    "no_stop_trim": (None, False), "spaces_between_special_tokens": (None, True),  # detokenizing
    "custom_params": UNSET,  # for a custom logit processor
}
_ENGINE_UNSUPPORTED = {
    "lora_path": UNSET, "return_hidden_states": (None, False), "custom_logit_processor": UNSET,
}
_CHAT_UNSUPPORTED = {
    "functions": (None, []), "function_call": (None, "none"),  # OpenAI's old spelling of tools, retired
    "audio": UNSET, "modalities": (None, ["text"]),
    "prediction": UNSET, "web_search_options": UNSET,
}
_GENERATE_UNSUPPORTED = {
    "input_embeds": UNSET, "image_data": UNSET, "video_data": UNSET, "audio_data": UNSET, "session_params": UNSET,
}


def native_sampling_params(raw: dict[str, Any]) -> SamplingParams:
    """``/generate``'s ``sampling_params`` (SGLang's names): a key this server knows but does not implement is
    refused as unsupported, any other unknown key as unknown (a typo like ``top-p`` must not be ignored)."""
    unsupported = {k: v for k, v in _DECODING_UNSUPPORTED.items() if k != "structural_tag"}  # /generate has it
    refuse_unsupported(raw, unsupported, where="sampling_params.")
    raw = {k: v for k, v in raw.items() if k not in unsupported}  # all of them at their "not used" values
    grammars = [k for k in GRAMMAR_FIELDS if raw.get(k) is not None]
    if len(grammars) > 1:
        raise APIError(400, f"{grammars[1]}: give only one of json_schema, regex, ebnf and structural_tag; these "
                            f"sampling_params "
                            f"give {grammars[0]} and {grammars[1]}", param=grammars[1])
    unknown = sorted(set(raw) - set(SamplingParams.__dataclass_fields__))
    if unknown:
        raise APIError(400, f"unknown sampling parameter {unknown[0]!r}", param="sampling_params")
    params = sampling_params(dict(raw))
    if params.n > MAX_N:
        raise APIError(400, f"n must be <= {MAX_N}, got {params.n}", param="n")
    return params


# ------------------------------------------------------------------------------------------------- schemas


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    unsupported: ClassVar[Mapping[str, tuple[Any, ...]]] = {}  # refused by name; see refuse_unsupported

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI's API documents its optional fields as nullable: ``"stream": null`` means "the default"."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data


# A list of token ids may be a whole context long (see MAX_JSON_ITEMS): every list type stops at its first bad
# element instead of collecting an error per element (seconds, holding the GIL, for a million), and unions try
# their branches in order.
TokenIds = Annotated[list[int], Field(fail_fast=True)]
Texts = Annotated[list[str], Field(fail_fast=True)]
TokenIdsBatch = Annotated[list[TokenIds], Field(fail_fast=True)]


class StreamOptions(_Strict):
    include_usage: bool = False  # a last chunk with the whole request's usage
    # every chunk carries its sequence's usage so far (SGLang's and vLLM's extension; independent of the above)
    continuous_usage_stats: bool = False


#: OpenAI's rule for the names of functions and response formats.
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class JSONSchemaFormat(_Strict):
    """``response_format.json_schema``: a named schema that the answer must follow."""

    name: str = Field(pattern=NAME_PATTERN)  # a label: checked, and a legitimate no-op
    # A no-op, as in SGLang and vLLM: the grammar, not a description, decides the shape of the answer.
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON value
    strict: bool | None = None  # OpenAI's "follow the schema exactly"; a grammar always does (a no-op)


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON that follows a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema object: {"name": ..., "schema": {...}}')
        return self


class _OpenAISampling(_Strict):
    """The sampling fields both OpenAI endpoints share (plus SGLang's extensions, with SGLang's names)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None  # without a stream a no-op: a whole answer carries its usage
    stop: str | Texts | None = Field(None, union_mode="left_to_right")
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (a JSON key, so a string) -> bias in [-100, 100]
    user: str | None = None  # the end user, for the provider's abuse monitoring: a legitimate no-op here
    # SGLang extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = None
    stop_regex: str | Texts | None = Field(None, union_mode="left_to_right")
    skip_special_tokens: bool = True
    cache_salt: str | None = None  # only requests with the same salt share cached prefixes (chapter 04)
    # Constrained decoding: OpenAI's response_format, or one of SGLang's three grammars (see constraint()).
    response_format: ResponseFormat | None = None
    json_schema: str | dict[str, Any] | None = Field(None, union_mode="left_to_right")  # SGLang's: a string
    regex: str | None = None
    ebnf: str | None = None

    def constraint(self) -> tuple[dict[str, Any], dict[str, str]]:
        """The grammar fields of :class:`SamplingParams` this request asks for, and the request's names for them
        (for error messages). ``response_format`` is OpenAI's way of asking for JSON; ``json_schema``, ``regex``
        and ``ebnf`` are SGLang's. One at most: a 400 names the second."""
        fmt = self.response_format
        given = [(name, getattr(self, name)) for name in ("json_schema", "regex", "ebnf")
                 if getattr(self, name) is not None]
        if fmt is not None and fmt.type != "text":
            given.insert(0, ("response_format", fmt))
        if len(given) > 1:
            raise APIError(400, f"{given[1][0]}: give only one of response_format (json_object or json_schema), "
                                f"json_schema, regex and ebnf; this request gives {given[0][0]} and {given[1][0]}",
                           param=given[1][0])
        if not given:
            return {}, {}
        name, value = given[0]
        if name != "response_format":
            return {name: value if isinstance(value, str) else json.dumps(value)}, {}
        if fmt.type == "json_object":
            # OpenAI's JSON mode: any JSON object (not an array or a bare value), with any properties
            return {"json_schema": ANY_JSON}, {"json_schema": "response_format"}
        schema = fmt.json_schema.schema_ if fmt.json_schema else None
        if schema is None:  # a json_schema format without a schema: any JSON value
            return {"json_schema": ANY_JSON}, {"json_schema": "response_format.json_schema"}
        return {"json_schema": json.dumps(schema)}, {"json_schema": "response_format.json_schema.schema"}

    def to_sampling_params(self, max_new_tokens: int,
                           tool_grammar: dict[str, dict[str, Any]] | None = None) -> SamplingParams:
        """The request's :class:`SamplingParams`; ``tool_grammar`` (one grammar field and its value: the
        ``json_schema`` of a forced tool call, :func:`minisgl_ref.server.tools.call_schema`, or the
        ``structural_tag`` of strict tools under ``"auto"``) takes the place of any other."""
        kw: dict[str, Any] = {"max_new_tokens": max_new_tokens, "ignore_eos": self.ignore_eos,
                              "skip_special_tokens": self.skip_special_tokens}
        for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                             ("min_p", "min_p"), ("presence_penalty", "presence_penalty"),
                             ("frequency_penalty", "frequency_penalty"),
                             ("repetition_penalty", "repetition_penalty"), ("stop", "stop"),
                             ("stop_token_ids", "stop_token_ids"), ("seed", "seed"),
                             ("min_new_tokens", "min_tokens"), ("stop_regex", "stop_regex"),
                             ("logit_bias", "logit_bias")):
            value = getattr(self, theirs)
            if value is not None:
                kw[ours] = value
        grammar, names = self.constraint()
        if tool_grammar is not None:
            grammar = {field: json.dumps(value) for field, value in tool_grammar.items()}
            names = {field: "tools" for field in tool_grammar}
        return sampling_params({**kw, **grammar}, names={**OPENAI_NAMES, **names})


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallItem(_Strict):
    """One call in an assistant message of the history (OpenAI's ``message.tool_calls[i]``)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


#: Message fields of OpenAI's API that would change what the model reads and that no chat template here renders:
#: the retired ``function_call`` (use ``tool_calls``) and audio.
UNSUPPORTED_MESSAGE_FIELDS = ("function_call", "audio")


class ChatMessage(BaseModel):
    """One message of a conversation. Fields beyond the declared ones (``reasoning_content``, ``refusal``, ...)
    go to the chat template with the message, as Hugging Face's ``apply_chat_template`` takes them: what the
    model reads is what its template renders (see :meth:`template_fields`)."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # an assistant's calls, earlier in the conversation
    tool_call_id: str | None = None  # a tool message: the call whose result it holds

    @model_validator(mode="after")
    def _calls_belong_to_the_assistant(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls (this one's role is {self.role!r})")
        return self

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        pieces = []
        for j, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"messages.{index}.content.{j}: only text parts are supported "
                                    f"(got type {part.get('type')!r})", param=f"messages.{index}.content")
            pieces.append(part["text"])
        return "".join(pieces)

    def template_fields(self, index: int) -> dict[str, Any]:
        """The message's extra fields, for the chat template. A null one says nothing and is left out (clients
        echo an earlier answer with ``"refusal": null, "audio": null``); one of
        :data:`UNSUPPORTED_MESSAGE_FIELDS` set to anything else is refused by name, and so is a name starting
        with ``_`` (the server's own markers)."""
        extra = {k: v for k, v in (self.model_extra or {}).items() if v is not None}
        for key in extra:
            if key in UNSUPPORTED_MESSAGE_FIELDS or key.startswith("_"):
                raise APIError(400, f"messages.{index}.{key} is not supported by this server",
                               param=f"messages.{index}.{key}")
        return extra


class FunctionSpec(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object; None: no arguments
    # Arguments that follow the schema exactly: what a grammar gives (tool_choice "required" or a named function);
    # with "auto" the calls are parsed from free text, so strict: true is refused there (chat_tool_plan)
    strict: bool | None = None


class ToolSpec(_Strict):
    """One entry of ``tools``: OpenAI's function tools are the only kind."""

    type: Literal["function"]
    function: FunctionSpec


class ChatCompletionRequest(_OpenAISampling):
    unsupported = {**_DECODING_UNSUPPORTED, **_ENGINE_UNSUPPORTED, **_CHAT_UNSUPPORTED}
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False  # the log probability of each token of the answer ...
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # ... and this many alternatives
    # The last message is an assistant's to continue (a prefill such as '{"name": '), not a turn to answer.
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # variables for the model's own template
    # Tool calling (minisgl_ref.server.tools): the functions, and whether the model must, may or may not call one.
    tools: list[ToolSpec] | None = None
    tool_choice: str | dict[str, Any] | None = Field(None, union_mode="left_to_right")  # checked by plan_tools
    parallel_tool_calls: bool = True

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        """Variables for the template, not arguments of the renderer: ``chat_template`` would run the client's
        own Jinja program here (a loop of 10**10 steps is 100 bytes), and the others change what rendering
        returns."""
        reserved = sorted(set(kwargs or ()) & TEMPLATE_RENDERER_ARGUMENTS)
        if reserved:
            raise ValueError(f"{reserved[0]!r} cannot be set through chat_template_kwargs (the server renders the "
                             "model's own chat template)")
        return kwargs


class CompletionRequest(_OpenAISampling):
    unsupported = {**_DECODING_UNSUPPORTED, **_ENGINE_UNSUPPORTED, "suffix": (None, "")}
    prompt: str | Texts | TokenIds | TokenIdsBatch = Field(union_mode="left_to_right")
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # each token's and this many alternatives'
    echo: bool = False  # the prompt comes back in front of the answer (with its log probabilities, if asked)
    best_of: int | None = None


class GenerateRequest(_Strict):
    """SGLang's native ``/generate``: ``text`` or ``input_ids`` (one or a batch), ``sampling_params`` with
    SGLang's names (one dict, or one per prompt)."""

    unsupported = {**_ENGINE_UNSUPPORTED, **_GENERATE_UNSUPPORTED}
    text: str | Texts | None = Field(None, union_mode="left_to_right")
    input_ids: TokenIds | TokenIdsBatch | None = Field(None, union_mode="left_to_right")
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    # SGLang's request id: reported back as meta_info.id (one string, or one per prompt; see client_rids)
    rid: str | Texts | None = Field(None, union_mode="left_to_right")
    return_logprob: bool = False  # log probabilities of the output tokens, and of the prompt's from ...
    logprob_start_len: int = Field(-1, ge=-1)  # ... this position on (-1: each prompt's last token, as SGLang)
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)  # alternatives per token
    return_text_in_logprobs: bool = False  # each token's text beside its id
    cache_salt: str | None = None
