"""FlashAttention-2 forward for DENSE, CAUSAL and SPARSE block masks.

Constexpr flags (one kernel body, specialised by the compiler):
  MASK_KIND       0 DENSE: every key tile; only the ragged tail (and key_lengths) is masked.
                  1 CAUSAL: tiles below the diagonal unmasked, diagonal tiles masked, none above.
                  2 SPARSE: walk the row tables; full blocks unmasked, partial blocks masked.
  IS_CAUSAL       apply q_idx >= kv_idx in masked tiles (top-left alignment).
  HAS_KEY_LENGTHS key_lengths[b] bounds the keys of batch b (SPARSE full blocks mask it too).
  BLOCK_M/BLOCK_N kernel tile (queries/keys); each divides SPARSE_BLOCK_M/SPARSE_BLOCK_N.
  HEAD_DIM        head dim padded to a power of two >= 16; D_PADDED: the real one is smaller.
  DOT_PRECISION   tl.dot input precision ("tf32" for fp32 inputs, "ieee" in the interpreter).
  WIDEN_DOTS      interpreter only: widen dot operands to fp32 (its bf16 dot is wrong).
  EVEN_LENGTHS    DENSE and CAUSAL only: both tiles divide q_len and kv_len, so no tile holds a
                  row or key past them and the loads need no bounds. The lengths themselves are
                  not specialised on: a new length compiles at most this one more variant.

The softmax runs in base 2: scores are scaled by scale * log2(e), the running max m and sum l
are kept per row and the output is divided by l once at the end; lse = (m + log2 l) * ln 2.
A row that sees no key keeps m = -inf, l = 0 and stores o = 0, lse = -inf.
"""

from __future__ import annotations

import contextvars
import dataclasses

import torch
import triton
import triton.language as tl

from sparseflash.attention.triton import configs
from sparseflash.attention.triton.launch import Launcher
from sparseflash.masks import BlockMask, MaskKind

LOG2E = 1.4426950408889634
INTERPRETER_PROGRAMS = 3  # the persistent forward's programs under the interpreter: several tiles each
KIND_CODES = {MaskKind.DENSE: 0, MaskKind.CAUSAL: 1, MaskKind.SPARSE: 2}
# Arguments that change with the sequence length and are not specialised on, so that a new length
# reuses the compiled kernel: the lengths and the strides of the block tables (block counts). The
# tensor strides stay specialised: their divisibility decides the width of vector loads.
ROW_LENGTH_ARGS = ["q_len", "kv_len", "stride_num_h", "stride_num_m", "stride_idx_h", "stride_idx_m"]
PERSISTENT_LENGTH_ARGS = [*ROW_LENGTH_ARGS, "q_rows", "k_rows", "v_rows", "o_rows", "n_tiles"]


