"""One way to build an engine: load the model and its tokenizer, start the tensor-parallel ranks, build the engine
(chapters 02, 09 and 10).

The offline :class:`~minisgl_ref.llm.LLM`, the server's scheduler process and every tensor-parallel follower call
:func:`build_runtime` with the same three settings objects (:class:`ModelArgs`, :class:`EngineConfig`,
:class:`TPArgs`), so an ``LLM.generate`` call and an HTTP request with the same settings run the very same engine,
and a follower builds exactly what its leader built.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from minisgl_ref.constrained.backend import GrammarBackend
from minisgl_ref.constrained.extension import StructuredOutput
from minisgl_ref.core.config import EngineConfig, ModelArgs, TPArgs
from minisgl_ref.distributed.group import DistConfig, exit_with_parent, report_failure
from minisgl_ref.engine.engine import Engine
from minisgl_ref.engine import warmup
from minisgl_ref.engine.extension import EngineExtension
from minisgl_ref.engine.naive import NaiveEngine
from minisgl_ref.models.config import ModelConfig
from minisgl_ref.models.loader import load_model
from minisgl_ref.moe.distribution import ExpertDistribution, attach_distribution
from minisgl_ref.moe.registry import install_moe_kernels, register_moe_models
from minisgl_ref.perf import attention as perf_attention
from minisgl_ref.perf import kernels as perf_kernels
from minisgl_ref.perf import model_transforms
from minisgl_ref.quant.registry import register_quantizations
from minisgl_ref.speculative.build import check_combination, speculative_extension
from minisgl_ref.speculative.config import SpeculativeConfig
from minisgl_ref.tokenizer import Tokenizer
from minisgl_ref.tp.engine import TPEngine
from minisgl_ref.tp.group import TPGroup

ENGINE_KINDS = ("paged", "naive")

log = logging.getLogger(__name__)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class Runtime:
    """Everything one process needs to serve: the model, its tokenizer and EOS ids, the engine, and (with tensor
    parallelism) its place in the group."""

    model: nn.Module
    model_config: ModelConfig
    model_path: Path | None  # the folder the model came from (None: a shipped config with dummy weights)
    tokenizer: Tokenizer | None  # None: dummy weights or a weights-only folder; prompts must be token ids
    eos_token_ids: frozenset[int]
    context_length: int
    device: torch.device
    engine: Engine | NaiveEngine
    group: TPGroup | None = None
    # seconds per start-up phase: loading the weights, compiling kernels, building the engine (KV pool, graphs)
    startup: dict[str, float] = field(default_factory=dict)
    #: Chapter 14's routing counter, when built with ``expert_distribution=True`` (an MoE model only).
    expert_distribution: ExpertDistribution | None = None

    @property
    def tp_rank(self) -> int:
        return 0 if self.group is None else self.group.rank

    @property
    def is_leader(self) -> bool:
        """Only rank 0 takes requests; the other ranks :meth:`follow` it."""
        return self.tp_rank == 0

    def follow(self) -> None:
        """On a rank other than 0: replay rank 0's steps until it shuts down, then leave the process group."""
        if not isinstance(self.engine, TPEngine) or self.is_leader:
            raise ValueError("follow() is for tensor-parallel ranks other than 0")
        assert self.group is not None
        try:
            self.engine.follow()
        except BaseException as e:
            report_failure(e)  # where rank 0 looks when its next collective fails: it raises this message
            raise
        finally:
            self.group.leave()

    def shutdown(self) -> None:
        """Stop the ranks this process started and leave the process group (nothing at tp=1)."""
        group, self.group = self.group, None
        if group is not None:
            group.close()


def engine_extensions(config: ModelConfig, tokenizer: Tokenizer | None,
                      eos: frozenset[int]) -> list[EngineExtension]:
    """What plugs into every paged engine's seam (:mod:`~minisgl_ref.engine.extension`), in order.

    Structured output (chapter 12): grammars compile against the model's vocabulary size, which may exceed the
    tokenizer's; nothing is built until the first constrained request. Without a tokenizer it is still there,
    to refuse constrained requests by name."""
    grammar = GrammarBackend(tokenizer.hf, config.vocab_size, stop_token_ids=eos) if tokenizer else None
    return [StructuredOutput(grammar)]


