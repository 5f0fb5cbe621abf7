"""``python -m minisgl_ref bench offline``: how fast the engine finishes a fixed pile of requests (chapter 11).

Offline throughput is the simplest honest engine benchmark: hand the whole workload to one ``LLM.generate`` call,
time that call, and divide the output tokens by the wall time. Nothing about arrival times or latency, just
how well the engine keeps the device busy. This module adds the three things that turn that into a
measurement worth publishing:

1. **The stage ladder.** ``--stage`` rebuilds the engine as it stood after each chapter, one feature at a time,
   so the table shows what each idea is worth on this workload and this machine:

   ==========  ==================================================================================
   stage       engine
   ==========  ==================================================================================
   naive       chapter 00's oracle: no KV cache, every step recomputes every sequence
   paged       chapter 03: paged KV cache + continuous batching (radix, chunking, overlap off)
   radix       chapter 04: + prefix sharing through the radix cache
   chunked     chapter 05: + chunked prefill
   overlap     chapter 06: + overlap scheduling (this is the default engine)
   ==========  ==================================================================================

2. **Counters next to the clock.** Besides tokens per second each run reports how many prompt tokens were
   actually computed (``engine.stats.prefill_tokens``), how many were served from the cache, the radix hit
   rate and the number of retractions: the *why* behind a time. With cascade decode attention active (radix
   cache on, ``--disable-cascade-attention`` not given) it also reports the KV bytes an average decode step
   read with the cascade and would have read without it (:func:`~minisgl_ref.perf.cascade.decode_kv_bytes`,
   summed by :mod:`~minisgl_ref.bench.cascade_stats`), and how many decode steps ran it.

3. **The roofline.** A decode step must at least read every weight once and every running request's KV cache
   once (chapter 11). :func:`roofline_floor_seconds` turns that into the least time any
   engine could take on a workload at a given memory bandwidth; on CUDA every run is also reported as a
   fraction of that floor.

``--quick`` shrinks everything (workload, budgets, and a tiny Qwen3-shaped model with random weights) so the
whole ladder runs on two CPU cores in seconds; the numbers then teach ratios, not absolute speed.
``--output FILE.json`` saves the results with :mod:`~minisgl_ref.bench.provenance`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from minisgl_ref import env
from minisgl_ref.bench.cascade_stats import cascade_stats
from minisgl_ref.bench.provenance import collect_provenance
from minisgl_ref.bench.workloads import Workload, canonical_workload, shared_prefix_workload, warmup_workload
from minisgl_ref.core.config import EngineConfig
from minisgl_ref.bench.step_trace import StepTrace
from minisgl_ref.models.config import ModelConfig
from minisgl_ref.models.loader import MODEL_REGISTRY, shipped_config_names
from minisgl_ref.models.weights import checkpoint_shapes
from minisgl_ref.quant.linear import linear_layers

# ------------------------------------------------------------------------------------------------ presets

STAGES = ("naive", "paged", "radix", "chunked", "overlap")

#: H100 SXM HBM bandwidth measured by a device-to-device copy; the datasheet says 3.35e12.
H100_MEASURED_BANDWIDTH = 3.0e12

#: The model of the published canonical numbers (random weights: throughput does not depend on their values).
DEFAULT_MODEL = "qwen3-0.6b"

#: A Qwen3-shaped model small enough for two CPU cores, yet big enough that computing a token costs more than
#: scheduling it, so that saving prefill work (the radix cache) shows up in the wall time. Its vocabulary
#: holds the workloads' token ids 0..10000.
QUICK_MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 10240,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}
QUICK_MODEL_NAME = "quick-tiny-qwen3"

#: Engine budgets the CLI uses unless given: the engine's own defaults, and a ``--quick`` set scaled down with
#: the workload so that prefill steps still hold only a few prompts each (as they do at full size, where 16384
#: tokens are a small slice of the workload). With everything admitted in one step no request could reuse
#: another's prefix: the tree is filled only after the step that computes it.
FULL_BUDGETS = {"max_prefill_tokens": EngineConfig.max_prefill_tokens,
                "chunked_prefill_size": EngineConfig.chunked_prefill_size}
QUICK_BUDGETS = {"max_prefill_tokens": 1024, "chunked_prefill_size": 512}

#: ``--quick`` workloads: the same recipes, CPU-sized. The shared-prefix one is prefill-dominated on purpose
#: (long shared system prompts, short questions and answers) so that the radix cache's saving is large and its
#: effect on wall time survives a noisy, shared machine.
QUICK_CANONICAL = {"num_prompts": 8, "input_len": (32, 128), "output_len": (8, 32)}
QUICK_SHARED_PREFIX = {"num_groups": 4, "prompts_per_group": 8, "system_len": 480, "question_len": 32,
                       "output_len": 4}
FULL_SHARED_PREFIX = {"num_groups": 64, "prompts_per_group": 16, "system_len": 2048, "question_len": 128,
                      "output_len": 256}


# ------------------------------------------------------------------------------------------------- stages


def stage_settings(stage: str, base: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The ``(engine, engine_kwargs)`` of a ladder stage, starting from the user's engine arguments ``base``.

    Each stage switches on one more feature than the one before; everything else (budgets, page size, pool
    size) stays as given, so neighbouring stages differ in exactly one idea."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {', '.join(STAGES)} or 'all', got {stage!r}")
    if stage == "naive":
        return "naive", {}
    level = STAGES.index(stage)
    kwargs = dict(base)
    kwargs["disable_radix_cache"] = level < STAGES.index("radix")
    if level < STAGES.index("chunked"):
        kwargs["chunked_prefill_size"] = -1
    elif kwargs.get("chunked_prefill_size", EngineConfig.chunked_prefill_size) == -1:
        raise ValueError(f"stage {stage!r} includes chunked prefill: give --chunked-prefill-size > 0")
    kwargs["disable_overlap_schedule"] = level < STAGES.index("overlap")
    return "paged", kwargs


def stage_of(engine: str, kwargs: dict[str, Any]) -> str:
    """The name of the ladder stage that an engine configuration is (``custom`` if it is none of them)."""
    if engine == "naive":
        return "naive"
    radix = not kwargs.get("disable_radix_cache", False)
    chunked = kwargs.get("chunked_prefill_size", EngineConfig.chunked_prefill_size) != -1
    overlap = not kwargs.get("disable_overlap_schedule", False)
    features = (radix, chunked, overlap)
    for stage, expected in (("paged", (False, False, False)), ("radix", (True, False, False)),
                            ("chunked", (True, True, False)), ("overlap", (True, True, True))):
        if features == expected:
            return stage
    return "custom"


def parse_stages(text: str) -> list[str]:
    """``all``, or a comma-separated list of stage names such as ``paged,radix``."""
    if text == "all":
        return list(STAGES)
    stages = [s.strip() for s in text.split(",") if s.strip()]
    for s in stages:
        if s not in STAGES:
            raise argparse.ArgumentTypeError(f"unknown stage {s!r} (choose from {', '.join(STAGES)} or all)")
    return stages


# ----------------------------------------------------------------------------------------------- roofline


def weight_bytes(config: ModelConfig) -> int:
    """Bytes of all weights in ``config.dtype``: what every decode step must stream from memory at least once.

    Counted from the checkpoint's tensor shapes, so a tied embedding counts once (the LM head reads it; the
    embedding lookup reads only a few rows)."""
    shapes = MODEL_REGISTRY[config.architecture].checkpoint_shapes(config)
    # `shapes`: checkpoint tensor name -> shape; what is left is elements times bytes per element (of
    # config.dtype: 2 in bf16, 4 in float32).
    # BEGIN TASK 11.2: the decode roofline
    elem = torch.finfo(config.dtype).bits // 8
    return sum(math.prod(shape) for shape in shapes.values()) * elem
    # END TASK 11.2


def context_token_sum(prompt_lens: Sequence[int], output_lens: Sequence[int]) -> int:
    """Sum over every generated token of the context it attends to: request i's j-th output token
    (j = 0 .. O_i - 1) sees its P_i prompt tokens and j earlier outputs, so the sum is
    ``sum_i (O_i * P_i + O_i * (O_i - 1) / 2)``.

    Two readings of the same number: the KV entries a cached engine must *read* over the whole workload, and
    the tokens the naive oracle *recomputes* (it feeds ``P_i + j`` tokens to produce token j)."""
    # BEGIN TASK 11.2: the decode roofline
    return sum(o * p + o * (o - 1) // 2 for p, o in zip(prompt_lens, output_lens))
    # END TASK 11.2


def roofline_floor_seconds(
    prompt_lens: Sequence[int],
    output_lens: Sequence[int],
    weight_bytes: int,
    kv_bytes_per_token: int,
    bandwidth: float = H100_MEASURED_BANDWIDTH,
) -> float:
    """The least time any engine needs to decode a workload when memory bandwidth is the limit.

    The most favourable schedule runs every request from the first step (memory permitting), so there are
    ``max(O_i)`` steps and each reads the weights once; and every output token must read the KV of the context
    before it, whatever the schedule. Prefill is treated as free (it is compute-bound and short). So::

        bytes = max_i(O_i) * weight_bytes + sum_i sum_j (P_i + j) * kv_bytes_per_token
        floor = bytes / bandwidth

    For the canonical workload on Qwen3-0.6B in bf16 (1.19 GB of weights, 114,688 KV bytes per token) this is
    5.03 s at the H100's measured 3.0 TB/s (26.6k output tok/s) and 4.50 s at its datasheet 3.35 TB/s
    (29.7k tok/s): that is the datasheet figure. The KV term is :func:`context_token_sum`."""
    # BEGIN TASK 11.2: the decode roofline
    steps = max(output_lens, default=0)
    total = steps * weight_bytes + context_token_sum(prompt_lens, output_lens) * kv_bytes_per_token
    return total / bandwidth
    # END TASK 11.2


def routed_floor_seconds(config: ModelConfig, record: dict[str, Any], context_tokens: int,
                         bandwidth: float) -> float:
    """The floor of an MoE run whose routing was counted (chapter 14): the least time its steps could take if
    each read only what it needs, at ``bandwidth``.

    A step reads every weight that is not an expert (attention, norms, routers, embeddings and LM head, as
    :func:`weight_bytes` counts them) and, of each sparse layer, the experts at least one of its tokens picked;
    every output token reads the KV of its context, as in :func:`roofline_floor_seconds`. ``record`` is
    :meth:`~minisgl_ref.moe.distribution.ExpertDistribution.dump` of the run: its ``steps`` and, per layer, the
    sum over the steps of the distinct experts picked. So::

        bytes = steps * non_expert_bytes + sum_layers(active_expert_steps) * expert_bytes
                + context_tokens * kv_bytes_per_token

    Unlike chapter 11's floor, which assumes the kindest schedule (``max(O_i)`` steps, each reading all
    weights), this one charges the steps the engine really took, prefill steps included: it says how close each
    of them came to the bytes it had to move, not whether there could have been fewer steps."""
    moe = MODEL_REGISTRY[config.architecture].moe_config(config)  # type: ignore[attr-defined]
    elem = torch.finfo(config.dtype).bits // 8
    expert = 3 * config.hidden_size * moe.intermediate_size * elem  # gate, up and down of one expert
    non_expert = weight_bytes(config) - len(record["layer_ids"]) * moe.num_experts * expert
    total = (record["steps"] * non_expert + sum(record["active_expert_steps"]) * expert
             + context_tokens * config.kv_bytes_per_token)
    return total / bandwidth


def stored_bytes(llm) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """``(weight bytes, KV bytes per token)`` as this engine stores them: chapter 11's counts from the config,
    unless chapter 15 stores fewer. FP8 projections: the bytes of the built model's parameters (one per weight,
    plus the float32 scales; one process's model, so tensor parallelism keeps the config's count). An FP8 cache:
    one byte per key and value element."""
    config = llm.config
    weights = weight_bytes(config)
    quantized = any(layer.quant_method.quantized for _, layer in linear_layers(llm.model))
    if quantized and getattr(llm, "tp_size", 1) == 1:
        seen: dict[int, int] = {}
        for p in llm.model.parameters():  # a tied embedding is one tensor, counted once
            seen[p.data_ptr()] = p.numel() * p.element_size()
        weights = sum(seen.values())
    pool = getattr(getattr(llm, "engine", None), "kv_pool", None)
    kv = config.kv_bytes_per_token
    if pool is not None and pool.quantized:
        kv = type(pool).bytes_per_slot(config.num_layers, config.num_kv_heads, config.head_dim, config.dtype)
    return weights, kv


def workload_floor_seconds(workload: Workload, config: ModelConfig, bandwidth: float,
                           stored: tuple[int, int] | None = None) -> float:
    """:func:`roofline_floor_seconds` of a workload on a model (all requests run to ``max_new_tokens``);
    ``stored``: the engine's own ``(weight bytes, KV bytes per token)`` (:func:`stored_bytes`), if not the
    config's."""
    prompt_lens = [len(p) for p in workload.prompts]
    output_lens = [p["max_new_tokens"] for p in workload.sampling_params]
    weights, kv = stored or (weight_bytes(config), config.kv_bytes_per_token)
    return roofline_floor_seconds(prompt_lens, output_lens, weights, kv, bandwidth)


