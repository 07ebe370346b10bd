"""Pictures of a BlockMask: ASCII for the terminal, PNG for papers and W&B."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sparseflash.masks.block_mask import BlockMask

FULL, PARTIAL, EMPTY = "#", "+", "."


def _downsample(layout: torch.Tensor, max_cells: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Group ``[n_q, n_kv]`` tiles into at most ``max_cells`` cells a side.

    Returns (any tile on, all tiles on, tiles per cell side)."""
    n = max(layout.shape)
    group = -(-n // max_cells)
    if group == 1:
        return layout, layout, 1
    pad_q, pad_kv = (-layout.shape[0]) % group, (-layout.shape[1]) % group

    def cells(fill: float) -> torch.Tensor:  # (cells_q, cells_kv, group, group); past the edge: fill
        x = torch.nn.functional.pad(layout.float()[None, None], (0, pad_kv, 0, pad_q), value=fill)[0, 0]
        return x.unflatten(0, (-1, group)).unflatten(2, (-1, group)).transpose(1, 2)

    # tiles past the edge count as off for "any" and as on for "all"
    return cells(0.0).amax((-1, -2)) > 0, cells(1.0).amin((-1, -2)) > 0, group


def ascii_picture(mask: "BlockMask", max_cells: int = 64, max_heads: int = 4) -> str:
    """One text grid per layout head: ``#`` full tile, ``+`` partial tile, ``.`` skipped.

    Masks wider than ``max_cells`` tiles are drawn with one character per group of tiles
    (``#`` all full, ``.`` all skipped, ``+`` mixed)."""
    lines = []
    full, partial = mask.full_layout.cpu(), mask.partial_layout.cpu()
    for h in range(min(mask.num_heads, max_heads)):
        on = full[h] | partial[h]
        any_on, all_full, group = _downsample(on, max_cells)
        _, all_full, _ = _downsample(full[h], max_cells)
        if mask.num_heads > 1 or group > 1:
            lines.append(f"head {h}" + (f" ({group}x{group} tiles per character)" if group > 1 else ""))
        for row_any, row_full in zip(any_on.tolist(), all_full.tolist()):
            lines.append("".join(FULL if f else PARTIAL if a else EMPTY for a, f in zip(row_any, row_full)))
    if mask.num_heads > max_heads:
        lines.append(f"... {mask.num_heads - max_heads} more heads")
    return "\n".join(lines)


def plot_png(mask: "BlockMask", path: str, max_heads: int = 4) -> None:
    """Save the layout of the first ``max_heads`` heads as a PNG (full dark, partial mid-grey)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = min(mask.num_heads, max_heads)
    picture = (mask.full_layout.float() + 0.5 * mask.partial_layout.float()).cpu()
    fig, axes = plt.subplots(1, heads, figsize=(4 * heads, 4), squeeze=False)
    for h, ax in enumerate(axes[0]):
        ax.imshow(picture[h].numpy(), cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
        ax.set_title(f"head {h}" if mask.num_heads > 1 else f"density {mask.density:.3f}")
        ax.set_xlabel(f"key block ({mask.block_size[1]})")
        ax.set_ylabel(f"query block ({mask.block_size[0]})")
    fig.suptitle(f"{mask.kind.name} q_len={mask.q_len} kv_len={mask.kv_len}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
