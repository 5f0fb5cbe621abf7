"""Rows that feed a guess: how the model runner lays them out (chapter 13 fills them; the core only runs them).

A row with a :class:`~minisgl_ref.core.batch.Guess` computes its request's known tokens and then the guessed ones,
and needs the logits at every one of its positions, not only the last. Two things differ from an extend row:

* its input ids run past the request's ``all_ids``. :func:`prepare_with_guesses` hands the flat-batch builder
  (``ModelRunner.prepare``, chapter 03's task) a stand-in request whose ``all_ids`` end with the guess, so that
  builder stays exactly what chapter 03 shows; KV slots and page-table entries come out right, since a guessed
  token takes the row's next slot like any extend token;
* a tree-shaped guess puts several tokens at the same depth: their positions (what RoPE sees) are the last known
  token's plus their depth, not consecutive. Those are patched after the builder ran (a chain needs nothing),
  and the row's attention mask (``Guess.mask``) goes into ``ForwardBatch.extend_masks``, which only a backend
  with ``supports_custom_mask`` takes (its ``forward`` refuses the step otherwise: never a silent causal mask).

Every position of such a row is listed in ``ForwardBatch.extra_logit_indices``; the forward pass returns their
logits after the rows' last ones, and :func:`split_row_logits` takes them apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import cast

import torch

from minisgl_ref.core.batch import Row, ScheduledBatch
from minisgl_ref.core.forward_batch import ForwardBatch
from minisgl_ref.core.request import Req
from minisgl_ref.sampling.sampler import to_device


@dataclass(frozen=True)
class _Fed:
    """What the flat-batch builder reads of a request, with the guess appended to its tokens."""

    all_ids: list[int]
    req_pool_idx: int | None


def _fed(row: Row) -> Row:
    assert row.guess is not None
    req = row.req
    return replace(row, req=cast(Req, _Fed(req.all_ids + list(row.guess.tokens), req.req_pool_idx)))


def prepare_with_guesses(prepare: Callable[[ScheduledBatch], ForwardBatch], batch: ScheduledBatch) -> ForwardBatch:
    """``prepare(batch)``, with the rows that feed a guess laid out as the module docstring says (a batch without
    any is passed through untouched: one scan of its rows is all it costs)."""
    if all(row.guess is None for row in batch.rows):
        return prepare(batch)
    fb = prepare(ScheduledBatch([row if row.guess is None else _fed(row) for row in batch.rows]))
    wanted: list[int] = []
    moved: list[int] = []  # flat index of each guessed token whose position is not the consecutive one
    moved_pos: list[int] = []
    masks: list[torch.Tensor | None] = []
    start = 0
    for row in batch.rows:
        guess = row.guess
        masks.append(None if guess is None or guess.mask is None else _row_mask(row.extend_len, guess.mask))
        if guess is not None:
            wanted.extend(range(start, start + row.extend_len))
            if not guess.is_chain:
                first = start + row.extend_len - len(guess.tokens)  # the guess's first flat index
                last_known = row.prefix_len + row.extend_len - len(guess.tokens) - 1
                moved.extend(range(first, first + len(guess.tokens)))
                moved_pos.extend(last_known + d for d in guess.depths)
        start += row.extend_len
    device = fb.input_ids.device
    fb.extra_logit_indices = to_device(torch.tensor(wanted, dtype=torch.int64), device)
    if moved:
        fb.positions[to_device(torch.tensor(moved), device)] = to_device(torch.tensor(moved_pos), device)
    if any(m is not None for m in masks):
        fb.extend_masks = masks
    return fb


def _row_mask(extend_len: int, guess_mask: torch.Tensor) -> torch.Tensor:
    """The row's mask over its new tokens: causal among the known ones, the guess's own mask over the last known
    token and the guessed ones (which see every earlier known token)."""
    n = guess_mask.shape[0]
    mask = torch.ones(extend_len, extend_len, dtype=torch.bool).tril()
    mask[extend_len - n:, extend_len - n:] = guess_mask.to(device="cpu", dtype=torch.bool)
    return mask


def split_row_logits(logits: torch.Tensor, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The forward pass's logits as (each row's last token's [B, V], the extra positions' [M, V] or None)."""
    if fb.extra_logit_indices is None:
        return logits, None
    m = fb.extra_logit_indices.shape[0]
    return logits[:-m], logits[-m:]
