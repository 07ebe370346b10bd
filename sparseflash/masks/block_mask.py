"""BlockMask: the one mask object every attention backend reads.

Storage
-------
A mask is kept at block granularity. The score matrix of one head, ``q_len x kv_len``, is cut
into tiles of ``SPARSE_BLOCK_M x SPARSE_BLOCK_N`` (``block_size``); the last row and column of
tiles may be ragged when the lengths are not multiples of the block. ``layout`` is a bool tensor
``[H_or_1, n_q_blocks, n_kv_blocks]``: True means the tile is computed, False means it is never
loaded, multiplied or stored. A leading dimension of 1 is shared by every head.

Inside computed tiles one element-level predicate may apply: ``causal`` keeps the score
``(q_idx, kv_idx)`` only when ``q_idx >= kv_idx``. Indices are absolute positions counted from 0
for both queries and keys (top-left alignment, as ``torch.nn.functional.scaled_dot_product_attention``
with ``is_causal=True`` and FlexAttention's ``q_idx >= kv_idx``): with ``q_len < kv_len`` the last
keys are never seen, with ``q_len > kv_len`` the last queries see every key.

The stored layout is canonical: tiles that the causal predicate empties entirely are switched off
on construction, so two masks that select the same elements compare equal.

Derived, cached per device (``tables(device)``):
- row tables ``kv_num_blocks [H, n_q]``, ``kv_indices [H, n_q, n_kv]`` (ascending; entries past
  ``kv_num_blocks`` are padding and never read) for the forward and dQ passes;
- column tables ``q_num_blocks [H, n_kv]``, ``q_indices [H, n_kv, n_q]`` for the dK/dV pass;
- each split into *full* tiles (every element kept and in bounds: no element mask needed) and
  *partial* tiles (a causal diagonal, or a ragged last tile of keys or of queries: the kernel
  applies the element mask and the bounds).

A row of queries with no computed tile is legal: its output is 0 and its log-sum-exp ``-inf``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

MIN_BLOCK, MAX_BLOCK = 16, 256
DEFAULT_BLOCK = 128  # the mask block wherever none is given


class MaskKind(enum.Enum):
    """Which kernel specialisation a mask selects."""

    DENSE = "dense"  # every tile computed, no element predicate
    CAUSAL = "causal"  # every tile the causal predicate allows, and nothing else
    SPARSE = "sparse"  # anything else: walk the tables


@dataclass(frozen=True)
class BlockTables:
    """Index tables of one mask on one device (all int32).

    ``H`` is the number of layout heads (1 when shared). ``*_kv_*`` are row tables (one row per
    query block), ``*_q_*`` column tables (one row per key block). Entries past ``num_blocks``
    are padding.
    """

    full_kv_num_blocks: torch.Tensor  # [H, n_q]
    full_kv_indices: torch.Tensor  # [H, n_q, n_kv]
    partial_kv_num_blocks: torch.Tensor  # [H, n_q]
    partial_kv_indices: torch.Tensor  # [H, n_q, n_kv]
    full_q_num_blocks: torch.Tensor  # [H, n_kv]
    full_q_indices: torch.Tensor  # [H, n_kv, n_q]
    partial_q_num_blocks: torch.Tensor  # [H, n_kv]
    partial_q_indices: torch.Tensor  # [H, n_kv, n_q]


def layout_to_tables(layout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row tables of a bool layout ``[..., n_rows, n_cols]``.

    Returns ``num_blocks [..., n_rows]`` and ``indices [..., n_rows, n_cols]`` (int32), the
    column indices of the True entries first and in ascending order; both contiguous (the
    kernels step through a row with unit stride).
    """
    num_blocks = layout.sum(-1, dtype=torch.int32).contiguous()
    indices = torch.argsort((~layout).to(torch.int8), dim=-1, stable=True).to(torch.int32).contiguous()
    return num_blocks, indices


def _check_block(value: int, name: str) -> int:
    value = int(value)
    if not (MIN_BLOCK <= value <= MAX_BLOCK and value & (value - 1) == 0):
        raise ValueError(
            f"{name} must be a power of two from {MIN_BLOCK} to {MAX_BLOCK}; got {value}"
        )
    return value


