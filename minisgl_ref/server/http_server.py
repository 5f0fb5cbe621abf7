"""The HTTP endpoints: OpenAI-compatible and SGLang-native (chapter 10).

==========================  ======================================================================
route                       what it does
==========================  ======================================================================
POST /v1/chat/completions   OpenAI chat: streaming or not, n, stop, seed, usage with cached tokens,
                            response_format, tools and tool_choice (:mod:`~minisgl_ref.server.tools`)
POST /v1/completions        OpenAI completions: a prompt, a batch of prompts, or token ids
                            (both: a stream's usage at its end, or on every chunk)
POST /v1/responses          OpenAI's Responses API: input items, instructions, text.format, function tools,
                            named stream events; the chat route's code under the new names
                            (:mod:`~minisgl_ref.server.responses`, which also serves GET and DELETE
                            /v1/responses/{id} from its in-memory store of past responses)
GET  /v1/models             the one model served
GET  /v1/models/{id}        that model (404 for any other id)
POST /generate              SGLang's native API: text or input_ids, sampling_params, cumulative stream
                            (logprobs: each event's new ones), prefill-only scoring; a prompt's
                            logprobs from logprob_start_len on (-1, the default: its last token)
GET  /health                200 while every process is alive and the scheduler is not stuck inside one
                            step (--watchdog-timeout), 503 (and why) otherwise
GET  /health_generate       200 once a one-token request has gone through the whole pipeline
GET  /model_info            model path, context length, vocabulary (also at /get_model_info)
GET  /server_info           the server's arguments and the scheduler's state: running, queued, KV use
                            (also at /get_server_info)
POST /flush_cache           drop the radix cache (refused while requests run)
GET  /metrics               Prometheus text (with --enable-metrics)
==========================  ======================================================================

Every generation handler follows the same three steps:

1. **Validate**, in a worker thread: parse the JSON, check it against its schema, tokenize, and check the ids
   against the model (:mod:`minisgl_ref.server.protocol` says what is checked). A 4xx here touches nothing else.
   All of it is CPU work proportional to the body, which on the event loop would pause every stream for as long
   as it took (a 10 MB prompt: half a minute). In a thread the loop keeps running: the tokenizer (Rust) releases
   the GIL while it encodes, and Python code gives it up every few milliseconds. Only ``json.loads`` and
   pydantic hold it throughout, for a time that the body size limit bounds (about a second for the worst body
   of 32 MiB, the default limit).
2. **Submit** the token ids through the :class:`TokenizerManager`.
3. **Answer**: stream the chunks as server-sent events, or collect them into one JSON body. Streaming ends with
   ``data: [DONE]``; a client that disconnects mid-stream cancels the response task, which closes the
   generator, which aborts the request in the scheduler.

No answer to a client's input is a 500: a value that no check above refuses and that still makes the server
fail is a bug in those checks (tests/test_server.py's ``BAD_REQUESTS`` lists what they must refuse).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

import minisgl_ref
from minisgl_ref.sampling.params import SamplingParams
from minisgl_ref.server.args import ServerArgs
from minisgl_ref.server.logprobs import (
    TokenText,
    chat_content,
    completion_logprobs,
    merge_completion_logprobs,
    sglang_logprobs,
)
from minisgl_ref.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerateRequest,
    error_body,
    native_sampling_params,
    parse_json_body,
    sampling_params,
    validate,
)
from minisgl_ref.server.tokenizer_manager import LAST_PROMPT_TOKEN, Chunk, RequestOptions, TokenizerManager
from minisgl_ref.server.tools import (
    NO_PARAMETERS,
    Function,
    ToolCallParser,
    ToolPlan,
    call_schema,
    call_structural_tag,
    plan_tools,
    render_messages,
    template_renders_tools,
)

Sub = tuple[list[int], SamplingParams]  # one request for the scheduler: prompt ids, sampling parameters
T = TypeVar("T")
UNAUTHENTICATED = ("/health", "/health_generate", "/metrics")
WHILE_DEAD = ("/health", "/metrics", "/get_model_info", "/model_info")  # still answered after a child died
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def native_sse(event: dict[str, Any], ids_json: str) -> str:
    """``sse(event)`` for a native stream event, with its ``output_ids`` spliced in as text encoded before.

    A native event carries every id generated so far, so encoding each one afresh costs the whole answer per
    token: turning ints into text was a third of the API server's CPU time per streamed event at 256-token
    answers, and grows with the answer. :class:`Output` keeps the ids' text and appends to it instead, leaving
    an O(length) copy, not an O(length) encode. (The key order differs from :func:`sse`'s; JSON ignores it.)"""
    head = json.dumps({k: v for k, v in event.items() if k != "output_ids"}, ensure_ascii=False)
    return f'data: {head[:-1]}, "output_ids": [{ids_json}]}}\n\n'


SSE_DONE = "data: [DONE]\n\n"


class Gate:
    """Pure ASGI middleware in front of every route: the API key check, the "is the server still whole?" check,
    and the request body's size limit. (Starlette's ``BaseHTTPMiddleware`` would wrap streaming bodies and get in
    the way of disconnect detection, so this is written against ASGI directly.)

    The size limit must act before the body is read, which is why it lives here and not in a handler (by the
    time a handler sees a body, it has been read whole). A body that announces its length (``Content-Length``)
    is refused at once; one sent in chunks is counted as it arrives and refused as soon as the count passes the
    limit. Either way the answer is 413, and uvicorn discards whatever the client still sends."""

    def __init__(self, app: Any, manager: TokenizerManager, api_key: str | None, max_body_mb: float) -> None:
        self.app, self.manager, self.api_key = app, manager, api_key
        self.max_body_mb, self.max_body_bytes = max_body_mb, int(max_body_mb * 2**20)

    def too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than this server's limit of {self.max_body_mb:g} MiB "
                             "(set by --max-request-body-mb)", code="request_too_large")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        headers = dict(scope["headers"])
        reply: JSONResponse | None = None
        if self.api_key is not None and path not in UNAUTHENTICATED:
            auth = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or token.strip() != self.api_key:
                what = "missing" if not auth else "invalid"
                reply = JSONResponse(
                    error_body(f"{what} API key: send 'Authorization: Bearer <key>' with the key given to "
                               "--api-key", "invalid_request_error", code="invalid_api_key"),
                    status_code=401)
        if reply is None and self.manager.dead is not None and path not in WHILE_DEAD:
            reply = JSONResponse(error_body(f"the server cannot serve requests: {self.manager.dead}",
                                            "service_unavailable", code=503), status_code=503)
        if reply is None and int(headers.get(b"content-length", b"0")) > self.max_body_bytes:
            reply = JSONResponse(self.too_large().body(), status_code=413)
        if reply is not None:
            return await reply(scope, receive, send)
        return await self.app(scope, self.counting(receive), send)

    def counting(self, receive: Any) -> Any:
        """``receive``, counting the body's bytes; past the limit it raises the 413 (as an :class:`APIError`,
        which reaches the app's handler for those, since the app is what called ``receive``)."""
        received = 0

        async def counted() -> Any:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body_bytes:
                raise self.too_large()
            return message

        return counted


