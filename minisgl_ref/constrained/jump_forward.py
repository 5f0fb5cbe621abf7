"""Jump-forward decoding: append the text the grammar forces, without a decode step per token (chapter 12).

Inside a JSON object with fixed keys, after ``{"name": "Ada", `` the grammar allows exactly one continuation,
``"age": ``: every token of it would cost a full decode step, and the model has no choice to make. SGLang's
compressed-FSM idea is to append such forced text at once and compute its KV in one extend step.

The catch is tokenization. The forced text must become tokens, and tokenizing it on its own gives tokens the
model would never have produced: the tokenizer merges characters *across* the boundary between what was sampled
and what is forced (``"`` sampled, ``age": `` forced may canonically be ``"age`` + ``":`` + `` ``). Feeding the
model a non-canonical tokenization drifts it off its training distribution. So, as SGLang does, we re-tokenize
the last few output tokens together with the forced text, keep the common prefix of the old and new tokens, and
replace the rest: the matcher is rolled back to that prefix and advanced by the new tokens, and the request
continues with an extend step over them.

The same holds at the far end of the forced text. The grammar stops forcing in the middle of what the tokenizer
would write as one token: after ``"skills": [`` it forces `` [``, and the model's own token there is `` ["``.
Appending `` [`` and then letting the model sample ``"`` separately is a tokenization it never saw, and a real
model drifts off after it (SmolLM2 starts writing ``["./Lyon/Lyon/...`` until its length limit). So the last
forced token is always left for the model to sample, which it may extend: one decode step per jump buys back
the model's own tokenization. A forced stretch of a single token is then not jumped at all.

:func:`plan_jump` does the token work and advances the matcher; the engine changes the request and its KV
bookkeeping. The retokenized text must decode to exactly the old text plus the forced text (checked), so the
request's text is what it would have been had the forced tokens been sampled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from minisgl_ref.constrained.matcher import GrammarState

#: How many trailing output tokens are re-tokenized with the forced text (SGLang looks back a few tokens too).
RETOKENIZE_WINDOW = 4


@dataclass(frozen=True)
class Jump:
    """Drop the last ``rollback`` output tokens, then append ``tokens``. ``text`` is the forced string; ``text_ids``
    tokenize exactly ``text`` (the detokenizer is fed those, since it cannot take back text it has streamed)."""

    rollback: int
    tokens: list[int]
    text: str
    text_ids: list[int]


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def plan_jump(state: GrammarState, tokenizer: Any, output_ids: list[int], max_rollback: int) -> Jump | None:
    """If the grammar forces a continuation, the :class:`Jump` that appends it, with ``state`` already advanced by
    it; None (``state`` unchanged) if nothing is forced or the text does not tokenize cleanly.

    ``tokenizer`` is a HF tokenizer (``encode(text, add_special_tokens=False)``, ``decode(ids,
    skip_special_tokens=False)``); ``output_ids`` are the request's output tokens so far, all accepted by
    ``state``; ``max_rollback`` caps how many trailing output tokens may be replaced (the engine never replaces
    tokens whose KV the radix tree already shares).

    What to write, in order:

    1. The forced text is ``state.jump_forward_string()`` with trailing whitespace removed (``rstrip``): a BPE
       vocabulary glues a space to the word after it, so a lone forced space is left for the model to sample.
    2. Tokenize it alone. Its **last token is held back** for the model to sample: the forced text ends where the
       grammar stops forcing, which is usually in the middle of what the tokenizer would write as one token
       (forced `` [`` before a string: the model writes `` ["``). Appending `` [`` would give the model a
       tokenization it never saw in training, and its output drifts (it answers ``["./`` instead of
       ``["Python``). So the text to append is the decode of all tokens but the last, ``text_ids`` are that
       text's own tokens, and if there are none, or they do not decode back to exactly that text, return None:
       a single forced token is sampled like any other.
    3. The tail: the last ``min(RETOKENIZE_WINDOW, max_rollback, len(output_ids))`` output tokens. If there is a
       tail, tokenize (its decoded text + the text to append) together; if that decodes back to exactly the same
       string, these are the new tokens; otherwise forget the tail (empty) and use ``text_ids``. With no tail, the
       new tokens are ``text_ids``.
    4. Keep the longest common prefix of the tail and the new tokens (``_common_prefix_len``): ``rollback`` is
       the number of tail tokens after it, and the tokens to append are the new tokens after it. None if there
       are none to append.
    5. Roll ``state`` back by ``rollback`` tokens and advance it by the tokens to append (``state.accepts``). If
       it refuses them, put ``state`` back exactly where it was (advance it again by the rolled-back tail
       tokens) and return None.
    6. Return ``Jump(rollback, tokens, text, text_ids)``.

    Example (SmolLM2's tokenizer, a schema with keys ``name`` and ``age``): the output ends ``... "Ada"``, with
    ``"`` the last token, and the grammar forces ``, "age": ``. The forced text is ``, "age":``, whose tokens are
    ``','``, ``' "'``, ``'age'``, ``'":'``; the last is held back, so the text to append is ``, "age``. With the
    tail, the tokenizer writes ``'",'`` as one token. So the plan rolls back one token (the ``'"'``) and appends
    three: ``'",'``, ``' "'``, ``'age'``; the model then samples ``'":'`` itself, the only token it may."""
    # BEGIN TASK 12.1: jump-forward with retokenization
    # Trailing whitespace stays for the model to sample: BPE vocabularies glue a space to the word after it
    # (" you"), so a forced lone " " token would be followed by an unnatural space-less word, or a second space.
    forced = state.jump_forward_string().rstrip()
    if not forced:
        return None
    # The last forced token is left to the model: it may merge with what comes after it (" [" + '"' -> ' ["').
    text = tokenizer.decode(tokenizer.encode(forced, add_special_tokens=False)[:-1], skip_special_tokens=False)
    text_ids = tokenizer.encode(text, add_special_tokens=False) if text else []
    if not text_ids or tokenizer.decode(text_ids, skip_special_tokens=False) != text:
        return None  # one forced token only, or text that is not a whole number of tokens' worth of characters
    window = min(RETOKENIZE_WINDOW, max_rollback, len(output_ids))
    tail = output_ids[len(output_ids) - window :] if window > 0 else []
    new_ids = text_ids
    if tail:
        old_text = tokenizer.decode(tail, skip_special_tokens=False)
        retokenized = tokenizer.encode(old_text + text, add_special_tokens=False)
        if tokenizer.decode(retokenized, skip_special_tokens=False) == old_text + text:
            new_ids = retokenized
        else:  # the tail does not round-trip (say, it ends inside a character): append the forced text alone
            tail = []
    keep = _common_prefix_len(tail, new_ids)
    rollback, tokens = len(tail) - keep, new_ids[keep:]
    if not tokens:
        return None
    state.rollback(rollback)
    if not state.accepts(tokens):
        state.accepts(tail[keep:])  # put the matcher back where it was
        return None
    return Jump(rollback, tokens, text, text_ids)
    # END TASK 12.1
