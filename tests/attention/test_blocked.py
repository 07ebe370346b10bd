"""The blocked backend (the FA2 loop in PyTorch) against the reference oracle.

Every test compares ``o``, ``lse`` and the three gradients of ``sum(o * do)`` on random inputs
(fresh seed per session, see conftest) by relative error, and checks for NaN. The grids cover
every axis the issue names -- mask kind, lengths (63/111/1000, S_q != S_kv), head dims
(8/64/128), fp32 and bf16, GQA, key_lengths, fully masked rows -- without the full cartesian
product: large lengths run with small head dims and large blocks.
"""

from __future__ import annotations

import pytest
import torch

import sparseflash
from sparseflash.attention import blocked
from sparseflash.masks import BlockMask, from_layout, make
from tests.helpers import assert_close, attention_with_grads, check_backend

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
NAMES = ("o", "lse", "dq", "dk", "dv")


def _mask(kind: str, q_len: int, kv_len: int, heads: int) -> BlockMask | str | None:
    """One mask of each kind, with small blocks so that short sequences have many tiles."""
    if kind == "none":  # mask=None: dense, built by the API
        return None
    if kind == "causal-str":  # mask="causal", built by the API with the default block
        return "causal"
    if kind == "dense":
        return make("dense", q_len, kv_len, block=32)
    if kind == "causal":
        return make("causal", q_len, kv_len, block=16)
    if kind == "butterfly":
        return make("butterfly", q_len, kv_len, block=(32, 16))
    if kind == "butterfly-global":
        return make("butterfly", q_len, kv_len, block=16, factors=2, global_blocks=1)
    if kind == "local":
        return make("local", q_len, kv_len, block=16, window=1)
    if kind == "local-causal":
        return make("local", q_len, kv_len, block=16, causal=True, window=2)
    if kind == "strided":
        return make("strided", q_len, kv_len, block=16, stride=3)
    if kind == "longformer":
        return make("longformer", q_len, kv_len, block=16, window=1, global_blocks=1)
    if kind == "random":
        return make("random", q_len, kv_len, block=16, density=0.3, seed=7)
    if kind == "bigbird":
        return make("bigbird", q_len, kv_len, block=16, window=1, global_blocks=1, random_blocks=1)
    if kind == "per-head":  # a different random layout for every head
        return make("random", q_len, kv_len, block=16, heads=heads, density=0.4)
    if kind == "per-head-causal":
        return make("bigbird", q_len, kv_len, block=(16, 32), heads=heads, causal=True)
    if kind == "empty-rows":  # query blocks 0 and 2 see nothing
        layout = torch.rand(heads, -(-q_len // 16), -(-kv_len // 16)) < 0.5
        layout[:, 0] = layout[:, 2] = False
        layout[:, 1, 0] = True
        return from_layout(layout, block=16, q_len=q_len, kv_len=kv_len)
    if kind == "all-empty":
        layout = torch.zeros(1, -(-q_len // 16), -(-kv_len // 16), dtype=torch.bool)
        return from_layout(layout, block=16, q_len=q_len, kv_len=kv_len)
    raise ValueError(kind)


def _inputs(batch, heads, kv_heads, q_len, kv_len, dim, dtype):
    q = torch.randn(batch, heads, q_len, dim, dtype=dtype)
    k = torch.randn(batch, kv_heads, kv_len, dim, dtype=dtype)
    v = torch.randn(batch, kv_heads, kv_len, dim, dtype=dtype)
    do = torch.randn(batch, heads, q_len, dim, dtype=dtype)
    return q, k, v, do


def _compare(mask, q, k, v, do, key_lengths=None):
    """blocked against the fp64 reference (``tests.helpers.check_outputs``): o, lse, dq, dk, dv;
    returns the blocked results."""
    return check_backend("blocked", q, k, v, mask, do, key_lengths)


# ---------------------------------------------------------------------------- every mask kind
KINDS = [
    "none", "causal-str", "dense", "causal", "butterfly", "butterfly-global", "local", "local-causal",
    "strided", "longformer", "random", "bigbird", "per-head", "per-head-causal", "empty-rows",
]


@pytest.mark.parametrize("lengths", [(111, 111), (63, 130)], ids=lambda s: f"sq{s[0]}-skv{s[1]}")
@pytest.mark.parametrize("kind", KINDS)
def test_mask_kinds(kind, lengths):
    q_len, kv_len = lengths
    q, k, v, do = _inputs(2, 2, 2, q_len, kv_len, 16, torch.float32)
    _compare(_mask(kind, q_len, kv_len, heads=2), q, k, v, do)


@pytest.mark.parametrize("kind", ["causal", "butterfly", "per-head", "empty-rows"])
def test_one_tile_per_chunk(kind, monkeypatch):
    """Force every tile into its own chunk: the online softmax must merge across chunks."""
    monkeypatch.setattr(blocked, "SCORE_BYTES_PER_CHUNK", 1)
    q, k, v, do = _inputs(2, 2, 1, 70, 50, 8, torch.float32)
    _compare(_mask(kind, 70, 50, heads=2), q, k, v, do, key_lengths=torch.tensor([50, 21]))


# ---------------------------------------------------------------------------- lengths
LENGTH_CASES = [
    # q_len, kv_len, mask kind, block (large lengths: small head dim, large blocks)
    (63, 63, "causal", 16),
    (111, 111, "butterfly", 16),
    (1000, 1000, "dense", 128),
    (1000, 1000, "causal", 64),
    (1000, 1000, "butterfly", 64),
    (1000, 1000, "local", 128),
    (63, 1000, "causal", 64),
    (1000, 111, "causal", 32),
    (111, 63, "random", 16),
    (1, 63, "dense", 16),
    (63, 2, "dense", 16),
    (17, 200, "butterfly", 16),
]


@pytest.mark.parametrize(
    "q_len,kv_len,kind,block", LENGTH_CASES, ids=[f"sq{a}-skv{b}-{c}-blk{d}" for a, b, c, d in LENGTH_CASES]
)
def test_lengths(q_len, kv_len, kind, block):
    params = {"window": 1} if kind == "local" else {}
    mask = make(kind, q_len, kv_len, block=block, **params)
    q, k, v, do = _inputs(1, 2, 2, q_len, kv_len, 8, torch.float32)
    _compare(mask, q, k, v, do)


# ---------------------------------------------------------------------------- head dims and dtypes
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dim", [8, 64, 128], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("kind", ["causal", "butterfly", "per-head"])
def test_head_dims_and_dtypes(kind, dim, dtype):
    q, k, v, do = _inputs(2, 2, 2, 111, 95, dim, dtype)
    got = _compare(_mask(kind, 111, 95, heads=2), q, k, v, do)
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    assert all(g.dtype == dtype for g in got[2:])


def test_bf16_close_to_fp32_truth():
    """bf16 inputs through the blocked loop stay close to fp32 attention of the same values."""
    q, k, v, _ = _inputs(1, 2, 2, 200, 200, 64, torch.bfloat16)
    mask = make("bigbird", 200, block=32)
    o = sparseflash.attention(q, k, v, mask, backend="blocked")
    o32 = sparseflash.attention(q.float(), k.float(), v.float(), mask, backend="reference")
    assert_close(o, o32, 2e-2, "o (bf16 vs fp32)")


@pytest.mark.parametrize("kind", ["none", "butterfly"])
def test_under_autocast_like_sdpa(kind):
    """Under bf16 autocast, fp32 q, k, v (as from autocast-free code) are cast to bf16 and the
    blocked loop still runs in fp32: the same o and gradients as bf16 inputs without autocast."""
    q, k, v, do = _inputs(2, 2, 2, 111, 111, 32, torch.float32)
    mask = _mask(kind, 111, 111, heads=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, _, dq, dk, dv = attention_with_grads("blocked", q, k, v, mask, do.bfloat16())
    want = attention_with_grads("reference", q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, do.bfloat16())
    assert o.dtype == torch.bfloat16
    for name, a, b in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv), (want[0], *want[2:])):
        assert_close(a.float(), b.float(), TOL[torch.bfloat16], name)


# ---------------------------------------------------------------------------- GQA
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=lambda h: f"H4-Hkv{h}")
@pytest.mark.parametrize("kind", ["causal", "butterfly", "per-head"])
def test_gqa(kind, kv_heads):
    q, k, v, do = _inputs(2, 4, kv_heads, 111, 111, 16, torch.float32)
    _compare(_mask(kind, 111, 111, heads=4), q, k, v, do)


def test_gqa_equals_repeated_heads():
    """GQA is attention with each key/value head repeated for its group of query heads."""
    q, k, v, do = _inputs(2, 4, 2, 63, 63, 16, torch.float32)
    mask = _mask("per-head", 63, 63, heads=4)
    gqa = attention_with_grads("blocked", q, k, v, mask, do)
    full = attention_with_grads("blocked", q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), mask, do)
    for name, a, b in zip(NAMES[:3], gqa[:3], full[:3]):
        assert_close(a, b, 1e-5, name)
    # a shared key/value head receives the sum of its query heads' gradients
    for name, a, b in zip(("dk", "dv"), gqa[3:], full[3:]):
        assert_close(a, b.unflatten(1, (2, 2)).sum(2), 1e-5, name)


# ---------------------------------------------------------------------------- key_lengths and empty rows
@pytest.mark.parametrize("lengths", [[111, 111], [50, 111], [17, 3], [111, 0]], ids=lambda x: "kl" + "-".join(map(str, x)))
@pytest.mark.parametrize("kind", ["none", "causal", "butterfly", "per-head"])
def test_key_lengths(kind, lengths):
    q, k, v, do = _inputs(2, 2, 1, 100, 111, 16, torch.float32)
    key_lengths = torch.tensor(lengths)
    got = _compare(_mask(kind, 100, 111, heads=2), q, k, v, do, key_lengths=key_lengths)
    o, lse, dq, dk, dv = got
    for b, n in enumerate(lengths):  # padded keys get no gradient
        assert torch.all(dk[b, :, n:] == 0) and torch.all(dv[b, :, n:] == 0)


def test_key_lengths_equal_truncated_keys():
    """Masking keys past key_lengths[b] is the same as cutting them off."""
    q, k, v, _ = _inputs(2, 2, 2, 80, 100, 16, torch.float32)
    mask = make("dense", 80, 100, block=16)
    o = sparseflash.attention(q, k, v, mask, key_lengths=torch.tensor([100, 37]), backend="blocked")
    short = sparseflash.attention(q[1:], k[1:, :, :37], v[1:, :, :37], backend="blocked")
    assert_close(o[1:], short, 1e-5, "o with key_lengths")


def _assert_empty_rows(got, rows):
    """``rows`` (a bool [B, H, S_q] or index): o 0, lse -inf, dq 0; nothing NaN anywhere."""
    o, lse, dq, dk, dv = got
    for name, x in zip(NAMES, got):
        assert not torch.isnan(x).any(), f"{name} has NaN"
    assert torch.all(o[rows] == 0), "o of a fully masked row must be 0"
    assert torch.all(lse[rows] == float("-inf")), "lse of a fully masked row must be -inf"
    assert torch.all(dq[rows] == 0), "dq of a fully masked row must be 0"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fully_masked_batch_row(dtype):
    """key_lengths 0: that batch element sees no key at all."""
    q, k, v, do = _inputs(2, 2, 2, 63, 63, 16, dtype)
    got = _compare(_mask("causal", 63, 63, 2), q, k, v, do, key_lengths=torch.tensor([63, 0]))
    _assert_empty_rows(got, 1)
    assert torch.all(got[3][1] == 0) and torch.all(got[4][1] == 0), "dk, dv of unseen keys must be 0"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_layout_with_empty_rows(dtype):
    q, k, v, do = _inputs(2, 3, 3, 70, 70, 16, dtype)
    mask = _mask("empty-rows", 70, 70, heads=3)
    got = _compare(mask, q, k, v, do)
    _assert_empty_rows(got, (slice(None), slice(None), slice(0, 16)))
    _assert_empty_rows(got, (slice(None), slice(None), slice(32, 48)))
    assert torch.isfinite(got[1][:, :, 16:32]).all()


def test_causal_layout_with_empty_rows_and_key_lengths():
    """A causal layout missing its first query-block row, combined with key_lengths."""
    q, k, v, do = _inputs(2, 2, 2, 63, 63, 16, torch.float32)
    layout = make("causal", 63, block=16).layout.clone()
    layout[:, 0] = False  # queries 0..15 see nothing
    mask = from_layout(layout, block=16, q_len=63, kv_len=63, causal=True)
    got = _compare(mask, q, k, v, do, key_lengths=torch.tensor([63, 20]))
    _assert_empty_rows(got, (slice(None), slice(None), slice(0, 16)))


def test_all_empty_mask():
    q, k, v, do = _inputs(1, 2, 2, 40, 50, 8, torch.float32)
    got = attention_with_grads("blocked", q, k, v, _mask("all-empty", 40, 50, 2), do)
    _assert_empty_rows(got, ...)
    assert torch.all(got[3] == 0) and torch.all(got[4] == 0)


# ---------------------------------------------------------------------------- gradients through lse, scale
@pytest.mark.parametrize("kind", ["causal", "per-head", "empty-rows"])
def test_gradient_through_lse(kind):
    q, k, v, do = _inputs(2, 2, 2, 70, 90, 16, torch.float32)
    mask = _mask(kind, 70, 90, heads=2)
    w = torch.randn(2, 2, 70)
    grads = []
    for backend in ("blocked", "reference"):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        o, lse = sparseflash.attention(*leaves, mask, backend=backend, return_lse=True,
                                       key_lengths=torch.tensor([90, 33]))
        loss = (o * do).sum() + (torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)) * w).sum()
        grads.append(torch.autograd.grad(loss, leaves))
    for name, a, b in zip(("dq", "dk", "dv"), *grads):
        assert_close(a, b, 1e-5, f"{name} through o and lse")


