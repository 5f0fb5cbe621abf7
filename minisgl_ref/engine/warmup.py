"""Compile at start-up, in parallel, so that the first request runs at full speed (chapter 11).

A GPU engine runs code that is compiled the first time it is used: FlashInfer builds each kernel family with nvcc
(tens of seconds each on a machine that never built it; norm, activation, RoPE and decode attention are four
families, the first three compiled by jobs that chapter 11's fused kernels hand to :func:`start`) and Triton
compiles its kernels (the sampler's draw among them) once per pattern of argument alignment. Left to happen lazily,
all of it lands inside the first requests: on a bare H100 the first run of the canonical workload took 11.3 s where
the second took 7.6 s, although an untimed warm-up workload had run before either.

:func:`start` launches every such compile at once in a small thread pool (the compilers are other processes or
release the GIL, so they overlap) right after the weights are loaded; :meth:`Warmup.wait` joins them before the
engine captures its CUDA graphs (a capture must not see other threads' kernels). Each result lands in its
on-disk cache (FlashInfer's, Triton's and Inductor's), so the next start on the same machine only loads it. One
log line says what compiled and how long the slowest took.

cuBLAS has a first-call cost of its own, per matmul shape and per process (no disk cache): the same job pool
runs every matmul an eager step can meet once (:func:`matmul_shapes`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from minisgl_ref.core.config import EngineConfig
from minisgl_ref.models.config import ModelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelShapes:
    """What a kernel is compiled for: the model's per-rank attention shape, hidden sizes and dtype."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    dtype: torch.dtype
    decode_backend: str
    prefill_backend: str
    kv_dtype: torch.dtype | None = None  # the KV cache's numbers when not ``dtype`` (chapter 15's FP8 cache)


def _attention(shapes: KernelShapes, device: torch.device, phase: str) -> None:
    from minisgl_ref.attention.flashinfer_backend import compile_kernels

    compile_kernels(phase, shapes.num_q_heads, shapes.num_kv_heads, shapes.head_dim, shapes.dtype, device,
                    shapes.kv_dtype)


def _sampler(shapes: KernelShapes, device: torch.device) -> None:
    from minisgl_ref.sampling.fused_draw import compile_kernels

    compile_kernels(shapes.vocab_size, device, tuple(dict.fromkeys((shapes.dtype, torch.float32))))


#: One matmul an eager step runs, and the token counts (rows) it will see: (weight, bias or None, counts, whether
#: it accumulates into its output as ``out += x W^T``, a different cuBLAS call with a first-call cost of its own).
MatmulShapes = tuple[torch.Tensor, "torch.Tensor | None", list[int], bool]


def matmul_shapes(model: torch.nn.Module, engine: EngineConfig) -> list[MatmulShapes]:
    """The matmuls of an eager (extend) step on CUDA, each with the row counts it can see.

    cuBLAS chooses its kernel for a matmul shape on the first call with that shape, and that first call costs
    ~0.25-0.4 ms of host time on an H100 host against ~0.03 ms for a repeat. An extend step multiplies by each
    of the model's projection weights once per layer with as many rows as the step has tokens; since its token
    count is padded to a multiple of ``extend_token_multiple`` (``ModelRunner.pad_extend``), the counts an
    extend step can have are few enough to meet them all here: multiples of it up to the step's token budget.
    The LM head sees one row per request of the step. Decode shapes need nothing: capturing their CUDA graphs
    runs them. With padding off (a multiple of 1) only the LM head's shapes are warmed. In a model whose norms
    are folded (:mod:`~minisgl_ref.perf.norm_folding`) the row-parallel projections accumulate into the
    residual stream instead."""
    from minisgl_ref.engine.model_runner import EXTEND_TOKEN_MULTIPLE
    from minisgl_ref.layers.embedding import ParallelLMHead
    from minisgl_ref.layers.linear import ColumnParallelLinear, RowParallelLinear

    multiple = engine.extend_token_multiple or EXTEND_TOKEN_MULTIPLE
    budget = engine.max_prefill_tokens + (engine.max_running_requests if engine.enable_mixed_chunk else 0)
    tokens = list(range(multiple, budget + multiple, multiple)) if multiple > 1 else []
    rows = list(range(1, engine.max_running_requests + 1))
    folded = bool(getattr(model, "norms_folded", False))
    seen: set[tuple] = set()
    out: list[MatmulShapes] = []
    for m in model.modules():
        accumulate = False
        if isinstance(m, ParallelLMHead):
            weight, bias, counts = m.weight, None, rows
        elif isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            if m.quant_method.quantized:  # its own kernels (chapter 15), not cuBLAS's plain matmul
                continue
            weight, bias, counts = m.weight, getattr(m, "bias", None), tokens
            accumulate = folded and isinstance(m, RowParallelLinear)
        else:
            continue
        key = (tuple(weight.shape), weight.dtype, bias is not None, len(counts), accumulate)
        if counts and key not in seen:
            seen.add(key)
            out.append((weight, bias, counts, accumulate))
    return out