# ------------------------------------------------------------------------------------------------- models


@dataclass
class ModelSpec:
    """Which model to benchmark: what ``LLM(model_path, load_format=...)`` receives, and how to name it.

    ``config`` is set for the built-in ``--quick`` model, which exists only as this config dict."""

    path: str | None
    load_format: str = "auto"
    dtype: str = "auto"
    device: str | None = None
    context_length: int | None = None
    name: str = ""
    config: dict[str, Any] | None = None
    quantization: str | None = None  # chapter 15: store an ordinary checkpoint's projections in FP8

    def describe(self) -> dict[str, Any]:
        return {"name": self.name or str(self.path), "path": self.path, "load_format": self.load_format,
                "dtype": self.dtype, "device": self.device, "context_length": self.context_length,
                "config": self.config, "quantization": self.quantization}


def quick_model(device: str | None = "cpu") -> ModelSpec:
    """The tiny random-weight model of ``--quick``."""
    return ModelSpec(None, "dummy", "auto", device, None, QUICK_MODEL_NAME, dict(QUICK_MODEL_CONFIG))


def resolve_model(model_path: str | None, load_format: str | None, *, quick: bool, dtype: str = "auto",
                  device: str | None = None, context_length: int | None = None,
                  quantization: str | None = None) -> ModelSpec:
    """The model the CLI flags ask for. Without ``--model-path``: the tiny model under ``--quick``, else
    Qwen3-0.6B with dummy weights. Without ``--load-format``: dummy weights for a shipped config name such as
    ``qwen3-0.6b`` (there are no real ones here), the checkpoint's own weights for anything else."""
    if model_path is None:
        spec = quick_model() if quick else ModelSpec(DEFAULT_MODEL, "dummy", name=DEFAULT_MODEL)
    else:
        shipped = not Path(model_path).expanduser().is_dir() and model_path.split("/")[-1].lower() in (
            shipped_config_names())
        spec = ModelSpec(model_path, "dummy" if shipped else "auto", name=model_path)
    if load_format is not None:
        spec.load_format = load_format
    spec.dtype, spec.device, spec.context_length = dtype, device, context_length
    spec.quantization = quantization
    return spec