@triton.jit
def mma(a, b, acc, DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr):
    """``tl.dot(a, b, acc)``; WIDEN_DOTS (interpreter only) widens the operands to fp32 first,
    since the interpreter's bf16 dot is wrong. The operands keep their bf16/fp16 rounding."""
    if WIDEN_DOTS:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def listed_block(idx_ptr, t, t_hi, FROM_TABLE: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_BLOCK_N: tl.constexpr):
    """The mask block that holds tile ``t`` of a walk over the blocks listed at idx_ptr (0 for t >= t_hi,
    and without a table).

    The loops read it for the next tile at the end of each tile and carry it. A read that feeds
    the tile's own addresses makes Triton's pipeliner copy it asynchronously too, and then wait
    for every copy in flight at each tile (``DEPBAR.LE SB0, 0x0``) instead of keeping
    num_stages - 1 tiles of K/V (or Q/dO) in flight; a read at the start of the tile lives across
    its dots and made the dK/dV loop spill (kernel_notes.md, versions 15-16).

    Tile 0's read needs no bound: every table row holds an entry 0 (it is as wide as the other
    side has blocks), so the read of a walk's first block (walks from tables start at 0) is issued
    at once instead of after the load of the row's count."""
    if FROM_TABLE:
        tiles_per_block: tl.constexpr = SPARSE_BLOCK_N // BLOCK_N
        return tl.load(idx_ptr + t // tiles_per_block, mask=(t < t_hi) | (t == 0), other=0)
    else:
        return 0


@triton.jit
def tile_start(t, block, FROM_TABLE: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_BLOCK_N: tl.constexpr):
    """First key index of tile ``t``: ``t * BLOCK_N``, or its offset in the listed mask block ``block``."""
    if FROM_TABLE:
        tiles_per_block: tl.constexpr = SPARSE_BLOCK_N // BLOCK_N
        return block * SPARSE_BLOCK_N + (t % tiles_per_block) * BLOCK_N
    else:
        return t * BLOCK_N


TABLE_CHUNK = tl.constexpr(64)


@triton.jit
def blocks_below(idx_ptr, num, bound_block):
    """How many of the ``num`` ascending block indices at idx_ptr are below ``bound_block``."""
    count = 0
    for start in range(0, num, TABLE_CHUNK):
        offs = start + tl.arange(0, TABLE_CHUNK)
        idx = tl.load(idx_ptr + offs, mask=offs < num, other=bound_block)
        count += tl.sum((idx < bound_block).to(tl.int32), 0)
    return count


@triton.jit
def row_tile_ranges(FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, h, q_start, kv_bound,
                    stride_num_h, stride_num_m, stride_idx_h, stride_idx_m,
                    MASK_KIND: tl.constexpr, HAS_KEY_LENGTHS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, SPARSE_BLOCK_M: tl.constexpr, SPARSE_BLOCK_N: tl.constexpr):
    """Key tiles of the query tile at q_start, as an unmasked run and a masked run.

    Returns (full_idx, full_hi, part_idx, part_lo, part_hi): tiles [0, full_hi) need no element
    mask, tiles [part_lo, part_hi) do. SPARSE counts tiles of the blocks listed in its row
    tables, without the blocks wholly past key_lengths[b] (the tables are ascending, so those
    come last); DENSE and CAUSAL count tiles from key 0 up to kv_bound and read no table."""
    if MASK_KIND == 2:
        tiles_per_block: tl.constexpr = SPARSE_BLOCK_N // BLOCK_N
        mask_row = q_start // SPARSE_BLOCK_M
        num_off = h * stride_num_h + mask_row * stride_num_m
        idx_off = h * stride_idx_h + mask_row * stride_idx_m
        full_num = tl.load(FULL_NUM + num_off)
        part_num = tl.load(PART_NUM + num_off)
        if HAS_KEY_LENGTHS:
            bound_block = tl.cdiv(kv_bound, SPARSE_BLOCK_N)
            full_num = blocks_below(FULL_IDX + idx_off, full_num, bound_block)
            part_num = blocks_below(PART_IDX + idx_off, part_num, bound_block)
        return FULL_IDX + idx_off, full_num * tiles_per_block, PART_IDX + idx_off, 0, part_num * tiles_per_block
    else:
        if MASK_KIND == 1:  # key tiles wholly at or below the tile's first row need no mask
            full_hi = tl.minimum(q_start + 1, kv_bound) // BLOCK_N
            masked_end = tl.minimum(kv_bound, q_start + BLOCK_M)
        else:
            full_hi = kv_bound // BLOCK_N
            masked_end = kv_bound
        return FULL_IDX, full_hi, PART_IDX, full_hi, tl.cdiv(masked_end, BLOCK_N)


@triton.jit
def key_tile_scores(q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, offs_m, offs_kv, offs_d,
                    kv_bound, head_dim, qk_scale, APPLY_CAUSAL: tl.constexpr, APPLY_KV_BOUND: tl.constexpr,
                    D_PADDED: tl.constexpr, V_TRANSPOSED: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    WIDEN_DOTS: tl.constexpr):
    """Load the key tile at offs_kv and score it against q.

    Returns the base-2 scores (BM, BN) with dropped ones at -inf (keys past kv_bound; and, with
    APPLY_CAUSAL, keys after the query), k^T (D, BN), and v as (BN, D), or (D, BN) with V_TRANSPOSED."""
    k_ptrs = k_base + offs_kv[None, :] * stride_kn + offs_d[:, None] * stride_kd
    if V_TRANSPOSED:
        v_ptrs = v_base + offs_kv[None, :] * stride_vn + offs_d[:, None] * stride_vd
    else:
        v_ptrs = v_base + offs_kv[:, None] * stride_vn + offs_d[None, :] * stride_vd
    if APPLY_KV_BOUND or D_PADDED:
        k_in = (offs_kv[None, :] < kv_bound) & (offs_d[:, None] < head_dim)
        k_t = tl.load(k_ptrs, mask=k_in, other=0.0)
        if V_TRANSPOSED:
            v = tl.load(v_ptrs, mask=k_in, other=0.0)
        else:
            v = tl.load(v_ptrs, mask=(offs_kv[:, None] < kv_bound) & (offs_d[None, :] < head_dim), other=0.0)
    else:
        k_t = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    s = mma(q, k_t, None, DOT_PRECISION, WIDEN_DOTS) * qk_scale
    if APPLY_CAUSAL or APPLY_KV_BOUND:
        keep = offs_kv[None, :] < kv_bound
        if APPLY_CAUSAL:
            keep = keep & (offs_m[:, None] >= offs_kv[None, :])
        s = tl.where(keep, s, float("-inf"))
    return s, k_t, v


@triton.jit
def online_softmax_step(acc, l_i, m_i, s, v, MAY_BE_EMPTY: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        WIDEN_DOTS: tl.constexpr):
    """Fold one key tile, base-2 scores s (BM, BN) and values v (BN, D), into the running output
    acc (BM, D), sum l and max m; MAY_BE_EMPTY: a row of s may be all -inf (masked tiles)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MAY_BE_EMPTY:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
    else:
        m_ref = m_new
    p = tl.math.exp2(s - m_ref[:, None])
    alpha = tl.math.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = mma(p.to(v.dtype), v, acc, DOT_PRECISION, WIDEN_DOTS)
    return acc, l_i, m_new


@triton.jit
def finish_rows(acc, l_i, m_i):
    """The rows' output (fp32, BM x D) and natural-log lse; a row that saw no key gets 0 and -inf."""
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # * ln 2
    return acc / l_safe[:, None], lse


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
               t_lo, t_hi, idx_ptr, offs_m, offs_n, offs_d, kv_bound, head_dim, qk_scale,
               FROM_TABLE: tl.constexpr, APPLY_CAUSAL: tl.constexpr, APPLY_KV_BOUND: tl.constexpr,
               BLOCK_N: tl.constexpr, SPARSE_BLOCK_N: tl.constexpr, D_PADDED: tl.constexpr,
               DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr):
    """Online softmax over key tiles t_lo..t_hi-1 of one query tile."""
    block = listed_block(idx_ptr, t_lo, t_hi, FROM_TABLE, BLOCK_N, SPARSE_BLOCK_N)
    for t in range(t_lo, t_hi):
        offs_kv = tile_start(t, block, FROM_TABLE, BLOCK_N, SPARSE_BLOCK_N) + offs_n
        s, _, v = key_tile_scores(q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, offs_m, offs_kv,
                                  offs_d, kv_bound, head_dim, qk_scale, APPLY_CAUSAL, APPLY_KV_BOUND, D_PADDED,
                                  False, DOT_PRECISION, WIDEN_DOTS)
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, v, APPLY_CAUSAL or APPLY_KV_BOUND, DOT_PRECISION,
                                            WIDEN_DOTS)
        block = listed_block(idx_ptr, t + 1, t_hi, FROM_TABLE, BLOCK_N, SPARSE_BLOCK_N)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=ROW_LENGTH_ARGS)
