"""Kernel launches that spend less host time than ``kernel[grid](...)``.

``kernel[grid](*args, **constexprs)`` binds and specialises every argument on every call, and
renders its options to a string for the cache key: 40-80 µs of host time for our kernels of 20-60
arguments on an H100 host's CPU, where a whole forward+backward at S=1024 keeps the GPU busy
for ~0.6 ms (docs/kernels.md, "Host time and the Launcher"). ``Launcher`` goes through Triton once per
specialisation, keeps the compiled kernel it returns, and then launches that kernel past Triton's runner
(``Compiled``), with the tensors' addresses as ints. ``recorded`` collects the launches a thread makes in a
block, which replay.py launches again on later calls.

A kernel's first launch compiles it (seconds on an H100). ``Launcher.compile_ahead`` compiles what
a launch will need in a child process forked for it (forked.py), so that the forward and the
backward kernels of a first call, and several specialisations of one kernel, compile at the same
time on cores of their own; the launch then finds its kernel in Triton's disk cache. Outputs not
allocated yet are given as ``Standin``s.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
import triton
from triton import knobs
from triton.compiler import CompiledKernel
from triton.runtime import driver
from triton.runtime.cache import triton_key
from triton.runtime.jit import JITFunction

from sparseflash.attention.triton import forked


def interpreting() -> bool:
    """Whether Triton runs kernels under its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel_switch(name: str) -> str:
    """An environment variable that turns a family of kernels on or off: "auto" (its default: where they were
    measured faster), "1" (wherever they apply) or "0" (never)."""
    value = os.environ.get(name, "auto")
    if value not in ("auto", "0", "1"):
        raise ValueError(f"{name} must be auto, 0 or 1; got {value!r}")
    return value


