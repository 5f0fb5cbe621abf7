"""Incremental detokenization and stop strings (chapter 02).

A streaming server sends text as the tokens are sampled. The obvious way, ``decode([new_id])`` per token, is
wrong in three ways, and each rule in this module answers one of them:

1. **A token is not a piece of text.** Byte-level BPE tokenizers (GPT-2, Qwen, SmolLM2) and byte-fallback
   sentencepiece tokenizers (Llama-2, Mistral) can split one character over several tokens: SmolLM2 spends
   three tokens on a single Hangul syllable, a family emoji is seven code points and twenty-five bytes. Decoding
   a prefix that stops inside a character gives U+FFFD (the replacement character) at the end. *Rule: never emit
   text that ends in U+FFFD; wait for more tokens* (and at the very end, flush whatever is there, so the output
   still equals the plain decode).

2. **The decode of a suffix is not the suffix of the decode.** Sentencepiece-style tokenizers drop the leading
   space of the *first* token they decode (``decode(["▁world"]) == "world"``, but ``" world"`` is what it adds
   after ``"Hello"``). *Rule: decode each new token together with a little context before it, and emit only
   what the new tokens added to the context's text.* We keep two offsets into the ids: ``surface`` (where the
   context window starts) and ``read`` (where the tokens not yet turned into text start), decode ``ids[surface:]``
   and ``ids[surface:read]``, and emit the difference. Both offsets move forward after every emission, so each
   step decodes a few tokens, not the whole output: O(window) per token instead of O(length), which is what keeps
   the detokenizer off the critical path of a server streaming thousands of tokens per request.

3. **Stop strings can span tokens, and streamed text cannot be taken back.** ``stop=["###"]`` may arrive as
   ``"#"``, ``"##"``. *Rule: look for stop strings in the text, not in the tokens, and hold back any tail of the
   text that could still become a stop string.* When a stop string completes, the output ends just before it
   (SGLang's and OpenAI's default: the stop string is not part of the output); if it never completes, the held
   text is released as soon as it can no longer be the start of one (or at :meth:`finish`).

4. **A stop regex cannot be held back.** SGLang's ``stop_regex`` ends a request once its text matches a regular
   expression. Unlike a stop string, no finite tail of the text can be proven "not the start of a match", so
   nothing is held back for it: the request ends at the first step whose text contains a match (Python's
   ``re.search``), and the text is kept up to the end of that match, which was never streamed before the match
   completed. A greedy pattern can therefore match more when several tokens arrive in one step; the engine
   feeds one token per step, which makes the cut a function of the ids alone. The pattern is the client's, and
   some patterns take exponential time to fail (``(a|aa)+c`` on a run of ``a``), so each search runs with a
   time limit (the ``regex`` package's ``timeout``); a pattern that exceeds it ends its own request with an
   error instead of stalling every request the engine serves.

Stop *token ids* (EOS, ``<|im_end|>``) are not handled here: the scheduler sees the sampled ids first and
finishes the request itself; this class only turns ids into text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import regex

REPLACEMENT_CHAR = "\ufffd"

# How many prompt tokens to decode as context before the first output token (rule 2). A handful is plenty:
# the context only has to absorb the "first token" effects of the decoder.
PROMPT_CONTEXT_TOKENS = 5
# How far further back we may look for a context that starts on a character boundary (see `_prompt_context`).
MAX_CONTEXT_BACKOFF = 8
# The longest one stop-regex search may take (rule 4); a normal pattern needs microseconds.
STOP_REGEX_TIMEOUT_S = 0.05


class SupportsDecode(Protocol):
    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's output ids into text deltas that never have to be retracted.

    Feed it the ids sampled at each step with :meth:`step`, which returns the text that became *final*; when the
    request ends for another reason (EOS id, length limit, abort), call :meth:`finish` to flush what was held
    back. For any way of cutting the ids into steps, the concatenation of the returned deltas equals
    ``tokenizer.decode(ids)``, cut just before the first stop string if one occurs.
    """

    def __init__(
        self,
        tokenizer: SupportsDecode,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        prompt_ids: Sequence[int] | None = None,
        stop_regex: Sequence[str] = (),
    ) -> None:
        """``prompt_ids``, if given, provides the context for the first output tokens, so that the output text is
        what the output adds *after* the prompt (e.g. ``" Hello"`` rather than ``"Hello"`` for a sentencepiece
        model whose first output token is ``"▁Hello"``). Without it, the output is decoded on its own."""
        if isinstance(stop, str):
            raise TypeError("stop must be a sequence of strings, not a single string")
        if any(s == "" for s in stop):
            raise ValueError("an empty stop string would end every request at once")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop: tuple[str, ...] = tuple(dict.fromkeys(stop))  # unique, in the caller's order
        self._stop_regex = [regex.compile(p) for p in dict.fromkeys(stop_regex)]

        # ids = (a few prompt tokens as context) + (the output tokens)
        context = self._prompt_context(list(prompt_ids or []))
        self._ids: list[int] = context
        self._num_context = len(context)
        self._surface = 0  # the decode window starts here ...
        self._read = len(context)  # ... and the ids from here on have not become text yet

        self._held = ""  # final text that is not emitted yet: it might be the start of a stop string
        self._chunks: list[str] = []  # everything emitted so far
        self._matched_stop: str | None = None
        self._finished = False

    # ------------------------------------------------------------------ public API

    @property
    def token_ids(self) -> list[int]:
        """The output ids fed in so far (the prompt context is not included)."""
        return self._ids[self._num_context :]

    @property
    def output_text(self) -> str:
        """All text emitted so far (after :meth:`finish`: the whole output)."""
        return "".join(self._chunks)

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the request, or ``None``."""
        return self._matched_stop

    @property
    def finished(self) -> bool:
        """True once a stop string matched or :meth:`finish` was called; later ids are ignored."""
        return self._finished

    def step(self, new_ids: Sequence[int]) -> str:
        """Add the newly sampled ids; return the text that became final (often ``""``).

        After a stop string matched, further ids are ignored: with overlap scheduling (chapter 06) the engine
        may already have sampled one more token before it learns that the request is done.
        """
        if self._finished:
            return ""
        self._ids.extend(new_ids)
        return self._advance(final=False)

    def finish(self) -> str:
        """The request ended without a stop string: flush incomplete characters and held-back text."""
        if self._finished:
            return ""
        return self._advance(final=True)

    # ------------------------------------------------------------------ the heart

    def _advance(self, *, final: bool) -> str:
        """Turn the ids not yet decoded into text, check it for stop strings, and return what may be emitted.

        The state: ``self._ids`` (prompt context, then every output id so far), two offsets into it,
        ``self._surface <= self._read`` (the decode window starts at ``surface``; the ids from ``read`` on have
        not become text yet), and ``self._held``, final text not emitted yet. Two halves, one per rule of the
        module docstring:

        * Decode ``ids[surface:read]`` (text already handed on) and ``ids[surface:]`` (the same plus the new ids)
          with ``self._decode`` and keep the difference. Decoding both *from the same start* is what makes the
          difference right: any effect the decoder has on the first token it sees (sentencepiece dropping a
          leading space) hits both strings alike. Take the new text, and move the window on (``surface`` to
          ``read``, ``read`` to the end of the ids), only when ``final`` or when the text has grown and does not
          end in U+FFFD (``REPLACEMENT_CHAR``: a character still missing bytes); otherwise take nothing and
          leave the offsets, so that the next step decodes these ids again. A text that has not grown (a skipped
          special token) must not move the window either: a window starting on such a token would make the
          decoder treat the token after it as the first one and drop its leading space.
        * Search ``held + new text`` (``pending``) with ``self._find_stop(pending)``; only that needs searching,
          because any tail that could start a stop string was held back rather than emitted. If it finds one, it
          returns ``(cut, matched)``: set ``self._matched_stop = matched``, mark the detokenizer finished, clear
          the held text and emit ``pending[:cut]``. Otherwise hold back the tail that could still start a stop
          string (``_stop_prefix_len(pending, self._stop)`` characters; nothing when ``final``), set
          ``self._finished = final`` and emit the rest.

        Emit through ``self._emit(text)``, which records the text, and return what it returns.
        """
        # BEGIN TASK 2.1: incremental detokenization
        prefix_text = self._decode(self._ids[self._surface : self._read])
        new_text = self._decode(self._ids[self._surface :])
        if final or (len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR)):
            # The tokens just turned into text become the context of the next step's window.
            self._surface, self._read = self._read, len(self._ids)
            fresh = new_text[len(prefix_text) :]
        else:
            fresh = ""  # wait: the next ids may complete the character; decode these ids again then

        pending = self._held + fresh
        stop = self._find_stop(pending)
        if stop is not None:
            cut, self._matched_stop = stop
            self._finished, self._held = True, ""
            return self._emit(pending[:cut])  # what follows the cut (the stop string, if it is one) is dropped
        keep = 0 if final else _stop_prefix_len(pending, self._stop)
        self._held = pending[len(pending) - keep :]
        self._finished = final
        return self._emit(pending[: len(pending) - keep])
        # END TASK 2.1

    # ------------------------------------------------------------------ helpers

    def _emit(self, text: str) -> str:
        if text:
            self._chunks.append(text)
        return text

    def _find_stop(self, pending: str) -> tuple[int, str] | None:
        """Where the output ends if ``pending`` (the text not emitted yet) completes a stop string or a stop regex:
        ``(cut, matched)`` means "emit ``pending[:cut]`` and finish, reporting ``matched``"; None: no stop yet.

        A stop string is cut off with everything after it (rule 3); a stop regex keeps the text up to the end
        of its match (rule 4). When both occur, the one that completed first wins: a reader watching the text
        grow would have seen it end there."""
        match = _first_stop(pending, self._stop)
        found = self._first_regex(pending) if pending else None
        if found is not None and (match is None or found[0] < match[0] + len(match[1])):
            end, pattern = found
            return max(end, 0), pattern
        return match

    def _first_regex(self, pending: str) -> tuple[int, str] | None:
        """The stop-regex match over the whole text (emitted + ``pending``) that ends first, as ``(end, pattern)``
        with ``end`` counted in ``pending``; None when no pattern matches."""
        if not self._stop_regex:
            return None
        text, base = self.output_text + pending, len(self.output_text)
        ends = []
        for r in self._stop_regex:
            try:
                m = r.search(text, timeout=STOP_REGEX_TIMEOUT_S)
            except TimeoutError:
                raise ValueError(f"stop_regex {r.pattern!r} took longer than {STOP_REGEX_TIMEOUT_S} s to search "
                                 f"{len(text)} characters of output; use a pattern that does not backtrack") from None
            if m is not None:
                ends.append((m.end() - base, r.pattern))
        return min(ends) if ends else None

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _prompt_context(self, prompt_ids: list[int]) -> list[int]:
        """The last few prompt ids, starting on a character boundary.

        Starting the context inside a multi-byte character is harmless for byte-level BPE (the stray bytes
        become a U+FFFD in both decodes of the window), but not for byte-fallback tokenizers: their decoder
        turns a whole *run* of ``<0x..>`` tokens into U+FFFDs when the run is not valid UTF-8. A context that
        starts with a stray continuation byte token would then poison the bytes of the first output character
        (a Chinese prompt followed by a Chinese reply would come out as U+FFFDs). So we step back until the
        context decodes without a leading U+FFFD, and use no context if that fails.
        """
        end = len(prompt_ids)
        first = max(0, end - PROMPT_CONTEXT_TOKENS)
        for start in range(first, max(0, first - MAX_CONTEXT_BACKOFF) - 1, -1):
            if not self._decode(prompt_ids[start:end]).startswith(REPLACEMENT_CHAR):
                return prompt_ids[start:end]
        return []


def _first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """The stop string occurrence in ``text`` that *ends* first, as ``(start, stop)``; ties go to the longest.

    "Ends first" is what a reader watching the text grow one character at a time would see first, so the result
    does not depend on how the text happened to be cut into tokens and steps.
    """
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for stop in stops:
        start = text.find(stop)
        if start < 0:
            continue
        candidate = (start + len(stop), start, stop)
        if best is None or candidate[:2] < best[:2]:
            best = candidate
    return None if best is None else (best[1], best[2])


def _stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of some stop string (0 if none).

    That tail must be held back: the next tokens may complete the stop string, and then it must not have been
    emitted.
    """
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest
