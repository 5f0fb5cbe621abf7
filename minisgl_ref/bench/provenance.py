"""Where a number came from: the machine, the software and the command behind a benchmark result (chapter 11).

A throughput figure is only worth publishing next to the facts that produced it. Every results file this
project writes carries one :func:`collect_provenance` record:

* the hardware: GPU names, memory and driver when CUDA is used, else the CPU's model name and core count;
* the software: Python, torch (and the CUDA it was built with), transformers, this package;
* the code: the git commit of the checkout, read straight from ``.git`` (no ``git`` process is started);
* the run: the exact command line, the UTC date, and any settings the caller adds (engine arguments, model).

Every probe is best effort: a fact that cannot be found is recorded as ``None`` rather than failing a benchmark
that took an hour to run. The offline benchmark uses this module today; the GPU benchmarks of later chapters
(online serving, CUDA graphs, tensor parallelism) reuse it so that all results files look alike.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from minisgl_ref import env

#: Distributions whose versions every results file records (missing ones are recorded as ``None``).
PACKAGES = ("minisgl_ref", "torch", "transformers", "tokenizers", "safetensors", "numpy",
            "triton", "flashinfer-python", "flash-attn")


def package_version(name: str) -> str | None:
    """The installed version of distribution ``name``, or ``None`` if it is not installed. This package counts
    as installed also when it is imported from a plain checkout (its ``__version__``)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        if name == "minisgl_ref":
            import minisgl_ref

            return minisgl_ref.__version__
        return None


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    return {name: package_version(name) for name in names}


# ------------------------------------------------------------------------------------------------ hardware


def cpu_name() -> str:
    """The CPU's marketing name (``model name`` in ``/proc/cpuinfo`` on Linux), else what :mod:`platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def nvidia_driver_version() -> str | None:
    """The NVIDIA driver version, from ``nvidia-smi`` (torch knows the CUDA runtime, not the driver)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    versions = sorted({line.strip() for line in out.splitlines() if line.strip()})
    return ", ".join(versions) or None


def gpu_info() -> list[dict[str, Any]]:
    """One record per visible CUDA device (empty without CUDA): name, memory, compute capability, SM count."""
    if not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        gpus.append({"index": i, "name": props.name, "memory_gib": round(props.total_memory / 2**30, 2),
                     "compute_capability": f"{props.major}.{props.minor}",
                     "multiprocessors": props.multi_processor_count})
    return gpus


def hardware() -> dict[str, Any]:
    """The machine: CPU always (the scheduler runs there), GPUs and driver when CUDA is available."""
    gpus = gpu_info()
    return {
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpus": gpus,
        "gpu": gpus[0]["name"] if gpus else None,
        "nvidia_driver": nvidia_driver_version() if gpus else None,
        "cuda_runtime": torch.version.cuda,
    }


# ------------------------------------------------------------------------------------------------ software


def find_git_dir(start: Path | None = None) -> Path | None:
    """The ``.git`` directory of the checkout that contains ``start`` (default: this package), if any.

    A ``.git`` *file* (worktrees, submodules) holds ``gitdir: <path>``; it is followed."""
    here = (start or Path(__file__)).resolve()
    for folder in (here, *here.parents):
        dot_git = folder / ".git"
        if dot_git.is_dir():
            return dot_git
        if dot_git.is_file():
            text = dot_git.read_text().strip()
            if text.startswith("gitdir:"):
                target = Path(text.split(":", 1)[1].strip())
                return target if target.is_absolute() else (folder / target).resolve()
    return None


def _resolve_ref(git_dir: Path, ref: str) -> str | None:
    """The commit a ref such as ``refs/heads/main`` points at: a loose ref file, else ``packed-refs``."""
    for base in (git_dir, _common_dir(git_dir)):
        loose = base / ref
        if loose.is_file():
            return loose.read_text().strip()
        packed = base / "packed-refs"
        if packed.is_file():
            for line in packed.read_text().splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[1] == ref:
                    return parts[0]
    return None


def _common_dir(git_dir: Path) -> Path:
    """A worktree's git dir keeps branch refs in the main repository's; ``commondir`` says where that is."""
    common = git_dir / "commondir"
    if common.is_file():
        return (git_dir / common.read_text().strip()).resolve()
    return git_dir


def git_commit(start: Path | None = None) -> str | None:
    """The checked-out commit (40 hex digits), read from the files under ``.git``; ``None`` outside a checkout
    or before the first commit. ``MINISGL_GIT_COMMIT``, when set, wins: a copy of the working tree on another
    machine may carry a stale ``.git``. Uncommitted changes are not detected: commit before publishing numbers."""
    pinned = env.pinned_git_commit()
    if pinned:  # given explicitly, e.g. on a machine that received the working tree but not a current .git
        return pinned
    git_dir = find_git_dir(start)
    if git_dir is None:
        return None
    try:
        head = (git_dir / "HEAD").read_text().strip()
        if head.startswith("ref:"):
            return _resolve_ref(git_dir, head.split(":", 1)[1].strip())
        return head or None  # a detached HEAD holds the commit itself
    except OSError:
        return None


def software() -> dict[str, Any]:
    """Interpreter, packages and commit. ``torch`` is torch's own version string, which names its build
    (``2.11.0+cu130``); the distribution's metadata (under ``packages``) does not always."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "packages": package_versions(),
        "git_commit": git_commit(),
    }


# ------------------------------------------------------------------------------------------------- the run


def command_line(argv: list[str] | None = None) -> str:
    """The command as the user typed it: ``python -m minisgl_ref bench offline ...`` when run as a module."""
    argv = list(sys.argv if argv is None else argv)
    if argv and Path(argv[0]).name == "__main__.py" and Path(argv[0]).parent.name == "minisgl_ref":
        argv = ["python", "-m", "minisgl_ref", *argv[1:]]
    return shlex.join(argv)


def collect_provenance(argv: list[str] | None = None, **settings: Any) -> dict[str, Any]:
    """Everything needed to interpret (and re-run) a benchmark result, as a JSON-ready dict.

    ``argv`` defaults to ``sys.argv``; keyword ``settings`` (engine arguments, model, workload...) are stored
    as given under ``settings``."""
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(argv),
        "argv": list(sys.argv if argv is None else argv),
        "cwd": os.getcwd(),
        "executable": sys.executable,
        "hardware": hardware(),
        "software": software(),
        "settings": settings,
    }