@pytest.mark.parametrize("scale", [0.05, 1.0, 2.5])
def test_scale(scale):
    q, k, v, do = _inputs(1, 2, 2, 63, 63, 16, torch.float32)
    mask = _mask("butterfly", 63, 63, 2)
    got = attention_with_grads("blocked", q, k, v, mask, do)  # default scale 1/sqrt(D) = 0.25
    o = sparseflash.attention(q, k, v, mask, scale=scale, backend="blocked")
    o_ref = sparseflash.attention(q, k, v, mask, scale=scale, backend="reference")
    assert_close(o, o_ref, 1e-5, f"o at scale {scale}")
    # scale s on q is the same as scale 1 on (s * q)
    o_q = sparseflash.attention(q * scale, k, v, mask, scale=1.0, backend="blocked")
    assert_close(o, o_q, 1e-5, "scale folded into q")
    default = sparseflash.attention(q, k, v, mask, scale=0.25, backend="blocked")
    assert_close(got[0], default, 1e-6, "default scale is 1/sqrt(D)")


# ---------------------------------------------------------------------------- the loop itself
def test_visits_only_computed_tiles(monkeypatch):
    """A tile the mask zeroes is never gathered, and each computed tile once per pass."""
    mask = make("random", 150, 130, block=16, heads=2, density=0.3)
    seen = []
    original = blocked._raw_scores

    def spy(q_blk, k_blk, tiles, part, scale):
        seen.extend(zip(tiles.head[part].tolist(), tiles.q_block[part].tolist(), tiles.kv_block[part].tolist()))
        return original(q_blk, k_blk, tiles, part, scale)

    monkeypatch.setattr(blocked, "_raw_scores", spy)
    q, k, v, do = _inputs(1, 2, 2, 150, 130, 8, torch.float32)
    attention_with_grads("blocked", q, k, v, mask, do)
    expected = sorted(map(tuple, mask.layout.nonzero().tolist()))
    assert sorted(seen) == sorted(expected * 2)  # forward + backward