def build_llm(model: ModelSpec, engine: str, engine_kwargs: dict[str, Any]):  # type: ignore[no-untyped-def]
    """A fresh ``LLM`` for one run. Dummy weights are seeded by tensor name, so every stage gets the same model."""
    from minisgl_ref.llm import LLM  # imported here: it pulls in transformers, which --help does not need

    def make(path: str | None):  # type: ignore[no-untyped-def]
        return LLM(path, load_format=model.load_format, dtype=model.dtype, device=model.device,
                   context_length=model.context_length, engine=engine, quantization=model.quantization,
                   **engine_kwargs)

    if model.config is None:
        return make(model.path)
    with tempfile.TemporaryDirectory(prefix="minisgl_quick_") as folder:  # the weights are random: only the
        (Path(folder) / "config.json").write_text(json.dumps(model.config))  # config has to exist on disk
        return make(folder)


# ------------------------------------------------------------------------------------------------ running


@dataclass
class RunResult:
    """One timed ``generate`` call. Throughputs are tokens per second of wall time."""

    stage: str
    engine: str
    engine_args: dict[str, Any]
    device: str
    dtype: str
    requests: int
    input_tokens: int
    output_tokens: int
    wall_s: float
    output_throughput: float
    total_throughput: float
    prefill_tokens: int  # prompt tokens whose KV was computed (the naive oracle: every token it fed the model)
    cached_tokens: int  # prompt tokens served from the radix cache
    radix_hit_rate: float | None  # cached / prompt tokens of the run; None without a radix cache
    retractions: int
    steps: int | None
    aborted: int = 0
    roofline_floor_s: float | None = None  # CUDA only: the workload's floor at --hbm-bandwidth
    roofline_fraction: float | None = None  # floor / wall: 1.0 would be a perfect engine
    # Cascade decode attention (None when the engine has none): decode steps, those that ran the cascade, and the
    # KV bytes (all layers) an average decode step read, and would have read with plain decode attention.
    decode_steps: int | None = None
    cascade_decode_steps: int | None = None
    kv_bytes_per_decode_step: float | None = None
    kv_bytes_per_decode_step_plain: float | None = None
    # Seconds from "build the engine" to ready (weights, KV pool, kernel compilation, CUDA-graph capture): what a
    # user waits before the first request; a cold start (a fresh machine's first process) also fills the on-disk
    # kernel caches.
    startup_s: float | None = None
    startup_phases: dict[str, float] | None = None  # the engine's part of it, phase by phase (Runtime.startup)
    # New entries in the on-disk kernel caches (Triton, Inductor, FlashInfer) during the timed run: anything but
    # zeros means a kernel compiled inside the run instead of at start-up.
    compiled_during_run: dict[str, int] | None = None
    # Python's cyclic garbage collector during the timed run: collections and seconds per generation, and the
    # objects it tracked at the start (a full collection walks them all, holding the host's only thread).
    gc_during_run: dict[str, Any] | None = None
    # An MoE model with --enable-expert-distribution-metrics (chapter 14): the timed run's routing counts
    # (ExpertDistribution.dump), and the floor of the steps it took when each reads only the experts it routed to.
    expert_distribution: dict[str, Any] | None = None
    routed_floor_s: float | None = None
    routed_floor_fraction: float | None = None


