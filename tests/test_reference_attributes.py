"""The API reference lists an attribute only when something documents it (docs/hooks/griffe_attributes.py).

On a small package: a ``#:`` comment (above the assignment or at the end of its line), a docstring and a flag's
help text document an attribute; a bare assignment is dropped, while an undocumented function, class or property
stays, and a dataclass keeps every field in its signature. On the package itself: the fields a reader looks up
(``Req``, ``SamplingParams``, ``EngineConfig``, ``ServerArgs``, ...) are all documented, so none of them leaves
the reference.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

griffe = pytest.importorskip("griffe")

ROOT = Path(__file__).resolve().parents[1]
EXTENSION = str(ROOT / "docs" / "hooks" / "griffe_attributes.py")


def _load(name: str, search_path: Path):
    return griffe.load(name, search_paths=[str(search_path)], resolve_aliases=False,
                       extensions=griffe.load_extensions("dataclasses", EXTENSION))


def test_bare_attributes_are_dropped_and_documented_ones_kept(tmp_path):
    pkg = tmp_path / "toy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent('''
        """A toy package."""
        from dataclasses import dataclass


        def flag(default, help=None, **kwargs):
            return default

        #: How many rows a step holds at most.
        MAX_ROWS = 8
        BARE = 3
        TRAILING = 4  #: documented at the end of its line
        WITH_DOCSTRING = 5
        """Documented by a docstring."""


        @dataclass
        class Config:
            size: int = flag(1, "how big")
            mode: str = flag("a")
            scratch: int = 0
            #: Why it exists.
            kept: int = 0


        class Worker:
            def __init__(self, config):
                self.config = config
                #: The rows of the step in flight.
                self.rows = []

            @property
            def busy(self):
                return bool(self.rows)

            def run(self):
                return None


        def helper():
            return None
    '''))
    toy = _load("toy", tmp_path)
    members = set(toy.members)
    assert {"MAX_ROWS", "TRAILING", "WITH_DOCSTRING", "Config", "Worker", "helper"} <= members
    assert "BARE" not in members
    assert toy["MAX_ROWS"].docstring.value == "How many rows a step holds at most."
    assert toy["TRAILING"].docstring.value == "documented at the end of its line"
    config = toy["Config"]
    assert config["size"].docstring.value == "`--size`: how big"
    assert config["mode"].docstring.value == "The command-line flag `--mode`."
    assert config["kept"].docstring.value == "Why it exists."
    assert "scratch" not in config.members
    # The dataclass's signature still has every field, the dropped one included.
    assert [p.name for p in config["__init__"].parameters] == ["self", "size", "mode", "scratch", "kept"]
    worker = toy["Worker"]
    assert "config" not in worker.members
    assert worker["rows"].docstring.value == "The rows of the step in flight."
    assert {"busy", "run", "__init__"} <= set(worker.members)


def test_the_fields_a_reader_looks_up_stay_in_the_reference():
    full = griffe.load("minisgl_ref", search_paths=[str(ROOT)], resolve_aliases=False,
                       extensions=griffe.load_extensions("dataclasses"))
    shown = _load("minisgl_ref", ROOT)
    for path in ("core.request.Req", "core.request.FinishReason", "sampling.params.SamplingParams",
                 "core.config.EngineConfig", "core.config.ModelArgs", "core.config.TPArgs",
                 "server.args.ServerArgs", "server.args.Addresses", "llm.GenerateOutput"):
        fields = [name for name, m in full[path].members.items() if m.is_attribute and not name.startswith("_")]
        dropped = [name for name in fields if name not in shown[path].members]
        assert fields and not dropped, f"{path}: fields without a docstring or #: comment: {dropped}"
    # ... while plain state is not listed.
    assert "config" in full["scheduler.scheduler.Scheduler"].members
    assert "config" not in shown["scheduler.scheduler.Scheduler"].members
