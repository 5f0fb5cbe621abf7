"""What cascade decode attention saved, counted for ``bench offline`` (chapter 11).

The engine itself keeps no such counters: the cascade's planner (:class:`~minisgl_ref.perf.cascade.CascadePlanner`)
shows every decode step's context lengths and prefix groups to its ``observers``, and :func:`cascade_stats` adds
a :class:`CascadeStats` there the first time a benchmark asks, so that an engine nobody measures pays nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from minisgl_ref.perf.cascade import CascadePlanner, PrefixGroups, kv_tokens_read


@dataclass
class CascadeStats:
    """What the engine's decode steps read, summed since the counting started (``bench offline`` reports the
    difference over a run). Tokens are per layer; multiply by ``kv_bytes_per_token`` for bytes."""

    decode_steps: int = 0
    cascade_steps: int = 0  # decode steps that ran the cascade (the batch had groups)
    kv_tokens_plain: int = 0  # what plain decode would have read
    kv_tokens_cascade: int = 0  # what was read (equal to the plain count in steps without groups)
    grouped_rows: int = 0  # rows that read a shared prefix, summed over steps
    groups: int = 0  # groups, summed over steps

    def __call__(self, seq_lens: Sequence[int], groups: PrefixGroups | None) -> None:
        """Count one decode step (a :data:`~minisgl_ref.perf.cascade.CascadeObserver`)."""
        plain, cascade = kv_tokens_read(seq_lens, groups)
        self.decode_steps += 1
        self.kv_tokens_plain += plain
        self.kv_tokens_cascade += cascade
        if groups is not None:
            self.cascade_steps += 1
            self.groups += groups.num_groups
            self.grouped_rows += sum(len(r) for r in groups.rows)


def cascade_stats(llm: Any) -> CascadeStats | None:
    """The counters of ``llm``'s cascade, counting from the first call on; None when its engine runs without a
    cascade (turned off, no radix cache, the naive oracle)."""
    planner = getattr(getattr(llm.engine, "runner", None), "planner", None)
    if not isinstance(planner, CascadePlanner):
        return None
    stats = next((o for o in planner.observers if isinstance(o, CascadeStats)), None)
    if stats is None:
        stats = CascadeStats()
        planner.observers.append(stats)
    return stats