@dataclass
class _Counters:
    """The engine's cumulative counters at one instant; a run reports the difference of two snapshots."""

    prefill_tokens: int = 0
    steps: int = 0
    retractions: int = 0
    decode_steps: int = 0  # the rest: cascade attention's counters (CascadeStats), 0 without a cascade
    cascade_steps: int = 0
    kv_tokens_plain: int = 0
    kv_tokens_cascade: int = 0

    @classmethod
    def read(cls, llm) -> _Counters:  # type: ignore[no-untyped-def]
        engine = llm.engine
        if llm.engine_kind == "naive":  # the oracle keeps no statistics
            return cls()
        c = cascade_stats(llm)
        cascade = (c.decode_steps, c.cascade_steps, c.kv_tokens_plain, c.kv_tokens_cascade) if c else ()
        return cls(engine.stats.prefill_tokens, engine.stats.steps, engine.scheduler.num_retractions, *cascade)

    def __sub__(self, other: _Counters) -> _Counters:
        return _Counters(*(a - b for a, b in zip(asdict(self).values(), asdict(other).values())))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _forget_warmup(llm) -> None:  # type: ignore[no-untyped-def]
    """Empty the radix cache after the warm-up, so the timed run starts as cold as it would without one."""
    if llm.engine_kind != "naive":
        llm.engine.flush_cache()  # through the engine: at tp > 1 the followers flush theirs too


