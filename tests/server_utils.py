"""Helpers for the server tests: start ``python -m minisgl_ref serve`` in a subprocess, talk to it, read SSE."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

STARTUP_TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children_of(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (read from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the command name (2nd field) may contain spaces; the fields after its closing paren are fixed
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


class ServerProcess:
    """One server in a subprocess (its own session, so it can be signalled alone), logging to a temp file."""

    def __init__(self, *extra: str, api_key: str | None = None, env: dict[str, str] | None = None,
                 stdin: Any = None) -> None:
        self.api_key = api_key
        self._args, self._env, self._stdin = extra, env, stdin
        self.log = tempfile.NamedTemporaryFile("w+", prefix="minisgl-server-", suffix=".log", delete=False)
        self._start()

    def _start(self) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "minisgl_ref", "serve", "--port", str(self.port), *self._args]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=self._stdin, start_new_session=True,
            env={**os.environ, **(self._env or {}), "PYTHONUNBUFFERED": "1"},
        )
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        restarts = 2
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if "address already in use" in self.log_text() and restarts:
                    # Another process bound the free port between free_port() and the server's bind: try another.
                    restarts -= 1
                    self.log.seek(0)
                    self.log.truncate()
                    self._start()
                    continue
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the server did not start within {timeout} s:\n{self.log_text()}")

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers, timeout=kw.pop("timeout", 120), **kw)

    def post(self, path: str, **kw: Any) -> httpx.Response:
        headers = {**self.headers, **kw.pop("headers", {})}
        return httpx.post(self.url + path, headers=headers, timeout=kw.pop("timeout", 300), **kw)

    def server_info(self) -> dict[str, Any]:
        r = self.get("/get_server_info")
        r.raise_for_status()
        return r.json()

    def log_text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-6000:]

    def terminate(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill_all(self) -> None:
        """Last-resort cleanup: the whole session (server and children)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        self.log.close()
        os.unlink(self.log.name)


def parse_sse(text: str) -> list[Any]:
    """The events of a ``text/event-stream`` body; ``"[DONE]"`` stays a string. Fails on malformed events."""
    events: list[Any] = []
    assert text.endswith("\n\n"), f"an SSE body must end with a blank line: {text[-80:]!r}"
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), f"not an SSE data event: {block!r}"
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def descendants_of(pid: int) -> list[int]:
    """Every live process below ``pid``: its children, their children, and so on (read from /proc)."""
    out, todo = [], [pid]
    while todo:
        kids = children_of(todo.pop())
        out += kids
        todo += kids
    return out


def wait_for_log(server: ServerProcess, needle: str, timeout: float = STARTUP_TIMEOUT_S) -> str:
    """Wait until ``needle`` appears in the server's log (for servers whose readiness is a printed line rather
    than ``/health``); returns the log so far. Fails if the server exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        server.log.flush()
        text = Path(server.log.name).read_text()
        if needle in text:
            return text
        if server.proc.poll() is not None:
            raise RuntimeError(f"the server exited with {server.proc.returncode}:\n{server.log_text()}")
        time.sleep(0.5)
    raise TimeoutError(f"{needle!r} did not appear within {timeout} s:\n{server.log_text()}")


@contextlib.contextmanager
def running_server(*flags: str, **kw: Any) -> Iterator[ServerProcess]:
    """A ready server for a ``with`` block (or a fixture), stopped however the block ends."""
    srv = ServerProcess(*flags, **kw)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.kill_all()


# ------------------------------------------------------------------------- helpers of the fuzz and soak tests


def wait_idle(server: ServerProcess, timeout: float = 120) -> dict[str, Any]:
    """Poll until the scheduler holds no request and the whole KV pool is free or evictable again (the same check
    as ``wait_idle`` in test_server.py); returns the last ``/get_server_info``."""
    deadline = time.monotonic() + timeout
    while True:
        info = server.server_info()
        if (info["num_running_reqs"] == 0 and info["num_queue_reqs"] == 0 and info["num_tracked_reqs"] == 0
                and info["available_kv_tokens"] == info["max_total_num_tokens"]):
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"the server did not go idle within {timeout} s: {info}")
        time.sleep(0.25)


def error_body_problem(body: bytes) -> str | None:
    """What is wrong with ``body`` as an OpenAI-style error (``{"error": {"message", "type", "param", "code"}}``
    with a non-empty message), or None if nothing is."""
    try:
        obj = json.loads(body)
    except ValueError:
        return f"the error body is not JSON: {body[:200]!r}"
    err = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
        return f"not an OpenAI-style error body: {body[:200]!r}"
    if not isinstance(err["message"], str) or not err["message"].strip():
        return f"the error message is empty: {body[:200]!r}"
    return None


def sse_problem(text: str) -> tuple[list[Any], str | None]:
    """The events of an SSE body (``"[DONE]"`` stays a string) and what is wrong with it, if anything: a malformed
    event, a missing final ``data: [DONE]``, or an error event in the middle of a 200 stream."""
    if not text.endswith("\n\n"):
        return [], f"the stream does not end with a blank line: {text[-120:]!r}"
    events: list[Any] = []
    for block in text.split("\n\n")[:-1]:
        if not block.startswith("data: "):
            return events, f"not an SSE data event: {block[:200]!r}"
        payload = block[len("data: "):]
        try:
            events.append(payload if payload == "[DONE]" else json.loads(payload))
        except ValueError:
            return events, f"an SSE event is not JSON: {payload[:200]!r}"
    if not events or events[-1] != "[DONE]" or "[DONE]" in events[:-1]:
        return events, f"the stream does not end with exactly one data: [DONE]: {text[-200:]!r}"
    errors = [e for e in events[:-1] if isinstance(e, dict) and "error" in e]
    if errors:
        return events, f"an error event in the stream: {json.dumps(errors[0])[:300]}"
    return events, None
