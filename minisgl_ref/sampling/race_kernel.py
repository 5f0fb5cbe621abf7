"""The exponential race of :mod:`minisgl_ref.sampling.fused_draw` as a Triton kernel (imported only on a GPU).

The grid is ``(rows, chunks)``: program ``(r, c)`` walks the ``c``-th contiguous slice of row ``r``'s vocabulary
(a whole number of blocks), makes each entry's noise in registers and writes the slice's winner -- its best
score and the id that scored it -- to ``[rows, chunks]`` buffers, which the launcher reduces over the chunks.

Why split a row over several programs. A GPU runs a program on one streaming multiprocessor (SM); an H100 has 132 of
them, and each needs several programs in flight to keep its memory reads and arithmetic units busy (while one waits,
another computes). With one program per row, a decode batch of 8 rows would keep 8 SMs busy while 124 wait, and even
256 rows give each SM only about two programs, each walking a whole row of 152k entries one block after another.
On an H100, at 256 rows and a vocabulary of 151,936, one program per row took 315 us per call, where reading the
float32 logits once takes about 52 us at 3 TB/s; split into chunks, about 210 us (the float64 logarithm below is now
the larger part of it). Cutting each row into chunks
gives the GPU ``rows * chunks`` independent programs (:func:`~minisgl_ref.sampling.fused_draw.num_chunks` picks how
many); the price is a second, tiny step that compares ``chunks`` candidates per row.

Ties go to the lowest id, as with ``torch.argmax``, at every level: each lane of a program keeps the first
(lowest) id at which its best score appeared, the program takes the lowest id among the lanes that hold its
best score, and the launcher's argmax over chunks keeps the first (lowest) chunk among equal scores -- and
chunks are in id order. The per-lane running best also keeps the loop free of cross-lane reductions: those
happen once per program, at the end.

Why the hash runs on 32-bit unsigned integers. :func:`~minisgl_ref.sampling.sampler.hash32` keeps its values in
int64 tensors only because PyTorch lacks uint32 arithmetic on every device; every step of it is arithmetic modulo
2**32. A GPU's integer units are 32 bits wide: each int64 multiply or shift becomes several 32-bit instructions. In
uint32 the same steps are single instructions with the same results: a multiply wraps modulo 2**32 by itself (no
mask needed) and ``>>`` on an unsigned value is a logical shift, as on the non-negative int64 values of the eager
code. The seed and step enter by truncation to 32 bits, which is the ``& 0xFFFFFFFF`` of
:func:`~minisgl_ref.sampling.sampler.seeded_uniform`.

The logits may be float32, bfloat16 or float16: they are converted to float32 as they are loaded, which is
exact, so the caller need not make a float32 copy of ``[B, V]`` first.

Why the second logarithm is the GPU's approximate one. The kernel is bound by its instructions, not by the logits
it reads, and a float32 ``log`` is a software routine of ~25 instructions and a branch (which also keeps the
compiler from interleaving the work of neighbouring entries). The race needs two per entry. The first, inside
``log1p``, must be exact to the last bits near 1, where the winners' noise lives; the second, ``log(E)`` in the
score, needs only an error small against the score's own rounding: the hardware's ``lg2.approx`` is off by at most
~2**-22 in absolute terms, while a score of magnitude 1-30 is rounded to 2**-23-2**-19 anyway. So with
``FAST_LOG`` the score takes ``lg2.approx`` (one instruction), and two draws can differ only where two scores tie
to within float32 rounding, as they already may between this kernel and the eager code. Triton's interpreter has
no such instruction; on the CPU the kernel keeps ``tl.log``.

Why most blocks skip the exact noise (``PRUNE``). Only the winner's score matters, and a cheap bound says which
entries cannot be it: ``E = -log1p(-u)`` is at least ``u``, so an entry scores at most ``l / T - log(u)``, one
approximate logarithm of a number the hash already gave. A program keeps its best score so far; a block of entries
whose bounds are all at or below it cannot change the winner, and skips the exact ``log1p``, the division and the
score's logarithm -- most of the kernel's instructions. For scores without structure, the ``k``-th block of a
program holds the best of its first ``k`` blocks with probability ``1 / k`` (the bound, a little looser than the
score, passes a little more often), and the peaked rows of a trained model pass far less often, so after the first
blocks most take the short path. The bound carries a slack (``BOUND_SLACK``) larger than every rounding between it
and the computed score, so the winner, and the tokens, are exactly those of ``PRUNE=False``. The probability path
(``p / E``) does not prune: it runs after top-k/top-p, whose own passes over the row cost more than the race.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice

LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
#: Added to the bound ``l / T - log(u)`` so that it stays above the computed score whatever the rounding. Where
#: u < 2**-25, E is u itself (``w == 1`` below), both logarithms take the same input and agree bit for bit. Above
#: it, log2 of u and of E lies in (-25, 4.1], where lg2.approx is within 2 units in the last place (~3.8e-6 at 25,
#: ~2.6e-6 once times ln 2) and the multiply by ln 2 rounds by ~1e-6; E is within a few units in the last place
#: of -log1p(-u) (~4e-7 in its logarithm), and subtracting the slack rounds by ~1e-6. The worst case of the sum,
#: ~9e-6, is under half the slack.
BOUND_SLACK: tl.constexpr = tl.constexpr(2e-5)


@triton.jit
def _log(x, FAST_LOG: tl.constexpr):
    """Natural logarithm: the hardware's lg2.approx times ln 2 with FAST_LOG, the exact routine otherwise."""
    if FAST_LOG:
        return libdevice.fast_log2f(x) * LN2
    else:
        return tl.log(x)


