"""The chapter pages of the site show each code cell's outputs, from the executed notebook the notebook test saves.

``docs/hooks/chapters.py`` renders ``chapters/NN_slug.py`` as a page; when ``build/executed/NN_slug.ipynb`` (written
by ``tests/test_notebooks.py::test_notebook_runs``) has the same code cells, every code cell is followed by its
outputs. These tests build a small executed notebook by hand and check what the page gets from it.
"""

from __future__ import annotations

import base64
import importlib.util
import re
import sys
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")  # the book's tools (dev extras); a GPU machine running `-m gpu` may lack them
nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parents[1]
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)
SCRIPT = '''# %% [markdown]
# # 42 · A test chapter

# %% tags=["setup"]
import warnings

# %%
print("hello")

# %% alt="Bar chart: one grey bar per request, the third twice as tall as the others" caption="Tokens per request"
show_a_figure()

# %% tags=["remove"]
print("not on the page")
'''


@pytest.fixture(scope="module")
def hook():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("chapters_hook", ROOT / "docs" / "hooks" / "chapters.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    yield module
    sys.modules.pop(spec.name, None)


def _executed(script: Path, tmp: Path) -> Path:
    """An "executed" copy of ``script``: the outputs a kernel would have recorded, written by hand."""
    nb = jupytext.read(script, fmt="py:percent")
    code = [c for c in nb.cells if c.cell_type == "code"]
    code[0].outputs = [nbformat.v4.new_output("stream", name="stderr", text="x.py:1: UserWarning: w\n  warn()\n")]
    code[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="hello <b>\n"),
                       nbformat.v4.new_output("stream", name="stdout", text="\n".join(map(str, range(500))))]
    code[2].outputs = [nbformat.v4.new_output("display_data", data={
        "image/png": base64.b64encode(PNG).decode(), "text/plain": "<Figure size 640x480 with 1 Axes>"})]
    code[3].outputs = [nbformat.v4.new_output("stream", name="stdout", text="not on the page\n")]
    path = tmp / "executed" / f"{script.stem}.ipynb"
    path.parent.mkdir()
    nbformat.write(nb, path)
    return path.parent


