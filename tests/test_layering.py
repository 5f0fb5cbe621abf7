"""The engine package is a strictly layered graph: no import cycles, and no import from a higher floor.

Every module of ``minisgl_ref/`` is read with ``ast`` (not imported), and every import of a ``minisgl_ref`` module
counts: at the top of the file, inside a function, and under ``if TYPE_CHECKING:``. A module belongs to the floor
of its package (the second component of its dotted name, or the module itself for ``llm.py``, ``cli.py`` and
``__main__.py``; ``minisgl_ref`` for the package's own ``__init__``). A module may import from its own floor or
from a floor below; it may never import from a floor above, and the module graph may have no cycle at all.

Run it as a script (``python tests/test_layering.py``) to print the counts and every offending import.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

# The floors of the engine, bottom first. A package imports only from its own floor or a lower one.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("env",),  # every environment variable the package reads
    ("sampling", "tokenizer"),  # sampling parameters and the sampler; tokenizer and incremental detokenizer
    ("core",),  # the shared vocabulary: Req, ForwardBatch, EngineConfig, ScheduledBatch
    ("distributed",),  # process groups and collectives
    ("layers",),  # tensor-parallel linears, embedding, norm, rotary, attention layer, the kernel table
    ("kvcache",),  # memory only: page allocator, KV pool, request-to-token table, radix tree
    ("models",),  # Llama, Qwen2, Qwen3, config, weights, loader
    ("attention",),  # attention backends
    ("scheduler",),  # the scheduler and the cache manager it drives
    ("engine",),  # the engine loop, model runner, CUDA graphs
    ("perf", "constrained", "speculative", "moe", "quant"),  # extensions (chapter 11): cascade and split-KV decode,
    # folded norms, fused kernels; (chapter 12): structured output -- grammar specs, xgrammar compiles, matchers,
    # token bitmasks, the engine hooks; (chapter 13): speculative decoding -- proposers, draft trees, verification,
    # acceptance; (chapter 14): mixture of experts -- routers, the expert computation and its fused kernel, the
    # MoE models, registered with the loader through register_architecture; (chapter 15): quantization -- FP8
    # formats and scales, FP8 linear layers through the linear seam, registered with the loader's
    # register_quantization
    ("tp",),  # the tensor-parallel engine, group membership and rank launching
    ("runtime",),  # build_runtime: model, tokenizer and engine for one process (offline, server, followers)
    ("llm",),  # the offline LLM
    ("minisgl_ref",),  # the package's public API (`from minisgl_ref import LLM, SamplingParams`)
    ("server", "bench"),  # the HTTP server processes; the benchmarks
    ("cli", "__main__", "course", "book"),  # the command line; the course tasks' regions; what the chapters show code and tables with
)

ROOT = Path(__file__).resolve().parent.parent / "minisgl_ref"

#: The core: chapters 00-10's floors. They declare the seams (``engine/extension.py``, the attention planner, the
#: kernel table, model transforms) that later chapters fill.
CORE = ("env", "sampling", "tokenizer", "core", "distributed", "layers", "kvcache", "models", "attention",
        "scheduler", "engine")
#: Later chapters, plugged into the core's seams by ``runtime.build_runtime``: no core module may import them.
EXTENSIONS = ("perf", "constrained", "speculative", "moe", "quant")


@dataclass(frozen=True)
class Edge:
    src: str  # importing module, dotted
    dst: str  # imported module, dotted
    file: str  # path of the importing file, relative to the repository root
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.src} imports {self.dst}"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _resolve(target: str, modules: set[str]) -> str | None:
    """The longest prefix of a dotted name that is a module of the package (`a.b.C` -> `a.b`)."""
    parts = target.split(".")
    while parts:
        name = ".".join(parts)
        if name in modules:
            return name
        parts.pop()
    return None


def import_edges(root: Path = ROOT) -> list[Edge]:
    files = sorted(root.rglob("*.py"))
    modules = {module_name(f, root) for f in files}
    edges: list[Edge] = []
    seen: set[Edge] = set()
    for f in files:
        src = module_name(f, root)
        is_pkg = f.name == "__init__.py"
        rel = str(f.relative_to(root.parent))
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative import: resolve against the importing module's package
                    base = src.split(".") if is_pkg else src.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                # `from pkg import sub` names the submodule `pkg.sub` when it exists, else `pkg` itself.
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
            for t in targets:
                dst = _resolve(t, modules)
                edge = Edge(src, dst, rel, node.lineno) if dst is not None and dst != src else None
                if edge is not None and edge not in seen:  # `from m import a, b` is one import of `m`
                    seen.add(edge)
                    edges.append(edge)
    return edges


def floor_of(layers: tuple[tuple[str, ...], ...] = LAYERS) -> dict[str, int]:
    return {pkg: i for i, floor in enumerate(layers) for pkg in floor}


def upward_imports(edges: list[Edge], layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[Edge]:
    floors = floor_of(layers)
    return [e for e in edges if floors[package_of(e.dst)] > floors[package_of(e.src)]]


def cycles(edges: list[Edge]) -> list[list[Edge]]:
    """The strongly connected components of the module graph with more than one module, each as its edges."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.src, set()).add(e.dst)
        graph.setdefault(e.dst, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.add(w)
                if w == v:
                    break
            if len(scc) > 1:
                sccs.append(scc)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [[e for e in edges if e.src in scc and e.dst in scc] for scc in sccs]


def test_every_package_has_a_floor():
    packages = {package_of(module_name(f, ROOT)) for f in ROOT.rglob("*.py")}
    missing = packages - set(floor_of())
    assert not missing, f"packages without a floor in LAYERS: {sorted(missing)}"


def test_no_import_cycles():
    found = cycles(import_edges())
    assert not found, "import cycles:\n" + "\n\n".join("\n".join(map(str, c)) for c in found)


def test_no_upward_imports():
    found = upward_imports(import_edges())
    floors = floor_of()
    assert not found, "imports from a higher floor:\n" + "\n".join(
        f"{e}  (floor {floors[package_of(e.src)]} -> {floors[package_of(e.dst)]})" for e in found
    )


def core_imports_of_extensions(edges: list[Edge]) -> list[Edge]:
    """Every import of an extension package by a core module, wherever it appears (``TYPE_CHECKING`` included)."""
    return [e for e in edges if package_of(e.src) in CORE and package_of(e.dst) in EXTENSIONS]


def test_extensions_sit_above_the_core():
    floors = floor_of()
    assert set(CORE) | set(EXTENSIONS) <= set(floors)
    assert min(floors[p] for p in EXTENSIONS) > max(floors[p] for p in CORE)


def test_core_never_imports_an_extension():
    found = core_imports_of_extensions(import_edges())
    assert not found, "core modules importing an extension package (use a seam instead):\n" + "\n".join(map(str, found))


def test_the_rule_names_the_offending_line(tmp_path: Path):
    """The check itself: a core module that imports an extension is reported with its file and line."""
    pkg = tmp_path / "minisgl_ref"
    for d in ("engine", "constrained"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "engine.py").write_text('"""An engine."""\n\nimport minisgl_ref.constrained\n')
    found = core_imports_of_extensions(import_edges(pkg))
    assert [str(e) for e in found] == [
        "minisgl_ref/engine/engine.py:3: minisgl_ref.engine.engine imports minisgl_ref.constrained"]
    assert upward_imports(found) == found


def environment_reads(root: Path = ROOT) -> list[str]:
    """``file:line`` of every read of an environment variable (``os.environ.get``, ``os.environ[...]``,
    ``os.getenv``) outside ``env.py``. Copying the whole environment for a child process (``dict(os.environ)``) is
    not a read of a variable."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path == root / "env.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            is_environ = lambda n: isinstance(n, ast.Attribute) and n.attr == "environ"  # noqa: E731
            read = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and ((node.func.attr == "get" and is_environ(node.func.value)) or node.func.attr == "getenv"))
            read = read or (isinstance(node, ast.Subscript) and is_environ(node.value)
                            and isinstance(node.ctx, ast.Load))
            if read:
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


def test_every_environment_variable_is_read_in_env_py():
    found = environment_reads()
    assert not found, "environment variables read outside minisgl_ref/env.py:\n" + "\n".join(found)


if __name__ == "__main__":
    edges = import_edges()
    found_cycles = cycles(edges)
    found_up = upward_imports(edges)
    print(f"{len(edges)} imports, {len(found_cycles)} cycles, {len(found_up)} upward imports")
    for c in found_cycles:
        print("cycle:\n  " + "\n  ".join(map(str, c)))
    for e in found_up:
        print("upward:", e)