def _attn_fwd(
    Q, K, V, O, LSE, KEY_LENGTHS,
    FULL_NUM, FULL_IDX, PART_NUM, PART_IDX,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_num_h, stride_num_m, stride_idx_h, stride_idx_m,
    heads, groups, q_len, kv_len, head_dim, qk_scale,
    MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_KEY_LENGTHS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPARSE_BLOCK_M: tl.constexpr, SPARSE_BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PADDED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WIDEN_DOTS: tl.constexpr, EVEN_LENGTHS: tl.constexpr,
):
    tl.static_assert(SPARSE_BLOCK_M % BLOCK_M == 0, "BLOCK_M must divide SPARSE_BLOCK_M")
    tl.static_assert(SPARSE_BLOCK_N % BLOCK_N == 0, "BLOCK_N must divide SPARSE_BLOCK_N")
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    q_start = start_m * BLOCK_M
    offs_m = q_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)

    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=(offs_m[:, None] < q_len) & (offs_d[None, :] < head_dim), other=0.0)
    k_base = K + b * stride_kb + (h // groups) * stride_kh
    v_base = V + b * stride_vb + (h // groups) * stride_vh

    kv_bound = kv_len
    if HAS_KEY_LENGTHS:
        kv_bound = tl.minimum(kv_bound, tl.load(KEY_LENGTHS + b).to(tl.int32))
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # SPARSE full blocks may still straddle key_lengths[b]; DENSE/CAUSAL runs stop before it.
    WALK_TABLES: tl.constexpr = MASK_KIND == 2
    FULL_NEEDS_BOUND: tl.constexpr = WALK_TABLES and HAS_KEY_LENGTHS
    PART_NEEDS_BOUND: tl.constexpr = HAS_KEY_LENGTHS or not EVEN_LENGTHS
    full_idx, full_hi, part_idx, part_lo, part_hi = row_tile_ranges(
        FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, h, q_start, kv_bound,
        stride_num_h, stride_num_m, stride_idx_h, stride_idx_m,
        MASK_KIND, HAS_KEY_LENGTHS, BLOCK_M, BLOCK_N, SPARSE_BLOCK_M, SPARSE_BLOCK_N)
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        0, full_hi, full_idx, offs_m, offs_n, offs_d, kv_bound, head_dim, qk_scale,
        WALK_TABLES, False, FULL_NEEDS_BOUND, BLOCK_N, SPARSE_BLOCK_N, D_PADDED, DOT_PRECISION,
        WIDEN_DOTS)
    if part_hi > part_lo:  # rows without partial blocks skip the masked run's set-up and drain
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
            part_lo, part_hi, part_idx, offs_m, offs_n, offs_d, kv_bound, head_dim, qk_scale,
            WALK_TABLES, IS_CAUSAL, PART_NEEDS_BOUND, BLOCK_N, SPARSE_BLOCK_N, D_PADDED, DOT_PRECISION,
            WIDEN_DOTS)

    o, lse = finish_rows(acc, l_i, m_i)
    o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=(offs_m[:, None] < q_len) & (offs_d[None, :] < head_dim))
    tl.store(LSE + bh * q_len + offs_m, lse, mask=offs_m < q_len)