def normalize_block_size(block_size: int | tuple[int, int]) -> tuple[int, int]:
    """``128`` or ``(128, 64)`` -> ``(SPARSE_BLOCK_M, SPARSE_BLOCK_N)``, checked."""
    if isinstance(block_size, int):
        block_size = (block_size, block_size)
    if len(block_size) != 2:
        raise ValueError(f"block_size must be an int or a pair (M, N); got {block_size!r}")
    return _check_block(block_size[0], "SPARSE_BLOCK_M"), _check_block(block_size[1], "SPARSE_BLOCK_N")


class BlockMask:
    """A block-sparse attention mask; see the module docstring for its storage and semantics.

    Args:
        layout: bool ``[n_q_blocks, n_kv_blocks]`` or ``[H_or_1, n_q_blocks, n_kv_blocks]``.
        block_size: ``SPARSE_BLOCK_M`` (queries) and ``SPARSE_BLOCK_N`` (keys), powers of two
            from 16 to 256; an int sets both.
        q_len, kv_len: sequence lengths; default ``n_blocks * block``. The last block may be
            ragged: ``ceil(len / block)`` must equal the number of blocks.
        causal: apply ``q_idx >= kv_idx`` inside the computed tiles.
    """

    def __init__(
        self,
        layout: torch.Tensor,
        block_size: int | tuple[int, int] = DEFAULT_BLOCK,
        q_len: int | None = None,
        kv_len: int | None = None,
        causal: bool = False,
    ):
        layout = torch.as_tensor(layout)
        if layout.dim() == 2:
            layout = layout.unsqueeze(0)
        if layout.dim() != 3:
            raise ValueError(
                f"layout must be [n_q_blocks, n_kv_blocks] or [H, n_q_blocks, n_kv_blocks]; "
                f"got shape {tuple(layout.shape)}"
            )
        if layout.dtype != torch.bool:
            raise ValueError(f"layout must be a bool tensor; got dtype {layout.dtype}")
        block_m, block_n = normalize_block_size(block_size)
        _, n_q, n_kv = layout.shape
        q_len = n_q * block_m if q_len is None else int(q_len)
        kv_len = n_kv * block_n if kv_len is None else int(kv_len)
        for name, length, n, block in (("q_len", q_len, n_q, block_m), ("kv_len", kv_len, n_kv, block_n)):
            if length < 1:
                raise ValueError(f"{name} must be >= 1; got {length}")
            if -(-length // block) != n:
                raise ValueError(
                    f"{name}={length} with block {block} needs {-(-length // block)} blocks; "
                    f"the layout has {n}"
                )
        self.block_size = (block_m, block_n)
        self.q_len, self.kv_len = q_len, kv_len
        self.causal = bool(causal)
        visible, partial = self._tile_classes(layout.device)
        self.layout = (layout & visible).contiguous()
        self._visible_tiles, self._partial_tiles = visible, partial
        self._tables: dict[str, BlockTables] = {}
        # What a backend derives from this mask and keeps while the mask lives, under its own key.
        self.derived: dict[str, dict] = {}

    # ------------------------------------------------------------------ geometry
    @property
    def num_heads(self) -> int:
        """Heads of the layout: 1 when every head shares it."""
        return self.layout.shape[0]

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(H_or_1, n_q_blocks, n_kv_blocks)``."""
        return tuple(self.layout.shape)

    @property
    def device(self) -> torch.device:
        return self.layout.device

    def _tile_classes(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``visible [n_q, n_kv]``: the tile keeps at least one element; ``partial``: it drops some."""
        block_m, block_n = self.block_size
        n_q, n_kv = -(-self.q_len // block_m), -(-self.kv_len // block_n)
        q_first = torch.arange(n_q, device=device) * block_m
        q_last = torch.clamp(q_first + block_m, max=self.q_len) - 1
        kv_first = torch.arange(n_kv, device=device) * block_n
        kv_last = torch.clamp(kv_first + block_n, max=self.kv_len) - 1
        ragged = (kv_last - kv_first + 1 < block_n)[None, :] | (q_last - q_first + 1 < block_m)[:, None]
        if not self.causal:
            return torch.ones(n_q, n_kv, dtype=torch.bool, device=device), ragged
        visible = q_last[:, None] >= kv_first[None, :]
        crosses_diagonal = kv_last[None, :] > q_first[:, None]
        return visible, crosses_diagonal | ragged

    # ------------------------------------------------------------------ derived views
    @property
    def kind(self) -> MaskKind:
        """DENSE (all tiles, no predicate), CAUSAL (all tiles the predicate allows) or SPARSE."""
        if not hasattr(self, "_kind"):
            all_on = bool((self.layout == self._visible_tiles).all())
            self._kind = (MaskKind.CAUSAL if self.causal else MaskKind.DENSE) if all_on else MaskKind.SPARSE
        return self._kind

    @property
    def mean_row_blocks(self) -> float:
        """Mean computed tiles per query-block row (cached: reading it costs no device sync)."""
        if not hasattr(self, "_mean_row_blocks"):
            self._mean_row_blocks = self.layout.sum().item() / (self.num_heads * self.layout.shape[1])
        return self._mean_row_blocks

    @property
    def full_layout(self) -> torch.Tensor:
        """``[H_or_1, n_q, n_kv]``: computed tiles that need no element mask."""
        return self.layout & ~self._partial_tiles

    @property
    def partial_layout(self) -> torch.Tensor:
        """``[H_or_1, n_q, n_kv]``: computed tiles where the element mask drops some scores."""
        return self.layout & self._partial_tiles

    def tables(self, device: torch.device | str | None = None) -> BlockTables:
        """Full/partial row and column tables on ``device`` (default: the mask's), cached."""
        device = torch.device(device if device is not None else self.device)
        key = str(device)
        if key not in self._tables:
            full, partial = self.full_layout.to(device), self.partial_layout.to(device)
            self._tables[key] = BlockTables(
                *layout_to_tables(full),
                *layout_to_tables(partial),
                *layout_to_tables(full.transpose(1, 2)),
                *layout_to_tables(partial.transpose(1, 2)),
            )
        return self._tables[key]

    @property
    def kv_num_blocks(self) -> torch.Tensor:
        """``[H_or_1, n_q]`` int32: computed tiles of each query-block row."""
        return layout_to_tables(self.layout)[0]

    @property
    def kv_indices(self) -> torch.Tensor:
        """``[H_or_1, n_q, n_kv]`` int32: their key-block indices, ascending, then padding."""
        return layout_to_tables(self.layout)[1]

    @property
    def q_num_blocks(self) -> torch.Tensor:
        """``[H_or_1, n_kv]`` int32: computed tiles of each key-block column."""
        return layout_to_tables(self.layout.transpose(1, 2))[0]

    @property
    def q_indices(self) -> torch.Tensor:
        """``[H_or_1, n_kv, n_q]`` int32: their query-block indices, ascending, then padding."""
        return layout_to_tables(self.layout.transpose(1, 2))[1]

    def _kept_per_tile(self) -> torch.Tensor:
        """``[n_q, n_kv]`` int64: how many scores each tile keeps when it is computed."""
        block_m, block_n = self.block_size
        n_q, n_kv = self.layout.shape[1:]
        a = torch.arange(n_q, dtype=torch.int64) * block_m
        b = torch.clamp(a + block_m, max=self.q_len) - 1
        c = torch.arange(n_kv, dtype=torch.int64) * block_n
        d = torch.clamp(c + block_n, max=self.kv_len) - 1
        a, b, c, d = a[:, None], b[:, None], c[None, :], d[None, :]
        if not self.causal:
            return (b - a + 1) * (d - c + 1)
        # rows q in [lo, hi] see q - c + 1 keys; rows past d see the whole tile width.
        lo, hi = torch.maximum(a, c), torch.minimum(b, d)
        n_mid = torch.clamp(hi - lo + 1, min=0)
        on_diagonal = n_mid * (lo + hi) // 2 - n_mid * (c - 1)
        n_below = torch.clamp(b - torch.maximum(a, d + 1) + 1, min=0)
        return on_diagonal + n_below * (d - c + 1)

    @property
    def density(self) -> float:
        """Exact fraction of the ``q_len x kv_len`` scores computed (averaged over layout heads)."""
        kept = (self.layout.cpu().to(torch.int64) * self._kept_per_tile()).sum().item()
        return kept / (self.num_heads * self.q_len * self.kv_len)

    def to_dense(self) -> torch.Tensor:
        """Element-level bool mask ``[H_or_1, q_len, kv_len]`` (True = score kept)."""
        block_m, block_n = self.block_size
        dense = self.layout.repeat_interleave(block_m, 1).repeat_interleave(block_n, 2)
        dense = dense[:, : self.q_len, : self.kv_len]
        if self.causal:
            q_idx = torch.arange(self.q_len, device=self.device)[:, None]
            kv_idx = torch.arange(self.kv_len, device=self.device)[None, :]
            dense = dense & (q_idx >= kv_idx)
        return dense

    # ------------------------------------------------------------------ algebra
    def _replace(self, layout: torch.Tensor, causal: bool | None = None) -> "BlockMask":
        return BlockMask(layout, self.block_size, self.q_len, self.kv_len,
                         self.causal if causal is None else causal)

    def _check_compatible(self, other: "BlockMask", op: str) -> None:
        if not isinstance(other, BlockMask):
            raise TypeError(f"{op} needs two BlockMasks; got {type(other).__name__}")
        mine = (self.block_size, self.q_len, self.kv_len)
        theirs = (other.block_size, other.q_len, other.kv_len)
        if mine != theirs:
            raise ValueError(
                f"{op} needs masks of the same (block_size, q_len, kv_len); got {mine} and {theirs}"
            )
        if 1 not in (self.num_heads, other.num_heads) and self.num_heads != other.num_heads:
            raise ValueError(f"{op}: layouts of {self.num_heads} and {other.num_heads} heads do not broadcast")

    def __and__(self, other: "BlockMask") -> "BlockMask":
        """Scores kept by both masks."""
        self._check_compatible(other, "&")
        return self._replace(self.layout & other.layout.to(self.device), self.causal or other.causal)

    def __or__(self, other: "BlockMask") -> "BlockMask":
        """Scores kept by either mask (both causal or both not: a mixed union has no block form)."""
        self._check_compatible(other, "|")
        if self.causal != other.causal:
            raise ValueError(
                "| of a causal and a non-causal mask cannot be stored as one BlockMask; "
                "make both causal or neither"
            )
        return self._replace(self.layout | other.layout.to(self.device))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockMask):
            return NotImplemented
        if (self.block_size, self.q_len, self.kv_len, self.causal) != (
            other.block_size, other.q_len, other.kv_len, other.causal
        ):
            return False
        try:
            a, b = torch.broadcast_tensors(self.layout, other.layout.to(self.device))
        except RuntimeError:
            return False
        return bool((a == b).all())

    __hash__ = None  # holds a tensor: equality is by value, so it is not hashable

    def to(self, device: torch.device | str) -> "BlockMask":
        """The same mask with its layout on ``device``."""
        if torch.device(device) == self.device:
            return self
        return self._replace(self.layout.to(device))

    # ------------------------------------------------------------------ pictures
    def __repr__(self) -> str:
        return (
            f"BlockMask(kind={self.kind.name}, heads={self.num_heads}, q_len={self.q_len}, "
            f"kv_len={self.kv_len}, block_size={self.block_size}, causal={self.causal}, "
            f"density={self.density:.4f})"
        )

    def __str__(self) -> str:
        from sparseflash.masks.viz import ascii_picture

        return repr(self) + "\n" + ascii_picture(self)

    def plot(self, path: str, max_heads: int = 4) -> None:
        """Write a PNG picture of the layout (needs matplotlib)."""
        from sparseflash.masks.viz import plot_png

        plot_png(self, path, max_heads=max_heads)
