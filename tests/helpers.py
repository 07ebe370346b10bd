"""How the attention tests judge a backend: against an fp64 oracle, element by element.

As FlashAttention's tests do it, an output is compared with the reference run in fp64 on the same
(low-precision) inputs, and its largest element error must stay within ``FACTOR`` times the largest
error of a plain PyTorch implementation in the inputs' own precision (``reference_attention(...,
upcast=False)``: scores and ``p @ v`` in that dtype, the softmax in fp32), plus one rounding step of
the dtype at the tensor's largest magnitude (outputs are rounded to it once; bf16 gradients get
``GRADIENT_STEPS``, gradients of captured tensors ``CAPTURE_GRADIENT_STEPS`` and their summation
order's fp32 rounding, ``capture_order_error``), and dq, dk and captured gradients what delta taken
from the stored o moves them by (``_stored_o_shift``). So a few corrupted rows fail even where a
whole-tensor norm would hide them. The relative error over the tensor must stay within the dtype's
``REL_TOL`` too, nothing may be NaN, and the ``-inf`` entries of lse (rows that see no key) must
match exactly. lse is computed in fp32 by every backend and is held to an fp32 tolerance
(``LSE_TOL``), except for fp32 inputs on a GPU, whose dots run in TF32 by design: there the baseline
also uses TF32, lse follows the ``FACTOR`` rule and the relative error may reach ``TF32_REL_TOL``. A
call with dropout (``SeededDropout``) is judged against the reference with the dropout the call drew.
"""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path
from typing import NamedTuple

import torch

import sparseflash
from sparseflash.attention import resolve_mask
from sparseflash.attention.dropout import Dropout, draw_seed
from sparseflash.attention.reference import reference_attention
from sparseflash.masks.functions import trace

FACTOR = {torch.float16: 2.0, torch.bfloat16: 2.0, torch.float32: 8.0}
# The kernels' backward rounds P and dS to the inputs' dtype before its dots, as FlashAttention's does;
# in bf16 (8-bit mantissas) that alone put a gradient 3-4 rounding steps off at a few elements of small
# shapes (decoding: GQA, 2-5 query rows), where the plain implementation was closer, with the same
# errors from the regular forward and the split one. In fp32 decoding's dk with dropout (3 query rows,
# p = 0.2, a causal window) came 2.1 steps beyond 8x the plain error once in a CI run (1.167e-6 against 1.04e-6
# allowed), where the plain implementation, summing 3 terms, was near exact. A corrupted tile is off by many more.
GRADIENT_STEPS = {torch.bfloat16: 4, torch.float32: 4}
# A captured tensor's gradient is a sum over every score, added by the kernels' atomics in any order:
# in fp32 it came 2 steps off once (9.5e-7 against 9.4e-7 allowed) where the plain implementation was exact.
CAPTURE_GRADIENT_STEPS = 2
REL_TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 1e-5}
TF32_REL_TOL = 5e-3  # fp32 inputs on a GPU: TF32 dots (10-bit mantissas), as fp16's
LSE_TOL = 1e-5  # absolute and relative: |lse - lse_ref| <= LSE_TOL * (1 + |lse_ref|)
NAMES = ("o", "lse", "dq", "dk", "dv")


@contextlib.contextmanager
def seeded(rng_seed: int, device):
    """Inside: torch's generators (the CPU's and ``device``'s) start from ``torch.manual_seed(rng_seed)``;
    after it they are as before."""
    devices = [torch.device(device)] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(rng_seed)
        yield


class SeededDropout(NamedTuple):
    """Dropout ``p`` for a call made right after ``torch.manual_seed(rng_seed)``."""

    p: float
    rng_seed: int

    def drawn(self, device) -> Dropout:
        """The ``Dropout`` such a call on ``device`` uses: its seed drawn the way ``attention`` draws it."""
        with seeded(self.rng_seed, device):
            return Dropout(self.p, draw_seed(torch.device(device)))


class _Fields(NamedTuple):
    o: torch.Tensor
    lse: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor


class Outputs(_Fields):
    """``(o, lse, dq, dk, dv)``, and as an attribute ``dcaptures``: the gradients of the tensors a
    score_mod captures that require grad (kept out of the tuple, which tests unpack)."""

    dcaptures: tuple = ()


