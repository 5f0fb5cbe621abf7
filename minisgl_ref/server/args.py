"""What ``serve`` was asked to do: the server's arguments, checked once, in the parent process (chapter 10).

Every child process receives the same :class:`ServerArgs` (it is a plain dataclass, so ``multiprocessing`` can
pickle it), which is how the scheduler learns the engine settings and the detokenizer the model folder.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

#: Engine defaults of a server on a CPU, where one scheduler thread takes ~65 ms for a decode step of the embedded
#: model but ~37 s for a 3,000-token prompt in one step. Cut into 32-token chunks that share their step with the
#: running requests' decode rows, the same prompt delays each running stream's next token by ~0.3-0.45 s (about
#: five decode steps) and takes ~25% longer to prefill itself. Chapter 10 shows the measurement.
CPU_SERVER_ENGINE_DEFAULTS: dict[str, Any] = {"chunked_prefill_size": 32, "enable_mixed_chunk": True}


@dataclass
class ServerArgs:
    model_path: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    device: str | None = None
    context_length: int | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 30000
    tp_size: int = 1  # tensor parallelism (chapter 09): one scheduler process per rank
    dp_size: int = 1  # data parallelism: N whole servers behind SGLang's router (data_parallel.py)
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # host:port where the ranks meet; None: a free local port
    served_model_name: str | None = None
    api_key: str | None = None
    # The largest request body read, in MiB; a larger one gets 413 before it is read. The largest legitimate body
    # is a full-context prompt, as text or as token ids, at most ~8 bytes a token either way: 1 MiB for a 128k
    # context, 8 MiB for a million tokens. The limit also bounds how long one body can pause every stream, as
    # parsing JSON holds the GIL (~30 ms per MiB of token ids on a laptop core).
    max_request_body_mb: float = 32.0
    enable_metrics: bool = False
    log_level: str = "info"
    shell: bool = False
    # How long a server whose child died keeps answering 503 (so that clients and /health can see why) before
    # it exits with a non-zero status.
    dead_child_grace_s: float = 2.0

    @classmethod
    def from_cli(cls, args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> ServerArgs:
        if args.engine != "paged":
            raise ValueError("serve needs --engine paged (the naive oracle cannot batch, abort or share a cache)")
        from minisgl_ref.distributed.group import DistConfig

        DistConfig(args.tp_size, 0, args.nnodes, args.node_rank, args.dist_init_addr)  # bad TP flags fail here
        if not 0 < args.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {args.port}")
        if args.context_length is not None and args.context_length < 2:
            raise ValueError(f"--context-length must be at least 2, got {args.context_length}")
        if args.api_key is not None and not args.api_key:
            raise ValueError("--api-key must not be empty")
        if not 0 < args.max_request_body_mb < float("inf"):
            raise ValueError(f"--max-request-body-mb must be a positive number, got {args.max_request_body_mb}")
        if args.dp_size < 1:
            raise ValueError(f"--dp-size must be at least 1, got {args.dp_size}")
        if args.dp_size > 1 and args.shell:
            raise ValueError("--shell chats with one server; it cannot be combined with --dp-size > 1")
        if args.dp_size > 1 and args.nnodes > 1:
            raise ValueError("--dp-size > 1 runs its servers on this machine; it cannot be combined with --nnodes")
        from minisgl_ref.core.config import EngineConfig

        engine_kwargs = dict(engine_kwargs)
        if _resolved_device(args.device) == "cpu":
            for key, value in CPU_SERVER_ENGINE_DEFAULTS.items():
                engine_kwargs.setdefault(key, value)
        EngineConfig(**engine_kwargs)  # a bad engine flag fails here, before any process starts
        _check_attention_backends(args.device, engine_kwargs)
        grace = float(os.environ.get("MINISGL_DEAD_CHILD_GRACE_S", "2.0"))
        return cls(
            model_path=args.model_path,
            load_format=args.load_format,
            dtype=args.dtype,
            device=args.device,
            context_length=args.context_length,
            engine_kwargs=dict(engine_kwargs),
            host=args.host,
            port=args.port,
            tp_size=args.tp_size,
            dp_size=args.dp_size,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            dist_init_addr=args.dist_init_addr,
            served_model_name=args.served_model_name,
            api_key=args.api_key,
            max_request_body_mb=args.max_request_body_mb,
            enable_metrics=args.enable_metrics,
            log_level=args.log_level,
            shell=args.shell,
            dead_child_grace_s=grace,
        )

    def public_dict(self) -> dict[str, Any]:
        """For ``/get_server_info``: everything but the API key."""
        d = asdict(self)
        d.pop("api_key")
        d.update(d.pop("engine_kwargs"))
        return d


def _resolved_device(device: str | None) -> str:
    """``cpu`` or ``cuda``: what ``--device`` (or its default, CUDA when there is one) means."""
    if device is not None:
        return "cpu" if device.startswith("cpu") else "cuda"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_attention_backends(device: str | None, engine_kwargs: dict[str, Any]) -> None:
    """An attention backend that was asked for but cannot run here (a GPU backend on the CPU, a package that is
    not installed) fails now, in one line, rather than after the children have spent a minute loading the model.
    (The engine checks again with the model's dtype known; see :mod:`minisgl_ref.attention.registry`.)"""
    names = {engine_kwargs.get(k) for k in ("attention_backend", "prefill_attention_backend",
                                            "decode_attention_backend")} - {None}
    if not names:
        return
    import torch

    from minisgl_ref.attention.registry import check_backend_can_run

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    for name in sorted(names):
        check_backend_can_run(name, dev)


@dataclass(frozen=True)
class Addresses:
    """The ZeroMQ endpoints (``ipc://`` files in a private temporary folder), one per receiving process."""

    scheduler: str  # the scheduler's PULL socket: requests, aborts, RPCs from the API server
    detokenizer: str  # the detokenizer's PULL socket: token ids from the scheduler
    api: str  # the API server's PULL socket: text from the detokenizer, RPC replies from the scheduler
    folder: str

    @classmethod
    def fresh(cls) -> Addresses:
        folder = tempfile.mkdtemp(prefix="minisgl_ref-")
        return cls(
            scheduler=f"ipc://{folder}/scheduler",
            detokenizer=f"ipc://{folder}/detokenizer",
            api=f"ipc://{folder}/api",
            folder=folder,
        )


def add_server_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``serve`` beyond the model and engine ones, with SGLang's names."""
    g = p.add_argument_group("server (SGLang names)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=30000)
    g.add_argument("--served-model-name", default=None, help="the model name clients must use (default: the path)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every API route")
    g.add_argument("--max-request-body-mb", type=float, default=ServerArgs.max_request_body_mb,
                   help="refuse request bodies larger than this many MiB with 413, before reading them")
    g.add_argument("--enable-metrics", action="store_true", help="serve Prometheus metrics at /metrics")
    g.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    g.add_argument("--shell", action="store_true", help="chat in this terminal instead of serving HTTP")
    g.add_argument("--dp-size", type=int, default=1,
                   help="data parallelism: this many whole servers behind SGLang's cache-aware router "
                        "(needs: pip install 'minisgl_ref[router]')")
