"""The settings of speculative decoding (chapter 13), named after SGLang's ``--speculative-*`` flags.

They live here, with the feature, rather than in the core's :class:`~minisgl_ref.core.config.EngineConfig`:
an engine without speculation never reads them. :func:`~minisgl_ref.runtime.build_runtime` takes one
:class:`SpeculativeConfig` beside the engine's settings and plugs the extension in when ``algorithm`` is set.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The proposers: n-gram lookup in the request's own tokens, or a draft model (STANDALONE, SGLang's name for a
#: separate small model; ``self:K`` as its path drafts with the target's own first K layers).
ALGORITHMS = ("NGRAM", "STANDALONE")
#: ``--speculative-draft-model-path self:K``: the layer-truncated copy of the target (self-speculation).
SELF_DRAFT_PREFIX = "self:"


@dataclass(frozen=True)
class SpeculativeConfig:
    """Whether and how to speculate. ``algorithm=None`` (the default) turns the feature off.

    ``num_draft_tokens`` counts, as in SGLang, the tokens of one verify row: the request's last known token and
    the drafts after it, so a request is given at most ``num_draft_tokens - 1`` draft tokens per step. With
    ``eagle_topk == 1`` the draft is a chain of ``num_steps`` tokens, and ``num_draft_tokens`` defaults to
    ``num_steps + 1``; a larger top-k draws a tree of ``num_steps`` levels, which needs an attention backend that
    takes a tree mask."""

    algorithm: str | None = None  #: NGRAM or STANDALONE (SGLang: --speculative-algorithm)
    draft_model_path: str | None = None  #: STANDALONE's draft model folder, or ``self:K``
    num_steps: int = 4  #: draft depth (SGLang: --speculative-num-steps)
    eagle_topk: int = 1  #: children per draft node; 1 drafts chains (SGLang: --speculative-eagle-topk)
    num_draft_tokens: int | None = None  #: tokens per verify row, the root included (default num_steps + 1)
    #: Above this many running requests a decode step is bound by arithmetic, not by reading the weights, and a
    #: verify row's extra tokens cost about what they save: speculation pauses (no guesses, overlap as usual).
    max_batch: int = 8
    #: A request whose recent drafts were accepted less often than this (accepted / drafted, averaged over about
    #: the last ``1 / rate_decay`` verifies) stops drafting for ``cooldown_steps`` steps, then tries one token.
    min_accept_rate: float = 0.2
    rate_decay: float = 0.25
    cooldown_steps: int = 16

    def __post_init__(self) -> None:
        if self.algorithm is None:
            return
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"speculative_algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        if self.algorithm == "STANDALONE" and not self.draft_model_path:
            raise ValueError("speculative_draft_model_path is needed with speculative_algorithm=STANDALONE "
                             f"(a model folder, or {SELF_DRAFT_PREFIX}K for the target's first K layers)")
        if self.algorithm == "NGRAM" and self.draft_model_path:
            raise ValueError("speculative_draft_model_path is only for speculative_algorithm=STANDALONE")
        if self.self_draft_layers is not None and self.self_draft_layers < 1:
            raise ValueError(f"speculative_draft_model_path {self.draft_model_path!r}: K in {SELF_DRAFT_PREFIX}K "
                             f"must be >= 1")
        if self.num_steps < 1:
            raise ValueError(f"speculative_num_steps must be >= 1, got {self.num_steps}")
        if self.eagle_topk < 1:
            raise ValueError(f"speculative_eagle_topk must be >= 1, got {self.eagle_topk}")
        if self.draft_tokens < 2:
            raise ValueError(f"speculative_num_draft_tokens must be >= 2 (it counts the last known token and at "
                             f"least one draft), got {self.num_draft_tokens}")
        if self.eagle_topk == 1 and self.num_draft_tokens is not None and self.num_draft_tokens > self.num_steps + 1:
            raise ValueError(f"speculative_num_draft_tokens ({self.num_draft_tokens}) exceeds speculative_num_steps "
                             f"+ 1 ({self.num_steps + 1}): a chain of {self.num_steps} drafts has no more tokens")
        if self.max_batch < 1:
            raise ValueError(f"speculative_max_batch must be >= 1, got {self.max_batch}")
        if not 0 <= self.min_accept_rate <= 1 or not 0 < self.rate_decay <= 1 or self.cooldown_steps < 0:
            raise ValueError("speculative_min_accept_rate and speculative_rate_decay must lie in [0, 1] and (0, 1], "
                             "speculative_cooldown_steps must be >= 0")

    @property
    def enabled(self) -> bool:
        return self.algorithm is not None

    @property
    def draft_tokens(self) -> int:
        """Tokens per verify row, the root included (``num_draft_tokens`` or its default)."""
        return self.num_draft_tokens if self.num_draft_tokens is not None else self.num_steps + 1

    @property
    def self_draft_layers(self) -> int | None:
        """K of ``self:K`` (the target's first K layers draft), or None for a separate draft model."""
        path = self.draft_model_path
        if path is None or not path.startswith(SELF_DRAFT_PREFIX):
            return None
        k = path[len(SELF_DRAFT_PREFIX):]
        if not k.isdigit():
            raise ValueError(f"speculative_draft_model_path {path!r}: expected {SELF_DRAFT_PREFIX}K with K a number "
                             f"of layers")
        return int(k)
