"""The offline API: ``LLM(...).generate(prompts, params)`` (chapters 00-02).

This is the front door for scripts, notebooks and tests: it owns a model, a tokenizer and an engine, turns
prompts into :class:`Req` objects, runs them to completion and returns plain results. The engine underneath gets
faster chapter by chapter; this interface does not change.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from minisgl_ref.constrained import spec_of, validate_grammar
from minisgl_ref.core.config import EngineConfig, ModelArgs, TPArgs
from minisgl_ref.core.request import LogprobRequest, Req, are_token_ids, first_outside
from minisgl_ref.engine.engine import Engine
from minisgl_ref.engine.naive import NaiveEngine
from minisgl_ref.moe.distribution import ExpertDistribution
from minisgl_ref.runtime import build_runtime
from minisgl_ref.sampling.params import SamplingParams
from minisgl_ref.speculative.config import SpeculativeConfig
from minisgl_ref.tokenizer import IncrementalDetokenizer
from minisgl_ref.tp.group import TPGroup

Prompt = str | Sequence[int]
Messages = Sequence[Mapping[str, Any]]


@dataclass
class GenerateOutput:
    """One completion. ``finish_reason`` is ``stop``, ``length`` or ``abort``; ``matched_stop`` is the stop
    token id or stop string that ended it, if any."""

    text: str  #: the output as text (stop strings and the stop token left out)
    output_ids: list[int]  #: the output token ids, the stop token included
    finish_reason: str  #: ``stop``, ``length`` or ``abort``
    matched_stop: int | str | None  #: the stop token id or stop string that ended it, if any
    prompt_tokens: int  #: tokens in the prompt
    completion_tokens: int  #: tokens in the output
    cached_tokens: int = 0  #: prompt tokens whose KV came from the radix cache (chapter 04)
    rid: str = ""  #: the request's id
    #: With return_logprob: (logprob, token id, [(alternative id, logprob), ...]) per token; the first prompt
    #: token's logprob is None.
    input_token_logprobs: list[tuple[float | None, int, list[tuple[int, float]]]] | None = None
    output_token_logprobs: list[tuple[float, int, list[tuple[int, float]]]] | None = None  #: the same per output token

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class LLM:
    """An engine in a Python object. ``LLM()`` loads the embedded SmolLM2-135M-Instruct; ``LLM(model_path=...)``
    any local HF folder; ``LLM(model_path="qwen3-0.6b", load_format="dummy")`` a shipped config with random
    weights (no tokenizer: pass token ids).

    ``engine="paged"`` (default) is the real engine of chapters 03-06, configured by SGLang-named keyword
    arguments (``max_running_requests``, ``chunked_prefill_size``, ``page_size``, ``disable_radix_cache``, ...,
    see :class:`EngineConfig`, and the ``speculative_*`` ones of chapter 13's :class:`SpeculativeConfig`:
    ``speculative_algorithm="NGRAM"``, say); ``engine="naive"`` is the chapter-00 oracle that recomputes everything.

    ``tp_size=N`` (chapter 09) shards the model over N ranks: this process becomes rank 0 and starts ranks
    1..N-1 as child processes (one GPU each, or CPU processes talking through gloo), which follow it step by
    step. ``nnodes``, ``node_rank`` and ``dist_init_addr`` spread the ranks over machines, as in SGLang; on a
    node other than 0, call :meth:`follow` instead of generating. :meth:`shutdown` (or a ``with`` block, or the
    end of the program) stops the other ranks. ``tp_rank`` is for processes started by someone else, one per
    rank. ``ep_size=N`` (with ``tp_size=N``, chapter 14) splits each MoE layer's experts over the ranks (an MoE model
    needs it at ``tp_size > 1``), and ``enable_expert_distribution_metrics=True`` counts which experts the router
    picks (:meth:`start_expert_distribution_record`). ``quantization="fp8"`` stores an ordinary checkpoint's
    projections in FP8 (chapter 15; an FP8 checkpoint needs no flag). :func:`~minisgl_ref.runtime.build_runtime`
    does the building."""

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
        ep_size: int = 1,
        tp_rank: int | None = None,
        enable_expert_distribution_metrics: bool = False,
        quantization: str | None = None,
        **engine_kwargs: Any,
    ) -> None:
        model = ModelArgs(None if model_path is None else str(model_path), load_format, dtype,  # type: ignore[arg-type]
                          device, context_length, skip_tokenizer_init, quantization)
        tp = TPArgs(tp_size, nnodes, node_rank, dist_init_addr, ep_size)
        group = TPGroup.member(tp, tp_rank) if tp_rank is not None and tp.enabled else None  # started elsewhere
        speculative, engine_kwargs = SpeculativeConfig.split(engine_kwargs)  # chapter 13's speculative_* settings
        rt = build_runtime(model, EngineConfig(**engine_kwargs), tp, kind=engine, group=group, speculative=speculative,
                           expert_distribution=enable_expert_distribution_metrics)
        self.runtime, self.engine_kind, self.tp_size, self.tp_rank = rt, engine, tp_size, rt.tp_rank
        self.model, self.config, self.model_path, self.device = rt.model, rt.model_config, rt.model_path, rt.device
        self.tokenizer, self.eos_token_ids, self.context_length = rt.tokenizer, rt.eos_token_ids, rt.context_length
        self.engine: Engine | NaiveEngine = rt.engine
        # Stop the other ranks when this object goes away (or at exit), even without shutdown().
        self._finalizer = weakref.finalize(self, rt.shutdown)

    @property
    def is_leader(self) -> bool:
        """Only rank 0 takes requests; the other ranks :meth:`follow` it."""
        return self.runtime.is_leader

    def follow(self) -> None:
        """On a rank other than 0 (``node_rank > 0``): replay rank 0's steps until it shuts down."""
        self.runtime.follow()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks and leave the process group (a no-op at tp=1). Also runs at exit
        and at the end of a ``with LLM(...) as llm:`` block."""
        self._finalizer()

    # -------------------------------------------------------------------- chapter 14: the experts' routing

    def _expert_distribution(self) -> ExpertDistribution:
        counter = self.runtime.expert_distribution
        if counter is None:
            raise ValueError("no expert distribution is counted: build the LLM of an MoE model with "
                             "enable_expert_distribution_metrics=True")
        return counter

    def start_expert_distribution_record(self) -> None:
        """Clear the routing counts and count every step from now on (SGLang's name)."""
        self._expert_distribution().start()

    def stop_expert_distribution_record(self) -> None:
        """Stop counting; the counts stay readable."""
        self._expert_distribution().stop()

    def dump_expert_distribution_record(self) -> dict[str, Any]:
        """The counts: steps, tokens, and per sparse layer the (token, choice) pairs per expert and the mean
        number of distinct experts a step read (:meth:`ExpertDistribution.dump`)."""
        return self._expert_distribution().dump()

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
        if not ids or not are_token_ids(ids):
            raise ValueError("prompt must be a string or a non-empty list of token ids (ints)")
        # Checked here as well as in Req.token_id_problem: the detokenizer decodes the prompt's last ids first.
        if first_outside(ids, self.config.vocab_size) is not None:
            raise ValueError(f"prompt token ids must lie in [0, {self.config.vocab_size})")
        return ids

    def make_request(self, prompt: Prompt, params: SamplingParams, **options: Any) -> Req:
        """A :class:`Req` for ``prompt``; ``options`` are per-request fields of :class:`Req` (``logprobs``,
        ``cache_salt``)."""
        if not self.is_leader:
            raise ValueError(f"this process is tensor-parallel rank {self.tp_rank}; only rank 0 takes requests")
        spec = spec_of(params)
        if spec is not None:  # structured output (chapter 12): a bad grammar is refused before anything runs
            if isinstance(self.engine, NaiveEngine):
                raise ValueError(f"{spec.field} needs the paged engine (engine='paged')")
            if self.tokenizer is None:
                raise ValueError(f"{spec.field} needs a tokenizer; this model has none")
            validate_grammar(params)
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
        alternatives) to the outputs, and the prompt's from position ``logprob_start_len`` on (-1: none; SGLang's
        names, chapter 10, though SGLang's -1 means the last prompt token, as the server's ``/generate`` does).
        With ``max_new_tokens=0`` and ``logprob_start_len >= 0`` a request only scores its prompt: one prefill,
        no output token (``Req.prefill_only``)."""
        wanted: LogprobRequest | None = None
        if return_logprob:
            if isinstance(self.engine, NaiveEngine):
                raise ValueError("return_logprob needs the paged engine (engine='paged')")
            wanted = LogprobRequest(top_logprobs_num, logprob_start_len)
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params_list = self._params_list(sampling_params, len(prompts))
        reqs: list[Req] = []
        for prompt, params in zip(prompts, params_list):
            for _ in range(params.n):
                # every request gets its own copy of the question, to fill in with its own answers
                logprobs = wanted.fresh() if wanted is not None else None
                reqs.append(self.make_request(prompt, params, logprobs=logprobs))
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
        lp = req.logprobs
        return GenerateOutput(
            text=req.output_text,
            output_ids=list(req.output_ids),
            finish_reason=req.finish_reason.kind,
            matched_stop=req.finish_reason.matched,
            prompt_tokens=len(req.input_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            rid=req.rid,
            input_token_logprobs=None if lp is None else [(e.logprob, t, e.top) for e, t in zip(
                lp.prompt, req.input_ids[max(lp.start, 0):])],
            output_token_logprobs=None if lp is None else [(e.logprob, t, e.top) for e, t in zip(
                lp.output, req.output_ids)],
        )
