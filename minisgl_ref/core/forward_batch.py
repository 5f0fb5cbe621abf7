"""What one forward pass needs to know about the batch it runs (chapters 00 and 03).

A step feeds a flat list of new tokens from several requests (no padding): ``input_ids`` and ``positions`` are
[T]. ``extend_lens`` says how many of those tokens belong to each request, ``prefix_lens`` how many earlier tokens
of that request already sit in the KV cache. Everything that is the same for all layers is computed once, here
and in the backend's ``init_forward_metadata``, not once per layer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class AttentionBackendProtocol(Protocol):
    """What a forward batch needs of the backend it carries. The backends themselves live in
    ``minisgl_ref.attention``, a floor above this one; typing the field with this protocol keeps the batch a plain
    data type that imports none of them (every class there derived from ``attention.base.AttentionBackend`` fits)."""

    def init_forward_metadata(self, batch: ForwardBatch) -> None: ...

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, batch: ForwardBatch, *,
        kv_stored: bool = False,
    ) -> torch.Tensor: ...


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill: one or more new tokens per request (with or without a cached prefix)
    DECODE = "decode"  # exactly one new token per request

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    extend_lens_cpu: list[int]  # new tokens per request
    prefix_lens_cpu: list[int]  # tokens already cached per request
    attn_backend: AttentionBackendProtocol
    # Set by engines with a KV cache (chapter 03): each request's page-table row, each new token's slot, and each
    # request's whole length (prefix + new tokens) on the device.
    req_pool_indices: torch.Tensor | None = None  # [B]
    out_cache_loc: torch.Tensor | None = None  # [T]
    seq_lens: torch.Tensor | None = None  # [B]
    # Index of each request's last new token in the flat [T] layout: only those rows need logits.
    last_token_indices: torch.Tensor | None = None  # [B]
    # Further tokens whose logits are wanted, by flat index: every position of a row that feeds a guess to check
    # (chapter 13). None (nearly every step): only the last tokens'. The forward pass then returns [B + M] logits.
    extra_logit_indices: torch.Tensor | None = None  # [M]
    #: Which of its own new tokens each new token may attend to, per row of an EXTEND batch (chapter 13's draft
    #: trees): None (every row causal), or one entry per row, in row order. Entry ``b`` is None for a causal row,
    #: or a bool tensor ``[extend_lens_cpu[b], extend_lens_cpu[b]]`` on any device (the backend copies it over):
    #: ``[i, j]`` True means row b's new token i may attend to its new token j. It must be lower triangular with
    #: a true diagonal (a token sees itself and, among the new tokens, only earlier ones), so it can only take
    #: visibility away from the causal mask: a draft tree in topological order gives such a mask
    #: (``DraftTree.mask()``). The row's ``prefix_lens_cpu[b]`` cached tokens stay visible to all its new tokens.
    #: The mask does not move positions: whoever builds the batch sets them (a tree node at ``prefix + depth``).
    #: Only a backend that declares ``supports_custom_mask`` takes a batch with a mask; any other raises.
    extend_masks: list[torch.Tensor | None] | None = None

    @property
    def has_custom_mask(self) -> bool:
        """Whether some row attends through ``extend_masks`` rather than causally."""
        return self.extend_masks is not None and any(m is not None for m in self.extend_masks)

    def check_extend_masks(self) -> None:
        """Raise ValueError unless ``extend_masks`` keeps its contract (see the field). Shapes and dtypes are
        checked on the host; the triangle only for masks on the CPU, since reading a device tensor would wait."""
        if self.extend_masks is None:
            return
        if self.mode.is_decode:
            raise ValueError("extend_masks belong to EXTEND batches: a decode row has one new token")
        if len(self.extend_masks) != self.batch_size:
            raise ValueError(f"extend_masks has {len(self.extend_masks)} entries for {self.batch_size} rows")
        for b, (m, e) in enumerate(zip(self.extend_masks, self.extend_lens_cpu)):
            if m is None:
                continue
            if m.dtype != torch.bool or tuple(m.shape) != (e, e):
                raise ValueError(f"row {b}'s extend mask must be [{e}, {e}] bool, got {tuple(m.shape)} {m.dtype}")
            if m.device.type == "cpu" and not (torch.equal(m, m.tril()) and bool(m.diagonal().all())):
                raise ValueError(f"row {b}'s extend mask must be lower triangular with a true diagonal")

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens_cpu)

    @property
    def seq_lens_cpu(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens_cpu, self.extend_lens_cpu)]

    @classmethod
    def for_full_sequences(
        cls, sequences: list[list[int]], attn_backend: AttentionBackendProtocol, device: torch.device | str = "cpu"
    ) -> ForwardBatch:
        """A prefill of whole sequences with nothing cached: the oracle's every step."""
        flat = [t for seq in sequences for t in seq]
        positions = [p for seq in sequences for p in range(len(seq))]
        lens = [len(s) for s in sequences]
        return cls(
            mode=ForwardMode.EXTEND,
            input_ids=torch.tensor(flat, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            extend_lens_cpu=lens,
            prefix_lens_cpu=[0] * len(sequences),
            attn_backend=attn_backend,
            last_token_indices=torch.tensor(lens, device=device).cumsum(0) - 1,
        )
