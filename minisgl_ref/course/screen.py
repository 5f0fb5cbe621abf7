"""The static check of submitted task regions: code that reaches for the grader, the reference or the process is
refused before any test runs.

The grader (:mod:`minisgl_ref.course.grade`) runs the tests in a child process and trusts only what that child's
genuine plugin signs. Code inside the child can still do anything the child can (a task region runs there, when a
test calls it), so this check is the second line: it reads each region of the student's copy with :mod:`ast` and
refuses the constructs that have no place in an engine function and every place in an escape:

* code outside the function the region belongs to (lines pasted between the markers that close the function and
  run at import);
* imports of the process, the interpreter or the grader: ``os``, ``sys``, ``subprocess``, ``ctypes``,
  ``importlib``, ``builtins``, ``gc``, ``inspect``, ``pytest``, ``conftest``, ``minisgl_ref.course`` and the like
  (:data:`REFUSED_MODULES`), and ``__editable__`` finders;
* names that run or reach arbitrary code: ``__import__``, ``eval``, ``exec``, ``compile``, ``open``,
  ``globals``, ``vars``, ``setattr`` (:data:`REFUSED_NAMES`), and ``getattr`` with a computed name;
* attributes that lead out of the function: ``sys.modules``, ``os._exit``, ``sys.exit``, frames and their
  globals, ``__subclasses__``, ``torch.os`` (:data:`REFUSED_ATTRIBUTES`);
* ``global`` and ``nonlocal``, and assignments to module-level names' attributes or items (monkeypatching
  ``torch.testing.assert_close``, the engine's classes or a test helper).

None of the reference's regions uses any of these, so a correct answer is never refused. A refused region scores
0 for its task, as if it were blank, and the report says which construct on which line was refused. The check is
a list of known escapes, not a proof: it stops the obvious ones and makes the rest deliberate.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

from minisgl_ref.course.regions import Region, blank_text, scan, scan_text

#: Modules (and their submodules) a region may not import.
REFUSED_MODULES = frozenset({
    "os", "posix", "nt", "sys", "subprocess", "_posixsubprocess", "ctypes", "_ctypes", "cffi", "importlib",
    "builtins", "__builtin__", "gc", "inspect", "atexit", "signal", "multiprocessing", "threading", "_thread",
    "socket", "pty", "runpy", "site", "sitecustomize", "usercustomize", "pkgutil", "zipimport", "shutil",
    "pathlib", "io", "_io", "tempfile", "pickle", "marshal", "shelve", "code", "codeop", "types", "mmap", "fcntl",
    "resource", "sysconfig", "pytest", "_pytest", "pluggy", "conftest", "tests", "hypothesis", "setuptools", "pip",
    "minisgl_ref.course", "asyncio", "concurrent", "faulthandler", "tracemalloc", "traceback", "weakref",
    "dis", "linecache", "glob", "fileinput",
})
#: Names a region may not use (as a name: call, reference or assignment).
REFUSED_NAMES = frozenset({
    "__import__", "eval", "exec", "compile", "open", "globals", "locals", "vars", "setattr", "delattr",
    "breakpoint", "input", "exit", "quit", "__builtins__", "__loader__", "__spec__", "__file__", "memoryview",
})
#: Attribute names a region may not read or write, whatever the object.
REFUSED_ATTRIBUTES = frozenset({
    # the process and the interpreter
    "_exit", "exit", "kill", "killpg", "fork", "forkpty", "setsid", "system", "popen", "execv", "execve",
    "execl", "execle", "execlp", "execvp", "execvpe", "spawnv", "spawnve", "posix_spawn", "modules", "path_hooks",
    "meta_path", "settrace", "setprofile", "_getframe", "environ", "putenv", "dup2", "chdir",
    # frames, code and the objects behind them
    "f_back", "f_globals", "f_locals", "f_builtins", "f_code", "gi_frame", "cr_frame", "ag_frame", "tb_frame",
    "get_objects", "get_referrers", "get_referents", "__globals__", "__builtins__", "__subclasses__", "__bases__",
    "__base__", "__mro__", "__dict__", "__code__", "__closure__", "__func__", "__self__", "__import__",
    "__loader__", "__spec__", "__file__", "__path__", "__getattribute__", "__setattr__", "__delattr__",
    "__reduce__", "__reduce_ex__", "__init_subclass__",
    # modules reached as attributes of other modules (torch.os, np.sys, ...)
    "os", "sys", "subprocess", "builtins", "importlib", "ctypes", "gc", "inspect", "atexit", "signal", "pytest",
    "multiprocessing", "threading", "pickle", "marshal", "shutil", "pathlib", "io", "types", "runpy",
    # compiling and loading native code
    "load_inline", "load_library", "cpp_extension", "cdll", "CDLL", "dlopen",
})


def _module_refused(name: str) -> bool:
    parts = name.split(".")
    return any(".".join(parts[:i]) in REFUSED_MODULES for i in range(1, len(parts) + 1)) or any(
        p.startswith("__editable__") for p in parts)


def _resolve(node: ast.ImportFrom, path: str) -> str:
    """The absolute module a ``from ... import`` names, given the file it sits in."""
    if not node.level:
        return node.module or ""
    package = path.removesuffix(".py").split("/")[:-1]  # minisgl_ref/x/y.py -> [minisgl_ref, x]
    base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
    return ".".join([*base, *([node.module] if node.module else [])])


def _module_names(tree: ast.Module) -> set[str]:
    """Names bound at the top level of a module: its imports, functions, classes and globals."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def _local_names(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The owner function's parameters and the names it (or the region) binds."""
    a = fn.args
    names = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
    names |= {x.arg for x in (a.vararg, a.kwarg) if x is not None}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not fn:
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(x.asname or x.name).split(".")[0] for x in node.names}
    return names


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred)):
        node = node.value
    return node


