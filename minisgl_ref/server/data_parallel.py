"""Data parallelism: N copies of the server behind SGLang's router (chapter 10).

``python -m minisgl_ref serve --dp-size N`` runs N complete, independent servers (each its own API server,
scheduler and detokenizer, each with the whole model and its own KV pool and radix cache) and puts SGLang's
router, the ``sglang-router`` package (a load balancer written in Rust), in front of them on ``--host/--port``.
Clients see one server; throughput grows with the number of copies, as long as there are devices (or cores) to
hold them. Tensor parallelism (chapter 09) splits *one* model over several devices to make each step faster or to
fit a model that is too big; data parallelism copies a model that already fits to serve more requests at once.
The two combine: ``--dp-size 2 --tp-size 2`` is two servers of two ranks each.

Why the router, and why its ``cache_aware`` policy. Each copy's radix cache (chapter 04) only helps the requests
that copy receives. A round-robin balancer sends the second request of a conversation, or the tenth request that
starts with the same long system prompt, to whichever copy is next in line, so every copy ends up prefilling
(and storing) the same prefix: it is computed N times instead of once. The ``cache_aware`` policy keeps, in the
router, an approximate radix tree per worker of the request *texts* it has sent there. For a new request it finds
the worker whose tree shares the longest prefix with it; if that match covers enough of the request (the
``--cache-threshold``, 30 % by default) the request goes there, since that worker very likely still holds the
prefix's KV. Otherwise it goes to the worker with the smallest tree, which spreads unrelated prefixes over the
copies. And if the copies' loads (requests in flight) drift too far apart, it stops chasing cache hits and picks
the least loaded worker until they even out. Requests that share a prefix thus land on the same worker, whose
radix cache hits, while different prefixes still fill all copies.

What this module does, in order:

1. pick a free loopback port per worker and start each worker as an ordinary ``python -m minisgl_ref serve``
   subprocess with the same model and engine flags (on a GPU machine, each on its own ``--tp-size`` GPUs; on a
   CPU, with the cores shared out through ``OMP_NUM_THREADS``);
2. wait until every worker answers ``/health``, then start ``python -m sglang_router.launch_router`` on the
   public address with those workers' URLs, and print one ready line once the router has registered them all;
3. supervise: if any child (a worker or the router) exits, stop the others and exit with status 1; on Ctrl-C or
   SIGTERM stop the router first (no new requests), then the workers, and exit with status 0.

The children are detached from the terminal (``start_new_session``), so a terminal's Ctrl-C reaches only this
launcher, which stops them in order; and each is asked (Linux ``PR_SET_PDEATHSIG``) to receive SIGTERM if the
launcher itself is killed outright, so no worker outlives it.

Two things a reader of the logs will see. Each worker prints its own "The server is ready" line for its private
port; the launcher's line that counts is "The router is ready" for the public one. And when the router registers
a worker it probes whether it speaks HTTP or gRPC; the gRPC probe shows up in the worker's log as a couple of
uvicorn "Invalid HTTP request received" warnings, which are harmless.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

from minisgl_ref.core.config import to_argv
from minisgl_ref.env import cpu_threads
from minisgl_ref.server.args import ServerArgs
from minisgl_ref.server.process_utils import configure_logging

log = logging.getLogger("minisgl_ref.data_parallel")

ROUTER_INSTALL = "pip install 'minisgl_ref[router]'"  # or: pip install sglang-router
POLL_S = 0.2
# a worker's own shutdown: uvicorn's grace period and its children's (or, while loading, the end of its tokenizer load)
STOP_TIMEOUT_S = 30.0
# ServerArgs fields that are not forwarded as worker flags: the public address and the DP size belong to the router,
# --shell is refused with DP, and the multi-node fields are refused too (see ServerArgs.from_cli).
NOT_FORWARDED = frozenset({"host", "port", "dp_size", "shell", "nnodes", "node_rank", "dist_init_addr"})
# our --log-level -> the router's, one step quieter: its "info" logs every step of every worker registration, and
# its "warn" notes at start-up that our workers lack SGLang's newer routes (it falls back to the older ones).
ROUTER_LOG_LEVEL = {"debug": "debug", "info": "warn", "warning": "error", "error": "error", "critical": "error"}


def check_router_installed() -> None:
    """Fail before anything starts (a ``ValueError`` is one ``error:`` line in the CLI) if the router is missing."""
    if importlib.util.find_spec("sglang_router") is None:
        raise ValueError(f"--dp-size > 1 needs SGLang's router (the sglang-router package): {ROUTER_INSTALL}")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def worker_command(args: ServerArgs, port: int) -> list[str]:
    """The ``serve`` command line of one worker: every model, engine and server flag of ``args`` (SGLang's flag
    names are the field names with dashes), on a private loopback port, without ``--dp-size``."""
    return [sys.executable, "-m", "minisgl_ref", "serve", "--host", "127.0.0.1", "--port", str(port),
            *[a for obj in (args.model, args.engine, args.tp, args.speculative, args)
              for a in to_argv(obj, NOT_FORWARDED)]]


def router_command(args: ServerArgs, worker_urls: list[str], metrics_port: int) -> list[str]:
    """The router's command line. Its Prometheus endpoint (always on, port 29000 on every interface by default)
    is moved to a free loopback port, so two of these on one machine do not collide."""
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
           "--policy", "cache_aware", "--host", args.host, "--port", str(args.port),
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
           "--log-level", ROUTER_LOG_LEVEL[args.log_level],
           # the workers are already up when the router starts: check them at once, not every 30 s
           "--worker-startup-check-interval", "1",
           # on SIGTERM, wait for requests in flight a few seconds, not the default three minutes
           "--shutdown-grace-period-secs", "5"]
    if args.api_key:
        # The router then requires 'Authorization: Bearer KEY' from clients and sends the key to the workers.
        cmd += ["--api-key", args.api_key]
    return cmd


def worker_envs(args: ServerArgs) -> list[dict[str, str]]:
    """Each worker's environment: its own GPUs on a CUDA machine, a share of the cores on a CPU."""
    env = dict(os.environ)
    n, tp_size = args.dp_size, args.tp.tp_size
    device = args.model.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cpu"):
        # Each worker's engine would take all cores but one (minisgl_ref.env.cpu_threads); N of them would
        # oversubscribe the machine and spin at every OpenMP barrier. Share the cores out instead.
        env.setdefault("OMP_NUM_THREADS", str(cpu_threads(ranks=n, spare=1)))
        return [dict(env) for _ in range(n)]
    if ":" in device:
        raise ValueError(f"--device {device} names one GPU; with --dp-size, choose the GPUs with CUDA_VISIBLE_DEVICES")
    import torch

    visible = env.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    need = n * tp_size
    if len(gpus) < need:
        raise ValueError(f"--dp-size {n} x --tp-size {tp_size} needs {need} GPUs, {len(gpus)} visible")
    return [{**env, "CUDA_VISIBLE_DEVICES": ",".join(gpus[i * tp_size:(i + 1) * tp_size])}
            for i in range(n)]


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux to send us SIGTERM when the launcher dies, even by SIGKILL."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux/glibc: the launcher's own cleanup is all there is


