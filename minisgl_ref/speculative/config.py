"""The settings of speculative decoding (chapter 13), named after SGLang's ``--speculative-*`` flags.

They live here, with the feature, rather than in the core's :class:`~minisgl_ref.core.config.EngineConfig`:
an engine without speculation never reads them. :func:`~minisgl_ref.runtime.build_runtime` takes one
:class:`SpeculativeConfig` beside the engine's settings and plugs the extension in when ``algorithm`` is set.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from minisgl_ref.core.config import flag

#: The proposers: n-gram lookup in the request's own tokens, or a draft model (STANDALONE, SGLang's name for a
#: separate small model; ``self:K`` as its path drafts with the target's own first K layers).
ALGORITHMS = ("NGRAM", "STANDALONE")
#: ``--speculative-draft-model-path self:K``: the layer-truncated copy of the target (self-speculation).
SELF_DRAFT_PREFIX = "self:"


@dataclass(frozen=True)
class SpeculativeConfig:
    """Whether and how to speculate; ``speculative_algorithm=None`` (the default) turns the feature off. Every
    field is the command-line flag of the same name (``--speculative-num-steps``) and a keyword argument of the
    offline ``LLM``.

    ``speculative_num_draft_tokens`` counts, as in SGLang, the tokens of one verify row: the request's last known
    token and the drafts after it, so a request gets at most ``speculative_num_draft_tokens - 1`` draft tokens per
    step. With ``speculative_eagle_topk == 1`` the draft is a chain of ``speculative_num_steps`` tokens and the
    count defaults to ``speculative_num_steps + 1``; a larger top-k draws a tree of ``speculative_num_steps``
    levels, which needs an attention backend that takes a tree mask."""

    speculative_algorithm: str | None = flag(None, "NGRAM (look the continuation up in the request's own tokens) "
                                                   "or STANDALONE (a draft model)", choices=list(ALGORITHMS))
    speculative_draft_model_path: str | None = flag(None, "STANDALONE's draft model folder, or self:K to draft "
                                                          "with the target's own first K layers")
    speculative_num_steps: int = flag(4, "draft depth: tokens of a chain, levels of a tree")
    speculative_eagle_topk: int = flag(1, "children per draft node (1: chains)")
    speculative_num_draft_tokens: int | None = flag(None, "tokens per verify row, the last known token included "
                                                          "(default: --speculative-num-steps + 1)", type=int)
    #: Above this many running requests speculation pauses (no drafts, overlap as usual). A batch runs until its
    #: slowest request finishes, so its pace is set by the request whose drafts are rejected most, while every
    #: verify step (without overlap) costs about two decode steps: on an H200 with a 2.1B model, n-gram chains
    #: that never paused were 2.3x faster per token for one request, 1.04x for 4, 0.94x for 8, 0.75x for 16 and
    #: 0.30x for 64 (``docs/data/spec_bench_h200.json``, config ``ngram_b64``); paused above 4, 1.00-1.01x from 8
    #: to 64 requests and 2.39x for one (``docs/data/spec_interleaved_h200.json``).
    speculative_max_batch: int = flag(4, "speculate only while at most this many requests run")
    #: A request whose recent drafts were accepted less often than this (accepted / drafted, a moving average
    #: with weight ``speculative_rate_decay`` for the newest verify) stops drafting for
    #: ``speculative_cooldown_steps`` steps, then starts again with one token.
    speculative_min_accept_rate: float = flag(0.2, "pause drafting for a request whose recent accept rate is lower")
    speculative_cooldown_steps: int = flag(16, "how many steps such a pause lasts")
    speculative_rate_decay: float = 0.25

    def __post_init__(self) -> None:
        algorithm = self.speculative_algorithm
        if algorithm is None:
            return
        if algorithm not in ALGORITHMS:
            raise ValueError(f"speculative_algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        if algorithm == "STANDALONE" and not self.speculative_draft_model_path:
            raise ValueError("speculative_draft_model_path is needed with speculative_algorithm=STANDALONE "
                             f"(a model folder, or {SELF_DRAFT_PREFIX}K for the target's first K layers)")
        if algorithm == "NGRAM" and self.speculative_draft_model_path:
            raise ValueError("speculative_draft_model_path is only for speculative_algorithm=STANDALONE")
        layers = self.self_draft_layers
        if layers is not None and layers < 1:
            raise ValueError(f"speculative_draft_model_path {self.speculative_draft_model_path!r}: K in "
                             f"{SELF_DRAFT_PREFIX}K must be >= 1")
        if self.speculative_num_steps < 1:
            raise ValueError(f"speculative_num_steps must be >= 1, got {self.speculative_num_steps}")
        if self.speculative_eagle_topk < 1:
            raise ValueError(f"speculative_eagle_topk must be >= 1, got {self.speculative_eagle_topk}")
        if self.draft_tokens < 2:
            raise ValueError(f"speculative_num_draft_tokens must be >= 2 (it counts the last known token and at "
                             f"least one draft), got {self.speculative_num_draft_tokens}")
        if self.speculative_eagle_topk == 1 and self.draft_tokens > self.speculative_num_steps + 1:
            raise ValueError(f"speculative_num_draft_tokens ({self.draft_tokens}) exceeds speculative_num_steps + 1 "
                             f"({self.speculative_num_steps + 1}): a chain of {self.speculative_num_steps} drafts "
                             f"has no more tokens")
        if self.speculative_max_batch < 1:
            raise ValueError(f"speculative_max_batch must be >= 1, got {self.speculative_max_batch}")
        if not 0 <= self.speculative_min_accept_rate <= 1:
            raise ValueError(f"speculative_min_accept_rate must be in [0, 1], got {self.speculative_min_accept_rate}")
        if not 0 < self.speculative_rate_decay <= 1:
            raise ValueError(f"speculative_rate_decay must be in (0, 1], got {self.speculative_rate_decay}")
        if self.speculative_cooldown_steps < 0:
            raise ValueError(f"speculative_cooldown_steps must be >= 0, got {self.speculative_cooldown_steps}")

    @classmethod
    def split(cls, kwargs: dict[str, object]) -> tuple[SpeculativeConfig, dict[str, object]]:
        """The settings among ``kwargs`` (the offline ``LLM``'s keyword arguments), and the rest."""
        names = {f.name for f in fields(cls)}
        mine = {k: v for k, v in kwargs.items() if k in names}
        return cls(**mine), {k: v for k, v in kwargs.items() if k not in names}  # type: ignore[arg-type]

    @property
    def enabled(self) -> bool:
        return self.speculative_algorithm is not None

    @property
    def draft_tokens(self) -> int:
        """Tokens per verify row, the root included (``speculative_num_draft_tokens`` or its default)."""
        n = self.speculative_num_draft_tokens
        return n if n is not None else self.speculative_num_steps + 1

    @property
    def self_draft_layers(self) -> int | None:
        """K of ``self:K`` (the target's first K layers draft), or None for a separate draft model."""
        path = self.speculative_draft_model_path
        if path is None or not path.startswith(SELF_DRAFT_PREFIX):
            return None
        k = path[len(SELF_DRAFT_PREFIX):]
        if not k.isdigit():
            raise ValueError(f"speculative_draft_model_path {path!r}: expected {SELF_DRAFT_PREFIX}K with K a "
                             f"number of layers")
        return int(k)