@triton.jit
def hash32(x):
    """sampler.hash32 on uint32 values: the multiplies wrap modulo 2**32 and the shifts are logical. Its
    constants (_HASH_MUL_1, _HASH_MUL_2) are written out, as are the salts below (_SALT_SEED, _SALT_KEY2):
    a jitted function reads literals."""
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    return x ^ (x >> 15)


@triton.jit
def race_kernel(
    x, stride_x,  # [B, V] float32, bfloat16 or float16: logits (LOG_SPACE) or probabilities
    inv_temperatures,  # [B] float32 (LOG_SPACE only)
    seeds, steps,  # [B] int64
    chunk_scores, chunk_ids,  # [B, C] float32 and int64: each chunk's best score and its id (C = grid axis 1)
    vocab_size, chunk_size,  # chunk_size: a multiple of BLOCK
    LOG_SPACE: tl.constexpr, BLOCK: tl.constexpr, FAST_LOG: tl.constexpr = False, PRUNE: tl.constexpr = True,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    seed = tl.load(seeds + row)
    step = tl.load(steps + row)
    # The row's two keys, as in seeded_uniform: fold the 64-bit seed and the step into 32 bits twice over.
    key = hash32((seed >> 32).to(tl.uint32) ^ 0x3C6EF372)
    key = hash32(key ^ seed.to(tl.uint32))
    key1 = hash32(key ^ step.to(tl.uint32))
    key2 = hash32(key1 ^ 0x1B873593)
    if LOG_SPACE:
        inv_t = tl.load(inv_temperatures + row)
    start = chunk * chunk_size
    end = tl.minimum(start + chunk_size, vocab_size)
    x_row = x + row * stride_x
    offs = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), -float("inf"), tl.float32)  # per lane: the best score so far...
    best_id = tl.zeros((BLOCK,), dtype=tl.int32)  # ...and the first id that reached it
    top = tl.max(best, axis=0)  # the program's best score so far (-inf)
    for block_start in range(start, end, BLOCK):
        v = block_start + offs
        mask = v < end
        h = hash32(hash32(v.to(tl.uint32) ^ key1) ^ key2)
        u = (h.to(tl.float32) + 0.5) * (2.0**-32)
        u = tl.minimum(u, 1.0 - 2.0**-24)
        val = tl.load(x_row + v, mask=mask, other=0.0).to(tl.float32)
        if LOG_SPACE:
            val = val * inv_t
        exact = True
        if PRUNE and LOG_SPACE:
            # E >= u, so no entry of the block can score above l / T - log(u) (plus BOUND_SLACK, which covers the
            # logarithms' rounding): one cheap logarithm of u. A block whose bounds all stay at or below the best
            # score so far cannot change the winner, and skips the exact noise.
            bound = tl.where(mask, val - (_log(u, FAST_LOG) - BOUND_SLACK), -float("inf"))
            exact = tl.max(bound, axis=0) > top
        if exact:
            # E = -log1p(-u), not -log(1 - u): in float32, 1 - u loses the low bits of a small u, and the winners of
            # the race live there. Kahan's log1p: w = 1 - u is rounded, but log(w) / (w - 1) varies so slowly near
            # 1 that evaluating it at the rounded w and multiplying by the exact -u gives log1p(-u) to a few units
            # in the last place, in float32 (a float64 logarithm is as exact and a long software routine on a GPU).
            w = 1.0 - u
            e = tl.where(w == 1.0, u, -tl.log(w) * (u / (1.0 - w)))
            if LOG_SPACE:
                score = val - _log(e, FAST_LOG)  # lg2.approx with FAST_LOG: see the module docstring
            else:
                score = val / e
            better = mask & (score > best)  # strictly better: an equal score later in the row keeps the earlier id
            best_id = tl.where(better, v, best_id)
            best = tl.where(better, score, best)
            if PRUNE and LOG_SPACE:
                top = tl.max(best, axis=0)
    top = tl.max(best, axis=0)
    top_id = tl.min(tl.where(best == top, best_id, vocab_size), axis=0)  # ties: the lowest id
    out = row * tl.num_programs(1) + chunk
    tl.store(chunk_scores + out, top)
    tl.store(chunk_ids + out, top_id.to(tl.int64))