def _store_problems(target: ast.expr, module_names: set[str], local: set[str]) -> list[str]:
    """Why storing into ``target`` changes something outside the function, or ``[]``."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return [why for elt in target.elts for why in _store_problems(elt, module_names, local)]
    if isinstance(target, ast.Starred):
        return _store_problems(target.value, module_names, local)
    if not isinstance(target, (ast.Attribute, ast.Subscript)):
        return []
    root = _root(target)
    if isinstance(root, ast.Name):
        if root.id in module_names and root.id not in local:
            return [f"assigns into {ast.unparse(target)} (monkeypatching the module-level {root.id})"]
        return []
    if isinstance(target, ast.Attribute):
        return [f"sets the attribute {ast.unparse(target)} of something other than a local object"]
    return []


def _refusals(nodes: Iterable[ast.AST], path: str, module_names: set[str], local: set[str]) -> list[str]:
    out: list[str] = []
    for top in nodes:
        called = {id(n.func) for n in ast.walk(top) if isinstance(n, ast.Call)}
        for node in ast.walk(top):
            line = getattr(node, "lineno", "?")
            if isinstance(node, ast.Name) and node.id in ("getattr", "hasattr") and id(node) not in called:
                out.append(f"line {line}: {node.id} passed around (only a direct call is checked)")
            if isinstance(node, ast.Import):
                out += [f"line {line}: imports {a.name}" for a in node.names if _module_refused(a.name)]
            elif isinstance(node, ast.ImportFrom):
                module = _resolve(node, path)
                if _module_refused(module) or any(_module_refused(f"{module}.{a.name}") for a in node.names):
                    out.append(f"line {line}: imports from {module or '.'}")
            elif isinstance(node, ast.Name) and node.id in REFUSED_NAMES:
                out.append(f"line {line}: uses {node.id}")
            elif isinstance(node, ast.Attribute) and node.attr in REFUSED_ATTRIBUTES:
                out.append(f"line {line}: uses the attribute .{node.attr}")
            elif isinstance(node, (ast.Global, ast.Nonlocal)):
                out.append(f"line {line}: declares {type(node).__name__.lower()} {', '.join(node.names)}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                    "getattr", "hasattr"):
                obj = node.args[0] if node.args else None
                name = node.args[1] if len(node.args) > 1 else None
                if isinstance(name, ast.Constant) and isinstance(name.value, str):
                    if name.value in REFUSED_ATTRIBUTES:
                        out.append(f"line {line}: {node.func.id}(..., {name.value!r})")
                elif not (isinstance(obj, ast.Name) and obj.id in local and obj.id not in module_names):
                    out.append(f"line {line}: {node.func.id} with a computed name on something other than a "
                               "local object")
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                out += [f"line {line}: {why}" for t in targets for why in _store_problems(t, module_names, local)]
    return list(dict.fromkeys(out))


def _owner(tree: ast.Module, region: Region) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The innermost function that starts before the region's BEGIN line."""
    begin = region.begin + 1  # 1-based line of the BEGIN marker
    best = None
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.lineno < begin <= (fn.end_lineno or 0):
            if best is None or fn.lineno > best.lineno:
                best = fn
    return best


