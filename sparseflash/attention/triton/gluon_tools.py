"""What the Gluon kernels for Hopper (forward_gluon.py, backward_gluon.py) share: TMA copies in the names
Triton 3.6 and 3.9 give them, named barriers between pairs of consumer warpgroups, TMA descriptors over the
row views of (B, H, S, D) tensors, and the ``SPARSEFLASH_GLUON`` switch."""

from __future__ import annotations

import functools

import torch
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma, warpgroup_mma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.core import builtin

from sparseflash.attention.triton.forward_persistent import row_view_rows
from sparseflash.attention.triton.launch import kernel_switch
from sparseflash.masks import MaskKind

# Triton 3.9 renamed Triton 3.6's TMA load and store (and removed the old names)
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
# and its barrier of a partition's threads (bar.sync of its warps)
thread_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@builtin
def tma_reduce_add(desc, coord, src, _semantic=None):
    """Add the shared-memory tile ``src`` into the tensor of TMA descriptor ``desc`` at ``coord``
    (``cp.reduce.async.bulk.tensor...add``; wait for it to have read ``src`` with ``tma.store_wait``).
    Triton 3.9 calls it ``tma.async_atomic_add``; 3.6 builds the same operation but has no Gluon name for it."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, coord, src.handle)


@gluon.jit
def named_sync(barrier: gl.constexpr, x):
    """``bar.sync barrier, 256``: wait until two consumer warpgroups reach ``barrier``, this one and another that
    may have arrived there with ``named_arrive``. Returns x, which orders it among x's uses."""
    return gl.inline_asm_elementwise(f"bar.sync {barrier}, 256; mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def named_arrive(barrier: gl.constexpr, x):
    """``bar.arrive barrier, 256``: let the consumer warpgroup that syncs on ``barrier`` pass. Returns x."""
    return gl.inline_asm_elementwise(f"bar.arrive {barrier}, 256; mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def load_box(desc, desc2, row, col, bar, dst, dst2, HEAD_DIM2: gl.constexpr):
    """TMA-load the box of ``desc`` at (row, col) into dst and, with HEAD_DIM2 (a head dim in two parts,
    ``plan.head_dim_parts``), the second part's (desc2's box at the columns after the first part's) into dst2,
    both arriving on ``bar``."""
    tma_load(desc, [row, col], bar, dst)
    if HEAD_DIM2 > 0:
        tma_load(desc2, [row, col + desc.block_type.shape[1]], bar, dst2)


@gluon.jit
def issue_abt(a, a2, b, b2, zero, HEAD_DIM2: gl.constexpr):
    """Issue A B^T (shared-memory a (M, HEAD_DIM) and b (N, HEAD_DIM): S = Q K^T, or in the backward S^T = K Q^T
    and dP^T = V dO^T) over both parts of the head dim with HEAD_DIM2 (a2, b2 the second's): one wgmma group a
    part, the second accumulating into the first's."""
    s = warpgroup_mma(a, b.permute((1, 0)), zero, use_acc=False, is_async=True)
    if HEAD_DIM2 > 0:
        s = warpgroup_mma(a2, b2.permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def issue_pv(p_op, p2_op, v, v2, acc, acc2, HEAD_DIM2: gl.constexpr):
    """Issue acc += P V (register operand p_op, shared-memory v (K, HEAD_DIM): O += P V, or in the backward
    dV += P^T dO and dK += dS^T Q) and with HEAD_DIM2 acc2 += P V2 (P in the second accumulator's operand
    layout p2_op): one wgmma group a part."""
    acc = warpgroup_mma(p_op, v, acc, is_async=True)
    if HEAD_DIM2 > 0:
        acc2 = warpgroup_mma(p2_op, v2, acc2, is_async=True)
    return acc, acc2


@gluon.jit
def ring_index(n, STAGES: gl.constexpr):
    """The buffer of a ring of STAGES buffers that item n takes, n % STAGES. With one buffer, 0 through an opaque
    move: a constant 0 makes every shared-memory view of a loop over the ring invariant, and ptxas hoisted them and
    held them in registers (the Gluon backward's wide kernel at head dim 256 spilled 376 bytes a thread, 11 local
    stores with the move)."""
    if STAGES == 1:
        return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [n * 0], dtype=gl.int32, is_pure=False, pack=1)
    else:
        return n % STAGES


@gluon.jit
def listed_walk(FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, b, h, line, stride_num_b, stride_num_h, stride_num_l,
                stride_idx_b, stride_idx_h, stride_idx_l, TILES_PER_BLOCK: gl.constexpr):
    """A SPARSE walk along row or column ``line`` of the mask of batch b, head h, from its block tables
    (row or column tables: full and partial counts and indices, with their batch, head and line strides):
    (n_full, n_tiles, full_idx, part_idx), the tiles of its full blocks, of all its blocks, and where its
    tables' entries start (``walk_tile_start``)."""
    num_off = b * stride_num_b + h * stride_num_h + line * stride_num_l
    idx_off = b * stride_idx_b + h * stride_idx_h + line * stride_idx_l
    n_full = gl.load(FULL_NUM + num_off) * TILES_PER_BLOCK
    n_tiles = n_full + gl.load(PART_NUM + num_off) * TILES_PER_BLOCK
    return n_full, n_tiles, FULL_IDX + idx_off, PART_IDX + idx_off


@gluon.jit
def walk_before(n_full, n_tiles, full_idx, part_idx, end_block, TILES_PER_BLOCK: gl.constexpr):
    """(n_full, n_tiles) of a ``listed_walk`` without its blocks from ``end_block`` on (a SPARSE row walk cut at the
    first block past a batch's keys): its tables are ascending, so those blocks come last in each."""
    full = entries_below(full_idx, n_full // TILES_PER_BLOCK, end_block)
    part = entries_below(part_idx, (n_tiles - n_full) // TILES_PER_BLOCK, end_block)
    return full * TILES_PER_BLOCK, (full + part) * TILES_PER_BLOCK


@gluon.jit
def entries_below(idx, num, bound):
    """How many of the ascending entries idx[0:num] are below ``bound``, the Gluon twin of ``tiles.blocks_below``:
    32 entries at a time, each warp of the partition loading all of them, so that the count is a warp's (no
    exchange between warps; a table row of 32 blocks or fewer, the common one, takes one round of loads)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    offs = gl.arange(0, 32, layout=layout)
    count = num * 0
    for start in range(0, num, 32):
        entries = gl.load(idx + start + offs, mask=start + offs < num, other=bound)
        count += gl.sum((entries < bound).to(gl.int32), 0)
    return count


@gluon.jit
def walk_tile_start(t, first, n_full, full_idx, part_idx, MASK_KIND: gl.constexpr, TILE: gl.constexpr,
                    SPARSE_BLOCK: gl.constexpr):
    """Start of tile t (of TILE rows) of a walk along one side of the mask: (first + t) * TILE, or (SPARSE,
    MASK_KIND 2) its place among the tiles of the listed full blocks (n_full: their tiles), then of the
    partial ones (full_idx, part_idx: the table entries of the walk's row or column)."""
    if MASK_KIND == 2:
        tiles_per_block: gl.constexpr = SPARSE_BLOCK // TILE
        if t < n_full:
            block = gl.load(full_idx + t // tiles_per_block)
        else:
            block = gl.load(part_idx + (t - n_full) // tiles_per_block)
        return block * SPARSE_BLOCK + (t % tiles_per_block) * TILE
    else:
        return (first + t) * TILE


@gluon.jit
def moved_back(start, length, TILE: gl.constexpr, RAGGED: gl.constexpr):
    """``start`` of a tile of TILE rows, moved back to end at ``length`` where it would run past it (RAGGED: lengths
    the tiles do not divide, at least a tile long). A TMA box past a head's last row in a ``row_view`` reads the rows
    after it: the next head's, or other memory where the layout has gaps (a slice of longer sequences), whose values
    may be NaN, and a masked score's P = 0 times a NaN is NaN; only a box past the tensor's end reads zeros. The rows
    the moved tile shares with the tile before are the caller's to mask."""
    if RAGGED:
        return gl.minimum(start, length - TILE)
    else:
        return start


@gluon.jit
def key_end(KEY_LENGTHS, b, kv_len, HAS_KEY_LENGTHS: gl.constexpr):
    """The end of batch b's keys: min(kv_len, KEY_LENGTHS[b]) with HAS_KEY_LENGTHS, else kv_len."""
    if HAS_KEY_LENGTHS:
        return gl.minimum(kv_len, gl.load(KEY_LENGTHS + b))
    else:
        return kv_len


@gluon.jit
def row_view_coords(b, h, row, stride_b, stride_h, stride_m):
    """(row, column) in a ``row_view`` (rows of pitch stride_m) of element (b, h, row, 0): the Gluon twin of
    forward_persistent.py's ``row_view_coords``, so that the Gluon kernels call only Gluon functions."""
    offset = b.to(gl.int64) * stride_b + h.to(gl.int64) * stride_h
    return (offset // stride_m).to(gl.int32) + row, (offset % stride_m).to(gl.int32)


@functools.lru_cache(maxsize=None)
def shared_layout(rows: int, columns: int, dtype: torch.dtype):
    """The shared-memory layout (swizzle) of a (rows, columns) TMA box of fp16/bf16/fp32."""
    element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for([rows, columns], element)


def layout_rows(per_layout: dict, tensors: tuple) -> list[int | None]:
    """``row_view_rows`` of each tensor (None: TMA cannot read its layout), kept in ``per_layout`` (a launch
    plan's dict for one kernel) by the tensors' strides and 16-byte alignment: host time on every launch."""
    layout = tuple((x.stride(), x.data_ptr() % 16) for x in tensors)
    rows = per_layout.get(layout)
    if rows is None:
        rows = per_layout[layout] = [row_view_rows(x) for x in tensors]
    return rows


def row_view(x: torch.Tensor, rows: int, block_rows: int, columns: int | None = None) -> TensorDescriptor:
    """A TMA descriptor of (block_rows, columns) boxes (columns: D by default, or a part of the head dim) over
    x (B, H, S, D) seen as ``rows`` rows of pitch x.stride(2) (``forward_persistent.row_view_rows``)."""
    pitch, columns = x.stride(2), columns or x.shape[3]
    return TensorDescriptor(x, [rows, pitch], [pitch, 1], [block_rows, columns],
                            shared_layout(block_rows, columns, x.dtype))


def takes(q: torch.Tensor, k: torch.Tensor, mask, tiles: dict[int, tuple[int, int]], dropout: bool,
          ragged: tuple[bool, bool] = (False, False)) -> bool:
    """Whether a Gluon kernel of (query, key) tiles ``tiles[head dim]`` can compute these inputs and mask:
    fp16/bf16, a head dim ``tiles`` lists, lengths that the tiles divide (SPARSE: that the mask blocks divide,
    blocks that the tiles divide: a walk takes every tile of a listed block, so a ragged last block would read
    past the lengths), no dropout. Mask and score functions they take (``tiles.modded_scores``), and key_lengths
    (``key_end``; SPARSE row walks cut by ``walk_before``).
    ``ragged`` (queries, keys): the sides whose last tile the kernel moves back to end at the last row
    (``moved_back``); it then takes DENSE and CAUSAL masks on any lengths with a tile of those sides."""
    if q.dtype not in (torch.float16, torch.bfloat16) or q.shape[3] not in tiles or dropout:
        return False
    lengths = (q.shape[2], k.shape[2])
    if any(ragged) and mask.kind is not MaskKind.SPARSE:
        return all(length >= tile for length, tile, moved in zip(lengths, tiles[q.shape[3]], ragged) if moved)
    return all(length % tile == 0 for length, tile in zip(lengths, tiles[q.shape[3]])) and (
        mask.kind is not MaskKind.SPARSE or all(length % block == 0 and block % tile == 0 for length, block, tile in
                                                zip(lengths, mask.block_size, tiles[q.shape[3]])))


def chosen(q: torch.Tensor, k: torch.Tensor, mask, tiles: dict[int, tuple[int, int]], row_keys: float,
           auto_row_keys: float, dropout: bool, ragged: tuple[bool, bool] = (False, False)) -> bool:
    """Whether calls take a Gluon kernel of (query, key) tiles ``tiles[head dim]``: with ``SPARSEFLASH_GLUON`` "1"
    wherever it ``takes`` them (``ragged``: as there), "auto" there on rows of ``row_keys`` >= ``auto_row_keys``
    keys on average (where it was measured faster), "0" never."""
    value = kernel_switch("SPARSEFLASH_GLUON")
    return value != "0" and takes(q, k, mask, tiles, dropout, ragged) and (
        value == "1" or row_keys >= auto_row_keys)
