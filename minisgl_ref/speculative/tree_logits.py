"""A draft tree's verify row run by hand, and each of its paths run from scratch: the two sides of the claim that
one forward pass with the tree mask gives the logits after every path at once (chapter 13, section 2).

The engine builds verify rows itself (the scheduler, the model runner); these functions build the one row outside
it, with the parts the engine uses (a KV pool, a request-to-token table, the ``torch_native`` backend), so that
the chapter can show the claim on the embedded model and ``tests/test_spec_tree_attention.py`` can assert it on
a tiny one.
"""

from __future__ import annotations

import torch

from minisgl_ref.attention.torch_native import NoCacheAttentionBackend, TorchNativeBackend
from minisgl_ref.core.forward_batch import ForwardBatch, ForwardMode
from minisgl_ref.kvcache.pool import KVPool
from minisgl_ref.kvcache.req_to_token import ReqToTokenPool
from minisgl_ref.models.config import ModelConfig
from minisgl_ref.speculative.tree import DraftTree


def verify_row_logits(model: torch.nn.Module, config: ModelConfig, prefix: list[int], root: int,
                      tree: DraftTree, *, seed: int = 0) -> torch.Tensor:
    """The logits of one verify row, ``[len(tree) + 1, vocab]``: ``prefix`` prefilled first (its KV stored as a
    first prefill leaves it), then the row of ``root`` and the tree's nodes, at the positions ``prefix + depth``
    under the tree's ancestor mask. The KV slots are a shuffled set (seeded by ``seed``), so a read of a wrong
    slot gives wrong logits."""
    n = len(prefix) + len(tree) + 1
    table = ReqToTokenPool(1, n + 1)
    pool = KVPool(config.num_layers, n + 1, config.num_kv_heads, config.head_dim, torch.float32, "cpu")
    backend = TorchNativeBackend(pool, table)
    slots = torch.randperm(n, generator=torch.Generator().manual_seed(seed)) + 1  # slot 0 is the pool's padding
    table.write(0, 0, slots)

    def extend(ids: list[int], start: int, positions: list[int], mask: torch.Tensor | None) -> torch.Tensor:
        batch = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=torch.tensor(ids), positions=torch.tensor(positions),
                             extend_lens_cpu=[len(ids)], prefix_lens_cpu=[start], attn_backend=backend,
                             req_pool_indices=torch.tensor([0]), out_cache_loc=slots[start : start + len(ids)],
                             extend_masks=None if mask is None else [mask])
        backend.init_forward_metadata(batch)
        with torch.no_grad():
            return model.compute_logits(model(batch.input_ids, batch.positions, batch))

    extend(prefix, 0, list(range(len(prefix))), None)
    return extend([root, *tree.tokens], len(prefix), tree.positions(len(prefix)), tree.mask())


def path_to(tree: DraftTree, node: int) -> list[int]:
    """The drafted tokens from the root down to ``node`` (-1: the root itself, no token)."""
    path = []
    while node >= 0:
        path.append(tree.tokens[node])
        node = tree.parents[node]
    return path[::-1]


def path_logits(model: torch.nn.Module, sequence: list[int]) -> torch.Tensor:
    """The next-token logits after ``sequence`` (``[vocab]``), the whole sequence run from scratch by the
    chapter-00 oracle's attention: what a verify row's offset must give for the path that ends there."""
    full = ForwardBatch.for_full_sequences([sequence], NoCacheAttentionBackend())
    with torch.no_grad():
        return model.compute_logits(model(full.input_ids, full.positions, full))[-1]


__all__ = ["path_logits", "path_to", "verify_row_logits"]