def build_runtime(model: ModelArgs = ModelArgs(), engine: EngineConfig | None = None, tp: TPArgs = TPArgs(), *,
                  kind: str = "paged", group: TPGroup | None = None,
                  speculative: SpeculativeConfig = SpeculativeConfig(),
                  expert_distribution: bool = False) -> Runtime:
    """Load ``model`` and build a ``kind`` engine (``paged``: the real engine of chapters 03-08; ``naive``: the
    chapter-00 oracle) configured by ``engine``; with ``speculative`` enabled, the paged engine also drafts and
    verifies (chapter 13: its extension and proposer are built here, after the target model).
    ``expert_distribution`` counts an MoE model's routing on the device from the start (chapter 14; SGLang's
    ``--enable-expert-distribution-metrics``), in this process's model (rank 0's under tensor parallelism).

    With ``tp.tp_size > 1`` this process becomes its node's first rank and starts the node's other ranks, which
    build the same runtime (:func:`follow_leader`); pass ``group`` instead when someone else starts the ranks
    (the server starts one scheduler process per rank)."""
    if kind not in ENGINE_KINDS:
        raise ValueError(f"engine must be 'paged' or 'naive', got {kind!r}")
    if (group is not None or tp.enabled) and kind != "paged":
        raise ValueError(f"tp_size={tp.tp_size} needs engine='paged' (the naive oracle runs on one device)")
    check_combination(speculative, kind=kind, tp_enabled=group is not None or tp.enabled, engine=engine)
    register_moe_models()  # chapter 14: the MoE architectures, through the loader's registry seam
    register_quantizations()  # chapter 15: FP8 weights, through the loader's quantization seam
    if group is None and tp.enabled:
        group = TPGroup.launch(tp, follow_leader, (model, engine))  # checks the flags before it starts anything
    phases: dict[str, float] = {}
    clock = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        phases[name] = now - clock
        clock = now

    try:
        device = group.device(model.device) if group else torch.device(model.device or default_device())
        net, config, folder = load_model(model.model_path, load_format=model.load_format, dtype=model.dtype,
                                         device=device, quantization=model.quantization)
        model_transforms.apply_(net, device, config.dtype)  # chapter 11: fused kernels, folded norms (on a GPU)
        install_moe_kernels(net, device)  # chapter 14: the fused expert kernel (on a GPU)
        counter = None
        if expert_distribution:  # chapter 14: before the CUDA graphs, which capture the counting
            counter = attach_distribution(net, device)
            if counter is None:
                raise ValueError(f"enable_expert_distribution_metrics needs a mixture-of-experts model; "
                                 f"{config.architecture} has no experts")
        if group is not None:
            group.join(device)  # every rank has loaded its shard: meet the others
        # Dummy weights keep the folder's tokenizer when it has one (a shipped config has none).
        tokenizer = None if model.skip_tokenizer_init else Tokenizer.find(folder)
        eos = frozenset(config.eos_token_ids) | (tokenizer.eos_token_ids if tokenizer else frozenset())
        context = config.usable_context(model.context_length or None)  # a sliding window caps it
        if context < 2:
            raise ValueError(f"context_length must be at least 2, got {context}")
        phase("weights")
        if kind == "paged" and device.type == "cuda":  # compile kernels now, in parallel, not in the first steps
            engine_config = engine or EngineConfig()
            shapes = warmup.shapes_of(net, config, engine_config, device)
            warmup.start(shapes, device, warmup.matmul_shapes(net, engine_config),
                         jobs={**perf_kernels.warmup_jobs(shapes, device),
                               **perf_attention.warmup_jobs(shapes, engine_config)}).wait()
            phase("kernel compiles")
        if kind == "naive":
            built: Engine | NaiveEngine = NaiveEngine(net, config.vocab_size, device)
        elif group is not None:
            built = group.engine = TPEngine(net, config, engine, device=device, context_length=context,
                                            tokenizer=tokenizer, extensions=engine_extensions(config, tokenizer, eos),
                                            attention_planner=perf_attention.attention_planner)
        else:
            extensions = engine_extensions(config, tokenizer, eos)
            if speculative.enabled:  # chapter 13: drafts, verified in the engine's own steps
                grammar = next(e for e in extensions if isinstance(e, StructuredOutput))  # masks drafted paths
                extensions.append(speculative_extension(speculative, net, config, device=device,
                                                        engine=engine or EngineConfig(), context_length=context,
                                                        dtype=model.dtype, constraint=grammar))
            built = Engine(net, config, engine, device=device, context_length=context, extensions=extensions,
                           attention_planner=perf_attention.attention_planner)  # chapter 11's decode attention
        phase("engine (KV pool, CUDA graphs)")
    except BaseException as e:
        if group is not None:
            group.report_failure(e)
            group.close()
        raise
    log.info("engine ready in %.1f s: %s", sum(phases.values()),
             ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases.items()))
    return Runtime(net, config, folder, tokenizer, eos, context, device, built, group, phases, counter)


def follow_leader(rank: int, cfg: DistConfig, settings: tuple[ModelArgs, EngineConfig | None], announce: Any) -> None:
    """A follower rank started by :func:`build_runtime`: build the same runtime as rank ``rank``, then replay the
    leader's steps until it stops."""
    exit_with_parent()
    model, engine = settings
    try:
        runtime = build_runtime(model, engine, group=TPGroup(cfg.with_rank(rank), announce=announce))
    except Exception as e:  # already reported to the leader, which raises it
        raise SystemExit(1) from e
    runtime.follow()