@triton.jit
def row_view(X, rows, stride_m, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A TMA descriptor over X seen as a matrix of ``rows`` rows of pitch stride_m (``row_view_rows``)."""
    return tl.make_tensor_descriptor(X, shape=[rows, stride_m], strides=[stride_m, 1],
                                     block_shape=[BLOCK, HEAD_DIM])


@triton.jit
def row_view_coords(b, h, row, stride_b, stride_h, stride_m):
    """(row, column) in ``row_view`` of element (b, h, row, 0)."""
    offset = b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
    return (offset // stride_m).to(tl.int32) + row, (offset % stride_m).to(tl.int32)


@triton.jit
def _fwd_tiles_tma(acc, l_i, m_i, q, k_desc, v_desc, k_row, k_col, v_row, v_col, t_hi, idx_ptr, q_start,
                   qk_scale, FROM_TABLE: tl.constexpr, APPLY_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, SPARSE_BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   WIDEN_DOTS: tl.constexpr):
    """``_fwd_tiles`` over tiles 0..t_hi-1 for the persistent forward: K and V through the ``row_view``
    descriptors, no bounds."""
    for t in tl.range(0, t_hi):
        block = listed_block(idx_ptr, t, t_hi, FROM_TABLE, BLOCK_N, SPARSE_BLOCK_N)
        kv_start = tile_start(t, block, FROM_TABLE, BLOCK_N, SPARSE_BLOCK_N)
        k = k_desc.load([k_row + kv_start, k_col])
        v = v_desc.load([v_row + kv_start, v_col])
        s = mma(q, tl.trans(k), None, DOT_PRECISION, WIDEN_DOTS) * qk_scale
        if APPLY_CAUSAL:
            offs_m = q_start + tl.arange(0, BLOCK_M)
            offs_kv = kv_start + tl.arange(0, BLOCK_N)
            s = tl.where(offs_m[:, None] >= offs_kv[None, :], s, float("-inf"))
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, v, APPLY_CAUSAL, DOT_PRECISION, WIDEN_DOTS)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=PERSISTENT_LENGTH_ARGS)
def _attn_fwd_persistent(
    Q, K, V, O, LSE, FULL_NUM, FULL_IDX,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
    q_rows, k_rows, v_rows, o_rows,
    stride_num_h, stride_num_m, stride_idx_h, stride_idx_m,
    heads, groups, q_len, kv_len, n_tiles, qk_scale,
    MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_KEY_LENGTHS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPARSE_BLOCK_M: tl.constexpr, SPARSE_BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PADDED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WIDEN_DOTS: tl.constexpr, EVEN_LENGTHS: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
):
    """The forward of DENSE and CAUSAL masks whose tiles divide the lengths and of SPARSE masks without
    partial blocks, as NUM_PROGRAMS programs that each take every NUM_PROGRAMS-th (batch x head,
    query tile), with Q, K, V (and, for DENSE and CAUSAL, O) moved by TMA.
    Triton's warp specialisation (Hopper, num_warps=4) splits the tile loop into a producer warp
    that loads and two consumer warpgroups of BLOCK_M / 2 rows each; the producer loads the next
    tile's Q while the consumers finish the current one."""
    tl.static_assert(not HAS_KEY_LENGTHS and not D_PADDED,
                     "the persistent forward takes no key_lengths and unpadded heads only")
    q_desc = row_view(Q, q_rows, stride_qm, BLOCK_M, HEAD_DIM)
    k_desc = row_view(K, k_rows, stride_kn, BLOCK_N, HEAD_DIM)
    v_desc = row_view(V, v_rows, stride_vn, BLOCK_N, HEAD_DIM)
    o_desc = row_view(O, o_rows, stride_om, BLOCK_M, HEAD_DIM)
    WALK_TABLES: tl.constexpr = MASK_KIND == 2
    CAUSAL: tl.constexpr = MASK_KIND == 1
    m_tiles = q_len // BLOCK_M
    for tile in tl.range(tl.program_id(0), n_tiles, NUM_PROGRAMS, warp_specialize=True):
        bh = tile // m_tiles
        if CAUSAL:  # the longest rows first
            q_start = (m_tiles - 1 - tile % m_tiles) * BLOCK_M
        else:
            q_start = (tile % m_tiles) * BLOCK_M
        b = bh // heads
        h = bh % heads
        full_idx, full_hi, _, _, part_hi = row_tile_ranges(
            FULL_NUM, FULL_IDX, FULL_NUM, FULL_IDX, h, q_start, kv_len,
            stride_num_h, stride_num_m, stride_idx_h, stride_idx_m,
            MASK_KIND, False, BLOCK_M, BLOCK_N, SPARSE_BLOCK_M, SPARSE_BLOCK_N)
        q_row, q_col = row_view_coords(b, h, q_start, stride_qb, stride_qh, stride_qm)
        k_row, k_col = row_view_coords(b, h // groups, 0, stride_kb, stride_kh, stride_kn)
        v_row, v_col = row_view_coords(b, h // groups, 0, stride_vb, stride_vh, stride_vn)
        q = q_desc.load([q_row, q_col])
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        # CAUSAL runs its diagonal tiles in the same loop, masking every tile: a second loop makes
        # the warp-specialisation pass fail (Triton 3.9)
        acc, l_i, m_i = _fwd_tiles_tma(
            acc, l_i, m_i, q, k_desc, v_desc, k_row, k_col, v_row, v_col, part_hi if CAUSAL else full_hi,
            full_idx, q_start, qk_scale, WALK_TABLES, CAUSAL, BLOCK_M, BLOCK_N, SPARSE_BLOCK_N, DOT_PRECISION,
            WIDEN_DOTS)
        o, lse = finish_rows(acc, l_i, m_i)
        if WALK_TABLES:  # rows of few tiles: o straight from registers, not waiting for a TMA store
            o_offs = (q_start + tl.arange(0, BLOCK_M))[:, None] * stride_om + tl.arange(0, HEAD_DIM)[None, :]
            tl.store(O + (b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh) + o_offs, o.to(O.dtype.element_ty))
        else:
            o_row, o_col = row_view_coords(b, h, q_start, stride_ob, stride_oh, stride_om)
            o_desc.store([o_row, o_col], o.to(O.dtype.element_ty))
        # lse's addresses share no value with o's TMA coordinates: Triton 3.6-3.9's warp specialisation
        # offsets such a shared value by the second consumer's first row and then adds that
        # consumer's row range to it again, writing its lse BLOCK_M / 2 rows too far (kernel_notes.md,
        # version 22).
        tl.store(LSE + bh * q_len + (q_start + tl.arange(0, BLOCK_M)), lse)


# ---------------------------------------------------------------------------------- launcher
FORWARD = Launcher(_attn_fwd)
FORWARD_PERSISTENT = Launcher(_attn_fwd_persistent)


class KernelInputs:
    """What the kernel launches of every call with one mask, shapes, dtype, device, scale and
    key_lengths presence share: shapes, mask tables, tuning key and constexprs. ``of`` keeps it on
    the mask (``mask.derived``): building it cost ~25 µs of host time per call on the H100 machine."""

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, mask: BlockMask, has_key_lengths: bool,
           scale: float) -> "KernelInputs":
        per_mask = mask.derived.setdefault("triton", {})
        key = (q.shape, k.shape, q.dtype, q.device, has_key_lengths, scale)
        inputs = per_mask.get(key)
        if inputs is None:
            inputs = per_mask[key] = cls(q, k, mask, has_key_lengths, scale)
        return inputs

    def __init__(self, q: torch.Tensor, k: torch.Tensor, mask: BlockMask, has_key_lengths: bool, scale: float):
        self.batch, self.heads, self.q_len, self.head_dim = q.shape
        self.kv_heads, self.kv_len = k.shape[1], k.shape[2]
        self.groups = self.heads // self.kv_heads
        self.scale, self.qk_scale = scale, scale * LOG2E
        self.padded_dim = max(16, triton.next_power_of_2(self.head_dim))
        self.has_key_lengths = has_key_lengths
        self.kind, self.causal, self.sparse_block = mask.kind, mask.causal, mask.block_size
        self.persistent_fits = self._persistent_fits(q, mask)
        self.programs = (torch.cuda.get_device_properties(q.device).multi_processor_count
                         if q.device.type == "cuda" else INTERPRETER_PROGRAMS)
        self.config_key = configs.ConfigKey.of(q, mask, self.padded_dim, self.persistent_fits)
        self._placeholder = torch.empty(1, dtype=torch.int32, device=q.device)  # for absent tensors
        tables = mask.tables(q.device) if mask.kind is MaskKind.SPARSE else None
        self._tables = {side: self._tables_of(tables, side) for side in ("kv", "q")}
        self._constexprs: dict[tuple, dict] = {}
        self._persistent_scalars: dict[tuple, tuple | None] = {}

    def _persistent_fits(self, q: torch.Tensor, mask: BlockMask) -> bool:
        """Whether the persistent forward can take this problem on this device: DENSE or CAUSAL with
        lengths that 128-row tiles divide, or SPARSE without partial blocks (IS_CAUSAL then changes
        nothing: its full blocks need no element mask); no key_lengths, an unpadded head dim and
        fp16/bf16 (the launch also checks the layouts: ``row_view_rows``). Not bf16 under the
        interpreter, whose TMA loads corrupt bf16 (Triton 3.9)."""
        if self.kind is MaskKind.SPARSE:
            even_tiles = not bool(mask.partial_layout.any())
        else:
            even_tiles = self.q_len % 128 == 0 and self.kv_len % 128 == 0
        return (even_tiles and not self.has_key_lengths and self.padded_dim == self.head_dim
                and (q.dtype is torch.float16 or (q.dtype is torch.bfloat16 and not configs.interpreting()))
                and configs.persistent_supported(q.device))

    def persistent_scalars(self, q, k, v, o) -> tuple | None:
        """The persistent forward's scalars up to n_tiles: the (batch, head, row) strides and
        ``row_view_rows`` of q, k, v, o, the table strides, heads, groups and lengths; None where
        TMA cannot read a layout. Kept per layout (strides and 16-byte alignment)."""
        layout = (q.stride(), k.stride(), v.stride(), q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16)
        if layout not in self._persistent_scalars:
            rows = [row_view_rows(x) for x in (q, k, v, o)]
            self._persistent_scalars[layout] = None if None in rows else (
                *[s for x in (q, k, v, o) for s in x.stride()[:3]], *rows, *self._tables["kv"][1],
                self.heads, self.groups, self.q_len, self.kv_len)
        return self._persistent_scalars[layout]

    def key_lengths_arg(self, key_lengths: torch.Tensor | None) -> torch.Tensor:
        """``key_lengths`` as the kernels read it (int32), or a placeholder (HAS_KEY_LENGTHS is off)."""
        return self._placeholder if key_lengths is None else key_lengths.to(torch.int32).contiguous()

    def tables_of(self, side: str) -> tuple[tuple, tuple]:
        """``side`` "kv" (row tables) or "q" (column tables): the tensors full num/idx and partial
        num/idx, and the (head, row) strides of num and idx; the head stride is 0 for a shared layout."""
        return self._tables[side]

    def _tables_of(self, tables, side: str) -> tuple[tuple, tuple]:
        if tables is None:  # DENSE and CAUSAL kernels read no table
            return (self._placeholder,) * 4, (0, 0, 0, 0)
        full_num, full_idx = getattr(tables, f"full_{side}_num_blocks"), getattr(tables, f"full_{side}_indices")
        part_num, part_idx = getattr(tables, f"partial_{side}_num_blocks"), getattr(tables, f"partial_{side}_indices")
        shared = full_num.shape[0] == 1
        return ((full_num, full_idx, part_num, part_idx),
                (0 if shared else full_num.stride(0), full_num.stride(1),
                 0 if shared else full_idx.stride(0), full_idx.stride(1)))

    def constexprs(self, cfg: configs.KernelConfig, **extra) -> dict:
        """The constexprs and launch options of a launch with ``cfg``: its tiles, warps and stages,
        the flags that forward and backward kernels share, and ``extra`` flags."""
        key = (cfg, *extra.items())
        if key not in self._constexprs:
            self._constexprs[key] = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
                                         num_stages=cfg.num_stages, **self._flags_of(cfg), **extra)
        return self._constexprs[key]

    def _flags_of(self, cfg: configs.KernelConfig) -> dict:
        even = self.kind is not MaskKind.SPARSE and all(
            length % tile == 0 for length in (self.q_len, self.kv_len) for tile in (cfg.block_m, cfg.block_n))
        return dict(
            MASK_KIND=KIND_CODES[self.kind], IS_CAUSAL=self.causal, HAS_KEY_LENGTHS=self.has_key_lengths,
            SPARSE_BLOCK_M=self.sparse_block[0], SPARSE_BLOCK_N=self.sparse_block[1],
            HEAD_DIM=self.padded_dim, D_PADDED=self.padded_dim != self.head_dim,
            DOT_PRECISION=self.config_key.dot_precision, WIDEN_DOTS=configs.interpreting(), EVEN_LENGTHS=even,
        )


def row_view_rows(x: torch.Tensor) -> int | None:
    """Rows of the matrix that ``row_view`` sees x (B, H, S, D) as: rows of pitch x.stride(2),
    where element (b, h, s, 0) is at column (b * stride_b + h * stride_h) % pitch. None where TMA
    cannot read x that way: a head's D elements crossing a pitch, or an address or pitch that is
    not 16-byte aligned."""
    batch, heads, seq, dim = x.shape
    stride_b, stride_h, pitch, stride_d = x.stride()
    in_pitch = (batch == 1 or stride_b % pitch == 0) and (
        heads == 1 or stride_h % pitch == 0 or (stride_h > 0 and (heads - 1) * stride_h + dim <= pitch))
    if stride_d != 1 or not in_pitch or x.data_ptr() % 16 or pitch * x.element_size() % 16:
        return None
    return ((batch - 1) * stride_b + (heads - 1) * stride_h) // pitch + seq


_SCRATCH: dict[tuple, torch.Tensor] = {}


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Triton's allocator for the global scratch where the persistent forward builds its TMA
    descriptors: one buffer per device and stream, kept and grown (launches on one stream run in
    turn, so they can share it; a fresh allocation cost ~5 µs of host time per launch)."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    buffer = _SCRATCH.get((device, stream))
    if buffer is None or buffer.numel() < size:
        buffer = _SCRATCH[device, stream] = torch.empty(size, dtype=torch.int8, device=device)
    return buffer


def _launch_with_scratch(launch) -> None:
    """``launch()`` with Triton's allocator set to ``_scratch`` in a copy of the caller's context,
    so that an allocator the caller set is neither used nor replaced."""
    def run():
        triton.set_allocator(_scratch)
        launch()
    contextvars.copy_context().run(run)


def attention_forward(q, k, v, key_lengths: torch.Tensor, inputs: KernelInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``o (B, H, S_q, D)`` in ``q.dtype`` and ``lse (B, H, S_q)`` fp32; ``key_lengths`` as
    ``inputs.key_lengths_arg`` gives it."""
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    tables, table_strides = inputs.tables_of("kv")
    tensors = (q, k, v, o, lse, key_lengths, *tables)
    scalars = (*q.stride(), *k.stride(), *v.stride(), *o.stride(), *table_strides, inputs.heads, inputs.groups,
               inputs.q_len, inputs.kv_len, inputs.head_dim, inputs.qk_scale)
    persistent_scalars = inputs.persistent_scalars(q, k, v, o) if inputs.persistent_fits else None

    def launch(cfg: configs.KernelConfig) -> None:
        if cfg.persistent and persistent_scalars is not None:
            n_tiles = inputs.batch * inputs.heads * (inputs.q_len // cfg.block_m)
            _launch_with_scratch(lambda: FORWARD_PERSISTENT(
                (min(n_tiles, inputs.programs),), (q, k, v, o, lse, *tables[:2]),
                (*persistent_scalars, n_tiles, inputs.qk_scale), inputs.constexprs(cfg, NUM_PROGRAMS=inputs.programs)))
            return
        if cfg.persistent:  # a layout TMA cannot read: the same tiles in the other kernel
            cfg = configs.launched["forward"] = dataclasses.replace(cfg, persistent=False)
        FORWARD((triton.cdiv(inputs.q_len, cfg.block_m), inputs.batch * inputs.heads), tensors, scalars,
                inputs.constexprs(cfg))

    configs.run_tuned("forward", inputs.config_key, launch)
    return o, lse
