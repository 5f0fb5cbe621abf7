"""The draft tree: the tokens a proposer guesses after a request's last token, and the shape that lets one forward
pass verify all of them.

A chain (one guess per position) is the special case where every node's parent is the node before it. A tree
keeps several guesses for the same position (siblings): the target model scores all of them in the same pass, and
the longest path it agrees with wins.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    """Draft tokens as a tree rooted at the request's last known token.

    Nodes are numbered 0..n-1 in topological order (a parent before its children). In the verify row the root
    comes first and node i sits at row offset i + 1, so the row's offsets are ``[root, node 0, ..., node n-1]``
    and the logits at offset j give the target's distribution of the token after that offset.
    """

    tokens: tuple[int, ...]  #: node i's drafted token
    parents: tuple[int, ...]  #: node i's parent: -1 for the root, else a node index smaller than i
    #: The proposal distributions the nodes were sampled from, [n, vocab], or None when the draft is deterministic
    #: (n-gram lookup, a greedy or top-k draft model): the acceptance rule then treats each node as a point mass.
    probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"a draft tree needs one parent per token: {len(self.tokens)} tokens, "
                             f"{len(self.parents)} parents")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i}'s parent must be -1 (the root) or an earlier node, got {p}")
        if self.probs is not None and self.probs.shape[0] != len(self.tokens):
            raise ValueError(f"probs has {self.probs.shape[0]} rows for {len(self.tokens)} draft tokens")

    @classmethod
    def chain(cls, tokens: list[int] | tuple[int, ...], probs: torch.Tensor | None = None) -> DraftTree:
        """A draft of one guess per position: node i's parent is node i - 1."""
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)), probs)

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        """Each node's distance from the root (a child of the root is at depth 1): its position is the root's
        position plus its depth. Not its index plus one: siblings share a depth, and a node listed late in the row
        (the third child of the root, say) can be shallow. Parents come before their children, so a node's
        depth follows from its parent's, already known."""
        # BEGIN TASK 13.2: the tree's depths and attention mask
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out
        # END TASK 13.2

    def positions(self, root_position: int) -> list[int]:
        """The verify row's positions, root first: the root at ``root_position`` (the number of the request's
        tokens already in the KV cache), node i at ``root_position + depth``. Siblings share a position: each is a
        guess for the same place in the sequence, and RoPE must rotate it as if it stood there alone."""
        return [root_position] + [root_position + d for d in self.depths()]

    def children(self, node: int) -> list[int]:
        """The children of ``node`` (-1: of the root), in node order."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def mask(self) -> torch.Tensor:
        """[n + 1, n + 1] bool over the verify row's offsets (root first): offset a may attend to offset b when b
        is a or one of a's ancestors. Every offset also sees the whole cached prefix, which is not in the mask.

        The causal mask would let a node see every offset before it in the row, its earlier siblings and their
        subtrees included: it would be computed after a text nobody wrote. Under this mask each node is computed
        as the last token of its own path, root to itself, so one pass scores every path at once. Node ``i`` sits
        at offset ``i + 1`` (the root at 0); parents come before their children."""
        # BEGIN TASK 13.2: the tree's depths and attention mask
        n = len(self.tokens)
        m = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        m[:, 0] = True
        for i, p in enumerate(self.parents):
            m[i + 1] = m[p + 1]
            m[i + 1, i + 1] = True
        return m
        # END TASK 13.2
