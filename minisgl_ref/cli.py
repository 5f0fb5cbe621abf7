"""``python -m minisgl_ref``: the command line (chapters 02 and 10).

Subcommands so far: ``generate`` (one prompt, chat template applied by default), ``chat`` (an interactive
conversation with ``/reset``), ``bench offline`` (throughput of one big generate call, chapter 11), ``bench
serving`` (latencies and throughput of a running server under load, chapter 10) and ``serve``. Any
problem a user can cause (a missing model folder, a bad sampling value) ends with one ``error:`` line and exit
status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence

from minisgl_ref.bench import offline as bench_offline
from minisgl_ref.core.config import EngineConfig, ModelArgs, TPArgs, add_flags, from_flags
from minisgl_ref.sampling.params import SamplingParams
from minisgl_ref.speculative.config import SpeculativeConfig


def add_model_and_engine_args(p: argparse.ArgumentParser) -> None:
    """The model, engine and tensor-parallel flags, with SGLang's names, generated from the settings classes
    (chapters 02-09). ``--chunked-prefill-size`` and ``--enable-mixed-chunk`` default to None here: ``serve``
    picks its own values for them per device (see ``server/args.py``)."""
    add_flags(p.add_argument_group("model"), ModelArgs)
    g = p.add_argument_group("engine (SGLang names)")
    g.add_argument("--engine", default="paged", choices=["paged", "naive"],
                   help="paged: the real engine; naive: the chapter-00 oracle (no KV cache)")
    add_flags(g, EngineConfig, chunked_prefill_size=None, enable_mixed_chunk=None)
    add_flags(p.add_argument_group("tensor parallelism (SGLang names, chapter 09)"), TPArgs)
    # Left at None unless given, so that only the flags given become LLM keyword arguments (speculative_kwargs).
    add_flags(p.add_argument_group("speculative decoding (SGLang names, chapter 13)"), SpeculativeConfig,
              **{f.name: None for f in dataclasses.fields(SpeculativeConfig)})


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
    add_model_and_engine_args(gen)
    _add_sampling_args(gen, default_temperature=0.0)

    chat = sub.add_parser("chat", help="interactive chat; /reset clears the history, /exit quits")
    chat.add_argument("--system", default=None)
    add_model_and_engine_args(chat)
    _add_sampling_args(chat, default_temperature=0.7)

    bench = sub.add_parser("bench", help="benchmarks (chapter 11)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    offline = bench_sub.add_parser("offline", help="offline throughput of one generate call over a fixed workload")
    add_model_and_engine_args(offline)
    bench_offline.add_offline_args(offline)
    from minisgl_ref.bench.serving import add_serving_args  # light: no torch

    serving = bench_sub.add_parser("serving", help="online load generator against a running server (chapter 10)")
    add_serving_args(serving)
    from minisgl_ref.bench.perplexity import add_perplexity_args  # light: no torch at import

    ppl = bench_sub.add_parser("perplexity", help="perplexity of a fixed text, bf16 against FP8 weights and KV "
                                                  "(chapter 15)")
    ppl.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ppl.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "float16", "bfloat16"])
    ppl.add_argument("--device", default=None, help="cpu or cuda (default: cpu)")
    add_perplexity_args(ppl)

    from minisgl_ref.server.args import add_server_args  # light: argparse only

    serve = sub.add_parser("serve", help="the OpenAI-compatible and SGLang-native HTTP server (chapter 10)")
    add_model_and_engine_args(serve)
    add_server_args(serve)
    return parser


def _load(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from minisgl_ref.llm import LLM

    return LLM(args.model_path, load_format=args.load_format, dtype=args.dtype, device=args.device,
               context_length=args.context_length, engine=args.engine, quantization=args.quantization,
               **vars(from_flags(TPArgs, args)),
               **(engine_kwargs(args) if args.engine == "paged" else {}), **speculative_kwargs(args))


def engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """The engine flags given, as ``LLM`` keyword arguments (a flag left at None takes the default)."""
    return {k: v for k, v in vars(from_flags(EngineConfig, args)).items() if getattr(args, k, None) is not None}


def speculative_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """The ``--speculative-*`` flags given (chapter 13), as ``LLM`` keyword arguments of the same names."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(SpeculativeConfig)
            if getattr(args, f.name, None) is not None}


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
    if args.bench_command == "serving":
        from minisgl_ref.bench import serving as bench_serving

        return bench_serving.main(args)
    if args.bench_command == "perplexity":
        from minisgl_ref.bench import perplexity as bench_perplexity

        return bench_perplexity.main(args)
    # The engine's start-up lines (what compiles, how long the CUDA graphs took) go to stderr with the results.
    logging.basicConfig(level=logging.WARNING, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("minisgl_ref").setLevel(logging.INFO)
    kwargs = engine_kwargs(args) | speculative_kwargs(args)
    if from_flags(TPArgs, args).enabled:  # bench offline --tp-size N: the LLM takes the TP flags too (ch. 09)
        kwargs |= vars(from_flags(TPArgs, args))
    return bench_offline.main(args, kwargs)


def cmd_serve(args: argparse.Namespace) -> int:
    from minisgl_ref.server.args import ServerArgs
    from minisgl_ref.server.launch import run_server

    return run_server(ServerArgs.from_cli(args))


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