class GCWatch:
    """Counts Python's garbage collections and the time they take while it is entered (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.tracked_at_start = 0
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.collections[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._started

    def __enter__(self) -> GCWatch:
        self.tracked_at_start = len(gc.get_objects())
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, Any]:
        return {"collections": self.collections, "seconds": [round(s, 4) for s in self.seconds],
                "tracked_objects_at_start": self.tracked_at_start, "frozen_objects": gc.get_freeze_count()}


def time_generate(llm, workload: Workload, *, warmup: Workload | None = None,  # type: ignore[no-untyped-def]
                  step_log: str | None = None, gc_watch: GCWatch | None = None):
    """Run the workload through ``llm.generate`` once (after an optional untimed warm-up) and return
    ``(outputs, wall seconds, counter deltas)``. The progress bar stays off: drawing it costs time too.
    ``step_log``: trace the timed run's steps to this file (:mod:`~minisgl_ref.bench.step_trace`);
    ``gc_watch``: count the garbage collections of the timed run there."""
    if warmup is not None:
        llm.generate(warmup.prompts, warmup.sampling_params, use_tqdm=False)
        _forget_warmup(llm)
    trace = StepTrace(step_log) if step_log and llm.engine_kind != "naive" else None
    if trace is not None:
        llm.engine.extensions.attach(trace)
    counter = getattr(getattr(llm, "runtime", None), "expert_distribution", None)  # chapter 14's, when asked for
    if counter is not None:
        counter.start()
    before = _Counters.read(llm)
    _synchronize(llm.device)
    with gc_watch if gc_watch is not None else contextlib.nullcontext():
        start = time.perf_counter()
        try:
            outputs = llm.generate(workload.prompts, workload.sampling_params, use_tqdm=False)
            _synchronize(llm.device)
        finally:
            if trace is not None:
                llm.engine.extensions.detach(trace)
                trace.close()
            if counter is not None:
                counter.stop()
        wall = time.perf_counter() - start
    return outputs, wall, _Counters.read(llm) - before


def count_cache_entries() -> dict[str, int]:
    """Files under each kernel cache (0 where there is none): two counts around a run say what it compiled."""
    return {name: sum(len(files) for _, _, files in os.walk(folder)) for name, folder in env.kernel_cache_dirs().items()}


def _hit_rate(engine_args: dict[str, Any], cached: int, prompt: int) -> float | None:
    """Prompt tokens served from the radix cache / prompt tokens; ``None`` for engines without one."""
    if not engine_args or engine_args.get("disable_radix_cache", False):
        return None
    return cached / prompt if prompt else 0.0


def summarize(  # type: ignore[no-untyped-def]
    llm, stage: str, outputs: list[Any], wall: float, counters: _Counters
) -> RunResult:
    """Turn one timed run into a :class:`RunResult`: tokens are counted from the outputs themselves, the work
    behind them from the engine's counters (the naive oracle has none: its work follows from the lengths)."""
    naive = llm.engine_kind == "naive"
    engine_args = {} if naive else asdict(llm.engine.config)
    in_tokens = sum(o.prompt_tokens for o in outputs)
    cached = sum(o.cached_tokens for o in outputs)
    out_tokens = sum(o.completion_tokens for o in outputs)
    if naive:
        prefill = context_token_sum([o.prompt_tokens for o in outputs], [o.completion_tokens for o in outputs])
    else:
        prefill = counters.prefill_tokens
    cascade: dict[str, Any] = {}
    if cascade_stats(llm) is not None and counters.decode_steps:
        kv = stored_bytes(llm)[1]  # an FP8 cache (chapter 15) holds half the config's bytes per token
        cascade = dict(decode_steps=counters.decode_steps, cascade_decode_steps=counters.cascade_steps,
                       kv_bytes_per_decode_step=counters.kv_tokens_cascade * kv / counters.decode_steps,
                       kv_bytes_per_decode_step_plain=counters.kv_tokens_plain * kv / counters.decode_steps)
    return RunResult(
        stage=stage, engine=llm.engine_kind, engine_args=engine_args, device=str(llm.device),
        dtype=str(llm.config.dtype).removeprefix("torch."), requests=len(outputs), input_tokens=in_tokens,
        output_tokens=out_tokens, wall_s=wall, output_throughput=out_tokens / wall,
        total_throughput=(in_tokens + out_tokens) / wall, prefill_tokens=prefill,
        cached_tokens=cached, radix_hit_rate=_hit_rate(engine_args, cached, in_tokens),
        retractions=counters.retractions, steps=None if naive else counters.steps,
        aborted=sum(o.finish_reason == "abort" for o in outputs), **cascade,
    )