def test_outputs_follow_their_cells(hook, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "42_test.py"
    script.write_text(SCRIPT)
    chapter = hook.Chapter(number="42", stem="42_test", source=script, title="A test chapter")
    page = hook.render_chapter_page(chapter, _executed(script, tmp_path))
    md = page.markdown
    assert page.outputs == 2 == md.count('<div class="chapter-output"')  # the two prints are one block; the figure
    assert md.index('print("hello")') < md.index("hello <b>") < md.index("show_a_figure()") < md.index("fig-1.png")
    assert "lines left out" in md and "499" in md and "\n250\n" not in md  # long text keeps its head and tail
    assert "UserWarning" not in md and "not on the page" not in md and "<Figure size" not in md
    assert page.figures == [("chapters/42_test/fig-1.png", PNG)]
    assert ('<figure class="chapter-figure" markdown="span">\n'
            "![Bar chart: one grey bar per request, the third twice as tall as the others](42_test/fig-1.png)\n"
            "<figcaption>Figure 42.1: Tokens per request</figcaption>\n</figure>") in md


def test_stale_or_missing_executed_copy_gives_code_only(hook, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "42_test.py"
    script.write_text(SCRIPT)
    chapter = hook.Chapter(number="42", stem="42_test", source=script, title="A test chapter")
    executed = _executed(script, tmp_path)
    script.write_text(SCRIPT.replace('print("hello")', 'print("hello again")'))  # the chapter changed since
    for folder in (executed, tmp_path / "nothing-here"):
        page = hook.render_chapter_page(chapter, folder)
        assert page.outputs == 0 and page.figures == [] and 'print("hello again")' in page.markdown


def test_a_plotting_cell_folds_its_code_and_shows_its_figure(hook, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """``hide-input`` folds the code and leaves the figure on the page; ``setup`` folds its outputs with its code."""
    script = tmp_path / "43_figs.py"
    script.write_text('# %% tags=["setup"]\nprint("loaded")\n\n# %% tags=["hide-input"]\ndraw()\n\n'
                      '# %% tags=["hide-output"]\nprint("long log")\n\n# %% tags=["remove-input"]\nprint("result")\n')
    nb = jupytext.read(script, fmt="py:percent")
    setup, plot, log, result = [c for c in nb.cells if c.cell_type == "code"]
    setup.outputs = [nbformat.v4.new_output("stream", name="stdout", text="loaded\n")]
    plot.outputs = [nbformat.v4.new_output("display_data", data={"image/png": base64.b64encode(PNG).decode()})]
    log.outputs = [nbformat.v4.new_output("stream", name="stdout", text="long log\n")]
    result.outputs = [nbformat.v4.new_output("stream", name="stdout", text="result\n")]
    executed = tmp_path / "executed"
    executed.mkdir()
    nbformat.write(nb, executed / "43_figs.ipynb")
    chapter = hook.Chapter(number="43", stem="43_figs", source=script, title="Figures")
    md = hook.render_chapter_page(chapter, executed).markdown
    lines = md.splitlines()

    def line_of(text: str) -> str:
        return next(line for line in lines if text in line)

    assert line_of("loaded").startswith("    ") and line_of('print("loaded")').startswith("    ")  # one fold
    assert line_of("draw()").startswith("    ")  # the plotting code is folded ...
    figure = line_of("43_figs/fig-1.png")
    assert not figure.startswith(" ") and md.index("draw()") < md.index(figure)  # ... its figure is not
    assert not line_of('print("long log")').startswith(" ") and "    long log" in lines  # code shown, log folded
    assert 'print("result")' not in md and not line_of("result").startswith(" ")  # output only
    assert md.count('??? note "setup"') == 1 and md.count('??? note "code"') == 1
    assert md.count('??? note "output"') == 1


def _figures_page(hook, tmp_path: Path, header: str, pngs: int):  # type: ignore[no-untyped-def]
    """A chapter 07 whose one plotting cell (with ``header`` after ``# %%``) drew ``pngs`` figures."""
    script = tmp_path / "07_figs.py"
    script.write_text(f'# %% [markdown]\n# # 07 · Figures\n\n# %% {header}\ndraw()\n')
    nb = jupytext.read(script, fmt="py:percent")
    plot = next(c for c in nb.cells if c.cell_type == "code")
    plot.outputs = [nbformat.v4.new_output("display_data", data={"image/png": base64.b64encode(PNG).decode()})
                    for _ in range(pngs)]
    executed = tmp_path / "executed"
    executed.mkdir(exist_ok=True)
    nbformat.write(nb, executed / "07_figs.ipynb")
    chapter = hook.Chapter(number="07", stem="07_figs", source=script, title="Figures")
    return hook.render_chapter_page(chapter, executed)


def test_a_figure_renders_with_its_number_caption_and_alt_text(hook, tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    """The page's HTML (as MkDocs' markdown makes it) has a ``<figure>`` with the image, its alt text, and a
    ``<figcaption>`` numbered by chapter and place; a cell that draws two figures gives a list per key."""
    import markdown

    header = ('alt=["Line chart: time (y) against batch size (x), flat then rising", '
              '"Bar chart: three bars, the middle one [highest] & labelled"] '
              'caption=["Step time against batch size", "Tokens kept < tokens sent"] tags=["hide-input"]')
    with caplog.at_level("WARNING", logger="mkdocs.hooks.chapters"):
        page = _figures_page(hook, tmp_path, header, pngs=2)
    assert caplog.records == []
    html = markdown.markdown(page.markdown, extensions=["md_in_html", "attr_list", "admonition", "pymdownx.details"])
    figures = re.findall(r'<figure class="chapter-figure">(.*?)</figure>', html, re.DOTALL)
    assert len(figures) == 2
    assert '<img alt="Line chart: time (y) against batch size (x), flat then rising" src="07_figs/fig-1.png" />' \
        in figures[0]
    assert "<figcaption>Figure 7.1: Step time against batch size</figcaption>" in figures[0]
    assert 'alt="Bar chart: three bars, the middle one [highest] &amp; labelled" src="07_figs/fig-2.png"' in figures[1]
    assert "<figcaption>Figure 7.2: Tokens kept &lt; tokens sent</figcaption>" in figures[1]
    assert html.index("draw()") < html.index("<figure")  # the folded code, then the figures


def test_a_figure_without_caption_or_alt_text_is_a_build_warning(hook, tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    """``mkdocs build --strict`` fails on warnings: a figure its cell does not describe stops the build."""
    with caplog.at_level("WARNING", logger="mkdocs.hooks.chapters"):
        _figures_page(hook, tmp_path, 'tags=["hide-input"]', pngs=1)
    assert [r.getMessage() for r in caplog.records] == [
        '07_figs: Figure 7.1 has no caption and no alt: give its cell `caption="..." alt="..."` in its '
        "`# %%` header line"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="mkdocs.hooks.chapters"):  # one string is for one figure only
        _figures_page(hook, tmp_path, 'alt="Line chart: time against batch size, flat" caption="Step time"', pngs=2)
    assert [r.getMessage().split(":")[1] for r in caplog.records] == [" Figure 7.2 has no caption and no alt"]
