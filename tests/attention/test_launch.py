"""``Launcher``: through Triton once per specialisation, then the compiled kernel directly.

No GPU here: a recording stand-in plays the JIT kernel and the compiled kernel it returns. The GPU
suite (``-m gpu``) runs every real launch through the direct path, and checks that a first call
compiles its kernels ahead, on the launchers' threads.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from sparseflash.attention.triton import launch


class RecordingKernel:
    """``kernel[grid](*args, **kwargs)`` as a JITFunction takes it; every launch lands in ``log``."""

    arg_names = ["X", "Y", "n", "scale", "BLOCK", "FLAG"]

    def __init__(self):
        self.log = []
        self.compile_seconds = {}  # BLOCK -> seconds a compile takes (0.2 by default)
        self.device_caches = {0: "binder"}

    def warmup(self, *args, grid, **kwargs):
        time.sleep(self.compile_seconds.get(kwargs["BLOCK"], 0.2))  # a compile: the launch waits for it
        self.log.append(("warmup", threading.current_thread().name, grid, args, kwargs))

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
    monkeypatch.setattr(launch, "driver", SimpleNamespace(active=SimpleNamespace(get_current_device=lambda: 0,
                                                                                 set_current_device=lambda d: None)))
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


def test_a_launch_waits_for_the_compile_ahead_on_the_launchers_thread(launcher):
    x, y = torch.randn(64), torch.randn(64)
    launcher.compile_ahead((3, 2), (launch.Standin(torch.float32, (64,)), y), (64, 0.5),
                           dict(FLAG=True, num_warps=4, BLOCK=32))
    _launch(launcher, x, y)
    ahead, first = launcher.kernel.log
    assert ahead[0] == "warmup" and ahead[1].startswith("sparseflash-compile")
    assert ahead[2:] == ((3, 2), (ahead[3][0], y, 64, 0.5), dict(FLAG=True, num_warps=4, BLOCK=32))
    assert first[0] == "triton"


def test_compiles_ahead_run_at_once_and_a_launch_waits_for_its_own_only(launcher):
    launcher.kernel.compile_seconds = {16: 2.0, 32: 1.0}
    x, y = torch.randn(64), torch.randn(64)
    standin = launch.Standin(torch.float32, (64,))
    start = time.perf_counter()
    for block in (16, 32, 32):  # the repeat compiles nothing more
        launcher.compile_ahead((3, 2), (standin, y), (64, 0.5), dict(FLAG=True, num_warps=4, BLOCK=block))
    _launch(launcher, x, y, BLOCK=32)
    waited = time.perf_counter() - start
    assert 1.0 <= waited < 1.8, f"compiles ahead of 2 s and 1 s: the launch of the 1 s one waited {waited:.2f} s"
    launcher._compiler.shutdown(wait=True)
    assert [entry[0] for entry in launcher.kernel.log].count("warmup") == 2


def test_a_launch_with_no_compile_ahead_of_its_own_waits_for_those_in_flight(launcher):
    """Its kernel may be the same Triton specialisation (other strides, say): Triton then finds it
    compiled rather than compiling it beside the compile ahead."""
    launcher.kernel.compile_seconds = {32: 1.0}
    x, y = torch.randn(64), torch.randn(64)
    launcher.compile_ahead((3, 2), (launch.Standin(torch.float32, (64,)), y), (64, 0.5),
                           dict(FLAG=True, num_warps=4, BLOCK=32))
    start = time.perf_counter()
    _launch(launcher, x, y, n=48, BLOCK=32)  # another scalar: another key
    assert time.perf_counter() - start >= 0.9
    assert [entry[0] for entry in launcher.kernel.log] == ["warmup", "triton"]
    assert not launcher._ahead  # finished compiles are not kept


def test_a_bound_launch_runs_the_compiled_kernel_on_new_tensors(launcher):
    x, y = torch.randn(64), torch.randn(64)
    _launch(launcher, x, y)
    bound = launcher.bound((3, 2), (x, y), (64, 0.5), dict(FLAG=True, num_warps=4, BLOCK=32))
    x2, y2 = torch.randn(64), torch.randn(64)
    bound((x2, y2))
    assert launcher.kernel.log[-1] == ("direct", (3, 2, 1), (x2, y2, 64, 0.5, 32, True))


def test_no_compile_ahead_where_only_scalars_differ_from_a_launch(launcher):
    """A decoding loop's new key length each step: the kernel is compiled, a compile ahead would only find
    it again on another thread (and the launch wait for that)."""
    x, y = torch.randn(64), torch.randn(64)
    _launch(launcher, x, y, n=64)
    launcher.compile_ahead((3, 2), (launch.Standin(torch.float32, (64,)), y), (65, 0.5),
                           dict(FLAG=True, num_warps=4, BLOCK=32))
    launcher.compile_ahead((3, 2), (launch.Standin(torch.float32, (64,)), y), (65, 0.5),
                           dict(FLAG=True, num_warps=4, BLOCK=64))  # another constexpr: compiled ahead
    launcher._compiler.shutdown(wait=True)
    assert [entry[4]["BLOCK"] for entry in launcher.kernel.log if entry[0] == "warmup"] == [64]


def test_a_launcher_keeps_the_most_recent_launch_keys(launcher, monkeypatch):
    monkeypatch.setattr(launch, "LAUNCH_KEYS_KEPT", 2)
    x, y = torch.randn(64), torch.randn(64)
    for n in (1, 2, 3, 3, 1):
        _launch(launcher, x, y, n=n)
    assert len(launcher._compiled) == 2
    assert [entry[0] for entry in launcher.kernel.log] == ["triton", "triton", "triton", "direct", "triton"]


@pytest.mark.parametrize("shape", [(3,), (2, 5, 7), (1, 4, 1, 8)], ids=str)
def test_a_standin_has_the_layout_of_a_new_tensor(shape):
    standin, tensor = launch.Standin(torch.bfloat16, shape), torch.empty(shape, dtype=torch.bfloat16)
    assert standin.stride() == tensor.stride()
    assert standin.element_size() == tensor.element_size()
    assert standin.data_ptr() % 16 == 0


@pytest.mark.gpu
@pytest.mark.parametrize("gradient", ["dense", "expanded"])
def test_a_first_call_compiles_forward_and_backward_on_the_compile_threads(gradient):
    import triton

    import sparseflash

    threads = []

    def record(src, **kwargs):
        threads.append((threading.current_thread().name, src.fn.__name__, sorted(src.attrs.items())))

    salt = float(torch.randint(1, 10**6, ()).item())  # a new score function: kernels not compiled in this process

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + (q_idx - kv_idx) / salt

    q, k, v = (torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    previous = triton.knobs.compilation.listener  # told of every compile, a hit in Triton's disk cache too
    triton.knobs.compilation.listener = record
    try:
        o = sparseflash.attention(q, k, v, "causal", score_mod=score_mod)
        # as a model's gradients come (dense), or o.sum()'s (expanded, strides 0: read from a dense copy)
        o.backward(torch.randn_like(o) if gradient == "dense" else torch.ones(()).to(o).expand_as(o))
    finally:
        triton.knobs.compilation.listener = previous
    # new with the function: the forward, and the backward's dK/dV and dQ kernels (the preprocess depends on
    # no function, so an earlier test in this process may have compiled it)
    kernels = [kernel for _, kernel, _ in threads]
    assert sum(kernel.startswith("_attn_fwd") for kernel in kernels) == 1 and kernels.count("_attn_bwd") == 2, threads
    backward_threads = {name for name, kernel, _ in threads if kernel == "_attn_bwd"}
    assert len(backward_threads) == 2, f"dK/dV and dQ did not compile at once: {threads}"
    elsewhere = [entry for entry in threads if not entry[0].startswith("sparseflash-compile")]
    assert not elsewhere, f"compiled on the calling threads: {elsewhere}; ahead: {len(threads) - len(elsewhere)}"
    assert torch.isfinite(q.grad).all()


def test_a_plan_keeps_a_bounded_number_of_mods_tables():
    """A score function that captures a tensor made at each call (SparseAttention's key_mask) meets a
    new address at most calls: the plan keeps the latest few tables, each right for its tensor."""
    from sparseflash.attention.triton import codegen, plan
    from sparseflash.masks import make
    from sparseflash.masks.functions import trace

    q, mask = torch.randn(1, 2, 64, 16), make("dense", 64, block=16)
    kept = []
    for _ in range(plan.MODS_TABLES_KEPT + 5):
        bias = torch.randn(64)  # a new tensor, kept alive: a new address every time
        kept.append(bias)
        graph = trace(lambda score, b, h, q_idx, kv_idx: score + bias[kv_idx], "score_mod")
        launch_plan = plan.LaunchPlan.of(q, q, mask, False, 0.25, graph)  # one plan: the graphs are alike
        table = launch_plan.mods_table(launch_plan.captures(graph))
        assert torch.equal(table, codegen.mods_table([bias], [None], q.device))
    assert len(launch_plan._mods_tables) == plan.MODS_TABLES_KEPT
