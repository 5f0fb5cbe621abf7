"""What to load and how to run it: the model, engine and tensor-parallel settings (chapters 02-09).

The fields are named after SGLang's server arguments so that flags carry over, and each field that is a
command-line flag says so with :func:`flag`, which carries its help text: :func:`add_flags` turns a dataclass into
an argparse group and :func:`from_flags` turns the parsed flags back into the dataclass, so a default is written
down once, here. The list of attention backend names lives here too, beside the settings checked against it.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

#: Every name ``--attention-backend`` accepts (the backends themselves: ``minisgl_ref.attention``, chapter 07).
ATTENTION_BACKENDS = ("torch_native", "triton", "flashinfer", "fa3")

T = TypeVar("T")


def flag(default: Any, help: str | None = None, **argparse_kwargs: Any) -> Any:
    """A dataclass field that is also the command-line flag ``--field-name`` (``argparse_kwargs``: ``type``,
    ``choices``, ``action``; booleans default to ``store_true``, other types are read off the default)."""
    return field(default=default, metadata={"flag": {"help": help, **argparse_kwargs}})


def add_flags(group: Any, cls: type, **defaults: Any) -> None:
    """Add one flag per :func:`flag` field of ``cls`` to ``group``; ``defaults`` overrides a flag's default
    (``None``: "decided later", e.g. by the device, see ``serve``)."""
    for f in dataclasses.fields(cls):
        if "flag" not in f.metadata:
            continue
        kwargs = dict(f.metadata["flag"])
        if isinstance(f.default, bool) and "action" not in kwargs:
            kwargs["action"] = "store_true"
        elif "type" not in kwargs and "action" not in kwargs and f.default is not None:
            kwargs["type"] = type(f.default)
        group.add_argument("--" + f.name.replace("_", "-"), default=defaults.get(f.name, f.default), **kwargs)


def from_flags(cls: type[T], args: argparse.Namespace, **fixed: Any) -> T:
    """``cls`` built from the parsed flags; a flag left at ``None`` takes the field's default."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
             if "flag" in f.metadata and getattr(args, f.name, None) is not None}
    return cls(**{**given, **fixed})


def to_argv(obj: Any, skip: frozenset[str] = frozenset()) -> list[str]:
    """The command line that parses back into ``obj``'s flag fields (what another process is started with)."""
    argv: list[str] = []
    for f in dataclasses.fields(obj):
        value, name = getattr(obj, f.name), "--" + f.name.replace("_", "-")
        if "flag" not in f.metadata or f.name in skip or value is None:
            continue
        if f.metadata["flag"].get("action") is argparse.BooleanOptionalAction:
            argv.append(name if value else "--no-" + name[2:])
        elif isinstance(value, bool):
            argv += [name] if value else []
        else:
            argv += [name, str(value)]
    return argv


def validate_backend_name(field: str, value: str | None) -> None:
    """Raise ``ValueError`` naming ``field`` unless ``value`` is None (auto) or a known backend."""
    if value is not None and value not in ATTENTION_BACKENDS:
        raise ValueError(f"{field} must be one of {', '.join(ATTENTION_BACKENDS)} (or unset for auto), got {value!r}")


@dataclass(frozen=True)
class ModelArgs:
    """Which model to load, and where (chapter 02)."""

    model_path: str | None = flag(None, "local HF folder, or a shipped config name with --load-format dummy "
                                        "(default: the embedded SmolLM2-135M-Instruct)")
    #: ``dummy``: random weights for the model's config, no files read (shapes and speed, not text)
    load_format: str = flag("auto", choices=["auto", "dummy"])
    #: ``auto``: float32 on a CPU; on a GPU the checkpoint's dtype, bfloat16 for a float32 one
    dtype: str = flag("auto", choices=["auto", "float32", "float16", "bfloat16"])
    device: str | None = flag(None, "cpu or cuda (default: cuda when available)")
    context_length: int | None = flag(None, type=int)  #: the context window (default: the model config's)
    skip_tokenizer_init: bool = False  #: prompts are token ids only (SGLang's --skip-tokenizer-init)
    quantization: str | None = flag(None, "store the weights of an ordinary checkpoint quantized: fp8 (chapter 15; "
                                          "a quantized checkpoint is read as it is stored without this)")


