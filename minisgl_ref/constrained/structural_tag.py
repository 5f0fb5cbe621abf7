"""SGLang's structural tag, turned into xgrammar's (chapter 12).

A structural tag constrains only *parts* of the output. Until one of its triggers (say ``<tool_call>``) is
written the text is free; from the trigger on, the output must continue into one of the structures -- its fixed
begin string, then JSON for its schema, then its fixed end string -- and after the end the text is free again,
until the next trigger. This is how a server can let a model answer in prose *or* call a function, and still
promise that every call it writes has arguments that fit the function's schema.

The request carries SGLang's shape (``{"type": "structural_tag", "structures": [{"begin", "schema", "end"}],
"triggers": [...]}``, checked by :class:`~minisgl_ref.sampling.params.SamplingParams`); :func:`to_xgrammar`
rewrites it as xgrammar's ``triggered_tags`` format. Each schema's JSON is allowed at most one whitespace
character in a row (``max_whitespace_cnt=1``): enough for the ``", "`` and ``": "`` separators a model writes,
too little for the endless run of newlines a small model falls into when whitespace is free (the reason
``json_schema`` is compiled compact, :mod:`~minisgl_ref.constrained.backend`).
"""

from __future__ import annotations

import json
from typing import Any

import xgrammar as xgr
from xgrammar.structural_tag import JSONSchemaFormat, TagFormat, TriggeredTagsFormat

from minisgl_ref.constrained.schema_support import unsupported_keyword

#: Longest run of whitespace allowed inside a structure's JSON (see the module docstring).
MAX_WHITESPACE = 1


def structures(source: str) -> list[dict[str, Any]]:
    """The structures of a (normalised) structural tag's JSON text."""
    return json.loads(source)["structures"]


def to_xgrammar(source: str) -> xgr.StructuralTag:
    """xgrammar's structural tag for SGLang's (JSON text, as ``SamplingParams`` stores it)."""
    tag = json.loads(source)
    return xgr.StructuralTag(format=TriggeredTagsFormat(
        triggers=tag["triggers"],
        tags=[TagFormat(begin=s["begin"], end=s["end"],
                        content=JSONSchemaFormat(json_schema=s["schema"], max_whitespace_cnt=MAX_WHITESPACE))
              for s in tag["structures"]]))


def check_structural_tag_support(source: str) -> None:
    """Raise ``ValueError("structural_tag: structures[i].schema: the keyword ...")`` if one of the schemas uses a
    keyword the grammar would not enforce: the same check, and the same promise, as ``json_schema``'s."""
    for i, s in enumerate(structures(source)):
        reason = unsupported_keyword(s["schema"])
        if reason is not None:
            raise ValueError(f"structural_tag: structures[{i}].schema: {reason}")
