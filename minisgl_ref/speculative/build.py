"""Building speculative decoding for one engine from its settings (chapter 13): the proposer the settings name,
and the extension that owns it. :func:`~minisgl_ref.runtime.build_runtime` calls :func:`speculative_extension`.

``--speculative-algorithm NGRAM`` looks continuations up in each request's own tokens (no model at all).
``STANDALONE`` drafts with a small model that shares the target's tokenizer: ``--speculative-draft-model-path``
names its folder, or ``self:K`` drafts with the target's own first K decoder layers (self-speculation: the
draft shares every weight with the target and costs no memory but its KV).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from minisgl_ref.core.config import EngineConfig
from minisgl_ref.models.config import ModelConfig
from minisgl_ref.models.loader import load_model
from minisgl_ref.speculative.config import SpeculativeConfig
from minisgl_ref.speculative.extension import SpeculativeExtension, TokenConstraint


def engine_backend_lacks_masks(engine: EngineConfig | None) -> bool:
    """Whether the attention backend named for extend steps is one that takes no tree mask (fa3). An automatic
    choice is checked once the engine is built (``SpeculativeExtension.bind``)."""
    if engine is None:
        return False
    return (engine.prefill_attention_backend or engine.attention_backend) == "fa3"


def check_combination(config: SpeculativeConfig, *, kind: str, tp_enabled: bool,
                      engine: EngineConfig | None = None) -> None:
    """Refuse, by name, what speculation cannot run with (before anything is loaded)."""
    if not config.enabled:
        return
    if kind != "paged":
        raise ValueError(f"speculative_algorithm={config.speculative_algorithm} needs engine='paged' (the naive "
                         "oracle has no verify rows)")
    if tp_enabled:
        raise ValueError("speculative_algorithm cannot be combined with tp_size > 1 yet (every rank would have "
                         "to draft alike)")
    if config.speculative_eagle_topk > 1 and engine_backend_lacks_masks(engine):
        raise ValueError(f"speculative_eagle_topk={config.speculative_eagle_topk} drafts trees, and the fa3 "
                         "attention backend takes no tree mask: use speculative_eagle_topk=1, or another "
                         "attention backend (torch_native, triton, flashinfer)")


def speculative_extension(config: SpeculativeConfig, target: nn.Module, target_config: ModelConfig, *,
                          device: torch.device, engine: EngineConfig, context_length: int,
                          dtype: str = "auto", constraint: TokenConstraint | None = None) -> SpeculativeExtension:
    """The extension with the proposer ``config`` asks for, drafting for ``target``; ``constraint`` (the engine's
    structured output) masks the drafted paths of requests that follow a grammar."""
    drafts = config.draft_tokens - 1
    if config.speculative_algorithm == "NGRAM":
        from minisgl_ref.speculative.ngram import NgramProposer, NgramSettings

        breadth = config.speculative_eagle_topk
        proposer = NgramProposer(NgramSettings(min_bfs_breadth=1, max_bfs_breadth=breadth,
                                               branch_length=max(config.speculative_num_steps, drafts)))
    else:
        from minisgl_ref.speculative.draft_model import DraftModelProposer, truncated_model

        layers = config.self_draft_layers
        if layers is not None:
            if layers > target_config.num_layers:
                raise ValueError(f"speculative_draft_model_path {config.speculative_draft_model_path!r}: the target "
                                 f"has {target_config.num_layers} layers")
            draft: nn.Module = truncated_model(target, layers)
            draft_config = replace(target_config, num_layers=layers)
        else:
            draft, draft_config, _ = load_model(config.speculative_draft_model_path, dtype=dtype, device=device)
            if draft_config.vocab_size != target_config.vocab_size:
                raise ValueError(f"speculative_draft_model_path: the draft model has {draft_config.vocab_size} token "
                                 f"ids and the target {target_config.vocab_size}; a draft must share the target's "
                                 "tokenizer")
        proposer = DraftModelProposer(draft, draft_config, target_vocab_size=target_config.vocab_size,
                                      num_steps=config.speculative_num_steps, topk=config.speculative_eagle_topk,
                                      max_requests=engine.max_running_requests, context_length=context_length,
                                      device=device, config=engine)
    return SpeculativeExtension(proposer, config, constraint=constraint)