def _free_device_memory(device: torch.device) -> None:
    """Return a dropped engine's memory before the next one is built: its KV pool is sized from what is free."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(llm, stage: str, workload: Workload, bandwidth: float,  # type: ignore[no-untyped-def]
            step_log: str | None = None) -> RunResult:
    """Time ``workload`` on a built ``llm`` and report it. On CUDA a short warm-up runs first, and the result
    carries the workload's roofline floor and the fraction of it that was reached."""
    on_cuda = llm.device.type == "cuda"
    caches = count_cache_entries() if on_cuda else None
    watch = GCWatch()
    outputs, wall, counters = time_generate(llm, workload, warmup=warmup_workload() if on_cuda else None,
                                            step_log=step_log, gc_watch=watch)
    result = summarize(llm, stage, outputs, wall, counters)
    result.gc_during_run = watch.summary()
    if on_cuda:
        assert caches is not None
        result.compiled_during_run = {k: v - caches[k] for k, v in count_cache_entries().items()}
        result.roofline_floor_s = workload_floor_seconds(workload, llm.config, bandwidth, stored_bytes(llm))
        result.roofline_fraction = result.roofline_floor_s / wall
    counter = getattr(getattr(llm, "runtime", None), "expert_distribution", None)
    if counter is not None:
        result.expert_distribution = counter.dump()
        if on_cuda:
            context = context_token_sum([len(p) for p in workload.prompts],
                                        [p["max_new_tokens"] for p in workload.sampling_params])
            result.routed_floor_s = routed_floor_seconds(llm.config, result.expert_distribution, context, bandwidth)
            result.routed_floor_fraction = result.routed_floor_s / wall
    return result


def run_stage(stage: str, workload: Workload, model: ModelSpec, base_engine_kwargs: dict[str, Any], *,
              bandwidth: float = H100_MEASURED_BANDWIDTH, engine: str | None = None,
              step_log: str | None = None) -> RunResult:
    """Build the engine of one ladder stage, time the workload on it, drop it again (``step_log``: trace the
    timed run's steps to this file).

    ``stage="custom"`` uses ``engine`` and ``base_engine_kwargs`` exactly as given (the CLI without
    ``--stage``); the result is still labelled with the stage it matches, if any."""
    if stage == "custom":
        engine_name, kwargs = engine or "paged", dict(base_engine_kwargs)
        stage = stage_of(engine_name, kwargs)
    else:
        engine_name, kwargs = stage_settings(stage, base_engine_kwargs)
    t0 = time.perf_counter()
    llm = build_llm(model, engine_name, kwargs if engine_name == "paged" else {})
    startup = time.perf_counter() - t0
    device = llm.device
    try:
        result = measure(llm, stage, workload, bandwidth, step_log)
        result.startup_s = startup
        result.startup_phases = dict(getattr(getattr(llm, "runtime", None), "startup", {})) or None
        return result
    finally:
        del llm
        _free_device_memory(device)


def run_ladder(workload: Workload, stages: Iterable[str], model: ModelSpec, engine_kwargs: dict[str, Any], *,
               bandwidth: float = H100_MEASURED_BANDWIDTH, log: Any = None) -> list[RunResult]:
    """Run several stages one after another in this process, on the same workload and the same weights."""
    results = []
    for stage in stages:
        if log is not None:
            print(f"[bench] {stage}: {workload.num_requests} requests ...", file=log, flush=True)
        results.append(run_stage(stage, workload, model, engine_kwargs, bandwidth=bandwidth))
        if log is not None:
            print(f"[bench] {stage}: {results[-1].output_throughput:,.1f} output tok/s", file=log, flush=True)
    return results


