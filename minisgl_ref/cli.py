"""``python -m minisgl_ref``: the command line (chapters 02 and 10).

Subcommands so far: ``generate`` (one prompt, chat template applied by default), ``chat`` (an interactive
conversation with ``/reset``), ``bench offline`` (throughput of one big generate call, chapter 11), ``bench
serving`` (latencies and throughput of a running server under load, chapter 10) and ``serve``. Any
problem a user can cause (a missing model folder, a bad sampling value) ends with one ``error:`` line and exit
status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from minisgl_ref.bench import offline as bench_offline
from minisgl_ref.sampling.params import SamplingParams


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model-path", default=None,
                   help="local HF folder, or a shipped config name with --load-format dummy "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument("--context-length", type=int, default=None)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's knobs, with SGLang's flag names (chapters 03-06)."""
    g = p.add_argument_group("engine (SGLang names)")
    g.add_argument("--engine", default="paged", choices=["paged", "naive"],
                   help="paged: the real engine; naive: the chapter-00 oracle (no KV cache)")
    g.add_argument("--max-running-requests", type=int, default=256)
    g.add_argument("--max-prefill-tokens", type=int, default=16384)
    g.add_argument("--chunked-prefill-size", type=int, default=None,
                   help="most prompt tokens of one request per step; -1 disables chunking (default: 8192; "
                        "serve on a CPU: 32, see chapter 10)")
    g.add_argument("--schedule-policy", default="fcfs", choices=["fcfs", "lpm"])
    g.add_argument("--enable-mixed-chunk", action=argparse.BooleanOptionalAction, default=None,
                   help="decode rows ride along in prefill steps (default: off; serve on a CPU: on)")
    g.add_argument("--in-batch-prefix-threshold", type=int, default=32,
                   help="hold back a request sharing this many uncached prompt tokens with one admitted in the same "
                        "prefill step, so it hits the radix cache next step (chapter 04); -1 disables")
    g.add_argument("--page-size", type=int, default=1)
    g.add_argument("--disable-radix-cache", action="store_true")
    g.add_argument("--disable-overlap-schedule", action="store_true")
    g.add_argument("--max-total-tokens", type=int, default=None)
    g.add_argument("--mem-fraction-static", type=float, default=0.85)
    t = p.add_argument_group("tensor parallelism (SGLang names, chapter 09)")
    t.add_argument("--tp-size", type=int, default=1, help="ranks that share the model (one GPU, or CPU process, each)")
    t.add_argument("--nnodes", type=int, default=1, help="machines the --tp-size ranks are spread over")
    t.add_argument("--node-rank", type=int, default=0, help="this machine's index among the --nnodes")
    t.add_argument("--dist-init-addr", default=None,
                   help="host:port on node 0 where the ranks meet (required with --nnodes > 1)")
    g.add_argument("--cuda-graph-max-bs", type=int, default=None,
                   help="capture decode CUDA graphs up to this batch size (default: max running requests, <= 256)")
    g.add_argument("--disable-cuda-graph", action="store_true", help="run decode eagerly (chapter 08)")
    from minisgl_ref.core.config import ATTENTION_BACKENDS

    for flag, what in (("--attention-backend", "both phases"), ("--prefill-attention-backend", "extend steps"),
                       ("--decode-attention-backend", "decode steps")):  # fmt: skip
        g.add_argument(flag, default=None, choices=ATTENTION_BACKENDS,
                       help=f"attention kernels for {what} (chapter 07; default: by device)")


ENGINE_ARG_NAMES = (
    "max_running_requests", "max_prefill_tokens", "chunked_prefill_size", "schedule_policy", "enable_mixed_chunk",
    "in_batch_prefix_threshold",
    "page_size", "disable_radix_cache", "disable_overlap_schedule", "max_total_tokens", "mem_fraction_static",
    "cuda_graph_max_bs", "disable_cuda_graph",
    "attention_backend", "prefill_attention_backend", "decode_attention_backend",
)


TP_ARG_NAMES = ("tp_size", "nnodes", "node_rank", "dist_init_addr")


def tp_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """The tensor-parallel flags, as ``LLM`` keyword arguments (chapter 09)."""
    return {name: getattr(args, name) for name in TP_ARG_NAMES}


def engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """The engine flags given (a flag left at None takes :class:`EngineConfig`'s default)."""
    return {name: getattr(args, name) for name in ENGINE_ARG_NAMES if getattr(args, name) is not None}


