"""Triton bugs the kernels work around, checked to still bite (docs/kernels.md, "Triton bugs worked around, and
how to check they still bite"). A test here fails once Triton fixes its bug: its message says which workaround
can then go. The bugs of Hopper compiles are checked by hand there (they need a GPU, or a patch of a kernel)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from sparseflash.attention.triton.launch import interpreting
from sparseflash.attention.triton.tiles import mma
from tests.helpers import assert_close, relative_error

SIDE = 32


@triton.jit
def _product(A, B, C, SIDE: tl.constexpr, WIDEN_DOTS: tl.constexpr):
    """C = A B for SIDE x SIDE row-major tiles, through ``tiles.mma``."""
    rows = tl.arange(0, SIDE)
    offsets = rows[:, None] * SIDE + rows[None, :]
    tl.store(C + offsets, mma(tl.load(A + offsets), tl.load(B + offsets), None, "ieee", WIDEN_DOTS))


@pytest.mark.skipif(not interpreting(), reason="a bug of Triton's CPU interpreter")
def test_the_interpreters_bf16_dot_is_still_wrong_and_widened_operands_are_right():
    a, b = (torch.randn(SIDE, SIDE, dtype=torch.bfloat16) for _ in range(2))
    expected = a.float() @ b.float()
    raw, widened = torch.empty(SIDE, SIDE), torch.empty(SIDE, SIDE)
    _product[(1,)](a, b, raw, SIDE=SIDE, WIDEN_DOTS=False)
    _product[(1,)](a, b, widened, SIDE=SIDE, WIDEN_DOTS=True)
    assert_close(widened, expected, 1e-5, "the product of operands widened to fp32")
    assert relative_error(raw, expected) > 1.0, (
        f"the interpreter's bf16 dot is right with Triton {triton.__version__}: WIDEN_DOTS (tiles.mma, "
        "plan.constexprs) can go")
