"""The scheduler process: the engine in a loop, fed and drained over ZeroMQ (chapter 10).

One scheduler runs per tensor-parallel rank; rank 0's (this class) talks to the other processes,
ranks 1..N-1 only replay its steps (chapter 09). Its loop is the whole server's heartbeat::

    while True:
        take every message waiting on the socket      (block only when the engine has nothing to do)
        handle them: new requests, aborts, RPCs
        engine.step()                                 (one batch: prefill or decode)
        send one BatchTokenOut with each advanced request's new token ids

Never blocking while there is work is what keeps continuous batching continuous: a request that arrives while a
decode batch runs joins at the next step instead of waiting for the batch to drain.

**Where the stop rules live.** A request ends on EOS / a stop token id, on its length limit, or on a stop string.
The first two only need token ids. Stop strings need text, and the engine must know *at once* (to stop spending
compute and free the KV), so a request with stop strings gets an :class:`IncrementalDetokenizer` here, and
``Req.append_token`` applies every stop rule in one place, exactly as in the offline ``LLM``. A request without
stop strings gets none: the scheduler's hot loop then never decodes text. The detokenizer process runs its own
``IncrementalDetokenizer`` on the same ids with the same stop strings; both are deterministic functions of the
ids, so they agree on where the text ends, and the detokenizer only has to be told which token (an EOS or stop
id) is not part of the text. The price is decoding stop-string requests twice; SGLang pays the same (its
scheduler decodes a tail of each request to check stop strings, its detokenizer decodes for the client).
"""

from __future__ import annotations

import logging
import shutil
import time
from typing import Any

import zmq

from minisgl_ref import env
from minisgl_ref.bench.step_trace import StepTrace
from minisgl_ref.core.request import FinishReason, LogprobRequest, Req
from minisgl_ref.engine.engine import Engine
from minisgl_ref.runtime import Runtime, build_runtime
from minisgl_ref.sampling.params import SamplingParams
from minisgl_ref.server.args import Addresses, ServerArgs
from minisgl_ref.server.messages import (
    AbortReq,
    BatchTokenOut,
    GenerateReqInput,
    RpcReq,
    RpcResp,
    decode,
    encode,
)
from minisgl_ref.server.process_utils import child_process_setup, report_ready
from minisgl_ref.server.watchdog import LoopClock, LoopWatch, start_stuck_step_logger
from minisgl_ref.speculative.extension import SpeculativeExtension
from minisgl_ref.tokenizer import IncrementalDetokenizer

# Prompt ids the detokenizer gets as context for the first output token (IncrementalDetokenizer looks at most
# PROMPT_CONTEXT_TOKENS + MAX_CONTEXT_BACKOFF = 13 back).
PROMPT_TAIL = 16
IDLE_POLL_MS = 200  # how long an idle scheduler sleeps on its socket before checking that its parent lives
log = logging.getLogger("minisgl_ref.scheduler")


