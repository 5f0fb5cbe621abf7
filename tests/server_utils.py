"""Helpers for the server tests: start ``python -m minisgl_ref serve`` in a subprocess, talk to it, read SSE."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
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
        self.port = free_port()
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile("w+", prefix="minisgl-server-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "minisgl_ref", "serve", "--port", str(self.port), *extra]
        if api_key:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=stdin, start_new_session=True,
            env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
        )
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
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
