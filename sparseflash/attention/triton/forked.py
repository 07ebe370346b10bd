"""Work done in a child process forked from the calling thread, waited for through a ``Future``.

A first call compiles its kernels ahead, several at once. On threads they took turns: the Python front
end of a Triton compile holds the GIL, so the compiles slowed each other and stalled the calling
thread's own launches (30-120 ms each while a kernel compiled beside them; docs/kernels.md, "The first
call"). A forked child starts in milliseconds with every module imported and every kernel hashed,
compiles on a core of its own, and leaves its kernel in Triton's disk cache, where the launch that needs
it finds it.

The child is forked from the thread that launches kernels and only compiles: it never touches CUDA
(which cannot run in a forked child) and takes no lock that the parent's other threads may have held
at the fork; a child that hangs regardless is killed after ``wait``'s timeout.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time
import warnings
from concurrent.futures import Future, TimeoutError
from typing import Callable


class ChildFailed(RuntimeError):
    """A child's task raised, or the child died or was killed."""


class Child(Future):
    """A ``Future`` of a forked child: None once the child's task returned, else ``ChildFailed``; ``started``:
    when it was forked (``time.monotonic()``)."""

    def __init__(self, pid: int):
        super().__init__()
        self.pid = pid
        self.started = time.monotonic()


# The children not yet reaped, for ``wait_all``: added by ``start``, taken out by the thread that waits on each
# child's pipe once its future is resolved
_IN_FLIGHT: set[Child] = set()
_IN_FLIGHT_LOCK = threading.Lock()


def available() -> bool:
    """Whether this platform forks (not Windows)."""
    return hasattr(os, "fork")


def start(task: Callable[[], object]) -> Child | None:
    """Run ``task()`` in a child forked from the calling thread; None where the fork fails (no memory for
    the child's page tables, say). Nothing ``task`` returns or prints reaches the parent: it works through
    files (a compile writes Triton's cache). The future resolves as the task ends, before the child's exit
    (which unmaps the parent's address space, CUDA's included: tens of milliseconds)."""
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        # "This process is multi-threaded, use of fork() may lead to deadlocks in the child": the child
        # only compiles (module docstring)
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            pid = os.fork()
        except OSError:
            os.close(read_end)
            os.close(write_end)
            return None
    if pid == 0:  # the child: never returns to the caller's code, never runs its exit handlers
        # A collection would walk every object of the parent's heap, writing to each: copying the pages
        # the child shares with the parent. The task is short; what it leaves goes with the child.
        gc.disable()
        # The parent's streams may be objects that need its threads (a notebook's, sent by a thread of
        # the kernel); whatever the task would print, the parent reports when it repeats the work.
        sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (closed by the exit)
        done = b"1"
        try:
            task()
            done = b"0"
        except BaseException:  # noqa: BLE001 (the parent repeats the work, where it reports the error)
            pass
        finally:
            os.write(write_end, done)
            os._exit(0)
    os.close(write_end)
    child = Child(pid)
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT.add(child)
    threading.Thread(target=_reap, args=(child, read_end), name="sparseflash-child-wait", daemon=True).start()
    return child


def _reap(child: Child, read_end: int) -> None:
    with os.fdopen(read_end, "rb") as pipe:
        done = pipe.read(1)  # b"" where the child died first
    if done == b"0":
        child.set_result(None)
    _, status = os.waitpid(child.pid, 0)
    if done != b"0":
        child.set_exception(ChildFailed(f"child {child.pid} failed (exit status {os.waitstatus_to_exitcode(status)})"))
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT.discard(child)


def wait(child: Child, timeout: float) -> bool:
    """Wait for ``child``'s task to end, killing the child after ``timeout`` seconds; whether the task
    returned."""
    try:
        return child.exception(timeout) is None
    except TimeoutError:
        try:
            os.kill(child.pid, signal.SIGKILL)
        except ProcessLookupError:  # it exited just now
            pass
        return child.exception() is None


def wait_all(timeout: float) -> bool:
    """Wait for the task of every child started so far to end, ``timeout`` seconds at most in all (a child still
    running then is left to the ``wait`` of the launch that needs its work); whether all ended."""
    deadline = time.monotonic() + timeout
    with _IN_FLIGHT_LOCK:
        children = list(_IN_FLIGHT)
    for child in children:
        try:
            child.exception(max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return False
    return True
