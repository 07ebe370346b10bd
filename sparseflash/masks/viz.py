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


ELEMENT_PICTURE_MAX = 1 << 22  # a PNG draws single scores up to this many (q_len x kv_len)


def _panels(mask: "BlockMask", max_heads: int) -> list[tuple[str, tuple[int, ...]]]:
    """``(label, layout index)`` of the first ``max_heads`` layouts: heads, and batch elements of a
    batch-dependent mask."""
    if mask.layout.dim() == 4:
        pairs = [(b, h) for b in range(mask.num_batches) for h in range(mask.num_heads)][:max_heads]
        return [(f"batch {b} head {h}", (b, h)) for b, h in pairs]
    return [(f"head {h}", (h,)) for h in range(min(mask.num_heads, max_heads))]


def ascii_picture(mask: "BlockMask", max_cells: int = 64, max_heads: int = 4) -> str:
    """One text grid per layout head: ``#`` full tile, ``+`` partial tile, ``.`` skipped.

    Masks wider than ``max_cells`` tiles are drawn with one character per group of tiles
    (``#`` all full, ``.`` all skipped, ``+`` mixed)."""
    lines = []
    full, partial = mask.full_layout.cpu(), mask.partial_layout.cpu()
    panels = _panels(mask, max_heads)
    for label, index in panels:
        on = full[index] | partial[index]
        any_on, _, group = _downsample(on, max_cells)
        _, all_full, _ = _downsample(full[index], max_cells)
        if mask.layout[..., 0, 0].numel() > 1 or group > 1:
            lines.append(label + (f" ({group}x{group} tiles per character)" if group > 1 else ""))
        for row_any, row_full in zip(any_on.tolist(), all_full.tolist()):
            lines.append("".join(FULL if f else PARTIAL if a else EMPTY for a, f in zip(row_any, row_full)))
    hidden = mask.layout[..., 0, 0].numel() - len(panels)
    if hidden > 0:
        lines.append(f"... {hidden} more heads")
    return "\n".join(lines)


def plot_png(mask: "BlockMask", path: str, max_heads: int = 4) -> None:
    """Save the first ``max_heads`` layouts as a PNG. Tiles: full dark, partial mid-grey. A mask with
    an element predicate (causal or a mask_mod) of at most ``ELEMENT_PICTURE_MAX`` scores is drawn
    score by score: kept black, computed but dropped inside a partial tile light grey (work the
    kernels do and throw away), never computed white."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(mask, max_heads)
    elements = (mask.causal or mask.mask_mod is not None) and mask.q_len * mask.kv_len <= ELEMENT_PICTURE_MAX
    if elements:
        block_m, block_n = mask.block_size
        computed = mask.layout.repeat_interleave(block_m, -2).repeat_interleave(block_n, -1)
        computed = computed[..., : mask.q_len, : mask.kv_len].float()
        dense = mask.to_dense().float()
        picture = (0.25 * computed + 0.75 * dense.expand_as(computed)).cpu()
        unit = "token"
    else:
        picture = (mask.full_layout.float() + 0.5 * mask.partial_layout.float()).cpu()
        unit = "block"
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4), squeeze=False)
    for (label, index), ax in zip(panels, axes[0]):
        ax.imshow(picture[index].numpy(), cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
        ax.set_title(label if len(panels) > 1 else f"density {mask.density:.3f}")
        ax.set_xlabel(f"key {unit}" + (f" ({mask.block_size[1]})" if unit == "block" else ""))
        ax.set_ylabel(f"query {unit}" + (f" ({mask.block_size[0]})" if unit == "block" else ""))
    fig.suptitle(f"{mask.kind.name} q_len={mask.q_len} kv_len={mask.kv_len}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
