"""The ``standard`` backend: a plain Transformer's attention (the whole score matrix in the inputs'
dtype), the baseline the kernels are timed against. In fp32 it is the reference, eager and under
``torch.compile``, with dropout's shared pattern; in 16 bits it carries a plain implementation's
rounding, judged against fp64 with that looser bound.
"""

from __future__ import annotations

import pytest
import torch

from tests.attention.test_compile import CASES, _case_mask, _fresh_dynamo  # noqa: F401 (autouse fixture)
from tests.attention.test_mods import _case_id, _inputs
from tests.helpers import NAMES, SeededDropout, _oracle, assert_close, attention_with_grads, check_backend

FP32_CASES = [(kind, q_len, kv_len, dim, torch.float32, gqa, lengths)
              for kind, q_len, kv_len, dim, _, gqa, lengths in CASES]
HALF_CASES = [case for case in CASES if case[4] is not torch.float32]
HALF_TOL = 5e-2  # bf16 scores: a score s is off by up to |s| * 2^-8 before the softmax


def _case(case, batch=2, heads=4):
    kind, q_len, kv_len, dim, dtype, gqa, key_lengths = case
    q, k, v, do = _inputs(batch, heads, heads // 2 if gqa else heads, q_len, kv_len, dim, dtype, "cpu")
    mask, score_mod = _case_mask(kind, q_len, kv_len, batch, heads, "cpu")
    lengths = torch.tensor([kv_len * 2 // 3 + 1, 0]) if key_lengths else None
    return q, k, v, do, mask, score_mod, lengths


@pytest.mark.parametrize("compiler", [None, "aot_eager"], ids=["eager", "compiled"])
@pytest.mark.parametrize("dropout", [None, SeededDropout(0.25, 7)], ids=["no-dropout", "dropout0.25"])
@pytest.mark.parametrize("case", FP32_CASES, ids=_case_id)
def test_standard_fp32_is_the_reference(case, dropout, compiler):
    q, k, v, do, mask, score_mod, lengths = _case(case)
    check_backend("standard", q, k, v, mask, do, lengths, score_mod=score_mod, compiler=compiler, dropout=dropout)


@pytest.mark.parametrize("case", HALF_CASES, ids=_case_id)
def test_standard_16bit_against_fp64(case):
    q, k, v, do, mask, score_mod, lengths = _case(case)
    got = attention_with_grads("standard", q, k, v, mask, do, lengths, score_mod=score_mod)
    expected = _oracle(q, k, v, mask, do, lengths, None, None, upcast=True, score_mod=score_mod)
    for name, actual, want in zip(NAMES, got, expected):
        if name == "lse":  # -inf exactly on the rows with no key, else close relative to 1 + |lse|
            per_row = 1 + torch.where(torch.isfinite(want), want.abs(), 0)
            assert_close(actual / per_row, want / per_row, HALF_TOL, name)
        else:
            assert_close(actual, want, HALF_TOL, name)
