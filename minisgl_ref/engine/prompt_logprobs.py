"""Log probabilities of prompt tokens, computed in the extend steps that process them (chapter 10).

A request that asks for its prompt's log probabilities needs, for each prompt position ``q``, the probability of
token ``q + 1`` under the logits of position ``q``: logits of many positions, where an ordinary step needs only
each row's last. The model runner computes them only in steps where some request asked (:meth:`PromptLogprobPlan.of`
is ``None`` otherwise), from the hidden states of the positions the plan lists, a few hundred rows at a time
(:data:`LOGPROB_CHUNK`) so that a long prompt never needs a ``[prompt, vocab]`` tensor at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from minisgl_ref.core.batch import ScheduledBatch
from minisgl_ref.sampling.sampler import StepLogprobs, to_device, token_logprobs

#: Prompt positions turned into logits at once when computing prompt log probabilities.
LOGPROB_CHUNK = 512


@dataclass
class PromptLogprobPlan:
    """Which positions of an extend step need the log probability of the prompt token that follows them."""

    spans: list[tuple[int, int, int]]  # (row of the batch, first prompt position predicted, how many)
    index: list[int]  # positions in the step's flattened tokens, span after span
    targets: list[int]  # the prompt token each of them predicts
    top_k: int

    @staticmethod
    def of(batch: ScheduledBatch) -> PromptLogprobPlan | None:
        """Position ``q`` of a row predicts prompt token ``q + 1``; the row reports tokens ``logprobs.start``
        .. end of prompt. The spans of successive chunks are disjoint, so each token is computed once (the
        engine skips any that a retracted request computes again)."""
        spans: list[tuple[int, int, int]] = []
        index: list[int] = []
        targets: list[int] = []
        top_k, offset = 0, 0
        for i, row in enumerate(batch.rows):
            req, start, n = row.req, row.prefix_len, row.extend_len
            wanted = req.logprobs
            if wanted is not None and wanted.prompt_pending(len(req.input_ids)) and not row.is_decode:
                first = max(start, wanted.start - 1, 0)
                last = min(start + n, len(req.input_ids) - 1)  # the last prompt position predicts the output
                if last > first:
                    spans.append((i, first + 1, last - first))
                    index += range(offset + first - start, offset + last - start)
                    targets += req.input_ids[first + 1 : last + 1]
                    top_k = max(top_k, wanted.top)
            offset += n
        return PromptLogprobPlan(spans, index, targets, top_k) if spans else None


def compute_prompt_logprobs(model: nn.Module, hidden: torch.Tensor, plan: PromptLogprobPlan,
                            device: torch.device) -> StepLogprobs:
    """The log probabilities the plan names, from the step's hidden states ``[T, hidden]``: the chosen tokens'
    and the ``plan.top_k`` best alternatives, in the plan's order."""
    index = to_device(torch.tensor(plan.index), device)
    targets = to_device(torch.tensor(plan.targets), device)
    parts = [token_logprobs(model.compute_logits(hidden[index[i : i + LOGPROB_CHUNK]]),
                            targets[i : i + LOGPROB_CHUNK], plan.top_k)
             for i in range(0, len(plan.index), LOGPROB_CHUNK)]
    return StepLogprobs(*(torch.cat(ts) for ts in zip(*((p.chosen, p.top_values, p.top_ids) for p in parts))))
