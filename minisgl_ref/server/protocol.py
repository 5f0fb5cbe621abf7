"""Request schemas of the OpenAI-compatible and SGLang-native APIs, and OpenAI-style errors (chapter 10).

A server's first duty to a bad request is a clear answer: HTTP 4xx and a body that names the problem, in the
shape every OpenAI client already understands::

    {"error": {"message": "temperature: Input should be less than or equal to 2 (got 3.5)",
               "type": "invalid_request_error", "param": "temperature", "code": null}}

The schemas are pydantic models in *strict* mode: ``"max_tokens": "10"`` or ``"n": true`` are type errors, not
silently converted (an int is still accepted where a float is expected). Unknown fields are ignored, as OpenAI
clients send fields this server does not need. Range rules that the engine also enforces (top_p in (0, 1], ...)
are left to :class:`SamplingParams`, whose error message names the field; the server translates SGLang's field
names back to OpenAI's (``max_new_tokens`` -> ``max_tokens``).
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from minisgl_ref.sampling.params import SamplingParams


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


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from e
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}",
                       code="invalid_json")
    return body


M = TypeVar("M", bound=BaseModel)
_BRANCH_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def validate(model: type[M], body: dict[str, Any]) -> M:
    """``model.model_validate(body)``, with pydantic's errors turned into one 400 naming the first bad field."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        # A union's error locations name the branch tried (``stop.str``, ``stop.list[str]``): drop those.
        path = [str(p) for p in err["loc"] if not (isinstance(p, str) and (
            "[" in p or p.lower() in _BRANCH_TAGS or p.startswith("function")))]
        param = ".".join(path) or None
        msg = err["msg"]
        if err["type"] != "missing" and "input" in err:
            msg += f" (got {json.dumps(err['input'])[:80]})"
        raise APIError(400, f"{param}: {msg}" if param else msg, param=param) from e


def sampling_params(kwargs: dict[str, Any], *, names: dict[str, str] | None = None) -> SamplingParams:
    """Build :class:`SamplingParams`, turning its ``ValueError`` into a 400 whose ``param`` is the field named at
    the start of the message (translated through ``names`` for OpenAI's spelling)."""
    names = names or {}
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        message = str(e)
        field = message.split(" ", 1)[0]
        param = names.get(field, field) if field in kwargs else None
        if param is not None and field != param:
            message = param + message[len(field):]
        raise APIError(400, message, param=param) from e


OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


# ------------------------------------------------------------------------------------------------- schemas


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _OpenAISampling(_Strict):
    """The sampling fields both OpenAI endpoints share (plus SGLang's extensions, with SGLang's names)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: Any = None
    user: str | None = None
    # SGLang extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True

    def to_sampling_params(self, max_new_tokens: int) -> SamplingParams:
        kw: dict[str, Any] = {"max_new_tokens": max_new_tokens, "ignore_eos": self.ignore_eos,
                              "skip_special_tokens": self.skip_special_tokens}
        for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                             ("min_p", "min_p"), ("presence_penalty", "presence_penalty"),
                             ("frequency_penalty", "frequency_penalty"),
                             ("repetition_penalty", "repetition_penalty"), ("stop", "stop"),
                             ("stop_token_ids", "stop_token_ids"), ("seed", "seed"),
                             ("min_new_tokens", "min_tokens")):
            value = getattr(self, theirs)
            if value is not None:
                kw[ours] = value
        return sampling_params(kw, names=OPENAI_NAMES)


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

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


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = None
    tools: Any = None
    response_format: Any = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class GenerateRequest(_Strict):
    """SGLang's native ``/generate``: ``text`` or ``input_ids`` (one or a batch), ``sampling_params`` with
    SGLang's names (one dict, or one per prompt)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    rid: Any = None
    return_logprob: bool = False