def _matmuls(shapes: list[MatmulShapes]) -> None:
    """Run each matmul once at each of its row counts (inputs of zeros; the outputs are dropped)."""
    for weight, bias, counts, accumulate in shapes:
        x = torch.zeros(max(counts), weight.shape[1], dtype=weight.dtype, device=weight.device)
        acc = torch.zeros(max(counts), weight.shape[0], dtype=weight.dtype, device=weight.device)
        for n in counts:
            if accumulate:
                acc[:n].addmm_(x[:n], weight.t())
            else:
                torch.nn.functional.linear(x[:n], weight, bias)


@dataclass
class Warmup:
    """The compiles started by :func:`start`; :meth:`wait` joins them and logs one line."""

    jobs: dict[str, Future[float]] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)

    def wait(self) -> dict[str, float]:
        """Seconds per compile job (a job that failed is logged and skipped: the kernel then compiles lazily,
        as it would have without the warm-up)."""
        seconds: dict[str, float] = {}
        for name, job in self.jobs.items():
            try:
                seconds[name] = job.result()
            except Exception:  # noqa: BLE001 - a warm-up must never stop the engine from starting
                log.warning("start-up compile of %s failed; it will compile on first use", name, exc_info=True)
        if seconds:
            slowest = max(seconds, key=seconds.__getitem__)
            log.info("start-up compiles done in %.1f s (%s; slowest: %s)", time.perf_counter() - self.started,
                     ", ".join(f"{name} {s:.1f} s" for name, s in seconds.items()), slowest)
        return seconds


def _timed(fn: Callable[[], None], device: torch.device) -> float:
    """Run one compile job on ``device`` and time it.

    The current CUDA device belongs to a thread, and a new thread starts on GPU 0: without the guard, a
    tensor-parallel rank on ``cuda:1`` would launch its warm-up kernels against GPU 0 (Triton refuses a pointer
    of another device, "cannot be accessed from Triton") and make a context there that holds memory for nothing."""
    t = time.perf_counter()
    with torch.cuda.device(device):
        fn()
        torch.cuda.synchronize(device)
    return time.perf_counter() - t


def shapes_of(model: torch.nn.Module, config: ModelConfig, engine: EngineConfig,
              device: torch.device) -> KernelShapes:
    """The shapes the engine about to be built will compile kernels for (heads per rank, as sharded)."""
    from minisgl_ref.attention.registry import resolve_backend_names
    from minisgl_ref.kvcache.pool import kv_pool_class
    from minisgl_ref.layers.attention import AttentionLayer

    layer = next(m for m in model.modules() if isinstance(m, AttentionLayer))
    kv_dtype = kv_pool_class(engine.kv_cache_dtype).storage_dtype_for(config.dtype)  # chapter 15's FP8 cache
    prefill, decode = resolve_backend_names(engine, device, config.dtype, quantized_kv=kv_dtype != config.dtype)
    return KernelShapes(layer.num_heads, layer.num_kv_heads, config.head_dim, config.hidden_size,
                        config.intermediate_size, config.vocab_size, config.dtype, decode, prefill, kv_dtype)


def start(shapes: KernelShapes, device: torch.device, matmuls: list[MatmulShapes] | None = None,
          jobs: Mapping[str, Callable[[], None]] | None = None) -> Warmup:
    """Start every start-up compile for ``shapes`` on ``device`` in background threads (nothing on the CPU), the
    first call of each matmul shape in ``matmuls`` (:func:`matmul_shapes`), and the named compile ``jobs`` of the
    extensions, each in a thread (chapter 11's: :func:`minisgl_ref.perf.kernels.warmup_jobs` for the fused kernels,
    :func:`minisgl_ref.perf.attention.warmup_jobs` for the split-KV decode kernel)."""
    warm = Warmup()
    if device.type != "cuda":
        return warm
    todo: dict[str, Callable[[], None]] = {**(jobs or {}), "sampler": lambda: _sampler(shapes, device)}
    if shapes.decode_backend == "flashinfer":
        todo["decode attention"] = lambda: _attention(shapes, device, "decode")
    if shapes.prefill_backend == "flashinfer":
        todo["prefill attention"] = lambda: _attention(shapes, device, "prefill")
    if matmuls:
        todo["matmul shapes"] = lambda: _matmuls(matmuls)
    log.info("start-up: compiling %s in parallel (cached on disk for the next start)", ", ".join(todo))
    pool = ThreadPoolExecutor(max_workers=len(todo), thread_name_prefix="compile")
    warm.jobs = {name: pool.submit(_timed, fn, device) for name, fn in todo.items()}
    pool.shutdown(wait=False)
    return warm
