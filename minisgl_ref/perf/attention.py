"""Chapter 11's attention speed-ups, plugged into the engine through the seams its core declares.

Two of them change what a decode step runs, and :func:`attention_planner` (the engine's
:data:`~minisgl_ref.engine.attention_planner.PlannerFactory`, which :func:`minisgl_ref.runtime.build_runtime` hands
to every engine it builds) installs both before any CUDA graph is captured:

* the split-KV decode kernel (:mod:`~minisgl_ref.perf.split_decode`), given to the engine's backend through its
  ``use_decode_kernel`` hook for decode batches of ``--split-decode-min-batch`` rows and more (the FlashInfer
  backend takes it; the others keep their own kernels);
* cascade decode attention (:mod:`~minisgl_ref.perf.cascade`): with a radix cache and unless
  ``--disable-cascade-attention``, the planner is a :class:`~minisgl_ref.perf.cascade.CascadePlanner`, which sends
  decode batches whose rows share a cached prefix to the cascade backend (and so to its own graphs).

:func:`warmup_jobs` adds the split-KV kernel's build to the start-up compiles (``engine/warmup.py``), so that the
first engine on a machine does not build it while capturing its graphs.

An engine built without this module (``Engine(model, model_config, config)``, as the tests of chapters 03-10 build
it) runs every step on its own backend with its own kernels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from minisgl_ref.core.config import EngineConfig
from minisgl_ref.engine.attention_planner import AttentionPlanner, AttentionSetup
from minisgl_ref.engine.warmup import KernelShapes
from minisgl_ref.perf.cascade import CascadePlanner, make_cascade_backend
from minisgl_ref.perf.split_decode import SplitDecode, load_kernel, supports


def attention_planner(setup: AttentionSetup) -> AttentionPlanner:
    """The engine's planner with chapter 11's decode attention: the split-KV kernel installed in its backend,
    and a cascade when one can help. The split-KV kernel reads bf16 only: with an FP8 cache (chapter 15) it is
    left out, and the cascade reads the cache as the engine's Triton backend does."""
    if not setup.kv_pool.quantized:
        install_split_decode(setup)
    cascade = make_cascade_backend(setup.config, setup.kv_pool, setup.req_to_token, setup.backend,
                                   num_q_heads=setup.num_q_heads)
    return AttentionPlanner(setup.backend) if cascade is None else CascadePlanner(setup.backend, cascade)


def install_split_decode(setup: AttentionSetup) -> bool:
    """Offer the split-KV kernel to the engine's decode backend, when ``--split-decode-min-batch`` is on and the
    kernel is compiled for the attention shape (bf16, head dim 128, 1, 2 or 4 query heads per KV head). The kernel
    is built when a batch first needs it; returns whether the backend took it."""
    min_batch = setup.config.split_decode_min_batch
    decode = setup.backend.phase_backend(decode=True)
    kv_heads, head_dim, dtype = decode.num_kv_heads, decode.head_dim, setup.kv_pool.k[0].dtype
    if min_batch <= 0 or not supports(setup.num_q_heads, kv_heads, head_dim, dtype):
        return False
    build: Callable[[], SplitDecode] = functools.partial(
        SplitDecode, num_q_heads=setup.num_q_heads, num_kv_heads=kv_heads, head_dim=head_dim,
        sm_scale=head_dim**-0.5, max_batch=setup.req_to_token.max_requests, device=decode.device)
    return setup.backend.use_decode_kernel(build, min_batch)


def warmup_jobs(shapes: KernelShapes, engine: EngineConfig) -> dict[str, Callable[[], None]]:
    """Start-up compiles for chapter 11's kernels: the split-KV decode kernel (nvcc and ninja build it once per
    machine, ~1 minute, then it loads from disk), when the FlashInfer decode backend will take it."""
    if (shapes.decode_backend == "flashinfer" and engine.split_decode_min_batch > 0
            and supports(shapes.num_q_heads, shapes.num_kv_heads, shapes.head_dim, shapes.dtype)):
        return {"split decode attention": _build_split_decode}
    return {}


def _build_split_decode() -> None:
    load_kernel()
