"""Griffe extension for the API reference: an attribute is listed only when something says what it is for.

Most attributes of the package are plain state (``self.config = config``), and a heading for each of them, with
nothing under it but the assignment, buried the documented objects: about a thousand such headings across the
reference pages. This extension, loaded by mkdocstrings (``mkdocs.yml``), reads the two ways the package
documents an attribute besides a docstring, then drops every attribute that is still undocumented:

* a ``#:`` comment, on the lines just above the assignment or at the end of its line (Sphinx's convention),
  as in ``minisgl_ref/book.py``'s ``OUTPUT_COLUMNS``;
* the help text of a :func:`minisgl_ref.core.config.flag` field: ``max_running_requests: int = flag(256, "most
  requests decoding at once")`` is documented as "``--max-running-requests``: most requests decoding at once".

Functions, classes and properties are not touched: an undocumented one still shows its signature and source. Griffe's
dataclass extension must run first (``mkdocs.yml`` lists it before this one), because it builds a dataclass's
``__init__`` from the fields, including those dropped here.
"""

from __future__ import annotations

import ast
import re
from typing import Any

from griffe import Attribute, Docstring, Extension, Object

_TRAILING = re.compile(r"#:\s?(.*)$")


def comment_doc(lines: list[str], lineno: int) -> str | None:
    """The ``#:`` comment documenting the assignment on line ``lineno`` (1-based) of ``lines``, or None.

    Comment lines directly above the assignment win; otherwise a ``#:`` comment at the end of its first line."""
    above: list[str] = []
    i = lineno - 2
    while i >= 0 and lines[i].lstrip().startswith("#:"):
        above.insert(0, lines[i].lstrip()[2:].strip())
        i -= 1
    if above:
        return " ".join(line for line in above if line) or None
    if 0 < lineno <= len(lines):
        match = _TRAILING.search(lines[lineno - 1])
        if match and match.group(1).strip():
            return match.group(1).strip()
    return None


def flag_doc(node: ast.AST, name: str) -> str | None:
    """"``--name``: help" for a field assigned ``flag(default, help, ...)``; "The command-line flag ``--name``."
    when the flag has no help text; None for any other assignment."""
    value = getattr(node, "value", None)
    if not isinstance(value, ast.Call):
        return None
    func = value.func
    if not ((isinstance(func, ast.Name) and func.id == "flag") or (isinstance(func, ast.Attribute)
                                                                    and func.attr == "flag")):
        return None
    option = "--" + name.replace("_", "-")
    helps = [kw.value for kw in value.keywords if kw.arg == "help"] or value.args[1:2]
    if helps and isinstance(helps[0], ast.Constant) and isinstance(helps[0].value, str) and helps[0].value:
        return f"`{option}`: {helps[0].value}"
    return f"The command-line flag `{option}`."


def _source_lines(attr: Attribute) -> list[str]:
    try:
        return attr.lines_collection[attr.filepath]  # type: ignore[index]
    except (KeyError, TypeError):
        return []


def drop_bare_attributes(obj: Object) -> int:
    """Remove every undocumented attribute under ``obj`` (modules and classes, recursively); returns how many."""
    dropped = 0
    for name, member in list(obj.members.items()):
        if member.is_alias:
            continue
        if member.is_attribute and not member.has_docstring and "property" not in member.labels:
            obj.del_member(name)
            dropped += 1
        elif member.is_module or member.is_class:
            dropped += drop_bare_attributes(member)  # type: ignore[arg-type]
    return dropped


class AttributeDocs(Extension):
    """Give attributes their ``#:`` comments or flag help as docstrings; drop the attributes left without one."""

    def on_attribute_instance(self, *, node: ast.AST | Any, attr: Attribute, **kwargs: Any) -> None:
        if attr.has_docstring or attr.lineno is None:
            return
        text = comment_doc(_source_lines(attr), attr.lineno)
        if text is None and isinstance(node, ast.AST):
            text = flag_doc(node, attr.name)
        if text:
            attr.docstring = Docstring(text, lineno=attr.lineno, parent=attr)

    def on_package(self, *, pkg: Object, **kwargs: Any) -> None:
        drop_bare_attributes(pkg)
