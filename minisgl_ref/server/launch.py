"""Starting, supervising and stopping the server's processes (chapter 10).

The life of ``python -m minisgl_ref serve``:

1. **Start.** Resolve the model folder (converting the embedded model once, here, before two children race to
   do it), then spawn the scheduler and the detokenizer with ``multiprocessing``'s *spawn* method (a fresh
   interpreter: forking a process that may hold CUDA state or threads is unsafe). While they load, the parent
   loads its own tokenizer. Each child reports on a pipe when it is ready, or why it failed. Only then is the
   HTTP port opened, so a client never talks to a server whose model is still loading.
2. **Serve.** uvicorn runs the FastAPI app on an asyncio loop; next to it, the tokenizer manager's receive
   task and a watchdog that checks the children every 200 ms. The loop is uvloop's and the HTTP parser
   httptools' where they are installed (both are C): every streamed token is an event that passes through
   this one process, and they cut its CPU time per event (chapter 11 measures it).
3. **Stop.** Ctrl-C or SIGTERM: uvicorn finishes (open streams get a few seconds), then every child is sent
   SIGTERM, joined, and killed if it lingers. If a *child* dies instead, the watchdog fails every request in
   flight, ``/health`` and new requests answer 503 naming the dead process for a short grace period, and then
   the server stops the rest and exits with status 1, so a supervisor (systemd, Kubernetes) restarts it rather
   than leaving a server that accepts connections and never answers. A scheduler that is alive but stuck inside
   one step turns ``/health`` to 503 too, while it lasts (:mod:`~minisgl_ref.server.watchdog`).

Children also watch their parent: if it is killed outright (SIGKILL, where no cleanup can run) they notice that
they were re-parented and exit on their own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
from collections.abc import Coroutine
from typing import Any

from minisgl_ref.server.args import Addresses, ServerArgs
from minisgl_ref.server.process_utils import configure_logging
from minisgl_ref.server.watchdog import LoopClock

log = logging.getLogger("minisgl_ref.server")

try:  # uvicorn's fast HTTP/1.1 parser, when installed; otherwise the pure-Python h11
    import httptools  # noqa: F401

    HTTP_PARSER = "httptools"
except ImportError:
    HTTP_PARSER = "h11"


def _run_event_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run the HTTP server's coroutine on uvloop when it is installed (a libuv loop in C), else on asyncio's."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


WATCHDOG_PERIOD_S = 0.2
CHILD_STOP_TIMEOUT_S = 5.0


class Launcher:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.addrs = Addresses.fresh()
        self.procs: dict[str, Any] = {}
        self.ready_conns: dict[str, Any] = {}
        self.last_words: dict[str, str] = {}  # name -> why a dead child stopped, if it said (see dead_child)
        self.exit_code = 0
        self.stop_signal: int | None = None
        self.uvicorn_server: Any = None
        self.clock: LoopClock | None = None

    # ------------------------------------------------------------------------------------------------- main

    def run(self) -> int:
        configure_logging(self.args.log_level, "server")
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            from minisgl_ref.models.loader import resolve_model_path
            from minisgl_ref.server.detokenizer_process import load_tokenizer

            resolve_model_path(self.args.model.model_path, self.args.model.load_format)  # fail fast; convert once
            self._start_children()
            if self.args.tp.node_rank > 0:
                return self._follow_node()  # another machine's ranks of a multi-node group: no HTTP here
            tokenizer = load_tokenizer(self.args)
            info = self._wait_until_ready()
            if info is None:
                return 0  # stopped by a signal while loading
            if self.args.shell:
                from minisgl_ref.server.shell import run_shell

                return run_shell(self, info, tokenizer)
            _run_event_loop(self._serve_http(info, tokenizer))
            return self.exit_code
        finally:
            self.stop_children()
            shutil.rmtree(self.addrs.folder, ignore_errors=True)
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: Any) -> None:
        if self.stop_signal is not None:
            raise KeyboardInterrupt  # a second Ctrl-C: stop waiting for anything
        self.stop_signal = sig
        log.info("received %s, shutting down", signal.Signals(sig).name)

    # -------------------------------------------------------------------------------------------- children

    def _start_children(self) -> None:
        from minisgl_ref.distributed.group import DistConfig
        from minisgl_ref.server.detokenizer_process import run_detokenizer_process
        from minisgl_ref.server.scheduler_process import run_scheduler_process

        ctx = mp.get_context("spawn")
        # One scheduler per tensor-parallel rank of this node (chapter 09); rank 0's is "scheduler", and only
        # node 0 runs the detokenizer (and, in the parent, the HTTP server).
        dist_cfg = DistConfig.of(self.args.tp)
        if self.args.tp.tp_size > 1 and self.args.tp.dist_init_addr is None:
            self.args.tp = dataclasses.replace(self.args.tp, dist_init_addr=dist_cfg.with_free_port().dist_init_addr)
        self.clock = LoopClock(ctx)  # when rank 0's loop last came round (watchdog.py)
        targets: dict[str, tuple[Any, tuple[Any, ...]]] = {
            ("scheduler" if rank == 0 else f"scheduler-tp{rank}"): (run_scheduler_process,
                                                                    (rank, self.clock if rank == 0 else None))
            for rank in dist_cfg.node_ranks()
        }
        if self.args.tp.node_rank == 0:
            targets["detokenizer"] = (run_detokenizer_process, ())
        for name, (target, extra) in targets.items():
            receiver, sender = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=target, args=(self.args, self.addrs, sender, *extra), name=f"minisgl-{name}",
                               daemon=True)
            proc.start()
            sender.close()  # the child holds the only writer: EOF here means it died before reporting
            self.procs[name] = proc
            self.ready_conns[name] = receiver
        log.info("started %s", ", ".join(f"{n} (pid {p.pid})" for n, p in self.procs.items()))

    def _wait_until_ready(self) -> dict[str, Any] | None:
        infos: dict[str, dict[str, Any]] = {}
        while len(infos) < len(self.procs):
            if self.stop_signal is not None:
                return None
            for name, conn in self.ready_conns.items():
                if name in infos or not conn.poll(0.1):
                    continue
                try:
                    payload = conn.recv()
                except EOFError:
                    payload = {"error": f"exited with code {self._exitcode(name)} while starting"}
                if "error" in payload:
                    raise ValueError(f"the {name} process failed to start: {payload['error']}")
                infos[name] = payload["ok"]
        info = dict(infos.get("scheduler", {}))  # a node_rank > 0 node has no rank 0
        info["pids"] = {name: p.pid for name, p in self.procs.items()} | {"server": os.getpid()}
        return info

    def _follow_node(self) -> int:
        """A node other than 0 of a multi-node group: its schedulers follow rank 0 (on node 0) until it stops."""
        import time

        if self._wait_until_ready() is None:
            return 0
        log.info("ranks %s ready; following node 0 at %s", list(self.procs), self.args.tp.dist_init_addr)
        while self.stop_signal is None:
            dead = self.dead_child()
            if dead is not None:
                return 0 if all(p.exitcode == 0 for p in self.procs.values()) else 1
            time.sleep(WATCHDOG_PERIOD_S)
        return 0

    def _exitcode(self, name: str) -> int | None:
        self.procs[name].join(1.0)
        return self.procs[name].exitcode

    def dead_child(self) -> str | None:
        for name, proc in self.procs.items():
            if not proc.is_alive():
                return f"the {name} process (pid {proc.pid}) exited with code {proc.exitcode}{self._last_words(name)}"
        return None

    def _last_words(self, name: str) -> str:
        """What a child that kept its startup pipe open said about why it stopped (a tensor-parallel follower
        does), as ``": reason"``; remembered, since the watchdog asks more than once."""
        if name not in self.last_words:
            conn, words = self.ready_conns.get(name), ""
            try:
                if conn is not None and not conn.closed and conn.poll(0):
                    msg = conn.recv()
                    words = f": {msg['error']}" if isinstance(msg, dict) and "error" in msg else ""
            except (EOFError, OSError):
                pass
            self.last_words[name] = words
        return self.last_words[name]

    def stop_children(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs.values():
            proc.join(CHILD_STOP_TIMEOUT_S)
            if proc.is_alive():
                log.warning("%s did not stop on SIGTERM; killing it", proc.name)
                proc.kill()
                proc.join(CHILD_STOP_TIMEOUT_S)
        for conn in self.ready_conns.values():
            conn.close()

    # ---------------------------------------------------------------------------------------------- serving

    def make_manager(self, info: dict[str, Any], tokenizer: Any) -> Any:
        from minisgl_ref.server.metrics import ServerMetrics
        from minisgl_ref.server.tokenizer_manager import TokenizerManager

        metrics = ServerMetrics(self.model_name) if self.args.enable_metrics else None
        manager = TokenizerManager(self.args, self.addrs, info, tokenizer, metrics)
        clock, timeout = self.clock, self.args.watchdog_timeout
        if clock is not None:
            manager.step_stuck = lambda: clock.stuck(timeout)
        manager.start()
        return manager

    @property
    def model_name(self) -> str:
        from minisgl_ref.models.embedded import EMBEDDED_NAME

        return self.args.served_model_name or self.args.model.model_path or EMBEDDED_NAME

    async def watchdog(self, manager: Any, on_dead: Any) -> None:
        stuck_since: float | None = None  # when the current stuck step was first seen, for the logs
        while True:
            await asyncio.sleep(WATCHDOG_PERIOD_S)
            stuck = manager.step_stuck()
            if stuck is not None and stuck_since is None:
                stuck_since = asyncio.get_running_loop().time()
                log.error("%s: /health answers 503 until it ends", stuck)
            elif stuck is None and stuck_since is not None:
                log.warning("the stuck engine step has ended (%.1f s after it was reported); /health is 200 again",
                            asyncio.get_running_loop().time() - stuck_since)
                stuck_since = None
            reason = self.dead_child() or manager.dead
            if reason is None:
                continue
            log.error("%s; failing all requests and shutting down in %.1f s", reason, self.args.dead_child_grace_s)
            self.exit_code = 1
            manager.mark_dead(reason)
            await asyncio.sleep(self.args.dead_child_grace_s)
            on_dead()
            return

    async def _serve_http(self, info: dict[str, Any], tokenizer: Any) -> None:
        import uvicorn

        from minisgl_ref.server.http_server import create_app
        from minisgl_ref.server.responses import router as responses_router

        manager = self.make_manager(info, tokenizer)
        app = create_app(manager, self.args, self.model_name)
        app.include_router(responses_router)  # /v1/responses, built on the chat route's code (server/responses.py)
        config = uvicorn.Config(
            app, host=self.args.host, port=self.args.port, log_level=self.args.log_level, http=HTTP_PARSER,
            access_log=self.args.log_level == "debug", lifespan="off", timeout_graceful_shutdown=3,
        )
        server = self.uvicorn_server = uvicorn.Server(config)

        def stop() -> None:
            server.should_exit = True

        watchdog = asyncio.get_running_loop().create_task(self.watchdog(manager, stop))
        announce = asyncio.get_running_loop().create_task(self._announce(server))
        try:
            if self.stop_signal is None:
                await server.serve()
        finally:
            watchdog.cancel()
            announce.cancel()
            manager.close()

    async def _announce(self, server: Any) -> None:
        while not server.started:
            await asyncio.sleep(0.05)
        log.info("ready: model %r on http://%s:%d (OpenAI API at /v1, native at /generate)", self.model_name,
                 self.args.host, self.args.port)
        print(f"The server is ready: http://{self.args.host}:{self.args.port}", file=sys.stderr, flush=True)


def run_server(args: ServerArgs) -> int:
    if args.dp_size > 1:  # N copies of this server behind SGLang's router
        from minisgl_ref.server.data_parallel import run_data_parallel

        return run_data_parallel(args)
    return Launcher(args).run()