def _loss(o, lse, do, dlse):
    """``sum(o * do)``, plus ``sum(lse * dlse)`` over the rows that see a key when ``dlse`` is given."""
    work = torch.promote_types(o.dtype, torch.float32)
    loss = (o.to(work) * do.to(work)).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)) * dlse).sum()
    return loss


def _trained_captures(score_mod) -> tuple[torch.Tensor, ...]:
    """The tensors ``score_mod`` captures that require grad."""
    if score_mod is None:
        return ()
    return tuple(t for t in trace(score_mod, "score_mod").captures if t.requires_grad)


def _grads(run, q, k, v, do, dlse, captures=()) -> Outputs:
    """``run(q, k, v) -> (o, lse)`` and the gradients of ``_loss`` in q, k, v and ``captures``; q, k, v
    keep their layout."""
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    o, lse = run(q, k, v)
    dq, dk, dv, *dcaptures = torch.autograd.grad(_loss(o, lse, do, dlse), (q, k, v, *captures))
    out = Outputs(o, lse, dq, dk, dv)
    out.dcaptures = tuple(dcaptures)
    return out


def attention_with_grads(backend, q, k, v, mask, do, key_lengths=None, *, scale=None, dlse=None,
                         score_mod=None, compiler=None, dropout: SeededDropout | None = None) -> Outputs:
    """``(o, lse, dq, dk, dv, dcaptures)`` of ``sparseflash.attention`` through ``backend`` for the loss
    ``sum(o * do)`` (``+ sum(lse * dlse)`` over rows that see a key, with ``dlse``); with ``compiler`` (a
    torch.compile backend) the call runs compiled with ``fullgraph=True``; with ``dropout`` it drops
    probabilities, called right after its ``torch.manual_seed``."""
    def run(q, k, v):
        return sparseflash.attention(q, k, v, mask, score_mod=score_mod, key_lengths=key_lengths, scale=scale,
                                     dropout_p=dropout.p if dropout else 0.0, backend=backend, return_lse=True)
    if compiler is not None:
        run = torch.compile(run, backend=compiler, fullgraph=True)
    with seeded(dropout.rng_seed, q.device) if dropout else contextlib.nullcontext():
        return _grads(run, q, k, v, do, dlse, _trained_captures(score_mod))


def _oracle(q, k, v, mask, do, key_lengths, scale, dlse, upcast: bool, score_mod=None,
            dropout: Dropout | None = None) -> Outputs:
    """The reference in fp64 (``upcast``), or in the inputs' precision."""
    block_mask = resolve_mask(mask, q.shape[2], k.shape[2], q.shape[1])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    tf32 = q.dtype is torch.float32 and q.is_cuda and not upcast
    if upcast:
        q, k, v, do = (x.double() for x in (q, k, v, do))
    elif tf32:  # the kernels' fp32 dots are TF32 on a GPU; cuBLAS may not be (small K): cut the inputs
        q, k, v, do = (_round_to_tf32(x) for x in (q, k, v, do))
    with _tf32_matmuls(tf32):
        return _grads(lambda q, k, v: reference_attention(q, k, v, block_mask, key_lengths, scale, score_mod,
                                                          dropout, upcast=upcast),
                      q, k, v, do, dlse, _trained_captures(score_mod))


def _round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` cut to TF32's 10-bit mantissa, as tensor cores read fp32 operands (truncated)."""
    bits = x.detach().contiguous().view(torch.int32)
    return (bits & ~0x1FFF).view(torch.float32).view_as(x)


@contextlib.contextmanager
def _tf32_matmuls(on: bool):
    """fp32 matmuls in TF32 while ``on`` (torch's ``fp32_precision`` setting where it has one: from
    torch 2.9 on, ``allow_tf32`` no longer switches cuBLAS)."""
    owner = torch.backends.cuda.matmul
    name, value = ("fp32_precision", "tf32") if hasattr(owner, "fp32_precision") else ("allow_tf32", True)
    before = getattr(owner, name)
    if on:
        setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest element error over the entries where ``expected`` is finite."""
    finite = torch.isfinite(expected)
    return (actual.double() - expected.double())[finite].abs().max().item() if finite.any() else 0.0


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` over the finite entries of ``expected``."""
    finite = torch.isfinite(expected)
    diff = (actual.double() - expected.double())[finite]
    return (diff.norm() / expected.double()[finite].norm().clamp_min(1e-6)).item()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, name: str) -> None:
    """Same shape, no NaN, the same non-finite entries, and relative error at most ``tol``."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert not torch.isnan(actual).any(), f"{name} contains NaN"
    finite = torch.isfinite(expected)
    mismatched = (actual[~finite] != expected[~finite].to(actual.dtype)).sum().item()
    assert mismatched == 0, f"{name}: {mismatched} non-finite entries differ (e.g. lse of empty rows must be -inf)"
    err = relative_error(actual, expected)
    assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.1e}"


