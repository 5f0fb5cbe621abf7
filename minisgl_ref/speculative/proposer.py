"""What the engine asks of a proposer: four calls, batched where it matters (chapter 13).

A proposer guesses the next few tokens of each running request, cheaply; the target model then verifies the
guesses in one forward pass. The engine tells the proposer everything it knows about a request's tokens, and
asks it for a draft tree before each step:

* ``start(rid, tokens)``: request ``rid`` begins (or begins again, after a retraction), and ``tokens`` is all
  it holds so far: the prompt, plus any output already produced. A second ``start`` for a ``rid`` the proposer
  still knows replaces what it knew (as a ``finish`` then a ``start`` would).
* ``extend(rid, tokens)``: ``tokens`` were appended to the request, in order: the accepted part of the last
  draft plus the target's bonus token after it (or a single token of a step that verified no draft). This is the
  only way a proposer learns what the target accepted; it never reads the request itself. After it, the
  request's known sequence is ``start``'s tokens followed by every ``extend``'s, and the next draft hangs off its
  last token.
* ``propose(rids, max_tokens)``: one result per rid, in order: a :class:`~minisgl_ref.speculative.tree.DraftTree`
  of at most ``max_tokens`` nodes rooted at the request's last known token, or ``None`` (an empty tree means the
  same) when there is nothing worth proposing. Batched, because a draft model runs all requests in one forward
  pass per draft step. Proposing changes nothing the engine can observe: proposing again with the same known
  tokens gives the same trees (a proposer that samples keeps its own seeded generator), and a proposer whose
  draft left state behind (a draft model's KV for the drafted tokens) drops it before returning, so that what it
  holds for a request always matches the tokens the request has *accepted*.
* ``finish(rid)``: the request left (finished, aborted, or retracted to be started again): forget it and free
  what it held. Finishing a rid the proposer does not know is a no-op, so the engine may call it on every exit.

Every rid passed to ``extend`` or ``propose`` must have been started and not finished since (``KeyError``
otherwise). Token lists are plain ``list[int]``; a proposer copies what it keeps.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from minisgl_ref.speculative.tree import DraftTree


@runtime_checkable
class Proposer(Protocol):
    """Guesses draft tokens for running requests (n-gram lookup, a draft model); see the module docstring."""

    def start(self, rid: int, tokens: list[int]) -> None:
        """Request ``rid`` begins with ``tokens`` (prompt plus any output so far)."""
        ...

    def extend(self, rid: int, tokens: list[int]) -> None:
        """``tokens`` were appended to request ``rid`` (the accepted draft prefix and the bonus token)."""
        ...

    def propose(self, rids: list[int], max_tokens: int) -> list[DraftTree | None]:
        """One draft tree of at most ``max_tokens`` nodes per rid (``None`` or empty: no guess), in order."""
        ...

    def finish(self, rid: int) -> None:
        """Request ``rid`` left: forget it and free what it held (a no-op for an unknown rid)."""
        ...


def empty(tree: DraftTree | None) -> bool:
    """Whether a proposal holds no token to verify (``None`` or a tree of no nodes)."""
    return tree is None or len(tree) == 0
