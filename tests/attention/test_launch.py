"""``Launcher``: through Triton once per specialisation, then the compiled kernel directly.

No GPU here: a recording stand-in plays the JIT kernel and the compiled kernel it returns. The GPU
suite (``-m gpu``) runs every real launch through the direct path.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sparseflash.attention.triton import launch


class RecordingKernel:
    """``kernel[grid](*args, **kwargs)`` as a JITFunction takes it; every launch lands in ``log``."""

    arg_names = ["X", "Y", "n", "scale", "BLOCK", "FLAG"]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def through_triton(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            return RecordingCompiled(self.log)
        return through_triton


class RecordingCompiled:
    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("direct", grid, args))


@pytest.fixture
def launcher(monkeypatch):
    monkeypatch.setattr(launch, "driver", SimpleNamespace(active=SimpleNamespace(get_current_device=lambda: 0)))
    out = launch.Launcher(RecordingKernel())
    out._direct = True  # the stand-in is no JITFunction
    return out


def _launch(launcher, x, y, n=64, scale=0.5, **constexprs):
    launcher((3, 2), (x, y), (n, scale), dict(FLAG=constexprs.get("FLAG", True), num_warps=4,
                                              BLOCK=constexprs.get("BLOCK", 32)))


def test_second_launch_goes_direct_with_constexprs_in_signature_order(launcher):
    x, y = torch.randn(64), torch.randn(64)
    _launch(launcher, x, y)
    _launch(launcher, x, y)
    first, second = launcher.kernel.log
    assert first == ("triton", (3, 2), (x, y, 64, 0.5), dict(FLAG=True, num_warps=4, BLOCK=32))
    assert second == ("direct", (3, 2, 1), (x, y, 64, 0.5, 32, True))


@pytest.mark.parametrize("change", ["scalar", "float", "misaligned", "dtype", "constexpr"])
def test_a_new_specialisation_goes_through_triton(launcher, change):
    x, y = torch.randn(65), torch.randn(64)
    _launch(launcher, x[:64], y)
    other = {"scalar": dict(n=65), "float": dict(scale=0.25), "constexpr": dict(BLOCK=64)}.get(change, {})
    other_x = {"misaligned": x[1:], "dtype": x[:64].half()}.get(change, x[:64])
    _launch(launcher, other_x, y, **other)
    _launch(launcher, other_x, y, **other)
    assert [entry[0] for entry in launcher.kernel.log] == ["triton", "triton", "direct"]


def test_interpreted_kernels_always_go_through_triton():
    interpreted = launch.Launcher(RecordingKernel())  # not a JITFunction: TRITON_INTERPRET=1
    x, y = torch.randn(64), torch.randn(64)
    for _ in range(2):
        _launch(interpreted, x, y)
    assert [entry[0] for entry in interpreted.kernel.log] == ["triton", "triton"]
