"""BlockMask: the one mask object every attention backend reads.

Storage
-------
A mask is kept at block granularity. The score matrix of one head, ``q_len x kv_len``, is cut
into tiles of ``SPARSE_BLOCK_M x SPARSE_BLOCK_N`` (``block_size``); the last row and column of
tiles may be ragged when the lengths are not multiples of the block. ``layout`` is a bool tensor
``[H_or_1, n_q_blocks, n_kv_blocks]``: True means the tile is computed, False means it is never
loaded, multiplied or stored. A leading dimension of 1 is shared by every head. A mask whose element
predicate depends on the batch element has a batch dimension in front: ``[B, H_or_1, n_q, n_kv]``.

Inside computed tiles element-level predicates may apply: ``causal`` keeps the score
``(q_idx, kv_idx)`` only when ``q_idx >= kv_idx``, and ``mask_mod(b, h, q_idx, kv_idx)`` (FlexAttention's
signature, ``sparseflash.masks.functions``) keeps the scores where it is True. The mask_mod is
evaluated once per tile, in chunks, on the mask's device, when the mask is built: a tile where it keeps
nothing is switched off, one where it keeps everything is full (the kernels never evaluate it there),
the others are partial. Indices are absolute positions counted from 0
for both queries and keys (top-left alignment, as ``torch.nn.functional.scaled_dot_product_attention``
with ``is_causal=True`` and FlexAttention's ``q_idx >= kv_idx``): with ``q_len < kv_len`` the last
keys are never seen, with ``q_len > kv_len`` the last queries see every key.

The stored layout is canonical: tiles that the predicates empty entirely are switched off on
construction, so two masks without a mask_mod that select the same elements compare equal.

Derived, cached per device (``tables(device)``):
- row tables ``kv_num_blocks [H, n_q]``, ``kv_indices [H, n_q, n_kv]`` (ascending; entries past
  ``kv_num_blocks`` are padding and never read) for the forward and dQ passes;
- column tables ``q_num_blocks [H, n_kv]``, ``q_indices [H, n_kv, n_q]`` for the dK/dV pass;
- each split into *full* tiles (every element kept and in bounds: no element mask needed) and
  *partial* tiles (a causal diagonal, a tile the mask_mod cuts, or a ragged last tile of keys or of
  queries: the kernel applies the element mask and the bounds);
- tables carry the layout's leading dimensions (``[B, H, ...]`` for a batch-dependent mask).

A row of queries with no computed tile is legal: its output is 0 and its log-sum-exp ``-inf``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from sparseflash.masks.functions import Graph, trace

MaskMod = Callable[..., torch.Tensor]  # (b, h, q_idx, kv_idx) -> bool
EVAL_ELEMENTS = 1 << 24  # the mask_mod is evaluated on at most this many scores at a time

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


def check_count(value, name: str) -> int:
    """``value`` as an int >= 1 (a sequence length), else ValueError naming ``name``: a float, a string or a
    bool is not a length."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ValueError(f"{name} must be an int >= 1; got {value!r}")
    if value.__index__() < 1:
        raise ValueError(f"{name} must be >= 1; got {value}")
    return value.__index__()


def _check_block(value: int, name: str) -> int:
    value = value.__index__() if hasattr(value, "__index__") and not isinstance(value, bool) else value
    if not isinstance(value, int) or not (MIN_BLOCK <= value <= MAX_BLOCK and value & (value - 1) == 0):
        raise ValueError(
            f"{name} must be a power of two from {MIN_BLOCK} to {MAX_BLOCK}; got {value!r}"
        )
    return value


def normalize_block_size(block_size: int | tuple[int, int]) -> tuple[int, int]:
    """``128`` or ``(128, 64)`` -> ``(SPARSE_BLOCK_M, SPARSE_BLOCK_N)``, checked."""
    if hasattr(block_size, "__index__"):
        block_size = (block_size, block_size)
    if not isinstance(block_size, (tuple, list)) or len(block_size) != 2:
        raise ValueError(f"block_size must be an int or a pair (M, N); got {block_size!r}")
    return _check_block(block_size[0], "SPARSE_BLOCK_M"), _check_block(block_size[1], "SPARSE_BLOCK_N")