class SchedulerWorker:
    def __init__(self, rt: Runtime, addrs: Addresses, clock: LoopClock | None = None) -> None:
        # The runtime is built exactly as the offline LLM builds its own (build_runtime), so an HTTP request and
        # an LLM.generate call with the same settings run the very same engine code.
        self.rt = rt
        self.engine = rt.engine
        # Speculative decoding (chapter 13), if this engine has it: its per-request figures go into meta_info.
        self.spec = rt.engine.extensions.find(SpeculativeExtension) if isinstance(rt.engine, Engine) else None
        assert isinstance(self.engine, Engine)
        self.reqs: dict[str, Any] = {}  # rid -> Req, while the engine has it
        self.sent: dict[str, int] = {}  # rid -> output ids already sent on
        self.sent_logprobs: dict[str, tuple[int, int]] = {}  # rid -> (input, output) logprob entries sent
        self.announced: set[str] = set()  # rids whose first row (with the detokenizer's init) went out
        self.ctx = zmq.Context()
        self.recv = self.ctx.socket(zmq.PULL)
        self.recv.bind(addrs.scheduler)
        self.to_detok = self.ctx.socket(zmq.PUSH)
        self.to_detok.connect(addrs.detokenizer)
        self.to_api = self.ctx.socket(zmq.PUSH)
        self.to_api.connect(addrs.api)
        self.watch = LoopWatch(clock)  # the parent's life, and each turn's start for the watchdog (watchdog.py)

    def info(self) -> dict[str, Any]:
        cfg = self.rt.model_config
        return {
            "model_path": str(self.rt.model_path) if self.rt.model_path else None,
            "architecture": cfg.architecture,
            "context_length": self.rt.context_length,
            "vocab_size": cfg.vocab_size,
            "dtype": str(cfg.dtype).removeprefix("torch."),
            "device": str(self.rt.device),
            "max_total_num_tokens": self.engine.max_total_tokens,
            "max_running_requests": self.engine.config.max_running_requests,
            "page_size": self.engine.config.page_size,
            "has_tokenizer": self.rt.tokenizer is not None,
        }

    # ---------------------------------------------------------------------------------------------------- loop

    def run(self) -> None:
        """The scheduler's loop: receive, step, send, until the parent process is gone (``self.watch.alive()``
        turns False).

        Each turn of the loop:

        1. **Receive.** Take every message waiting on ``self.recv`` (:meth:`_drain_messages`) and send on the
           rows that handling them produced (requests answered at once: ``max_new_tokens=0`` without prompt log
           probabilities, refusals, aborts) with :meth:`_send_rows`. While the engine has work
           (``self.engine.has_work``) never wait for a message: take what is there and go on to the step, or every
           running stream would stall. With no work, sleep on the socket, ``poller.poll(IDLE_POLL_MS)`` (a
           timeout, so that a dead parent is noticed), and drain only if something arrived.
        2. **Step.** If the engine has work, run one ``self.engine.step()`` and send the rows of its events
           (:meth:`_rows_for`). A step that raises must not end the loop (the process, and with it the server,
           would die): log it with ``log.exception`` and abort everything in flight with
           ``self.engine.abort_all(f"the engine failed: {type(e).__name__}: {e}")``, whose events are sent like a
           step's."""
        poller = zmq.Poller()
        poller.register(self.recv, zmq.POLLIN)
        # BEGIN TASK 10.2: the scheduler loop: receive, step, send
        while self.watch.alive():
            if self.engine.has_work or poller.poll(IDLE_POLL_MS):
                rows = self._drain_messages()
                self._send_rows(rows)
            if self.engine.has_work:
                try:
                    events = self.engine.step()
                except Exception as e:  # noqa: BLE001 - the engine contains per-request failures itself;
                    # this is the last line: fail what is in flight, keep the process (and the server) alive
                    log.exception("an engine step failed; aborting every request in flight")
                    events = self.engine.abort_all(f"the engine failed: {type(e).__name__}: {e}")
                self._send_rows(self._rows_for(events))
        # END TASK 10.2

    def _drain_messages(self) -> list[tuple[Any, list[int], bool]]:
        """Take every message waiting on ``self.recv`` without blocking (``self.recv.recv(zmq.NOBLOCK)`` raises
        ``zmq.Again`` once none is left), :func:`decode` each one and hand it to its handler: :meth:`_add` for a
        :class:`GenerateReqInput`, :meth:`_abort` for an :class:`AbortReq`, :meth:`_rpc` for an :class:`RpcReq`.
        The first two append rows to send, ``(req, new_ids, finished)``, to the list they are given; return that
        list. Every waiting message, not just one: requests that arrived together must all enter the engine before
        its next step, or they would be prefilled in separate steps."""
        # BEGIN TASK 10.2: the scheduler loop: receive, step, send
        rows: list[tuple[Any, list[int], bool]] = []
        while True:
            try:
                data = self.recv.recv(zmq.NOBLOCK)
            except zmq.Again:
                return rows
            msg = decode(data)
            if isinstance(msg, GenerateReqInput):
                self._add(msg, rows)
            elif isinstance(msg, AbortReq):
                self._abort(msg.rid, rows)
            elif isinstance(msg, RpcReq):
                self._rpc(msg)
        # END TASK 10.2

    # ------------------------------------------------------------------------------------------------ handlers

    def _add(self, msg: GenerateReqInput, rows: list) -> None:
        try:
            params = SamplingParams.from_dict(msg.sampling_params)
            detok = None
            if (params.stop or params.stop_regex) and self.rt.tokenizer is not None:
                detok = IncrementalDetokenizer(self.rt.tokenizer, skip_special_tokens=params.skip_special_tokens,
                                               stop=params.stop, stop_regex=params.stop_regex,
                                               prompt_ids=msg.input_ids)
            req = Req(input_ids=list(msg.input_ids), params=params, eos_token_ids=self.rt.eos_token_ids,
                      detokenizer=detok, context_len=self.rt.context_length, rid=msg.rid,
                      cache_salt=msg.cache_salt,
                      logprobs=LogprobRequest.asked(msg.return_logprob, msg.top_logprobs_num, msg.logprob_start_len))
            self.engine.add_request(req)  # raises ValueError for a request this model cannot run
        except (ValueError, TypeError) as e:
            # The API server validates first, so this is a bug or a race; answer rather than leave it hanging.
            self._refuse(msg.rid, str(e))
            return
        self.reqs[req.rid] = req
        self.sent[req.rid] = 0
        if req.finished:
            # max_new_tokens == 0 with no prompt log probabilities to compute (a prefill-only request runs its
            # prefill first: Req.prefill_only), or refused at the door (a prompt bigger than the whole pool). The
            # engine reports the latter again at its next step; by then the rid is gone and that event is ignored.
            rows.append((req, [], True))

    def _abort(self, rid: str, rows: list) -> None:
        req = self.reqs.get(rid)
        if req is None or req.finished:
            return  # already done: the abort crossed the last output on the wire
        self.engine.abort(req, "aborted by the client")  # frees wait for any step in flight (the engine decides)
        rows.append((req, [], True))

    def _rpc(self, msg: RpcReq) -> None:
        try:
            if msg.method == "get_stats":
                resp = RpcResp(msg.rpc_id, True, self.stats())
            elif msg.method == "flush_cache":
                ok = self.engine.flush_cache()
                resp = RpcResp(msg.rpc_id, ok, "Cache flushed." if ok else
                               "the cache was not flushed: requests are running or waiting")
            else:
                resp = RpcResp(msg.rpc_id, False, f"unknown rpc {msg.method!r}")
        except Exception as e:  # noqa: BLE001 - report, do not die
            resp = RpcResp(msg.rpc_id, False, f"{type(e).__name__}: {e}")
        self.to_api.send(encode(resp))

    def describe(self) -> str:
        """What the engine holds, in one line (for the stuck-step log)."""
        sched = self.engine.scheduler
        return (f"{self.engine.stats.steps} steps done, {len(sched.running)} running, {len(sched.waiting)} waiting, "
                f"a step in flight: {self.engine.inflight is not None}, {len(self.reqs)} requests tracked")

    def stats(self) -> dict[str, Any]:
        engine, sched, cache = self.engine, self.engine.scheduler, self.engine.cache
        total = engine.max_total_tokens
        available = cache.available_tokens
        return {
            "num_running_reqs": len(sched.running) + (sched.chunked is not None),
            "num_queue_reqs": len(sched.waiting),
            "max_total_num_tokens": total,
            "available_kv_tokens": available,  # free slots + slots eviction could free (cached, unpinned)
            "free_kv_tokens": cache.allocator.num_free_tokens,
            "evictable_kv_tokens": cache.evictable_tokens,
            "token_usage": round((total - available) / total, 6) if total else 0.0,
            "cache_hit_rate": float(cache.hit_rate) if cache.shares_prefixes else 0.0,
            "num_retractions": sched.num_retractions,
            "engine_steps": engine.stats.steps,
            "prefill_tokens": engine.stats.prefill_tokens,
            "decode_tokens": engine.stats.decode_tokens,
            "num_tracked_reqs": len(self.reqs),
            "spec_verify_ct": self.spec.verify_ct if self.spec else 0,  # verify rows so far, and the tokens they
            "spec_appended_tokens": self.spec.appended_tokens if self.spec else 0,  # appended (chapter 13)
        }

    # ------------------------------------------------------------------------------------------------- outputs

    def _rows_for(self, events: list) -> list[tuple[Any, list[int], bool]]:
        """One row ``(req, new_ids, finished)`` per event of a step (``event.req``), in order, for the requests
        this loop still tracks (``self.reqs``, keyed by rid). An event for any other request is skipped: its final
        row has gone out already (an abort, or a request finished at the door that the engine reports once more).
        ``self.sent[rid]`` counts the output ids already sent on (:meth:`_send_rows` advances it), so ``new_ids``
        are the ids of ``req.output_ids`` after those (each id is sent exactly once), and ``finished`` is
        ``req.finished``."""
        # BEGIN TASK 10.2: the scheduler loop: receive, step, send
        rows = []
        for ev in events:
            req = ev.req
            if req.rid not in self.reqs:
                continue
            start = self.sent[req.rid]
            rows.append((req, list(req.output_ids[start:]), req.finished))
        return rows
        # END TASK 10.2

    def _send_rows(self, rows: list[tuple[Any, list[int], bool]]) -> None:
        if not rows:
            return
        out = BatchTokenOut([], [], [], [], [], [], [], [])
        for req, new_ids, finished in rows:
            rid = req.rid
            if rid in self.sent:
                self.sent[rid] += len(new_ids)
            first = rid not in self.announced
            self.announced.add(rid)
            out.rids.append(rid)
            out.new_ids.append(new_ids)
            out.finished.append(finished)
            out.finish_reasons.append(req.finish_reason.to_dict() if finished else None)
            out.cached_tokens.append(req.cached_tokens)
            out.logprobs.append(self._new_logprobs(req.rid, req.logprobs) if req.logprobs is not None else None)
            out.spec.append(self._spec_info(rid, finished))
            out.inits.append({
                "stop": list(req.params.stop),
                "stop_regex": list(req.params.stop_regex),
                "skip_special_tokens": req.params.skip_special_tokens,
                "prompt_tail": list(req.input_ids[-PROMPT_TAIL:]),
            } if first else None)
            if finished:
                self.reqs.pop(rid, None)
                self.sent.pop(rid, None)
                self.sent_logprobs.pop(rid, None)
                self.announced.discard(rid)
        if not any(out.logprobs):
            out.logprobs = None
        if not any(out.spec):
            out.spec = None
        self.to_detok.send(encode(out))

    def _refuse(self, rid: str, message: str) -> None:
        """Answer a request that never entered the engine: one final row of its own, with no tokens."""
        init = {"stop": [], "stop_regex": [], "skip_special_tokens": True, "prompt_tail": []}
        reason = FinishReason("abort", message=message).to_dict()
        self.to_detok.send(encode(BatchTokenOut([rid], [[]], [True], [reason], [0], [init])))

    def _spec_info(self, rid: str, finished: bool) -> dict[str, Any] | None:
        """SGLang's per-request speculation figures for ``meta_info`` (None for a request that verified no
        draft); the extension forgets them with the request's last row."""
        if self.spec is None:
            return None
        stats = self.spec.pop_stats(rid) if finished else self.spec.stats.get(rid)
        if stats is None:
            return None
        return {"spec_verify_ct": stats.verify_ct, "spec_accept_length": round(stats.accept_length, 6),
                "spec_accept_token_num": stats.accepted_tokens, "spec_draft_token_num": stats.draft_tokens}

    def _new_logprobs(self, rid: str, logprobs: LogprobRequest) -> dict[str, Any]:
        """The log-probability entries request ``rid`` gained since its last row."""
        n_in, n_out = self.sent_logprobs.get(rid, (0, 0))
        self.sent_logprobs[rid] = (len(logprobs.prompt), len(logprobs.output))
        return {"input": [[e.logprob, [list(t) for t in e.top]] for e in logprobs.prompt[n_in:]],
                "output": [[e.logprob, [list(t) for t in e.top]] for e in logprobs.output[n_out:]]}

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def run_follower_rank(rt: Runtime, args: ServerArgs, log: Any, parent_conn: Any = None) -> None:
    """Ranks 1..N-1 (chapter 09): no sockets, no outputs. Replay rank 0's steps (broadcast to us at the top of
    each of its steps) until rank 0 stops or dies.

    A collective that fails with a plain ``RuntimeError`` means rank 0 went away (its sockets closed): nothing
    left to follow. Any other error is this rank's own failure: it is logged, sent to the launcher on
    ``parent_conn`` (which names it when it reports this process's death) and ends the process with status 1."""
    log.info("ready: tensor-parallel rank %d of %d on %s", rt.tp_rank, args.tp.tp_size, rt.device)
    try:
        rt.follow()
    except Exception as e:  # noqa: BLE001 - sorted below
        if type(e) is RuntimeError:
            log.info("stopping: %s", e)
            return
        log.exception("tensor-parallel rank %d failed", rt.tp_rank)
        if parent_conn is not None:
            report_ready(parent_conn, {"error": f"rank {rt.tp_rank}: {type(e).__name__}: {e}"})
        raise SystemExit(1) from e
    finally:
        if parent_conn is not None and not parent_conn.closed:
            parent_conn.close()