@dataclass
class ServerState:
    """What every route needs: the tokenizer manager (the way to the scheduler), the server's arguments and the
    model's public name. One per app, at ``app.state.server``."""

    manager: TokenizerManager
    args: ServerArgs
    model_name: str
    names: TokenText = field(init=False)  # token id -> text, for log probabilities
    accepted_names: set[str] = field(init=False)  # the model names a request may give
    template_tools: bool = field(init=False)  # does the chat template render tools itself? (server/tools.py)

    def __post_init__(self) -> None:
        self.names = TokenText(self.manager.tokenizer)
        self.template_tools = self.manager.tokenizer is not None and template_renders_tools(self.manager.tokenizer)
        path = self.args.model.model_path
        self.accepted_names = {self.model_name, "default"} | ({path} if path else set())

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.accepted_names and name != ROUTER_NO_MODEL:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{self.model_name}' "
                                "(see /v1/models)", param="model", code="model_not_found")

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": int(START_TIME), "owned_by": "minisgl_ref",
                "root": self.manager.info.get("model_path"), "max_model_len": self.manager.context_length}


def create_app(manager: TokenizerManager, args: ServerArgs, model_name: str) -> FastAPI:
    """The HTTP app: the routes below (one :data:`router`), the error handlers and the :class:`Gate`."""
    app = FastAPI(title="minisgl_ref", version=minisgl_ref.__version__, docs_url=None, redoc_url=None)
    app.state.server = ServerState(manager, args, model_name)
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected)
    app.add_middleware(Gate, manager=manager, api_key=args.api_key, max_body_mb=args.max_request_body_mb)
    app.include_router(router)
    return app


router = APIRouter()
START_TIME = time.time()
#: The model name SGLang's router writes into a request that named none (``serve --dp-size``): "no model given".
ROUTER_NO_MODEL = "unknown"


def _state(request: Request) -> ServerState:
    return request.app.state.server


# -------------------------------------------------------------------------------------------------- errors


async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(str(e.detail), kind, code=e.status_code), status_code=e.status_code)


async def _unexpected(_: Request, e: Exception) -> JSONResponse:
    # A bug in this server, never a client's doing (see the module docstring); uvicorn logs the traceback.
    return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), status_code=500)


async def validated(request: Request, prepare: Callable[[ServerState, dict[str, Any]], T]
                    ) -> tuple[ServerState, T]:
    """Step 1 of the module docstring: read the body (the :class:`Gate` has capped its size), then parse,
    validate and tokenize it with ``prepare`` in a worker thread."""
    s = _state(request)
    try:
        raw = await request.body()
    except ClientDisconnect as e:  # it left mid-upload: nobody to answer, but no error of ours either
        raise APIError(499, "client disconnected") from e
    return s, await asyncio.to_thread(lambda: prepare(s, parse_json_body(raw)))


# ----------------------------------------------------------------------------------- health & info

def _unhealthy(manager: TokenizerManager) -> JSONResponse | None:
    """503 while a child process is dead or the scheduler is stuck inside one step (server/watchdog.py)."""
    reason = manager.dead or manager.step_stuck()
    if reason is None:
        return None
    return JSONResponse(error_body(reason, "service_unavailable", code=503), status_code=503)

