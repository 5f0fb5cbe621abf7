"""``serve --shell``: chat with the served model in this terminal (chapter 10).

The shell is one more client of the :class:`TokenizerManager`, in the same process, without HTTP: the manager's
asyncio loop runs in a background thread, and the terminal (``input()`` must own the main thread so that Ctrl-C
and Ctrl-D behave) hands it one request per turn and prints the text as it streams back.

Each turn sends the *whole* conversation again, rendered by the chat template. That looks wasteful, and it
would be without a prefix cache: here the previous turns' tokens (prompt and answer) are still in the radix
cache, so only the new message is prefilled. The line printed after each answer shows it (``cached``).
Ctrl-C during an answer aborts it (the request is aborted in the scheduler like a disconnected HTTP client);
``/reset`` clears the history; ``/set NAME VALUE`` changes a sampling parameter (``/set temperature 0``,
``/set max_new_tokens 64``); ``/exit`` or Ctrl-D quits.
"""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from minisgl_ref.sampling.params import SamplingParams

SHELL_MAX_NEW_TOKENS = 512
SHELL_TEMPERATURE = 0.7


class _LoopThread:
    """An asyncio loop running in a daemon thread, for the manager's sockets and tasks."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="minisgl-shell-loop", daemon=True)
        self.thread.start()

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(2.0)


def run_shell(launcher: Any, info: dict[str, Any], tokenizer: Any) -> int:
    if tokenizer is None:
        raise ValueError("--shell needs a model with a tokenizer")
    runner = _LoopThread()

    async def setup() -> Any:
        manager = launcher.make_manager(info, tokenizer)

        def on_dead() -> None:
            os.kill(os.getpid(), signal.SIGTERM)  # interrupt the input() in the main thread

        watchdog = asyncio.get_running_loop().create_task(launcher.watchdog(manager, on_dead))
        return manager, watchdog

    manager, watchdog = runner.call(setup())

    def on_term(sig: int, frame: Any) -> None:
        raise SystemExit(launcher.exit_code)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return _repl(runner, manager, tokenizer, launcher.model_name)
    except SystemExit as e:
        return int(e.code or 0)
    finally:
        runner.call(_close(manager, watchdog))
        runner.stop()


async def _close(manager: Any, watchdog: asyncio.Task) -> None:
    watchdog.cancel()  # a pending task left on a stopped loop is reported as "destroyed but pending"
    try:
        await watchdog
    except asyncio.CancelledError:
        pass
    manager.close()


def _stream(runner: _LoopThread, manager: Any, ids: list[int], params: SamplingParams) -> Iterator[Any]:
    out: queue.Queue = queue.Queue()

    async def pump() -> None:
        try:
            async for _, chunk in manager.generate([(ids, params)]):
                out.put(chunk)
        except Exception as e:  # noqa: BLE001 - hand it to the terminal
            out.put(e)
        finally:
            out.put(None)

    fut = asyncio.run_coroutine_threadsafe(pump(), runner.loop)
    try:
        while True:
            try:
                item = out.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is None:
                return
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        fut.cancel()  # if we stopped early (Ctrl-C), this closes the generator, which aborts the request


def _repl(runner: _LoopThread, manager: Any, tokenizer: Any, model_name: str) -> int:
    interactive = sys.stdin.isatty()
    print(f"Chatting with {model_name}. /reset clears the history, /set NAME VALUE changes a sampling "
          "parameter, /exit (or Ctrl-D) quits.", flush=True)
    history: list[dict[str, str]] = []
    settings: dict[str, Any] = {"max_new_tokens": SHELL_MAX_NEW_TOKENS, "temperature": SHELL_TEMPERATURE}
    while True:
        try:
            line = input(">>> " if interactive else "")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            return 0
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history.clear()
            print("(history cleared)", flush=True)
            continue
        if line.startswith("/set"):
            settings = _set(settings, line)
            continue
        if line.startswith("/"):
            print("(commands: /reset, /set NAME VALUE, /exit)", flush=True)
            continue
        turn = history + [{"role": "user", "content": line}]
        ids = tokenizer.apply_chat_template(turn, add_generation_prompt=True)
        room = manager.context_length - len(ids)
        if room < 1:
            print("(the conversation no longer fits in the context window: /reset)", flush=True)
            continue
        params = SamplingParams.from_dict({**settings, "max_new_tokens": min(settings["max_new_tokens"], room)})
        pieces: list[str] = []
        last = None
        t0 = time.perf_counter()
        try:
            for chunk in _stream(runner, manager, ids, params):
                if chunk.text:
                    pieces.append(chunk.text)
                    print(chunk.text, end="", flush=True)
                last = chunk
        except KeyboardInterrupt:
            print("\n(interrupted)", flush=True)
            continue
        print(flush=True)
        if last is None or (last.finish_reason or {}).get("type") == "abort":
            reason = (last.finish_reason or {}).get("message") if last else "no answer"
            print(f"(error: {reason})", flush=True)
            if manager.dead:
                return 1
            continue
        history = turn + [{"role": "assistant", "content": "".join(pieces)}]
        dt = time.perf_counter() - t0
        print(f"[prompt {last.prompt_tokens} tokens, cached {last.cached_tokens}; "
              f"generated {last.completion_tokens} in {dt:.2f} s]", flush=True)


def _set(settings: dict[str, Any], line: str) -> dict[str, Any]:
    """``/set NAME VALUE``: change a sampling parameter (SGLang's names) for the following turns."""
    import json

    parts = line.split(maxsplit=2)
    if len(parts) != 3:
        print(f"(usage: /set NAME VALUE, e.g. /set temperature 0; now: {settings})", flush=True)
        return settings
    _, name, raw = parts
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    new = {**settings, name: value}
    try:
        SamplingParams.from_dict(new)
    except (ValueError, TypeError) as e:
        print(f"(not set: {e})", flush=True)
        return settings
    print(f"({name} = {value!r})", flush=True)
    return new
