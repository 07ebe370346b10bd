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


def _projections(module: SparseAttention, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v (B, heads, S, head_dim) of the module's projections, written out."""
    b, s, _ = x.shape
    q = module.to_q(x).view(b, s, module.heads, module.head_dim).transpose(1, 2)
    kv = module.to_kv(x).view(b, s, 2, module.kv_heads, module.head_dim)
    return q, kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)


def _output(module: SparseAttention, o: torch.Tensor) -> torch.Tensor:
    """The output projection of the heads' outputs o (B, heads, S, head_dim)."""
    b, h, s, d = o.shape
    return module.to_out(o.transpose(1, 2).reshape(b, s, h * d))


def _manual(module: SparseAttention, x: torch.Tensor, mask, key_lengths=None) -> torch.Tensor:
    """The module's computation written out: projections, reference attention, output projection."""
    q, k, v = _projections(module, x)
    return _output(module, sparseflash.attention(q, k, v, mask, key_lengths=key_lengths, backend="reference"))


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
    with pytest.raises(ValueError, match=r"SparseAttention's heads must be an int >= 1; got 0"):
        SparseAttention(32, 0)
    with pytest.raises(ValueError, match=r"SparseAttention's heads must be an int >= 1; got -2"):
        SparseAttention(32, -2)
    with pytest.raises(ValueError, match=r"SparseAttention's kv_heads must be an int >= 1; got 0"):
        SparseAttention(32, 4, kv_heads=0)
    with pytest.raises(ValueError, match=r"unknown backend 'foo'; expected one of: auto, "):
        SparseAttention(32, 4, backend="foo")
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
    with pytest.raises(ValueError, match=r"takes x of shape \(B, S, 32\); got list"):
        module([[0.0] * DIM])


def _manual_left_out(module: SparseAttention, x: torch.Tensor, causal: bool, key_mask: torch.Tensor,
                     key_lengths=None) -> torch.Tensor:
    """The module's computation with the keys ``key_mask`` leaves out, written out over the whole score
    matrix: GQA heads repeated, ALiBi where the module has it, keys past ``key_lengths`` out (a row with
    no key left gives 0)."""
    q, k, v = (t.double() for t in _projections(module, x))
    k, v = (t.repeat_interleave(module.heads // module.kv_heads, dim=1) for t in (k, v))
    b, s = key_mask.shape
    positions = torch.arange(s, device=x.device)
    allowed = key_mask[:, None, None, :].expand(b, 1, s, s)
    if causal:
        allowed = allowed & (positions[:, None] >= positions[None, :])
    if key_lengths is not None:
        allowed = allowed & (positions < key_lengths[:, None])[:, None, None, :]
    scores = q @ k.transpose(-1, -2) / module.head_dim ** 0.5
    if module.score_mod is not None:  # ALiBi
        scores = scores + module.score_mod.slopes.double()[:, None, None] * (positions[None, :] - positions[:, None])
    p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    return _output(module, (p @ v).to(x.dtype))


@pytest.mark.parametrize("backend", ["reference", "blocked", "triton"])
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
@pytest.mark.parametrize("variant", ["plain", "gqa-lengths-alibi"])
def test_key_mask_leaves_keys_out_anywhere_in_the_sequence(backend, causal, variant):
    extra = variant != "plain"
    module = SparseAttention(DIM, HEADS, mask="causal" if causal else None, backend=backend,
                             kv_heads=2 if extra else None, score_mod="alibi" if extra else None)
    x = torch.randn(3, 37, DIM, requires_grad=True)
    key_mask = torch.rand(3, 37) < 0.3
    key_mask[1] = False  # a batch entry with no key at all: every row empty
    key_mask[2, 0] = False  # under causal, row 0 of entry 2 sees nothing
    key_lengths = torch.tensor([37, 20, 11]) if extra else None
    out = module(x, key_lengths, key_mask)
    expected = _manual_left_out(module, x, causal, key_mask, key_lengths)
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
    with pytest.raises(ValueError, match="on meta"):
        module(x, key_mask=torch.ones(2, 10, dtype=torch.bool, device="meta"))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_gpu_key_mask_leaves_keys_out(causal):
    """The kernels on CUDA (bf16, a realistic length): the key mask's separable path against the whole
    score matrix, o and dx, with GQA, key_lengths and ALiBi."""
    module = SparseAttention(256, 4, mask="causal" if causal else None, kv_heads=2, score_mod="alibi",
                             backend="triton").cuda().bfloat16()
    x = torch.randn(2, 1000, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    key_mask = torch.rand(2, 1000, device="cuda") < 0.15
    key_lengths = torch.tensor([1000, 613], device="cuda")
    out = module(x, key_lengths, key_mask)
    expected = _manual_left_out(module, x, causal, key_mask, key_lengths)
    assert_close(out.float(), expected.float(), 2e-2, "o")
    grad = torch.randn_like(out)
    (got,) = torch.autograd.grad(out, x, grad)
    (want,) = torch.autograd.grad(expected, x, grad)
    assert_close(got.float(), want.float(), 3e-2, "dx")
