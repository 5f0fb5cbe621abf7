"""The files the book cites exist, and every result file under ``docs/data/`` is cited by a page.

The pages are the chapters (``chapters/NN_slug.py``), the docs (``docs/**/*.md``, course pages included), the
benchmarks page's generator (``scripts/benchmarks_page.py``), the README and the engine's docstrings (the
reference pages render them). A result file counts as cited when a page names it, or when a cited result file
names it (a data file's provenance may point at the run it was compared with). A name may be written with a
placeholder, as chapter code builds it: ``constrained_bench_real_{name}_h100.json`` cites every file it can
expand to, ``_{plain,mixed}_`` the two it lists.

* A cited ``scripts/...`` path (a command in a "Reproduce" section, a data file's ``command`` or ``script``
  field) must exist, so that every command the book gives can be run.
* A cited ``docs/data/...`` file must exist, and every file under ``docs/data/`` must be cited: a result nobody
  reads is not kept.

Nothing is executed: the files are read as text, in well under a second.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data"


def pages(root: Path = ROOT) -> list[Path]:
    """Every file a reader sees as a page, or whose text a page shows."""
    found = sorted((root / "chapters").glob("[0-9][0-9]_*.py"))
    found += sorted((root / "docs").glob("**/*.md"))
    found += [root / "scripts" / "benchmarks_page.py", root / "README.md", root / "scripts" / "gpu" / "README.md"]
    found += sorted((root / "minisgl_ref").glob("**/*.py"))
    return [p for p in found if p.is_file()]


#: A result file's name as a page writes it: letters, digits, ``_ - .`` and placeholders, then an extension.
DATA_NAME = re.compile(r"[A-Za-z0-9_{},.\-]+\.(?:json|jsonl|txt|log)\b")
#: A result file cited by its path.
DATA_PATH = re.compile(r"docs/data/([A-Za-z0-9_{},.\-]+\.(?:json|jsonl|txt|log))\b")
#: A script cited by its path (``/work/x/scripts/...`` in an old provenance field counts from ``scripts/``).
SCRIPT_PATH = re.compile(r"(?<![\w.-])(?:[\w./-]*/)?(scripts/[\w./-]+?\.(?:sh|py))\b")


def name_pattern(name: str) -> re.Pattern[str] | None:
    """A cited name as a pattern: ``{a,b}`` is one of the listed words, ``{x}`` any run of ``[a-z0-9_]``.
    None for a name too vague to cite one file (fewer than 12 fixed characters, as ``f"{name}.json"``)."""
    if len(re.sub(r"\{[^}]*\}", "", name)) < 12:
        return None
    parts = []
    for piece in re.split(r"(\{[^}]*\})", name):
        if piece.startswith("{") and piece.endswith("}"):
            words = piece[1:-1].split(",")
            parts.append("(?:" + "|".join(map(re.escape, words)) + ")" if len(words) > 1 else "[a-z0-9_]+")
        else:
            parts.append(re.escape(piece))
    return re.compile("".join(parts))


def cited_data(texts: list[str], files: list[str], read) -> set[str]:  # type: ignore[no-untyped-def]
    """The files of ``files`` that ``texts`` cite, directly or through a cited file (``read(name)`` is its text)."""
    cited: set[str] = set()

    def scan(text: str) -> set[str]:
        new = set()
        for token in set(DATA_NAME.findall(text)):
            pattern = name_pattern(token)
            if pattern is not None:
                new |= {f for f in files if pattern.fullmatch(f)}
        return new - cited

    frontier = set().union(*(scan(t) for t in texts)) if texts else set()
    while frontier:
        cited |= frontier
        frontier = set().union(*(scan(read(f)) for f in frontier)) - cited
    return cited


def missing_data(texts: list[str], files: list[str]) -> list[str]:
    """``docs/data/...`` paths in ``texts`` that name no file of ``files``."""
    missing = []
    for text in texts:
        for name in DATA_PATH.findall(text):
            pattern = name_pattern(name) or re.compile(re.escape(name))
            if not any(pattern.fullmatch(f) for f in files):
                missing.append(name)
    return sorted(set(missing))


def missing_scripts(texts: list[str], root: Path = ROOT) -> list[str]:
    """``scripts/...`` paths in ``texts`` that do not exist under ``root``."""
    return sorted({p for t in texts for p in SCRIPT_PATH.findall(t) if not (root / p).is_file()})


def _data_files() -> list[str]:
    return sorted(p.name for p in DATA.iterdir() if p.is_file())


def _texts(paths: list[Path]) -> list[str]:
    return [p.read_text(errors="replace") for p in paths]


def test_every_data_file_is_cited_by_a_page() -> None:
    files = _data_files()
    cited = cited_data(_texts(pages()), files, lambda f: (DATA / f).read_text(errors="replace"))
    assert len(files) > 100
    assert sorted(set(files) - cited) == []


def test_every_cited_data_file_exists() -> None:
    assert missing_data(_texts(pages()), _data_files()) == []


def test_every_cited_script_exists() -> None:
    data_texts = _texts(sorted(DATA.iterdir()))
    page_texts = _texts(pages())
    assert any("scripts/gpu/chapter.sh" in t for t in page_texts)
    assert missing_scripts(page_texts + data_texts) == []


def test_the_checks_catch_what_they_look_for(tmp_path: Path) -> None:
    """Each check reports the problem it exists for, and only that."""
    files = ["decode_anatomy_h100.json", "decode_anatomy_folded_h100.json", "constrained_bench_real_typical_h100.json",
             "constrained_bench_real_bounded_h100.json", "tp_bench_h200.json", "tp_bench_h200.log"]
    texts = {"decode_anatomy_h100.json": '{"compared_with": "decode_anatomy_folded_h100.json"}',
             "tp_bench_h200.json": "{}"}
    page = ('AN = load("decode_anatomy_h100.json")\n'
            'REAL = {n: ROOT / f"constrained_bench_real_{n}_h100.json" for n in ("typical", "bounded")}\n'
            'X = json.loads((ROOT / "docs/data" / f"{name}.json").read_text())\n'
            "# `docs/data/tp_bench_h200.json`, `docs/data/gone_h100.json`\n")
    cited = cited_data([page], files, lambda f: texts.get(f, ""))
    # directly, through another cited file, through a placeholder; the vague f"{name}.json" cites nothing
    assert sorted(set(files) - cited) == ["tp_bench_h200.log"]
    assert missing_data([page], files) == ["gone_h100.json"]
    assert missing_data(["`docs/data/constrained_bench_real_{typical,bounded}_h100.json`"], files) == []
    (tmp_path / "scripts" / "gpu").mkdir(parents=True)
    (tmp_path / "scripts" / "gpu" / "chapter.sh").write_text("")
    cmds = ["# bash scripts/gpu/chapter.sh 11\n# bash scripts/gpu/bare_machine.sh out.json",
            '"command": "/work/main/scripts/gpu/offline_suite.py --parts steps"']
    assert missing_scripts(cmds, tmp_path) == ["scripts/gpu/bare_machine.sh", "scripts/gpu/offline_suite.py"]


EVIDENCE = ROOT / "docs" / "performance-evidence.md"
#: The line under a table of the evidence page that names its data: ``Data: [`docs/data/x.json`](data/x.json) ...``.
DATA_LINE = re.compile(r"^Data: .*docs/data/", re.MULTILINE)


def tables_without_data(markdown: str) -> list[int]:
    """First lines (1-based) of the tables of ``markdown`` (``text`` blocks and Markdown tables) with no ``Data:``
    line naming a ``docs/data/`` file right under them. Command blocks (``bash``) and the table under
    ``## Provenance``, which names commits rather than results, are not measurements."""
    lines = markdown.split("\n")
    tables: list[tuple[int, int]] = []
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            j = next(k for k in range(i + 1, len(lines)) if lines[k].startswith("```"))
            if lines[i].strip() in ("```", "```text"):
                tables.append((i, j))
            i = j + 1
        elif re.match(r"^\|\s*-{3}|^\|-{3}", lines[i]):
            j = i
            while j + 1 < len(lines) and lines[j + 1].startswith("|"):
                j += 1
            tables.append((i - 1, j))
            i = j + 1
        else:
            i += 1
    missing = []
    for start, end in tables:
        heading = next((line for line in reversed(lines[:start]) if line.startswith("## ")), "")
        if heading == "## Provenance":
            continue
        after = [line for line in lines[end + 1:end + 4] if line.strip()]
        if not (after and DATA_LINE.match(after[0])):
            missing.append(start + 1)
    return missing


