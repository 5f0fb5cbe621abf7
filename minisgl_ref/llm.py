"""The offline API: ``LLM(...).generate(prompts, params)`` (chapters 00-02).

This is the front door for scripts, notebooks and tests: it owns a model, a tokenizer and an engine, turns
prompts into :class:`Req` objects, runs them to completion and returns plain results. The engine underneath gets
faster chapter by chapter; this interface does not change.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from minisgl_ref.core.config import EngineConfig
from minisgl_ref.core.request import Req
from minisgl_ref.distributed import set_tp_info
from minisgl_ref.distributed.group import (
    DistConfig,
    destroy_distributed,
    exit_with_parent,
    init_distributed,
    rank_device,
)
from minisgl_ref.engine.engine import Engine
from minisgl_ref.engine.naive import NaiveEngine
from minisgl_ref.models.loader import load_model
from minisgl_ref.sampling.params import SamplingParams
from minisgl_ref.tokenizer import IncrementalDetokenizer, Tokenizer
from minisgl_ref.tokenizer.tokenizer import TOKENIZER_FILES
from minisgl_ref.tp.engine import TPEngine, spawn_local_ranks, stop_local_ranks, wait_ready

Prompt = str | Sequence[int]
Messages = Sequence[Mapping[str, Any]]


@dataclass
class GenerateOutput:
    """One completion. ``finish_reason`` is ``stop``, ``length`` or ``abort``; ``matched_stop`` is the stop
    token id or stop string that ended it, if any."""

    text: str
    output_ids: list[int]
    finish_reason: str
    matched_stop: int | str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    rid: str = ""
    # With return_logprob: (logprob, token id, [(alternative id, logprob), ...]) per token; the first prompt
    # token's logprob is None.
    input_token_logprobs: list[tuple[float | None, int, list[tuple[int, float]]]] | None = None
    output_token_logprobs: list[tuple[float, int, list[tuple[int, float]]]] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def quiesce_for_teardown(engine: Any) -> None:
    """Before a rank leaves its process group: drop the engine's CUDA graphs (their captured all-reduces use the
    NCCL communicator about to be destroyed) and wait for the device, so that no collective is pending.

    ``MINISGL_SHUTDOWN_TRACE_S=N`` prints every thread's Python stack if teardown still runs N seconds later:
    how to find out where a rank hangs on a machine without a debugger."""
    trace_after = float(os.environ.get("MINISGL_SHUTDOWN_TRACE_S", "0") or 0)
    if trace_after > 0:
        faulthandler.dump_traceback_later(trace_after, exit=False)
    runner = getattr(engine, "runner", None)
    if runner is not None and getattr(runner, "graph_runner", None) is not None:
        runner.graph_runner = None
        gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@dataclass
class TPHandle:
    """What an ``LLM`` must clean up at tp > 1: the ranks it spawned and the process group (chapter 09)."""

    size: int
    procs: list[Any] = field(default_factory=list)
    engine: Any = None

    def close(self) -> None:
        connected = dist.is_initialized()
        if isinstance(self.engine, TPEngine) and self.engine.is_leader and connected:
            self.engine.stop_followers()
        # Leave the group *before* waiting for the followers to exit: NCCL's teardown waits for every rank of
        # the communicator, so a leader that joined its followers first would wait on them while they wait in
        # their own teardown for it (on two H200s that cost the 30 s join time-out at every shutdown; gloo's
        # teardown is local, which is why the CPU tests never saw it).
        if self.size > 1:
            quiesce_for_teardown(self.engine)
            destroy_distributed()
            faulthandler.cancel_dump_traceback_later()
        if self.procs:
            stop_local_ranks(self.procs, timeout_s=30.0 if connected else 0.0)
            self.procs = []
        self.engine = None


def _tp_follower_main(rank: int, dist_cfg: DistConfig, llm_kwargs: dict[str, Any], ready: Any) -> None:
    """Entry point of a spawned follower of an offline ``LLM(tp_size=N)``: build the same LLM as rank ``rank``,
    then follow the leader until it stops."""
    exit_with_parent()
    threads = os.environ.get("MINISGL_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    try:
        llm = LLM(**llm_kwargs, tp_size=dist_cfg.tp_size, nnodes=dist_cfg.nnodes, node_rank=dist_cfg.node_rank,
                  dist_init_addr=dist_cfg.dist_init_addr, tp_rank=rank, _ready=ready)
    except Exception as e:  # noqa: BLE001 - reported to the leader, which raises it
        try:
            ready.send({"error": f"rank {rank}: {type(e).__name__}: {e}"})
        except (OSError, ValueError):
            pass
        raise SystemExit(1) from e
    llm.follow()


class LLM:
    """An engine in a Python object. ``LLM()`` loads the embedded SmolLM2-135M-Instruct; ``LLM(model_path=...)``
    any local HF folder; ``LLM(model_path="qwen3-0.6b", load_format="dummy")`` a shipped config with random
    weights (no tokenizer: pass token ids).

    ``engine="paged"`` (default) is the real engine of chapters 03-06, configured by SGLang-named keyword
    arguments (``max_running_requests``, ``chunked_prefill_size``, ``page_size``, ``disable_radix_cache``, ...,
    see :class:`EngineConfig`); ``engine="naive"`` is the chapter-00 oracle that recomputes everything.

    ``tp_size=N`` (chapter 09) shards the model over N ranks: this process becomes rank 0 and starts ranks
    1..N-1 as child processes (one GPU each, or CPU processes talking through gloo), which follow it step by
    step. ``nnodes``, ``node_rank`` and ``dist_init_addr`` spread the ranks over machines, as in SGLang; on a
    node other than 0, call :meth:`follow` instead of generating. :meth:`shutdown` (or a ``with`` block, or the
    end of the program) stops the other ranks. ``tp_rank`` is for processes started by someone else (the server
    starts one scheduler process per rank)."""

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        load_format: str = "auto",
        dtype: str | torch.dtype = "auto",
        device: str | None = None,
        context_length: int | None = None,
        engine: str = "paged",
        skip_tokenizer_init: bool = False,
        tp_size: int = 1,
        nnodes: int = 1,
        node_rank: int = 0,
        dist_init_addr: str | None = None,
        tp_rank: int | None = None,
        _ready: Any = None,
        **engine_kwargs: Any,
    ) -> None:
        if engine not in ("paged", "naive"):
            raise ValueError(f"engine must be 'paged' or 'naive', got {engine!r}")
        engine_config = EngineConfig(**engine_kwargs)
        self.device = torch.device(device or default_device())
        # Tensor parallelism (chapter 09): this process is one rank; at tp_size=1 nothing below starts anything.
        self.tp_size, self.tp_rank = tp_size, 0
        self._tp = TPHandle(tp_size)
        dist_cfg = None
        if tp_size > 1 or nnodes > 1:
            if engine != "paged":
                raise ValueError(f"tp_size={tp_size} needs engine='paged' (the naive oracle runs on one device)")
            dist_cfg, ready_conns = self._start_tp(
                DistConfig(tp_size, 0, nnodes, node_rank, dist_init_addr), tp_rank,
                dict(model_path=None if model_path is None else str(model_path), load_format=load_format,
                     dtype=dtype, device=device, context_length=context_length, engine=engine,
                     skip_tokenizer_init=skip_tokenizer_init, **engine_kwargs),
            )
            # Stop the other ranks when this object goes away (or at exit), even without shutdown().
            self._tp_finalizer = weakref.finalize(self, self._tp.close)
        try:
            self.model, self.config, folder = load_model(
                None if model_path is None else str(model_path), load_format=load_format, dtype=dtype,
                device=self.device,
            )
            if dist_cfg is not None:
                self._join_tp(dist_cfg, ready_conns, _ready)
        except BaseException:
            self.shutdown()
            raise
        self.model_path = folder
        self.tokenizer: Tokenizer | None = None
        if folder is not None and load_format != "dummy" and not skip_tokenizer_init:
            if any((folder / name).is_file() for name in TOKENIZER_FILES):
                self.tokenizer = Tokenizer.from_pretrained(folder)
            # else: a weights-only folder; like SGLang's --skip-tokenizer-init, prompts must be token ids
        eos = set(self.config.eos_token_ids)
        if self.tokenizer is not None:
            eos |= self.tokenizer.eos_token_ids
        self.eos_token_ids = frozenset(eos)
        self.context_length = context_length or self.config.max_position_embeddings
        if self.context_length < 2:
            raise ValueError(f"context_length must be at least 2, got {self.context_length}")
        self.engine_kind = engine
        self.engine: Engine | NaiveEngine
        if engine == "naive":
            self.engine = NaiveEngine(self.model, self.config.vocab_size, self.device)
        elif dist_cfg is not None:
            self.engine = TPEngine(self.model, self.config, engine_config, device=self.device,
                                   context_length=self.context_length, tokenizer=self.tokenizer)
            self._tp.engine = self.engine
        else:
            self.engine = Engine(self.model, self.config, engine_config, device=self.device,
                                 context_length=self.context_length)

    # ------------------------------------------------------------------------------ tensor parallelism (ch. 09)

    def _start_tp(self, cfg: DistConfig, tp_rank: int | None, llm_kwargs: dict[str, Any]) -> tuple[DistConfig, list]:
        """Take this process's rank and, when it launches its node (``tp_rank is None``), spawn the node's other
        ranks. They load their shards while this process loads its own; the process group starts afterwards."""
        launcher = tp_rank is None
        if launcher:
            if cfg.nnodes == 1:
                cfg = cfg.with_free_port()
            cfg = cfg.with_rank(cfg.node_ranks()[0])
        else:
            cfg = cfg.with_rank(tp_rank)
        self.tp_rank = cfg.tp_rank
        self.device = rank_device(cfg, self.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            # Ranks on one CPU share its cores; more threads than cores makes every rank spin at each barrier.
            threads = os.environ.get("MINISGL_THREADS") or max(1, (os.cpu_count() or 1) // cfg.ranks_per_node)
            torch.set_num_threads(int(threads))
        set_tp_info(cfg.tp_rank, cfg.tp_size)
        conns: list = []
        if launcher:
            others = [r for r in cfg.node_ranks() if r != cfg.tp_rank]
            self._tp.procs, conns = spawn_local_ranks(cfg, others, _tp_follower_main, llm_kwargs)
        return cfg, conns

    def _join_tp(self, cfg: DistConfig, conns: list, ready: Any) -> None:
        if ready is not None:  # a spawned rank: tell the launcher that the weights are loaded
            ready.send({"ok": cfg.tp_rank})
            ready.close()
        wait_ready(self._tp.procs, conns)
        init_distributed(cfg, self.device)

    @property
    def is_leader(self) -> bool:
        """Only rank 0 takes requests; the other ranks :meth:`follow` it."""
        return self.tp_rank == 0

    def follow(self) -> None:
        """On a rank other than 0: replay rank 0's steps until it shuts down, then leave the process group."""
        if not isinstance(self.engine, TPEngine) or self.is_leader:
            raise ValueError("follow() is for tensor-parallel ranks other than 0")
        try:
            self.engine.follow()
        finally:
            quiesce_for_teardown(self.engine)
            destroy_distributed()
            faulthandler.cancel_dump_traceback_later()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks and leave the process group (a no-op at tp=1). Also runs at exit
        and at the end of a ``with LLM(...) as llm:`` block."""
        finalizer = getattr(self, "_tp_finalizer", None)
        if finalizer is not None:
            finalizer()  # runs TPHandle.close once
        else:
            self._tp.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ----------------------------------------------------------------------------------------------- requests

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is text but this model has no tokenizer (dummy weights): pass token ids")
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt must be a string or a non-empty list of token ids (ints)")
        if any(t < 0 or t >= self.config.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must lie in [0, {self.config.vocab_size})")
        return ids

    def make_request(self, prompt: Prompt, params: SamplingParams, **options: Any) -> Req:
        """A :class:`Req` for ``prompt``; ``options`` are per-request fields of :class:`Req` (``return_logprob``,
        ``top_logprobs_num``, ``logprob_start_len``, ``cache_salt``)."""
        if not self.is_leader:
            raise ValueError(f"this process is tensor-parallel rank {self.tp_rank}; only rank 0 takes requests")
        input_ids = self._encode(prompt)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=params.skip_special_tokens, stop=params.stop,
                stop_regex=params.stop_regex,
                prompt_ids=input_ids,  # context, so a sentencepiece first token keeps its leading space
            )
        elif params.stop or params.stop_regex:
            raise ValueError("stop strings and stop_regex need a tokenizer; this model has none (use stop_token_ids)")
        req = Req(
            input_ids=input_ids,
            params=params,
            eos_token_ids=self.eos_token_ids,
            detokenizer=detok,
            context_len=self.context_length,
            **options,
        )
        problem = req.token_id_problem(self.config.vocab_size)
        if problem is not None:
            raise ValueError(problem)
        return req

    @staticmethod
    def _params_list(params: Any, n_prompts: int) -> list[SamplingParams]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, (SamplingParams, Mapping)):
            params = [params] * n_prompts
        if len(params) != n_prompts:
            raise ValueError(f"sampling_params has {len(params)} entries for {n_prompts} prompts")
        return [p if isinstance(p, SamplingParams) else SamplingParams.from_dict(p) for p in params]

    # ------------------------------------------------------------------------------------------------ generate

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Mapping[str, Any] | Sequence[Any] | None = None,
        *,
        use_tqdm: bool = True,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
    ) -> list[GenerateOutput]:
        """Complete each prompt. With ``n > 1`` a prompt yields n outputs, consecutive in the returned list.

        ``return_logprob`` adds each output token's log probability (and its ``top_logprobs_num`` most likely
        alternatives) to the outputs, and the prompt's from position ``logprob_start_len`` on (-1: none); SGLang's
        names and meaning (chapter 10)."""
        options: dict[str, Any] = {}
        if return_logprob:
            if isinstance(self.engine, NaiveEngine):
                raise ValueError("return_logprob needs the paged engine (engine='paged')")
            options = dict(return_logprob=True, top_logprobs_num=top_logprobs_num,
                           logprob_start_len=logprob_start_len)
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params_list = self._params_list(sampling_params, len(prompts))
        reqs: list[Req] = []
        for prompt, params in zip(prompts, params_list):
            for _ in range(params.n):
                reqs.append(self.make_request(prompt, params, **options))
        self._run(reqs, use_tqdm)
        return [self._output(r) for r in reqs]

    def chat(
        self,
        conversations: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Mapping[str, Any] | Sequence[Any] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[GenerateOutput]:
        """Apply the model's chat template to each conversation (a list of ``{"role", "content"}``) and generate."""
        if conversations and isinstance(conversations[0], Mapping):
            conversations = [conversations]  # type: ignore[list-item]
        prompts = [self.chat_prompt_ids(c) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat_prompt_ids(self, messages: Messages) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; this model has none (dummy weights)")
        return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one request piece by piece as it is generated (the CLI chat uses this)."""
        params = sampling_params or SamplingParams()
        req = self.make_request(prompt, params)
        if isinstance(self.engine, NaiveEngine):
            while not req.finished:
                for _, delta in self.engine.step([req]):
                    if delta:
                        yield delta
        else:
            self.engine.add_request(req)
            while not req.finished:
                for event in self.engine.step():
                    if event.req is req and event.delta:
                        yield event.delta
            self.engine.run_until_done()  # drain the step still in flight
        self.last_output = self._output(req)

    # ------------------------------------------------------------------------------------------------- helpers

    def _run(self, reqs: list[Req], use_tqdm: bool) -> None:
        bar = tqdm(total=len(reqs), desc="generate", unit="req", disable=not use_tqdm or len(reqs) < 2)
        done = sum(r.finished for r in reqs)
        bar.update(done)
        if isinstance(self.engine, NaiveEngine):
            step = lambda: self.engine.step(reqs)  # noqa: E731
        else:
            for r in reqs:
                self.engine.add_request(r)
            step = self.engine.step
        while not all(r.finished for r in reqs):
            step()
            now = sum(r.finished for r in reqs)
            bar.update(now - done)
            done = now
        if isinstance(self.engine, Engine):
            self.engine.run_until_done()  # drain the step still in flight (overlap)
        bar.close()

    @staticmethod
    def _output(req: Req) -> GenerateOutput:
        assert req.finish_reason is not None
        return GenerateOutput(
            text=req.output_text,
            output_ids=list(req.output_ids),
            finish_reason=req.finish_reason.kind,
            matched_stop=req.finish_reason.matched,
            prompt_tokens=len(req.input_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            rid=req.rid,
            input_token_logprobs=[(e.logprob, t, e.top) for e, t in zip(
                req.input_logprobs, req.input_ids[max(req.logprob_start_len, 0):])] if req.return_logprob else None,
            output_token_logprobs=[(e.logprob, t, e.top) for e, t in zip(req.output_logprobs, req.output_ids)]
            if req.return_logprob else None,
        )
