"""SparseAttention: shapes, mask specs, GQA, key_lengths, gradients, and that it is plain
multi-head attention around ``sparseflash.attention``."""

from __future__ import annotations

import pytest
import torch

import sparseflash
from sparseflash import SparseAttention
from sparseflash.masks import make
from tests.helpers import assert_close

DIM, HEADS = 32, 4


def _manual(module: SparseAttention, x: torch.Tensor, mask, key_lengths=None) -> torch.Tensor:
    """The module's computation written out: projections, reference attention, output projection."""
    b, s, _ = x.shape
    hd = module.head_dim
    q = module.to_q(x).view(b, s, module.heads, hd).transpose(1, 2)
    kv = module.to_kv(x).view(b, s, 2, module.kv_heads, hd)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    o = sparseflash.attention(q, k, v, mask, key_lengths=key_lengths, backend="reference")
    return module.to_out(o.transpose(1, 2).reshape(b, s, module.heads * hd))


SPECS = {
    "none": (None, lambda s, h: None),
    "causal": ("causal", lambda s, h: "causal"),
    "pattern-name": ("butterfly", lambda s, h: make("butterfly", s)),
    "dict": ({"pattern": "local", "block": 16, "causal": True, "params": {"window": 1}},
             lambda s, h: make("local", s, block=16, causal=True, window=1)),
    "dict-per-head": ({"pattern": "random", "block": 16, "per_head": True, "params": {"density": 0.4, "seed": 3}},
                      lambda s, h: make("random", s, block=16, heads=h, density=0.4, seed=3)),
    "block-mask": (make("bigbird", 70, block=16), lambda s, h: make("bigbird", 70, block=16)),
}


