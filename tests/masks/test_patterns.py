"""The built-in patterns (checked against their definitions, written out naively) and the registry."""

from __future__ import annotations

import math

import pytest
import torch

from sparseflash.masks import BlockMask, MaskKind, from_block_fn, from_layout, get, make, patterns, register, registered

BUILT_IN = ["bigbird", "butterfly", "causal", "dense", "fixed", "local", "longformer", "random", "strided"]


@pytest.fixture
def registry(monkeypatch):
    """A private copy of the registry: patterns registered by a test vanish after it."""
    monkeypatch.setattr(patterns, "_REGISTRY", dict(patterns._REGISTRY))


def _layout(name, n, m=None, **params) -> torch.Tensor:
    """The [n_q, n_kv] layout of a shared pattern with 16-wide blocks."""
    return make(name, 16 * n, 16 * (n if m is None else m), block=16, **params).layout[0]


def _naive(n_q, n_kv, keep) -> torch.Tensor:
    return torch.tensor([[bool(keep(i, j)) for j in range(n_kv)] for i in range(n_q)])


# ---------------------------------------------------------------------------- butterfly
@pytest.mark.parametrize("n", [2, 4, 8, 16, 32, 64])
def test_butterfly_power_of_two(n):
    layout = _layout("butterfly", n)
    k = int(math.log2(n))
    assert (layout.sum(-1) == k + 1).all(), "k + 1 blocks per row"
    assert torch.equal(layout, layout.T), "symmetric"
    assert layout.diagonal().all()


@pytest.mark.parametrize("factors", [0, 1, 2, 3, 5])
def test_butterfly_factors(factors):
    n = 32
    layout = _layout("butterfly", n, factors=factors)
    expected = _naive(n, n, lambda i, j: i == j or any(i ^ j == 1 << f for f in range(factors)))
    assert torch.equal(layout, expected)
    assert (layout.sum(-1) == factors + 1).all() and torch.equal(layout, layout.T)


@pytest.mark.parametrize("n_q,n_kv", [(5, 5), (12, 7), (7, 12), (1, 9)])
def test_butterfly_definition_any_shape(n_q, n_kv):
    expected = _naive(n_q, n_kv, lambda i, j: i == j or bin(i ^ j).count("1") == 1)
    assert torch.equal(_layout("butterfly", n_q, n_kv), expected)


@pytest.mark.parametrize("global_blocks", [1, 2])
def test_butterfly_global_blocks(global_blocks):
    n = 16
    layout = _layout("butterfly", n, factors=1, global_blocks=global_blocks)
    assert layout[:global_blocks].all() and layout[:, :global_blocks].all()
    rest = layout[global_blocks:, global_blocks:]
    expected = _naive(n, n, lambda i, j: i == j or i ^ j == 1)[global_blocks:, global_blocks:]
    assert torch.equal(rest, expected)
    assert torch.equal(layout, layout.T)


# ---------------------------------------------------------------------------- local, strided, longformer
@pytest.mark.parametrize("window", [0, 1, 3])
def test_local(window):
    n = 10
    layout = _layout("local", n, window=window)
    assert torch.equal(layout, _naive(n, n, lambda i, j: abs(i - j) <= window))
    interior = layout[window:n - window]
    assert (interior.sum(-1) == 2 * window + 1).all()


