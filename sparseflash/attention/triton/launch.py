"""Kernel launches that spend less host time than ``kernel[grid](...)``.

``kernel[grid](*args, **constexprs)`` binds and specialises every argument on every call, and
renders its options to a string for the cache key: 40-80 µs of host time for our kernels of 20-60
arguments on an H100 host's CPU, where a whole forward+backward at S=1024 keeps the GPU busy
for ~0.6 ms (docs/kernels.md, "Host time"). ``Launcher`` goes through Triton once per
specialisation, keeps the compiled kernel it returns, and then launches that kernel directly.
"""

from __future__ import annotations

import os

import torch
from triton.compiler import CompiledKernel
from triton.runtime import driver
from triton.runtime.jit import JITFunction


def interpreting() -> bool:
    """Whether Triton runs kernels under its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class Launcher:
    """Launches one ``@triton.jit`` kernel whose arguments are its tensors first, then its scalars,
    then its constexprs (keyword arguments, with ``num_warps`` and ``num_stages``). Under the
    interpreter (``TRITON_INTERPRET=1``, where the kernel is not a JITFunction) every launch goes
    through Triton."""

    def __init__(self, kernel):
        self.kernel = kernel
        self._direct = isinstance(kernel, JITFunction)
        self._compiled: dict[tuple, tuple[CompiledKernel, tuple]] = {}

    def __call__(self, grid: tuple[int, ...], tensors: tuple[torch.Tensor, ...], scalars: tuple,
                 constexprs: dict) -> None:
        if not self._direct:
            self.kernel[grid](*tensors, *scalars, **constexprs)
            return
        # What Triton specialises on, and more: the device it launches on (the current one, as
        # Triton does), each tensor's dtype and 16-byte alignment, every scalar's exact value (its
        # divisibility by 16 and equality to 1 are specialised) and the constexprs. A new value only
        # costs one launch through Triton, which compiles nothing new where its own specialisation
        # is unchanged.
        key = (driver.active.get_current_device(), tuple(constexprs.items()), scalars,
               *[(t.dtype, t.data_ptr() % 16 == 0) for t in tensors])
        entry = self._compiled.get(key)
        if entry is not None:
            compiled, constexpr_values = entry
            compiled[(*grid, 1, 1)[:3]](*tensors, *scalars, *constexpr_values)  # it takes a 3-D grid only
            return
        compiled = self.kernel[grid](*tensors, *scalars, **constexprs)
        names = self.kernel.arg_names[len(tensors) + len(scalars):]
        self._compiled[key] = compiled, tuple(constexprs[name] for name in names)