def test_every_table_of_the_evidence_page_names_its_data() -> None:
    text = EVIDENCE.read_text()
    assert text.count("\nData: ") >= 50
    assert tables_without_data(text) == []
    files = _data_files()
    for line in re.findall(r"^Data: .*$", text, re.MULTILINE):
        assert re.search(r"\((?:NVIDIA )?H[12]00[^)]*, 20\d\d-\d\d-\d\d\)", line), line  # hardware and date
        assert missing_data([line], files) == []


def test_a_table_without_its_data_line_is_caught() -> None:
    page = ("intro\n\n```text\na 1\n```\n\nData: [`docs/data/x_h100.json`](data/x_h100.json) (H100, 2026-11-24).\n\n"
            "```text\nb 2\n```\n\nno data named here\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
            "```bash\npython -m x\n```\n\n## Provenance\n\n| what | commit |\n|---|---|\n| x | abc1234 |\n")
    assert tables_without_data(page) == [9, 15]


#: A module a command runs: ``python -m benchmarks.kernels``, ``python3 -m minisgl_ref.course grade``.
MODULE = re.compile(r"python3? -m ((?:benchmarks|minisgl_ref|scripts)(?:\.\w+)*)")


def missing_modules(texts: list[str], root: Path = ROOT) -> list[str]:
    """Modules run by ``python -m`` in ``texts`` that are neither a file nor a package under ``root``. A line that
    checks out another commit first (``git checkout $REV && python -m ...``) runs that commit's code: skipped."""
    missing = set()
    for text in texts:
        for line in text.splitlines():
            if "git checkout" in line:
                continue
            for name in MODULE.findall(line):
                path = root / name.replace(".", "/")
                if not (path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()):
                    missing.add(name)
    return sorted(missing)


def test_every_module_a_page_runs_exists() -> None:
    assert missing_modules(_texts(pages())) == []


def test_a_missing_module_is_caught(tmp_path: Path) -> None:
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "kernels.py").write_text("")
    text = ("# python -m benchmarks.kernels --output x.json\n# python -m minisgl_ref.bench.tp --phase check\n"
            "git checkout $OLD && python -m benchmarks.raw_decode\n")
    assert missing_modules([text], tmp_path) == ["minisgl_ref.bench.tp"]
