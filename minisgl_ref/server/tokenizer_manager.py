"""The API server's side of a request: text to ids, out to the scheduler, outputs back to the right handler
(chapter 10).

Like SGLang's ``TokenizerManager``, it lives *in* the HTTP process rather than in a tokenizer process of its own
(Mini-SGLang's choice). Tokenizing a chat prompt takes well under a millisecond per hundred tokens, so a
separate process would buy little and cost a hop; and tokenizing here means every request is fully validated
(prompt length against the context window, token ids against the vocabulary) *before* it enters the pipeline,
so a bad request gets its 400 at once and never reaches the engine. Its tokenizing and checking methods
(:meth:`~TokenizerManager.encode`, :meth:`~TokenizerManager.chat_ids`, the ``check_*`` ones) run in the HTTP
handlers' worker threads, off the event loop (a huge prompt takes seconds to encode), so they only read state
that never changes after start-up; HF's Rust tokenizer may encode on several threads at once, and releases the
GIL while it does.

Each HTTP handler calls :meth:`TokenizerManager.generate`, an async generator of ``(index, Chunk)`` pairs. A
background task (:meth:`_recv_loop`) reads the detokenizer's batched outputs and drops each row into the queue
of the request it belongs to; a handler that finds several rows of its request waiting takes them as one
(:func:`coalesce`). When a handler stops listening before its request finished (the client went
away, or the handler was cancelled) the generator's ``finally`` sends an :class:`AbortReq`, and the scheduler
frees the request's KV.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import zmq
import zmq.asyncio

from minisgl_ref.sampling.params import SamplingParams
from minisgl_ref.server.args import Addresses, ServerArgs
from minisgl_ref.server.messages import (
    AbortReq,
    BatchStrOut,
    GenerateReqInput,
    RpcReq,
    RpcResp,
    decode,
    encode,
)
from minisgl_ref.server.metrics import RequestTrack, ServerMetrics
from minisgl_ref.server.protocol import APIError

log = logging.getLogger("minisgl_ref.server")


@dataclass
class Chunk:
    """What one output row means to a handler: new text and ids, and whether (and why) the request ended."""

    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: dict[str, Any] | None
    cached_tokens: int
    completion_tokens: int  # so far
    prompt_tokens: int
    rid: str
    e2e_latency: float = 0.0
    # For requests that asked for them: the log-probability entries computed since the last chunk, as
    # ``{"input": [...], "output": [...]}`` (see :mod:`minisgl_ref.server.logprobs`).
    logprobs: dict[str, list[Any]] | None = None
    # For requests that verified drafts (chapter 13): SGLang's speculation figures so far, for meta_info.
    spec: dict[str, Any] | None = None


def merge_chunks(first: Chunk, then: Chunk) -> Chunk:
    """One chunk that says what ``first`` and then ``then`` (of the same sequence) said."""
    logprobs = first.logprobs
    if then.logprobs:
        before = first.logprobs or {}
        logprobs = {key: before.get(key, []) + then.logprobs.get(key, []) for key in ("input", "output")}
    return dataclasses.replace(then, text=first.text + then.text, token_ids=first.token_ids + then.token_ids,
                               logprobs=logprobs, spec=then.spec or first.spec)


def coalesce(pending: list[tuple[int, Chunk]]) -> list[tuple[int, Chunk]]:
    """The chunks that queued up for one handler, merged per sequence (in order of first appearance).

    A handler normally wakes for every chunk. When the API server's event loop falls behind (thousands of
    streams, each one event per token), several chunks of a request wait in its queue; sending them one event
    each would spend the most CPU exactly when there is least to spare, and deliver them back to back anyway.
    One event carrying them all costs one encode and one socket write."""
    merged: dict[int, Chunk] = {}
    for index, chunk in pending:
        merged[index] = merge_chunks(merged[index], chunk) if index in merged else chunk
    return list(merged.items())


#: ``RequestOptions.logprob_start_len`` for "each prompt from its own last token": what SGLang's ``/generate``
#: means by -1, its default. The position differs between the prompts of one batch, so the request carries this
#: rule and each sequence resolves it against its own prompt (:meth:`RequestOptions.logprob_start`).
LAST_PROMPT_TOKEN = "last"


@dataclass(frozen=True)
class RequestOptions:
    """What a request asks of the engine besides its sampling parameters; the same for every sequence of one
    HTTP request. The names are SGLang's (see :class:`~minisgl_ref.core.request.Req`).

    ``logprob_start_len`` is the first prompt position whose log probability is reported: a position, -1 for
    none of the prompt (the engine's meaning, and what the OpenAI routes need), or :data:`LAST_PROMPT_TOKEN`."""

    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int | Literal["last"] = -1
    cache_salt: str | None = None

    def logprob_start(self, prompt_len: int) -> int:
        """The engine's ``logprob_start_len`` (a position, or -1: none) for one sequence whose prompt has
        ``prompt_len`` tokens. Without ``return_logprob`` no position is reported."""
        start = self.logprob_start_len
        if not self.return_logprob:
            return -1
        if isinstance(start, str):
            assert start == LAST_PROMPT_TOKEN, start
            return prompt_len - 1
        return start


@dataclass
class ReqState:
    rid: str
    index: int
    queue: asyncio.Queue
    prompt_tokens: int
    internal: bool
    created: float = field(default_factory=time.perf_counter)
    last_time: float | None = None
    completion_tokens: int = 0
    finished: bool = False
    track: RequestTrack | None = None  # the metrics' view of it, from when the scheduler has it (never if internal)


class TokenizerManager:
    def __init__(self, args: ServerArgs, addrs: Addresses, info: dict[str, Any], tokenizer: Any,
                 metrics: ServerMetrics | None) -> None:
        self.args = args
        self.addrs = addrs
        self.info = info
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.context_length: int = info["context_length"]
        self.vocab_size: int = info["vocab_size"]
        self.max_total_num_tokens: int = info["max_total_num_tokens"]
        self.states: dict[str, ReqState] = {}
        self.rpcs: dict[int, asyncio.Future] = {}
        self._rpc_ids = itertools.count()
        self.dead: str | None = None  # why the server cannot serve any more (a child process died)
        # why the scheduler counts as stuck inside one step, or None (the launcher sets it: server/watchdog.py)
        self.step_stuck: Callable[[], str | None] = lambda: None
        # Sending never blocks (a PUSH socket queues up to its high-water mark), so a plain socket works from
        # async code, and also from a `finally` that runs while the task is being cancelled.
        self._sync_ctx = zmq.Context()
        self.to_scheduler = self._sync_ctx.socket(zmq.PUSH)
        self.to_scheduler.setsockopt(zmq.LINGER, 0)
        self.to_scheduler.connect(addrs.scheduler)
        self._async_ctx = zmq.asyncio.Context()
        self.recv = self._async_ctx.socket(zmq.PULL)
        self.recv.bind(addrs.api)
        self._task: asyncio.Task | None = None

    # -------------------------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._recv_loop())
        self._task.add_done_callback(self._recv_loop_ended)

    def _recv_loop_ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            # Without this loop no request can ever finish: better to say so (and exit) than to hang.
            log.error("the API server's receive loop failed", exc_info=task.exception())
            self.mark_dead(f"the API server's receive loop failed: {task.exception()!r}")

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._sync_ctx.destroy(linger=0)
        self._async_ctx.destroy(linger=0)

    def mark_dead(self, reason: str) -> None:
        """A child process died: fail every request in flight and refuse new ones."""
        if self.dead is not None:
            return
        self.dead = reason
        for st in list(self.states.values()):
            self._deliver(st, "", [], True, {"type": "abort", "message": reason}, 0)
        for fut in self.rpcs.values():
            if not fut.done():
                fut.set_exception(APIError(503, reason, "service_unavailable"))

    def check_alive(self) -> None:
        if self.dead is not None:
            raise APIError(503, f"the server cannot serve requests: {self.dead}", "service_unavailable")

    # ------------------------------------------------------------------------------------------ tokenizing

    def require_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise APIError(400, f"{what} needs a tokenizer, and this model has none: send token ids instead")
        return self.tokenizer

    def encode(self, text: str) -> list[int]:
        return self.require_tokenizer("a text prompt").encode(text)

    def chat_ids(self, messages: list[dict[str, Any]], *, continue_final_message: bool = False,
                 **template_kwargs: Any) -> list[int]:
        """The prompt of a chat request. With ``continue_final_message`` the last (assistant) message is left
        open for the model to continue, instead of a new assistant turn being started after it."""
        tok = self.require_tokenizer("chat")
        if continue_final_message:
            if messages[-1]["role"] != "assistant":
                raise APIError(400, "continue_final_message needs the last message to be the assistant's",
                               param="continue_final_message")
            template_kwargs.update(continue_final_message=True, add_generation_prompt=False)
        try:
            return tok.apply_chat_template(messages, **{"add_generation_prompt": True, **template_kwargs})
        except Exception as e:  # noqa: BLE001 - jinja raises whatever the template author wrote
            raise APIError(400, f"the chat template rejected these messages: {e}", param="messages") from e

    def check_params(self, params: SamplingParams) -> None:
        """What :class:`SamplingParams` cannot check without the model: every token id it names (stop ids,
        logit_bias keys) must be in the vocabulary, or the request would fail deep inside the scheduler."""
        if params.stop and self.tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer, and this model has none: use stop_token_ids",
                           param="stop")
        self.check_token_ids(params.stop_token_ids or (), param="stop_token_ids")
        self.check_token_ids(params.logit_bias or {}, param="logit_bias")

    def check_token_ids(self, ids: Iterable[int], *, param: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"{param}: token id {bad} is out of range: the vocabulary has {self.vocab_size} "
                                "ids", param=param)

    def check_prompt(self, ids: Sequence[int], max_new_tokens: int | None, *, param: str = "prompt") -> None:
        """The checks SGLang's tokenizer manager makes before a request may enter the pipeline (the length first:
        it costs nothing, however long the prompt)."""
        if not ids:
            raise APIError(400, "the prompt is empty", param=param)
        n, ctx = len(ids), self.context_length
        if n >= ctx:
            raise APIError(
                400, f"This model's maximum context length is {ctx} tokens, but the prompt has {n} tokens "
                     "(at least one token must be left for the output).",
                param=param, code="context_length_exceeded")
        self.check_token_ids(ids, param=param)
        if max_new_tokens is not None and n + max_new_tokens > ctx:
            raise APIError(
                400, f"This model's maximum context length is {ctx} tokens. However, you requested "
                     f"{n + max_new_tokens} tokens ({n} in the prompt, {max_new_tokens} for the completion). "
                     "Please reduce the prompt or the maximum number of output tokens.",
                param="max_tokens", code="context_length_exceeded")
        if n + 1 > self.max_total_num_tokens:
            raise APIError(400, f"the prompt has {n} tokens but the whole KV pool holds "
                                f"{self.max_total_num_tokens}", param=param, code="context_length_exceeded")

    # ------------------------------------------------------------------------------------------ generating

    async def generate(
        self, reqs: Sequence[tuple[list[int], SamplingParams]], *, internal: bool = False,
        options: RequestOptions = RequestOptions(),
    ) -> AsyncIterator[tuple[int, Chunk]]:
        """Run several requests (a batch, or the n samples of one prompt) and yield ``(index, chunk)`` as their
        outputs arrive, until every one has finished. Leaving early aborts the unfinished ones."""
        self.check_alive()
        base = uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        states = [ReqState(f"{base}-{i}", i, queue, len(ids), internal) for i, (ids, _) in enumerate(reqs)]
        remaining = len(states)
        try:
            for st, (ids, params) in zip(states, reqs):
                self.states[st.rid] = st
                self._send(GenerateReqInput(st.rid, list(ids), params.to_dict(), options.cache_salt,
                                            options.return_logprob, options.top_logprobs_num,
                                            options.logprob_start(len(ids))))
                if self.metrics is not None and not internal:
                    st.track = self.metrics.start(st.prompt_tokens, st.created)
            while remaining:
                pending = [await queue.get()]
                while not queue.empty():  # this handler fell behind: what has piled up goes out as one event
                    pending.append(queue.get_nowait())
                for index, chunk in coalesce(pending):
                    if chunk.finished:
                        remaining -= 1
                    yield index, chunk
        finally:
            for st in states:
                self.states.pop(st.rid, None)
                if not st.finished and self.dead is None:
                    st.finished = True
                    try:
                        self._send(AbortReq(st.rid))
                    except APIError:
                        log.warning("could not send the abort of %s", st.rid)
                    log.debug("aborted %s (its client stopped listening)", st.rid)
                if self.metrics is not None and st.track is not None:
                    # Counts it as aborted unless it was already counted when it ended (in `_deliver`).
                    self.metrics.end(st.track, aborted=True)

    async def rpc(self, method: str, timeout: float = 30.0) -> RpcResp:
        self.check_alive()
        rpc_id = next(self._rpc_ids)
        fut = asyncio.get_running_loop().create_future()
        self.rpcs[rpc_id] = fut
        self._send(RpcReq(rpc_id, method))
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError as e:
            raise APIError(503, f"the scheduler did not answer {method!r} within {timeout:.0f} s",
                           "service_unavailable") from e
        finally:
            self.rpcs.pop(rpc_id, None)

    def _send(self, msg: Any) -> None:
        try:
            self.to_scheduler.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again as e:
            raise APIError(503, "the scheduler is not keeping up with requests", "service_unavailable") from e

    # -------------------------------------------------------------------------------------------- receiving

    async def _recv_loop(self) -> None:
        while True:
            msg = decode(await self.recv.recv())
            if isinstance(msg, BatchStrOut):
                for rid, delta, ids, finished, reason, cached, logprobs, spec in zip(
                    msg.rids, msg.deltas, msg.new_ids, msg.finished, msg.finish_reasons, msg.cached_tokens,
                    msg.logprobs or itertools.repeat(None), msg.spec or itertools.repeat(None),
                ):
                    st = self.states.get(rid)
                    if st is not None and not st.finished:
                        self._deliver(st, delta, ids, finished, reason, cached, logprobs, spec)
            elif isinstance(msg, RpcResp):
                fut = self.rpcs.get(msg.rpc_id)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    def _deliver(self, st: ReqState, text: str, ids: list[int], finished: bool, reason: dict[str, Any] | None,
                 cached: int, logprobs: dict[str, list[Any]] | None = None,
                 spec: dict[str, Any] | None = None) -> None:
        now = time.perf_counter()
        st.completion_tokens += len(ids)
        if ids:
            st.last_time = now
        e2e = now - st.created
        m, track = self.metrics, st.track
        if m is not None and track is not None:
            m.on_output(track, len(ids), cached, now)
        if finished:
            st.finished = True
            if m is not None and track is not None:
                m.end(track, aborted=bool(reason and reason.get("type") == "abort"), now=now)
        st.queue.put_nowait((st.index, Chunk(text, list(ids), finished, reason, cached, st.completion_tokens,
                                             st.prompt_tokens, st.rid, e2e, logprobs, spec)))