def check_outputs(got: Outputs, q, k, v, mask, do, key_lengths=None, *, scale=None, dlse=None,
                  names=NAMES, score_mod=None, dropout: SeededDropout | None = None) -> None:
    """Judge ``got`` (a backend's ``Outputs`` for these inputs) as the module docstring says; the
    gradients of a score_mod's trained captures as o and the gradients are."""
    dtype = q.dtype
    drawn = dropout.drawn(q.device) if dropout else None
    want = _oracle(q, k, v, mask, do, key_lengths, scale, dlse, True, score_mod, drawn)
    plain = _oracle(q, k, v, mask, do, key_lengths, scale, dlse, False, score_mod, drawn)
    tf32 = dtype is torch.float32 and q.is_cuda
    shifts = None  # what delta from the stored o moves dq, dk and the captured gradients by (not dv)
    if got.dcaptures or any(name in ("dq", "dk") for name in names):
        shifts = _stored_o_shift(got, want, q, k, v, mask, do, key_lengths, scale, score_mod, drawn)
    triples = [(name, getattr(got, name), getattr(want, name), getattr(plain, name),
                getattr(shifts, name) if name in ("dq", "dk") else None) for name in names]
    captured = zip(got.dcaptures, want.dcaptures, plain.dcaptures, shifts.dcaptures if shifts else ())
    triples += [(f"dcapture{i}", *grads) for i, grads in enumerate(captured)]
    for name, actual, expected, baseline, shift in triples:
        if name.startswith("dcapture"):  # in the captured tensor's dtype: compared in the inputs' terms
            actual, expected, baseline = actual.to(dtype), expected.to(torch.float64), baseline.to(dtype)
        assert actual.dtype == (torch.float32 if name == "lse" else dtype), f"{name}: dtype {actual.dtype}"
        # A reduction the plain implementation itself gets this far off (a captured tensor's gradient
        # summed over every score in TF32) is held to a multiple of its error, as elements are below.
        tol = max(TF32_REL_TOL if tf32 else REL_TOL[dtype], FACTOR[dtype] * relative_error(baseline, expected))
        if shift is not None:
            tol += relative_error(expected + shift, expected)
        assert_close(actual, expected, tol, name)
        if shift is None:
            err = max_error(actual, expected)
        else:  # each element may be off by its own share of the stored o's error
            err = ((actual.double() - expected).abs() - shift.abs())[torch.isfinite(expected)].max().item()
        if name == "lse" and not tf32:
            bound = (LSE_TOL * (1 + expected.abs())).where(torch.isfinite(expected), 0)
            worst = ((actual.double() - expected).abs().where(torch.isfinite(expected), 0) - bound).max().item()
            assert worst <= 0, f"lse: error {err:.2e} beyond the fp32 tolerance {LSE_TOL:.0e} x (1 + |lse|)"
            continue
        step = torch.finfo(dtype).eps * expected[torch.isfinite(expected)].abs().max().item() if expected.numel() else 0
        steps = GRADIENT_STEPS.get(dtype, 1) if name.startswith("d") else 1
        order = 0.0
        if name.startswith("dcapture"):
            steps = max(steps, CAPTURE_GRADIENT_STEPS)
            order = capture_order_error(expected, q, k)
        allowed = FACTOR[dtype] * max_error(baseline, expected) + steps * step + order
        assert err <= allowed, (f"{name}: max element error {err:.3e} > {FACTOR[dtype]:g} x the plain "
                                f"{str(dtype).removeprefix('torch.')} implementation's "
                                f"{max_error(baseline, expected):.3e} + {steps} rounding step(s) of {step:.1e}"
                                f" + the summation order's {order:.1e}"
                                + (" beyond the stored o's share" if shift is not None else ""))


