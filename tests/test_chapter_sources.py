"""The chapter sources read as a book: headings are markdown, figures are on the page, and the prose speaks of the
engine, not of how its numbers were gathered.

These tests read ``chapters/NN_slug.py`` (jupytext percent scripts) and ``docs/*.md`` as text; nothing is executed,
so they take well under a second.

* A heading written as a comment inside a code cell (``# ## 8. The oracle check`` after some code, with no
  ``# %% [markdown]`` line before it) is shown on the site as a Python comment in a code block, not as a heading:
  the section disappears from the page's table of contents.
* A cell that draws a figure must put its outputs on the page. How the site places a code cell's code and outputs
  is decided by its tags in ``docs/hooks/chapters.py`` (:func:`cell_parts`): ``setup`` and ``hide-cell`` fold the
  outputs together with the code, ``hide-output`` folds them, ``remove*`` drops them. Such a cell may fold its
  plotting code (``hide-input``), never its figure.
* And it must fold that plotting code (``hide-input``), with nothing else in the cell: the numbers, prints and
  checks a reader should see go in a visible cell before the figure.
* The book, the docs and the benchmarks page speak about the engine. Words about how measurements were run
  (machines lent for a while, calls, sessions, device time) and commit hashes in running prose belong in the data
  files under ``docs/data/``, which record the provenance of every number.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")  # the book's tools (dev extras); a GPU machine running `-m gpu` may lack them

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted(p for p in (ROOT / "chapters").glob("*.py") if re.match(r"\d{2}_", p.name))
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


#: A markdown heading as jupytext writes it in a percent script: ``# # Title``, ``# ## Section`` ...
HEADING_IN_COMMENT = re.compile(r"^#\s#{1,6}\s+\S")
#: Calls that draw a figure in a notebook.
DRAWS_FIGURE = re.compile(r"\bplt\.show\(|\.show\(\s*\)\s*$|\bdisplay\(\s*fig\b", re.MULTILINE)

#: Process words: how a measurement was run, not what the engine does. Matched case-insensitively as words.
PROCESS_WORDS = [
    r"bare machines?",
    r"GPU calls?",
    r"(the )?same call",
    r"(measured|ran|run) in one call",
    r"sessions?",
    r"device time",
    r"lent machines?",
    r"perf2_round\w*",
    r"\w*_redesign\w*",
]
# A space in a pattern matches any run of whitespace, so a phrase broken across two lines of a paragraph is found.
PROCESS = re.compile(r"(?<![\w/])(" + "|".join(w.replace(" ", r"\s+") for w in PROCESS_WORDS) + r")(?![\w/])",
                     re.IGNORECASE)
#: A short commit hash in prose: 7 to 12 hex digits with at least one letter and one digit, not part of a
#: file name or identifier.
COMMIT_HASH = re.compile(r"(?<![\w./-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,12}(?![\w-]|\.\w)")


@pytest.fixture(scope="module")
def hook():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("chapters_hook_sources", ROOT / "docs" / "hooks" / "chapters.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    yield module
    sys.modules.pop(spec.name, None)


def _cells(path: Path):  # type: ignore[no-untyped-def]
    return jupytext.read(path, fmt="py:percent").cells


def test_there_are_chapters() -> None:
    assert len(CHAPTERS) >= 12 and DOCS


def misplaced_headings(path: Path) -> list[str]:
    """Heading lines (and bare ``#`` paragraph breaks of prose) inside the code cells of a chapter."""
    found = []
    for k, cell in enumerate(_cells(path)):
        if cell.cell_type != "code":
            continue
        for line in cell.source.splitlines():
            if HEADING_IN_COMMENT.match(line) or line.strip() == "#":
                found.append(f"{path.name}, code cell {k}: {line.strip()!r}")
    return found


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_headings_are_markdown_not_comments_in_code(path: Path) -> None:
    assert misplaced_headings(path) == [], "start a `# %% [markdown]` cell before the heading"


def test_a_heading_after_code_without_a_markdown_marker_is_caught(tmp_path: Path) -> None:
    bad = tmp_path / "42_bad.py"
    bad.write_text('# %%\nx = 1\n#\n# ## 3. A section\n#\n# Some prose.\n\n# %% [markdown]\n# ## 4. Fine\n')
    assert len(misplaced_headings(bad)) == 3  # the heading and the two bare "#" lines around the prose
    good = tmp_path / "42_good.py"
    good.write_text('# %%\nx = 1\n\n# %% [markdown]\n# ## 3. A section\n#\n# Some prose.\n')
    assert misplaced_headings(good) == []


def hidden_figures(path: Path, hook) -> list[str]:  # type: ignore[no-untyped-def]
    """Code cells that draw a figure whose outputs the site folds or drops."""
    found = []
    for k, cell in enumerate(_cells(path)):
        if cell.cell_type == "code" and DRAWS_FIGURE.search(cell.source):
            tags = cell.metadata.get("tags", [])
            if not hook.outputs_visible(tags):
                found.append(f"{path.name}, code cell {k}, tags {tags}")
    return found


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_figure_is_shown_on_the_page(path: Path, hook) -> None:  # type: ignore[no-untyped-def]
    assert hidden_figures(path, hook) == [], "tag a plotting cell `hide-input` to fold its code, not its figure"


def test_which_tags_hide_a_figure(hook, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    shown = [[], ["hide-input"], ["hide"], ["remove-input"]]
    hidden = [["setup"], ["hide-cell"], ["hide-output"], ["remove"], ["remove-cell"], ["remove-output"],
              ["hide-input", "remove-output"]]
    assert [hook.outputs_visible(t) for t in shown] == [True] * len(shown)
    assert [hook.outputs_visible(t) for t in hidden] == [False] * len(hidden)
    script = tmp_path / "42_fig.py"
    script.write_text('# %% tags=["setup"]\nimport matplotlib.pyplot as plt\n\n'
                      '# %% tags=["hide"]\nplt.plot([1, 2])\nplt.show()\n\n'
                      '# %% tags=["setup"]\nfig, ax = plt.subplots()\nplt.show()\n')
    assert hidden_figures(script, hook) == ["42_fig.py, code cell 2, tags ['setup']"]


#: Alt text that says nothing about the picture: the hook's old placeholder, or a bare word.
GENERIC_ALT = re.compile(r"^(figure|image|picture|plot|chart|graph|diagram)\b.{0,25}$|figure \d+ of chapter",
                         re.IGNORECASE)
MIN_ALT = 30


def figure_cells(path: Path) -> list[tuple[int, int]]:
    """``(cell index, figures it draws)`` for each code cell of a chapter that draws, in page order."""
    return [(k, len(DRAWS_FIGURE.findall(cell.source))) for k, cell in enumerate(_cells(path))
            if cell.cell_type == "code" and DRAWS_FIGURE.search(cell.source)]


def undescribed_figures(path: Path, hook) -> list[str]:  # type: ignore[no-untyped-def]
    """Figures whose cell gives no caption, or an alt text too short or too generic to tell a reader what it shows."""
    cells, found = _cells(path), []
    for k, count in figure_cells(path):
        for i in range(count):
            caption, alt = hook.figure_texts(cells[k].metadata, i)
            where = f"{path.name}, code cell {k}, figure {i + 1} of the cell"
            if not caption:
                found.append(f"{where}: no caption")
            if len(alt) < MIN_ALT or GENERIC_ALT.search(alt) or alt == caption:
                found.append(f"{where}: alt text {alt!r} does not describe the picture")
    return found


def uncited_figures(path: Path) -> list[str]:
    """Figures that the markdown cell right after their cell does not cite by number (``Figure 3.2``)."""
    cells, found, number = _cells(path), [], 0
    chapter = int(path.name[:2])
    for k, count in figure_cells(path):
        after = cells[k + 1] if k + 1 < len(cells) else None
        for _ in range(count):
            number += 1
            label = f"Figure {chapter}.{number}"
            if after is None or after.cell_type != "markdown":
                found.append(f"{path.name}, code cell {k}: no markdown cell right after it to say what {label} shows")
            elif not re.search(re.escape(label) + r"(?!\d)", after.source):
                found.append(f"{path.name}, code cell {k}: the markdown cell after it does not cite {label}")
    return found


#: Ways of pointing at a figure without its number, which break when cells move.
VAGUE_FIGURE_REFERENCE = re.compile(
    r"\b(the|this|that) (picture|figure|plot|chart)s? (above|below)\b"
    r"|\b(read|in|see) the (picture|plot|figure|chart)\b"
    r"|\bthe (first|second|third|last|previous|next) (picture|figure|plot|chart)\b", re.IGNORECASE)


def vague_figure_references(path: Path) -> list[str]:
    found = []
    for k, cell in enumerate(_cells(path)):
        if cell.cell_type == "markdown":
            found += [f"{path.name}, markdown cell {k}: {m.group(0)!r}" for m in VAGUE_FIGURE_REFERENCE.finditer(
                " ".join(cell.source.split()))]
    return found


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_figure_has_a_caption_alt_text_and_a_sentence_citing_it(path: Path, hook) -> None:  # type: ignore[no-untyped-def]
    """The site numbers each figure ``Figure C.K`` and captions it from its cell's ``caption`` and ``alt``
    metadata (``docs/hooks/chapters.py``); the prose right after it says what to look at, by that number."""
    assert undescribed_figures(path, hook) == [], 'give the plotting cell `# %% alt="..." caption="..."`'
    assert uncited_figures(path) == []
    assert vague_figure_references(path) == []


def test_undescribed_and_uncited_figures_are_caught(hook, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    alt = "Line chart: time per step (y) against batch size (x), flat up to 64, then rising"
    good = tmp_path / "03_good.py"
    good.write_text(f'# %% alt="{alt}" caption="Step time against batch size" tags=["hide-input"]\nplt.show()\n\n'
                    "# %% [markdown]\n# Figure 3.1 shows the knee.\n\n"
                    '# %% alt=["Bar chart: tokens per request, the third bar twice as tall", '
                    '"Bar chart: pages per request, all bars the same height"] caption=["Tokens", "Pages"]\n'
                    "plt.show()\nplt.show()\n\n# %% [markdown]\n# Compare Figure 3.2 with Figure 3.3.\n")
    assert figure_cells(good) == [(0, 1), (2, 2)]
    assert undescribed_figures(good, hook) == [] and uncited_figures(good) == [] and vague_figure_references(good) == []
    bad = tmp_path / "03_bad.py"
    bad.write_text('# %% tags=["hide-input"]\nplt.show()\n\n# %% [markdown]\n# Figure 3.1 shows it.\n\n'
                   '# %% alt="Figure 2 of chapter 03, KV cache and batching" caption="Pool"\nplt.show()\n\n'
                   "# %% [markdown]\n# Figure 3.20 is not figure 3.2, as the picture above shows.\n\n"
                   f'# %% alt="Chart" caption="Chart"\nfig.show()\n\n# %%\nprint(1)\n\n'
                   f'# %% alt="{alt}" caption="Step time"\nplt.show()\n\n# %% [markdown]\n# Figure 3.3 shows it.\n')
    assert [p.split(": ", 1)[1] for p in undescribed_figures(bad, hook)] == [
        "no caption", "alt text '' does not describe the picture",
        "alt text 'Figure 2 of chapter 03, KV cache and batching' does not describe the picture",
        "alt text 'Chart' does not describe the picture"]
    assert [p.split(": ", 1)[1] for p in uncited_figures(bad)] == [
        "the markdown cell after it does not cite Figure 3.2",
        "no markdown cell right after it to say what Figure 3.3 shows",
        "the markdown cell after it does not cite Figure 3.4"]  # numbers follow the page: the last is 3.4, not 3.3
    assert [v.split(": ", 1)[1] for v in vague_figure_references(bad)] == ["'the picture above'"]



#: What a reader must see rather than find in a fold: a line that prints, displays (other than the figure) or checks.
SHOWS_OR_CHECKS = re.compile(r"\bprint\(|^\s*assert\b|\bdisplay\((?!\s*fig\b)", re.MULTILINE)


def unfolded_plotting_code(path: Path, hook) -> list[str]:  # type: ignore[no-untyped-def]
    """Cells that draw a figure but show their plotting code, and folded plotting cells that also print or check.

    A figure's matplotlib code is scaffolding: the page folds it (a tag of the hook's ``FOLD_INPUT_TAGS``, where
    :func:`cell_parts` puts the code in a collapsed block) and shows the figure. What the reader should see, the
    numbers a figure is drawn from, the lines it prints, the assertions it makes, belongs in a visible cell before
    it; so a folded plotting cell draws and does nothing else."""
    found = []
    for k, cell in enumerate(_cells(path)):
        if cell.cell_type != "code" or not DRAWS_FIGURE.search(cell.source):
            continue
        tags = cell.metadata.get("tags", [])
        if hook.cell_parts(tags).code != "folded":
            found.append(f"{path.name}, code cell {k}: the plotting code is not folded (tags {tags})")
        else:
            found += [f"{path.name}, code cell {k}: a folded plotting cell prints or checks: {m.group(0).strip()!r}"
                      for m in SHOWS_OR_CHECKS.finditer(cell.source)]
    return found


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_figure_folds_its_plotting_code(path: Path, hook) -> None:  # type: ignore[no-untyped-def]
    assert unfolded_plotting_code(path, hook) == [], (
        'move prints and asserts to a visible cell before the figure and tag the drawing cell `tags=["hide-input"]`')


def test_unfolded_plotting_code_is_caught(hook, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    alt = 'alt="Line chart: step time against batch size, flat, then rising" caption="Step time"'
    good = tmp_path / "42_good.py"
    good.write_text('# %%\nrates = [1, 2]\nprint(rates)\nassert rates[0] < rates[1]\n\n'
                    f'# %% {alt} tags=["hide-input"]\nfig, ax = plt.subplots()\nax.plot(rates)\nplt.show()\n\n'
                    f'# %% {alt} tags=["hide"]\ndisplay(fig)\n\n# %% [markdown]\n# Figure 42.1.\n')
    assert unfolded_plotting_code(good, hook) == []
    bad = tmp_path / "42_bad.py"
    bad.write_text(f'# %% {alt}\nrates = [1, 2]\nplt.plot(rates)\nplt.show()\n\n'  # code shown
                   f'# %% {alt} tags=["remove-input"]\nplt.show()\n\n'  # code dropped, not folded
                   f'# %% {alt} tags=["hide-input"]\nplt.plot(rates)\nplt.show()\nprint(f"x {{rates}}")\n'
                   '    assert rates\ndisplay(show_table(rows))\n\n'  # folded, but hides what it prints and checks
                   '# %% [markdown]\n# Figure 42.1.\n')
    assert [p.split(": ", 1)[1] for p in unfolded_plotting_code(bad, hook)] == [
        "the plotting code is not folded (tags [])",
        "the plotting code is not folded (tags ['remove-input'])",
        "a folded plotting cell prints or checks: 'print('",
        "a folded plotting cell prints or checks: 'assert'",
        "a folded plotting cell prints or checks: 'display('"]


def _prose_lines(path: Path) -> list[tuple[int, str]]:
    """The lines a reader reads as prose: markdown cells and comments of a chapter, or a docs page."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [(n, line) for n, line in enumerate(lines, 1)
            if path.suffix == ".md" or line.lstrip().startswith("#") or "print(" in line]


def process_words(path: Path) -> list[str]:
    found = []
    prose = _prose_lines(path)
    for (n, line), nxt in zip(prose, prose[1:] + [(0, "")]):
        # the line, joined to the next prose line when that follows it directly (a phrase may wrap)
        joined = line if nxt[0] != n + 1 else line + "\n" + re.sub(r"^\s*#\s?", "", nxt[1])
        for m in PROCESS.finditer(joined):
            if m.start() < len(line):
                found.append(f"{path.name}:{n}: {' '.join(m.group(0).split())!r} in {line.strip()[:120]!r}")
    return found


def commit_hashes_in_prose(path: Path) -> list[str]:
    """Commit hashes outside tables (a table of runs may name the commit each row was measured at)."""
    found = []
    for n, line in _prose_lines(path):
        if re.match(r"^\s*(#\s*)?\|", line):
            continue
        for m in COMMIT_HASH.finditer(line):
            found.append(f"{path.name}:{n}: {m.group(0)} in {line.strip()[:120]!r}")
    return found


BOOK = CHAPTERS + DOCS


@pytest.mark.parametrize("path", BOOK, ids=lambda p: p.name)
def test_the_book_speaks_of_the_engine_not_of_its_measuring(path: Path) -> None:
    assert process_words(path) == []
    assert commit_hashes_in_prose(path) == []


def test_process_words_and_hashes_are_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("Measured on a bare machine in one GPU call (same call), in one session, at commit 4d00637.\n"
                    "| run | commit |\n| --- | --- |\n| a | 4d00637 |\n"
                    "A data file `docs/data/gpu_tests_h100_ff3d759.txt`; the colour #444444; `start_new_session`.\n"
                    "Graphs replay the whole sequence with one call; a cold start. It ran on five more bare\n"
                    "machines.\n")
    words = [w.split(": ", 1)[1].split(" in ")[0] for w in process_words(page)]
    assert words == ["'bare machine'", "'GPU call'", "'same call'", "'session'", "'bare machines'"]
    assert [h.split(": ", 1)[1].split()[0] for h in commit_hashes_in_prose(page)] == ["4d00637"]


#: The closing headings every numbered chapter has, in this order, each in a markdown cell.
CLOSING_HEADINGS = ["## Summary", "## Exercises", "## Reproduce"]


def closing_headings(path: Path) -> list[str]:
    """The closing headings (``## Summary``, ``## Exercises``, ``## Reproduce``) of a chapter's markdown cells, in
    the order they appear."""
    found = []
    for cell in _cells(path):
        if cell.cell_type != "markdown":
            continue
        for line in cell.source.splitlines():
            if line.strip() in CLOSING_HEADINGS:
                found.append(line.strip())
    return found


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_chapter_ends_with_summary_exercises_reproduce(path: Path) -> None:
    """A reader who finishes a chapter finds what it taught, then what to practise, then how to run it again."""
    assert closing_headings(path) == CLOSING_HEADINGS


def test_a_missing_or_misplaced_summary_is_caught(tmp_path: Path) -> None:
    missing = tmp_path / "42_missing.py"
    missing.write_text("# %% [markdown]\n# ## Exercises\n\n# %% [markdown]\n# ## Reproduce\n")
    assert closing_headings(missing) == ["## Exercises", "## Reproduce"]
    late = tmp_path / "42_late.py"
    late.write_text("# %% [markdown]\n# ## Exercises\n\n# %% [markdown]\n# ## Summary\n\n"
                    "# %% [markdown]\n# ## Reproduce\n")
    assert closing_headings(late) == ["## Exercises", "## Summary", "## Reproduce"]
    in_code = tmp_path / "42_code.py"  # a heading written as a comment in a code cell is not a heading
    in_code.write_text("# %%\nx = 1\n# ## Summary\n\n# %% [markdown]\n# ## Exercises\n\n"
                       "# %% [markdown]\n# ## Reproduce\n")
    assert closing_headings(in_code) == ["## Exercises", "## Reproduce"]
    for bad in (missing, late, in_code):
        assert closing_headings(bad) != CLOSING_HEADINGS


def test_every_chapter_has_a_row_in_the_chapters_table(hook) -> None:  # type: ignore[no-untyped-def]
    """The chapters index says, for each chapter file, which stage it adds to the engine: no empty cell."""
    stages = {number: stage for number, _, stage in hook.CHAPTER_PLAN}
    numbers = [p.name[:2] for p in CHAPTERS]
    assert [n for n in numbers if not stages.get(n, "").strip()] == []
