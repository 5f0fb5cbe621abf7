"""One request's position in its grammar (chapter 12).

A compiled grammar is shared; the *state* -- how far into the grammar this request's output has got -- is not.
:class:`GrammarState` wraps xgrammar's ``GrammarMatcher``, a pushdown automaton that is advanced by every token
the request accepts, and answers the three questions the engine asks it:

* which tokens may come next? (:meth:`fill`: one row of a packed token bitmask, 32 tokens per int32);
* is the output over? (:attr:`is_terminated`: the grammar was complete and a stop token was accepted);
* is the continuation forced? (:meth:`jump_forward_string`: the text that every valid continuation starts
  with, which jump-forward decoding appends without sampling, chapter 12).

The stop tokens are the request's (its EOS ids and ``stop_token_ids``): the mask allows them exactly when the
grammar is complete, so a constrained request cannot stop half-way through its JSON, and once the grammar is
complete the model may still choose to continue where the grammar allows (a number can take more digits).

A stop token is never text to the grammar. So ``stop_token_ids`` that are ordinary text tokens (``"``, a digit)
can leave the grammar at a *dead end*: every token it would allow next is one of the request's stop ids, and the
mask allows nothing. The request asked to stop at those ids, and the grammar can only go on through one of them:
:meth:`open_dead_end` then allows the stop ids, and the one drawn ends the request (:attr:`is_terminated`), as a
stop id does in a free request. Without it the row would have no finite logit, and no token to draw.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch
import xgrammar as xgr


class GrammarState:
    """A request's grammar matcher; advanced by :meth:`accept` with each accepted token, rolled back by
    :meth:`rollback` (jump-forward's retokenization)."""

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: Iterable[int] | None = None) -> None:
        stops = sorted(set(stop_token_ids)) if stop_token_ids is not None else None
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None)
        self.stop_token_ids: list[int] = list(self._matcher.stop_token_ids)
        # Only a stop id that is text elsewhere (not special, not the tokenizer's own stop) can corner the grammar.
        info = compiled.tokenizer_info
        never_text = set(info.special_token_ids) | set(info.stop_token_ids)
        self.can_be_cornered = any(t not in never_text for t in self.stop_token_ids)
        self.num_accepted = 0  # tokens accepted so far (those rollback can undo)
        self.at_dead_end = False  # the last fill allowed nothing; open_dead_end allowed the stop ids instead
        self._stopped = False  # a stop id was accepted at a dead end
        self._vocab_size: int = info.vocab_size

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (and no change) if the grammar does not allow it here. At a dead end,
        a stop id is allowed and ends the output."""
        if self.at_dead_end and token_id in self.stop_token_ids:
            self._stopped = True
            return True
        ok = self._matcher.accept_token(token_id)
        self.num_accepted += ok
        if not ok and token_id in self.stop_token_ids and self._cornered_now():
            # At a dead end that no fill has marked: several tokens appended in one step (speculative decoding,
            # chapter 13) are accepted without a fill between them.
            self._stopped = True
            return True
        return ok

    def accepts(self, token_ids: Iterable[int]) -> bool:
        """Advance by each of ``token_ids``; if one is refused, undo the ones accepted here and return False."""
        done = 0
        for t in token_ids:
            if not self.accept(t):
                self.rollback(done)
                return False
            done += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        if num_tokens > 0:
            self._matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def _cornered_now(self) -> bool:
        """Whether the grammar is at a dead end here: it can be cornered, and its mask allows nothing."""
        if not self.can_be_cornered or self._matcher.is_terminated():
            return False
        scratch = xgr.allocate_token_bitmask(1, self._vocab_size)
        self._matcher.fill_next_token_bitmask(scratch, 0)
        return not scratch.any()

    def allowed_after(self, tokens: Sequence[int], scratch: torch.Tensor) -> torch.Tensor | None:
        """The tokens allowed after this state advanced by ``tokens`` (a path the grammar allows, each token
        allowed by the mask before it), as a ``[vocab]`` bool mask (True: allowed), the state left as it was.
        None when nothing may follow (a stop token on the path ended the grammar): no token after it is kept.

        The mask is the one a plain step would fill there, a dead end opened to the stop ids included.
        ``scratch`` is a one-row bitmask (``xgr.allocate_token_bitmask(1, vocab)``) to fill into."""
        at_dead_end, done, ended = self.at_dead_end, 0, False
        try:
            for t in tokens:
                if self._matcher.accept_token(t):
                    done += 1
                elif t in self.stop_token_ids and self._cornered_now():
                    ended = True  # a stop id at a dead end: the output is over
                else:
                    raise ValueError(f"token {t} is not allowed by the grammar at its place on the path")
                if ended or self._matcher.is_terminated():
                    return None
            self.fill(scratch, 0)
            if self.can_be_cornered and not scratch[0].any():
                self.open_dead_end(scratch, 0)
            return unpack_mask(scratch[0], self._vocab_size)
        finally:
            if done:
                self._matcher.rollback(done)
            self.at_dead_end = at_dead_end

    @property
    def xgr_matcher(self) -> xgr.GrammarMatcher:
        """The wrapped xgrammar matcher (what :class:`~minisgl_ref.constrained.bitmask.TokenBitmask` hands to
        xgrammar's batch fill)."""
        return self._matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (an int32 CPU tensor, one bit per token)."""
        self.at_dead_end = False
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def open_dead_end(self, bitmask: torch.Tensor, row: int) -> None:
        """``bitmask[row]``, just filled, allows nothing: allow the request's stop ids there instead (see the
        module docstring), so that the one drawn ends the output."""
        self.at_dead_end = True
        words = bitmask[row].numpy().view(np.uint32)  # bit 31 of an int32 word is its sign: set it unsigned
        for t in self.stop_token_ids:
            if t // 32 < words.shape[0]:
                words[t // 32] |= np.uint32(1 << (t % 32))

    @property
    def is_terminated(self) -> bool:
        """A stop token was accepted after the grammar was complete, or at a dead end: nothing may follow."""
        return self._stopped or self._matcher.is_terminated()

    def jump_forward_string(self) -> str:
        """The text every continuation allowed by the grammar starts with ("" when there is a choice)."""
        return self._matcher.find_jump_forward_string()


def unpack_mask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """One packed bitmask row (int32, bit ``v % 32`` of word ``v // 32``: token ``v`` allowed) as a
    ``[vocab_size]`` bool mask. An arithmetic shift keeps bit 0 right for the sign bit too."""
    ids = torch.arange(vocab_size)
    return ((words.to(torch.int64)[ids >> 5] >> (ids & 31)) & 1).bool()
