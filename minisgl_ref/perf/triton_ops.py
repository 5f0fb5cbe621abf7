"""Two per-token kernels of our own, in Triton: fewer kernels, and fewer passes over memory (chapters 08 and 11).

After CUDA graphs removed the launch cost, a decode step of Qwen3-0.6B is still ~370 kernels, and at small batch
most of them move a few kilobytes: each costs its ~2-4 us of fixed GPU time whatever it does. Two groups of
them do so little that merging them is pure gain:

* **QK-norm + RoPE** (Qwen3). Each layer normalises every query head and every key head (two RMSNorm kernels,
  two weights) and then rotates both (one RoPE kernel): three passes over the same few kilobytes.
  :func:`qk_norm_rope_` does all of it in one pass, in place on the ``q`` / ``k`` views of the fused QKV output;
  one program per (token, head), the head's 128 values in registers from load to store.
* **The KV store**. ``pool.k[layer][slots] = k; pool.v[layer][slots] = v`` is two indexing kernels.
  :func:`store_kv_` writes both in one.

Both round at the same points as the plain PyTorch reference (``rms_norm``, ``qk_norm_rope`` and ``store_kv`` in
``layers/kernel_table.py``, ``layers/rotary.py``): the normalised head is rounded to the activation dtype,
multiplied by the weight and rounded again, then rotated in float32 and rounded once more. So they agree with the
reference to the last bit but for the order of the sum of squares (``tests/test_triton_fused.py``, on the CPU
through Triton's interpreter).

They run where the other fused ops run (CUDA, half precision, ``MINISGL_FUSED`` not ``0``), in decode and prefill
steps alike: :mod:`minisgl_ref.perf.kernels` puts them into the layers' kernel table, and
:mod:`minisgl_ref.perf.rope_store` and :mod:`minisgl_ref.perf.norm_folding` call the variants that also store the
K/V and finish a folded norm. In a decode step the gain is the kernels saved; in a prefill step it is the bandwidth:
the step's 16,384 new tokens of Qwen3-0.6B carry ~130 MB of q, k and v per layer, and FlashInfer's QK-norm, its RoPE
and PyTorch's indexed store took ~86 ms of an H100's time over the canonical workload's prefill, where one pass that
reads each value once and writes it once needs about a third of that (``scripts/gpu/measure/prefill_anatomy.py``).

Two costs that once kept them to decode steps are handled here. Triton's Python launcher costs ~20 us of host
time per eager launch, twice a PyTorch or FlashInfer launch (``scripts/gpu/measure/launch_overhead.py``; H100 host): CUDA
graphs hide it in decode steps and small prefill steps, and next to a large prefill step's milliseconds it does
not count (it also replaces three or four launches). And Triton compiles a variant of a kernel per pattern of
argument alignment (a pointer aligned to 16 bytes or not): a misaligned index tensor is copied first
(:func:`_aligned`), so every step runs the one variant that graph capture compiles at start-up, and no step of a
live server waits for a compilation. See :mod:`minisgl_ref.attention.triton_kernels` for the conventions (int64
index arithmetic, no helper ``@triton.jit`` calls) that keep the interpreter fast enough for CPU tests.
"""

from __future__ import annotations

import functools

import torch

from minisgl_ref import env


@functools.cache
def _triton_ok() -> bool:
    if not env.fused_kernels_enabled():
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # not installed: the plain ops are always correct
        return False
    return True


def available(x: torch.Tensor) -> bool:
    """Whether the kernels apply to ``x``: a CUDA half/bf16 tensor and Triton importable."""
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and _triton_ok()


