"""Work that a process's first kernel launch would otherwise wait for, started in the background when
sparseflash is imported with a CUDA build of torch.

The first compile of a process, whether Triton's cache holds the kernel or not, first hashes Triton's own
compiler (``triton.runtime.cache.triton_key``: its Python sources and its 100+ MB shared library, 0.4 s
on an H100 host). A thread of its own hashes it while the program builds its model, loads data and starts
CUDA, which usually takes longer, so that a first call finds it done: a new process whose kernels are
cached starts in a third to a half of the time. The thread then builds Triton's C helpers for CUDA, which
its driver loads at the first launch: a gcc compile (0.5 s) where Triton's cache lacks them, on a new
machine. It makes no CUDA call (a CUDA driver started before a fork leaves the forked children without
CUDA). Triton itself is imported on the importing thread: a package's modules imported on two threads at
once can meet each other half-initialised (Python then raises an ImportError), and the thread imports
nothing. ``SPARSEFLASH_WARM_UP=0`` turns it off; under
Triton's interpreter (``TRITON_INTERPRET=1``), which compiles nothing, it does not run.
"""

from __future__ import annotations

import os
import threading

import torch


def start() -> threading.Thread | None:
    """Import Triton and start, on a thread, hashing its compiler and building its C helpers for CUDA (not a
    daemon: a process that ends at once waits for it, about a second, rather than killing it mid-hash or
    mid-build). None where it does not run: turned off, under the interpreter, with a torch built without
    CUDA, or without Triton."""
    if os.environ.get("SPARSEFLASH_WARM_UP", "1") == "0" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return None
    if torch.version.cuda is None:
        return None
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        return None
    try:
        from triton.backends.nvidia.driver import CudaUtils
    except ImportError:
        CudaUtils = None  # noqa: N806 (a class, or nothing)
    thread = threading.Thread(target=_warm_up, args=(triton_key, CudaUtils), name="sparseflash-warm-up")
    thread.start()
    return thread


def _warm_up(triton_key, cuda_utils) -> None:
    triton_key()  # its lru_cache keeps the hash
    if cuda_utils is not None:
        try:
            cuda_utils()  # compiled into Triton's cache, where the driver finds it
        except Exception:  # noqa: BLE001 (no CUDA driver library, say: the first launch reports it)
            pass
