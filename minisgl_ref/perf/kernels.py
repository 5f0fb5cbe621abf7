"""The fused per-token kernels, installed into the layers' kernel table (chapters 08 and 11).

The layers call their small per-token ops through :data:`~minisgl_ref.layers.kernel_table.KERNELS`, whose entries
start as plain PyTorch. :func:`install` replaces each entry by one that runs a fused kernel where it applies and the
plain entry everywhere else:

================  =====================================================  ==========================================
entry             fused kernel                                           applies to
================  =====================================================  ==========================================
``rms_norm``      FlashInfer ``rmsnorm``                                 CUDA half/bf16, FlashInfer importable
``add_rms_norm``  FlashInfer ``fused_add_rmsnorm`` (in place)            the same
``silu_and_mul``  FlashInfer ``silu_and_mul``                            the same
``qk_norm_rope``  our Triton ``qk_norm_rope_`` (QK-norm and RoPE in       CUDA half/bf16, Triton importable, q's
                  one pass, in place); else QK-norm through the table    head dim the rotary table's; FlashInfer's
                  and FlashInfer's RoPE                                  RoPE as for ``rms_norm``
``store_kv``      our Triton ``store_kv_`` (K and V in one kernel)       CUDA half/bf16, Triton importable, K/V in
                                                                         the pool's dtype and row shape
================  =====================================================  ==========================================

Every condition is checked on each call, on the tensors at hand (and ``MINISGL_FUSED=0`` turns all of them off),
so an installed table still computes the plain ops on a CPU tensor or in float32: the CPU oracle tests compare
exact arithmetic in any process. :func:`~minisgl_ref.perf.model_transforms.apply_` installs the table for a model
that serves on a CUDA device; :func:`warmup_jobs` compiles FlashInfer's three kernel families at start-up.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields

import torch

from minisgl_ref.engine.warmup import KernelShapes
from minisgl_ref.layers import kernel_table
from minisgl_ref.layers.kernel_table import KERNELS, Norm, Rotary
from minisgl_ref.perf import fused_ops, triton_ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if fused_ops.fused_available(x):  # one FlashInfer kernel, also on [T, heads, head_dim] views (QK-norm)
        return fused_ops.rmsnorm(x, weight, eps)
    return kernel_table.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if fused_ops.fused_available(x):
        return fused_ops.fused_add_rmsnorm(x, residual, weight, eps)
    return kernel_table.add_rms_norm(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if fused_ops.fused_available(gate_up):  # one kernel instead of three
        return fused_ops.silu_and_mul(gate_up)
    return kernel_table.silu_and_mul(gate_up)


def qk_norm_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, rotary: Rotary,
                 q_norm: Norm | None = None, k_norm: Norm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if triton_ops.available(q) and q.shape[-1] == rotary.head_dim:  # one Triton kernel, in place
        norm = (q_norm.weight, k_norm.weight, q_norm.eps) if q_norm is not None and k_norm is not None else ()
        return triton_ops.qk_norm_rope_(positions, q, k, rotary.cos_cache, rotary.sin_cache, *norm)
    if q_norm is not None and k_norm is not None:
        q, k = q_norm(q), k_norm(k)  # through the table: FlashInfer's RMSNorm where it runs
    if fused_ops.fused_available(q):  # one FlashInfer kernel for q and k together
        return fused_ops.rope_inplace(positions, q, k, cos_sin_cache(rotary, q.device))
    return rotary(positions, q, k)


def store_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    if (triton_ops.available(k) and k.dtype == k_pool.dtype and v.dtype == v_pool.dtype
            and triton_ops.rows_fit(k_pool, k) and triton_ops.rows_fit(v_pool, v)):
        triton_ops.store_kv_(k_pool, v_pool, slots, k, v)
        return
    kernel_table.store_kv(k_pool, v_pool, slots, k, v)


_COS_SIN: weakref.WeakKeyDictionary[object, torch.Tensor] = weakref.WeakKeyDictionary()


def cos_sin_cache(rotary: Rotary, device: torch.device) -> torch.Tensor:
    """FlashInfer's rotary table for ``rotary``: ``[max_position, head_dim]`` float32 on ``device``, the cos table
    then the sin table along the last dim. Made on first use and kept as long as the rotary layer lives."""
    table = _COS_SIN.get(rotary)
    if table is None or table.device != device:
        table = torch.cat([rotary.cos_cache, rotary.sin_cache], dim=-1).to(device).contiguous()
        _COS_SIN[rotary] = table
    return table


_FUSED: dict[str, Callable[..., object]] = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm,
                                            "silu_and_mul": silu_and_mul, "qk_norm_rope": qk_norm_rope,
                                            "store_kv": store_kv}


def install() -> None:
    """Put the fused entries into the layers' kernel table, for every layer of this process (idempotent)."""
    for name, op in _FUSED.items():
        setattr(KERNELS, name, op)


def uninstall() -> None:
    """Put the plain entries back."""
    KERNELS.reset()


def is_installed() -> bool:
    return all(getattr(KERNELS, name) is op for name, op in _FUSED.items())


@contextmanager
def installed() -> Iterator[None]:
    """The fused entries inside the ``with`` block, and whatever the table held before after it (for tests)."""
    saved = {f.name: getattr(KERNELS, f.name) for f in fields(KERNELS)}
    install()
    try:
        yield
    finally:
        for name, op in saved.items():
            setattr(KERNELS, name, op)


# --------------------------------------------------------------------------------------- start-up compiles


def _compile(shapes: KernelShapes, device: torch.device, family: str) -> None:
    """Run one of FlashInfer's fused-op JIT families (``norm``, ``activation`` or ``rope``) once on zeros."""
    x = torch.zeros(2, shapes.hidden_size, dtype=shapes.dtype, device=device)
    if not fused_ops.fused_available(x):
        return
    if family == "norm":
        w = torch.ones(shapes.hidden_size, dtype=shapes.dtype, device=device)
        fused_ops.rmsnorm(x, w, 1e-6)
        fused_ops.fused_add_rmsnorm(x.clone(), x.clone(), w, 1e-6)
    elif family == "activation":
        fused_ops.silu_and_mul(torch.zeros(2, 2 * shapes.intermediate_size, dtype=shapes.dtype, device=device))
    else:
        q = torch.zeros(2, shapes.num_q_heads, shapes.head_dim, dtype=shapes.dtype, device=device)
        k = torch.zeros(2, shapes.num_kv_heads, shapes.head_dim, dtype=shapes.dtype, device=device)
        cos_sin = torch.zeros(8, shapes.head_dim, dtype=torch.float32, device=device)
        fused_ops.rope_inplace(torch.zeros(2, dtype=torch.int64, device=device), q, k, cos_sin)


def warmup_jobs(shapes: KernelShapes, device: torch.device) -> dict[str, Callable[[], None]]:
    """The start-up compiles of the fused ops, for :func:`minisgl_ref.engine.warmup.start`. Each FlashInfer family
    is its own nvcc build (on a bare H100 the three took 128 s one after the other and 72 s in threads,
    ``docs/data/startup_and_cascade_h100.json``), so each is its own job, and its own thread."""
    return {family: (lambda family=family: _compile(shapes, device, family))  # type: ignore[misc]
            for family in ("norm", "activation", "rope")}
