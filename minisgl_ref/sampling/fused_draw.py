"""The sampler's seeded draw as one Triton kernel on the GPU (chapters 02 and 11).

:func:`~minisgl_ref.sampling.sampler.sample_from_probs` is the exponential race over hashed noise: about 25
elementwise int64 passes over ``[B, V]`` to make the noise, then a division and an argmax. Run eagerly on a GPU,
each pass is a round trip through memory (about 6 ms per step at B = 256 and V = 152k on an H100). Here the
kernel of :mod:`.race_kernel` reads the logits once, makes the noise in registers with the same integer hash,
and keeps the running winner, so a step reads the logits once and writes one token per row.

How the work is laid out. A row's vocabulary is cut into ``chunks`` contiguous slices, one program each, so
that a launch has ``rows * chunks`` programs: enough to occupy every SM of the GPU whatever the batch size (a
decode step may have 8 rows; a GPU has more than a hundred SMs). :func:`num_chunks` picks the count. Each
program writes its slice's best score and id to a small ``[rows, chunks]`` buffer, and :func:`_race` finishes
with ``argmax`` over the chunks, which keeps the first of equal scores: the lowest chunk, hence the lowest id,
the same tie rule as one ``argmax`` over the whole row. The integer hash runs on uint32, which the GPU does in
single instructions where int64 takes several (:mod:`.race_kernel` explains both choices).

The kernel reads float32, bfloat16 or float16 logits and converts them in registers (exactly), so bfloat16
logits need no float32 copy of ``[B, V]`` first: on its plain temperature path the sampler passes them as they
are. On an H100, at 256 rows and a vocabulary of 151,936, that copy takes 122 us; the kernel itself took 315 us
per call with one program per row (``docs/data/decode_profile_h100.txt``). Split into chunks, a call (launches included) takes 212 us against 437 us for
the float32 copy plus the old kernel, and 117 us against 284 us at 64 rows (``docs/data/sampler_ab_h100.json``).

Why a kernel of our own rather than ``torch.compile`` of the eager function: the compiled version was not faster
(on an H100 the canonical workload ran at 17.1k output tok/s with it and 17.5k with this kernel), but it cost every
engine start about 15 s of tracing and code generation even with a warm disk cache (four specialisations: two
functions, a batch of one and of many), most of a warm start, and after a cold start it kept compiling new
variants inside the first requests. This kernel is a few Triton compiles at a cold start (one per input dtype
and path, see :func:`compile_kernels`) and cache loads after that: with the single float32 variant the kernel
had before, the whole start-up compile step of a warm start took about 3 s (chapter 11).

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
#: Programs one launch aims for: about 8 per SM on the 132 SMs of an H100, about what an SM holds at once. Fewer,
#: longer programs would leave SMs idle at small batches; more, shorter ones skip fewer blocks, because a program
#: prunes against the best score of the blocks it has already seen (:mod:`.race_kernel`). On an H100 at 256 rows,
#: 4 chunks of 19 blocks took 89 us and 8 chunks of 10 blocks 92 us; at 128 rows 8 chunks took 54 us and 16
#: chunks 60 us (``docs/data/race_prune_h100.json``).
TARGET_PROGRAMS = 1024
#: Logit dtypes the kernel reads directly; anything else is converted to float32 first.
_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _kernel():  # type: ignore[no-untyped-def]
    """The kernel, imported on first use so that importing this module does not import Triton."""
    from minisgl_ref.sampling.race_kernel import race_kernel

    return race_kernel


@functools.cache
def _compiled() -> bool:
    """Whether the kernel is compiled for the GPU (not run by Triton's interpreter, which lacks ``lg2.approx``)."""
    import triton

    return isinstance(_kernel(), triton.runtime.JITFunction)


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


def num_chunks(rows: int, vocab: int, block: int = BLOCK_V) -> int:
    """How many programs share one row's vocabulary: about ``TARGET_PROGRAMS / rows``, at least 1 and at most
    one per block of ``block`` entries.

    One program per row would leave most of the GPU idle when rows are fewer than its SMs (decode batches of 1 to
    64 rows are common) and give each SM few programs even at 256 rows. Splitting further than
    ``TARGET_PROGRAMS`` gains nothing once every SM is busy: each extra chunk costs one more candidate to compare at
    the end and shortens the run of blocks over which a program prunes. A chunk smaller than a block would only
    leave lanes idle.
    """
    blocks = -(-vocab // block)
    return max(1, min(blocks, -(-TARGET_PROGRAMS // max(rows, 1))))


def _race(x: torch.Tensor, inv_temperatures: torch.Tensor | None, seeds: torch.Tensor, steps: torch.Tensor,
          log_space: bool, block: int, chunks: int | None, prune: bool = True) -> torch.Tensor:
    """Launch the kernel over ``rows x chunks`` programs, then pick each row's winner among its chunks."""
    rows, vocab = x.shape
    if x.dtype not in _NATIVE_DTYPES:
        x = x.float()
    if x.stride(1) != 1:
        x = x.contiguous()
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    blocks = -(-vocab // block)
    chunk_size = -(-blocks // (chunks or num_chunks(rows, vocab, block))) * block  # whole blocks
    chunks = -(-vocab // chunk_size)  # rounding up the size may leave fewer, never empty, chunks
    scores = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    ids = torch.empty(rows, chunks, dtype=torch.int64, device=x.device)
    inv = inv_temperatures if inv_temperatures is not None else scores  # unused without LOG_SPACE
    # Pruning is for the log-space race, and a program of one block has nothing to prune against. (Passing
    # PRUNE=False otherwise also keeps the number of compiled variants down: Triton builds one per constexpr.)
    prune = prune and log_space and chunk_size > block
    _kernel()[(rows, chunks)](x, x.stride(0), inv, seeds.to(torch.int64), steps.to(torch.int64), scores, ids,
                              vocab, chunk_size, LOG_SPACE=log_space, BLOCK=block, FAST_LOG=_compiled(),
                              PRUNE=prune, num_warps=8)  # fmt: skip
    # argmax keeps the first of equal scores: the lowest chunk, whose id is below every later chunk's.
    return ids.gather(1, scores.argmax(dim=1, keepdim=True)).squeeze(1)


def temperature_sample(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                       steps: torch.Tensor, *, block: int = BLOCK_V, chunks: int | None = None,
                       prune: bool = True) -> torch.Tensor:
    """One token per row from ``softmax(logits / temperatures)`` with the seeded noise: the eager
    :func:`~minisgl_ref.sampling.sampler.temperature_sample` in one pass over the logits (float32, bfloat16 or
    float16). ``block`` and ``chunks`` override the launch layout (tests); ``prune=False`` makes the exact noise of
    every entry instead of skipping the blocks that cannot win (benchmarks, tests). None of them changes the
    tokens."""
    inv = (1.0 / temperatures.float()).contiguous()
    return _race(logits, inv, seeds, steps, log_space=True, block=block, chunks=chunks, prune=prune)


def sample_from_probs(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, *, block: int = BLOCK_V,
                      chunks: int | None = None) -> torch.Tensor:
    """One token per row from ``probs`` (rows need not be normalised): the eager
    :func:`~minisgl_ref.sampling.sampler.sample_from_probs` in one pass."""
    return _race(probs, None, seeds, steps, log_space=False, block=block, chunks=chunks)


def compile_kernels(vocab_size: int, device: torch.device,
                    logit_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)) -> None:
    """Compile every variant the engine will launch before the first request (the engine's start-up): the
    temperature path for each dtype in which logits reach it (the model's dtype, straight from the LM head;
    float32 after penalties or a logit bias), the filtered path on float32 probabilities, each with one row and
    several, so that every pattern of argument alignment the engine will pass is built now."""
    for rows in (1, 2):
        ones = torch.ones(rows, dtype=torch.float32, device=device)
        zeros = torch.zeros(rows, dtype=torch.int64, device=device)
        for dtype in logit_dtypes:
            logits = torch.zeros(rows, vocab_size, dtype=dtype, device=device)
            for chunks in (None, 1):  # one block a program (no pruning) and a whole row a program (pruning)
                temperature_sample(logits, ones, zeros, zeros, chunks=chunks)
        probs = torch.full((rows, vocab_size), 1.0 / vocab_size, dtype=torch.float32, device=device)
        sample_from_probs(probs, zeros, zeros)
