"""The HTTP endpoints: OpenAI-compatible and SGLang-native (chapter 10).

==========================  ======================================================================
route                       what it does
==========================  ======================================================================
POST /v1/chat/completions   OpenAI chat: streaming or not, n, stop, seed, usage with cached tokens
POST /v1/completions        OpenAI completions: a prompt, a batch of prompts, or token ids
GET  /v1/models             the one model served
POST /generate              SGLang's native API: text or input_ids, sampling_params, cumulative stream
GET  /health                200 while every process is alive, 503 (and why) otherwise
GET  /health_generate       200 once a one-token request has gone through the whole pipeline
GET  /get_model_info        model path, context length, vocabulary
GET  /get_server_info       the server's arguments and the scheduler's state (running, queued, KV use)
POST /flush_cache           drop the radix cache (refused while requests run)
GET  /metrics               Prometheus text (with --enable-metrics)
==========================  ======================================================================

Every handler follows the same three steps: validate (a 4xx here touches nothing else), submit through the
:class:`TokenizerManager`, and either stream the chunks as server-sent events or collect them into one JSON
body. Streaming ends with ``data: [DONE]``; a client that disconnects mid-stream cancels the response task,
which closes the generator, which aborts the request in the scheduler.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import minisgl_ref
from minisgl_ref.sampling.params import SamplingParams
from minisgl_ref.server.args import ServerArgs
from minisgl_ref.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    error_body,
    parse_json_body,
    sampling_params,
    validate,
)
from minisgl_ref.server.tokenizer_manager import Chunk, TokenizerManager

UNAUTHENTICATED = ("/health", "/health_generate", "/metrics")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class Gate:
    """Pure ASGI middleware in front of every route: the API key check, then the "is the server still whole?"
    check. (Starlette's ``BaseHTTPMiddleware`` would wrap streaming bodies and get in the way of disconnect
    detection, so this is written against ASGI directly.)"""

    def __init__(self, app: Any, manager: TokenizerManager, api_key: str | None) -> None:
        self.app, self.manager, self.api_key = app, manager, api_key

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        reply: JSONResponse | None = None
        if self.api_key is not None and path not in UNAUTHENTICATED:
            auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or token.strip() != self.api_key:
                what = "missing" if not auth else "invalid"
                reply = JSONResponse(
                    error_body(f"{what} API key: send 'Authorization: Bearer <key>' with the key given to "
                               "--api-key", "invalid_request_error", code="invalid_api_key"),
                    status_code=401)
        if reply is None and self.manager.dead is not None and path not in ("/health", "/metrics",
                                                                            "/get_model_info"):
            reply = JSONResponse(error_body(f"the server cannot serve requests: {self.manager.dead}",
                                            "service_unavailable", code=503), status_code=503)
        if reply is not None:
            return await reply(scope, receive, send)
        return await self.app(scope, receive, send)


def create_app(manager: TokenizerManager, args: ServerArgs, model_name: str) -> FastAPI:
    app = FastAPI(title="minisgl_ref", version=minisgl_ref.__version__, docs_url=None, redoc_url=None)
    accepted_names = {model_name, "default"} | ({args.model_path} if args.model_path else set())

    # ---------------------------------------------------------------------------------------- errors

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), kind, code=e.status_code), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"),
                            status_code=500)

    app.add_middleware(Gate, manager=manager, api_key=args.api_key)

    async def body_of(request: Request) -> dict[str, Any]:
        return parse_json_body(await request.body())

    def check_model(name: str | None) -> None:
        if name is not None and name not in accepted_names:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{model_name}' "
                                "(see /v1/models)", param="model", code="model_not_found")

    # ----------------------------------------------------------------------------------- health & info

    @app.get("/health")
    async def health() -> Response:
        if manager.dead is not None:
            return JSONResponse(error_body(manager.dead, "service_unavailable", code=503), status_code=503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
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

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(START_TIME), "owned_by": "minisgl_ref",
            "root": manager.info.get("model_path"), "max_model_len": manager.context_length,
        }]}

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        path = manager.info.get("model_path")
        return {
            "model_path": path, "tokenizer_path": path if manager.tokenizer is not None else None,
            "is_generation": True, "served_model_name": model_name, "architecture": manager.info["architecture"],
            "context_length": manager.context_length, "vocab_size": manager.vocab_size,
        }

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        stats = (await manager.rpc("get_stats")).result
        return {**args.public_dict(), **{k: v for k, v in manager.info.items() if k not in ("model_path",)},
                "served_model_name": model_name, "version": minisgl_ref.__version__,
                "internal_states": [stats], **stats}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        resp = await manager.rpc("flush_cache")
        if not resp.ok:
            raise APIError(400, str(resp.result), code="cache_busy")
        return PlainTextResponse(str(resp.result))

    if args.enable_metrics:
        assert manager.metrics is not None
        metrics = manager.metrics

        @app.get("/metrics")
        async def prometheus() -> Response:
            if manager.dead is None:
                try:
                    metrics.set_scheduler_stats((await manager.rpc("get_stats", timeout=5)).result)
                except APIError:
                    pass  # a scheduler deep in a long step: serve the last known values
            return Response(metrics.render(), media_type=metrics.content_type)

    # -------------------------------------------------------------------------------- OpenAI: chat

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = validate(ChatCompletionRequest, await body_of(request))
        check_model(req.model)
        _reject_unsupported(req.logprobs, "logprobs")
        _reject_unsupported(req.tools, "tools")
        _reject_unsupported(req.response_format if not _is_text_format(req.response_format) else None,
                            "response_format")
        messages = [{"role": m.role, "content": m.text(i), **({"name": m.name} if m.name else {})}
                    for i, m in enumerate(req.messages)]
        ids = manager.chat_ids(messages, **(req.chat_template_kwargs or {}))
        requested = req.max_completion_tokens or req.max_tokens
        manager.check_prompt(ids, requested, param="messages")
        params = req.to_sampling_params(requested or manager.context_length - len(ids))
        manager.check_params(params)
        subs = _fan_out([ids], params, req.n)
        manager.check_alive()
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            gen = _chat_stream(manager, subs, rid, created, model_name, include_usage, req.n)
            return StreamingResponse(gen, media_type="text/event-stream", headers=SSE_HEADERS)
        finals = await _collect(manager, subs, request)
        choices = [{
            "index": i,
            "message": {"role": "assistant", "content": f["text"]},
            "logprobs": None,
            "finish_reason": f["finish_reason"],
            "matched_stop": f["matched_stop"],
        } for i, f in enumerate(finals)]
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": model_name,
            "choices": choices, "usage": _usage(finals, [len(ids)]),
        })

    # ------------------------------------------------------------------------------- OpenAI: completions

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = validate(CompletionRequest, await body_of(request))
        check_model(req.model)
        _reject_unsupported(req.logprobs, "logprobs")
        _reject_unsupported(req.echo or None, "echo")
        _reject_unsupported(req.suffix, "suffix")
        if req.best_of not in (None, 1, req.n):
            raise APIError(400, "best_of is not supported (use n)", param="best_of")
        prompts = _prompt_list(req.prompt)
        id_lists = [manager.encode(p) if isinstance(p, str) else p for p in prompts]
        for ids in id_lists:
            manager.check_prompt(ids, req.max_tokens, param="prompt")
        params = req.to_sampling_params(req.max_tokens or 16)
        manager.check_params(params)
        subs = _fan_out(id_lists, params, req.n)
        manager.check_alive()
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            gen = _completion_stream(manager, subs, rid, created, model_name, include_usage,
                                     [len(ids) for ids in id_lists])
            return StreamingResponse(gen, media_type="text/event-stream", headers=SSE_HEADERS)
        finals = await _collect(manager, subs, request)
        choices = [{"index": i, "text": f["text"], "logprobs": None, "finish_reason": f["finish_reason"],
                    "matched_stop": f["matched_stop"]} for i, f in enumerate(finals)]
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": created, "model": model_name,
            "choices": choices, "usage": _usage(finals, [len(ids) for ids in id_lists]),
        })

    # ----------------------------------------------------------------------------------- native /generate

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        req = validate(GenerateRequest, await body_of(request))
        if (req.text is None) == (req.input_ids is None):
            raise APIError(400, "give exactly one of 'text' and 'input_ids'", param="text")
        _reject_unsupported(req.return_logprob or None, "return_logprob")
        single = isinstance(req.text, str) or (req.input_ids is not None and (
            not req.input_ids or isinstance(req.input_ids[0], int)))
        if req.text is not None:
            items = [req.text] if isinstance(req.text, str) else list(req.text)
            id_lists = [manager.encode(t) for t in items]
            param = "text"
        else:
            id_lists = [req.input_ids] if single else list(req.input_ids)  # type: ignore[list-item]
            param = "input_ids"
        if not id_lists:
            raise APIError(400, f"{param} is an empty batch", param=param)
        raw = req.sampling_params if req.sampling_params is not None else {}
        raw_list = raw if isinstance(raw, list) else [raw] * len(id_lists)
        if len(raw_list) != len(id_lists):
            raise APIError(400, f"sampling_params has {len(raw_list)} entries for {len(id_lists)} prompts",
                           param="sampling_params")
        subs: list[tuple[list[int], SamplingParams]] = []
        for ids, sp in zip(id_lists, raw_list):
            unknown = set(sp) - set(SamplingParams.__dataclass_fields__)
            if unknown:
                raise APIError(400, f"unknown sampling parameter {sorted(unknown)[0]!r}", param="sampling_params")
            params = sampling_params(dict(sp))
            manager.check_params(params)
            manager.check_prompt(ids, params.max_new_tokens, param=param)
            subs += _fan_out([ids], params, params.n)
        manager.check_alive()
        batch = not single or len(subs) > 1
        if req.stream:
            return StreamingResponse(_generate_stream(manager, subs, batch), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        finals = await _collect(manager, subs, request)
        outs = [{"text": f["text"], "output_ids": f["output_ids"], "meta_info": f["meta_info"]} for f in finals]
        return JSONResponse(outs if batch else outs[0])

    return app


START_TIME = time.time()


# ------------------------------------------------------------------------------------------------ helpers


def _is_text_format(fmt: Any) -> bool:
    return fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text")


def _reject_unsupported(value: Any, name: str) -> None:
    if value not in (None, False, 0, [], {}):
        raise APIError(400, f"{name} is not supported by this server", param=name)


def _prompt_list(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _fan_out(id_lists: Sequence[list[int]], params: SamplingParams,
             n: int) -> list[tuple[list[int], SamplingParams]]:
    """``n`` samples of each prompt. With a seed, sample ``j`` uses ``seed + j`` so that the samples differ while
    sample 0 equals the same request with ``n=1``."""
    subs = []
    for ids in id_lists:
        for j in range(n):
            p = params
            if n > 1 or params.n != 1:
                d = params.to_dict()
                d["n"] = 1
                if params.seed is not None:
                    d["seed"] = params.seed + j
                p = SamplingParams.from_dict(d)
            subs.append((list(ids), p))
    return subs


def _openai_finish(reason: dict[str, Any] | None) -> tuple[str | None, Any]:
    if reason is None:
        return None, None
    return reason["type"], reason.get("matched")


def _final(chunks_text: list[str], ids: list[int], last: Chunk) -> dict[str, Any]:
    reason = last.finish_reason or {"type": "abort"}
    kind, matched = _openai_finish(reason)
    meta_reason = dict(reason)
    if kind == "length":
        meta_reason["length"] = last.completion_tokens
    return {
        "text": "".join(chunks_text),
        "output_ids": ids,
        "finish_reason": kind,
        "matched_stop": matched,
        "completion_tokens": last.completion_tokens,
        "cached_tokens": last.cached_tokens,
        "meta_info": {
            "id": last.rid, "finish_reason": meta_reason, "prompt_tokens": last.prompt_tokens,
            "completion_tokens": last.completion_tokens, "cached_tokens": last.cached_tokens,
            "e2e_latency": round(last.e2e_latency, 6),
        },
    }


def _raise_if_aborted(manager: TokenizerManager, last: Chunk) -> None:
    reason = last.finish_reason or {}
    if reason.get("type") == "abort":
        status, kind = (503, "service_unavailable") if manager.dead else (500, "server_error")
        raise APIError(status, f"the request was aborted: {reason.get('message', 'unknown')}", kind)


async def _collect(manager: TokenizerManager, subs: list[tuple[list[int], SamplingParams]],
                   request: Request) -> list[dict[str, Any]]:
    """Run the requests to completion, aborting them if the client disconnects meanwhile."""
    texts: list[list[str]] = [[] for _ in subs]
    ids: list[list[int]] = [[] for _ in subs]
    last: list[Chunk | None] = [None] * len(subs)

    async def consume() -> None:
        async for i, chunk in manager.generate(subs):
            texts[i].append(chunk.text)
            ids[i] += chunk.token_ids
            if chunk.finished:
                last[i] = chunk

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
    finals = []
    for t, i, c in zip(texts, ids, last):
        assert c is not None
        _raise_if_aborted(manager, c)
        finals.append(_final(t, i, c))
    return finals


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


def _stream_error(reason: dict[str, Any]) -> str:
    return sse(error_body(f"the request was aborted: {reason.get('message', 'unknown')}", "server_error"))


async def _chat_stream(manager: TokenizerManager, subs: list, rid: str, created: int, model: str,
                       include_usage: bool, n: int) -> AsyncIterator[str]:
    def chunk(i: int, delta: dict[str, Any], finish: str | None, matched: Any = None) -> str:
        choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["matched_stop"] = matched
        return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [choice]})

    finals: list[dict[str, Any]] = [{} for _ in subs]
    for i in range(n):
        yield chunk(i, {"role": "assistant", "content": ""}, None)
    async for i, c in manager.generate(subs):
        if c.text:
            yield chunk(i, {"content": c.text}, None)
        if c.finished:
            reason = c.finish_reason or {"type": "abort"}
            if reason["type"] == "abort":
                yield _stream_error(reason)
            else:
                yield chunk(i, {}, reason["type"], reason.get("matched"))
            finals[i] = {"completion_tokens": c.completion_tokens, "cached_tokens": c.cached_tokens}
    if include_usage:
        yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [], "usage": _usage(finals, [len(subs[0][0])])})
    yield SSE_DONE


async def _completion_stream(manager: TokenizerManager, subs: list, rid: str, created: int, model: str,
                             include_usage: bool, prompt_lens: list[int]) -> AsyncIterator[str]:
    def chunk(i: int, text: str, finish: str | None, matched: Any = None) -> str:
        choice = {"index": i, "text": text, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["matched_stop"] = matched
        return sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                    "choices": [choice]})

    finals: list[dict[str, Any]] = [{} for _ in subs]
    async for i, c in manager.generate(subs):
        if c.finished:
            reason = c.finish_reason or {"type": "abort"}
            if reason["type"] == "abort":
                if c.text:
                    yield chunk(i, c.text, None)
                yield _stream_error(reason)
            else:
                yield chunk(i, c.text, reason["type"], reason.get("matched"))
            finals[i] = {"completion_tokens": c.completion_tokens, "cached_tokens": c.cached_tokens}
        elif c.text:
            yield chunk(i, c.text, None)
    if include_usage:
        yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                   "choices": [], "usage": _usage(finals, prompt_lens)})
    yield SSE_DONE


async def _generate_stream(manager: TokenizerManager, subs: list, batch: bool) -> AsyncIterator[str]:
    """SGLang's native stream: every event carries the *cumulative* text and ids so far."""
    texts = ["" for _ in subs]
    ids: list[list[int]] = [[] for _ in subs]
    async for i, c in manager.generate(subs):
        texts[i] += c.text
        ids[i] += c.token_ids
        if not c.text and not c.token_ids and not c.finished:
            continue
        if c.finished:
            out = _final([texts[i]], ids[i], c)
            event = {"text": out["text"], "output_ids": out["output_ids"], "meta_info": out["meta_info"]}
        else:
            event = {"text": texts[i], "output_ids": ids[i], "meta_info": {
                "id": c.rid, "finish_reason": None, "prompt_tokens": c.prompt_tokens,
                "completion_tokens": c.completion_tokens, "cached_tokens": c.cached_tokens,
                "e2e_latency": round(c.e2e_latency, 6)}}
        if batch:
            event["index"] = i
        yield sse(event)
    yield SSE_DONE