def run_scheduler_process(args: ServerArgs, addrs: Addresses, ready_conn: Any, tp_rank: int = 0,
                          clock: LoopClock | None = None) -> None:
    """The child process's entry point (``multiprocessing`` spawn target): build this rank's runtime, then run
    the scheduler loop (rank 0) or follow rank 0 (the others). ``clock`` (rank 0) tells the API server when the
    loop last came round (:mod:`~minisgl_ref.server.watchdog`)."""
    log = child_process_setup(args.log_level, f"scheduler TP{tp_rank}")
    try:
        import torch

        from minisgl_ref.tp.group import TPGroup

        if (args.model.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cpu"):
            torch.set_num_threads(env.cpu_threads(spare=1))  # one core for the API server and the detokenizer
        group = TPGroup.member(args.tp, tp_rank) if args.tp.enabled else None
        rt = build_runtime(args.model, args.engine, args.tp, group=group, speculative=args.speculative)
        worker = SchedulerWorker(rt, addrs, clock) if tp_rank == 0 else None
        trace = StepTrace(args.step_log) if worker is not None and args.step_log else None
        if worker is not None and trace is not None:
            worker.engine.extensions.attach(trace)  # a line per step, written as each is processed
    except Exception as e:  # noqa: BLE001 - the parent prints this one line and exits
        report_ready(ready_conn, {"error": f"{type(e).__name__}: {e}"})
        return
    if worker is None:
        report_ready(ready_conn, {"ok": {"tp_rank": tp_rank, "device": str(rt.device)}}, close=False)
        return run_follower_rank(rt, args, log, ready_conn)
    t0 = time.perf_counter()
    if clock is not None:
        start_stuck_step_logger(clock, args.watchdog_timeout, worker.describe, log)
    report_ready(ready_conn, {"ok": worker.info()}, close=False)
    log.info("ready: %s", worker.info())
    try:
        worker.run()
    except Exception as e:
        # The loop itself failed (it contains engine failures, so this is a bug in the loop): its last words
        # go to the launcher, which names them when it reports this process's death.
        report_ready(ready_conn, {"error": f"{type(e).__name__}: {e}"})
        raise
    finally:
        if not ready_conn.closed:
            ready_conn.close()
        if not worker.watch.alive():  # orphaned (the parent was killed outright): clean up its socket folder
            shutil.rmtree(addrs.folder, ignore_errors=True)
        log.info("stopping after %.0f s", time.perf_counter() - t0)
        worker.close()
        if trace is not None:
            trace.close()
        rt.shutdown()  # tensor parallelism: tell the other ranks to stop, and leave the group