def cache_root() -> Path:
    """Where sparseflash keeps what later processes reuse (generated helpers, tuned configs):
    ``$SPARSEFLASH_CACHE_DIR``, default ``~/.cache/sparseflash``."""
    return Path(os.environ.get("SPARSEFLASH_CACHE_DIR", Path.home() / ".cache" / "sparseflash"))


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for the host's grid arithmetic: ``triton.cdiv`` is a constexpr function in
    Triton 3.9, and calling it from Python cost ~4 µs."""
    return -(-a // b)


# How long a launch waits for its compile ahead before it kills the child and compiles itself: a compile
# takes 1-5 s on an H100 host; a child that takes far longer is stuck (forked.py).
AHEAD_TIMEOUT_SECONDS = 300

# Held by a thread while it compiles through Triton, and while it forks a child to compile: a fork made
# while another thread is inside Triton's compiler could leave the child a lock (LLVM's, MLIR's) held by
# a thread that does not exist there, and the child stuck. Launches from several threads are the case:
# autograd's device threads run the backward's.
_COMPILING = threading.Lock()

LAUNCH_KEYS_KEPT = 4096  # launch keys a Launcher keeps, the most recent (a key holds every scalar's value)

INTERPRETER_MULTIPROCESSORS = 3  # what the kernels size their grids by under the interpreter

# A kernel that compiles in seconds has a faster-compiling one stand in for it on a first call (the fused
# backward its two halves, the Gluon forward the Triton forward, the Gluon backward the Triton backward's
# halves), both compiled ahead at once, where the process may use this many CPUs: fewer, and the compiles
# beside the calls would slow them.
STAND_IN_FROM_CPUS = 8


def standing_in(state: dict, compiling: Callable[[object], bool]):
    """What stands in on this call for a kernel compiling ahead: ``state["stand_in"]``, set by the first call that
    compiled both ahead (the stand-in's launches), while ``compiling(it)`` says that compile is in flight; else
    None. The first call that finds the compile ended (compiled, or failed: the launch then compiles and reports)
    ends the standing in, for every layout of the plan that keeps ``state``. None while a CUDA graph is being
    captured: a graph would replay what stands in for good, so the launch waits for its own kernel instead."""
    stand_in = state.get("stand_in")
    if stand_in is None or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return None
    if not compiling(stand_in):
        state.pop("stand_in", None)  # (another thread may have ended it)
        return None
    return stand_in


def run_stand_in(state: dict, launches: Callable[[], None]) -> bool:
    """Run ``launches``, the launches of what stands in on this call (``standing_in(state, ...)``): True. Where one
    does not fit the GPU (``OutOfResources``: its config was chosen for a lighter variant of the plan's key), the
    standing in ends for every layout of the plan that keeps ``state``, and the call is to run the kernel stood in
    for: False (its outputs are then written again in full)."""
    try:
        launches()
    except triton.runtime.errors.OutOfResources:
        state.pop("stand_in", None)
        return False
    return True


def usable_cpus() -> int:
    """The CPUs this process may run on (a batch job's share of a node, where the scheduler pins it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    """The GPU's multiprocessors (programs that run at once, for grids sized by it)."""
    if device.type != "cuda":
        return INTERPRETER_MULTIPROCESSORS
    return torch.cuda.get_device_properties(device).multi_processor_count


GLUON_TRITON = (3, 6)  # the first Triton whose Gluon has the Hopper API the Gluon kernels use


def gluon_hopper(device: torch.device) -> bool:
    """Whether the Gluon kernels (forward_gluon.py, backward_gluon.py) run on ``device``: a Hopper GPU
    (capability 9.x) with Triton >= 3.6; never under the interpreter, which does not run Gluon."""
    return device.type == "cuda" and not interpreting() and _gluon_hopper(device)


@functools.lru_cache(maxsize=None)
def _gluon_hopper(device: torch.device) -> bool:
    version = tuple(int(part) for part in triton.__version__.split("+")[0].split(".")[:2])
    return version >= GLUON_TRITON and torch.cuda.get_device_capability(device)[0] == 9


class Standin:
    """An output tensor that is not allocated yet, as far as compiling a kernel that takes it needs:
    its dtype, shape and contiguous strides, and an address as aligned as torch's allocations."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...]):
        self.dtype, self.shape = dtype, tuple(shape)

    def stride(self, dim: int | None = None) -> tuple[int, ...] | int:
        strides = tuple(math.prod(self.shape[i + 1:]) for i in range(len(self.shape)))
        return strides if dim is None else strides[dim]

    def element_size(self) -> int:
        return self.dtype.itemsize

    @staticmethod
    def data_ptr() -> int:
        return 0


# The launches that a thread's ``recorded`` block collects (``replay.py``).
_recordings = threading.local()


@contextlib.contextmanager
def recorded() -> Iterator[list]:
    """``with recorded() as launches:`` collects the launches of every ``Launcher`` this thread makes while the
    block is open, in order: ``(Compiled, grid, tensors, scalars)``, or None for a launch through Triton's
    interpreter."""
    outer = getattr(_recordings, "launches", None)
    _recordings.launches = launches = []
    try:
        yield launches
    finally:
        _recordings.launches = outer


class Launcher:
    """Launches one ``@triton.jit`` kernel whose arguments are its tensors first, then its scalars,
    then its constexprs (keyword arguments, with ``num_warps`` and ``num_stages``). Under the
    interpreter (``TRITON_INTERPRET=1``, where the kernel is not a JITFunction) every launch goes
    through Triton."""

    def __init__(self, kernel, scratch: Callable | None = None):
        """``scratch``: for a kernel that takes global scratch (where it builds TMA descriptors), Triton's allocator of
        it (``triton.set_allocator``), set for its launches only."""
        self.kernel, self.scratch = kernel, scratch
        self._direct = isinstance(kernel, JITFunction)
        self._compiled: dict[tuple, Compiled] = {}
        self._variants: set[tuple] = set()  # the keys of _compiled without their scalars (_variant)
        self._ahead: dict[tuple, forked.Child] = {}  # compiles ahead, by the key of the launch they serve

    @staticmethod
    def _key(tensors: tuple, scalars: tuple, constexprs: dict) -> tuple:
        # What Triton specialises on, and more: the device it launches on (the current one, as
        # Triton does), each tensor's dtype and 16-byte alignment, every scalar's exact value (its
        # divisibility by 16 and equality to 1 are specialised) and the constexprs. A new value only
        # costs one launch through Triton, which compiles nothing new where its own specialisation
        # is unchanged.
        return (driver.active.get_current_device(), tuple(constexprs.items()), scalars,
                *[(t.dtype, t.data_ptr() % 16 == 0) if isinstance(t, torch.Tensor) else Launcher._tensor_key(t)
                  for t in tensors])

    @staticmethod
    def _tensor_key(t) -> tuple:
        """What ``_key`` keeps of a tensor argument that is not a torch tensor: a ``Standin``'s dtype and
        alignment, as a tensor's; a TMA descriptor's (Gluon's TensorDescriptor, whose ``base`` is the
        tensor it reads) dtype, box and shared-memory layout: the kernel is specialised on those, its
        shape and strides are arguments."""
        base = getattr(t, "base", None)
        if base is not None:
            return base.dtype, tuple(t.block_shape), t.layout
        return t.dtype, t.data_ptr() % 16 == 0

    @staticmethod
    def _variant(key: tuple) -> tuple:
        """``key`` without the scalars' values: launches that differ only there (a decoding loop's growing
        key length) are mostly one Triton specialisation, which a compile ahead would only look up again."""
        return key[:2] + key[3:]

    def __call__(self, grid: tuple[int, ...], tensors: tuple[torch.Tensor, ...], scalars: tuple,
                 constexprs: dict) -> None:
        if not self._direct:
            with_scratch(self.scratch, lambda: self.kernel[grid](*tensors, *scalars, **constexprs))
            compiled = None
        else:
            key = self._key(tensors, scalars, constexprs)
            compiled = self._compiled.get(key)
            if compiled is None:
                compiled = self._compile(key, grid, tensors, scalars, constexprs)
            else:
                compiled(grid, tensors, scalars)
        launches = getattr(_recordings, "launches", None)
        if launches is not None:
            launches.append(None if compiled is None else (compiled, grid, tensors, scalars))

    def _compile(self, key: tuple, grid: tuple[int, ...], tensors: tuple, scalars: tuple,
                 constexprs: dict) -> Compiled:
        """Launch through Triton, which compiles the kernel or finds it in its cache, and keep it under ``key``."""
        # Wait for the compile ahead made for this launch, or, where there is none, for every one in
        # flight: a launch whose strides differ from the stand-ins' (a model's gradient out of a
        # rearrange) is often the same Triton specialisation, which Triton then finds in its cache instead
        # of compiling it beside the compile ahead. A compile that failed is repeated below, and reports.
        ahead = self._ahead.pop(key, None)
        for child in [ahead] if ahead is not None else list(self._ahead.values()):
            forked.wait(child, AHEAD_TIMEOUT_SECONDS)
        # (those that failed go: their launch compiles through Triton; those that succeeded stay: a compile ahead
        # asked for again starts nothing)
        self._ahead = {k: child for k, child in self._ahead.items() if not child.done() or child.exception() is None}
        with _COMPILING:
            kernel = with_scratch(self.scratch, lambda: self.kernel[grid](*tensors, *scalars, **constexprs))
        names = self.kernel.arg_names[len(tensors) + len(scalars):]
        if len(self._compiled) >= LAUNCH_KEYS_KEPT:  # the oldest goes (a new length each step would grow it
            del self._compiled[next(iter(self._compiled))]  # without end); it costs a launch through Triton
        compiled = self._compiled[key] = Compiled(kernel, tuple(constexprs[name] for name in names), self.scratch)
        self._variants.add(self._variant(key))
        return compiled

    def bound(self, grid: tuple[int, ...], tensors: tuple, scalars: tuple, constexprs: dict):
        """After a launch with these arguments: ``launch(tensors)``, which launches the same compiled kernel
        with the same grid, scalars and constexprs on other tensors without looking it up, for tensors of
        the dtypes and 16-byte alignment of ``tensors`` (the caller sees to it); None under the interpreter."""
        if not self._direct:
            return None
        compiled = self._compiled[self._key(tensors, scalars, constexprs)]
        return functools.partial(compiled, grid, scalars=scalars)

    def compiling(self, grid: tuple[int, ...], tensors: tuple, scalars: tuple, constexprs: dict) -> bool:
        """Whether a compile ahead for a launch with these arguments is in flight (a launch now would wait for
        it): what a faster kernel standing in for this one waits on. False where none was started (a compiled
        kernel, a launch differing only in its scalars, no fork), once it has ended, failed or not, and once it
        has run AHEAD_TIMEOUT_SECONDS (a child that hangs: the launch then waits as long again and kills it)."""
        if not self._direct:
            return False
        ahead = self._ahead.get(self._key(tensors, scalars, constexprs))
        return ahead is not None and not ahead.done() and time.monotonic() - ahead.started < AHEAD_TIMEOUT_SECONDS

    def compile_ahead(self, grid: tuple[int, ...], tensors: tuple, scalars: tuple, constexprs: dict) -> None:
        """Start compiling, in a child process, the kernel that a launch with these arguments needs
        (``tensors`` may hold ``Standin``s), unless it is compiled or compiling. The launch waits for it;
        a compile that fails is left for the launch to repeat and report."""
        if not self._direct or not forked.available():
            return
        key = self._key(tensors, scalars, constexprs)
        if key in self._compiled or key in self._ahead or self._variant(key) in self._variants:
            return
        # What each child would compute again, or cannot: the hashes of the kernel and of the functions it
        # takes, the kernel's per-device binder (Triton makes it from the current target: a CUDA call), the
        # current device and target.
        for fn in (self.kernel, *constexprs.values()):
            if isinstance(fn, JITFunction):
                fn.cache_key  # noqa: B018 (computed and kept by the property)
        triton_key()  # Triton's own hash, in every cache key: done by then on the warm-up thread, mostly
        device = driver.active.get_current_device()
        self.kernel.device_caches[device]  # noqa: B018 (made and kept by the defaultdict)
        in_child = _ChildDriver(driver.active, device, driver.active.get_current_target())

        def compile_in_child():
            driver.set_active(in_child)
            compiled = self.kernel.warmup(*tensors, *scalars, grid=grid, **constexprs)
            # its launch stub, a C compile that Triton caches (0.3-0.5 s on an H100 host) and the launch
            # would build otherwise
            in_child.launcher_cls(compiled.src, compiled.metadata)

        with _COMPILING:
            child = forked.start(compile_in_child)
        if child is not None:
            self._ahead[key] = child


def launch_hooks_set() -> bool:
    """Whether Triton's launch hooks are set (a profiler such as Proton sets them): launches then go through
    Triton's runner, which calls them. (Triton 3.6-3.9 keep them in a ``HookChain``, empty by default; older ones
    as a function or None.)"""
    return any(getattr(hook, "calls", hook) for hook in (knobs.runtime.launch_enter_hook,
                                                        knobs.runtime.launch_exit_hook))


class Compiled:
    """A compiled kernel and the values of its constexprs, launched past Triton's runner: the runner builds the
    launch's metadata and calls the (empty) launch hooks on every launch, and its launcher, given a tensor, asks
    CUDA for the attributes of its address (``cuPointerGetAttribute``), a driver call per tensor argument; given
    the address as an int, it takes it as it is (docs/kernels.md, "Host time and the Launcher")."""

    def __init__(self, kernel: CompiledKernel, constexpr_values: tuple, scratch: Callable | None = None):
        kernel._init_handles()  # (done by the launch that compiled it; loads the module where not)
        self.kernel, self.constexpr_values, self.scratch = kernel, constexpr_values, scratch
        self.run, self.function, self.metadata = kernel.run, kernel.function, kernel.packed_metadata

    def __call__(self, grid: tuple[int, ...], tensors: tuple, scalars: tuple) -> None:
        grid = (*grid, 1, 1)[:3]  # it takes a 3-D grid only
        if launch_hooks_set():
            with_scratch(self.scratch, lambda: self.kernel[grid](*tensors, *scalars, *self.constexpr_values))
            return
        # (a tensor's address as an int; a TMA descriptor as it is, which Triton's launcher encodes)
        self.launch(grid, current_stream(), [t.data_ptr() if isinstance(t, torch.Tensor) else t for t in tensors],
                    scalars)

    def launch(self, grid: tuple[int, int, int], stream: int, addresses: list, scalars: tuple) -> None:
        """Launch on ``stream`` with the tensor arguments' ``addresses`` (ints, or TMA descriptors) and ``scalars``,
        calling no launch hooks."""
        with_scratch(self.scratch, lambda: self.run(*grid, stream, self.function, self.metadata, None, None, None,
                                                    *addresses, *scalars, *self.constexpr_values))


def with_scratch(scratch: Callable | None, launch: Callable[[], object]):
    """``launch()``, with Triton's allocator of global scratch set to ``scratch`` (where not None) in a copy of the
    caller's context: an allocator the caller set stays."""
    if scratch is None:
        return launch()

    def run():
        triton.set_allocator(scratch)
        return launch()

    return contextvars.copy_context().run(run)


def current_device() -> int:
    """The current CUDA device, which Triton's runner launches on."""
    return driver.active.get_current_device()


def current_stream(device: int | None = None) -> int:
    """The current CUDA stream of ``device`` (default: the current device), as Triton's runner launches on it."""
    return driver.active.get_current_stream(current_device() if device is None else device)


class _ChildDriver:
    """Triton's driver as a forked child compiles under it: the parent's, with the current device, stream
    and target fixed, which Triton would ask CUDA (through torch) for."""

    def __init__(self, parent, device: int, target):
        self._parent, self._device, self._target = parent, device, target

    def get_current_device(self) -> int:
        return self._device

    def get_current_stream(self, device: int | None = None) -> int:
        return 0  # a compile launches nothing

    def get_current_target(self):
        return self._target

    def __getattr__(self, name: str):
        return getattr(self._parent, name)
