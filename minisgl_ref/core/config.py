"""Engine settings, named after SGLang's server arguments so that flags carry over (chapters 03-07).

The list of attention backend names lives here, beside the settings that are checked against it.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Every name ``--attention-backend`` accepts (the backends themselves: ``minisgl_ref.attention``, chapter 07).
ATTENTION_BACKENDS = ("torch_native", "triton", "flashinfer", "fa3")


def validate_backend_name(field: str, value: str | None) -> None:
    """Raise ``ValueError`` naming ``field`` unless ``value`` is None (auto) or a known backend."""
    if value is not None and value not in ATTENTION_BACKENDS:
        raise ValueError(f"{field} must be one of {', '.join(ATTENTION_BACKENDS)} (or unset for auto), got {value!r}")


@dataclass
class EngineConfig:
    max_running_requests: int = 256
    max_prefill_tokens: int = 16384  # new tokens per prefill step, summed over requests
    chunked_prefill_size: int = 8192  # most new tokens of one request per step; -1 disables chunking
    schedule_policy: str = "fcfs"  # or "lpm": longest cached prefix first
    enable_mixed_chunk: bool = False  # let decode tokens ride along in prefill steps
    # In-batch prefix caching (chapter 04): a waiting request that would compute at least this many uncached
    # prompt tokens that another request of the same prefill step is computing waits one step instead, and then
    # finds them in the radix tree. SGLang uses 32 (under lpm). -1 disables it.
    in_batch_prefix_threshold: int = 32
    page_size: int = 1
    disable_radix_cache: bool = False
    disable_overlap_schedule: bool = False
    max_total_tokens: int | None = None  # KV pool size in tokens; default: from memory (GPU) or 16384 (CPU)
    mem_fraction_static: float = 0.85  # GPU: fraction of memory for weights + KV pool
    init_new_token_ratio: float = 0.7  # admission reserves this fraction of each request's remaining output
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001
    # CUDA graphs for decode (chapter 08): captured for padded batch sizes up to cuda_graph_max_bs (default:
    # max_running_requests, at most 256). CUDA only, and only with a backend that has the graph hooks.
    cuda_graph_max_bs: int | None = None
    disable_cuda_graph: bool = False
    # Attention backends (chapter 07): torch_native, triton, flashinfer or fa3; None = the device's default.
    # attention_backend sets both phases; the prefill/decode flags override it for one phase.
    attention_backend: str | None = None
    prefill_attention_backend: str | None = None
    decode_attention_backend: str | None = None

    def __post_init__(self) -> None:
        def need(cond: bool, field: str, what: str, value: object) -> None:
            if not cond:
                raise ValueError(f"{field} must be {what}, got {value!r}")

        need(self.max_running_requests >= 1, "max_running_requests", ">= 1", self.max_running_requests)
        need(self.max_prefill_tokens >= 1, "max_prefill_tokens", ">= 1", self.max_prefill_tokens)
        need(self.chunked_prefill_size == -1 or self.chunked_prefill_size >= 1, "chunked_prefill_size",
             "-1 or >= 1", self.chunked_prefill_size)
        need(self.schedule_policy in ("fcfs", "lpm"), "schedule_policy", "'fcfs' or 'lpm'", self.schedule_policy)
        need(self.in_batch_prefix_threshold == -1 or self.in_batch_prefix_threshold >= 1,
             "in_batch_prefix_threshold", "-1 or >= 1", self.in_batch_prefix_threshold)
        need(self.page_size >= 1, "page_size", ">= 1", self.page_size)
        need(self.max_total_tokens is None or self.max_total_tokens >= self.page_size, "max_total_tokens",
             ">= page_size", self.max_total_tokens)
        need(0.0 < self.mem_fraction_static < 1.0, "mem_fraction_static", "in (0, 1)", self.mem_fraction_static)
        need(self.cuda_graph_max_bs is None or self.cuda_graph_max_bs >= 1, "cuda_graph_max_bs", ">= 1",
             self.cuda_graph_max_bs)
        for name in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
            validate_backend_name(name, getattr(self, name))
