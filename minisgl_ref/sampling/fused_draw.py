"""The sampler's seeded draw as one Triton kernel on the GPU (chapters 02 and 11).

:func:`~minisgl_ref.sampling.sampler.sample_from_probs` is the exponential race over hashed noise: about 25
elementwise int64 passes over ``[B, V]`` to make the noise, then a division and an argmax. Run eagerly on a GPU,
each pass is a round trip through memory (about 6 ms per step at B = 256 and V = 152k on an H100). Here one
program per row walks its logits once, makes the noise in registers with the same integer hash, and keeps the
running winner, so a step reads the logits once and writes one token per row.

Why a kernel of our own rather than ``torch.compile`` of the eager function: the compiled version was not faster
(on an H100 the canonical workload ran at 17.1k output tok/s with it and 17.5k with this kernel), but it cost every
engine start about 15 s of tracing and code generation even with a warm disk cache (four specialisations: two
functions, a batch of one and of many), most of a warm start, and on a bare machine it kept compiling new
variants inside the first requests. This kernel is one Triton compile on a bare machine and a cache load after
that: the whole start-up compile step of a warm start now takes about 3 s (chapter 11).

Two entry points, the two paths of :class:`~minisgl_ref.sampling.sampler.Sampler`:

* :func:`temperature_sample` (no top-k / top-p / min-p): the race in log space, ``argmax(l / T - log E)``, which
  needs no softmax at all (``p / E`` and ``exp(l / T) / E`` have the same argmax, and ``log`` keeps the order);
* :func:`sample_from_probs` (after filtering): ``argmax(p / E)`` on the filtered probabilities, where a zero
  probability can never win.

The noise is bit-identical to :func:`~minisgl_ref.sampling.sampler.seeded_uniform` (the same integer hash; the
float32 conversion and clamp happen at the same points), so the two paths draw the same token as the eager code
except when two candidates tie to within float32 rounding. ``tests/test_sampling.py`` checks them against the
eager functions on the CPU through Triton's interpreter.
"""

from __future__ import annotations

import functools

import torch

#: Vocabulary entries a program handles per loop iteration.
BLOCK_V = 2048


@functools.cache
def _kernel():  # type: ignore[no-untyped-def]
    """The kernel, imported on first use so that importing this module does not import Triton."""
    from minisgl_ref.sampling.race_kernel import race_kernel

    return race_kernel


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - no Triton: the eager path is always correct
        return False
    return True


def available(x: torch.Tensor) -> bool:
    """Whether the kernel runs for ``x``: a CUDA tensor, with Triton importable (checked once)."""
    return x.is_cuda and _triton_importable()


def _race(x: torch.Tensor, inv_temperatures: torch.Tensor | None, seeds: torch.Tensor, steps: torch.Tensor,
          log_space: bool) -> torch.Tensor:
    rows, vocab = x.shape
    x = x.float()
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    inv = inv_temperatures if inv_temperatures is not None else x  # unused without LOG_SPACE
    _kernel()[(rows,)](x, x.stride(0), inv, seeds.to(torch.int64), steps.to(torch.int64), out, vocab,
                       LOG_SPACE=log_space, BLOCK=BLOCK_V, num_warps=8)  # fmt: skip
    return out


def temperature_sample(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                       steps: torch.Tensor) -> torch.Tensor:
    """One token per row from ``softmax(logits / temperatures)`` with the seeded noise: the eager
    :func:`~minisgl_ref.sampling.sampler.temperature_sample` in one pass over the logits."""
    inv = (1.0 / temperatures.float()).contiguous()
    return _race(logits, inv, seeds, steps, log_space=True)


def sample_from_probs(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One token per row from ``probs`` (rows need not be normalised): the eager
    :func:`~minisgl_ref.sampling.sampler.sample_from_probs` in one pass."""
    return _race(probs, None, seeds, steps, log_space=False)


def compile_kernels(vocab_size: int, device: torch.device) -> None:
    """Compile both variants before the first request (the engine's start-up): one row and several, so that
    every pattern of argument alignment the engine will pass is built now."""
    for rows in (1, 2):
        logits = torch.zeros(rows, vocab_size, dtype=torch.float32, device=device)
        ones = torch.ones(rows, dtype=torch.float32, device=device)
        zeros = torch.zeros(rows, dtype=torch.int64, device=device)
        temperature_sample(logits, ones, zeros, zeros)
        sample_from_probs(logits.softmax(dim=-1), zeros, zeros)