@router.get("/health")
async def health(request: Request) -> Response:
    return _unhealthy(_state(request).manager) or Response(status_code=200)

@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    manager = _state(request).manager
    unhealthy = _unhealthy(manager)
    if unhealthy is not None:  # a stuck scheduler would not answer the probe's token either
        return unhealthy
    params = SamplingParams(max_new_tokens=1, temperature=0.0)

    async def one_token() -> None:
        async for _, chunk in manager.generate([([0], params)], internal=True):
            reason = chunk.finish_reason or {}
            if chunk.finished and reason.get("type") == "abort":
                raise APIError(503, str(reason.get("message", "aborted")), "service_unavailable")

    try:
        await asyncio.wait_for(one_token(), 60)
    except asyncio.TimeoutError as e:
        raise APIError(503, "no token within 60 s", "service_unavailable") from e
    return Response(status_code=200)

@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_state(request).model_card()]}

@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict[str, Any]:
    s = _state(request)
    s.check_model(model_id)
    return s.model_card()

@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(request: Request) -> dict[str, Any]:
    s = _state(request)
    manager, model_name = s.manager, s.model_name
    path = manager.info.get("model_path")
    return {
        "model_path": path, "tokenizer_path": path if manager.tokenizer is not None else None,
        "is_generation": True, "served_model_name": model_name, "architecture": manager.info["architecture"],
        "context_length": manager.context_length, "vocab_size": manager.vocab_size,
    }

@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request) -> dict[str, Any]:
    s = _state(request)
    stats = (await s.manager.rpc("get_stats")).result
    return {**s.args.public_dict(), **{k: v for k, v in s.manager.info.items() if k not in ("model_path",)},
            "served_model_name": s.model_name, "version": minisgl_ref.__version__,
            "internal_states": [stats], **stats}

@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    resp = await _state(request).manager.rpc("flush_cache")
    if not resp.ok:
        raise APIError(400, str(resp.result), code="cache_busy")
    return PlainTextResponse(str(resp.result))

@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    manager = _state(request).manager
    metrics = manager.metrics
    if metrics is None:  # served only with --enable-metrics
        raise StarletteHTTPException(404, "Not Found")
    if manager.dead is None:
        try:
            metrics.set_scheduler_stats((await manager.rpc("get_stats", timeout=5)).result)
        except APIError:
            pass  # a scheduler deep in a long step: serve the last known values
    return Response(metrics.render(), media_type=metrics.content_type)

# -------------------------------------------------------------------------------- OpenAI: chat

def chat_request(s: ServerState, body: dict[str, Any]
                 ) -> tuple[ChatCompletionRequest, list[int], list[Sub], ToolPlan]:
    manager = s.manager
    req = validate(ChatCompletionRequest, body)
    s.check_model(req.model)
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    plan = chat_tool_plan(req)
    messages = [_message(m, i) for i, m in enumerate(req.messages)]
    rendered, tools = render_messages(messages, plan, s.template_tools)
    template_kwargs = dict(req.chat_template_kwargs or {})
    if tools:
        template_kwargs["tools"] = tools
    ids = manager.chat_ids(rendered, continue_final_message=req.continue_final_message, **template_kwargs)
    requested = req.max_completion_tokens or req.max_tokens
    manager.check_prompt(ids, requested, param="messages")
    # With "required" or a named function the answer is the calls' JSON, by grammar; with strict tools under
    # "auto" the text is free and every call in it is held to its schema (a structural tag).
    tool_grammar = ({"json_schema": call_schema(plan)} if plan.constrained else
                    {"structural_tag": call_structural_tag(plan)} if _strict_auto(req, plan) else None)
    params = req.to_sampling_params(requested or manager.context_length - len(ids), tool_grammar=tool_grammar)
    manager.check_params(params)
    return req, ids, _fan_out([ids], params, req.n), plan


def _message(m: ChatMessage, i: int) -> dict[str, Any]:
    """One message of the conversation, as the chat template (or :func:`render_messages`) reads it."""
    out: dict[str, Any] = {**m.template_fields(i), "role": m.role, "content": m.text(i)}
    if m.name:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id or f"call_{i}_{j}", "type": "function",
                              "function": {"name": c.function.name, "arguments": c.function.arguments}}
                             for j, c in enumerate(m.tool_calls)]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def chat_tool_plan(req: ChatCompletionRequest) -> ToolPlan:
    """The request's ``tools`` and ``tool_choice``, checked (a 400 naming the field for anything wrong)."""
    functions = []
    for i, tool in enumerate(req.tools or []):
        fn = tool.function
        params = fn.parameters if fn.parameters is not None else NO_PARAMETERS
        where = f"tools.{i}.function.parameters"
        if params.get("type", "object") != "object":
            raise APIError(400, f"{where}: a function's arguments are a JSON object, so its parameters schema "
                                f"must have type 'object' (got {json.dumps(params.get('type'))})", param=where)
        sampling_params({"json_schema": json.dumps(params)}, names={"json_schema": where}, keywords=False)
        functions.append(Function(fn.name, fn.description, params))
    plan = plan_tools(functions, req.tool_choice, req.parallel_tool_calls)
    if plan.constrained or _strict_auto(req, plan):  # a promise that arguments fit: the grammar must enforce
        for i, f in enumerate(functions):                 # every keyword of the schemas it covers
            if plan.mode in ("required", "auto") or f.name == plan.named:
                where = f"tools.{i}.function.parameters"
                sampling_params({"json_schema": json.dumps(f.parameters)}, names={"json_schema": where})
    if plan.active and req.constraint()[0]:
        raise APIError(400, "response_format, json_schema, regex and ebnf cannot be combined with tools unless "
                            "tool_choice is 'none' (the answer could not both follow them and call a tool)",
                       param="tool_choice")
    return plan


