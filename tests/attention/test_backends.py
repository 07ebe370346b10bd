"""Grids every backend must pass, judged against the fp64 reference (``tests.helpers.check_outputs``):
GQA groups of 1, 2, 4 and 8 and MQA, non-default scales, rows emptied inside a computed tile, and a
loss through both o and lse. ``triton`` runs under the interpreter on CPU (small shapes) and
compiled on a GPU; ``gpu`` repeats the grids at realistic sizes there.
"""

from __future__ import annotations

import pytest
import torch

from sparseflash.masks import from_layout, make
from tests.helpers import check_backend

BACKENDS = ["triton", "blocked", "reference"]


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(batch, heads, kv_heads, q_len, kv_len, dim, dtype, device=None):
    device = device or _device()
    q = torch.randn(batch, heads, q_len, dim, dtype=dtype, device=device)
    k = torch.randn(batch, kv_heads, kv_len, dim, dtype=dtype, device=device)
    v = torch.randn(batch, kv_heads, kv_len, dim, dtype=dtype, device=device)
    do = torch.randn(batch, heads, q_len, dim, dtype=dtype, device=device)
    return q, k, v, do


def _mask(kind: str, q_len: int, kv_len: int, heads: int):
    if kind == "causal":
        return make("causal", q_len, kv_len, block=32)
    if kind == "butterfly":
        return make("butterfly", q_len, kv_len, block=(32, 16))
    if kind == "random-per-head":
        return make("random", q_len, kv_len, block=16, heads=heads, density=0.4)
    raise ValueError(kind)


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ---------------------------------------------------------------------------- GQA
GQA = [(8, 8), (8, 4), (8, 2), (8, 1), (3, 1)]  # (H, H_kv): groups 1, 2, 4, 8 (MQA) and an MQA group of 3


@pytest.mark.parametrize("heads, kv_heads", GQA, ids=[f"H{h}-Hkv{k}" for h, k in GQA])
@pytest.mark.parametrize("kind", ["causal", "random-per-head"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_gqa_groups(backend, kind, heads, kv_heads):
    """dK/dV of a key/value head sum over every query head of its group (not only the first ones)."""
    q, k, v, do = _inputs(2, heads, kv_heads, 70, 90, 16, torch.bfloat16)
    check_backend(backend, q, k, v, _mask(kind, 70, 90, heads), do, torch.tensor([90, 41], device=q.device))


# ---------------------------------------------------------------------------- scale
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("scale", [0.05, 2.0], ids=["scale0.05", "scale2"])
@pytest.mark.parametrize("kind", ["causal", "butterfly"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_non_default_scale(backend, kind, scale, dtype):
    """A user's scale reaches the forward and every gradient (1/sqrt(D) = 0.25 here, so both differ)."""
    q, k, v, do = _inputs(2, 4, 2, 63, 63, 16, DTYPES[dtype])
    check_backend(backend, q, k, v, _mask(kind, 63, 63, 4), do, scale=scale)


# ---------------------------------------------------------------------------- rows emptied inside a tile
def _emptied_in_tile(q_len: int, kv_len: int):
    """Causal, 64 x 16 blocks; query block 0 computes only key block 1: queries 0-15 lie in a computed
    tile but see no key in it (every key there is after them), so they see none at all."""
    n_q, n_kv = -(-q_len // 64), -(-kv_len // 16)
    layout = torch.ones(n_q, n_kv, dtype=torch.bool)
    layout[0] = False
    layout[0, 1] = True
    return from_layout(layout, block=(64, 16), q_len=q_len, kv_len=kv_len, causal=True)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_emptied_inside_a_computed_tile(backend, dtype):
    q, k, v, do = _inputs(2, 2, 1, 150, 150, 16, DTYPES[dtype])
    o, lse, dq, _, _ = check_backend(backend, q, k, v, _emptied_in_tile(150, 150), do)
    assert torch.all(o[:, :, :16] == 0) and torch.all(lse[:, :, :16] == float("-inf"))
    assert torch.all(dq[:, :, :16] == 0)
    assert torch.isfinite(lse[:, :, 16:]).all()


# ---------------------------------------------------------------------------- a loss through o and lse
@pytest.mark.parametrize("kind", ["causal", "random-per-head"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_loss_through_o_and_lse(backend, kind):
    """d lse / d s = p: the gradients of sum(o * do) + sum(lse * dlse), with rows of no key (key_lengths 0)."""
    q, k, v, do = _inputs(2, 4, 2, 70, 90, 16, torch.float16)
    dlse = torch.randn(2, 4, 70, device=q.device)
    check_backend(backend, q, k, v, _mask(kind, 70, 90, 4), do, torch.tensor([90, 0], device=q.device), dlse=dlse)


# ---------------------------------------------------------------------------- GPU, realistic sizes
@pytest.mark.gpu
@pytest.mark.parametrize("heads, kv_heads", GQA[1:], ids=[f"H{h}-Hkv{k}" for h, k in GQA[1:]])
@pytest.mark.parametrize("scale", [None, 0.05, 2.0], ids=["default-scale", "scale0.05", "scale2"])
def test_gpu_gqa_and_scale(heads, kv_heads, scale):
    q, k, v, do = _inputs(2, heads, kv_heads, 2000, 2000, 128, torch.bfloat16, "cuda")
    mask = make("butterfly", 2000, block=128)
    dlse = torch.randn(2, heads, 2000, device="cuda")
    check_backend("triton", q, k, v, mask, do, torch.tensor([2000, 777], device="cuda"), scale=scale, dlse=dlse)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_gpu_rows_emptied_inside_a_computed_tile(dtype):
    q, k, v, do = _inputs(2, 4, 2, 1000, 1000, 64, DTYPES[dtype], "cuda")
    o, lse, dq, _, _ = check_backend("triton", q, k, v, _emptied_in_tile(1000, 1000), do)
    assert torch.all(o[:, :, :16] == 0) and torch.all(lse[:, :, :16] == float("-inf")) and torch.all(dq[:, :, :16] == 0)