def test_inputs_unchanged_and_non_contiguous():
    base = torch.randn(2, 70, 3, 3 * 16)
    q, k, v = (base[..., i * 16:(i + 1) * 16].transpose(1, 2) for i in range(3))  # (B, H, S, D) views
    assert not q.is_contiguous()
    before = base.clone()
    do = torch.randn(2, 3, 70, 16)
    _compare(_mask("per-head", 70, 70, heads=3), q, k, v, do)
    assert torch.equal(base, before)


def test_auto_is_blocked_on_cpu():
    q, k, v, _ = _inputs(1, 2, 2, 63, 63, 8, torch.float32)
    mask = make("butterfly", 63, block=16)
    auto = sparseflash.attention(q, k, v, mask)
    assert torch.equal(auto, sparseflash.attention(q, k, v, mask, backend="blocked"))
    assert_close(auto, sparseflash.attention(q, k, v, mask, backend="reference"), 1e-5, "o")



def test_never_materialises_the_element_mask(monkeypatch):
    """The blocked loop reads the tables only: no S_q x S_kv element mask is ever built."""
    mask = make("butterfly", 1000, block=64)
    q, k, v, do = _inputs(1, 2, 2, 1000, 1000, 8, torch.float32)

    def forbidden(self):
        raise AssertionError("the blocked backend must not call BlockMask.to_dense()")

    with monkeypatch.context() as patch:
        patch.setattr(BlockMask, "to_dense", forbidden)
        got = attention_with_grads("blocked", q, k, v, mask, do)
    want = attention_with_grads("reference", q, k, v, mask, do)
    for name, a, b in zip(NAMES, got, want):
        assert_close(a, b, 1e-5, name)