def _strict_auto(req: ChatCompletionRequest, plan: ToolPlan) -> bool:
    """Is this an ``"auto"`` answer whose calls a structural tag keeps to their schemas (a tool is strict)?"""
    return plan.mode == "auto" and any(tool.function.strict for tool in req.tools or [])

@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    s, (req, ids, subs, plan) = await validated(request, chat_request)
    manager, model_name, names = s.manager, s.model_name, s.names
    manager.check_alive()
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    options = RequestOptions(return_logprob=req.logprobs, top_logprobs_num=req.top_logprobs or 0,
                             cache_salt=req.cache_salt)
    top_n = options.top_logprobs_num
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        gen = _chat_stream(manager, subs, options, rid, created, model_name, include_usage, req.n,
                           names if req.logprobs else None, plan, continuous=_continuous_usage(req))
        return StreamingResponse(gen, media_type="text/event-stream", headers=SSE_HEADERS)
    outs = await _collect(manager, subs, request, options)
    finals = [_final(o) for o in outs]
    choices = []
    for i, (o, f) in enumerate(zip(outs, finals)):
        message: dict[str, Any] = {"role": "assistant", "content": f["text"]}
        reason = f["finish_reason"]
        if plan.active:  # the same parser as a stream's, fed the whole text at once
            parser = _tool_parser(plan)
            parser.feed(f["text"])
            parser.finish()
            if parser.calls:
                message = {"role": "assistant", "content": parser.content or None,
                           "tool_calls": [c.openai() for c in parser.calls]}
                reason = _tool_reason(reason)
        choices.append({
            "index": i,
            "message": message,
            "logprobs": {"content": chat_content(names, *o.answer_logprobs(), top_n)} if req.logprobs else None,
            "finish_reason": reason,
            "matched_stop": f["matched_stop"],
        })
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": created, "model": model_name,
        "choices": choices, "usage": _usage(finals, [len(ids)]),
    })

# ------------------------------------------------------------------------------- OpenAI: completions

def completion_request(s: ServerState, body: dict[str, Any]
                       ) -> tuple[CompletionRequest, list[list[int]], list[Sub]]:
    manager = s.manager
    req = validate(CompletionRequest, body)
    s.check_model(req.model)
    if req.best_of not in (None, 1, req.n):
        raise APIError(400, "best_of is not supported (use n)", param="best_of")
    params = req.to_sampling_params(req.max_tokens or 16)
    manager.check_params(params)
    prompts = _prompt_list(req.prompt)
    _check_fan_out(len(prompts) * req.n, param="prompt")
    id_lists = [manager.encode(p) if isinstance(p, str) else p for p in prompts]
    for ids in id_lists:
        manager.check_prompt(ids, req.max_tokens, param="prompt")
    return req, id_lists, _fan_out(id_lists, params, req.n)