@functools.cache
def _kernels():  # type: ignore[no-untyped-def]
    """Compile (decorate) the kernels on first use, so importing this module does not import Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def qk_norm_rope_kernel(
        q, k, v,  # [T, H, D], [T, KVH, D], [T, KVH, D] views (last dim contiguous); q and k rotated in place
        q_weight, k_weight,  # [D] each (ignored without HAS_NORM)
        cos, sin,  # [max_position, D / 2] float32
        positions,  # [T]
        k_pool, v_pool, slots,  # [num_slots, KVH, D] contiguous, [T] (ignored without STORE)
        x,  # [T, HIDDEN] rows whose RMS divides q, k and v first (ignored without ROW_RMS)
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_xt, eps, x_eps,
        NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr,
        HAS_NORM: tl.constexpr, STORE: tl.constexpr, HALF: tl.constexpr,
        ROW_RMS: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_X: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, HALF)[None, :]
        # Every load first, then the arithmetic. The loads do not depend on each other (but for the angles, on the
        # position), so issued together they wait about one memory latency; interleaved with the reductions that
        # use them, each would wait for the one before, and this kernel is too small to hide that.
        pos = tl.load(positions + t).to(tl.int64)
        # Rows 0..NUM_Q-1 of the tile are the token's query heads, the next NUM_KV its key heads.
        h = tl.arange(0, BLOCK_H)[:, None].to(tl.int64)
        is_q = h < NUM_Q
        is_k = (h >= NUM_Q) & (h < NUM_Q + NUM_KV)
        hk = tl.maximum(h - NUM_Q, 0)
        rows = is_q | is_k
        base = tl.where(is_q, q + t * stride_qt + h * stride_qh, k + t * stride_kt + hk * stride_kh)
        x1 = tl.load(base + offs, mask=rows, other=0.0)
        x2 = tl.load(base + HALF + offs, mask=rows, other=0.0)
        if ROW_RMS:  # the token's input row was multiplied unnormalised: divide by its RMS now (norm folding)
            xo = tl.arange(0, BLOCK_X)
            xr = tl.load(x + t * stride_xt + xo, mask=xo < HIDDEN, other=0.0).to(tl.float32)
        if HAS_NORM:
            w1 = tl.where(is_q, tl.load(q_weight + offs), tl.load(k_weight + offs)).to(tl.float32)
            w2 = tl.where(is_q, tl.load(q_weight + HALF + offs), tl.load(k_weight + HALF + offs)).to(tl.float32)
        if STORE or ROW_RMS:
            hv = tl.arange(0, BLOCK_KV)[:, None].to(tl.int64)
            d = tl.arange(0, 2 * HALF)[None, :]
            in_v = hv < NUM_KV
            val = tl.load(v + t * stride_vt + hv * stride_vh + d, mask=in_v)
        if STORE:
            slot = tl.load(slots + t).to(tl.int64)
        c = tl.load(cos + pos * HALF + offs)
        s = tl.load(sin + pos * HALF + offs)

        dtype = x1.dtype
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        if ROW_RMS:  # rounded as the projection of the normalised row would have been
            x_r = 1.0 / tl.sqrt(tl.sum(xr * xr, axis=0) / HIDDEN + x_eps)
            a = (a * x_r).to(dtype).to(tl.float32)
            b = (b * x_r).to(dtype).to(tl.float32)
        if HAS_NORM:
            mean_sq = (tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1))[:, None] / (2 * HALF)
            r = 1.0 / tl.sqrt(mean_sq + eps)
            # weight * round(x * r), rounded: the reference's two roundings (RMSNorm._norm)
            a = (w1 * (a * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            b = (w2 * (b * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        y1 = (a * c - b * s).to(dtype)
        y2 = (b * c + a * s).to(dtype)
        tl.store(base + offs, y1, mask=rows)
        tl.store(base + HALF + offs, y2, mask=rows)
        if ROW_RMS:  # the values are divided by the row's RMS too, in place
            val = (val.to(tl.float32) * x_r).to(dtype)
            tl.store(v + t * stride_vt + hv * stride_vh + d, val, mask=in_v)
        if STORE:  # the rotated key heads and the value heads go straight into the token's KV slot
            pool_row = slot * (NUM_KV * 2 * HALF) + hk * (2 * HALF)
            tl.store(k_pool + pool_row + offs, y1, mask=is_k)
            tl.store(k_pool + pool_row + HALF + offs, y2, mask=is_k)
            tl.store(v_pool + slot * (NUM_KV * 2 * HALF) + hv * (2 * HALF) + d, val, mask=in_v)

    @triton.jit
    def store_kv_kernel(
        k, v,  # [T, KVH * D] rows (row stride given, elements contiguous)
        k_pool, v_pool,  # [num_slots, KVH * D] contiguous
        slots,  # [T]
        stride_kt, stride_vt,
        ROW: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots + t).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        tl.store(k_pool + slot * ROW + offs, tl.load(k + t * stride_kt + offs, mask=mask), mask=mask)
        tl.store(v_pool + slot * ROW + offs, tl.load(v + t * stride_vt + offs, mask=mask), mask=mask)

    @triton.jit
    def silu_and_mul_rms_kernel(
        gate_up, x, out,  # [T, 2 * I], [T, HIDDEN], [T, I] (rows given by their strides, elements contiguous)
        stride_gt, stride_xt, stride_ot, x_eps,
        I: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < I
        g = tl.load(gate_up + t * stride_gt + cols, mask=mask, other=0.0)  # every load first (qk_norm_rope_kernel)
        u = tl.load(gate_up + t * stride_gt + I + cols, mask=mask, other=0.0)
        xo = tl.arange(0, BLOCK_X)
        xr = tl.load(x + t * stride_xt + xo, mask=xo < HIDDEN, other=0.0).to(tl.float32)
        x_r = 1.0 / tl.sqrt(tl.sum(xr * xr, axis=0) / HIDDEN + x_eps)
        a = g.to(tl.float32) * x_r
        y = a / (1.0 + tl.exp(-a)) * (u.to(tl.float32) * x_r)
        tl.store(out + t * stride_ot + cols, y.to(g.dtype), mask=mask)

    return qk_norm_rope_kernel, store_kv_kernel, silu_and_mul_rms_kernel


def qk_norm_rope_(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    row_rms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalise (when weights are given) and rotate ``q`` [T, H, D] and ``k`` [T, KVH, D] in place, neox layout.

    ``cos`` / ``sin`` are the rotary tables ``[max_position, D / 2]`` (float32); ``D`` must be a power of two.
    ``store=(v, k_pool, v_pool, slots)`` also writes each token's rotated keys and its values ``v`` [T, KVH, D]
    into its KV slot: ``k_pool[slots] = k; v_pool[slots] = v`` (pools ``[num_slots, KVH, D]``, contiguous), in the
    same kernel, so a decode step needs no separate store kernel per layer.

    ``row_rms=(x, v, x_eps)`` first divides each token's q, k and ``v`` (in place) by the RMS of its row of ``x``
    [T, hidden]: q, k and v were projected from ``x`` itself, with the input norm's weight folded into the
    projection (:mod:`minisgl_ref.perf.norm_folding`), and this is the rest of that norm."""
    kernel, _, _ = _kernels()
    t, num_q, d = q.shape
    num_kv = k.shape[1]
    if (q_weight is None) != (k_weight is None):
        raise ValueError("give both q_weight and k_weight, or neither")
    if d & (d - 1) or q.stride(-1) != 1 or k.stride(-1) != 1 or cos.shape[-1] * 2 != d:
        raise ValueError(f"qk_norm_rope_ needs a power-of-two head dim, contiguous heads and a full rotary table; "
                         f"got q {tuple(q.shape)} strides {q.stride()}, cos {tuple(cos.shape)}")
    if store is not None:
        v, k_pool, v_pool, slots = store
        if (v.shape != k.shape or v.stride(-1) != 1 or k_pool.shape[1:] != k.shape[1:]
                or v_pool.shape != k_pool.shape or not (k_pool.is_contiguous() and v_pool.is_contiguous())
                or k_pool.dtype != q.dtype or v_pool.dtype != v.dtype or slots.shape != (t,)):
            raise ValueError(f"qk_norm_rope_: store needs v shaped like k {tuple(k.shape)} and contiguous pools "
                             f"[slots, {num_kv}, {d}] of the same dtype with one slot per token; got v "
                             f"{tuple(v.shape)}, pools {tuple(k_pool.shape)} / {tuple(v_pool.shape)}, "
                             f"slots {tuple(slots.shape)}")
    else:
        k_pool, v_pool, slots = k, k, positions  # unused without STORE
        v = row_rms[1] if row_rms is not None else k
    x, x_eps = q, 0.0  # unused without ROW_RMS
    if row_rms is not None:
        x, v_scaled, x_eps = row_rms
        if (x.dim() != 2 or x.shape[0] != t or x.stride(-1) != 1 or x.dtype != q.dtype
                or v_scaled is not v or v.shape != k.shape or v.stride(-1) != 1):
            raise ValueError(f"qk_norm_rope_: row_rms needs x [{t}, hidden] (rows contiguous, dtype {q.dtype}) and "
                             f"the same v as store=, shaped like k; got x {tuple(x.shape)} {x.dtype}, "
                             f"v {tuple(v_scaled.shape)}")
    if t == 0:
        return q, k
    has_norm = q_weight is not None
    positions, slots = _aligned(positions), _aligned(slots)
    kernel[(t,)](
        q, k, v, q_weight if has_norm else q, k_weight if has_norm else k, cos, sin, positions,
        k_pool, v_pool, slots, x, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        x.stride(0), eps, x_eps,
        NUM_Q=num_q, NUM_KV=num_kv, BLOCK_H=_next_pow2(num_q + num_kv), BLOCK_KV=_next_pow2(num_kv),
        HAS_NORM=has_norm, STORE=store is not None, HALF=d // 2,
        ROW_RMS=row_rms is not None, HIDDEN=x.shape[-1], BLOCK_X=_next_pow2(x.shape[-1]),
    )  # fmt: skip
    return q, k


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a copy of it when its address is not a multiple of 16 bytes: a view into a larger index tensor
    may start anywhere, and Triton would compile another variant of the kernel for it."""
    return x if x.data_ptr() % 16 == 0 else x.clone()


def rows_fit(k_pool: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``x`` [T, KVH, D] has the pool's row shape with each token's heads contiguous, as :func:`store_kv_`
    needs (the ``k`` / ``v`` views of a fused QKV output do)."""
    return x.shape[1:] == k_pool.shape[1:] and x.stride(2) == 1 and (x.shape[1] == 1 or x.stride(1) == x.shape[2])


