"""The warm-up that ``import sparseflash`` starts with a CUDA build of torch: Triton's compiler hash,
computed on a thread of its own before a first call needs it."""

from __future__ import annotations

import pytest
import torch
from triton.runtime.cache import triton_key

from sparseflash.attention import warm_up


@pytest.fixture
def cuda_build(monkeypatch):
    """A process as with a CUDA build of torch outside the interpreter, Triton's compiler hash not computed."""
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("SPARSEFLASH_WARM_UP", raising=False)
    triton_key.cache_clear()
    yield
    triton_key.cache_clear()


def test_the_warm_up_computes_the_compiler_hash_that_later_compiles_look_up(cuda_build):
    thread = warm_up.start()
    assert thread is not None and thread.name == "sparseflash-warm-up" and not thread.daemon
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert triton_key.cache_info().currsize == 1, "the compiler hash was not computed"
    hits = triton_key.cache_info().hits
    assert isinstance(triton_key(), str) and triton_key.cache_info().hits == hits + 1


@pytest.mark.parametrize("env", [{"SPARSEFLASH_WARM_UP": "0"}, {"TRITON_INTERPRET": "1"}],
                         ids=["turned-off", "interpreter"])
def test_no_warm_up_when_turned_off_or_under_the_interpreter(cuda_build, monkeypatch, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert warm_up.start() is None
    assert triton_key.cache_info().currsize == 0


def test_no_warm_up_with_a_torch_built_without_cuda(cuda_build, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    assert warm_up.start() is None
    assert triton_key.cache_info().currsize == 0


@pytest.mark.parametrize("outcome", ["built", "no-cuda-driver"])
def test_the_warm_up_builds_tritons_cuda_helpers_and_survives_a_machine_without_them(cuda_build, monkeypatch,
                                                                                      outcome):
    from triton.backends.nvidia import driver

    built = []

    class RecordingUtils:
        def __init__(self):
            built.append(True)
            if outcome == "no-cuda-driver":
                raise AssertionError("libcuda.so cannot found!")  # Triton's words where the library is missing

    monkeypatch.setattr(driver, "CudaUtils", RecordingUtils)
    failures = []
    monkeypatch.setattr("threading.excepthook", failures.append)
    thread = warm_up.start()
    thread.join(timeout=120)
    assert built == [True] and not failures
    assert triton_key.cache_info().currsize == 1
