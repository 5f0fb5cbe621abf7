"""Tokenizer and incremental detokenizer: the text edges of a request (chapter 02)."""

from minisgl_ref.tokenizer.detokenizer import IncrementalDetokenizer
from minisgl_ref.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]
