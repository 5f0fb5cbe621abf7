"""Vocabulary-parallel embedding and LM head (chapters 01 and 09).

Vocabularies are large (151,936 rows for Qwen3), so with tensor parallelism each rank keeps a contiguous block of
rows. For the embedding, a rank looks up only the token ids that fall into its block, writes zeros for the
others, and an all-reduce fills in the rest. For the LM head, each rank computes the logits of its block and an
all-gather concatenates them, because sampling needs the whole distribution.

When the vocabulary does not divide evenly, every rank still holds ``ceil(vocab / tp)`` rows (the last rank's
extra rows are zeros), so that the all-gather concatenates equal slices; the padded logits are cut off after it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl_ref.distributed import all_gather_last_dim, all_reduce, get_tp_info


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        tp = get_tp_info()
        self.tp_size = tp.size
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp.size)  # ceil: the last block may be padded
        self.start = min(vocab_size, tp.rank * self.rows_per_rank)
        self.end = min(vocab_size, self.start + self.rows_per_rank)
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.load_vocab_shard  # type: ignore[attr-defined]

    def load_vocab_shard(self, param: nn.Parameter, full: torch.Tensor) -> None:
        rows = self.end - self.start
        param.data.zero_()
        param.data[:rows].copy_(full.narrow(0, self.start, rows))  # works on a lazy checkpoint tensor too

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.start) & (input_ids < self.end)
        local = torch.where(mine, input_ids - self.start, 0)
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> logits over the full vocabulary, in the weights' dtype.

    Not converted to float32 here: a bfloat16 matmul's output holds no more than bfloat16, so a float32 copy adds
    no precision, only a pass over ``[B, V]`` (122 us at 256 rows of a 151,936-token vocabulary on an H100) and
    twice the memory of every captured logits buffer. Whoever needs float32 (a softmax, log probabilities,
    penalties) converts; the sampler's plain temperature draw reads bfloat16 directly (chapter 02)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        logits = all_gather_last_dim(logits)
        return logits[..., : self.vocab_size]