# ------------------------------------------------------------------------------------------------ reports

_COLUMNS = (  # (header, RunResult field, format)
    ("stage", "stage", "{}"), ("reqs", "requests", "{:,}"), ("in tok", "input_tokens", "{:,}"),
    ("out tok", "output_tokens", "{:,}"), ("wall s", "wall_s", "{:.2f}"),
    ("out tok/s", "output_throughput", "{:,.1f}"), ("total tok/s", "total_throughput", "{:,.1f}"),
    ("prefill tok", "prefill_tokens", "{:,}"), ("cached tok", "cached_tokens", "{:,}"),
    ("hit rate", "radix_hit_rate", "{:.1%}"), ("retract", "retractions", "{:,}"),
    ("of floor", "roofline_fraction", "{:.1%}"), ("of routed floor", "routed_floor_fraction", "{:.1%}"),
)


def format_table(results: Sequence[RunResult]) -> str:
    """A plain-text table, one row per run (``-`` where a number does not apply, e.g. the floor on CPU)."""
    rows = [[h for h, _, _ in _COLUMNS]]
    for r in results:
        values = [getattr(r, name) for _, name, _ in _COLUMNS]
        rows.append(["-" if v is None else fmt.format(v) for v, (_, _, fmt) in zip(values, _COLUMNS)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def make_report(results: Sequence[RunResult], workload: Workload, model: ModelSpec, *, bandwidth: float,
                argv: list[str] | None = None, **settings: Any) -> dict[str, Any]:
    """The JSON results file: provenance, workload, model, and one record per run (on CUDA each record carries
    the workload's roofline floor and the fraction of it reached)."""
    return {
        "benchmark": "offline",
        "provenance": collect_provenance(argv, bandwidth=bandwidth, **settings),
        "workload": workload.summary(),
        "model": model.describe(),
        "results": [asdict(r) for r in results],
    }


# -------------------------------------------------------------------------------------------------- CLI


def add_offline_args(p: argparse.ArgumentParser) -> None:
    """The benchmark's own flags. The model and engine flags are the CLI's shared ones; here their defaults
    become ``None`` so that ``--quick`` can pick CPU-sized values for whatever the user did not set."""
    g = p.add_argument_group(
        "benchmark",
        f"Model default here: {DEFAULT_MODEL} with dummy weights (--quick: {QUICK_MODEL_NAME}, a tiny random "
        "Qwen3). Unset --max-prefill-tokens / --chunked-prefill-size default to "
        f"{FULL_BUDGETS['max_prefill_tokens']} / {FULL_BUDGETS['chunked_prefill_size']} "
        f"(--quick: {QUICK_BUDGETS['max_prefill_tokens']} / {QUICK_BUDGETS['chunked_prefill_size']}).")
    g.add_argument("--workload", default="canonical", choices=["canonical", "shared-prefix"])
    g.add_argument("--num-prompts", type=int, default=None,
                   help="canonical workload: number of requests (default 256; --quick: %d)"
                        % QUICK_CANONICAL["num_prompts"])
    for flag, key in (("--gsp-groups", "num_groups"), ("--gsp-prompts-per-group", "prompts_per_group"),
                      ("--gsp-system-len", "system_len"), ("--gsp-question-len", "question_len"),
                      ("--gsp-output-len", "output_len")):
        g.add_argument(flag, type=int, default=None, dest=f"gsp_{key}",
                       help=f"shared-prefix workload (default {FULL_SHARED_PREFIX[key]}; "
                            f"--quick: {QUICK_SHARED_PREFIX[key]})")
    g.add_argument("--quick", action="store_true",
                   help="CPU-sized: a few short requests on a tiny random model, smaller prefill budgets")
    g.add_argument("--stage", type=parse_stages, default=None,
                   help="naive, paged, radix, chunked, overlap, a comma-separated list, or all "
                        "(default: one run of the engine exactly as the engine flags configure it)")
    g.add_argument("--output", default=None, help="write the results and their provenance to this JSON file")
    g.add_argument("--hbm-bandwidth", type=float, default=H100_MEASURED_BANDWIDTH,
                   help="bytes/s for the roofline floor (default: the H100's measured 3.0e12)")
    g.add_argument("--cpu-threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    g.add_argument("--enable-expert-distribution-metrics", action="store_true",
                   help="an MoE model: count the experts the router picks in the timed run, and report the floor "
                        "of reading only those (chapter 14)")
    g.add_argument("--step-log", default=None,
                   help="append one JSON line per engine step of the timed run to this file (without --stage)")
    p.set_defaults(load_format=None, max_prefill_tokens=None, chunked_prefill_size=None)


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The workload the flags describe; unset sizes come from the full or the ``--quick`` preset."""
    if args.workload == "canonical":
        if not args.quick:
            return canonical_workload(args.num_prompts or 256)
        kw = dict(QUICK_CANONICAL)
        kw["num_prompts"] = args.num_prompts or kw["num_prompts"]
        return canonical_workload(**kw)
    preset = QUICK_SHARED_PREFIX if args.quick else FULL_SHARED_PREFIX
    kw = {k: getattr(args, f"gsp_{k}") if getattr(args, f"gsp_{k}") is not None else v for k, v in preset.items()}
    return shared_prefix_workload(**kw)


def resolve_engine_kwargs(engine_kwargs: dict[str, Any], quick: bool) -> dict[str, Any]:
    """Fill the budgets the user left unset (``None``) from the full or the ``--quick`` preset."""
    preset = QUICK_BUDGETS if quick else FULL_BUDGETS
    out = {k: v for k, v in engine_kwargs.items() if v is not None}
    return {**{k: v for k, v in preset.items() if k not in out}, **out}


def _warn_if_naive_is_slow(workload: Workload) -> None:
    """The naive oracle recomputes every sequence every step; say so before it starts on a large workload."""
    tokens = context_token_sum([len(p) for p in workload.prompts],
                               [p["max_new_tokens"] for p in workload.sampling_params])
    if tokens > 10_000_000:
        print(f"[bench] warning: the naive stage recomputes {tokens:,} tokens on this workload, which takes a "
              "long time; --stage paged,radix,chunked,overlap skips it", file=sys.stderr)


def main(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    """Run ``bench offline`` from parsed CLI arguments; ``engine_kwargs`` are the shared engine flags."""
    if getattr(args, "step_log", None) and args.stage is not None:
        raise ValueError("--step-log traces the one run of the engine as configured; it cannot be combined with "
                         "--stage (several engines, one after the other)")
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    workload = workload_from_args(args)
    model = resolve_model(args.model_path, args.load_format, quick=args.quick, dtype=args.dtype,
                          quantization=getattr(args, "quantization", None),
                          device=args.device, context_length=args.context_length)
    kwargs = resolve_engine_kwargs(engine_kwargs, args.quick)
    if getattr(args, "enable_expert_distribution_metrics", False):
        kwargs["enable_expert_distribution_metrics"] = True
    print(f"[bench] workload {workload.name}: {workload.num_requests} requests, {workload.input_tokens:,} input "
          f"and {workload.output_tokens:,} output tokens; model {model.name}", file=sys.stderr)
    if args.stage and "naive" in args.stage:
        _warn_if_naive_is_slow(workload)
    if args.stage is None:
        results = [run_stage("custom", workload, model, kwargs, bandwidth=args.hbm_bandwidth, engine=args.engine,
                             step_log=args.step_log)]
    else:
        results = run_ladder(workload, args.stage, model, kwargs, bandwidth=args.hbm_bandwidth, log=sys.stderr)
    print(format_table(results))
    for r in results:
        if r.kv_bytes_per_decode_step is not None and r.kv_bytes_per_decode_step_plain:
            print(f"[bench] {r.stage}: cascade attention ran {r.cascade_decode_steps:,} of {r.decode_steps:,} decode "
                  f"steps; KV read per decode step {r.kv_bytes_per_decode_step / 1e9:.3f} GB "
                  f"(plain decode: {r.kv_bytes_per_decode_step_plain / 1e9:.3f} GB, "
                  f"{r.kv_bytes_per_decode_step / r.kv_bytes_per_decode_step_plain:.1%})", file=sys.stderr)
        if r.expert_distribution is not None:
            d = r.expert_distribution
            per_step = sum(d["active_experts_per_step"]) / max(len(d["layer_ids"]), 1)
            floor = "" if r.routed_floor_s is None else f"; their floor {r.routed_floor_s:.2f} s"
            print(f"[bench] {r.stage}: {d['steps']:,} steps read {per_step:.1f} of {d['num_experts']} experts per "
                  f"layer on average{floor}", file=sys.stderr)
        if r.startup_s is not None:
            phases = ", ".join(f"{k} {v:.1f} s" for k, v in (r.startup_phases or {}).items())
            print(f"[bench] {r.stage}: start-up {r.startup_s:.1f} s ({phases or 'no phases recorded'})",
                  file=sys.stderr)
        if r.compiled_during_run and any(r.compiled_during_run.values()):
            print(f"[bench] {r.stage}: kernels compiled inside the timed run (new cache files): "
                  f"{r.compiled_during_run}", file=sys.stderr)
    if args.output:
        report = make_report(results, workload, model, bandwidth=args.hbm_bandwidth, quick=args.quick,
                             stages=args.stage, engine=args.engine, engine_kwargs=kwargs)
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
        print(f"[bench] wrote {args.output}", file=sys.stderr)
    return 0
