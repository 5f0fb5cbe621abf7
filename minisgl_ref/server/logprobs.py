"""Log probabilities in the three response shapes clients expect (chapter 10).

The engine computes, for each token a request asked about, one entry: ``[logprob, [[id, logprob], ...]]``, the
token's log probability and its most likely alternatives (``logprob`` is None for the first prompt token, which
nothing predicts). Which distribution those numbers describe is the sampler's business (chapter 02: the one the
token was drawn from, after logit bias, penalties and temperature). This module only dresses the entries up:

* **OpenAI chat** (``logprobs: true``, ``top_logprobs: k``): ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}``, one item per token of the answer.
* **OpenAI completions** (``logprobs: k``, optionally ``echo``): parallel lists ``tokens``, ``token_logprobs``,
  ``top_logprobs`` (a ``{token: logprob}`` dict per token, holding the top ``k`` and the chosen token, as OpenAI
  does) and ``text_offset`` (where each token starts in the returned text).
* **SGLang** ``/generate`` (``return_logprob``): ``[logprob, token id, text or None]`` triples in
  ``meta_info``'s ``input_token_logprobs`` / ``output_token_logprobs`` and the matching ``*_top_logprobs``
  (the text only with ``return_text_in_logprobs``).

A token's text is its decode on its own, special tokens included; its ``bytes`` are that text's UTF-8 (a token
that holds part of a character decodes to U+FFFD alone, as in other OpenAI-compatible servers).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

Entry = Sequence[Any]  # [logprob or None, [[token id, logprob], ...]]


class TokenText:
    """Token id -> its text, cached (the same few thousand ids come back again and again)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._text)

    def _text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


# ------------------------------------------------------------------------------------------------ OpenAI chat


def _chat_item(names: TokenText, token_id: int, logprob: float) -> dict[str, Any]:
    text = names.text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_content(names: TokenText, entries: Sequence[Entry], ids: Sequence[int], top_n: int) -> list[dict[str, Any]]:
    """``choices[i].logprobs.content`` for ``ids`` (the tokens of the answer, each with its entry)."""
    return [{**_chat_item(names, t, e[0]),
             "top_logprobs": [_chat_item(names, alt, lp) for alt, lp in e[1][:top_n]]}
            for e, t in zip(entries, ids)]


# ----------------------------------------------------------------------------------------- OpenAI completions


def completion_logprobs(names: TokenText, entries: Sequence[Entry], ids: Sequence[int], top_n: int,
                        text_start: int = 0) -> dict[str, Any]:
    """``choices[i].logprobs`` for ``ids``; the first token starts at character ``text_start`` of the text."""
    tokens = [names.text(t) for t in ids]
    offsets, at = [], text_start
    for token in tokens:
        offsets.append(at)
        at += len(token)
    tops: list[dict[str, float] | None] = []
    for e, t in zip(entries, ids):
        if e[0] is None:
            tops.append(None)  # the first prompt token: nothing predicted it
            continue
        top = {names.text(alt): lp for alt, lp in e[1][:top_n]}
        top.setdefault(names.text(t), e[0])  # OpenAI always lists the chosen token too
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [e[0] for e in entries], "top_logprobs": tops,
            "text_offset": offsets}


def merge_completion_logprobs(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The parallel lists of several pieces, concatenated (prompt then output, or a stream's chunks)."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key in out:
            out[key] += part[key]
    return out


# ------------------------------------------------------------------------------------------- SGLang native


def sglang_logprobs(names: TokenText | None, entries: Sequence[Entry],
                    ids: Sequence[int]) -> tuple[list[list[Any]], list[list[list[Any]] | None]]:
    """``(token_logprobs, top_logprobs)`` as SGLang's ``meta_info`` holds them: ``[logprob, id, text]`` triples,
    the text None unless ``names`` is given (``return_text_in_logprobs``)."""

    def triple(token_id: int, logprob: float | None) -> list[Any]:
        return [logprob, token_id, names.text(token_id) if names is not None else None]

    tokens = [triple(t, e[0]) for e, t in zip(entries, ids)]
    tops = [None if e[0] is None else [triple(alt, lp) for alt, lp in e[1]] for e in entries]
    return tokens, tops
