"""Kernel launches that spend less host time than ``kernel[grid](...)``.

``kernel[grid](*args, **constexprs)`` binds and specialises every argument on every call, and
renders its options to a string for the cache key: 40-80 µs of host time for our kernels of 20-60
arguments on an H100 host's CPU, where a whole forward+backward at S=1024 keeps the GPU busy
for ~0.6 ms (docs/kernels.md, "Host time"). ``Launcher`` goes through Triton once per
specialisation, keeps the compiled kernel it returns, and then launches that kernel directly.

A kernel's first launch compiles it (seconds on an H100). ``Launcher.compile_ahead`` compiles what
a launch will need on threads of the launcher's own, so that the forward and the backward kernels
of a first call, and two specialisations of one kernel, compile at the same time instead of one
after the other (they overlap where the GIL is free: Triton's MLIR and LLVM stages, ptxas; its
Python front end takes turns); outputs not allocated yet are given as ``Standin``s.
"""

from __future__ import annotations

import functools
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import triton
from triton.compiler import CompiledKernel
from triton.runtime import driver
from triton.runtime.jit import JITFunction


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


# Compiles ahead of one kernel at once, each on a thread of its launcher: the backward's dK/dV and
# dQ kernels below head_dim 128 (backward.py). One after the other they made a first call ~1.3 s longer.
AHEAD_THREADS = 2

LAUNCH_KEYS_KEPT = 4096  # launch keys a Launcher keeps, the most recent (a key holds every scalar's value)

INTERPRETER_MULTIPROCESSORS = 3  # what the kernels size their grids by under the interpreter


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

    def stride(self) -> tuple[int, ...]:
        return tuple(math.prod(self.shape[i + 1:]) for i in range(len(self.shape)))

    def element_size(self) -> int:
        return self.dtype.itemsize

    @staticmethod
    def data_ptr() -> int:
        return 0


class Launcher:
    """Launches one ``@triton.jit`` kernel whose arguments are its tensors first, then its scalars,
    then its constexprs (keyword arguments, with ``num_warps`` and ``num_stages``). Under the
    interpreter (``TRITON_INTERPRET=1``, where the kernel is not a JITFunction) every launch goes
    through Triton."""

    def __init__(self, kernel):
        self.kernel = kernel
        self._direct = isinstance(kernel, JITFunction)
        self._compiled: dict[tuple, tuple[CompiledKernel, tuple]] = {}
        self._variants: set[tuple] = set()  # the keys of _compiled without their scalars (_variant)
        self._compiler: ThreadPoolExecutor | None = None
        self._ahead: dict[tuple, Future] = {}  # compiles ahead, by the key of the launch they serve

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
            self.kernel[grid](*tensors, *scalars, **constexprs)
            return
        key = self._key(tensors, scalars, constexprs)
        entry = self._compiled.get(key)
        if entry is not None:
            compiled, constexpr_values = entry
            compiled[(*grid, 1, 1)[:3]](*tensors, *scalars, *constexpr_values)  # it takes a 3-D grid only
            return
        # Wait for the compile ahead made for this launch, or, where there is none, for every one in
        # flight: a launch whose strides differ from the stand-ins' (a model's gradient out of a
        # rearrange) is often the same Triton specialisation, which Triton then finds compiled instead of
        # compiling it again beside the compile ahead. A compile that failed is repeated below, and reports.
        ahead = self._ahead.pop(key, None)
        for future in [ahead] if ahead is not None else list(self._ahead.values()):
            future.exception()
        self._ahead = {k: future for k, future in self._ahead.items() if not future.done()}
        compiled = self.kernel[grid](*tensors, *scalars, **constexprs)
        names = self.kernel.arg_names[len(tensors) + len(scalars):]
        if len(self._compiled) >= LAUNCH_KEYS_KEPT:  # the oldest goes (a new length each step would grow it
            del self._compiled[next(iter(self._compiled))]  # without end); it costs a launch through Triton
        self._compiled[key] = compiled, tuple(constexprs[name] for name in names)
        self._variants.add(self._variant(key))

    def bound(self, grid: tuple[int, ...], tensors: tuple, scalars: tuple, constexprs: dict):
        """After a launch with these arguments: ``launch(tensors)``, which launches the same compiled kernel
        with the same grid, scalars and constexprs on other tensors without looking it up, for tensors of
        the dtypes and 16-byte alignment of ``tensors`` (the caller sees to it); None under the interpreter."""
        if not self._direct:
            return None
        compiled, constexpr_values = self._compiled[self._key(tensors, scalars, constexprs)]
        run = compiled[(*grid, 1, 1)[:3]]

        def launch(tensors: tuple) -> None:
            run(*tensors, *scalars, *constexpr_values)

        return launch

    def compile_ahead(self, grid: tuple[int, ...], tensors: tuple, scalars: tuple, constexprs: dict) -> None:
        """Start compiling, on a thread of the launcher's, the kernel that a launch with these arguments
        needs (``tensors`` may hold ``Standin``s), unless it is compiled or compiling. The launch waits for
        it; a compile that fails is left for the launch to repeat and report."""
        if not self._direct:
            return
        key = self._key(tensors, scalars, constexprs)
        if key in self._compiled or key in self._ahead or self._variant(key) in self._variants:
            return
        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(max_workers=AHEAD_THREADS, thread_name_prefix="sparseflash-compile")
        # Triton (3.6) hashes a function and the functions it calls lazily and without a lock: two
        # threads doing it at once can see each other's placeholder and compile under keys that no
        # later launch looks up. Hash here, on the calling thread, before any compile thread runs; and
        # make the kernel's per-device cache here, which two threads could each make and one lose.
        for fn in (self.kernel, *constexprs.values()):
            if isinstance(fn, JITFunction):
                fn.cache_key  # noqa: B018 (computed and kept by the property)
        device = driver.active.get_current_device()  # the thread's own starts at device 0
        self.kernel.device_caches[device]  # noqa: B018 (made and kept by the defaultdict)

        def compile_on_device():
            driver.active.set_current_device(device)
            compiled = self.kernel.warmup(*tensors, *scalars, grid=grid, **constexprs)
            # Loading the module and building the launch stub (a C compile where Triton's cache
            # lacks it) happen at the first launch otherwise: 0.3-0.5 s each on an H100 host.
            getattr(compiled, "_init_handles", lambda: None)()

        self._ahead[key] = self._compiler.submit(compile_on_device)