@pytest.mark.parametrize("window", [0, 1, 3])
def test_local_causal(window):
    n, block = 10, 16
    mask = make("local", n * block - 5, block=block, window=window, causal=True)
    assert mask.causal
    assert torch.equal(mask.layout[0], _naive(n, n, lambda i, j: 0 <= i - j <= window))
    q_len = mask.q_len
    expected = _naive(q_len, q_len, lambda i, j: i >= j and i // block - j // block <= window)
    assert torch.equal(mask.to_dense()[0], expected)


@pytest.mark.parametrize("stride", [1, 3, 4])
def test_strided(stride):
    n = 13
    layout = _layout("strided", n, stride=stride)
    expected = _naive(n, n, lambda i, j: abs(i - j) < stride or (i - j) % stride == 0)
    assert torch.equal(layout, expected)
    causal = make("strided", 16 * n, block=16, causal=True, stride=stride).layout[0]
    assert torch.equal(causal, expected & torch.ones(n, n, dtype=torch.bool).tril())  # the paper's causal form


@pytest.mark.parametrize("stride,summary", [(1, 1), (3, 1), (4, 2), (4, 4)])
def test_fixed(stride, summary):
    n = 13
    layout = _layout("fixed", n, stride=stride, summary=summary)
    expected = _naive(n, n, lambda i, j: i // stride == j // stride or j % stride >= stride - summary)
    assert torch.equal(layout, expected)
    # every query reads every summary column
    assert layout[:, [j for j in range(n) if j % stride >= stride - summary]].all()


@pytest.mark.parametrize("window,global_blocks", [(1, 1), (2, 0), (0, 3)])
def test_longformer(window, global_blocks):
    n = 12
    layout = _layout("longformer", n, window=window, global_blocks=global_blocks)
    expected = _naive(n, n, lambda i, j: abs(i - j) <= window or i < global_blocks or j < global_blocks)
    assert torch.equal(layout, expected)


# ---------------------------------------------------------------------------- seeded patterns
def test_bigbird_contains_window_global_and_random():
    n, random_blocks = 16, 2
    layout = _layout("bigbird", n, window=1, global_blocks=1, random_blocks=random_blocks, seed=3)
    base = _naive(n, n, lambda i, j: abs(i - j) <= 1 or i < 1 or j < 1)
    assert (layout & base).equal(base)
    extra = (layout & ~base).sum(-1)
    assert (extra <= random_blocks).all() and extra.sum() > 0
    assert ((layout.sum(-1) >= base.sum(-1)) & (layout.sum(-1) <= base.sum(-1) + random_blocks)).all()


@pytest.mark.parametrize("name", ["bigbird", "random"])
def test_seeded_patterns_reproducible_and_vary(name):
    a = make(name, 1024, block=32, heads=4, seed=11)
    assert a == make(name, 1024, block=32, heads=4, seed=11), "same seed, same mask"
    assert a != make(name, 1024, block=32, heads=4, seed=12), "another seed, another mask"
    assert a.num_heads == 4
    heads = [a.layout[h] for h in range(4)]
    assert all(not torch.equal(heads[0], other) for other in heads[1:]), "each head differs"
    assert torch.equal(make(name, 1024, block=32, seed=11).layout[0], heads[0]), "heads=None is head 0"


def test_seeded_patterns_ignore_global_rng():
    torch.manual_seed(0)
    a = make("random", 512, block=16, density=0.3)
    torch.manual_seed(1)
    assert a == make("random", 512, block=16, density=0.3)


@pytest.mark.parametrize("density", [0.05, 0.25, 0.5, 0.9, 1.0])
def test_random_density_near_target(density):
    n = 64
    mask = make("random", 16 * n, block=16, heads=3, density=density, seed=5)
    per_row = mask.layout.sum(-1)
    assert (per_row == max(1, round(density * n))).all()
    assert abs(mask.density - density) <= 1 / n
    assert mask.layout[:, torch.arange(n), torch.arange(n)].all(), "the diagonal is kept"


def test_random_non_square_keeps_diagonal():
    layout = make("random", 16 * 20, 16 * 8, block=16, density=0.25, seed=2).layout[0]
    assert layout[torch.arange(8), torch.arange(8)].all()
    assert (layout.sum(-1) == 2).all()


# ---------------------------------------------------------------------------- dense and causal
def test_dense_and_causal_patterns():
    dense, causal = make("dense", 100, block=16), make("causal", 100, block=16)
    assert dense.kind is MaskKind.DENSE and not dense.causal and dense.density == 1.0
    assert causal.kind is MaskKind.CAUSAL and causal.causal
    assert causal.density == pytest.approx(sum(range(1, 101)) / 100**2, abs=1e-12)
    assert make("dense", 100, block=16, causal=True) == causal


# ---------------------------------------------------------------------------- composition
def test_composition():
    n, block = 16, 16
    local = make("local", n * block, block=block, window=1)
    butterfly = make("butterfly", n * block, block=block)
    both, either = local & butterfly, local | butterfly
    assert torch.equal(both.layout, local.layout & butterfly.layout)
    assert torch.equal(either.layout, local.layout | butterfly.layout)
    assert torch.equal(either.to_dense(), local.to_dense() | butterfly.to_dense())
    assert both.density <= min(local.density, butterfly.density)
    assert either.density >= max(local.density, butterfly.density)
    # with a causal mask: & keeps the causal predicate
    causal_local = local & make("causal", n * block, block=block)
    assert causal_local == make("local", n * block, block=block, window=1, causal=True)
    # causal | causal stays causal; per-head | shared broadcasts to per-head
    union = make("causal", 256, block=16) | make("local", 256, block=16, causal=True)
    assert union.causal and union == make("causal", 256, block=16)
    per_head = make("random", 256, block=16, heads=3) | local
    assert per_head.num_heads == 3 and torch.equal(per_head.layout[1], make("random", 256, block=16, heads=3).layout[1] | local.layout[0])


def test_or_of_causal_with_non_causal():
    a, b = make("causal", 256, block=16), make("butterfly", 256, block=16)
    assert torch.equal((a | b).to_dense(), a.to_dense() | b.to_dense())


# ---------------------------------------------------------------------------- the registry
def test_builtins_registered():
    assert set(BUILT_IN) <= set(registered())
    assert registered() == sorted(registered())
    assert get("butterfly").params == ["factors", "global_blocks"]
    assert get("random").per_head and not get("local").per_head
    assert get("causal").causal and not get("dense").causal


def test_register_and_make(registry):
    @register("test-anti-diagonal")
    def anti_diagonal(n_q, n_kv, width: int = 0):
        i, j = torch.meshgrid(torch.arange(n_q), torch.arange(n_kv), indexing="ij")
        return (i + j - (n_kv - 1)).abs() <= width

    assert anti_diagonal(2, 2).tolist() == [[False, True], [True, False]], "the decorator returns the function"
    assert "test-anti-diagonal" in registered()
    mask = make("test-anti-diagonal", 8 * 32, block=32, width=1)
    assert isinstance(mask, BlockMask) and mask.shape == (1, 8, 8)
    assert torch.equal(mask.layout[0], _naive(8, 8, lambda i, j: abs(i + j - 7) <= 1))
    assert get("test-anti-diagonal").params == ["width"]


def test_register_causal_pattern(registry):
    @register("test-causal-band", causal=True)
    def band(n_q, n_kv):
        return torch.ones(n_q, n_kv, dtype=torch.bool)

    mask = make("test-causal-band", 100, block=16)
    assert mask.causal and mask == make("causal", 100, block=16)


def test_per_head_pattern(registry):
    @register("test-head-column")
    def head_column(n_q, n_kv, head: int = 0):
        layout = torch.zeros(n_q, n_kv, dtype=torch.bool)
        layout[:, head % n_kv] = True
        return layout

    mask = make("test-head-column", 64, block=16, heads=3)
    assert mask.shape == (3, 4, 4)
    for h in range(3):
        assert mask.layout[h, :, h].all() and mask.layout[h].sum() == 4
    assert make("test-head-column", 64, block=16).shape == (1, 4, 4), "heads=None builds head 0"
    assert get("test-head-column").params == [], "head is supplied by make"
    # a shared pattern stays shared whatever heads says
    assert make("butterfly", 64, block=16, heads=3).shape == (1, 4, 4)


def test_unknown_name_lists_registered():
    with pytest.raises(ValueError) as err:
        make("no-such-pattern", 64)
    assert "unknown pattern 'no-such-pattern'" in str(err.value)
    for name in BUILT_IN:
        assert name in str(err.value)


def test_unknown_parameter():
    with pytest.raises(ValueError, match=r"pattern 'local' takes parameters \['window'\]; got \['size'\]"):
        make("local", 64, block=16, size=2)
    with pytest.raises(ValueError, match=r"pattern 'random' takes parameters \['density', 'seed'\]; got \['heads_seed'\]"):
        make("random", 64, block=16, heads_seed=2)


def test_make_lengths_and_blocks():
    mask = make("butterfly", 1000, 333, block=(64, 16))
    assert (mask.q_len, mask.kv_len, mask.block_size) == (1000, 333, (64, 16))
    assert mask.shape == (1, 16, 21)
    assert make("butterfly", 1000).block_size == (128, 128) and make("butterfly", 1000).kv_len == 1000


def test_from_layout():
    layout = torch.rand(3, 4, 5) < 0.5
    mask = from_layout(layout, block=(32, 16), q_len=100, kv_len=70)
    assert mask.shape == (3, 4, 5) and torch.equal(mask.layout, layout)
    assert (mask.q_len, mask.kv_len, mask.block_size, mask.causal) == (100, 70, (32, 16), False)
    shared = from_layout(layout[0], block=16)
    assert shared.shape == (1, 4, 5) and (shared.q_len, shared.kv_len) == (64, 80)


def test_from_block_fn():
    mask = from_block_fn(lambda h, i, j: (i - j).abs() <= 1, q_len=100, block=16)
    assert mask == make("local", 100, block=16, window=1)
    per_head = from_block_fn(lambda h, i, j: (i - j).abs() <= h, q_len=100, kv_len=70, block=16, heads=3, causal=True)
    assert per_head.shape == (3, 7, 5) and per_head.causal
    for h in range(3):
        assert torch.equal(per_head.layout[h], _naive(7, 5, lambda i, j: 0 <= i - j <= h))
    shared = from_block_fn(lambda h, i, j: j == 0, q_len=64, block=16, heads=2)
    assert shared.shape == (2, 4, 4) and shared.layout[:, :, 0].all() and shared.layout.sum() == 8