def _stored_o_shift(got: Outputs, want: Outputs, q, k, v, mask, do, key_lengths, scale, score_mod,
                    dropout) -> Outputs:
    """The gradients (fp64) of ``sum_i eps_i * lse_i``, ``eps_i = do_i . (o_i - o_exact_i)`` with the o the
    backend returned: a backward that takes ``delta_i = do_i . o_i`` from the o it stored (rounded to the
    inputs' dtype, with the forward's error), as FlashAttention's does, moves every dS_ij by
    ``-P_ij * eps_i``, and so dq, dk and a captured tensor's gradient by minus these (dv not at all). The
    plain implementation's autograd takes delta from its fp32 softmax and has no such error. It shows
    where a gradient sums few rows (dk of decoding's 2 query rows: 4e-2 relative error against the exact
    gradient, 5e-3 against the exact gradient less this) or cancels down while the shift stays whole (a
    slope's: ``(kv_idx - q_idx) * dS``): each element's share is allowed on top of the other errors."""
    eps = ((got.o.detach().double() - want.o.detach().double()) * do.double()).sum(-1)
    return _oracle(q, k, v, mask, torch.zeros_like(do), key_lengths, scale, eps, True, score_mod, dropout)


def capture_order_error(expected: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> float:
    """What adding a captured tensor's gradient (``expected``) up in any order may cost in fp32: each
    entry sums the terms of up to B * H * S_q * S_kv / numel scores, whose rounding errors grow as
    the square root of their number (twice that, times fp32's step at the largest entry). Seen in fp32
    (every-op-score, 64 x 64, ~600 scores an entry, atomics per score): 15-17 steps in 1 of 12 runs."""
    finite = expected[torch.isfinite(expected)]
    if not finite.numel():
        return 0.0
    summed = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] / expected.numel()
    return 2 * summed ** 0.5 * torch.finfo(torch.float32).eps * finite.abs().max().item()


def check_backend(backend, q, k, v, mask, do, key_lengths=None, *, scale=None, dlse=None,
                  score_mod=None, compiler=None, dropout: SeededDropout | None = None) -> Outputs:
    """Run ``backend`` on the inputs (compiled by ``compiler``, if given; with ``dropout``), judge its
    outputs (``check_outputs``) and return them."""
    got = attention_with_grads(backend, q, k, v, mask, do, key_lengths, scale=scale, dlse=dlse, score_mod=score_mod,
                               compiler=compiler, dropout=dropout)
    check_outputs(got, q, k, v, mask, do, key_lengths, scale=scale, dlse=dlse, score_mod=score_mod, dropout=dropout)
    return got


def dkdv_query_rows(monkeypatch) -> None:
    """For the rest of the test, the backward's dK/dV programs (their own launch or the fused one) hold 16
    keys and stream 32 queries (as far as the mask blocks allow), so that their score tiles have the
    queries along the rows (backward.py, QUERY_ROWS), where the interpreter's square tile keeps the keys
    there; the other kernels keep their configs. Choices made meanwhile are dropped after the test. Nothing stands
    in for the backward on its first call (``launch.standing_in``, on hosts of many CPUs): its halves' launches
    are not tuned ones, which ``tuning.recording`` would not see."""
    from sparseflash.attention.triton import backward, tuning

    original = tuning.candidates
    monkeypatch.setattr(backward, "usable_cpus", lambda: 1)

    def candidates(kernel, key):
        if kernel in ("dkdv", "backward"):
            return [tuning.fit(kernel, tuning.KernelConfig(16, 32, 4, 1), key)]
        return original(kernel, key)

    monkeypatch.setattr(tuning, "_chosen", {})
    monkeypatch.setattr(tuning, "candidates", candidates)


def assert_dkdv_query_rows(launched) -> None:
    """The dK/dV programs of the recorded launches (``tuning.recording()``) streamed more queries than
    they held keys."""
    configs = [entry.config for entry in launched if entry.kernel in ("dkdv", "backward")]
    assert configs and all(cfg.block_n > cfg.block_m for cfg in configs), f"dK/dV configs {configs}"


def module_from_file(path: Path, name: str):
    """The Python file at ``path`` (a script, not a package module) imported as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
