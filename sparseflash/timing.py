"""Timing GPU callables against each other: the tuner's candidate configs, the benchmark's backends.

An H100 under load drifts by several per cent within seconds (its clocks follow power and
temperature): one backward config timed 3.25-3.65 ms in rounds a
second apart. Timing one callable for 300 ms and then the next lets that drift decide gaps of
1-2 %. Here the callables take turns instead: each round gives each of them one short
``triton.testing.do_bench`` run (the L2 cache flushed before every call), in reverse order every
other round so that a steady drift falls on all of them alike, and every call's time is kept.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch

Times = Union[list[float], BaseException]


def interleaved_times(fns: Sequence[Callable[[], object]], rounds: int, rep_ms: float, warmup_ms: float,
                      grad_to_none: Optional[list[torch.Tensor]] = None,
                      catch: tuple[type[BaseException], ...] = ()) -> list[Times]:
    """The time (ms) of every timed call of each of ``fns``, over ``rounds`` interleaved rounds of
    ``rep_ms`` (and ``warmup_ms`` of warm-up calls) per callable and round. A callable that raises
    one of ``catch`` is not timed again: its entry is the exception."""
    from triton.testing import do_bench

    times: list[Times] = [[] for _ in fns]
    for round_ in range(rounds):
        order = range(len(fns)) if round_ % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            if isinstance(times[i], BaseException):
                continue
            try:
                times[i] += do_bench(fns[i], warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none,
                                     return_mode="all")
            except catch as err:
                times[i] = err
    return times
