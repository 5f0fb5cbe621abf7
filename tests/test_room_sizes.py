"""The rooms a student reads first stay the size a student can read.

Each core class below is where a chapter's idea lives; later chapters plug into it through declared seams
(``engine/extension.py``, the attention planner, model transforms) instead of growing it. These budgets make a
room that outgrows its chapter fail the suite, with its size in the message. Sizes are read with ``ast`` (class
lines from ``class`` to its last line, docstrings included; dataclass fields as annotated assignments).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "minisgl_ref"

#: (file, class, most lines): the engine loop (chapter 06), the model runner (chapter 03).
CLASS_LINES = (
    ("engine/engine.py", "Engine", 300),
    ("engine/model_runner.py", "ModelRunner", 220),
)
#: (file, class, most fields): a request (chapter 00); a feature's per-request state lives with the feature.
CLASS_FIELDS = (("core/request.py", "Req", 20),)


def _class(path: str, name: str) -> ast.ClassDef:
    tree = ast.parse((ROOT / path).read_text())
    found = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name]
    assert found, f"{path} has no class {name}"
    return found[0]


@pytest.mark.parametrize(("path", "name", "budget"), CLASS_LINES)
def test_class_lines(path: str, name: str, budget: int):
    node = _class(path, name)
    size = node.end_lineno - node.lineno + 1  # type: ignore[operator]
    assert size <= budget, f"{path}: {name} is {size} lines, over its budget of {budget}"


@pytest.mark.parametrize(("path", "name", "budget"), CLASS_FIELDS)
def test_class_fields(path: str, name: str, budget: int):
    fields = [s.target.id for s in _class(path, name).body
              if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    assert len(fields) <= budget, f"{path}: {name} has {len(fields)} fields, over its budget of {budget}: {fields}"


def test_the_chapter_01_model_has_one_forward_path():
    """Every module of ``models/llama.py`` has one ``forward``; a faster variant is a transform applied to a built
    model (``perf/``), not a second path inside it."""
    tree = ast.parse((ROOT / "models/llama.py").read_text())
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        paths = [f.name for f in cls.body if isinstance(f, ast.FunctionDef) and f.name.startswith("forward")]
        assert len(paths) <= 1, f"models/llama.py: {cls.name} has several forward paths: {paths}"


def test_the_engine_never_probes_a_backend():
    """Every hook the engine's components call on an attention backend is declared on ``AttentionBackend``, so
    none is looked up with ``getattr``/``hasattr``."""
    found = []
    for path in sorted((ROOT / "engine").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and "backend" in ast.unparse(node.args[0])):
                found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "backend hooks found by probing, not declared on AttentionBackend:\n" + "\n".join(found)
