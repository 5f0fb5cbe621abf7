"""What ``serve`` was asked to do: the server's arguments, checked once, in the parent process (chapter 10).

Every child process receives the same :class:`ServerArgs` (it is a plain dataclass, so ``multiprocessing`` can
pickle it), which is how the scheduler learns the engine settings and the detokenizer the model folder.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any

from minisgl_ref import env
from minisgl_ref.core.config import EngineConfig, ModelArgs, TPArgs, add_flags, flag, from_flags
from minisgl_ref.speculative.config import SpeculativeConfig

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

#: Engine defaults of a server on a CPU, where one scheduler thread takes ~65 ms for a decode step of the embedded
#: model but ~37 s for a 3,000-token prompt in one step. Cut into 32-token chunks that share their step with the
#: running requests' decode rows, the same prompt delays each running stream's next token by ~0.3-0.45 s (about
#: five decode steps) and takes ~25% longer to prefill itself. Chapter 10 shows the measurement.
CPU_SERVER_ENGINE_DEFAULTS: dict[str, Any] = {"chunked_prefill_size": 32, "enable_mixed_chunk": True}

#: Engine defaults of a server on a GPU. Mixed chunks: a prompt that arrives shares its step with the running
#: requests' decode rows, so those wait one step (~2.5 ms for a prompt of 1,000 tokens on an H100, a CUDA-graph
#: replay, chapter 11) instead of a prefill step plus their own. Measured with 200 Poisson requests at 8 and 16
#: per second, the inter-token latency p99 fell from 2.2-2.4x its median to 1.6-1.7x.
GPU_SERVER_ENGINE_DEFAULTS: dict[str, Any] = {"enable_mixed_chunk": True}


@dataclass
class ServerArgs:
    """The model, engine and tensor-parallel settings every ``LLM`` takes, plus the server's own flags."""

    model: ModelArgs = field(default_factory=ModelArgs)  #: which model, on which device (the same as ``LLM``'s)
    engine: EngineConfig = field(default_factory=EngineConfig)  #: the engine's settings, as for ``LLM``
    tp: TPArgs = field(default_factory=TPArgs)  #: tensor parallelism (chapter 09): one scheduler process per rank
    #: speculative decoding (chapter 13): off unless --speculative-algorithm is given
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    host: str = flag("127.0.0.1")  #: the address the HTTP server listens on (default: this machine only)
    port: int = flag(30000)  #: the HTTP port (SGLang's default)
    served_model_name: str | None = flag(None, "the model name clients must use (default: the path)")
    api_key: str | None = flag(None, "require 'Authorization: Bearer KEY' on every API route")
    # The largest request body read, in MiB; a larger one gets 413 before it is read. The largest legitimate body
    # is a full-context prompt, as text or as token ids, at most ~8 bytes a token either way: 1 MiB for a 128k
    # context, 8 MiB for a million tokens. The limit also bounds how long one body can pause every stream, as
    # parsing JSON holds the GIL (~30 ms per MiB of token ids on a laptop core).
    max_request_body_mb: float = flag(32.0, "refuse request bodies larger than this many MiB with 413, before "
                                            "reading them")
    enable_metrics: bool = flag(False, "serve Prometheus metrics at /metrics")
    step_log: str | None = flag(None, "append one JSON line per engine step to this file (what ran, and the "
                                      "time since the previous step's tokens): where an inter-token latency "
                                      "tail comes from")
    watchdog_timeout: float = flag(60.0, "/health and /health_generate answer 503 while the scheduler has been "
                                         "inside one engine step for longer than this many seconds (0: off)")
    log_level: str = flag("info", choices=LOG_LEVELS)  #: the least severe log record every process prints
    shell: bool = flag(False, "chat in this terminal instead of serving HTTP")
    # data parallelism: N whole servers behind SGLang's router (data_parallel.py)
    dp_size: int = flag(1, "data parallelism: this many whole servers behind SGLang's cache-aware router "
                           "(needs: pip install 'minisgl_ref[router]')")
    #: How long a server whose child died keeps answering 503 (so that clients and /health can see why) before
    #: it exits with a non-zero status (``MINISGL_DEAD_CHILD_GRACE_S``).
    dead_child_grace_s: float = field(default_factory=env.dead_child_grace_s)

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> ServerArgs:
        if args.engine != "paged":
            raise ValueError("serve needs --engine paged (the naive oracle cannot batch, abort or share a cache)")
        from minisgl_ref.distributed.group import DistConfig

        tp = from_flags(TPArgs, args)
        DistConfig.of(tp)  # bad TP flags fail here
        if not 0 < args.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {args.port}")
        if args.context_length is not None and args.context_length < 2:
            raise ValueError(f"--context-length must be at least 2, got {args.context_length}")
        if args.api_key is not None and not args.api_key:
            raise ValueError("--api-key must not be empty")
        if not 0 < args.max_request_body_mb < float("inf"):
            raise ValueError(f"--max-request-body-mb must be a positive number, got {args.max_request_body_mb}")
        if not 0 <= args.watchdog_timeout < float("inf"):
            raise ValueError(f"--watchdog-timeout must be a number of seconds >= 0, got {args.watchdog_timeout}")
        if args.dp_size < 1:
            raise ValueError(f"--dp-size must be at least 1, got {args.dp_size}")
        if args.dp_size > 1 and args.shell:
            raise ValueError("--shell chats with one server; it cannot be combined with --dp-size > 1")
        if args.dp_size > 1 and args.nnodes > 1:
            raise ValueError("--dp-size > 1 runs its servers on this machine; it cannot be combined with --nnodes")
        device_defaults = (CPU_SERVER_ENGINE_DEFAULTS if _resolved_device(args.device) == "cpu"
                           else GPU_SERVER_ENGINE_DEFAULTS)
        given = {k: v for k, v in device_defaults.items() if getattr(args, k) is None}
        engine = from_flags(EngineConfig, args, **given)  # a bad engine flag fails here, before any process starts
        _check_attention_backends(args.device, engine)
        speculative = from_flags(SpeculativeConfig, args)  # a bad combination of its flags fails here too
        return from_flags(cls, args, model=from_flags(ModelArgs, args), engine=engine, tp=tp, speculative=speculative)

    def public_dict(self) -> dict[str, Any]:
        """For ``/get_server_info``: every setting but the API key, in one flat dictionary."""
        d = {**asdict(self.model), **asdict(self.tp), **asdict(self.engine), **asdict(self.speculative), **asdict(self)}
        for name in ("api_key", "model", "engine", "tp", "speculative", "skip_tokenizer_init"):
            d.pop(name)
        return d


