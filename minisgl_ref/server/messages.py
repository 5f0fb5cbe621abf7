"""The messages the server's processes send each other over ZeroMQ (chapter 10).

Each message is a small dataclass. On the wire it is ``msgpack([class name, [field values in order]])``: no
pickle (a process should never execute what another sends it), no field names (they cost bytes on every step),
and only plain types (ints, strings, lists, dicts), which is all a request needs once its text is token ids.

Who sends what::

    API server  ── GenerateReqInput, AbortReq, RpcReq ──>  scheduler
    scheduler   ── BatchTokenOut ──────────────────────>  detokenizer
    detokenizer ── BatchStrOut ────────────────────────>  API server
    scheduler   ── RpcResp ────────────────────────────>  API server

Outputs are *batched*: one message per engine step carries a row for every request that advanced, so the
per-message cost is paid once per step rather than once per token.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import msgpack


@dataclass
class GenerateReqInput:
    """A tokenized request. ``sampling_params`` is :meth:`SamplingParams.to_dict`, already validated."""

    rid: str
    input_ids: list[int]
    sampling_params: dict[str, Any]
    cache_salt: str | None = None  # requests with different salts never share cached prefixes
    return_logprob: bool = False  # and the two below: SGLang's flat fields, Req.logprobs once built (chapter 10)
    top_logprobs_num: int = 0
    logprob_start_len: int = -1


@dataclass
class AbortReq:
    """Stop ``rid`` wherever it is and free its KV (the client went away)."""

    rid: str


@dataclass
class RpcReq:
    """A control call answered by the scheduler: ``get_stats`` or ``flush_cache``."""

    rpc_id: int
    method: str


@dataclass
class RpcResp:
    rpc_id: int
    ok: bool
    result: Any


@dataclass
class BatchTokenOut:
    """One engine step's news, one row per request: the token ids it gained, and whether (and why) it ended.

    ``inits[i]`` is set on a request's first row only: what the detokenizer needs to decode it (the stop strings,
    ``skip_special_tokens``, and the last few prompt ids as context for the first output token).
    """

    rids: list[str]
    new_ids: list[list[int]]
    finished: list[bool]
    finish_reasons: list[dict[str, Any] | None]
    cached_tokens: list[int]
    inits: list[dict[str, Any] | None]
    # Per row, for requests that asked for log probabilities: the entries computed since the last row, as
    # ``{"input": [...], "output": [...]}`` with each entry ``[logprob, [[token id, logprob], ...]]``.
    # None when no row has any.
    logprobs: list[dict[str, Any] | None] | None = None
    # Per row, for requests that verified drafts (speculative decoding, chapter 13): SGLang's ``meta_info``
    # figures so far (``spec_verify_ct``, ``spec_accept_length``, ...). None when no row has any.
    spec: list[dict[str, Any] | None] | None = None


@dataclass
class BatchStrOut:
    """The same rows with the text each one added (``deltas``), ready to stream."""

    rids: list[str]
    deltas: list[str]
    new_ids: list[list[int]]
    finished: list[bool]
    finish_reasons: list[dict[str, Any] | None]
    cached_tokens: list[int]
    logprobs: list[dict[str, Any] | None] | None = None
    spec: list[dict[str, Any] | None] | None = None


_TYPES: dict[str, type] = {
    cls.__name__: cls for cls in (GenerateReqInput, AbortReq, RpcReq, RpcResp, BatchTokenOut, BatchStrOut)
}


def encode(msg: Any) -> bytes:
    name = type(msg).__name__
    if name not in _TYPES:
        raise TypeError(f"{name} is not a server message")
    return msgpack.packb([name, [getattr(msg, f.name) for f in fields(msg)]])


def decode(data: bytes) -> Any:
    name, values = msgpack.unpackb(data, strict_map_key=False)
    return _TYPES[name](*values)
