"""Text in, token ids out, and back again (chapter 02).

The engine itself only ever sees token ids. Text exists at the two edges of a request: the prompt (or the chat
messages) must become ids before the scheduler can admit it, and the sampled ids must become text before the
server can stream it. This module is the first edge; :mod:`minisgl_ref.tokenizer.detokenizer` is the second.

We do not write a tokenizer: the model folder's own tokenizer (``tokenizer.json`` and friends, read by HF
``transformers``) is the specification, and any re-implementation could only disagree with it. What this thin
wrapper adds is the few decisions a serving engine must make on top of it:

* which ids end a request (``eos_token_ids``: the folder's ``generation_config.json`` can name several, e.g.
  Llama-3-Instruct ends turns with ``<|eot_id|>`` but its tokenizer's ``eos_token`` is ``<|end_of_text|>``);
* how a chat becomes ids (render the template to *text*, then encode that text *without* adding special tokens,
  because the template already wrote the BOS token if the model wants one);
* clear errors for folders that cannot be served the way the caller asks (no tokenizer files, or a chat request
  for a base model that has no chat template).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

# Any one of these files is enough for transformers to build a tokenizer from a folder.
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",  # a `tokenizers` (Rust) tokenizer: the usual case
    "tokenizer.model",  # a sentencepiece model (older Llama / Mistral folders)
    "vocab.json",  # GPT-2-style vocab.json + merges.txt
    "tokenizer_config.json",
)

Message = Mapping[str, Any]


class Tokenizer:
    """A model folder's tokenizer plus the serving-side facts that go with it.

    Build it with :meth:`from_pretrained`; the wrapped ``transformers`` tokenizer stays available as :attr:`hf`
    for anything this class does not cover.
    """

    def __init__(self, hf: Any, *, eos_token_ids: Iterable[int] = (), path: str | Path | None = None) -> None:
        self._hf = hf
        # The Rust tokenizer under a "fast" HF tokenizer: decoding through it directly skips the Python layers
        # of ``hf.decode`` (argument conversion, clean-up options), about four fifths of the cost of a short
        # decode, and gives the same text when the clean-up is off (see :meth:`decode`).
        self._rust = getattr(hf, "backend_tokenizer", None)
        self.path = Path(path) if path is not None else None
        eos = set(eos_token_ids)
        if hf.eos_token_id is not None:
            eos.add(int(hf.eos_token_id))
        self.eos_token_ids: frozenset[int] = frozenset(eos)

    # ------------------------------------------------------------------ loading

    @classmethod
    def find(cls, folder: Path | None) -> Tokenizer | None:
        """The tokenizer of a model folder, or None when it has none (a weights-only folder: like SGLang's
        ``--skip-tokenizer-init``, prompts must then be token ids)."""
        if folder is None or not any((folder / name).is_file() for name in TOKENIZER_FILES):
            return None
        return cls.from_pretrained(folder)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, gguf_file: str | None = None) -> Tokenizer:
        """Load the tokenizer of the local model folder ``path``.

        ``gguf_file`` names a GGUF file inside ``path`` to read the tokenizer from instead (slow: transformers
        rebuilds the tokenizer from the GGUF metadata; the embedded model converts it once and saves a folder).
        Only local folders are accepted: a serving engine should fail loudly rather than reach for a model hub.
        """
        folder = Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(f"tokenizer folder {folder} does not exist (or is not a directory)")
        if gguf_file is None:
            if not any((folder / name).is_file() for name in TOKENIZER_FILES):
                raise FileNotFoundError(
                    f"{folder} holds no tokenizer: expected one of {', '.join(TOKENIZER_FILES)}"
                )
        elif not (folder / gguf_file).is_file():
            raise FileNotFoundError(f"GGUF file {folder / gguf_file} does not exist")

        from transformers import AutoTokenizer  # imported late: it is slow to import and only needed here

        kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
        try:
            hf = AutoTokenizer.from_pretrained(str(folder), **kwargs)
        except (OSError, ValueError) as err:
            raise ValueError(f"could not load a tokenizer from {folder}: {err}") from err
        return cls(hf, eos_token_ids=_generation_config_eos(folder), path=folder)

    # ------------------------------------------------------------------ basics

    @property
    def hf(self) -> Any:
        """The wrapped ``transformers`` tokenizer."""
        return self._hf

    @property
    def vocab_size(self) -> int:
        """How many ids this tokenizer can decode: the base vocabulary plus added (special) tokens.

        Note that this is often *smaller* than the model's ``vocab_size`` (the embedding matrix is padded to a
        multiple of 64 or 128 for fast matmuls): a sampler must never pick the padding rows, but the tokenizer
        is not the place that knows about them.
        """
        return len(self._hf)

    @property
    def bos_token_id(self) -> int | None:
        return self._hf.bos_token_id

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``.

        ``add_special_tokens=True`` (the HF default) lets the tokenizer add what it adds to a raw prompt, e.g.
        Llama's BOS. Pass ``False`` for text that already contains them, such as a rendered chat template:
        encoding that with ``True`` would give a Llama model *two* BOS tokens, which silently degrades it.
        """
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of ``ids``.

        ``clean_up_tokenization_spaces`` is forced off: that option rewrites ``" ."`` into ``"."`` and similar,
        which (besides being wrong for BPE models) is not *local*: appending a token can change text that was
        decoded before it, and the incremental detokenizer relies on decoding being local.
        """
        if self._rust is not None:
            return self._rust.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self._hf.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    # ------------------------------------------------------------------ chat

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._hf, "chat_template", None))

    def chat_template_text(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """Render ``messages`` with the model's chat template and return the *text*.

        ``add_generation_prompt=True`` appends the header of an assistant turn (``<|im_start|>assistant\\n``
        for ChatML models) so that the model's next tokens are the reply rather than another user turn.
        ``template_kwargs`` reach the template (e.g. ``enable_thinking=False`` for Qwen3, or ``tools=[...]``).
        """
        if not self.has_chat_template:
            raise ValueError(
                f"the tokenizer in {self.path or '<memory>'} has no chat template (no 'chat_template' in "
                "tokenizer_config.json and no chat_template.jinja): it is probably a base model, which cannot "
                "serve chat requests; send a plain completion prompt instead"
            )
        text = self._hf.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        assert isinstance(text, str)
        return text

    def apply_chat_template(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> list[int]:
        """Token ids of the rendered chat: the prompt of a chat-completion request.

        We render to text and encode ourselves (rather than ``tokenize=True``) so that the one rule that matters
        is visible here: the template wrote every special token itself, so none may be added.
        """
        text = self.chat_template_text(
            messages, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        return self.encode(text, add_special_tokens=False)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(path={str(self.path) if self.path else None!r}, vocab_size={self.vocab_size}, "
            f"eos_token_ids={sorted(self.eos_token_ids)})"
        )


def _generation_config_eos(folder: Path) -> list[int]:
    """The ``eos_token_id`` of ``folder/generation_config.json``: absent, an int, or a list of ints.

    This file, not the tokenizer, is what ``model.generate`` uses to stop, so a server that ignores it keeps
    generating past the end of the assistant's turn on models whose turn-end token is not the tokenizer's EOS.
    """
    config_file = folder / "generation_config.json"
    if not config_file.is_file():
        return []
    eos = json.loads(config_file.read_text()).get("eos_token_id")
    if eos is None:
        return []
    if isinstance(eos, int):
        return [eos]
    return [int(i) for i in eos]