def add_server_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``serve`` beyond the model and engine ones, with SGLang's names."""
    add_flags(p.add_argument_group("server (SGLang names)"), ServerArgs)


def _resolved_device(device: str | None) -> str:
    """``cpu`` or ``cuda``: what ``--device`` (or its default, CUDA when there is one) means."""
    if device is not None:
        return "cpu" if device.startswith("cpu") else "cuda"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_attention_backends(device: str | None, engine: EngineConfig) -> None:
    """An attention backend that was asked for but cannot run here (a GPU backend on the CPU, a package that is
    not installed) fails now, in one line, rather than after the children have spent a minute loading the model.
    (The engine checks again with the model's dtype known; see :mod:`minisgl_ref.attention.registry`.)"""
    names = {engine.attention_backend, engine.prefill_attention_backend, engine.decode_attention_backend} - {None}
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

    scheduler: str  #: the scheduler's PULL socket: requests, aborts, RPCs from the API server
    detokenizer: str  #: the detokenizer's PULL socket: token ids from the scheduler
    api: str  #: the API server's PULL socket: text from the detokenizer, RPC replies from the scheduler
    folder: str  #: the private temporary folder that holds the socket files

    @classmethod
    def fresh(cls) -> Addresses:
        folder = tempfile.mkdtemp(prefix="minisgl_ref-")
        return cls(
            scheduler=f"ipc://{folder}/scheduler",
            detokenizer=f"ipc://{folder}/detokenizer",
            api=f"ipc://{folder}/api",
            folder=folder,
        )