class DataParallelLauncher:
    """Starts the workers and the router, supervises them, and stops them all (see the module docstring)."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.ports = [free_port() for _ in range(args.dp_size)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.workers: list[subprocess.Popen[bytes]] = []
        self.router: subprocess.Popen[bytes] | None = None
        self.stop_signal: int | None = None

    def run(self) -> int:
        check_router_installed()
        configure_logging(self.args.log_level, "dp")
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per readiness poll
        from minisgl_ref.models.loader import resolve_model_path

        # fail fast; convert the embedded model once
        resolve_model_path(self.args.model.model_path, self.args.model.load_format)
        envs = worker_envs(self.args)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            for i, (port, url, env) in enumerate(zip(self.ports, self.urls, envs)):
                self.workers.append(self._spawn(worker_command(self.args, port), env))
                # printed at every log level: this is how to reach one worker directly (its /get_server_info)
                print(f"worker {i} at {url} (pid {self.workers[-1].pid})", file=sys.stderr, flush=True)
            if not self._wait(self._workers_healthy, "the workers to load the model"):
                return self._exit_status()
            self.router = self._spawn(router_command(self.args, self.urls, free_port()), dict(os.environ))
            if not self._wait(self._router_ready, "the router to register the workers"):
                return self._exit_status()
            print(f"The router is ready: http://{self.args.host}:{self.args.port} (cache_aware over "
                  f"{len(self.workers)} workers, pid {self.router.pid})", file=sys.stderr, flush=True)
            self._wait(lambda: False, "")  # supervise until a signal or a child's death
            return self._exit_status()
        finally:
            self.stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: Any) -> None:
        if self.stop_signal is not None:
            raise KeyboardInterrupt  # a second Ctrl-C: stop waiting, kill what is left
        self.stop_signal = sig
        log.info("received %s, stopping the router and the workers", signal.Signals(sig).name)

    def _spawn(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log.debug("starting %s", " ".join(cmd))
        return subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)

    @property
    def children(self) -> list[subprocess.Popen[bytes]]:
        return ([self.router] if self.router is not None else []) + self.workers

    def dead_child(self) -> str | None:
        for proc in self.children:
            if proc.poll() is not None:
                who = "the router" if proc is self.router else f"worker {self.workers.index(proc)}"
                return f"{who} (pid {proc.pid}) exited with code {proc.returncode}"
        return None

    def _wait(self, done: Callable[[], bool], what: str) -> bool:
        """Poll ``done()`` until it is true (True), or until a signal arrives or a child dies (False)."""
        while self.stop_signal is None:
            dead = self.dead_child()
            if dead is not None:
                log.error("%s; stopping the rest", dead)
                return False
            if done():
                return True
            time.sleep(POLL_S)
        if what:
            log.info("stopped while waiting for %s", what)
        return False

    def _exit_status(self) -> int:
        return 0 if self.stop_signal is not None and self.dead_child() is None else 1

    def _workers_healthy(self) -> bool:
        return all(_get_ok(url + "/health") is not None for url in self.urls)

    def _router_ready(self) -> bool:
        """The router answers and has every worker registered and healthy (its ``/readiness`` route)."""
        body = _get_ok(f"http://{_connect_host(self.args.host)}:{self.args.port}/readiness")
        return body is not None and body.get("healthy_workers", len(self.workers)) >= len(self.workers)

    def stop_all(self) -> None:
        """Router first (it stops taking requests), then the workers; SIGKILL whatever lingers. A worker that was
        killed outright leaves its scheduler and detokenizer behind, with nobody to stop them: they are still in
        its process group (each worker leads its own), which is emptied first for a dead worker, last for all."""
        for proc in self.workers:
            if proc.poll() is not None:
                _kill_group(proc.pid)
        try:
            for proc in self.children:
                if proc.poll() is None:
                    proc.terminate()
                    if proc is self.router:
                        _wait_or_kill(proc)
            for proc in self.workers:
                _wait_or_kill(proc)
        except KeyboardInterrupt:
            for proc in self.children:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        for proc in self.workers:
            _kill_group(proc.pid)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the usual case: the worker stopped its own children, and the group is gone


def _wait_or_kill(proc: subprocess.Popen[bytes]) -> None:
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log.warning("pid %d did not stop on SIGTERM; killing it", proc.pid)
        proc.kill()
        proc.wait()


def _connect_host(host: str) -> str:
    """Where to reach a server bound to ``host`` from this machine (a wildcard address is not one to dial)."""
    return {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(host, f"[{host}]" if ":" in host else host)


def _get_ok(url: str) -> dict[str, Any] | None:
    """GET ``url``: its JSON body (or ``{}``) if it answered 200, else None."""
    try:
        r = httpx.get(url, timeout=2)
    except httpx.TransportError:
        return None
    if r.status_code != 200:
        return None
    try:
        body = r.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def run_data_parallel(args: ServerArgs) -> int:
    """``serve --dp-size N`` (N > 1): the workers and the router, until Ctrl-C, SIGTERM or a child's death."""
    return DataParallelLauncher(args).run()
