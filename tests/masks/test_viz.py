"""Pictures of a mask: the ASCII ``__str__`` and the PNG of ``plot``."""

from __future__ import annotations

import pytest
import torch

from sparseflash.masks import from_layout, make
from sparseflash.masks.viz import ascii_picture

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _grid(text: str) -> list[str]:
    """The rows of a picture (drops the repr line and head titles)."""
    return [line for line in text.splitlines() if line and set(line) <= set("#+.")]


def test_causal_picture():
    mask = make("causal", 64, block=16)
    text = str(mask)
    first = text.splitlines()[0]
    assert first == repr(mask)
    for field in ("kind=CAUSAL", "heads=1", "q_len=64", "kv_len=64", "block_size=(16, 16)", "causal=True",
                  "density=0.5078"):
        assert field in first
    assert _grid(text) == ["+...", "#+..", "##+.", "###+"]


def test_ragged_and_sparse_picture():
    # keys 0..49: the last key tile (48..49) is ragged, so partial
    layout = torch.tensor([[True, False, True, True], [False, True, False, True], [False, False, False, False]])
    mask = from_layout(layout, block=16, q_len=40, kv_len=50)
    assert _grid(str(mask)) == ["#.#+", ".#.+", "...."]
    assert "kind=SPARSE" in str(mask)


def test_per_head_picture():
    mask = make("random", 64, block=16, heads=6, density=0.5)
    text = ascii_picture(mask, max_heads=4)
    for h in range(4):
        assert f"head {h}" in text
    assert "head 4" not in text and "... 2 more heads" in text
    grids = _grid(text)
    assert len(grids) == 4 * 4
    expected = ["".join("#" if on else "." for on in row) for h in range(4) for row in mask.layout[h].tolist()]
    assert grids == expected


@pytest.mark.parametrize("n_blocks", [100, 101, 130])
def test_downsampled_picture(n_blocks):
    """Wide masks are drawn one character per group of tiles; a dense mask is '#' throughout,
    also in the edge cells that the group size does not divide."""
    dense = make("dense", 16 * n_blocks, block=16)
    text = ascii_picture(dense, max_cells=64)
    group = -(-n_blocks // 64)
    cells = -(-n_blocks // group)
    assert f"({group}x{group} tiles per character)" in text
    assert _grid(text) == ["#" * cells] * cells
    causal = _grid(ascii_picture(make("causal", 16 * n_blocks, block=16), max_cells=64))
    assert len(causal) == cells
    for i, row in enumerate(causal):
        assert row == "#" * i + "+" + "." * (cells - i - 1)


def test_empty_mask_picture():
    mask = from_layout(torch.zeros(3, 5, dtype=torch.bool), block=32)
    assert _grid(str(mask)) == ["....."] * 3
    assert "density=0.0000" in str(mask)


@pytest.mark.parametrize("heads", [1, 3])
def test_plot_writes_png(tmp_path, heads):
    mask = make("bigbird", 1000, block=32, heads=heads, causal=True)
    path = tmp_path / "mask.png"
    mask.plot(str(path))
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000
    # width grows with the number of heads drawn
    width = int.from_bytes(data[16:20], "big")
    assert width == 400 * heads
