"""Admission check for structured-output requests: is the grammar valid? (chapter 12)

The server should refuse a bad schema with an HTTP 400 *before* the request reaches the engine, where it could
only end as an aborted request. :func:`validate_grammar` parses the grammar with xgrammar's tokenizer-free front
end (``xgrammar.Grammar.from_json_schema`` / ``from_regex`` / ``from_ebnf`` / ``from_structural_tag``): the same
parser the engine's
compiler runs first, so what passes here compiles there, and it needs neither the model nor its tokenizer -- the
server's front-end process can call it. Results are cached per grammar, so a client that sends the same schema
with every request pays for parsing once.

A JSON schema that parses is then read once more, by :mod:`~minisgl_ref.constrained.schema_support`: xgrammar
silently skips the keywords it cannot turn into grammar (``uniqueItems``, ``not``, ``allOf`` with two
subschemas, ...), so a schema that uses one is refused too, by the keyword's name and its place in the schema --
it would otherwise come back as a 200 whose output may break the schema.
"""

from __future__ import annotations

import functools

import xgrammar as xgr

from minisgl_ref.constrained.schema_support import check_schema_support
from minisgl_ref.constrained.spec import GrammarSpec, grammar_error, spec_of
from minisgl_ref.constrained.structural_tag import check_structural_tag_support, to_xgrammar
from minisgl_ref.sampling.params import SamplingParams

#: How many distinct grammars the admission check remembers (the verdict, not the grammar).
VALIDATION_CACHE_SIZE = 1024


@functools.lru_cache(maxsize=VALIDATION_CACHE_SIZE)
def _problem(spec: GrammarSpec, keywords: bool) -> str | None:
    """The verdict on ``spec``: None if xgrammar parses it (and, with ``keywords``, enforces every keyword of a
    JSON schema), else the error message (a string, so it caches)."""
    try:
        if spec.kind == "json_schema":
            xgr.Grammar.from_json_schema(spec.source)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.source)
        elif spec.kind == "ebnf":
            xgr.Grammar.from_ebnf(spec.source)
        elif spec.kind == "structural_tag":
            xgr.Grammar.from_structural_tag(to_xgrammar(spec.source))
        # json_object: the built-in JSON grammar is always valid
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError from C++ for every kind of bad input
        return str(grammar_error(spec, e))
    if keywords and spec.kind in ("json_schema", "structural_tag"):
        try:
            if spec.kind == "json_schema":
                check_schema_support(spec.source)
            else:
                check_structural_tag_support(spec.source)
        except ValueError as e:
            return str(e)
    return None


def validate_grammar(params: SamplingParams, *, keywords: bool = True) -> None:
    """Raise ``ValueError`` if ``params`` asks for a grammar xgrammar cannot parse, or (unless ``keywords`` is
    False) a JSON schema (alone or in a structural tag) with a keyword the grammar would not enforce; the message
    starts with the field (``json_schema``, ``regex``, ``ebnf`` or ``structural_tag``) and gives the reason.
    Free-text requests always pass.

    ``SamplingParams`` itself already rejects two grammar fields at once and a ``json_schema`` that is not JSON.
    ``keywords=False`` is for a schema nothing will enforce anyway (a tool's, when the model may call it freely)."""
    spec = spec_of(params)
    if spec is None:
        return
    problem = _problem(spec, keywords)
    if problem is not None:
        raise ValueError(problem)
