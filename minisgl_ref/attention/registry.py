"""Choosing the attention backend: SGLang's three flags and its defaults (chapter 07).

``--attention-backend NAME`` picks one backend for every step; ``--prefill-attention-backend`` and
``--decode-attention-backend`` override it for one phase. Prefill and decode stress attention differently
(prefill is matrix work over many queries, decode streams the KV cache once per token), so the fastest kernel
for one is not always the fastest for the other. When the two differ, the engine gets a
:class:`HybridAttnBackend` that sends extend steps to one backend and decode steps to the other.

Defaults (no flag given), as in SGLang:

| device | prefill | decode |
| --- | --- | --- |
| CPU | torch_native | torch_native |
| Hopper (sm90) | fa3 (if importable) | flashinfer (if importable) |
| Ampere / Ada (sm80, 86, 89) | flashinfer (if importable) | flashinfer (if importable) |
| anything else, or a float32 model on any GPU | triton | triton |

with ``triton`` standing in wherever the preferred package is missing. A backend that is *asked for* but cannot
run (unknown name, package not installed, a GPU backend on the CPU, FA3 on a GPU that is not a Hopper) stops the
engine at start-up with one ``ValueError`` line that says what to do instead.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from minisgl_ref import env
from minisgl_ref.attention.base import AttentionBackend, DecodeKernel
from minisgl_ref.core.config import EngineConfig, validate_backend_name

if TYPE_CHECKING:
    from minisgl_ref.core.forward_batch import ForwardBatch
    from minisgl_ref.kvcache.pool import KVPool
    from minisgl_ref.kvcache.req_to_token import ReqToTokenPool
    from minisgl_ref.layers.attention import AttentionLayer

INSTALL_HINT = "pip install 'minisgl_ref[gpu]'"
HALF_DTYPES = (torch.float16, torch.bfloat16)


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def flash_attention_importable() -> bool:
    return _importable("flash_attn_interface") or _importable("flash_attn")


def default_backends(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> tuple[str, str]:
    """(prefill, decode) for a device when the user names none (see the module docstring's table). FlashInfer and
    FlashAttention compute in fp16/bf16 only, so a float32 model on a GPU gets our Triton kernels."""
    if device.type != "cuda":
        return "torch_native", "torch_native"
    if dtype not in HALF_DTYPES:
        return "triton", "triton"
    major, minor = torch.cuda.get_device_capability(device)
    has_flashinfer = _importable("flashinfer")
    if major == 9:
        prefill = "fa3" if _importable("flash_attn_interface") else ("flashinfer" if has_flashinfer else "triton")
        return prefill, "flashinfer" if has_flashinfer else "triton"
    if (major, minor) in ((8, 0), (8, 6), (8, 9)) and has_flashinfer:
        return "flashinfer", "flashinfer"
    return "triton", "triton"


def resolve_backend_names(
    config: EngineConfig, device: torch.device, dtype: torch.dtype = torch.bfloat16, *, quantized_kv: bool = False
) -> tuple[str, str]:
    """The (prefill, decode) pair for this engine: explicit per-phase flags, then ``--attention-backend``, then
    the device default. A default that cannot read a quantized KV cache (chapter 15: FlashAttention-3) gives way
    to the decode default where that one can (FlashInfer on a Hopper), else to the Triton backend; an explicit
    choice is kept (and refused by name when it cannot)."""
    auto_prefill, auto_decode = default_backends(device, dtype)
    if quantized_kv:
        fallback = auto_decode if _reads_quantized_kv(auto_decode) else "triton"
        auto_prefill, auto_decode = (n if _reads_quantized_kv(n) else fallback for n in (auto_prefill, auto_decode))
    prefill = config.prefill_attention_backend or config.attention_backend or auto_prefill
    decode = config.decode_attention_backend or config.attention_backend or auto_decode
    return prefill, decode


def check_backend_can_run(name: str, device: torch.device, dtype: torch.dtype | None = None) -> None:
    """Raise one clear ``ValueError`` if backend ``name`` cannot run on ``device`` (with a KV cache of ``dtype``,
    when given) in this installation."""
    validate_backend_name("attention backend", name)
    if name == "torch_native":
        return
    if name == "triton":
        if not _importable("triton"):
            raise ValueError(f"attention backend 'triton' needs the triton package ({INSTALL_HINT})")
        if device.type == "cpu" and not env.triton_interpreter():
            raise ValueError(
                "attention backend 'triton' needs a CUDA device; on the CPU it runs only in Triton's interpreter "
                "(set TRITON_INTERPRET=1 before starting; slow, for tests), else use torch_native"
            )
        return
    if device.type != "cuda":
        raise ValueError(f"attention backend {name!r} needs a CUDA device (this engine runs on {device.type}); "
                         "use torch_native on the CPU")  # fmt: skip
    if name in ("flashinfer", "fa3") and dtype is not None and dtype not in HALF_DTYPES:
        raise ValueError(f"attention backend {name!r} computes in float16/bfloat16 only, and this model is "
                         f"{str(dtype).replace('torch.', '')}: use --dtype bfloat16, or the triton backend")  # fmt: skip
    if name == "flashinfer":
        if not _importable("flashinfer"):
            raise ValueError(f"attention backend 'flashinfer' needs the flashinfer-python package ({INSTALL_HINT})")
        return
    assert name == "fa3"
    if not flash_attention_importable():
        raise ValueError(
            f"attention backend 'fa3' needs FlashAttention (module flash_attn_interface for FA3, or flash_attn for "
            f"FA2; {INSTALL_HINT})"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if major == 9 and _importable("flash_attn_interface"):
        return
    if _importable("flash_attn"):  # FA2: Ampere and newer
        if major < 8:
            raise ValueError(f"attention backend 'fa3' (FlashAttention-2 here) needs an sm80+ GPU, not sm{major}{minor}")
        return
    raise ValueError(
        f"attention backend 'fa3' (FlashAttention-3) runs on Hopper GPUs (sm90) only; this GPU is sm{major}{minor}: "
        "use flashinfer or triton"
    )


#: name -> (module of this package, class, the engine facts its constructor takes). Modules are imported only
#: when their backend is built, so a CPU-only install never imports triton, flashinfer or flash-attn.
BACKENDS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "torch_native": ("torch_native", "TorchNativeBackend", ()),
    "triton": ("triton_backend", "TritonAttnBackend", ("num_q_heads",)),
    "flashinfer": ("flashinfer_backend", "FlashInferBackend", ("num_q_heads",)),
    "fa3": ("fa3_backend", "FlashAttentionBackend", ("page_size",)),
}


def _reads_quantized_kv(name: str) -> bool:
    """Whether backend ``name`` reads a quantized KV pool (chapter 15); False where its module cannot import."""
    module, class_name, _ = BACKENDS[name]
    try:
        return bool(getattr(importlib.import_module(f"minisgl_ref.attention.{module}"), class_name).reads_quantized_kv)
    except ImportError:
        return False


def _quantized_kv_backends() -> list[str]:
    """The backends that read a quantized KV pool (chapter 15)."""
    return [name for name in BACKENDS if _reads_quantized_kv(name)]


def build_backend(
    name: str,
    kv_pool: KVPool,
    req_to_token: ReqToTokenPool,
    *,
    num_q_heads: int,
    page_size: int,
    device: torch.device,
) -> AttentionBackend:
    """One backend by name (after :func:`check_backend_can_run`)."""
    check_backend_can_run(name, device)
    module, class_name, wants = BACKENDS[name]
    cls = getattr(importlib.import_module(f"minisgl_ref.attention.{module}"), class_name)
    if kv_pool.quantized and not cls.reads_quantized_kv:
        raise ValueError(f"the {name} attention backend cannot read a KV cache stored as "
                         f"{str(kv_pool.storage_dtype).replace('torch.', '')} with scales (--kv-cache-dtype); "
                         f"use {', '.join(n for n in _quantized_kv_backends())}")
    facts = {"num_q_heads": num_q_heads, "page_size": page_size}
    return cls(kv_pool, req_to_token, **{fact: facts[fact] for fact in wants})


def create_attention_backend(
    config: EngineConfig,
    kv_pool: KVPool,
    req_to_token: ReqToTokenPool,
    *,
    num_q_heads: int,
    device: torch.device | str,
) -> AttentionBackend:
    """The engine's attention backend: one backend, or a :class:`HybridAttnBackend` when the prefill and decode
    choices differ. ``num_q_heads`` is the query heads per rank (the planners of FlashInfer and the graph
    buffers of Triton need it before the first layer runs)."""
    device = torch.device(device)
    dtype = kv_pool.dtype  # what attention computes in (the buffers may be smaller: chapter 15)
    prefill, decode = resolve_backend_names(config, device, dtype, quantized_kv=kv_pool.quantized)
    # Check both before building either, so that the error names the first problem and nothing is allocated.
    check_backend_can_run(prefill, device, dtype)
    check_backend_can_run(decode, device, dtype)
    kw = dict(num_q_heads=num_q_heads, page_size=config.page_size, device=device)
    if prefill == decode:
        return build_backend(prefill, kv_pool, req_to_token, **kw)  # type: ignore[arg-type]
    return HybridAttnBackend(
        build_backend(prefill, kv_pool, req_to_token, **kw),  # type: ignore[arg-type]
        build_backend(decode, kv_pool, req_to_token, **kw),  # type: ignore[arg-type]
    )


class HybridAttnBackend(AttentionBackend):
    """Two backends behind one interface: extend steps (prefill, chunks, mixed batches) go to ``prefill``,
    decode steps to ``decode``. Both read and write the same KV pool, so a request prefilled by one is decoded by
    the other. The decode graph hooks and a decode kernel from outside go to the decode backend; the extend-graph
    hooks are the prefill backend's, which :meth:`phase_backend` hands out."""

    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend) -> None:
        self.prefill, self.decode = prefill, decode
        self.name = f"{prefill.name}+{decode.name}"
        self.supports_cuda_graph = decode.supports_cuda_graph
        self.supports_custom_mask = prefill.supports_custom_mask  # masks come with extend steps only

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        (self.decode if batch.mode.is_decode else self.prefill).init_forward_metadata(batch)

    @property
    def kv_pool(self) -> KVPool:
        """The pool both sides read and write (one pool per engine)."""
        return self.decode.kv_pool

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch, *,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        side = self.decode if batch.mode.is_decode else self.prefill
        return side.forward(q, k, v, layer, batch, kv_stored=kv_stored)

    def phase_backend(self, decode: bool) -> AttentionBackend:
        return self.decode if decode else self.prefill

    def use_decode_kernel(self, build: Callable[[], DecodeKernel], min_batch: int) -> bool:
        return self.decode.use_decode_kernel(build, min_batch)

    def init_graph_buffers(self, max_bs: int) -> None:
        self.decode.init_graph_buffers(max_bs)

    def prepare_capture(self, batch: ForwardBatch) -> None:
        self.decode.prepare_capture(batch)

    def prepare_replay(self, batch: ForwardBatch) -> None:
        self.decode.prepare_replay(batch)
