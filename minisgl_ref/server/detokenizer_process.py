"""The detokenizer process: token ids in, streamable text out (chapter 10).

It keeps one :class:`IncrementalDetokenizer` (chapter 02) per live request, created from the ``init`` that rides
on the request's first row, and forwards every row to the API server with the text it added. Doing this in its
own process keeps text decoding off the scheduler's loop (the device would wait for the CPU otherwise) and off
the API server's event loop (every HTTP connection would wait).

The one rule it must share with the scheduler: a row that *finished on a stop token id* (EOS, ``<|im_end|>``,
a ``stop_token_ids`` entry) carries that token in its ids but not in its text, exactly as ``Req.append_token``
does offline. Stop *strings* need no message at all: this detokenizer was given the same stop strings, so it
stops at the same place.
"""

from __future__ import annotations

import shutil
from typing import Any

import zmq

from minisgl_ref.server.args import Addresses, ServerArgs
from minisgl_ref.server.messages import BatchStrOut, BatchTokenOut, decode, encode
from minisgl_ref.server.process_utils import ParentWatch, child_process_setup, report_ready

IDLE_POLL_MS = 500


class DetokenizerWorker:
    def __init__(self, args: ServerArgs, addrs: Addresses, tokenizer: Any) -> None:
        self.tokenizer = tokenizer  # None for a model without tokenizer files: ids only, empty text
        self.states: dict[str, Any] = {}  # rid -> IncrementalDetokenizer
        self.ctx = zmq.Context()
        self.recv = self.ctx.socket(zmq.PULL)
        self.recv.bind(addrs.detokenizer)
        self.send = self.ctx.socket(zmq.PUSH)
        self.send.connect(addrs.api)
        self.watch = ParentWatch()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.recv, zmq.POLLIN)
        while self.watch.alive():
            if not poller.poll(IDLE_POLL_MS):
                continue
            while True:
                try:
                    data = self.recv.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = decode(data)
                if isinstance(msg, BatchTokenOut):
                    self.send.send(encode(self.process(msg)))

    def process(self, batch: BatchTokenOut) -> BatchStrOut:
        deltas = []
        for rid, ids, finished, reason, init in zip(
            batch.rids, batch.new_ids, batch.finished, batch.finish_reasons, batch.inits
        ):
            detok = self.states.get(rid)
            if detok is None and init is not None and self.tokenizer is not None:
                from minisgl_ref.tokenizer import IncrementalDetokenizer

                detok = self.states[rid] = IncrementalDetokenizer(
                    self.tokenizer, skip_special_tokens=init["skip_special_tokens"], stop=init["stop"],
                    stop_regex=init.get("stop_regex", ()),
                    prompt_ids=init["prompt_tail"],
                )
            if detok is None:
                deltas.append("")
                continue
            text_ids = ids
            if finished and reason and reason.get("type") == "stop" and isinstance(reason.get("matched"), int):
                text_ids = ids[:-1]  # the stop token ends the request but is not part of its text
            try:
                delta = detok.step(text_ids) if text_ids else ""
                if finished:
                    delta += detok.finish()
            except ValueError:  # a stop regex over its time limit: the scheduler ends this request with the
                delta = ""      # error; it must not end this process, which serves every request
                finished = True
            if finished:
                self.states.pop(rid, None)
            deltas.append(delta)
        return BatchStrOut(batch.rids, deltas, batch.new_ids, batch.finished, batch.finish_reasons,
                           batch.cached_tokens, batch.logprobs, batch.spec)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def load_tokenizer(args: ServerArgs) -> Any:
    """The model folder's tokenizer, or None when the folder has none (dummy weights, weights-only folders)."""
    if args.model.load_format == "dummy":
        return None
    from minisgl_ref.models.loader import resolve_model_path
    from minisgl_ref.tokenizer import Tokenizer

    return Tokenizer.find(resolve_model_path(args.model.model_path, args.model.load_format).path)


def run_detokenizer_process(args: ServerArgs, addrs: Addresses, ready_conn: Any) -> None:
    log = child_process_setup(args.log_level, "detokenizer")
    try:
        worker = DetokenizerWorker(args, addrs, load_tokenizer(args))
    except Exception as e:  # noqa: BLE001
        report_ready(ready_conn, {"error": f"{type(e).__name__}: {e}"})
        return
    report_ready(ready_conn, {"ok": {}})
    log.debug("ready")
    try:
        worker.run()
    finally:
        if not worker.watch.alive():  # orphaned (the parent was killed outright): clean up its socket folder
            shutil.rmtree(addrs.folder, ignore_errors=True)
        worker.close()