@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    s, (req, id_lists, subs) = await validated(request, completion_request)
    manager, model_name, names = s.manager, s.model_name, s.names
    manager.check_alive()
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    want = req.logprobs is not None
    options = RequestOptions(return_logprob=want, top_logprobs_num=req.logprobs or 0,
                             logprob_start_len=0 if want and req.echo else -1, cache_salt=req.cache_salt)
    # With echo, the answer starts with the prompt's text: the string sent, or the decode of the ids sent.
    prompts = _prompt_list(req.prompt)
    echoed = [p if isinstance(p, str) else manager.tokenizer.decode(p) if manager.tokenizer else ""
              for p in prompts] if req.echo else None
    per_prompt = len(subs) // len(id_lists)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        gen = _completion_stream(manager, subs, options, rid, created, model_name, include_usage,
                                 [len(ids) for ids in id_lists], names if want else None,
                                 [echoed[k // per_prompt] for k in range(len(subs))] if echoed else None,
                                 continuous=_continuous_usage(req))
        return StreamingResponse(gen, media_type="text/event-stream", headers=SSE_HEADERS)
    outs = await _collect(manager, subs, request, options)
    finals = [_final(o) for o in outs]
    choices = []
    for i, (o, f) in enumerate(zip(outs, finals)):
        prefix = echoed[i // per_prompt] if echoed else ""
        logprobs = None
        if want:
            parts = [completion_logprobs(names, o.input_logprobs, subs[i][0], options.top_logprobs_num)
                     ] if req.echo else []
            parts.append(completion_logprobs(names, *o.answer_logprobs(), options.top_logprobs_num,
                                             text_start=len(prefix)))
            logprobs = merge_completion_logprobs(parts)
        choices.append({"index": i, "text": prefix + f["text"], "logprobs": logprobs,
                        "finish_reason": f["finish_reason"], "matched_stop": f["matched_stop"]})
    return JSONResponse({
        "id": rid, "object": "text_completion", "created": created, "model": model_name,
        "choices": choices, "usage": _usage(finals, [len(ids) for ids in id_lists]),
    })

# ----------------------------------------------------------------------------------- native /generate

def generate_request(s: ServerState, body: dict[str, Any]
                     ) -> tuple[GenerateRequest, bool, list[Sub], list[str] | None]:
    """The request, whether its answer is a batch (a list), its sub-requests, and the ids the client gave them
    (``rid``; None: the server's own)."""
    manager = s.manager
    req = validate(GenerateRequest, body)
    if (req.text is None) == (req.input_ids is None):
        raise APIError(400, "give exactly one of 'text' and 'input_ids'", param="text")
    single = isinstance(req.text, str) or (req.input_ids is not None and (
        not req.input_ids or isinstance(req.input_ids[0], int)))
    if req.text is not None:
        prompts: list[Any] = [req.text] if isinstance(req.text, str) else list(req.text)
        param = "text"
    else:
        prompts = [req.input_ids] if single else list(req.input_ids)  # type: ignore[arg-type]
        param = "input_ids"
    if not prompts:
        raise APIError(400, f"{param} is an empty batch", param=param)
    raw = req.sampling_params if req.sampling_params is not None else {}
    raw_list = raw if isinstance(raw, list) else [raw] * len(prompts)
    if len(raw_list) != len(prompts):
        raise APIError(400, f"sampling_params has {len(raw_list)} entries for {len(prompts)} prompts",
                       param="sampling_params")
    params_list = [native_sampling_params(sp) for sp in raw_list]  # cheap checks before tokenizing
    _check_fan_out(sum(p.n for p in params_list), param=param)
    subs: list[Sub] = []
    for prompt, params in zip(prompts, params_list):
        manager.check_params(params)
        ids = manager.encode(prompt) if param == "text" else prompt
        manager.check_prompt(ids, params.max_new_tokens, param=param)
        if req.return_logprob and req.logprob_start_len >= len(ids):
            raise APIError(400, f"logprob_start_len ({req.logprob_start_len}) must be below the prompt's "
                                f"{len(ids)} tokens", param="logprob_start_len")
        subs += _fan_out([ids], params, params.n)
    rids = client_rids(req.rid, [p.n for p in params_list])
    return req, not single or len(subs) > 1, subs, rids


def client_rids(rid: str | list[str] | None, samples: list[int]) -> list[str] | None:
    """The ``meta_info.id`` of each sequence when the client named its request (SGLang's ``rid``; ``samples``:
    the sequences of each prompt). A string names one sequence; for several it gets ``_0``, ``_1``, ...
    appended. A list gives one rid per prompt, and a prompt with ``n > 1`` numbers its samples the same way.
    The scheduler keeps its own unique ids: two clients may well pick the same rid."""
    if rid is None:
        return None
    if isinstance(rid, str):
        total = sum(samples)
        return [rid] if total == 1 else [f"{rid}_{i}" for i in range(total)]
    if len(rid) != len(samples):
        raise APIError(400, f"rid has {len(rid)} entries for {len(samples)} prompts", param="rid")
    return [r if n == 1 else f"{r}_{j}" for r, n in zip(rid, samples) for j in range(n)]

@router.post("/generate")
async def generate(request: Request) -> Response:
    s, (req, batch, subs, rids) = await validated(request, generate_request)
    manager, names = s.manager, s.names
    manager.check_alive()
    # Without return_logprob the other logprob fields mean nothing (as in SGLang), and are not passed on. With
    # it, SGLang's -1 (the default) reports each prompt from its own last token on.
    start = req.logprob_start_len if req.logprob_start_len >= 0 else LAST_PROMPT_TOKEN
    options = RequestOptions(return_logprob=req.return_logprob, top_logprobs_num=req.top_logprobs_num,
                             logprob_start_len=start if req.return_logprob else -1, cache_salt=req.cache_salt)
    texts = (names if req.return_text_in_logprobs else None) if req.return_logprob else False
    if req.stream:
        return StreamingResponse(_generate_stream(manager, subs, options, batch, texts, rids),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    outs = [_native(o, subs[i][0], options, texts) for i, o in
            enumerate(await _collect(manager, subs, request, options))]
    if rids is not None:
        for out, rid in zip(outs, rids):
            out["meta_info"]["id"] = rid
    return JSONResponse(outs if batch else outs[0])


# ------------------------------------------------------------------------------------------------ helpers


def _prompt_list(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


#: Sequences (prompts x n) one request may ask for. Each is a message to the scheduler, sent from the event loop
#: (~25 us each) into a socket that buffers about two thousand; a batch of millions froze every stream for minutes.
MAX_SEQUENCES = 1024


def _check_fan_out(count: int, *, param: str) -> None:
    if count > MAX_SEQUENCES:
        raise APIError(400, f"{param}: this request asks for {count} sequences (prompts x n), more than the "
                            f"{MAX_SEQUENCES} one request may: split it", param=param)


def _fan_out(id_lists: Sequence[list[int]], params: SamplingParams, n: int) -> list[Sub]:
    """``n`` samples of each prompt. With a seed, sample ``j`` uses ``seed + j`` so that the samples differ while
    sample 0 equals the same request with ``n=1`` (modulo 2**64: the engine only uses a seed's low 64 bits, and
    the wrap keeps it encodable)."""
    subs = []
    for ids in id_lists:
        for j in range(n):
            p = params
            if n > 1 or params.n != 1:
                seed = None if params.seed is None else (params.seed + j) % 2**64
                p = dataclasses.replace(params, n=1, seed=seed)
            subs.append((list(ids), p))
    return subs


@dataclass
class Output:
    """What one sequence has produced so far, gathered from its chunks."""

    text: str = ""
    ids: list[int] = field(default_factory=list)
    input_logprobs: list[Any] = field(default_factory=list)
    output_logprobs: list[Any] = field(default_factory=list)
    last: Chunk | None = None  # its final chunk, once it has one
    last_seen: Chunk | None = None  # its latest chunk
    ids_json: str = ""  # ``ids`` as JSON array items ("1,2,3"), grown with them: see :func:`native_sse`
    streamed: int = 0  # output log-probability entries already sent in native stream events (:func:`_native`)
    spec: dict[str, Any] | None = None  # the latest speculation figures (chapter 13), if it verified drafts

    def add(self, chunk: Chunk) -> None:
        self.last_seen = chunk
        self.spec = chunk.spec or self.spec
        self.text += chunk.text
        self.ids += chunk.token_ids
        if chunk.token_ids:
            piece = ",".join(map(str, chunk.token_ids))
            self.ids_json = f"{self.ids_json},{piece}" if self.ids_json else piece
        if chunk.logprobs:
            self.input_logprobs += chunk.logprobs["input"]
            self.output_logprobs += chunk.logprobs["output"]
        if chunk.finished:
            self.last = chunk

    def answer_logprobs(self) -> tuple[list[Any], list[int]]:
        """The output entries and ids of the *answer*: without the stop token (EOS or a stop id) that ended it,
        which the text does not contain either."""
        return _answer(self.output_logprobs, self.ids, self.last)


def _answer(entries: list[Any], ids: list[int], last: Chunk | None) -> tuple[list[Any], list[int]]:
    reason = (last.finish_reason if last is not None else None) or {}
    if reason.get("type") == "stop" and isinstance(reason.get("matched"), int) and ids and ids[-1] == reason["matched"]:
        return entries[: len(ids) - 1], ids[:-1]
    return entries[: len(ids)], ids


def _final(out: Output) -> dict[str, Any]:
    last = out.last
    assert last is not None
    reason = last.finish_reason or {"type": "abort"}
    meta_reason = dict(reason)
    if reason["type"] == "length":
        meta_reason["length"] = last.completion_tokens
    return {
        "text": out.text,
        "output_ids": out.ids,
        "finish_reason": reason["type"],
        "matched_stop": reason.get("matched"),
        "completion_tokens": last.completion_tokens,
        "cached_tokens": last.cached_tokens,
        "meta_info": {
            "id": last.rid, "finish_reason": meta_reason, "prompt_tokens": last.prompt_tokens,
            "completion_tokens": last.completion_tokens, "cached_tokens": last.cached_tokens,
            "e2e_latency": round(last.e2e_latency, 6), **_spec_meta(out),
        },
    }


def _spec_meta(out: Output) -> dict[str, Any]:
    """SGLang's speculation figures of a sequence (``spec_verify_ct``, ``spec_accept_length``, ...), from its
    latest chunk that carried them; none for a request that verified no draft (chapter 13)."""
    return dict(out.spec or {})


def _native(out: Output, prompt: list[int], options: RequestOptions, texts: TokenText | None | bool,
            finished: bool = True, streamed: int | None = None) -> dict[str, Any]:
    """One answer (or one stream event) of ``/generate``; ``texts`` is False without logprobs, else the token
    names for ``return_text_in_logprobs`` (or None).

    A stream event (``streamed``: the output log-probability entries earlier events carried) has SGLang's stream
    shape: the text and ids so far, but only the *new* output entries, with ``output_token_logprobs_length``
    counting them all (it equals ``completion_tokens``). Repeating every entry in every event would make a
    stream of n tokens send n**2 / 2 of them. The prompt's entries come whole in every event, as SGLang sends
    them (they all arrive with the prefill, so the list only grows before the first token).

    ``input_token_logprobs`` holds the prompt's tokens from the sequence's own start on
    (:meth:`RequestOptions.logprob_start`): on ``/generate`` by default one entry, its last prompt token's."""
    if finished:
        meta = _final(out)["meta_info"]
    else:
        c = out.last_seen
        meta = {"id": c.rid, "finish_reason": None, "prompt_tokens": c.prompt_tokens,
                "completion_tokens": c.completion_tokens, "cached_tokens": c.cached_tokens,
                "e2e_latency": round(c.e2e_latency, 6), **_spec_meta(out)}
    if texts is not False:
        first = options.logprob_start(len(prompt))
        prompt_ids = prompt[first:] if first >= 0 else []
        meta["input_token_logprobs"], meta["input_top_logprobs"] = sglang_logprobs(
            texts, out.input_logprobs, prompt_ids)  # type: ignore[arg-type]
        start = streamed or 0
        meta["output_token_logprobs"], meta["output_top_logprobs"] = sglang_logprobs(
            texts, out.output_logprobs[start:], out.ids[start:])  # type: ignore[arg-type]
        if streamed is not None:
            meta["output_token_logprobs_length"] = len(out.output_logprobs)
    return {"text": out.text, "output_ids": out.ids, "meta_info": meta}


def _raise_if_aborted(manager: TokenizerManager, last: Chunk) -> None:
    reason = last.finish_reason or {}
    if reason.get("type") == "abort":
        status, kind = (503, "service_unavailable") if manager.dead else (500, "server_error")
        raise APIError(status, f"the request was aborted: {reason.get('message', 'unknown')}", kind)


async def _collect(manager: TokenizerManager, subs: list[Sub], request: Request,
                   options: RequestOptions) -> list[Output]:
    """Run the requests to completion, aborting them if the client disconnects meanwhile."""
    outs = [Output() for _ in subs]

    async def consume() -> None:
        async for i, chunk in manager.generate(subs, options=options):
            outs[i].add(chunk)

    task = asyncio.ensure_future(consume())
    try:
        while not task.done():
            await asyncio.wait([task], timeout=1.0)
            if not task.done() and await request.is_disconnected():
                task.cancel()  # closes the generator, which aborts the requests
                raise APIError(499, "client disconnected")
        task.result()
    finally:
        if not task.done():
            task.cancel()
    for out in outs:
        assert out.last is not None
        _raise_if_aborted(manager, out.last)
    return outs


def _usage(finals: list[dict[str, Any]], prompt_lens: list[int]) -> dict[str, Any]:
    prompt = sum(prompt_lens)
    completion = sum(f["completion_tokens"] for f in finals)
    # With n > 1 the prompt is counted once per prompt (as OpenAI does); its cached part is the smallest any
    # sample saw, so the two stay consistent.
    per_prompt = len(finals) // max(len(prompt_lens), 1)
    cached = sum(min(f["cached_tokens"] for f in finals[k * per_prompt:(k + 1) * per_prompt])
                 for k in range(len(prompt_lens)))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _continuous_usage(req: ChatCompletionRequest | CompletionRequest) -> bool:
    return bool(req.stream_options and req.stream_options.continuous_usage_stats)


def _usage_so_far(prompt_tokens: int, c: Chunk | None) -> dict[str, Any]:
    """``stream_options.continuous_usage_stats``: the usage of one sequence up to chunk ``c`` (None: before its
    first), on every chunk of it, as SGLang and vLLM send it. The prompt counts whole from the first chunk on
    (it is all computed before the first token); ``completion_tokens`` counts the tokens generated so far, so
    the last content chunk's matches that sequence's share of the final usage."""
    done, cached = (c.completion_tokens, c.cached_tokens) if c is not None else (0, 0)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _stream_error(reason: dict[str, Any]) -> str:
    return sse(error_body(f"the request was aborted: {reason.get('message', 'unknown')}", "server_error"))


def _chunk_answer(c: Chunk) -> tuple[list[Any], list[int]]:
    """A chunk's output entries and ids, without the stop token that may end it (see ``Output.answer_logprobs``)."""
    return _answer((c.logprobs or {}).get("output", []), c.token_ids, c if c.finished else None)


def _tool_parser(plan: ToolPlan) -> ToolCallParser:
    """The parser for an answer under ``plan``: tagged calls in free text (``"auto"``), or the bare JSON that the
    grammar of ``"required"`` (an array, with parallel calls) or a named function (one object) produces."""
    form = "tagged" if not plan.constrained else "array" if plan.mode == "required" and plan.parallel else "object"
    return ToolCallParser(plan.names, form)  # type: ignore[arg-type]


def _tool_reason(reason: str) -> str:
    """OpenAI's finish reason for an answer that called tools: ``tool_calls`` where it would have been ``stop``
    (a call cut short by ``max_tokens`` still ends with ``length``)."""
    return "tool_calls" if reason == "stop" else reason


async def _chat_stream(manager: TokenizerManager, subs: list[Sub], options: RequestOptions, rid: str, created: int,
                       model: str, include_usage: bool, n: int, names: TokenText | None,
                       plan: ToolPlan, *, continuous: bool = False) -> AsyncIterator[str]:
    latest: list[Chunk | None] = [None] * len(subs)  # each sequence's latest chunk, for continuous usage

    def chunk(i: int, delta: dict[str, Any], finish: str | None, matched: Any = None,
              logprobs: list[Any] | None = None) -> str:
        choice = {"index": i, "delta": delta, "logprobs": None if logprobs is None else {"content": logprobs},
                  "finish_reason": finish}
        if finish is not None:
            choice["matched_stop"] = matched
        event = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                 "choices": [choice]}
        if continuous:
            event["usage"] = _usage_so_far(len(subs[i][0]), latest[i])
        return sse(event)

    finals: list[dict[str, Any]] = [{} for _ in subs]
    parsers = [_tool_parser(plan) for _ in subs] if plan.active else None
    for i in range(n):
        yield chunk(i, {"role": "assistant", "content": ""}, None)
    async for i, c in manager.generate(subs, options=options):
        latest[i] = c
        logprobs = chat_content(names, *_chunk_answer(c), options.top_logprobs_num) if names else None
        if parsers is None:
            if c.text or logprobs:
                yield chunk(i, {"content": c.text}, None, logprobs=logprobs)
        else:  # what the parser has made certain: content, and pieces of tool calls (one call's per chunk)
            delta = parsers[i].feed(c.text)
            if c.finished:
                end = parsers[i].finish()
                delta.content += end.content
                delta.tool_calls += end.tool_calls
            if delta.content or logprobs:
                yield chunk(i, {"content": delta.content}, None, logprobs=logprobs)
            for piece in delta.tool_calls:
                yield chunk(i, {"tool_calls": [piece]}, None)
        if c.finished:
            reason = c.finish_reason or {"type": "abort"}
            if reason["type"] == "abort":
                yield _stream_error(reason)
            else:
                finish = reason["type"]
                if parsers is not None and parsers[i].calls:
                    finish = _tool_reason(finish)
                yield chunk(i, {}, finish, reason.get("matched"))
            finals[i] = {"completion_tokens": c.completion_tokens, "cached_tokens": c.cached_tokens}
    if include_usage:
        yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [], "usage": _usage(finals, [len(subs[0][0])])})
    yield SSE_DONE


async def _completion_stream(manager: TokenizerManager, subs: list[Sub], options: RequestOptions, rid: str,
                             created: int, model: str, include_usage: bool, prompt_lens: list[int],
                             names: TokenText | None, echoed: list[str] | None, *,
                             continuous: bool = False) -> AsyncIterator[str]:
    """OpenAI's completion stream. With ``echo`` the first chunk of each sequence starts with its prompt's text
    (and, with ``logprobs``, the prompt tokens' entries); ``text_offset`` counts from the start of it all."""
    latest: list[Chunk | None] = [None] * len(subs)  # each sequence's latest chunk, for continuous usage

    def chunk(i: int, text: str, finish: str | None, matched: Any = None, logprobs: Any = None) -> str:
        choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["matched_stop"] = matched
        event = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
        if continuous:
            event["usage"] = _usage_so_far(len(subs[i][0]), latest[i])
        return sse(event)

    finals: list[dict[str, Any]] = [{} for _ in subs]
    sent = [0] * len(subs)  # characters sent so far per sequence, for text_offset
    started = [False] * len(subs)
    async for i, c in manager.generate(subs, options=options):
        latest[i] = c
        text, parts = c.text, []
        if not started[i]:
            started[i] = True
            if echoed is not None:
                text = echoed[i] + text
                if names is not None:
                    parts.append(completion_logprobs(names, (c.logprobs or {}).get("input", []), subs[i][0],
                                                     options.top_logprobs_num))
        if names is not None:
            parts.append(completion_logprobs(names, *_chunk_answer(c), options.top_logprobs_num,
                                             text_start=sent[i] + len(text) - len(c.text)))
        logprobs = merge_completion_logprobs(parts) if names is not None else None
        sent[i] += len(text)
        if c.finished:
            reason = c.finish_reason or {"type": "abort"}
            if reason["type"] == "abort":
                if text:
                    yield chunk(i, text, None, logprobs=logprobs)
                yield _stream_error(reason)
            else:
                yield chunk(i, text, reason["type"], reason.get("matched"), logprobs=logprobs)
            finals[i] = {"completion_tokens": c.completion_tokens, "cached_tokens": c.cached_tokens}
        elif text or (logprobs and logprobs["tokens"]):
            yield chunk(i, text, None, logprobs=logprobs)
    if include_usage:
        yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                   "choices": [], "usage": _usage(finals, prompt_lens)})
    yield SSE_DONE


async def _generate_stream(manager: TokenizerManager, subs: list[Sub], options: RequestOptions, batch: bool,
                           texts: TokenText | None | bool, rids: list[str] | None) -> AsyncIterator[str]:
    """SGLang's native stream: every event carries the *cumulative* text and ids so far, and the log
    probabilities of the output tokens it adds (see :func:`_native`)."""
    outs = [Output() for _ in subs]
    async for i, c in manager.generate(subs, options=options):
        out = outs[i]
        out.add(c)
        if not c.text and not c.token_ids and not c.finished:
            continue
        event = _native(out, subs[i][0], options, texts, finished=c.finished, streamed=out.streamed)
        out.streamed = len(out.output_logprobs)
        if batch:
            event["index"] = i
        if rids is not None:
            event["meta_info"]["id"] = rids[i]
        yield native_sse(event, out.ids_json)
    yield SSE_DONE
