"""What a request's output must look like, as one hashable value (chapter 12).

A request names its grammar with one of four sampling parameters (``json_schema``, ``regex``, ``ebnf``,
``structural_tag``;
:mod:`minisgl_ref.sampling.params`). Everything downstream -- the compile cache, the error messages, the engine's
bookkeeping -- needs the same two facts: *which kind* of grammar, and *its source text*. :class:`GrammarSpec` is
that pair. It is frozen and hashable because it is the key of the compiled-grammar cache: two requests with the
same schema string share one compiled grammar, whoever sent them.

``json_schema=ANY_JSON`` (OpenAI's ``response_format={"type": "json_object"}``) becomes its own kind,
``json_object``: any JSON object, not the schema of one (see :mod:`~minisgl_ref.constrained.backend`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from minisgl_ref.sampling.params import ANY_JSON, SamplingParams

GrammarKind = Literal["json_schema", "json_object", "regex", "ebnf", "structural_tag"]


@dataclass(frozen=True)
class GrammarSpec:
    """One grammar: its kind and its source text (empty for ``json_object``)."""

    kind: GrammarKind
    source: str

    @property
    def field(self) -> str:
        """The sampling parameter the client set, for error messages (``json_object`` came from json_schema)."""
        return "json_schema" if self.kind == "json_object" else self.kind


def spec_of(params: SamplingParams) -> GrammarSpec | None:
    """The grammar ``params`` asks for, or None for free text. ``SamplingParams`` already made sure at most one
    grammar field is set."""
    if params.json_schema is not None:
        if params.json_schema == ANY_JSON:
            return GrammarSpec("json_object", "")
        return GrammarSpec("json_schema", params.json_schema)
    if params.regex is not None:
        return GrammarSpec("regex", params.regex)
    if params.ebnf is not None:
        return GrammarSpec("ebnf", params.ebnf)
    if params.structural_tag is not None:
        return GrammarSpec("structural_tag", params.structural_tag)
    return None


# xgrammar's C++ errors start with a timestamp, a source location and sometimes an assertion's text:
# "[09:57:19] /project/cpp/regex_converter.cc:83: Regex parsing error at position 4: ...". The client needs only
# the reason.
_CPP_PREFIX = re.compile(r"^\s*(\[[\d:.]+\]\s*)?(\S+\.(cc|h|cpp):\d+:\s*)?(Check failed: .*? is false:\s*)?", re.S)


def grammar_error(spec: GrammarSpec, error: BaseException) -> ValueError:
    """A ``ValueError`` whose message names the sampling parameter and gives xgrammar's reason, e.g.
    ``regex is not a valid grammar: Regex parsing error at position 4: The parenthesis is not closed.``"""
    reason = _CPP_PREFIX.sub("", str(error).strip(), count=1).strip() or type(error).__name__
    return ValueError(f"{spec.field} is not a valid grammar: {reason}")
