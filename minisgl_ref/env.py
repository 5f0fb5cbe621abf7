"""Every environment variable the package reads, in one place (the bottom floor: it imports nothing of ours).

========================== ==================================================================================
``MINISGL_FUSED=0``        turn off the fused FlashInfer/Triton kernels of ``perf/`` (read once per process)
``MINISGL_THREADS``        intra-op threads of a CPU engine process (wins over ``OMP_NUM_THREADS``)
``OMP_NUM_THREADS``        the usual OpenMP override, honoured by :func:`cpu_threads` as well
``MINISGL_REF_CACHE``      where the embedded model is unpacked (else ``$XDG_CACHE_HOME/minisgl_ref``)
``MINISGL_SHUTDOWN_TRACE_S`` print every thread's stack if a rank's teardown still runs this many seconds later
``MINISGL_DEAD_CHILD_GRACE_S`` how long a server whose child died keeps answering 503 before it exits
``MINISGL_GIT_COMMIT``     the commit benchmark reports name, when the checkout's ``.git`` is missing or stale
``TRITON_INTERPRET=1``     Triton's CPU interpreter (lets the ``triton`` attention backend run on a CPU, slowly)
``MINISGL_FOLD_NORMS=0``   do not fold the RMSNorm weights into the next matmuls (chapter 11)
``TORCH_EXTENSIONS_DIR``   where PyTorch builds C++/CUDA extensions (our split-KV decode kernel among them)
``TRITON_CACHE_DIR``, ``TORCHINDUCTOR_CACHE_DIR``, ``FLASHINFER_WORKSPACE_BASE``
                           the compilers' own cache folders, read (never set) to count what a run compiled
========================== ==================================================================================
"""

from __future__ import annotations

import os
from pathlib import Path


def _get(name: str) -> str | None:
    return os.environ.get(name) or None


def fused_kernels_enabled() -> bool:
    return os.environ.get("MINISGL_FUSED", "1") != "0"


def chapter_threads() -> int:
    """Torch threads of a chapter's notebook or script (:func:`minisgl_ref.book.setup_chapter`):
    ``MINISGL_THREADS``, else one."""
    return int(_get("MINISGL_THREADS") or 1)


def cpu_threads(ranks: int = 1, spare: int = 0) -> int:
    """Intra-op threads for one of ``ranks`` CPU engine processes that share this machine with ``spare`` cores'
    worth of other work (the server's API process and detokenizer).

    More threads than cores is the one thing to avoid: OpenMP threads spin at every barrier, waiting for a
    sibling the OS has descheduled (on a busy 2-core machine, 2 threads decode ~6x slower than 1). So each rank
    takes an equal share of the cores this process may run on; ``MINISGL_THREADS`` or ``OMP_NUM_THREADS``
    overrides the share."""
    explicit = _get("MINISGL_THREADS") or _get("OMP_NUM_THREADS")
    if explicit:
        return int(explicit)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(1, (cores - spare) // ranks)


def model_cache_root() -> Path:
    """``$MINISGL_REF_CACHE``, else ``$XDG_CACHE_HOME/minisgl_ref``, else ``~/.cache/minisgl_ref``."""
    pinned = _get("MINISGL_REF_CACHE")
    if pinned:
        return Path(pinned)
    return Path(_get("XDG_CACHE_HOME") or Path.home() / ".cache") / "minisgl_ref"


def shutdown_trace_s() -> float:
    return float(_get("MINISGL_SHUTDOWN_TRACE_S") or 0)


def dead_child_grace_s() -> float:
    return float(_get("MINISGL_DEAD_CHILD_GRACE_S") or 2.0)


def pinned_git_commit() -> str | None:
    return _get("MINISGL_GIT_COMMIT")


def triton_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def fold_norms_enabled() -> bool:
    return os.environ.get("MINISGL_FOLD_NORMS", "1") != "0"


def torch_extensions_dir() -> str | None:
    return _get("TORCH_EXTENSIONS_DIR")


def kernel_cache_dirs() -> dict[str, Path]:
    """Where Triton, Inductor and FlashInfer keep the kernels they compiled (their defaults, or the environment's
    overrides)."""
    import getpass
    import tempfile

    home = Path.home()
    inductor = _get("TORCHINDUCTOR_CACHE_DIR") or str(Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}")
    flashinfer = Path(_get("FLASHINFER_WORKSPACE_BASE") or home) / ".cache" / "flashinfer"
    return {"triton": Path(_get("TRITON_CACHE_DIR") or home / ".triton" / "cache"), "inductor": Path(inductor),
            "flashinfer": flashinfer}
