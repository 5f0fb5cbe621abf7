"""The chapter notebooks: in sync with their chapters, and runnable on CPU from the first cell to the last.

Each chapter is written once, as ``chapters/NN_slug.py`` (jupytext percent format), and paired with
``notebooks/NN_slug.ipynb``, which ``scripts/sync_notebooks.sh`` generates from it. Per chapter:

* ``test_notebook_in_sync``: the notebook has the same cells (type and source) as jupytext makes from the
  script. Outputs and metadata are not compared: notebooks are committed without outputs, and Jupyter adds
  metadata of its own.
* ``test_notebook_runs`` (``slow``): the notebook is executed in memory, in a fresh ``python3`` kernel of the
  interpreter running pytest, from the repository root, on CPU (``CUDA_VISIBLE_DEVICES`` is emptied). The
  first cell that raises fails the test with that cell and its traceback. Nothing is written back to
  ``notebooks/``: the executed notebook, outputs and figures included, is saved as ``build/executed/NN_slug.ipynb``
  (ignored by git), which the site build (``docs/hooks/chapters.py``) renders after each cell. A notebook that
  fails leaves no executed copy behind. Figures are recorded with the inline matplotlib backend, so every
  ``plt.show()`` becomes a PNG output. Then its outputs are rendered as the chapter page renders them, and
  every line of a printed-text block must fit in ``minisgl_ref.book.OUTPUT_COLUMNS`` characters (code shown
  with ``show_code`` is markdown, not printed text: the site's code rule applies to it instead).

With no chapter written yet, both tests report a single skip.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

from minisgl_ref.book import OUTPUT_COLUMNS

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.py"))
CELL_TIMEOUT_S = 600
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
EXECUTED_DIR = ROOT / "build" / "executed"  # build artefacts: the site renders their outputs
SYNC_HINT = "run scripts/sync_notebooks.sh to regenerate the notebook from its chapter"


def _by_chapter() -> list:  # type: ignore[type-arg]
    """One parameter per chapter (its id is the file stem), or a single explicit skip when there are none."""
    if not CHAPTERS:
        return [pytest.param(None, marks=pytest.mark.skip(reason="no chapters/NN_slug.py written yet"))]
    return [pytest.param(path, id=path.stem) for path in CHAPTERS]


def notebook_of(chapter: Path) -> Path:
    return ROOT / "notebooks" / f"{chapter.stem}.ipynb"


def cell_sources(nb: nbformat.NotebookNode) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source) for cell in nb.cells]


# --------------------------------------------------------------------------------------------------------- sync


@pytest.mark.parametrize("chapter", _by_chapter())
def test_notebook_in_sync(chapter: Path) -> None:
    notebook = notebook_of(chapter)
    assert notebook.is_file(), f"{notebook.relative_to(ROOT)} is missing: {SYNC_HINT}"
    expected = cell_sources(jupytext.read(chapter, fmt="py:percent"))
    actual = cell_sources(nbformat.read(notebook, as_version=4))
    if actual == expected:
        return
    for i, (got, want) in enumerate(zip(actual, expected)):
        if got != want:
            pytest.fail(
                f"{notebook.name} differs from {chapter.name} at cell {i}:\n"
                f"--- notebook ({got[0]}):\n{got[1]}\n--- chapter ({want[0]}):\n{want[1]}\n{SYNC_HINT}",
                pytrace=False,
            )
    pytest.fail(
        f"{notebook.name} has {len(actual)} cells, {chapter.name} has {len(expected)}: {SYNC_HINT}", pytrace=False
    )


def test_every_notebook_has_a_chapter() -> None:
    orphans = sorted(
        nb.name for nb in (ROOT / "notebooks").glob("*.ipynb") if not (ROOT / "chapters" / f"{nb.stem}.py").is_file()
    )
    assert not orphans, f"notebooks without a chapter: {orphans} ({SYNC_HINT}, which deletes them)"


# ------------------------------------------------------------------------------------------------ output width

#: A ``text`` fence on a rendered page (a printed-text output block): its fence, then its body.
_TEXT_FENCE = re.compile(r"^(`{3,})text\n(.*?)\n\1$", re.S | re.M)


def _chapter_hook():  # type: ignore[no-untyped-def]
    """``docs/hooks/chapters.py``, the site's chapter renderer (not a package: loaded from its file)."""
    spec = importlib.util.spec_from_file_location("chapters_hook_notebooks", ROOT / "docs" / "hooks" / "chapters.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def wide_output_lines(nb: nbformat.NotebookNode, stem: str, width: int = OUTPUT_COLUMNS) -> list[str]:
    """Every line of a printed-text output block on ``stem``'s page that is longer than ``width``, as
    ``"cell K: [length] start of the line"``. The outputs are rendered by the page's own renderer (streams merged,
    warnings dropped, very long blocks cut), so what is checked is what a reader sees; outputs the page leaves
    out (``remove-output`` cells) are not checked, and markdown outputs (``show_code``, ``show_table``) are not
    printed text."""
    hook = _chapter_hook()
    chapter = hook.Chapter(number=stem[:2], stem=stem, source=ROOT / "chapters" / f"{stem}.py", title=stem)
    wide, figures = [], []
    for k, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or hook.cell_parts(cell.metadata.get("tags", [])).outputs == "removed":
            continue
        for block in hook.render_outputs(cell.get("outputs", []), chapter, figures):
            for fence in _TEXT_FENCE.finditer(block):
                wide += [f"cell {k}: [{len(line)}] {line[:80]}" for line in fence.group(2).splitlines()
                         if len(line) > width]
    return wide


def test_wide_output_lines_are_caught() -> None:
    """A printed line wider than the column is reported (in a fold too); code shown as markdown, figures and
    removed outputs are not."""
    long_line = "x" * 150
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("print(...)", outputs=[
            nbformat.v4.new_output("stream", name="stdout", text="short\n" + long_line + "\n")]),
        nbformat.v4.new_code_cell("x", outputs=[
            nbformat.v4.new_output("execute_result", data={"text/plain": "y" * 120}, execution_count=1)]),
        nbformat.v4.new_code_cell("show_code(...)", outputs=[
            nbformat.v4.new_output("display_data", data={"text/markdown": f"```python\n{long_line}\n```",
                                                           "text/plain": "<IPython.core.display.Markdown object>"})]),
        nbformat.v4.new_code_cell("print(...)", metadata={"tags": ["remove-output"]}, outputs=[
            nbformat.v4.new_output("stream", name="stdout", text=long_line)]),
        nbformat.v4.new_code_cell("print(...)", metadata={"tags": ["setup"]}, outputs=[
            nbformat.v4.new_output("stream", name="stdout", text="z" * 101)]),
        nbformat.v4.new_code_cell("print(...)", outputs=[
            nbformat.v4.new_output("stream", name="stdout", text="w" * OUTPUT_COLUMNS)]),
    ]
    assert wide_output_lines(nb, "99_example") == [
        f"cell 0: [150] {'x' * 80}", f"cell 1: [120] {'y' * 80}", f"cell 4: [101] {'z' * 80}"]