@dataclass(frozen=True)
class TPArgs:
    """How many ranks share the model and where they meet (chapter 09; checked by ``DistConfig``)."""

    tp_size: int = flag(1, "ranks that share the model (one GPU, or CPU process, each)")
    nnodes: int = flag(1, "machines the --tp-size ranks are spread over")
    node_rank: int = flag(0, "this machine's index among the --nnodes")
    dist_init_addr: str | None = flag(None, "host:port on node 0 where the ranks meet (required with --nnodes > 1)")
    ep_size: int = flag(1, "expert parallelism: split each MoE layer's experts over this many groups of the "
                           "--tp-size ranks (a divisor of --tp-size; each expert is sliced over the rest; "
                           "chapter 14)")

    def __post_init__(self) -> None:
        check_ep_size(self.ep_size, self.tp_size)

    @property
    def enabled(self) -> bool:
        return self.tp_size > 1 or self.nnodes > 1


def check_ep_size(ep_size: int, tp_size: int) -> None:
    """Expert parallelism splits the experts over the ranks of the tensor-parallel group, because attention and the
    dense layers keep running tensor-parallel on those same ranks (every rank holds every token): the ``tp_size``
    ranks form ``ep_size`` groups, each holding ``1/ep_size`` of the experts and slicing each of them over its
    ``tp_size / ep_size`` ranks (SGLang's ``moe_tp_size``). So ``ep_size`` divides ``tp_size``: 1 slices every
    expert over all ranks, ``tp_size`` keeps every expert whole on one rank."""
    if ep_size < 1 or tp_size % ep_size:
        raise ValueError(f"ep_size ({ep_size}) must divide tp_size ({tp_size}): the experts are split over "
                         f"the ranks of the tensor-parallel group, which also run attention")


