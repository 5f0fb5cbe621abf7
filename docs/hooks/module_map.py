"""MkDocs hook: the map of every module of ``minisgl_ref``, built from the code at every build.

A page that contains the placeholder ``<!-- modules:map -->`` (``docs/architecture.md``) gets a table with one
row per module: its dotted name (linked to its API reference entry), its floor, the first paragraph of its
docstring and the chapters that docstring names. Nothing in the table is written by hand, so it cannot go stale:

- the modules are the ``.py`` files under ``minisgl_ref/``, read with ``ast`` (never imported);
- the floors come from ``LAYERS`` in ``tests/test_layering.py``, the one list of them, which that test enforces;
- the chapters are the two-digit numbers after "chapter"/"chapters" in the docstring's first paragraph (a module
  that names none inherits its package's);
- the links point at the ``docs/reference/**/*.md`` page whose ``::: module`` block renders that module.

A module with no docstring, or with no ``::: module`` block on any reference page, is logged as a warning, which
fails ``mkdocs build --strict``: every module must say what it is and appear in the API reference.
"""

from __future__ import annotations

import ast
import logging
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.module_map")

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = ROOT / "minisgl_ref"
REFERENCE_DIR = ROOT / "docs" / "reference"
CHAPTERS_DIR = ROOT / "chapters"
LAYERING_TEST = ROOT / "tests" / "test_layering.py"
PLACEHOLDER = "<!-- modules:map -->"

#: Modules that need neither a docstring nor a reference entry.
EXEMPT = {"minisgl_ref.__main__"}

CHAPTER_REF = re.compile(r"\b[Cc]hapters?[\s-]+((?:\d\d)(?:\s*(?:,|-|–|/|and|or)\s*\d\d)*)")
MKDOCSTRINGS_BLOCK = re.compile(r"^:::\s+(?P<name>[\w.]+)\s*$")


@dataclass
class Module:
    name: str  # dotted
    path: str  # relative to the repository root
    floor: int
    floor_name: str
    summary: str
    chapters: list[str]


def _layers() -> tuple[tuple[str, ...], ...]:
    """``LAYERS`` from ``tests/test_layering.py``, read as a literal (the test file is not imported)."""
    tree = ast.parse(LAYERING_TEST.read_text(encoding="utf-8"))
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id == "LAYERS" and node.value is not None:
            return ast.literal_eval(node.value)
    raise RuntimeError(f"no LAYERS in {LAYERING_TEST}")


def _dotted(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


ROLE = re.compile(r":\w+:`(~?)([^`]+)`")


def _first_paragraph(doc: str) -> str:
    """The docstring's first paragraph on one line, reStructuredText roles made plain code."""
    para = doc.strip().split("\n\n", 1)[0]
    text = " ".join(line.strip() for line in para.splitlines())
    return ROLE.sub(lambda m: f"`{m[2].rsplit('.', 1)[-1] if m[1] else m[2]}`", text)


def _chapters(text: str) -> list[str]:
    found: set[int] = set()
    for m in CHAPTER_REF.finditer(text):
        group = m.group(1)
        numbers = [int(n) for n in re.findall(r"\d\d", group)]
        found.update(numbers)
        for a, b in re.findall(r"(\d\d)\s*[-–]\s*(\d\d)", group):  # "chapters 03-06" is a range
            found.update(range(int(a), int(b) + 1))
    return [f"{n:02d}" for n in sorted(found)]


def collect_modules() -> list[Module]:
    layers = _layers()
    floor_of = {pkg: i for i, floor in enumerate(layers) for pkg in floor}
    modules: list[Module] = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        name = _dotted(path)
        parts = name.split(".")
        package = parts[1] if len(parts) > 1 else parts[0]
        floor = floor_of.get(package, -1)
        if floor < 0:
            log.warning("module map: %s belongs to no floor of LAYERS in tests/test_layering.py", name)
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        summary = _first_paragraph(doc)
        modules.append(Module(name, path.relative_to(ROOT).as_posix(), floor, "/".join(layers[floor]) if floor >= 0
                              else "?", summary, _chapters(summary)))
    by_name = {m.name: m for m in modules}
    for m in modules:  # a module that names no chapter inherits its package's
        parent = m.name.rsplit(".", 1)[0]
        while not m.chapters and parent in by_name and parent != m.name:
            m.chapters = by_name[parent].chapters
            parent = parent.rsplit(".", 1)[0] if "." in parent else ""
    return sorted(modules, key=lambda m: (m.floor, m.name))


def reference_pages() -> dict[str, tuple[str, bool]]:
    """module -> (reference page relative to docs/, whether it is rendered with a heading of its own)."""
    found: dict[str, tuple[str, bool]] = {}
    for page in sorted(REFERENCE_DIR.rglob("*.md")):
        lines = page.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if m := MKDOCSTRINGS_BLOCK.match(line):
                options = []
                for follow in lines[i + 1:]:
                    if not follow.startswith("    "):
                        break
                    options.append(follow.strip())
                headed = "show_root_heading: false" not in options
                found.setdefault(m["name"], (f"reference/{page.relative_to(REFERENCE_DIR).as_posix()}", headed))
    return found


def chapter_pages() -> dict[str, str]:
    """chapter number -> its page, relative to docs/."""
    return {p.stem[:2]: f"chapters/{p.stem}.md" for p in sorted(CHAPTERS_DIR.glob("[0-9][0-9]_*.py"))}


def module_table(modules: list[Module], from_page: str) -> str:
    here = posixpath.dirname(from_page) or "."
    refs, chapters = reference_pages(), chapter_pages()
    rows = ["| module | floor | what it is | chapters |", "| --- | --- | --- | --- |"]
    for m in modules:
        if m.name in EXEMPT:
            continue
        if not m.summary:
            log.warning("module map: %s (%s) has no docstring", m.name, m.path)
        ref = refs.get(m.name)
        if ref is None:
            log.warning("module map: %s is on no docs/reference/**/*.md page (add a '::: %s' block)", m.name, m.name)
            cell = f"`{m.name}`"
        else:
            page, headed = ref
            link = posixpath.relpath(page, here) + (f"#{m.name}" if headed else "")
            cell = f"[`{m.name}`]({link})"
        chapter_cells = [
            f"[{n}]({posixpath.relpath(chapters[n], here)})" if n in chapters else n for n in m.chapters
        ]
        summary = (m.summary or "—").replace("|", "\\|")
        if not chapter_cells and "every chapter" in m.summary:
            chapter_cells = ["all"]
        rows.append(f"| {cell} | {m.floor} · {m.floor_name} | {summary} | {', '.join(chapter_cells) or '—'} |")
    return "\n".join(rows)


def on_page_markdown(markdown, page, config, files):  # type: ignore[no-untyped-def]
    if PLACEHOLDER not in markdown:
        return markdown
    return markdown.replace(PLACEHOLDER, module_table(collect_modules(), page.file.src_uri))


def on_serve(server, config, builder):  # type: ignore[no-untyped-def]
    """``mkdocs serve``: rebuild when a module's docstring or a reference page changes."""
    for folder in (PACKAGE_DIR, REFERENCE_DIR):
        if folder.is_dir():
            server.watch(str(folder))
    return server
