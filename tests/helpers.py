"""Comparison helpers shared by the attention tests."""

from __future__ import annotations

import torch

import sparseflash


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` over the finite entries of ``expected``.

    Non-finite entries (``lse = -inf`` on rows with no visible key) must match exactly."""
    actual, expected = actual.detach().float(), expected.detach().float()
    finite = torch.isfinite(expected)
    mismatched = (actual[~finite] != expected[~finite]).sum().item()
    assert mismatched == 0, f"{mismatched} non-finite entries differ (e.g. lse of empty rows must be -inf)"
    diff = (actual - expected)[finite]
    return (diff.norm() / expected[finite].norm().clamp_min(1e-6)).item()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, name: str) -> None:
    """No NaN, same shape, and relative error at most ``tol``."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert not torch.isnan(actual).any(), f"{name} contains NaN"
    err = relative_error(actual, expected)
    assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.1e}"


def attention_with_grads(backend, q, k, v, mask, do, key_lengths=None):
    """``(o, lse, dq, dk, dv)`` of ``attention`` through ``backend`` for the loss ``sum(o * do)``;
    q, k, v keep their layout (strides, storage offset)."""
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    o, lse = sparseflash.attention(q, k, v, mask, key_lengths=key_lengths, backend=backend, return_lse=True)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    return o, lse, dq, dk, dv
