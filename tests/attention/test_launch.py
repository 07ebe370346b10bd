"""``Launcher``: through Triton once per specialisation, then the compiled kernel directly; compiles
ahead in forked child processes.

No GPU here: a recording stand-in plays the JIT kernel and the compiled kernel it returns; a compile
ahead is its ``warmup`` run in a forked child, which records itself in a file. The GPU suite (``-m gpu``)
runs every real launch through the direct path, and checks that a first call compiles its kernels
ahead, in child processes.
"""

from __future__ import annotations

import json
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from sparseflash.attention.triton import forked, launch


class RecordingKernel:
    """``kernel[grid](*args, **kwargs)`` as a JITFunction takes it; every launch lands in ``log``, every
    warmup (a compile, in a child process) in a file of ``compiles``."""

    arg_names = ["X", "Y", "n", "scale", "BLOCK", "FLAG"]

    def __init__(self, compiles):
        self.log = []
        self.compiles = compiles
        self.compile_seconds = {}  # BLOCK -> seconds a compile takes (0.2 by default)
        self.failing = set()  # BLOCKs whose compile raises
        self.triton_seconds = 0.0
        self.device_caches = {0: "binder"}

    def warmup(self, *args, grid, **kwargs):
        time.sleep(self.compile_seconds.get(kwargs["BLOCK"], 0.2))  # a compile: the launch waits for it
        if kwargs["BLOCK"] in self.failing:
            raise RuntimeError("a compile error")
        record = dict(pid=os.getpid(), grid=grid, args=[str(a) for a in args], kwargs=kwargs)
        (self.compiles / f"{kwargs['BLOCK']}-{time.perf_counter_ns()}").write_text(json.dumps(record))
        return SimpleNamespace(src="source", metadata="metadata")

    def compiled_ahead(self) -> list[dict]:
        return [json.loads(path.read_text()) for path in sorted(self.compiles.iterdir())]

    def __getitem__(self, grid):
        def through_triton(*args, **kwargs):
            time.sleep(self.triton_seconds)  # a compile in this process, where no compile ahead served
            self.log.append(("triton", grid, args, kwargs))
            return RecordingCompiled(self.log)
        return through_triton


