"""MkDocs hook: tidy the reStructuredText habits of the package's docstrings in the API reference.

The docstrings are written for readers of the source, and some use reStructuredText: roles such as
``:class:`Req```, a literal block introduced by ``::``, or a "simple table" drawn with ``=====`` rules.
mkdocstrings renders docstrings as Markdown, where those are just text. Rather than rewrite the package's
docstrings for the site, this hook fixes the rendered HTML of the reference pages:

* a role is removed and its code span kept (shortened to the last dotted component when the name starts with
  ``~``, as Sphinx does);
* a paragraph ending in ``::`` (followed by its code block) ends in ``:``;
* a paragraph that is a simple table becomes an HTML table.
"""

from __future__ import annotations

import html as html_lib
import re

_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|data|obj|exc|const):<code>(~?)([^<]*)</code>")
_DOUBLE_COLON = re.compile(r"::</p>")
_PARAGRAPH = re.compile(r"<p>(=+(?: +=+)+\n.*?)</p>", re.DOTALL)
_RULE = re.compile(r"^=+(?: +=+)+$")


def _role(match: re.Match[str]) -> str:
    tilde, name = match.groups()
    return f"<code>{name.rsplit('.', 1)[-1] if tilde else name}</code>"


def _simple_table(match: re.Match[str]) -> str:
    """An RST simple table (rule, header, rule, rows, rule) as HTML; anything else is left alone."""
    if "<" in match.group(1):
        return match.group(0)  # inline markup would shift the columns; leave such a table as text
    lines = html_lib.unescape(match.group(1)).splitlines()
    rules = [i for i, line in enumerate(lines) if _RULE.match(line)]
    if len(rules) != 3 or rules[0] != 0 or rules[2] != len(lines) - 1:
        return match.group(0)
    spans = [m.span() for m in re.finditer(r"=+", lines[0])]
    # Each column runs from its rule's start to the next rule's start; the last one takes the rest of the line.
    starts = [start for start, _ in spans]
    bounds = list(zip(starts, starts[1:] + [None]))

    def cells(line: str) -> list[str]:
        return [html_lib.escape(line[a:b].strip()) for a, b in bounds]

    header = "".join(f"<th>{c}</th>" for c in cells(lines[1]))
    body = "".join(
        "<tr>" + "".join(f"<td>{c}</td>" for c in cells(line)) + "</tr>"
        for line in lines[rules[1] + 1 : rules[2]]
        if line.strip()
    )
    return f"<table><thead><tr>{header}</tr></thead><tbody>{body}</tbody></table>"


def on_page_content(html, page, config, files):  # type: ignore[no-untyped-def]
    if not page.file.src_uri.startswith("reference/"):
        return html
    html = _ROLE.sub(_role, html)
    html = _DOUBLE_COLON.sub(":</p>", html)
    return _PARAGRAPH.sub(_simple_table, html)