# ------------------------------------------------------------------------------------------------------ execute


def _runs_this_interpreter(executable: str) -> bool:
    """Would a kernel spec whose ``argv[0]`` is ``executable`` start the Python running these tests?

    jupyter_client replaces a bare ``python`` / ``python3`` / ``python3.X`` with ``sys.executable`` when it starts
    a kernel (that is what the spec installed by ipykernel into the virtualenv says). Absolute paths are compared
    without resolving symlinks: a virtualenv's ``bin/python`` is usually a link to the system Python, but only the
    link puts the virtualenv's packages on the path.
    """
    bare = {"python", f"python{sys.version_info[0]}", "python{}.{}".format(*sys.version_info[:2])}
    return executable in bare or os.path.abspath(executable) == os.path.abspath(sys.executable)


@pytest.fixture(scope="session")
def kernel_name(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``python3`` when it starts this interpreter, as it does with ipykernel installed in the virtualenv.

    Otherwise (a ``python3`` spec in ``~/.local/share/jupyter`` pointing at another Python, or none at all) we write
    a private kernel spec for ``sys.executable`` and put it first on ``JUPYTER_PATH`` for this session.
    """
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        argv = KernelSpecManager().get_kernel_spec("python3").argv
    except NoSuchKernel:
        argv = []
    if argv and _runs_this_interpreter(argv[0]):
        yield "python3"
        return
    name = "minisgl-ref-python"
    spec_dir = tmp_path_factory.mktemp("jupyter") / "kernels" / name
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python ({sys.executable})",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec, indent=1))
    jupyter_path = [str(spec_dir.parents[1])] + ([os.environ["JUPYTER_PATH"]] if os.environ.get("JUPYTER_PATH") else [])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", os.pathsep.join(jupyter_path))
        yield name


@pytest.mark.slow
@pytest.mark.parametrize("chapter", _by_chapter())
def test_notebook_runs(chapter: Path, kernel_name: str) -> None:
    notebook = notebook_of(chapter)
    if not notebook.is_file():
        pytest.fail(f"{notebook.relative_to(ROOT)} is missing: {SYNC_HINT}", pytrace=False)
    nb = nbformat.read(notebook, as_version=4)
    client = NotebookClient(
        nb,
        kernel_name=kernel_name,
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(ROOT)}},  # the kernel's working directory
    )
    # The inline backend records each figure as an image/png output when it is shown (Agg would drop it).
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    executed = EXECUTED_DIR / notebook.name
    executed.unlink(missing_ok=True)  # a stale copy must not outlive a failing run
    try:
        client.execute(env=env)  # executes `nb` in memory; the file in notebooks/ is never written
        EXECUTED_DIR.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, executed)  # kept even if a line is too wide: the page still renders, scrolling sideways
        wide = wide_output_lines(nb, chapter.stem)
        if wide:
            pytest.fail(f"{notebook.name}: {len(wide)} printed output line(s) wider than {OUTPUT_COLUMNS} characters "
                        "on the page (show code with minisgl_ref.book.show_code, rows with show_table, long text with "
                        "wrap or shorten):\n" + "\n".join(wide), pytrace=False)
        return
    except CellExecutionError as err:
        problem = f"a cell raised\n{err}"
    except CellTimeoutError as err:
        problem = f"a cell ran longer than {CELL_TIMEOUT_S} s\n{err}"
    except DeadKernelError as err:
        problem = f"the kernel died (out of memory?)\n{err}"
    # Outside the except blocks, so the report is the cell's error alone; IPython's colours are removed for logs.
    pytest.fail(f"{notebook.name}: {ANSI_ESCAPE.sub('', problem)}", pytrace=False)