def _add_sampling_args(p: argparse.ArgumentParser, default_temperature: float) -> None:
    g = p.add_argument_group("sampling (SGLang names)")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=default_temperature, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--seed", type=int, default=None)


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        repetition_penalty=args.repetition_penalty,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minisgl_ref", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print the answer")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--system", default=None, help="system message for the chat template")
    _add_model_args(gen)
    add_engine_args(gen)
    _add_sampling_args(gen, default_temperature=0.0)

    chat = sub.add_parser("chat", help="interactive chat; /reset clears the history, /exit quits")
    chat.add_argument("--system", default=None)
    _add_model_args(chat)
    add_engine_args(chat)
    _add_sampling_args(chat, default_temperature=0.7)

    bench = sub.add_parser("bench", help="benchmarks (chapter 11)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    offline = bench_sub.add_parser("offline", help="offline throughput of one generate call over a fixed workload")
    _add_model_args(offline)
    add_engine_args(offline)
    bench_offline.add_offline_args(offline)
    from minisgl_ref.bench.serving import add_serving_args  # light: no torch

    serving = bench_sub.add_parser("serving", help="online load generator against a running server (chapter 10)")
    add_serving_args(serving)
    from minisgl_ref.bench.kernels import add_kernels_args

    kernels = bench_sub.add_parser("kernels", help="attention kernel microbenchmarks vs the memory roofline (ch. 07)")
    add_kernels_args(kernels)

    from minisgl_ref.server.args import add_server_args  # light: argparse only

    serve = sub.add_parser("serve", help="the OpenAI-compatible and SGLang-native HTTP server (chapter 10)")
    _add_model_args(serve)
    add_engine_args(serve)
    add_server_args(serve)
    return parser


def _load(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from minisgl_ref.llm import LLM

    return LLM(
        args.model_path,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        context_length=args.context_length,
        engine=args.engine,
        **tp_kwargs(args),
        **(engine_kwargs(args) if args.engine == "paged" else {}),
    )


def _messages(system: str | None, turns: list[dict[str, str]]) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + turns


def cmd_generate(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    llm = _load(args)
    if not llm.is_leader:  # --node-rank > 0: this machine's ranks follow rank 0 until it is done
        llm.follow()
        return 0
    if args.raw:
        prompt = args.prompt
    else:
        prompt = llm.chat_prompt_ids(_messages(args.system, [{"role": "user", "content": args.prompt}]))
    for delta in llm.stream(prompt, params):
        print(delta, end="", flush=True)
    print()
    llm.shutdown()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    llm = _load(args)
    history: list[dict[str, str]] = []
    interactive = sys.stdin.isatty()
    if interactive:
        print("Chat with the model. /reset clears the history, /exit (or Ctrl-D) quits.")
    while True:
        try:
            line = input(">>> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        line = line.strip()
        if not line:
            continue
        if line == "/exit":
            return 0
        if line == "/reset":
            history.clear()
            print("(history cleared)")
            continue
        history.append({"role": "user", "content": line})
        prompt = llm.chat_prompt_ids(_messages(args.system, history))
        pieces = []
        for delta in llm.stream(prompt, params):
            pieces.append(delta)
            print(delta, end="", flush=True)
        print()
        history.append({"role": "assistant", "content": "".join(pieces)})


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "kernels":
        from minisgl_ref.bench import kernels as bench_kernels

        return bench_kernels.main(args)
    if args.bench_command == "serving":
        from minisgl_ref.bench import serving as bench_serving

        return bench_serving.main(args)
    kwargs = engine_kwargs(args)
    if args.tp_size > 1 or args.nnodes > 1:  # bench offline --tp-size N: the LLM takes the TP flags too (ch. 09)
        kwargs |= tp_kwargs(args)
    return bench_offline.main(args, kwargs)


def cmd_serve(args: argparse.Namespace) -> int:
    from minisgl_ref.server.args import ServerArgs
    from minisgl_ref.server.launch import run_server

    return run_server(ServerArgs.from_cli(args, engine_kwargs(args)))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {"generate": cmd_generate, "chat": cmd_chat, "bench": cmd_bench, "serve": cmd_serve}
    try:
        return handlers[args.command](args)
    except (ValueError, FileNotFoundError, OSError) as e:
        # User-facing problems (bad model path, invalid sampling value) are one line, not a traceback.
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
