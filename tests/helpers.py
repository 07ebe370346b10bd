"""How the attention tests judge a backend: against an fp64 oracle, element by element.

As FlashAttention's tests do it, an output is compared with the reference run in fp64 on the same
(low-precision) inputs, and its largest element error must stay within ``FACTOR`` times the largest
error of a plain PyTorch implementation in the inputs' own precision (``reference_attention(...,
upcast=False)``: scores and ``p @ v`` in that dtype, the softmax in fp32), plus one rounding step of
the dtype at the tensor's largest magnitude (outputs are rounded to it once). So a few corrupted
rows fail even where a whole-tensor norm would hide them. The relative error over the tensor must
stay within the dtype's ``REL_TOL`` too, nothing may be NaN, and the ``-inf`` entries of lse (rows
that see no key) must match exactly. lse is computed in fp32 by every backend and is held to an
fp32 tolerance (``LSE_TOL``), except for fp32 inputs on a GPU, whose dots run in TF32 by design:
there the baseline also uses TF32, and lse follows the ``FACTOR`` rule.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

import sparseflash
from sparseflash.attention import resolve_mask
from sparseflash.attention.reference import reference_attention

FACTOR = {torch.float16: 2.0, torch.bfloat16: 2.0, torch.float32: 8.0}
REL_TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 1e-5}
LSE_TOL = 1e-5  # absolute and relative: |lse - lse_ref| <= LSE_TOL * (1 + |lse_ref|)
NAMES = ("o", "lse", "dq", "dk", "dv")


class Outputs(NamedTuple):
    o: torch.Tensor
    lse: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor


def _loss(o, lse, do, dlse):
    """``sum(o * do)``, plus ``sum(lse * dlse)`` over the rows that see a key when ``dlse`` is given."""
    work = torch.promote_types(o.dtype, torch.float32)
    loss = (o.to(work) * do.to(work)).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)) * dlse).sum()
    return loss


def _grads(run, q, k, v, do, dlse) -> Outputs:
    """``run(q, k, v) -> (o, lse)`` and the gradients of ``_loss``; q, k, v keep their layout."""
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    o, lse = run(q, k, v)
    dq, dk, dv = torch.autograd.grad(_loss(o, lse, do, dlse), (q, k, v))
    return Outputs(o, lse, dq, dk, dv)


def attention_with_grads(backend, q, k, v, mask, do, key_lengths=None, *, scale=None, dlse=None) -> Outputs:
    """``(o, lse, dq, dk, dv)`` of ``sparseflash.attention`` through ``backend`` for the loss
    ``sum(o * do)`` (``+ sum(lse * dlse)`` over rows that see a key, with ``dlse``)."""
    def run(q, k, v):
        return sparseflash.attention(q, k, v, mask, key_lengths=key_lengths, scale=scale, backend=backend,
                                     return_lse=True)
    return _grads(run, q, k, v, do, dlse)


def _oracle(q, k, v, mask, do, key_lengths, scale, dlse, upcast: bool) -> Outputs:
    """The reference in fp64 (``upcast``), or in the inputs' precision."""
    block_mask = resolve_mask(mask, q.shape[2], k.shape[2], q.shape[1])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if upcast:
        q, k, v, do = (x.double() for x in (q, k, v, do))
    tf32 = (torch.backends.cuda.matmul, "allow_tf32", q.dtype is torch.float32 and q.is_cuda)
    with _flag(*tf32):  # the kernels' fp32 dots are TF32 on a GPU: so is the baseline's
        return _grads(lambda q, k, v: reference_attention(q, k, v, block_mask, key_lengths, scale, upcast=upcast),
                      q, k, v, do, dlse)


@contextlib.contextmanager
def _flag(owner, name: str, value: bool):
    before = getattr(owner, name)
    setattr(owner, name, value or before)
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
                  names=NAMES) -> None:
    """Judge ``got`` (a backend's ``Outputs`` for these inputs) as the module docstring says."""
    dtype = q.dtype
    want = _oracle(q, k, v, mask, do, key_lengths, scale, dlse, upcast=True)
    plain = _oracle(q, k, v, mask, do, key_lengths, scale, dlse, upcast=False)
    tf32 = dtype is torch.float32 and q.is_cuda
    for name in names:
        actual, expected, baseline = getattr(got, name), getattr(want, name), getattr(plain, name)
        assert actual.dtype == (torch.float32 if name == "lse" else dtype), f"{name}: dtype {actual.dtype}"
        assert_close(actual, expected, REL_TOL[dtype], name)
        err = max_error(actual, expected)
        if name == "lse" and not tf32:
            bound = (LSE_TOL * (1 + expected.abs())).where(torch.isfinite(expected), 0)
            worst = ((actual.double() - expected).abs().where(torch.isfinite(expected), 0) - bound).max().item()
            assert worst <= 0, f"lse: error {err:.2e} beyond the fp32 tolerance {LSE_TOL:.0e} x (1 + |lse|)"
            continue
        step = torch.finfo(dtype).eps * expected[torch.isfinite(expected)].abs().max().item() if expected.numel() else 0
        allowed = FACTOR[dtype] * max_error(baseline, expected) + step
        assert err <= allowed, (f"{name}: max element error {err:.3e} > {FACTOR[dtype]:g} x the plain "
                                f"{str(dtype).removeprefix('torch.')} implementation's "
                                f"{max_error(baseline, expected):.3e} + one rounding step {step:.1e}")


def check_backend(backend, q, k, v, mask, do, key_lengths=None, *, scale=None, dlse=None) -> Outputs:
    """Run ``backend`` on the inputs, judge its outputs (``check_outputs``) and return them."""
    got = attention_with_grads(backend, q, k, v, mask, do, key_lengths, scale=scale, dlse=dlse)
    check_outputs(got, q, k, v, mask, do, key_lengths, scale=scale, dlse=dlse)
    return got