def _culprit(text: str, regions: list[Region], live: list[Region], error: SyntaxError) -> Region | None:
    """The live region whose blanking removes ``error`` (or moves it): the one that holds the error's line, else
    the nearest one above it (an unclosed bracket or a missing body is reported on a later line)."""
    at = error.lineno or 0
    holding = [r for r in live if r.begin + 1 < at <= r.end + 1]
    above = sorted((r for r in live if r.end + 1 < at), key=lambda r: -r.begin)
    for r in holding + above:
        try:
            ast.parse(blank_text(text, [x for x in regions if x not in live or x is r]))
            return r
        except SyntaxError as again:
            if (again.lineno, again.msg) != (error.lineno, error.msg):
                return r
    return None


def screen_text(text: str, path: str, regions: list[Region] | None = None) -> dict[str, list[str]]:
    """task id -> why its regions in this file are refused (only refused tasks appear). A file that does not
    parse refuses the task whose region holds the syntax error (blanking it must make the file parse)."""
    regions = scan_text(text, path) if regions is None else regions
    out: dict[str, list[str]] = {}
    live = list(regions)
    while True:
        try:
            tree = ast.parse(blank_text(text, [r for r in regions if r not in live]))
            break
        except SyntaxError as e:
            culprit = _culprit(text, regions, live, e)
            if culprit is None:
                raise ValueError(f"{path}: a syntax error outside every task region ({e.msg}, line {e.lineno})")
            out.setdefault(culprit.task, []).append(f"{culprit.where}: does not parse ({e.msg}, line {e.lineno})")
            live.remove(culprit)
    text_now = blank_text(text, [r for r in regions if r not in live])
    module_names = _module_names(tree)
    # line numbers shift where a region above was blanked; re-scan the text that parsed
    for r in scan_text(text_now, path):
        if r.task in out:
            continue
        owner = _owner(tree, r)
        first, last = r.begin + 2, r.end  # 1-based lines strictly between the markers
        inside = {id(n) for n in ast.walk(owner)} if owner is not None else set()
        statements = [n for n in ast.walk(tree) if isinstance(n, ast.stmt) and first <= n.lineno <= last]
        problems: list[str] = []
        if owner is None or any(id(n) not in inside for n in statements):
            problems.append("code outside the function that holds the region (the markers must stay inside it)")
        else:
            top = [n for n in statements if not any(n is not m and n in ast.walk(m) for m in statements)]
            problems += _refusals(top, path, module_names, _local_names(owner))
        if problems:
            out.setdefault(r.task, []).extend(f"{r.where}: {p}" for p in problems)
    return out


def screen_tree(root: Path) -> dict[str, list[str]]:
    """task id -> why it is refused, over every region of the package under ``root``."""
    out: dict[str, list[str]] = {}
    for path in sorted({r.path for r in scan(root)}):
        for task, why in screen_text((root / path).read_text(encoding="utf-8"), path).items():
            out.setdefault(task, []).extend(why)
    return out


def blank_refused(root: Path, refused: Iterable[str]) -> list[str]:
    """Blank every region of the ``refused`` tasks under ``root`` (a scratch copy), so that no test, of that task
    or another, runs their code. Returns the files changed."""
    refused = set(refused)
    changed = []
    for path in sorted({r.path for r in scan(root) if r.task in refused}):
        text = (root / path).read_text(encoding="utf-8")
        (root / path).write_text(blank_text(text, [r for r in scan_text(text, path) if r.task in refused]),
                                 encoding="utf-8")
        changed.append(path)
    return changed