@dataclass
class EngineConfig:
    max_running_requests: int = flag(256, "most requests decoding at once")
    max_prefill_tokens: int = flag(16384, "new tokens per prefill step, summed over requests")
    chunked_prefill_size: int = flag(8192, "most prompt tokens of one request per step; -1 disables chunking "
                                           "(default: 8192; serve on a CPU: 32, see chapter 10)")
    schedule_policy: str = flag("fcfs", "fcfs, or lpm: longest cached prefix first", choices=["fcfs", "lpm"])
    enable_mixed_chunk: bool = flag(False, "decode rows ride along in prefill steps (default: off; serve: "
                                           "on)", action=argparse.BooleanOptionalAction)
    # In-batch prefix caching (chapter 04): SGLang uses 32 (under lpm).
    in_batch_prefix_threshold: int = flag(32, "hold back a request sharing this many uncached prompt tokens with "
                                              "one admitted in the same prefill step, so it hits the radix cache "
                                              "next step (chapter 04); -1 disables")
    page_size: int = flag(1, "tokens per KV page")
    kv_cache_dtype: str = flag("auto", "how the KV pool stores keys and values: auto (the model's dtype), or "
                                       "fp8_e4m3 / fp8_e5m2, one byte each with a per-layer scale (chapter 15)",
                               choices=["auto", "fp8_e4m3", "fp8_e5m2"])
    split_decode_min_batch: int = flag(48, "flashinfer decode: batches of at least this many rows use our "
                                            "split-KV CUDA kernel, balanced over the SMs (0 disables; chapter 11)")
    disable_radix_cache: bool = flag(False, "no prefix sharing between requests (chapter 04)")
    disable_overlap_schedule: bool = flag(False, "schedule the next step only after this one's tokens are back "
                                                 "(chapter 06)")
    max_total_tokens: int | None = flag(None, "KV pool size in tokens (default: from memory on a GPU, 16384 on a "
                                              "CPU)", type=int)
    mem_fraction_static: float = flag(0.85, "GPU: fraction of memory for weights + KV pool")
    init_new_token_ratio: float = 0.7  #: admission reserves this fraction of each request's remaining output
    min_new_token_ratio: float = 0.1  #: the lowest the reserved fraction decays to
    new_token_ratio_decay: float = 0.001  #: per decode step (a retraction adds 0.1)
    # CUDA graphs for decode (chapter 08): CUDA only, and only with a backend that has the graph hooks.
    cuda_graph_max_bs: int | None = flag(None, "capture decode CUDA graphs up to this batch size (default: max "
                                               "running requests, <= 256)", type=int)
    disable_cuda_graph: bool = flag(False, "run decode eagerly (chapter 08)")
    cuda_graph_max_extend_tokens: int = flag(2048, "capture extend steps of up to 64 rows (a prompt, or a prompt "
                                                   "beside decode rows) in CUDA graphs up to this many tokens (fa3 "
                                                   "prefill backend; 0 disables; chapter 11)")
    disable_budget_step_graph: bool = flag(False, "do not capture the extend step of exactly --max-prefill-tokens "
                                                  "tokens (up to 64 rows), which a burst of prompts fills step "
                                                  "after step (chapter 11)")
    extend_token_multiple: int | None = flag(None, "round each extend step's token count up to a multiple of this "
                                                   "with a padding row, so matmuls see few shapes (default: 64 on "
                                                   "CUDA, 1 = off elsewhere; chapter 11)", type=int)
    # Attention backends (chapter 07): attention_backend sets both phases; the prefill/decode flags override it.
    attention_backend: str | None = flag(None, "attention kernels for both phases (chapter 07; default: by "
                                               "device)", choices=ATTENTION_BACKENDS)
    prefill_attention_backend: str | None = flag(None, "attention kernels for extend steps (chapter 07; default: "
                                                       "by device)", choices=ATTENTION_BACKENDS)
    decode_attention_backend: str | None = flag(None, "attention kernels for decode steps (chapter 07; default: "
                                                      "by device)", choices=ATTENTION_BACKENDS)
    # Cascade decode attention (chapter 11): rows sharing a cached prefix read its KV once per step, not once each.
    disable_cascade_attention: bool = flag(False, "decode reads every request's copy of a shared prefix's KV, even "
                                                  "when the radix cache gives several running requests the same "
                                                  "pages (A/B runs; chapter 11)")
    cascade_min_prefix_len: int = flag(256, "shortest shared prefix (tokens) that cascade decode attention reads "
                                            "once for its whole group (chapter 11)")

    # Structured output (chapter 12): append the text a grammar forces without a decode step per token. Off by
    # default, as in SGLang: it is faster (SmolLM2-135M on a CPU, 8 small JSON schemas: 30% less time, 40 decode
    # tokens saved), but the forced tokens are the tokenizer's, not the model's own choice, so greedy outputs may
    # differ from decoding every token; turn it on where the latency of long fixed keys matters.
    enable_jump_forward: bool = flag(False, "constrained requests append the text their grammar forces in one "
                                           "extend step instead of one decode step per token (chapter 12)")

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
        need(self.kv_cache_dtype in ("auto", "fp8_e4m3", "fp8_e5m2"), "kv_cache_dtype",
             "'auto', 'fp8_e4m3' or 'fp8_e5m2'", self.kv_cache_dtype)
        need(self.split_decode_min_batch >= 0, "split_decode_min_batch", ">= 0", self.split_decode_min_batch)
        need(self.max_total_tokens is None or self.max_total_tokens >= self.page_size, "max_total_tokens",
             ">= page_size", self.max_total_tokens)
        need(0.0 < self.mem_fraction_static < 1.0, "mem_fraction_static", "in (0, 1)", self.mem_fraction_static)
        need(self.cascade_min_prefix_len >= 1, "cascade_min_prefix_len", ">= 1", self.cascade_min_prefix_len)
        need(self.cuda_graph_max_extend_tokens >= 0, "cuda_graph_max_extend_tokens", ">= 0",
             self.cuda_graph_max_extend_tokens)
        need(self.extend_token_multiple is None or self.extend_token_multiple >= 1, "extend_token_multiple", ">= 1",
             self.extend_token_multiple)
        need(self.cuda_graph_max_bs is None or self.cuda_graph_max_bs >= 1, "cuda_graph_max_bs", ">= 1",
             self.cuda_graph_max_bs)
        for name in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
            validate_backend_name(name, getattr(self, name))