class BlockMask:
    """A block-sparse attention mask; see the module docstring for its storage and semantics.

    Args:
        layout: bool ``[n_q_blocks, n_kv_blocks]``, ``[H_or_1, n_q_blocks, n_kv_blocks]`` or, for a
            batch-dependent mask_mod, ``[B, H_or_1, n_q_blocks, n_kv_blocks]``.
        block_size: ``SPARSE_BLOCK_M`` (queries) and ``SPARSE_BLOCK_N`` (keys), powers of two
            from 16 to 256; an int sets both.
        q_len, kv_len: sequence lengths; default ``n_blocks * block``. The last block may be
            ragged: ``ceil(len / block)`` must equal the number of blocks.
        causal: apply ``q_idx >= kv_idx`` inside the computed tiles.
        mask_mod: ``(b, h, q_idx, kv_idx) -> bool``, applied inside the computed tiles (checked and
            classified per tile here). ``b`` runs over the layout's batch dimension (0 without one),
            ``h`` over its heads (0 for a shared layout).

    A mask is immutable: what it derives (its kind, tables, tiles) is computed from these once, so
    they cannot be set again; ``&``, ``|``, ``batch_view`` and ``to`` make new masks.
    """

    FIELDS = ("layout", "block_size", "q_len", "kv_len", "causal", "mask_mod")

    def __setattr__(self, name: str, value) -> None:
        if name in BlockMask.FIELDS and name in self.__dict__:
            raise AttributeError(f"a BlockMask is immutable: build a new one instead of setting {name}")
        object.__setattr__(self, name, value)

    def __init__(
        self,
        layout: torch.Tensor,
        block_size: int | tuple[int, int] = DEFAULT_BLOCK,
        q_len: int | None = None,
        kv_len: int | None = None,
        causal: bool = False,
        mask_mod: Optional[MaskMod] = None,
    ):
        layout = torch.as_tensor(layout)
        if layout.dim() == 2:
            layout = layout.unsqueeze(0)
        if layout.dim() not in (3, 4):
            raise ValueError(
                f"layout must be [n_q_blocks, n_kv_blocks], [H, n_q_blocks, n_kv_blocks] or "
                f"[B, H, n_q_blocks, n_kv_blocks]; got shape {tuple(layout.shape)}"
            )
        if layout.dtype != torch.bool:
            raise ValueError(f"layout must be a bool tensor; got dtype {layout.dtype}")
        block_m, block_n = normalize_block_size(block_size)
        n_q, n_kv = layout.shape[-2:]
        q_len = n_q * block_m if q_len is None else check_count(q_len, "q_len")
        kv_len = n_kv * block_n if kv_len is None else check_count(kv_len, "kv_len")
        for name, length, n, block in (("q_len", q_len, n_q, block_m), ("kv_len", kv_len, n_kv, block_n)):
            if -(-length // block) != n:
                raise ValueError(
                    f"{name}={length} with block {block} needs {-(-length // block)} blocks; "
                    f"the layout has {n}"
                )
        self.block_size = (block_m, block_n)
        self.q_len, self.kv_len = q_len, kv_len
        self.causal = bool(causal)
        self.mask_mod = mask_mod
        visible, partial = self._tile_classes(layout.device)
        layout = layout & visible
        self._mod_kept = None  # per tile, the scores the mask_mod keeps (with causal and bounds)
        # a function the kernels cannot run fails here
        self._mask_graph = trace(mask_mod, "mask_mod") if mask_mod is not None else None
        self._parts_text = _parts_text(self.block_size, q_len, kv_len, self.causal, self._mask_graph)
        if mask_mod is not None:
            kept = _count_kept(mask_mod, self.causal, layout, self.block_size, q_len, kv_len)
            layout = kept > 0
            partial = partial | (kept < self._kept_per_tile().to(kept.device))
            self._mod_kept = kept
        self.layout = layout.contiguous()
        self._partial_tiles = partial
        self._tables: dict[str, BlockTables] = {}
        # What a backend derives from this mask and keeps while the mask lives, under its own key.
        self.derived: dict[str, dict] = {}

    @classmethod
    def _restore(cls, layout, block_size, q_len, kv_len, causal, mask_mod, partial, mod_kept,
                 mask_graph: Graph | None = None) -> "BlockMask":
        """A mask from parts already derived (a device move, a batch view): no mask_mod evaluation (its graph
        is traced unless given)."""
        mask = cls.__new__(cls)
        mask.block_size, mask.q_len, mask.kv_len, mask.causal, mask.mask_mod = block_size, q_len, kv_len, causal, mask_mod
        mask._mask_graph = mask_graph if mask_graph is not None or mask_mod is None else trace(mask_mod, "mask_mod")
        mask._parts_text = _parts_text(block_size, q_len, kv_len, causal, mask._mask_graph)
        mask.layout, mask._partial_tiles, mask._mod_kept = layout.contiguous(), partial, mod_kept
        mask._tables, mask.derived = {}, {}
        return mask

    # ------------------------------------------------------------------ geometry
    @property
    def num_heads(self) -> int:
        """Heads of the layout: 1 when every head shares it."""
        return self.layout.shape[-3]

    @property
    def num_batches(self) -> int:
        """Batch elements of the layout: 1 when every element shares it (no batch dimension)."""
        return self.layout.shape[0] if self.layout.dim() == 4 else 1

    @property
    def shape(self) -> tuple[int, ...]:
        """The layout's shape: ``(H_or_1, n_q_blocks, n_kv_blocks)``, with ``B`` in front for a
        batch-dependent mask."""
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

    # ------------------------------------------------------------------ the element predicate
    @property
    def mask_graph(self) -> Graph | None:
        """The mask_mod's traced graph (``sparseflash.masks.functions``), None without a mask_mod."""
        return self._mask_graph

    def check_shared_dims(self, batch: int, heads: int) -> None:
        """Raise ValueError where the mask_mod reads ``b`` (``h``) but the mask holds one batch element (head)
        for inputs of several: its tiles were classified with 0 alone, so it cannot serve the others."""
        reads = self._mask_graph.output.deps if self._mask_graph is not None else frozenset()
        for arg, have, want, what, option in (("h", self.num_heads, heads, "head", "heads"),
                                              ("b", self.num_batches, batch, "batch element", "batch")):
            if arg in reads and have == 1 and want > 1:
                raise ValueError(f"the mask's mask_mod reads {arg}, but the mask was built for one {what} and the "
                                 f"inputs have {want}: build it with from_mask_mod(..., {option}={want})")

    def mask_mod_at(self, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        """The element predicate (causal and mask_mod) at broadcastable ``q_idx``, ``kv_idx`` (absolute
        positions), as bool ``[B_or_1, H_or_1, ...]``."""
        return _predicate(self.mask_mod, self.causal, self.num_batches, self.num_heads, q_idx, kv_idx)

    def batch_view(self, b: int) -> "BlockMask":
        """The mask that batch element ``b`` sees, with no batch dimension (itself when it has none)."""
        if self.layout.dim() == 3:
            return self
        mod, view_mod = self.mask_mod, None  # a layout per batch element may come without a mask_mod
        if mod is not None:
            index = torch.tensor(b, device=self.device)
            view_mod = lambda _b, h, q_idx, kv_idx: mod(index, h, q_idx, kv_idx)  # noqa: E731
        return BlockMask._restore(self.layout[b], self.block_size, self.q_len, self.kv_len, self.causal, view_mod,
                                  self._partial_tiles if self._partial_tiles.dim() < 4 else self._partial_tiles[b],
                                  None if self._mod_kept is None else self._mod_kept[b])

    # ------------------------------------------------------------------ derived views
    @property
    def kind(self) -> MaskKind:
        """DENSE (all tiles, no predicate), CAUSAL (all tiles the causal predicate allows, no
        mask_mod) or SPARSE."""
        if not hasattr(self, "_kind"):
            visible, _ = self._tile_classes(self.device)
            all_on = self.mask_mod is None and bool((self.layout == visible).all())
            self._kind = (MaskKind.CAUSAL if self.causal else MaskKind.DENSE) if all_on else MaskKind.SPARSE
        return self._kind

    @property
    def mean_row_blocks(self) -> float:
        """Mean computed tiles per query-block row (cached: reading it costs no device sync)."""
        if not hasattr(self, "_mean_row_blocks"):
            rows = self.layout[..., 0].numel()
            self._mean_row_blocks = self.layout.sum().item() / rows
        return self._mean_row_blocks

    @property
    def full_layout(self) -> torch.Tensor:
        """The layout's shape: computed tiles that need no element mask."""
        return self.layout & ~self._partial_tiles

    @property
    def partial_layout(self) -> torch.Tensor:
        """The layout's shape: computed tiles where an element predicate or a bound drops some scores."""
        return self.layout & self._partial_tiles

    @property
    def needs_mask_mod(self) -> bool:
        """Whether a kernel must evaluate the mask_mod: some computed tile keeps only part of its scores
        (False when every tile the mask_mod touches is full or off)."""
        if not hasattr(self, "_needs_mask_mod"):
            self._needs_mask_mod = self._mod_kept is not None and bool(
                ((self._mod_kept > 0) & (self._mod_kept < self._kept_per_tile().to(self.device))).any())
        return self._needs_mask_mod

    def tables(self, device: torch.device | str | None = None) -> BlockTables:
        """Full/partial row and column tables on ``device`` (default: the mask's), cached."""
        device = torch.device(device if device is not None else self.device)
        key = str(device)
        if key not in self._tables:
            full, partial = self.full_layout.to(device), self.partial_layout.to(device)
            self._tables[key] = BlockTables(
                *layout_to_tables(full),
                *layout_to_tables(partial),
                *layout_to_tables(full.transpose(-2, -1)),
                *layout_to_tables(partial.transpose(-2, -1)),
            )
        return self._tables[key]

    @property
    def kv_num_blocks(self) -> torch.Tensor:
        """``[..., n_q]`` int32 (the layout's leading dims): computed tiles of each query-block row."""
        return layout_to_tables(self.layout)[0]

    @property
    def kv_indices(self) -> torch.Tensor:
        """``[..., n_q, n_kv]`` int32: their key-block indices, ascending, then padding."""
        return layout_to_tables(self.layout)[1]

    @property
    def q_num_blocks(self) -> torch.Tensor:
        """``[..., n_kv]`` int32: computed tiles of each key-block column."""
        return layout_to_tables(self.layout.transpose(-2, -1))[0]

    @property
    def q_indices(self) -> torch.Tensor:
        """``[..., n_kv, n_q]`` int32: their query-block indices, ascending, then padding."""
        return layout_to_tables(self.layout.transpose(-2, -1))[1]

    def _kept_per_tile(self) -> torch.Tensor:
        """``[n_q, n_kv]`` int64: how many scores each tile keeps when it is computed (causal and
        bounds only)."""
        block_m, block_n = self.block_size
        n_q, n_kv = -(-self.q_len // block_m), -(-self.kv_len // block_n)
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
        """Exact fraction of the ``q_len x kv_len`` scores computed (averaged over layout heads and batch)."""
        if self._mod_kept is not None:
            kept = self._mod_kept.sum().item()
        else:
            kept = (self.layout.cpu().to(torch.int64) * self._kept_per_tile()).sum().item()
        return kept / (self.layout[..., 0, 0].numel() * self.q_len * self.kv_len)

    def to_dense(self, queries: range | None = None) -> torch.Tensor:
        """Element-level bool mask ``[H_or_1, q_len, kv_len]`` (``[B, H_or_1, ...]`` with a batch
        dimension), True where a score is kept; ``queries`` (a range of query indices): their rows only,
        so that a long mask can be read a band at a time."""
        block_m, block_n = self.block_size
        queries = range(self.q_len) if queries is None else queries
        q_idx = torch.arange(queries.start, queries.stop, queries.step, device=self.device)
        dense = self.layout[..., q_idx // block_m, :].repeat_interleave(block_n, -1)[..., : self.kv_len]
        if self.causal or self.mask_mod is not None:
            kv_idx = torch.arange(self.kv_len, device=self.device)[None, :]
            keep = self.mask_mod_at(q_idx[:, None], kv_idx)
            dense = dense & (keep if self.layout.dim() == 4 else keep[0])
        return dense

    # ------------------------------------------------------------------ algebra
    def _check_compatible(self, other: "BlockMask", op: str) -> None:
        if not isinstance(other, BlockMask):
            raise TypeError(f"{op} needs two BlockMasks; got {type(other).__name__}")
        mine = (self.block_size, self.q_len, self.kv_len)
        theirs = (other.block_size, other.q_len, other.kv_len)
        if mine != theirs:
            raise ValueError(
                f"{op} needs masks of the same (block_size, q_len, kv_len); got {mine} and {theirs}"
            )
        for what, a, b in (("heads", self.num_heads, other.num_heads), ("batch elements", self.num_batches,
                                                                       other.num_batches)):
            if 1 not in (a, b) and a != b:
                raise ValueError(f"{op}: layouts of {a} and {b} {what} do not broadcast")

    def _combined_layout(self, other: "BlockMask", op) -> torch.Tensor:
        a, b = self.layout, other.layout.to(self.device)
        if a.dim() != b.dim():  # one has a batch dimension: give the other one too
            a, b = (x if x.dim() == 4 else x[None] for x in (a, b))
        return op(a, b)

    def __and__(self, other: "BlockMask") -> "BlockMask":
        """Scores kept by both masks (their layouts and their element predicates)."""
        self._check_compatible(other, "&")
        mods = [m for m in (self.mask_mod, other.mask_mod) if m is not None]
        mask_mod = mods[0] if len(mods) == 1 else (_both(*mods) if mods else None)
        return BlockMask(self._combined_layout(other, torch.logical_and), self.block_size, self.q_len, self.kv_len,
                         self.causal or other.causal, mask_mod)

    def __or__(self, other: "BlockMask") -> "BlockMask":
        """Scores kept by either mask. Without mask_mods and with the same causal flag this is a union
        of layouts; otherwise the result's mask_mod asks each mask's layout and predicates in turn."""
        self._check_compatible(other, "|")
        layout = self._combined_layout(other, torch.logical_or)
        if self.mask_mod is None and other.mask_mod is None and self.causal == other.causal:
            return BlockMask(layout, self.block_size, self.q_len, self.kv_len, self.causal)
        return BlockMask(layout, self.block_size, self.q_len, self.kv_len, False, _either(self, other))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockMask):
            return NotImplemented
        if (self.block_size, self.q_len, self.kv_len, self.causal, self.mask_mod) != (
            other.block_size, other.q_len, other.kv_len, other.causal, other.mask_mod
        ):
            return False
        try:
            a, b = torch.broadcast_tensors(self.layout, other.layout.to(self.device))
        except RuntimeError:
            return False
        return bool((a == b).all())

    __hash__ = None  # holds a tensor: equality is by value, so it is not hashable

    def to(self, device: torch.device | str) -> "BlockMask":
        """The same mask with its layout on ``device``. A mask_mod's captured tensors stay where they
        are: keep them on the device where the attention runs."""
        if torch.device(device) == self.device:
            return self
        moved = BlockMask._restore(self.layout.to(device), self.block_size, self.q_len, self.kv_len, self.causal,
                                   self.mask_mod, self._partial_tiles.to(device),
                                   None if self._mod_kept is None else self._mod_kept.to(device), self._mask_graph)
        for name in ("_kind", "_mean_row_blocks"):  # what reading the layout found, on any device
            if hasattr(self, name):
                setattr(moved, name, getattr(self, name))
        return moved

    # ------------------------------------------------------------------ parts (what a custom op takes)
    def parts(self) -> tuple[list[torch.Tensor], list[torch.Tensor], str]:
        """The mask as a custom op takes it: its tensors ``[layout, partial tiles]`` (and the mask_mod's kept
        counts), the mask_mod's captured tensors, and a string of the rest (block size, lengths, causal,
        the mask_mod's traced graph). Reads no tensor's values, so torch.compile traces it: a new mask with
        the same string is a new input, not a recompile. ``from_parts`` rebuilds the mask."""
        tensors = [self.layout, self._partial_tiles] + ([] if self._mod_kept is None else [self._mod_kept])
        return tensors, [] if self._mask_graph is None else list(self._mask_graph.captures), self._parts_text

    @classmethod
    def from_parts(cls, tensors: list[torch.Tensor], captures: list[torch.Tensor], spec: str) -> "BlockMask":
        """The mask that ``parts`` took apart; its mask_mod evaluates the traced graph."""
        static, key = spec.split("#", 1)
        block_m, block_n, q_len, kv_len, causal = (int(x) for x in static.split(","))
        graph = Graph.parse(key, captures) if key else None
        layout, partial, *kept = tensors
        return cls._restore(layout, (block_m, block_n), q_len, kv_len, bool(causal),
                            None if graph is None else graph.evaluate, partial, kept[0] if kept else None, graph)

    # ------------------------------------------------------------------ pictures
    def __repr__(self) -> str:
        batch = f"batch={self.num_batches}, " if self.layout.dim() == 4 else ""
        mod = f", mask_mod={getattr(self.mask_mod, '__name__', type(self.mask_mod).__name__)}" if self.mask_mod else ""
        return (
            f"BlockMask(kind={self.kind.name}, {batch}heads={self.num_heads}, q_len={self.q_len}, "
            f"kv_len={self.kv_len}, block_size={self.block_size}, causal={self.causal}{mod}, "
            f"density={self.density:.4f})"
        )

    def __str__(self) -> str:
        from sparseflash.masks.viz import ascii_picture

        return repr(self) + "\n" + ascii_picture(self)

    def plot(self, path: str, max_heads: int = 4) -> None:
        """Write a PNG picture of the mask (needs matplotlib): its tiles and, where it has an element
        predicate and is small enough, its scores."""
        from sparseflash.masks.viz import plot_png

        plot_png(self, path, max_heads=max_heads)


def _parts_text(block_size: tuple[int, int], q_len: int, kv_len: int, causal: bool, graph: Graph | None) -> str:
    """What ``BlockMask.parts`` writes of the mask's static fields and mask_mod, made on construction: under
    torch.compile, a string made while tracing could not hold lengths traced as symbols, and reading the
    graph's nodes would tie the compiled code to this mask's objects."""
    return f"{block_size[0]},{block_size[1]},{q_len},{kv_len},{int(causal)}#" + ("" if graph is None else graph.key())


def _broadcast_shape(a: torch.Size, b: torch.Size) -> tuple[int, ...]:
    """The broadcast of two shapes. torch.broadcast_shapes would do, but its first call imports
    sympy (through torch._refs): 0.3 s on a CPU, seconds on a GPU host, on every new process's first mask."""
    a, b = (1,) * (len(b) - len(a)) + tuple(a), (1,) * (len(a) - len(b)) + tuple(b)
    if any(x != y and 1 not in (x, y) for x, y in zip(a, b)):
        raise ValueError(f"shapes {a} and {b} do not broadcast")
    return tuple(y if x == 1 else x for x, y in zip(a, b))


def _predicate(mask_mod, causal: bool, batches: int, heads: int, q_idx: torch.Tensor,
               kv_idx: torch.Tensor) -> torch.Tensor:
    """causal and ``mask_mod`` at broadcastable positions, bool ``[batches|1, heads|1, ...]``."""
    keep = (q_idx >= kv_idx) if causal else torch.ones((), dtype=torch.bool, device=q_idx.device)
    keep = keep.expand(_broadcast_shape(q_idx.shape, kv_idx.shape))[None, None]
    if mask_mod is None:
        return keep
    b = torch.arange(batches, device=q_idx.device)[:, None, None, None]
    h = torch.arange(heads, device=q_idx.device)[None, :, None, None]
    out = torch.as_tensor(mask_mod(b, h, q_idx[None, None], kv_idx[None, None]), device=q_idx.device)
    if out.dtype != torch.bool:
        raise ValueError(f"mask_mod must return a bool tensor; it returned {out.dtype}")
    return keep & out


def _count_kept(mask_mod, causal: bool, layout: torch.Tensor, block_size: tuple[int, int], q_len: int,
                kv_len: int) -> torch.Tensor:
    """The layout's shape, int64: how many scores each computed tile keeps under causal, the bounds and
    ``mask_mod`` (0 where the tile is off). The predicate is evaluated on at most EVAL_ELEMENTS
    scores at a time, and not at all on chunks of tiles that are all off."""
    block_m, block_n = block_size
    layout4 = layout if layout.dim() == 4 else layout[None]
    batches, heads, n_q, n_kv = layout4.shape
    kept = torch.zeros(layout4.shape, dtype=torch.int64, device=layout.device)
    tiles = max(1, EVAL_ELEMENTS // (batches * heads * block_m * block_n))
    cols = min(n_kv, tiles)
    rows = max(1, tiles // cols)
    for r in range(0, n_q, rows):
        for c in range(0, n_kv, cols):
            if not layout4[..., r:r + rows, c:c + cols].any():
                continue
            q_idx = torch.arange(r * block_m, min(q_len, (r + rows) * block_m), device=layout.device)
            kv_idx = torch.arange(c * block_n, min(kv_len, (c + cols) * block_n), device=layout.device)
            keep = _predicate(mask_mod, causal, batches, heads, q_idx[:, None], kv_idx[None, :])
            keep = keep.expand(batches, heads, len(q_idx), len(kv_idx)).to(torch.int32)
            keep = torch.nn.functional.pad(keep, (0, (-len(kv_idx)) % block_n, 0, (-len(q_idx)) % block_m))
            count = keep.unflatten(-1, (-1, block_n)).unflatten(-3, (-1, block_m)).sum((-3, -1))
            kept[..., r:r + count.shape[-2], c:c + count.shape[-1]] = count
    kept = kept * layout4
    return kept if layout.dim() == 4 else kept[0]


def _both(first: MaskMod, second: MaskMod) -> MaskMod:
    def both(b, h, q_idx, kv_idx):
        return first(b, h, q_idx, kv_idx) & second(b, h, q_idx, kv_idx)
    return both


def _either(first: BlockMask, second: BlockMask) -> MaskMod:
    """The predicate of a union: each mask's layout (looked up per element) and its predicates."""
    masks = []
    for mask in (first, second):
        layout = mask.layout if mask.layout.dim() == 4 else mask.layout[None]
        masks.append((layout.to(first.device), mask.causal, mask.mask_mod))
    block_m, block_n = first.block_size
    shared = [(layout.shape[0] == 1, layout.shape[1] == 1) for layout, _, _ in masks]

    def either(b, h, q_idx, kv_idx):
        out = None
        for (layout, causal, mod), (one_batch, one_head) in zip(masks, shared):
            # 0 for a shared dimension, not b * 0: the predicate then does not read b (h), which a mask of one
            # batch element (head) requires (check_shared_dims)
            keep = layout[0 if one_batch else b, 0 if one_head else h, q_idx // block_m, kv_idx // block_n]
            if causal:
                keep = keep & (q_idx >= kv_idx)
            if mod is not None:
                keep = keep & mod(b, h, q_idx, kv_idx)
            out = keep if out is None else out | keep
        return out
    return either
