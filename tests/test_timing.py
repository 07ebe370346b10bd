"""Interleaved timing (``sparseflash.timing``) and the benchmark's use of it (``measure.time_steps``),
with ``do_bench`` and the CUDA calls replaced by recorders: the order the callables take turns in,
the calls' times pooled per callable, and failures recorded without stopping the others."""

from __future__ import annotations

import math

import pytest
import torch

from sparseflash import timing
from sparseflash.bench import measure
from sparseflash.bench.spec import BenchConfig, Timing


@pytest.fixture
def scripted_bench(monkeypatch):
    """do_bench replaced: a callable's n-th timing returns ``script[name][n - 1]``; the names in the
    order they were timed, and the rep each got, are recorded."""
    import triton.testing

    calls = []

    def bench(fn, warmup, rep, grad_to_none, return_mode):
        assert return_mode == "all"
        name, script = fn()
        calls.append((name, rep))
        result = script[[c for c, _ in calls].count(name) - 1]
        if isinstance(result, Exception):
            raise result
        return result

    monkeypatch.setattr(triton.testing, "do_bench", bench)
    return calls


def _fn(name, script):
    return lambda: (name, script)


def test_callables_take_turns_in_alternating_order_and_pool_their_calls(scripted_bench):
    a, b, c = _fn("a", [[1.0], [1.1, 1.2], [1.3]]), _fn("b", [[2.0]] * 3), _fn("c", [[3.0]] * 3)
    times = timing.interleaved_times([a, b, c], rounds=3, rep_ms=10, warmup_ms=1)
    assert [name for name, _ in scripted_bench] == list("abc" "cba" "abc")
    assert {rep for _, rep in scripted_bench} == {10}
    assert times == [[1.0, 1.1, 1.2, 1.3], [2.0] * 3, [3.0] * 3]


def test_a_caught_failure_stops_only_that_callable(scripted_bench):
    err = RuntimeError("out of memory")
    a, b = _fn("a", [[1.0], err]), _fn("b", [[2.0]] * 3)
    times = timing.interleaved_times([a, b], rounds=3, rep_ms=5, warmup_ms=1, catch=(RuntimeError,))
    assert times[0] is err and times[1] == [2.0] * 3
    assert [name for name, _ in scripted_bench] == ["a", "b", "b", "a", "b"]
    with pytest.raises(RuntimeError):  # not in catch: raised
        timing.interleaved_times([_fn("x", [err])], rounds=1, rep_ms=5, warmup_ms=1)


def test_time_steps_on_cuda_interleaves_the_fast_steps_only(monkeypatch):
    """A slow step gets its own plain calls, a failed warm call is reported, the rest take turns."""
    warm = {"fast1": (2.0, 10.0), "slow": (900.0, 20.0), "fast2": (3.0, 30.0), "broken": RuntimeError("boom")}

    def warm_call(step, device, grads):
        result = warm[step()]
        if isinstance(result, Exception):
            raise result
        return result

    interleaved = []

    def turns(fns, rounds, rep_ms, warmup_ms, grad_to_none, catch):
        interleaved.append(([fn() for fn in fns], rounds, rep_ms))
        return [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]

    monkeypatch.setattr(measure, "_warm_call", warm_call)
    monkeypatch.setattr(measure, "_events", lambda step, n, grads: [800.0] * n)
    monkeypatch.setattr(measure, "interleaved_times", turns)
    cfg = Timing(rep_ms=300, rounds=3, slow_ms=500, min_repeats=4)
    steps = [lambda name=name: name for name in warm]
    fast1, slow, fast2, broken = measure.time_steps(steps, torch.device("cuda"), cfg, [])
    assert interleaved == [(["fast1", "fast2"], 3, 100.0)]
    assert fast1["median_ms"] == 2.0 and fast1["peak_mem_mb"] == 10.0 and fast1["repeats"] == 3
    assert fast2["median_ms"] == 5.0 and fast2["peak_mem_mb"] == 30.0
    assert slow["median_ms"] == 800.0 and slow["repeats"] == 4
    assert isinstance(broken, RuntimeError)


def test_time_steps_on_cpu_times_each_step_with_the_wall_clock():
    cfg = Timing(warmup_ms=0, rep_ms=1, min_repeats=3, max_repeats=3)
    (result,) = measure.time_steps([lambda: sum(range(1000))], torch.device("cpu"), cfg, [])
    assert result["repeats"] == 3 and result["median_ms"] > 0 and math.isnan(result["peak_mem_mb"])


def test_rounds_must_be_positive():
    with pytest.raises(ValueError, match="timing.rounds must be at least 1; got 0"):
        BenchConfig.from_cfg({"timing": {"rounds": 0}})
