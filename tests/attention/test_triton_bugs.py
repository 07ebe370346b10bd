"""Triton bugs the kernels work around, checked to still bite (docs/kernels.md, "Triton bugs worked around, and
how to check they still bite"). A test here fails once Triton fixes its bug: its message says which workaround
can then go. The warp-specialisation pass's aborts are compiled for Hopper on the CPU from minimal reproducers
(``sm90_ws_bugs.py``); the bugs that show only in a run on a GPU are checked by hand there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


# what the pass aborts on (sm90_ws_bugs.VARIANTS), and the workaround that can go once it compiles
WARP_SPECIALISATION_ABORTS = {
    "second_loop": "the persistent forward walks CAUSAL's diagonal tiles and a SPARSE mask's partial tiles in its one "
                   "key loop, masking every tile (forward_persistent.py)",
    "column_sum": "the persistent forward evaluates a score function's row term on the rows' position vector, not "
                  "summed over a column (forward_persistent.py)",
    "row_load": "a warp-specialised dQ program may load its rows' lse2 and delta with tl.load, not through 1-D TMA "
                "descriptors as the prototype did (docs/kernels.md, \"The backward\")",
}


@pytest.mark.parametrize("bug", sorted(WARP_SPECIALISATION_ABORTS))
def test_the_warp_specialisation_pass_still_aborts(bug, tmp_path):
    """``sm90_ws_bugs``'s loop compiles for sm_90a as it is (the control) and the warp-specialisation pass aborts on
    it with the bug's one construct added."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "tests.attention.sm90_ws_bugs", "plain", bug],
                            cwd=Path(__file__).parents[2], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "compiled plain" in result.stdout, result.stderr[-4000:]
    assert f"failed {bug}" in result.stdout, (
        f"Triton {triton.__version__} warp-specialises the loop with {bug}: {WARP_SPECIALISATION_ABORTS[bug]} "
        "can change")
    assert "NVGPUWarpSpecialization" in result.stderr, result.stderr[-4000:]  # (the pass that aborted)