@pytest.mark.parametrize("kv_heads", [None, 2, 1], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("spec", list(SPECS))
def test_matches_manual_attention(spec, kv_heads):
    mask_spec, expected_mask = SPECS[spec]
    module = SparseAttention(DIM, HEADS, mask=mask_spec, backend="blocked", kv_heads=kv_heads)
    x = torch.randn(2, 70, DIM)
    y = module(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_close(y, _manual(module, x, expected_mask(70, HEADS)), 1e-5, "module output")


def test_mask_built_once_per_length():
    module = SparseAttention(DIM, HEADS, mask={"pattern": "butterfly", "block": 16}, backend="blocked")
    a = module.mask_for(100)
    assert module.mask_for(100) is a
    assert a == make("butterfly", 100, block=16)
    b = module.mask_for(37)
    assert (b.q_len, b.kv_len) == (37, 37)
    for s in (100, 37):
        assert module(torch.randn(1, s, DIM)).shape == (1, s, DIM)


def test_key_lengths():
    module = SparseAttention(DIM, HEADS, mask="causal", backend="blocked", kv_heads=2)
    x = torch.randn(2, 60, DIM)
    lengths = torch.tensor([60, 25])
    y = module(x, key_lengths=lengths)
    assert_close(y, _manual(module, x, "causal", lengths), 1e-5, "module output with key_lengths")
    # padding past key_lengths does not change the first 25 positions of the second sequence
    x2 = x.clone()
    x2[1, 25:] = torch.randn(35, DIM)
    assert_close(module(x2, key_lengths=lengths)[1, :25], y[1, :25], 1e-6, "unpadded positions")


def test_gradients_flow():
    module = SparseAttention(DIM, HEADS, mask={"pattern": "random", "block": 16, "per_head": True},
                             backend="blocked", kv_heads=2)
    x = torch.randn(2, 50, DIM, requires_grad=True)
    module(x, key_lengths=torch.tensor([50, 31])).square().mean().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    for name, p in module.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_blocked_and_reference_modules_agree():
    blocked = SparseAttention(DIM, HEADS, mask={"pattern": "bigbird", "block": 16}, backend="blocked", kv_heads=2)
    reference = SparseAttention(DIM, HEADS, mask={"pattern": "bigbird", "block": 16}, backend="reference", kv_heads=2)
    reference.load_state_dict(blocked.state_dict())
    x = torch.randn(2, 90, DIM)
    grads = []
    for module in (blocked, reference):
        xi = x.clone().requires_grad_(True)
        y = module(xi)
        y.backward(torch.ones_like(y))
        grads.append((y, xi.grad, module.to_q.weight.grad, module.to_kv.weight.grad))
    for name, a, b in zip(("y", "dx", "dWq", "dWkv"), *grads):
        assert_close(a, b, 1e-5, name)


def test_bad_construction_and_specs():
    with pytest.raises(ValueError, match=r"need dim % heads == 0 and heads % kv_heads == 0; got dim=30, heads=4, kv_heads=4"):
        SparseAttention(30, 4)
    with pytest.raises(ValueError, match=r"got dim=32, heads=4, kv_heads=3"):
        SparseAttention(32, 4, kv_heads=3)
    # a bad mask spec fails where the module is built, not at its first forward
    with pytest.raises(ValueError, match=r"a mask spec needs 'pattern' and may set .*; got keys \['pattern', 'size'\]"):
        SparseAttention(DIM, HEADS, mask={"pattern": "local", "size": 2})
    with pytest.raises(ValueError, match=r"got keys \['block'\]"):
        SparseAttention(DIM, HEADS, mask={"block": 16})
    with pytest.raises(ValueError, match=r"unknown pattern 'no-such-pattern'"):
        SparseAttention(DIM, HEADS, mask="no-such-pattern")
    with pytest.raises(ValueError, match=r"pattern 'local' takes parameters \['window'\]; got \['size'\]"):
        SparseAttention(DIM, HEADS, mask=sparseflash.masks.MaskSpec("local", {"size": 2}))
    with pytest.raises(ValueError, match=r"SPARSE_BLOCK_M must be a power of two"):
        SparseAttention(DIM, HEADS, mask={"pattern": "local", "block": 48})
    module = SparseAttention(DIM, HEADS, mask=make("dense", 64, block=16))  # built for another length
    with pytest.raises(ValueError, match=r"mask was built for q_len=64, kv_len=64; the inputs have S_q=20, S_kv=20"):
        module(torch.randn(1, 20, DIM))
    module = SparseAttention(DIM, HEADS)
    with pytest.raises(ValueError, match=r"SparseAttention\(dim=32\) takes x of shape \(B, S, 32\); got \(1, 20, 16\)"):
        module(torch.randn(1, 20, 16))


def _manual_left_out(module: SparseAttention, x: torch.Tensor, causal: bool, key_mask: torch.Tensor) -> torch.Tensor:
    """The module's computation with the keys ``key_mask`` leaves out, written out over the whole score
    matrix (a row with no key left gives 0)."""
    b, s, _ = x.shape
    hd = module.head_dim
    q = module.to_q(x).view(b, s, module.heads, hd).transpose(1, 2).double()
    kv = module.to_kv(x).view(b, s, 2, module.kv_heads, hd).double()
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    allowed = key_mask[:, None, None, :].expand(b, 1, s, s)
    if causal:
        allowed = allowed & torch.ones(s, s, dtype=torch.bool).tril()
    scores = (q @ k.transpose(-1, -2) / hd ** 0.5).masked_fill(~allowed, float("-inf"))
    p = torch.softmax(scores, -1).nan_to_num(0.0)
    o = (p @ v).to(x.dtype)
    return module.to_out(o.transpose(1, 2).reshape(b, s, module.heads * hd))


@pytest.mark.parametrize("backend", ["reference", "blocked", "triton"])
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_key_mask_leaves_keys_out_anywhere_in_the_sequence(backend, causal):
    module = SparseAttention(DIM, HEADS, mask="causal" if causal else None, backend=backend)
    x = torch.randn(3, 37, DIM, requires_grad=True)
    key_mask = torch.rand(3, 37) < 0.3
    key_mask[1] = False  # a batch entry with no key at all: every row empty
    key_mask[2, 0] = False  # under causal, row 0 of entry 2 sees nothing
    out, expected = module(x, key_mask=key_mask), _manual_left_out(module, x, causal, key_mask)
    assert_close(out, expected, 1e-4, "o")
    grad = torch.randn_like(out)
    (got,) = torch.autograd.grad(out, x, grad)
    (want,) = torch.autograd.grad(expected, x, grad)
    assert_close(got, want, 1e-4, "dx")


def test_key_mask_must_be_bool_of_the_inputs_batch_and_length():
    module = SparseAttention(DIM, HEADS)
    x = torch.randn(2, 10, DIM)
    with pytest.raises(ValueError, match=r"key_mask must be a bool tensor of shape \(2, 10\)"):
        module(x, key_mask=torch.ones(2, 9, dtype=torch.bool))
    with pytest.raises(ValueError, match="got torch.float32"):
        module(x, key_mask=torch.ones(2, 10))
