"""BlockMask: block sizes, ragged lengths, tables, the full/partial split, to_dense, density, kind,
equality, algebra and devices -- each checked against masks built element by element."""

from __future__ import annotations

import itertools

import pytest
import torch

from sparseflash.masks import BlockMask, BlockTables, MaskKind, from_layout, layout_to_tables, make


def _naive_dense(layout: torch.Tensor, block_m: int, block_n: int, q_len: int, kv_len: int,
                 causal: bool) -> torch.Tensor:
    """Element-level mask built one score at a time: the definition, nothing clever."""
    heads = layout.shape[0]
    dense = torch.zeros(heads, q_len, kv_len, dtype=torch.bool)
    for h in range(heads):
        for i in range(q_len):
            for j in range(kv_len):
                dense[h, i, j] = bool(layout[h, i // block_m, j // block_n]) and (not causal or i >= j)
    return dense


def _random_layout(heads, q_len, kv_len, block_m, block_n, density=0.5):
    return torch.rand(heads, -(-q_len // block_m), -(-kv_len // block_n)) < density


# (heads, q_len, kv_len, block_m, block_n, causal): square, ragged, S_q != S_kv, Q/KV blocks differ
GEOMETRIES = [
    (1, 64, 64, 16, 16, False),
    (1, 64, 64, 16, 16, True),
    (1, 70, 50, 16, 16, True),
    (3, 70, 50, 16, 16, False),
    (3, 45, 77, 16, 32, True),
    (2, 77, 45, 32, 16, True),
    (2, 100, 100, 32, 16, False),
    (1, 1, 40, 16, 16, True),
    (1, 40, 1, 16, 16, True),
    (2, 33, 33, 64, 64, True),
]
GEOMETRY_IDS = [f"H{h}-sq{a}-skv{b}-blk{m}x{n}-{'causal' if c else 'nocausal'}" for h, a, b, m, n, c in GEOMETRIES]


@pytest.fixture(params=GEOMETRIES, ids=GEOMETRY_IDS)
def random_mask(request):
    heads, q_len, kv_len, block_m, block_n, causal = request.param
    layout = _random_layout(heads, q_len, kv_len, block_m, block_n)
    return BlockMask(layout, (block_m, block_n), q_len, kv_len, causal), layout


# ---------------------------------------------------------------------------- construction
@pytest.mark.parametrize("block", [16, 32, 64, 128, 256])
def test_power_of_two_blocks_accepted(block):
    mask = BlockMask(torch.ones(2, 3, dtype=torch.bool), block)
    assert mask.block_size == (block, block)
    assert (mask.q_len, mask.kv_len) == (2 * block, 3 * block)
    assert mask.shape == (1, 2, 3) and mask.num_heads == 1


@pytest.mark.parametrize("block", [0, 1, 8, 15, 17, 24, 48, 96, 100, 512, -16])
def test_other_blocks_rejected(block):
    with pytest.raises(ValueError, match=rf"power of two from 16 to 256; got {block}"):
        BlockMask(torch.ones(1, 1, dtype=torch.bool), block)
    with pytest.raises(ValueError, match=rf"SPARSE_BLOCK_N must be a power of two from 16 to 256; got {block}"):
        BlockMask(torch.ones(1, 1, dtype=torch.bool), (16, block))


@pytest.mark.parametrize("blocks", list(itertools.product([16, 64, 256], [16, 128])), ids=lambda b: f"{b[0]}x{b[1]}")
def test_q_and_kv_blocks_differ(blocks):
    block_m, block_n = blocks
    mask = make("dense", 1000, 700, block=blocks)
    assert mask.block_size == blocks
    assert mask.shape == (1, -(-1000 // block_m), -(-700 // block_n))
    assert mask.to_dense().shape == (1, 1000, 700) and mask.to_dense().all()


@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (17, 16), (100, 33), (33, 100), (256, 255)])
def test_ragged_lengths(q_len, kv_len):
    mask = make("dense", q_len, kv_len, block=16)
    assert (mask.q_len, mask.kv_len) == (q_len, kv_len)
    assert mask.shape == (1, -(-q_len // 16), -(-kv_len // 16))
    assert mask.density == 1.0


def test_default_lengths_and_2d_layout():
    layout = torch.tensor([[True, False, True], [False, True, False]])
    mask = BlockMask(layout, (32, 16))
    assert (mask.q_len, mask.kv_len) == (64, 48)
    assert torch.equal(mask.layout, layout[None])
    assert mask.device == torch.device("cpu")


# ---------------------------------------------------------------------------- tables
def _layout_from_rows(num_blocks: torch.Tensor, indices: torch.Tensor, n_cols: int) -> torch.Tensor:
    """Rebuild a bool layout from a row table, checking order and padding on the way."""
    heads, n_rows = num_blocks.shape
    layout = torch.zeros(heads, n_rows, n_cols, dtype=torch.bool)
    for h in range(heads):
        for r in range(n_rows):
            cols = indices[h, r, : num_blocks[h, r]].tolist()
            assert cols == sorted(set(cols)), "table entries must be ascending and distinct"
            layout[h, r, cols] = True
            assert sorted(indices[h, r].tolist()) == list(range(n_cols)), "a row of indices is a permutation"
    return layout


def test_row_and_column_tables_round_trip(random_mask):
    mask, _ = random_mask
    _, n_q, n_kv = mask.shape
    for t in (mask.kv_num_blocks, mask.kv_indices, mask.q_num_blocks, mask.q_indices):
        assert t.dtype == torch.int32
    assert mask.kv_num_blocks.shape == (mask.num_heads, n_q) and mask.kv_indices.shape == mask.shape
    assert mask.q_num_blocks.shape == (mask.num_heads, n_kv)
    assert mask.q_indices.shape == (mask.num_heads, n_kv, n_q)
    assert torch.equal(_layout_from_rows(mask.kv_num_blocks, mask.kv_indices, n_kv), mask.layout)
    assert torch.equal(_layout_from_rows(mask.q_num_blocks, mask.q_indices, n_q).transpose(1, 2), mask.layout)


def test_full_and_partial_tables_round_trip(random_mask):
    mask, _ = random_mask
    _, n_q, n_kv = mask.shape
    tables = mask.tables()
    assert isinstance(tables, BlockTables)
    assert mask.tables() is tables and mask.tables("cpu") is tables  # cached per device
    full = _layout_from_rows(tables.full_kv_num_blocks, tables.full_kv_indices, n_kv)
    partial = _layout_from_rows(tables.partial_kv_num_blocks, tables.partial_kv_indices, n_kv)
    assert torch.equal(full, mask.full_layout) and torch.equal(partial, mask.partial_layout)
    full_t = _layout_from_rows(tables.full_q_num_blocks, tables.full_q_indices, n_q).transpose(1, 2)
    partial_t = _layout_from_rows(tables.partial_q_num_blocks, tables.partial_q_indices, n_q).transpose(1, 2)
    assert torch.equal(full_t, full) and torch.equal(partial_t, partial)
    # full and partial split the layout
    assert torch.equal(full | partial, mask.layout)
    assert not (full & partial).any()


def test_partial_tiles_are_exactly_those_the_element_mask_cuts(random_mask):
    """A computed tile is partial iff some score of its full block_m x block_n extent (the
    ragged tails included) is dropped: the causal diagonal, the ragged last key column and the
    ragged last query row."""
    mask, layout = random_mask
    block_m, block_n = mask.block_size
    dense = mask.to_dense()
    for h, i, j in mask.layout.nonzero().tolist():
        tile = dense[h, i * block_m:(i + 1) * block_m, j * block_n:(j + 1) * block_n]
        cut = tile.shape != (block_m, block_n) or not bool(tile.all())
        assert bool(mask.partial_layout[h, i, j]) == cut, (h, i, j)
        assert bool(mask.full_layout[h, i, j]) == (not cut), (h, i, j)
        assert tile.any(), "a computed tile keeps at least one score (the layout is canonical)"


def test_partial_tiles_of_causal_square_mask_are_the_diagonal():
    mask = make("causal", 128, block=16)
    eye = torch.eye(8, dtype=torch.bool)[None]
    assert torch.equal(mask.partial_layout, eye)
    assert torch.equal(mask.full_layout, torch.ones(8, 8, dtype=torch.bool).tril(-1)[None])


def test_partial_tiles_of_ragged_dense_mask_are_the_last_key_column_and_query_row():
    mask = make("dense", 100, 70, block=16)  # queries: 6 full tiles + one of 4; keys: 4 + one of 6
    expected = torch.zeros(1, 7, 5, dtype=torch.bool)
    expected[..., -1] = True
    expected[:, -1] = True
    assert torch.equal(mask.partial_layout, expected)
    assert mask.full_layout.sum() == 6 * 4
    exact = make("dense", 96, 64, block=16)
    assert not exact.partial_layout.any()


def test_layout_to_tables():
    layout = torch.tensor([[False, True, False, True], [False, False, False, False], [True, True, True, True]])
    num, idx = layout_to_tables(layout)
    assert num.tolist() == [2, 0, 4]
    assert idx[0, :2].tolist() == [1, 3] and idx[2].tolist() == [0, 1, 2, 3]
    assert num.is_contiguous() and idx.is_contiguous() and idx.dtype == torch.int32


# ---------------------------------------------------------------------------- to_dense and density
def test_to_dense_matches_naive(random_mask):
    mask, layout = random_mask
    block_m, block_n = mask.block_size
    expected = _naive_dense(layout, block_m, block_n, mask.q_len, mask.kv_len, mask.causal)
    dense = mask.to_dense()
    assert dense.dtype == torch.bool and dense.shape == (mask.num_heads, mask.q_len, mask.kv_len)
    assert torch.equal(dense, expected)


def test_to_dense_of_a_band_of_queries_is_those_rows(random_mask):
    mask, _ = random_mask
    start = torch.randint(0, mask.q_len, ()).item()
    stop = torch.randint(start + 1, mask.q_len + 1, ()).item()
    assert torch.equal(mask.to_dense(range(start, stop)), mask.to_dense()[..., start:stop, :])
    assert torch.equal(mask.to_dense(range(start, stop, 3)), mask.to_dense()[..., start:stop:3, :])


def test_density_is_exact(random_mask):
    mask, _ = random_mask
    assert mask.density == pytest.approx(mask.to_dense().double().mean().item(), abs=1e-12)


@pytest.mark.parametrize("q_len,kv_len", [(64, 64), (70, 50), (50, 70), (1000, 1000), (999, 333)])
def test_causal_density(q_len, kv_len):
    mask = make("causal", q_len, kv_len, block=32)
    kept = sum(min(i + 1, kv_len) for i in range(q_len))  # query i keeps keys 0..i
    assert mask.density == pytest.approx(kept / (q_len * kv_len), abs=1e-12)
    assert torch.equal(mask.to_dense()[0], torch.ones(q_len, kv_len, dtype=torch.bool).tril())


def test_causal_aligns_top_left():
    """q_len < kv_len: the last keys are never seen; q_len > kv_len: the last queries see all keys."""
    short_q = make("causal", 10, 40, block=16).to_dense()[0]
    assert not short_q[:, 10:].any() and short_q[9, :10].all()
    long_q = make("causal", 40, 10, block=16).to_dense()[0]
    assert long_q[9:].all() and not long_q[0, 1:].any()


def test_per_head_to_dense():
    layout = torch.zeros(3, 4, 4, dtype=torch.bool)
    layout[0, 0, 0] = layout[1, 1, 2] = layout[2, 3, 3] = True
    mask = from_layout(layout, block=16, q_len=60, kv_len=55, causal=True)
    dense = mask.to_dense()
    assert dense[0, :16, :16].equal(torch.ones(16, 16, dtype=torch.bool).tril()) and dense[0].sum() == 136
    assert dense[1].sum() == 0  # tile (1, 2) lies above the diagonal: dropped
    assert dense[2, 48:60, 48:55].equal(torch.ones(12, 7, dtype=torch.bool).tril()) and dense[2].sum() == 63
    assert mask.density == pytest.approx((136 + 0 + 63) / (3 * 60 * 55), abs=1e-12)


def test_canonical_layout_drops_tiles_above_the_diagonal():
    mask = from_layout(torch.ones(4, 4, dtype=torch.bool), block=16, causal=True)
    assert torch.equal(mask.layout[0], torch.ones(4, 4, dtype=torch.bool).tril())
    assert mask == make("causal", 64, block=16)


# ---------------------------------------------------------------------------- kind
@pytest.mark.parametrize(
    "build,kind",
    [
        (lambda: make("dense", 100, 70, block=16), MaskKind.DENSE),
        (lambda: from_layout(torch.ones(2, 3, 3, dtype=torch.bool), block=32), MaskKind.DENSE),
        (lambda: make("causal", 100, 70, block=16), MaskKind.CAUSAL),
        (lambda: make("dense", 100, block=16, causal=True), MaskKind.CAUSAL),
        (lambda: from_layout(torch.ones(4, 4, dtype=torch.bool), block=16, causal=True), MaskKind.CAUSAL),
        (lambda: make("local", 128, block=16, window=8, causal=True), MaskKind.CAUSAL),
        (lambda: make("local", 128, block=16, window=8), MaskKind.DENSE),
        (lambda: make("butterfly", 128, block=16), MaskKind.SPARSE),
        (lambda: make("local", 128, block=16, window=1, causal=True), MaskKind.SPARSE),
        (lambda: make("random", 128, block=16, heads=2), MaskKind.SPARSE),
        (lambda: from_layout(torch.zeros(2, 2, dtype=torch.bool), block=16), MaskKind.SPARSE),
    ],
    ids=["dense", "dense-per-head", "causal", "dense-causal-flag", "ones-causal", "wide-local-causal",
         "wide-local", "butterfly", "local-causal", "random-per-head", "empty"],
)
def test_kind(build, kind):
    assert build().kind is kind


def test_causal_minus_one_tile_is_sparse():
    layout = make("causal", 64, block=16).layout.clone()
    layout[0, 2, 1] = False
    assert from_layout(layout, block=16, causal=True).kind is MaskKind.SPARSE


# ---------------------------------------------------------------------------- equality, algebra, devices
def test_equality():
    a = make("butterfly", 128, block=16)
    assert a == make("butterfly", 128, block=16)
    assert a == from_layout(a.layout.clone(), block=16)
    assert a != make("butterfly", 128, block=16, factors=1)
    assert a != make("butterfly", 128, block=16, causal=True)
    assert a != make("butterfly", 128, block=32)
    assert a != make("butterfly", 127, block=16)
    assert a != "butterfly" and a != a.layout
    # a shared layout equals a per-head one whose heads all match it
    assert a == from_layout(a.layout.expand(3, -1, -1).clone(), block=16)
    assert make("random", 128, block=16, heads=2) != make("random", 128, block=16, heads=3)
    with pytest.raises(TypeError):
        hash(a)


def test_and_or_match_elementwise(random_mask):
    a, _ = random_mask
    block_m, block_n = a.block_size
    other = BlockMask(_random_layout(1, a.q_len, a.kv_len, block_m, block_n), a.block_size, a.q_len, a.kv_len,
                      a.causal)
    assert torch.equal((a & other).to_dense(), a.to_dense() & other.to_dense())
    assert torch.equal((a | other).to_dense(), a.to_dense() | other.to_dense())
    assert (a & other).num_heads == (a | other).num_heads == a.num_heads


def test_and_of_causal_and_non_causal():
    local = make("local", 100, block=16, window=1)
    both = local & make("causal", 100, block=16)
    assert both.causal and both == make("local", 100, block=16, window=1, causal=True)
    assert torch.equal(both.to_dense(), local.to_dense() & make("causal", 100, block=16).to_dense())


def test_or_of_causal_and_non_causal_is_the_union_of_scores():
    """A causal window | a non-causal butterfly keeps exactly the scores either keeps (through a
    mask_mod that asks each layout and predicate)."""
    a, b = make("local", 100, block=16, window=1, causal=True), make("butterfly", 100, block=16)
    union = a | b
    assert union.mask_mod is not None and not union.causal
    assert torch.equal(union.to_dense(), a.to_dense() | b.to_dense())
    assert union.density == pytest.approx(union.to_dense().float().mean().item())


def test_to_device():
    mask = make("random", 100, block=16, heads=2, density=0.5)
    assert mask.to("cpu") is mask and mask.to(torch.device("cpu")) is mask
    meta = mask.to("meta")
    assert meta.device.type == "meta" and meta.layout.device.type == "meta"
    assert meta.shape == mask.shape and meta.causal == mask.causal
    assert (meta.q_len, meta.kv_len, meta.block_size) == (mask.q_len, mask.kv_len, mask.block_size)
    assert mask.device.type == "cpu"  # the original is unchanged
    tables = mask.tables("meta")  # tables are built and cached per device
    assert tables.full_kv_indices.device.type == "meta" and mask.tables("meta") is tables
    assert mask.tables().full_kv_indices.device.type == "cpu"


def test_a_move_keeps_what_reading_the_layout_found():
    """``kind`` and ``mean_row_blocks`` read the layout (a device sync on a GPU); a moved mask keeps them,
    so a mask built on the CPU and moved reads nothing on its device (a meta layout cannot be read)."""
    for name in ("causal", "butterfly"):
        mask = make(name, 300, block=32)
        kind, row_blocks = mask.kind, mask.mean_row_blocks
        moved = mask.to("meta")
        assert moved.kind is kind and moved.mean_row_blocks == row_blocks
    with pytest.raises((RuntimeError, NotImplementedError)):  # not read before the move: the meta layout is read
        make("causal", 300, block=32).to("meta").mean_row_blocks  # noqa: B018


@pytest.mark.gpu
def test_to_cuda_round_trip():
    mask = make("bigbird", 300, block=32, heads=2)
    cuda = mask.to("cuda")
    assert cuda.device.type == "cuda" and cuda == mask and cuda.to("cpu") == mask
    assert torch.equal(cuda.to_dense().cpu(), mask.to_dense())
    assert cuda.density == mask.density and cuda.kind is mask.kind


@pytest.mark.parametrize("field", BlockMask.FIELDS)
def test_a_mask_is_immutable(field):
    """What a mask derives (its kind, tables, tiles) comes from its fields once: setting one again is an error."""
    mask = make("causal", 64, block=16)
    with pytest.raises(AttributeError, match=rf"a BlockMask is immutable: build a new one instead of setting {field}"):
        setattr(mask, field, getattr(mask, field))
    assert mask.kind is MaskKind.CAUSAL