class RecordingCompiled:
    """A compiled kernel as ``launch.Compiled`` takes it: its launcher ``run`` (with the stream, the function and
    metadata, three hook arguments, then the arguments) and Triton's runner ``compiled[grid](*args)``."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, log):
        self.log = log

    def _init_handles(self):
        pass

    def run(self, *args):
        assert args[3:9] == (STREAM, "function", "metadata", None, None, None)
        self.log.append(("direct", args[:3], args[9:]))

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("runner", grid, args))


STREAM = 7  # the current stream, as the stand-in driver gives it


@pytest.fixture
def launcher(monkeypatch, tmp_path):
    stubs = tmp_path / "stubs"
    stubs.mkdir()

    def launcher_cls(src, metadata):  # the launch stub a child builds: recorded as a file
        (stubs / f"{os.getpid()}").write_text(f"{src} {metadata}")

    active = SimpleNamespace(get_current_device=lambda: 0, get_current_target=lambda: "target",
                             get_current_stream=lambda device: STREAM, launcher_cls=launcher_cls)
    monkeypatch.setattr(launch, "driver", SimpleNamespace(active=active, set_active=lambda d: None))
    compiles = tmp_path / "compiles"
    compiles.mkdir()
    out = launch.Launcher(RecordingKernel(compiles))
    out._direct = True  # the stand-in is no JITFunction
    out.stubs, out.y = stubs, torch.randn(64)
    return out


def _ahead(launcher, block=32, n=64):
    launcher.compile_ahead((3, 2), (launch.Standin(torch.float32, (64,)), launcher.y), (n, 0.5),
                           dict(FLAG=True, num_warps=4, BLOCK=block))


def _wait_for_children(launcher):
    for child in list(launcher._ahead.values()):
        child.exception()


def _launch(launcher, x, y, n=64, scale=0.5, **constexprs):
    launcher((3, 2), (x, y), (n, scale), dict(FLAG=constexprs.get("FLAG", True), num_warps=4,
                                              BLOCK=constexprs.get("BLOCK", 32)))


def test_second_launch_goes_direct_with_addresses_and_constexprs_in_signature_order(launcher):
    x, y = torch.randn(64), torch.randn(64)
    _launch(launcher, x, y)
    _launch(launcher, x, y)
    first, second = launcher.kernel.log
    assert first == ("triton", (3, 2), (x, y, 64, 0.5), dict(FLAG=True, num_warps=4, BLOCK=32))
    # the tensors as their addresses: Triton's launcher takes an int as it is (a tensor costs it a CUDA call)
    assert second == ("direct", (3, 2, 1), (x.data_ptr(), y.data_ptr(), 64, 0.5, 32, True))


def test_with_launch_hooks_set_a_launch_goes_through_tritons_runner(launcher):
    import triton

    x, y = torch.randn(64), torch.randn(64)
    _launch(launcher, x, y)
    hook = lambda metadata: None  # noqa: E731 (as a profiler such as Proton adds one)
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        _launch(launcher, x, y)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    _launch(launcher, x, y)
    assert launcher.kernel.log[1:] == [("runner", (3, 2, 1), (x, y, 64, 0.5, 32, True)),
                                       ("direct", (3, 2, 1), (x.data_ptr(), y.data_ptr(), 64, 0.5, 32, True))]


def test_a_recorded_block_collects_this_threads_launches(launcher, tmp_path):
    x, y = torch.randn(64), torch.randn(64)
    interpreted = launch.Launcher(RecordingKernel(tmp_path))  # not a JITFunction: TRITON_INTERPRET=1
    elsewhere = []
    with launch.recorded() as launches:
        _launch(launcher, x, y)  # compiled: recorded with the kernel it compiled
        _launch(launcher, x, y, n=32)
        _launch(interpreted, x, y)
        thread = threading.Thread(target=lambda: elsewhere.append(_launch(launcher, x, y)))
        thread.start()
        thread.join()
    _launch(launcher, x, y)
    (first, grid, tensors, scalars), (second, *_), third = launches
    assert isinstance(first, launch.Compiled) and first is not second and third is None
    assert grid == (3, 2) and tensors == (x, y) and scalars == (64, 0.5) and len(launches) == 3


@pytest.mark.parametrize("change", ["scalar", "float", "misaligned", "dtype", "constexpr"])
def test_a_new_specialisation_goes_through_triton(launcher, change):
    x, y = torch.randn(65), torch.randn(64)
    _launch(launcher, x[:64], y)
    other = {"scalar": dict(n=65), "float": dict(scale=0.25), "constexpr": dict(BLOCK=64)}.get(change, {})
    other_x = {"misaligned": x[1:], "dtype": x[:64].half()}.get(change, x[:64])
    _launch(launcher, other_x, y, **other)
    _launch(launcher, other_x, y, **other)
    assert [entry[0] for entry in launcher.kernel.log] == ["triton", "triton", "direct"]


def test_interpreted_kernels_always_go_through_triton(tmp_path):
    interpreted = launch.Launcher(RecordingKernel(tmp_path))  # not a JITFunction: TRITON_INTERPRET=1
    x, y = torch.randn(64), torch.randn(64)
    for _ in range(2):
        _launch(interpreted, x, y)
    assert [entry[0] for entry in interpreted.kernel.log] == ["triton", "triton"]


def test_a_launch_waits_for_the_compile_ahead_made_in_a_child_process(launcher):
    x = torch.randn(64)
    _ahead(launcher)
    _launch(launcher, x, launcher.y)
    [ahead] = launcher.kernel.compiled_ahead()
    assert ahead["pid"] != os.getpid()
    assert ahead["grid"] == [3, 2] and ahead["args"][1:] == [str(launcher.y), "64", "0.5"]
    assert ahead["kwargs"] == dict(FLAG=True, num_warps=4, BLOCK=32)
    assert (launcher.stubs / str(ahead["pid"])).read_text() == "source metadata"  # its launch stub, built there
    assert [entry[0] for entry in launcher.kernel.log] == ["triton"]  # then found in Triton's cache


def test_compiles_ahead_run_at_once_and_a_launch_waits_for_its_own_only(launcher):
    launcher.kernel.compile_seconds = {16: 3.0, 32: 1.0}
    x = torch.randn(64)
    start = time.perf_counter()
    for block in (16, 32, 32):  # the repeat compiles nothing more
        _ahead(launcher, block)
    assert launcher.compiling((3, 2), (x, launcher.y), (64, 0.5), dict(FLAG=True, num_warps=4, BLOCK=32))
    _launch(launcher, x, launcher.y, BLOCK=32)
    waited = time.perf_counter() - start
    assert 1.0 <= waited < 2.5, f"compiles ahead of 3 s and 1 s: the launch of the 1 s one waited {waited:.2f} s"
    _wait_for_children(launcher)
    assert sorted(ahead["kwargs"]["BLOCK"] for ahead in launcher.kernel.compiled_ahead()) == [16, 32]
    assert not launcher.compiling((3, 2), (x, launcher.y), (64, 0.5), dict(FLAG=True, num_warps=4, BLOCK=16))  # done
    assert not launcher.compiling((3, 2), (x, launcher.y), (64, 0.5), dict(FLAG=False, num_warps=4, BLOCK=16))


def test_a_launch_with_no_compile_ahead_of_its_own_waits_for_those_in_flight(launcher):
    """Its kernel may be the same Triton specialisation (other strides, say): Triton then finds it
    compiled rather than compiling it beside the compile ahead."""
    launcher.kernel.compile_seconds = {32: 1.0}
    _ahead(launcher)
    start = time.perf_counter()
    _launch(launcher, torch.randn(64), launcher.y, n=48, BLOCK=32)  # another scalar: another key
    assert time.perf_counter() - start >= 0.9
    assert len(launcher.kernel.compiled_ahead()) == 1 and [entry[0] for entry in launcher.kernel.log] == ["triton"]
    _ahead(launcher, n=80)  # differs from a launched one in a scalar only: nothing to compile ahead, none in flight
    assert not launcher.compiling((3, 2), (torch.randn(64), launcher.y), (80, 0.5),
                                  dict(FLAG=True, num_warps=4, BLOCK=32))
    assert len(launcher.kernel.compiled_ahead()) == 1


def test_a_failed_compile_ahead_is_left_to_the_launch(launcher):
    launcher.kernel.failing = {32}
    _ahead(launcher)
    _wait_for_children(launcher)
    assert not launcher.compiling((3, 2), (torch.randn(64), launcher.y), (64, 0.5),
                                  dict(FLAG=True, num_warps=4, BLOCK=32))
    _launch(launcher, torch.randn(64), launcher.y)  # compiles through Triton, which reports what fails
    assert [entry[0] for entry in launcher.kernel.log] == ["triton"] and not launcher.kernel.compiled_ahead()


def test_a_stuck_compile_ahead_is_killed_after_the_timeout(launcher, monkeypatch):
    monkeypatch.setattr(launch, "AHEAD_TIMEOUT_SECONDS", 0.5)
    launcher.kernel.compile_seconds = {32: 60.0}
    _ahead(launcher)
    child = launcher._ahead[next(iter(launcher._ahead))]
    start = time.perf_counter()
    _launch(launcher, torch.randn(64), launcher.y)
    assert time.perf_counter() - start < 5
    assert isinstance(child.exception(), forked.ChildFailed)
    with pytest.raises(ProcessLookupError):
        os.kill(child.pid, 0)  # gone, and reaped


def test_a_bound_launch_runs_the_compiled_kernel_on_new_tensors(launcher):
    x, y = torch.randn(64), torch.randn(64)
    _launch(launcher, x, y)
    bound = launcher.bound((3, 2), (x, y), (64, 0.5), dict(FLAG=True, num_warps=4, BLOCK=32))
    x2, y2 = torch.randn(64), torch.randn(64)
    bound((x2, y2))
    assert launcher.kernel.log[-1] == ("direct", (3, 2, 1), (x2.data_ptr(), y2.data_ptr(), 64, 0.5, 32, True))


def test_no_fork_while_another_thread_compiles_through_triton(launcher):
    """A child forked then could inherit a compiler lock that the other thread holds (launch.py)."""
    launch.triton_key()  # computed once per process: not part of the wait measured below
    launcher.kernel.triton_seconds = 1.0
    other = threading.Thread(target=_launch, args=(launcher, torch.randn(64), launcher.y), kwargs=dict(BLOCK=16))
    other.start()
    time.sleep(0.2)
    start = time.perf_counter()
    _ahead(launcher, 32)
    waited = time.perf_counter() - start
    other.join()
    assert waited >= 0.6, f"forked {waited:.2f} s into the other thread's 1 s compile"
    _wait_for_children(launcher)
    assert [ahead["kwargs"]["BLOCK"] for ahead in launcher.kernel.compiled_ahead()] == [32]


def test_no_compile_ahead_where_only_scalars_differ_from_a_launch(launcher):
    """A decoding loop's new key length each step: the kernel is compiled, a compile ahead would only find
    it again in another process (and the launch wait for that)."""
    _launch(launcher, torch.randn(64), launcher.y, n=64)
    _ahead(launcher, 32, n=65)
    _ahead(launcher, 64, n=65)  # another constexpr: compiled ahead
    _wait_for_children(launcher)
    assert [ahead["kwargs"]["BLOCK"] for ahead in launcher.kernel.compiled_ahead()] == [64]


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


def _new_score_mod():
    salt = float(torch.randint(1, 10**6, ()).item())  # a new function: kernels compiled in no process before

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + (q_idx - kv_idx) / salt
    return score_mod


@pytest.mark.gpu
@pytest.mark.parametrize("gradient", ["dense", "expanded"])
def test_a_first_call_compiles_forward_and_backward_in_child_processes(gradient, tmp_path):
    import triton

    import sparseflash

    compiles = tmp_path / "compiles.jsonl"

    def record(src, cache_hit, **kwargs):  # in the child that compiles, or in this process
        with open(compiles, "a") as out:
            out.write(json.dumps(dict(pid=os.getpid(), kernel=src.fn.__name__, hit=cache_hit)) + "\n")

    score_mod = _new_score_mod()
    q, k, v = (torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    previous = triton.knobs.compilation.listener  # told of every compile, a hit in Triton's disk cache too
    triton.knobs.compilation.listener = record
    try:
        o = sparseflash.attention(q, k, v, "causal", score_mod=score_mod)
        # as a model's gradients come (dense), or o.sum()'s (expanded, strides 0: read from a dense copy)
        o.backward(torch.randn_like(o) if gradient == "dense" else torch.ones(()).to(o).expand_as(o))
    finally:
        triton.knobs.compilation.listener = previous
    records = [json.loads(line) for line in compiles.read_text().splitlines()]
    # new with the function: the forward, and the backward's dK/dV and dQ kernels (the preprocess depends on
    # no function, so an earlier test in this process may have compiled it)
    new = [r for r in records if not r["hit"]]
    kernels = [r["kernel"] for r in new]
    assert sum(kernel.startswith("_attn_fwd") for kernel in kernels) == 1 and kernels.count("_attn_bwd") == 2, records
    assert all(r["pid"] != os.getpid() for r in new), f"compiled in the calling process: {records}"
    assert len({r["pid"] for r in new if r["kernel"] == "_attn_bwd"}) == 2, f"dK/dV and dQ not at once: {records}"
    assert torch.isfinite(q.grad).all()


def test_a_stand_in_runs_while_the_kernel_it_stands_in_for_compiles():
    halves = [("cfg", 1), ("cfg", 2)]
    state, compiled, asked = {"stand_in": halves}, [False], []

    def compiling(stand_in):
        asked.append(stand_in)
        return not compiled[0]

    assert launch.standing_in(state, compiling) == halves and asked == [halves]
    compiled[0] = True
    assert launch.standing_in(state, compiling) is None
    assert state == {}  # ended for every layout: later calls ask nothing
    asked.clear()
    assert launch.standing_in(state, compiling) is None and asked == []


def test_nothing_stands_in_while_a_cuda_graph_is_captured(monkeypatch):
    """A graph would replay the stand-in for good: while a capture runs, the launch waits for its own kernel; the
    standing in goes on for the calls outside it."""
    halves = [("cfg", 1), ("cfg", 2)]
    state = {"stand_in": halves}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert launch.standing_in(state, lambda stand_in: True) is None
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert launch.standing_in(state, lambda stand_in: True) == halves


def test_halves_that_do_not_fit_the_gpu_end_their_standing_in(monkeypatch):
    """Halves standing in for the fused backward whose launch runs out of shared memory (their config chosen for a
    lighter variant of the key): the call runs the fused kernel, its gradients right, and the standing in ends."""
    import triton

    from sparseflash.attention.triton import backward, tuning
    from sparseflash.attention.triton.plan import LaunchPlan
    from sparseflash.masks import make
    from tests.helpers import check_backend

    q, k, v, do = (torch.randn(1, 2, 64, 128) for _ in range(4))
    mask = make("causal", 64, block=16)
    plan = LaunchPlan.of(q, k, mask, False, 0.1)  # the plan of the call below
    assert backward._kernels(plan) is backward.FUSED
    cfg = tuning.candidates("backward", plan.backward_key)[0]
    plan.per_layout["backward_stand_in"] = {"stand_in": [(cfg, 1), (cfg, 2)]}
    real, programs = backward.BACKWARD, []

    class HalvesOutOfSharedMemory:
        def __call__(self, grid, tensors, scalars, constexprs):
            programs.append(constexprs["PROGRAMS"])
            if constexprs["PROGRAMS"] != 0:
                raise triton.runtime.errors.OutOfResources(300_000, 232_448, "shared memory")
            real(grid, tensors, scalars, constexprs)

        def compiling(self, *args):
            return True  # the fused kernel's compile ahead in flight

    monkeypatch.setattr(backward, "BACKWARD", HalvesOutOfSharedMemory())
    check_backend("triton", q, k, v, mask, do, scale=0.1)
    assert programs == [1, 0] and "stand_in" not in plan.per_layout["backward_stand_in"]


def test_a_compile_ahead_that_hangs_stops_counting_as_in_flight(monkeypatch):
    """A stand-in waits on ``Launcher.compiling``: a child past AHEAD_TIMEOUT_SECONDS is not in flight any more
    (the launch then waits for it and kills it), so no stand-in runs for good."""
    launcher = launch.Launcher(None)
    launcher._direct = True
    monkeypatch.setattr(launch.Launcher, "_key", staticmethod(lambda tensors, scalars, constexprs: "key"))
    child = forked.Child(pid=-1)
    launcher._ahead["key"] = child
    assert launcher.compiling((1,), (), (), {})
    child.started -= launch.AHEAD_TIMEOUT_SECONDS
    assert not launcher.compiling((1,), (), (), {})


@pytest.mark.parametrize("do_layout", ["contiguous", "misaligned"])
def test_the_gluon_backwards_compiling_check_keys_the_launch_its_compile_ahead_keyed(do_layout, monkeypatch):
    """``backward_gluon.compiling`` asks the Launcher about the key of the compile ahead ``compile_ahead`` made,
    for the real inputs of a backward (a misaligned dO is read from a copy, which TMA reads)."""
    from sparseflash.attention.triton import backward, backward_gluon
    from sparseflash.attention.triton.plan import LaunchPlan
    from sparseflash.masks import make

    asked = []
    monkeypatch.setattr(launch, "driver", SimpleNamespace(active=SimpleNamespace(get_current_device=lambda: 0)))
    monkeypatch.setattr(backward_gluon, "BACKWARD_GLUON", SimpleNamespace(
        compile_ahead=lambda *arguments: asked.append(launch.Launcher._key(*arguments[1:])),
        compiling=lambda *arguments: asked.append(launch.Launcher._key(*arguments[1:])) or True))
    monkeypatch.setattr(backward_gluon, "LSE2_LESS_ROWS", SimpleNamespace(compile_ahead=lambda *arguments: None))
    q = torch.randn(2, 4, 512, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 512, 64, dtype=torch.bfloat16) for _ in range(2))
    plan = LaunchPlan.of(q, k, make("causal", 512), False, 64 ** -0.5)
    stats_stride = backward._stats_stride(plan)
    mods = plan.mods_table([])
    stats = launch.Standin(torch.float32, (2 * 4, stats_stride))
    assert backward_gluon.compile_ahead(plan, q, k, v, plan.placeholder, mods, stats, stats_stride)
    do = torch.randn_like(q)
    if do_layout == "misaligned":
        do = torch.randn(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)
        assert do.data_ptr() % 16
    assert backward_gluon.compiling(plan, q, k, v, do, plan.placeholder, mods, stats_stride)
    assert len(asked) == 2 and asked[0] == asked[1]


def test_a_misaligned_output_gradient_reaches_the_kernels_as_an_aligned_copy(monkeypatch):
    """The kernels compiled ahead take a contiguous, 16-byte aligned dO: a misaligned one (a view) is copied
    first, not specialised on anew; the gradients are those of the aligned values."""
    import sparseflash
    from sparseflash.attention.triton import backward

    seen = []

    def spied(plan, programs, q, k, v, do, *args, _original=backward._launcher, **kwargs):
        seen.append(do.data_ptr() % 16)
        return _original(plan, programs, q, k, v, do, *args, **kwargs)

    monkeypatch.setattr(backward, "_launcher", spied)
    q, k, v = (torch.randn(1, 2, 64, 32, requires_grad=True) for _ in range(3))
    aligned = torch.randn(1, 2, 64, 32)
    misaligned = torch.empty(aligned.numel() + 1)[1:].view(aligned.shape).copy_(aligned)
    assert misaligned.data_ptr() % 16
    grads = [torch.autograd.grad(sparseflash.attention(q, k, v, "causal", backend="triton"), (q, k, v), do)
             for do in (aligned, misaligned)]
    assert seen and not any(seen), f"a kernel read dO at an address 16 bytes do not align: {seen}"
    for name, first, second in zip("qkv", *grads):
        assert torch.equal(first, second), f"d{name} differs with a misaligned dO"


def test_the_triton_forward_stands_in_for_the_gluon_forward_until_it_is_compiled(monkeypatch):
    from sparseflash.attention.triton import forward, forward_gluon
    from sparseflash.attention.triton.tuning import KernelConfig

    cfg = KernelConfig(128, 64, 8, 3)
    compiled, asked = [False], []

    def compiling(plan, *arguments):
        asked.append(arguments)
        return not compiled[0]

    monkeypatch.setattr(forward_gluon, "compiling", compiling)
    plan = SimpleNamespace(per_layout={"forward_stand_in": {"stand_in": cfg}})
    arguments = ("q", "k", "v", "o", "lse", "key_lengths", "mods")
    assert forward._triton_stand_in(plan, *arguments) == cfg and asked == [arguments]
    compiled[0] = True
    assert forward._triton_stand_in(plan, *arguments) is None
    assert plan.per_layout["forward_stand_in"] == {}  # ended for every layout: later calls ask nothing
    asked.clear()
    assert forward._triton_stand_in(plan, *arguments) is None and asked == []
    assert forward._triton_stand_in(SimpleNamespace(per_layout={}), *arguments) is None and asked == []


@pytest.mark.gpu
def test_a_first_forward_runs_the_triton_kernel_while_the_gluon_forward_compiles(monkeypatch):
    """A new score function on causal rows the Gluon forward takes: the first call's forward runs the Triton
    kernel, compiled ahead beside the Gluon one; a later call the Gluon forward; every output against the
    reference."""
    import sparseflash
    from sparseflash.attention.triton import forward_gluon
    from sparseflash.attention.triton.launch import gluon_hopper
    from tests.helpers import assert_close

    if not gluon_hopper(torch.device("cuda")) or launch.usable_cpus() < launch.STAND_IN_FROM_CPUS:
        pytest.skip(f"the Triton forward stands in on Hopper hosts of {launch.STAND_IN_FROM_CPUS} CPUs or more")
    monkeypatch.delenv("SPARSEFLASH_GLUON", raising=False)
    launched = []

    def spied(*args, _original=forward_gluon.launch, **kwargs):
        if not kwargs.get("ahead"):
            launched.append(_original(*args, **kwargs))
            return launched[-1]
        return _original(*args, **kwargs)

    monkeypatch.setattr(forward_gluon, "launch", spied)
    score_mod = _new_score_mod()
    q, k, v = (torch.randn(2, 4, 1024, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    expected = sparseflash.attention(q.float(), k.float(), v.float(), "causal", score_mod=score_mod,
                                     backend="reference")
    calls, deadline = 0, time.monotonic() + 120
    while not launched and time.monotonic() < deadline:  # the first call, then until the Gluon forward takes over
        assert_close(sparseflash.attention(q, k, v, "causal", score_mod=score_mod).float(), expected, 2e-2,
                     f"o of call {calls}")
        if calls == 0:
            assert not launched, "the first call waited for the Gluon forward"
        calls += 1
        time.sleep(0.01)
    assert launched == [True], f"the Gluon forward did not take over in {calls} calls"
    assert_close(sparseflash.attention(q, k, v, "causal", score_mod=score_mod).float(), expected, 2e-2,
                 "o of the Gluon forward")


def _backwards_until_taken_over(q, k, v, score_mod, first_check, taken_over, stand_in: str, kernel: str) -> None:
    """Backwards of calls on causal rows with ``score_mod``: the first (``first_check()`` after it: the stand-in ran),
    then until ``taken_over()`` (at most 100 calls, 0.1 s apart), which must come; the first's gradients and the
    last's against the reference. A call without gradients compiles the forward first: the backward's compile ahead
    starts with the first call that takes gradients, and would otherwise have the forward's compile time to finish
    in (at head dim 96 it did, and the first backward had nothing to stand in for)."""
    import sparseflash
    from tests.helpers import assert_close

    do = torch.randn_like(q)
    o = sparseflash.attention(q.float(), k.float(), v.float(), "causal", score_mod=score_mod, backend="reference")
    expected = torch.autograd.grad(o, (q, k, v), do.float())
    with torch.no_grad():
        sparseflash.attention(q, k, v, "causal", score_mod=score_mod)
    sparseflash.wait_for_compiles()
    grads = []
    for _ in range(100):
        o = sparseflash.attention(q, k, v, "causal", score_mod=score_mod)
        grads.append(torch.autograd.grad(o, (q, k, v), do))
        if len(grads) == 1:
            first_check()
        if taken_over():
            break
        time.sleep(0.1)
    assert taken_over(), f"the {kernel} never took over"
    for name, first, last, ref in zip("qkv", grads[0], grads[-1], expected):
        assert_close(first.float(), ref, 2e-2, f"d{name} of the {stand_in}")
        assert_close(last.float(), ref, 2e-2, f"d{name} of the {kernel}")


@pytest.mark.gpu
def test_a_first_backward_at_head_dim_128_runs_the_halves_while_the_fused_kernel_compiles():
    from sparseflash.attention.triton import backward

    if launch.usable_cpus() < launch.STAND_IN_FROM_CPUS:
        pytest.skip(f"the halves stand in on hosts of {launch.STAND_IN_FROM_CPUS} CPUs or more")
    score_mod = _new_score_mod()
    before = set(backward.BACKWARD._compiled)

    def new_programs():  # the PROGRAMS of the backward kernels launched since ``before``
        return {dict(key[1])["PROGRAMS"] for key in set(backward.BACKWARD._compiled) - before}

    def first_check():
        assert new_programs() == {1, 2}, f"the first backward launched PROGRAMS {new_programs()}, not the halves"

    q, k, v = (torch.randn(2, 4, 700, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    _backwards_until_taken_over(q, k, v, score_mod, first_check, lambda: 0 in new_programs(), "halves",
                                "fused kernel")


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [64, 96, 128, 192, 256], ids=["d64", "d96", "d128", "d192", "d256"])
def test_a_first_backward_runs_the_triton_halves_while_the_gluon_backward_compiles(dim, monkeypatch):
    """A new score function on causal rows the Gluon backward takes: the first backward runs the Triton
    backward's halves (``backward.gluon_stand_in``: GLUON_STAND_IN's small tiles, GLUON_STAND_IN_WIDE's at 256),
    compiled ahead beside the Gluon backward; a later one the Gluon backward; every gradient against the
    reference. Rows long enough for "auto" to take the Gluon backward at the head dim."""
    from sparseflash.attention.triton import backward, backward_gluon
    from sparseflash.attention.triton.launch import gluon_hopper

    if not gluon_hopper(torch.device("cuda")) or launch.usable_cpus() < launch.STAND_IN_FROM_CPUS:
        pytest.skip(f"the halves stand in on Hopper hosts of {launch.STAND_IN_FROM_CPUS} CPUs or more")
    monkeypatch.delenv("SPARSEFLASH_GLUON", raising=False)
    launched = []

    def spied(*args, _original=backward_gluon.launch, **kwargs):
        ran = _original(*args, **kwargs)
        if not kwargs.get("ahead"):
            launched.append(ran)
        return ran

    monkeypatch.setattr(backward_gluon, "launch", spied)
    score_mod = _new_score_mod()
    before = set(backward.BACKWARD._compiled)

    def first_check():
        halves = [dict(key[1]) for key in set(backward.BACKWARD._compiled) - before]
        programs = {half["PROGRAMS"] for half in halves}
        assert not launched and programs == {1, 2}, (
            f"the first backward launched the Gluon backward ({launched}) or PROGRAMS {programs}, not the halves")
        small = backward.GLUON_STAND_IN if dim < 256 else backward.GLUON_STAND_IN_WIDE
        assert all((half["BLOCK_M"], half["BLOCK_N"], half["num_warps"]) == (small.block_m, small.block_n,
                                                                             small.num_warps) for half in halves)

    seq = 2 * backward_gluon.AUTO_ROW_KEYS[dim]  # causal rows of half as many keys on average, and a tile
    q, k, v = (torch.randn(2, 4, seq + 128, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    _backwards_until_taken_over(q, k, v, score_mod, first_check, lambda: launched == [True], "halves",
                                "Gluon backward")


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