def _next_pow2(n: int) -> int:
    """The smallest power of two >= ``n``: Triton tiles have power-of-two sides."""
    return 1 << max(n - 1, 0).bit_length()


def store_kv_(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
    """``k_pool[slots] = k; v_pool[slots] = v`` in one kernel. Pools ``[num_slots, KVH, D]`` contiguous; ``k`` /
    ``v`` ``[T, KVH, D]`` with each token's heads contiguous (views of the QKV output are)."""
    _, kernel, _ = _kernels()
    t = k.shape[0]
    row = k_pool.shape[1] * k_pool.shape[2]
    for name, x in (("k", k), ("v", v)):
        if not rows_fit(k_pool, x):
            raise ValueError(f"store_kv_: {name} rows must be {row} contiguous values, got {tuple(x.shape)} "
                             f"strides {x.stride()}")
    if t == 0:
        return
    block = _next_pow2(row)
    slots = _aligned(slots)
    kernel[(t,)](k, v, k_pool, v_pool, slots, k.stride(0), v.stride(0), ROW=row, BLOCK=block)


#: Columns of the activation one program of :func:`silu_and_mul_rms` computes.
ACT_BLOCK = 1024


def silu_and_mul_rms(gate_up: torch.Tensor, x: torch.Tensor, x_eps: float) -> torch.Tensor:
    """``silu(gate / rms) * (up / rms)`` with ``gate_up = [gate | up]`` [T, 2 * I] and ``rms`` the RMS of each
    token's row of ``x`` [T, hidden]: the MLP's activation when the norm before it is folded into ``gate_up``'s
    weight (:mod:`minisgl_ref.perf.norm_folding`). One kernel, as FlashInfer's ``silu_and_mul`` is; each program
    reads its token's row of ``x`` (a few kilobytes) to finish the norm."""
    *_, kernel = _kernels()
    t, two_i = gate_up.shape
    if (gate_up.dim() != 2 or two_i % 2 or gate_up.stride(-1) != 1 or x.dim() != 2 or x.shape[0] != t
            or x.stride(-1) != 1 or x.dtype != gate_up.dtype):
        raise ValueError(f"silu_and_mul_rms needs gate_up [T, 2 * I] and x [T, hidden] of one dtype with contiguous "
                         f"rows; got {tuple(gate_up.shape)} {gate_up.dtype} and {tuple(x.shape)} {x.dtype}")
    inter = two_i // 2
    out = torch.empty(t, inter, dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    kernel[(t, -(-inter // ACT_BLOCK))](
        gate_up, x, out, gate_up.stride(0), x.stride(0), out.stride(0), x_eps,
        I=inter, HIDDEN=x.shape[-1], BLOCK_X=_next_pow2(x.shape[-1]), BLOCK=min(ACT_BLOCK, _next_pow2(inter)),
    )  # fmt: skip
    return out
