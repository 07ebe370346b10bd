"""Measuring one case: the timed step of a mode, the timers, peak memory and the correctness gate.

Timers return milliseconds. On CUDA, ``triton.testing.do_bench`` (L2 flushed between calls, the
gradients reset with ``grad_to_none``), the backends of a case taking turns in rounds; a step slower
than ``timing.slow_ms`` is timed instead with ``min_repeats`` CUDA-event-timed calls, so one slow
case cannot eat the sweep. On CPU, a wall clock
over repeats after a warm-up call. Peak memory is ``torch.cuda.max_memory_allocated`` over one warm
call (inputs included); on CPU it is not measured (NaN).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
import warnings
from typing import Callable, Optional

import torch

import sparseflash
from sparseflash.bench.spec import Timing
from sparseflash.masks import BlockMask
from sparseflash.timing import interleaved_times

Step = Callable[[], object]
COMPILE_WAIT_S = 300.0  # how long the rows wait for the kernels sparseflash's first calls compile ahead


def make_step(fwd: Callable[[], torch.Tensor], mode: str, do) -> Step:
    """The work one timed call does: ``fwd`` (no autograd), ``bwd`` (backward of one retained
    forward) or ``fwdbwd`` (both)."""
    if mode == "fwd":
        def step():
            with torch.no_grad():
                return fwd()
    elif mode == "fwdbwd":
        def step():
            fwd().backward(do)
    elif mode == "bwd":
        o = fwd()

        def step():
            o.backward(do, retain_graph=True)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return step


def run_once(fwd, mode, q, k, v, do):
    """The first call: ``o`` and, for bwd modes, ``(dq, dk, dv)`` of ``sum(o * do)``."""
    if mode == "fwd":
        with torch.no_grad():
            return fwd(), None
    o = fwd()
    return o, torch.autograd.grad(o, (q, k, v), do)


@contextlib.contextmanager
def compile_counts():
    """``with compile_counts() as counts:`` what the calls inside the block compiled, in ``counts``:
    ``compiled_kernels`` (Triton kernels compiled: sparseflash's and those Inductor generates),
    ``cached_kernels`` (Triton kernels found in Triton's disk cache) and ``dynamo_graphs`` (graphs
    torch.compile captured). Triton's counts are 0 where nothing runs through Triton's compiler (its
    interpreter, PyTorch's own kernels)."""
    counts = {"compiled_kernels": 0, "cached_kernels": 0, "dynamo_graphs": 0}
    try:
        import triton
        knobs = triton.knobs.compilation
    except (ImportError, AttributeError):  # no Triton, or one without compile listeners
        knobs = None
    previous = knobs.listener if knobs is not None else None

    def listen(*, cache_hit, **kwargs):
        counts["cached_kernels" if cache_hit else "compiled_kernels"] += 1
        if previous is not None:
            previous(cache_hit=cache_hit, **kwargs)

    from torch._dynamo.utils import counters
    graphs_before = counters["stats"]["unique_graphs"]
    if knobs is not None:
        knobs.listener = listen
    try:
        yield counts
    finally:
        if knobs is not None:
            knobs.listener = previous
        counts["dynamo_graphs"] = counters["stats"]["unique_graphs"] - graphs_before


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_ms(fn: Callable[[], object], device: torch.device):
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, (time.perf_counter() - start) * 1e3


def _quantile(times: list[float], q: float) -> float:
    return float(torch.tensor(times, dtype=torch.float64).quantile(q))


def _stats(times: list[float], timing: Timing) -> dict:
    lo, hi = timing.quantiles
    return {"median_ms": statistics.median(times), "p20_ms": _quantile(times, lo),
            "p80_ms": _quantile(times, hi), "repeats": len(times)}


def _events(step: Step, n: int, grads: list[torch.Tensor]) -> list[float]:
    times = []
    for _ in range(n):
        for g in grads:
            g.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def _wall_times(step: Step, device: torch.device, timing: Timing, grads: list[torch.Tensor]) -> list[float]:
    """CPU: a warm-up (at least one call), then as many repeats as fit in rep_ms."""
    _, warm = wall_ms(step, device)
    spent = warm
    while spent < timing.warmup_ms:
        _, t = wall_ms(step, device)
        spent += t
    n = int(min(timing.max_repeats, max(timing.min_repeats, timing.rep_ms / max(warm, 1e-3))))
    times = []
    for _ in range(n):
        for g in grads:
            g.grad = None
        times.append(wall_ms(step, device)[1])
    return times


def _warm_call(step: Step, device: torch.device, grads: list[torch.Tensor]) -> tuple[float, float]:
    """Milliseconds and peak memory (MB, inputs included) of one CUDA call."""
    for g in grads:
        g.grad = None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    _, ms = wall_ms(step, device)
    return ms, torch.cuda.max_memory_allocated(device) / 2**20


def _attempt(fn: Callable[[], object]) -> object:
    """``fn()``, or the exception it raised."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - the caller records it
        return err


def graphed(step: Step) -> Step:
    """``step`` captured into a CUDA graph (after a call on a side stream, as torch asks), as the graph's
    replay: the same GPU work without the host's launches."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def time_steps(steps: list[Step], device: torch.device, timing: Timing,
               grads: list[torch.Tensor]) -> list[dict | BaseException]:
    """Median, spread and repeats of each of ``steps`` (the backends of one case and mode, sharing
    the leaves ``grads``) and ``peak_mem_mb`` of one warm call (CUDA); or the exception a step
    raised. On CUDA the steps take turns, ``timing.rounds`` rounds of ``rep_ms / rounds`` each
    (``sparseflash.timing``), so that the GPU's clock drift does not favour one of them; a step
    slower than ``slow_ms`` gets ``min_repeats`` plain timed calls of its own. With ``timing.cuda_graph``
    (CUDA) each step is timed as the replay of its CUDA graph (``graphed``)."""
    if device.type != "cuda":
        times = [_attempt(lambda s=s: _wall_times(s, device, timing, grads)) for s in steps]
        peaks = [math.nan] * len(steps)
    else:
        warm = [_attempt(lambda s=s: _warm_call(s, device, grads)) for s in steps]
        # the kernels sparseflash's first calls compile ahead, which faster-compiling ones stand in for meanwhile:
        # the steady speed, and a CUDA graph, are theirs
        if not sparseflash.wait_for_compiles(COMPILE_WAIT_S):
            warnings.warn(f"sparseflash's kernels still compiling after {COMPILE_WAIT_S:.0f} s: the rows may time "
                          "the kernels that stand in for them")
        if timing.cuda_graph:
            steps = [w if isinstance(w, BaseException) else _attempt(lambda s=s: graphed(s))
                     for s, w in zip(steps, warm)]
            warm = [s if isinstance(s, BaseException) else w for s, w in zip(steps, warm)]
        times = [w if isinstance(w, BaseException) else
                 _attempt(lambda s=s: _events(s, timing.min_repeats, grads)) if w[0] > timing.slow_ms else None
                 for s, w in zip(steps, warm)]
        turns = [i for i, t in enumerate(times) if t is None]
        taken = interleaved_times([steps[i] for i in turns], timing.rounds, timing.rep_ms / timing.rounds,
                                  timing.warmup_ms, grads or None, catch=(Exception,))
        for i, t in zip(turns, taken):
            times[i] = t
        peaks = [math.nan if isinstance(w, BaseException) else w[1] for w in warm]
    timed = {"cuda_graph": True} if timing.cuda_graph and device.type == "cuda" else {}
    return [t if isinstance(t, BaseException) else {**_stats(t, timing), "peak_mem_mb": peak, **timed}
            for t, peak in zip(times, peaks)]


# ---------------------------------------------------------------------------- correctness gate
def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in fp64; inf if ``actual`` has NaN/inf."""
    actual, expected = actual.detach().double(), expected.detach().double()
    if actual.shape != expected.shape or not torch.isfinite(actual).all():
        return math.inf
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-12))


def head_slice(mask: BlockMask, heads: int) -> BlockMask:
    """``mask`` for the first ``heads`` heads (a shared layout stays shared)."""
    if mask.num_heads == 1:
        return mask
    return BlockMask(mask.layout[..., :heads, :, :], mask.block_size, mask.q_len, mask.kv_len, mask.causal,
                     mask.mask_mod)


def slice_inputs(q, k, v, do, heads: int):
    """Batch 0 and the first ``heads`` query heads with their key/value heads, as fresh leaves that
    require grad. Under GQA whole groups are kept (``heads`` rounded up to a multiple of the group),
    so that the sliced dK and dV sum every query head that reads them."""
    group = q.shape[1] // k.shape[1]
    kv_heads = -(-heads // group)
    pick = lambda x, n: x[:1, :n].detach().clone().requires_grad_(True)  # noqa: E731
    return pick(q, kv_heads * group), pick(k, kv_heads), pick(v, kv_heads), do[:1, :kv_heads * group].detach()


def trusted_outputs(backend_fn, q, k, v, do, mask: BlockMask, heads: int) -> dict:
    """``o, dq, dk, dv`` of a trusted backend on batch 0 and the first ``heads`` heads."""
    qs, ks, vs, dos = slice_inputs(q, k, v, do, heads)
    o = backend_fn(qs, ks, vs, head_slice(mask, qs.shape[1]))
    dq, dk, dv = torch.autograd.grad(o, (qs, ks, vs), dos)
    return {"o": o.detach(), "dq": dq, "dk": dk, "dv": dv}


def compare(o, grads, trusted: dict, tol: float) -> tuple[float, Optional[str]]:
    """Largest relative error over ``o`` (and ``dq, dk, dv``) on the trusted slice, and a message
    naming the worst tensor when it exceeds ``tol``."""
    pairs = [("o", o)]
    if grads is not None:
        pairs += list(zip(("dq", "dk", "dv"), grads))
    errors = {name: relative_error(x[:1, :trusted[name].shape[1]], trusted[name]) for name, x in pairs}
    worst = max(errors, key=errors.get)
    err = errors[worst]
    if not err <= tol:
        return err, f"{worst}: relative error {err:.2e} > tol {tol:.1e}"
    return err, None
