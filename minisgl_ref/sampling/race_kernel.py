"""The exponential race of :mod:`minisgl_ref.sampling.fused_draw` as a Triton kernel (imported only on a GPU).

One program per row: the row's two hash keys from its seed and step, then a walk over the vocabulary in blocks,
each block making its noise in registers and keeping the best score so far (ties go to the lowest id, as with
``torch.argmax``).
"""

import triton
import triton.language as tl


@triton.jit
def hash32(x):
    """sampler.hash32 on int64 values in [0, 2**32); its constants (_HASH_MUL_1, _HASH_MUL_2, _MASK32) written
    out, as are the salts below (_SALT_SEED, _SALT_KEY2): a jitted function reads literals."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & 0xFFFFFFFF
    return x ^ (x >> 15)


@triton.jit
def race_kernel(
    x, stride_x,  # [B, V] float32: logits (LOG_SPACE) or probabilities
    inv_temperatures,  # [B] float32 (LOG_SPACE only)
    seeds, steps,  # [B] int64
    out,  # [B] int64
    vocab_size,
    LOG_SPACE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    seed = tl.load(seeds + row)
    step = tl.load(steps + row)
    # The row's two keys, as in seeded_uniform: fold the 64-bit seed and the step into 32 bits twice over.
    key = hash32(((seed >> 32) & 0xFFFFFFFF) ^ 0x3C6EF372)
    key = hash32(key ^ (seed & 0xFFFFFFFF))
    key1 = hash32(key ^ (step & 0xFFFFFFFF))
    key2 = hash32(key1 ^ 0x1B873593)
    if LOG_SPACE:
        inv_t = tl.load(inv_temperatures + row)
    best = tl.full((), -float("inf"), tl.float32)
    best_id = tl.zeros((), dtype=tl.int64)
    offs = tl.arange(0, BLOCK).to(tl.int64)
    for start in range(0, vocab_size, BLOCK):
        v = start + offs
        mask = v < vocab_size
        h = hash32(hash32(v ^ key1) ^ key2)
        u = (h.to(tl.float32) + 0.5) * (2.0**-32)
        u = tl.minimum(u, 1.0 - 2.0**-24)
        # -log1p(-u) in float64: float32 1 - u loses small u, and the winners of the race live there.
        e = (-tl.log(1.0 - u.to(tl.float64))).to(tl.float32)
        val = tl.load(x + row * stride_x + v, mask=mask, other=0.0)
        if LOG_SPACE:
            score = val * inv_t - tl.log(e)
        else:
            score = val / e
        score = tl.where(mask, score, -float("inf"))
        block_best = tl.max(score, axis=0)
        block_id = tl.min(tl.where(score == block_best, v, vocab_size), axis=0)  # ties: the lowest id
        better = block_best > best
        best_id = tl.where(better, block_id, best_id)
        best = tl.where(better, block_best, best)
    tl.store(out + row, best_id)
