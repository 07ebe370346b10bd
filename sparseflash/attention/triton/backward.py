"""FlashAttention-2 backward: a preprocess kernel, then one kernel for dK/dV and dQ (no atomics). On Hopper,
the Gluon backward (backward_gluon.py, ``plan.gluon_backward``) may take the call after the preprocess.

Constexpr flags: those of forward.py (MASK_KIND, IS_CAUSAL, HAS_KEY_LENGTHS, SPARSE_BLOCK_M,
SPARSE_BLOCK_N, HEAD_DIM, HEAD_DIM2, D_PADDED, DOT_PRECISION, WIDEN_DOTS, EVEN_LENGTHS), and
  BLOCK_M   the tile a program holds: BLOCK_M queries of a dQ program, BLOCK_M keys of a dK/dV one;
  BLOCK_N   the tile it streams: keys for dQ, queries for dK/dV (in one launch, each tile divides
            both sides of the mask blocks);
  HAS_DLSE  the loss also depends on lse: d lse / d s = p, so delta becomes rowsum(o * do) - dlse.
  PROGRAMS  0: both kinds of program in one launch; 1: only dK/dV; 2: only dQ.
  QUERY_ROWS  the dK/dV programs' score tiles have the queries along the rows (below).
  MASK_MOD, SCORE_MOD, SCORE_KEYS, SCORE_ROW  as in forward.py; the backward scales dS by SCORE_MOD's
            derivative, and takes SCORE_ROW's term of each query tile off the lse it subtracts.
  DROPOUT   as in forward.py: the same scores are dropped again (``tiles.dropout_kept_tile``); dV takes
            the kept probabilities, scaled, and dS = p * (kept * dP * dropout_scale - delta).
  SCORE_MOD_GRADS  a generated function (codegen.py) that adds the gradients of the score function's
            captured tensors (atomics, in the dK/dV programs, which see every computed score once),
            or None.

The scores are recomputed from q, k and lse (p = exp2(s * scale * log2 e - lse * log2 e)), never
stored; nor is the dropout mask. With dropout, delta = rowsum(o * do) still equals rowsum(p * dP') where
dP' is the gradient of the undropped probabilities, since o already holds the kept ones.
- preprocess, one program per query tile: delta = rowsum(o * do) (- dlse), and lse2 = lse * log2 e,
  the base-2 lse the loops subtract; rows that saw no key (lse = -inf) get lse2 = +inf, so that
  their p is 0. Both are (B * H, stats_stride) with stats_stride = q_len rounded up to 16.
- _attn_bwd: two kinds of program in each row of the grid (one row per batch and key/value head),
  so the dQ programs of a head run next to its dK/dV programs and share K, V, Q and dO in L2; under
  head_dim 128 and at 256 columns they go in two launches instead (FUSED_FROM_HEAD_DIM,
  SPLIT_FROM_COLUMNS):
  - dK/dV: one program per key tile; it walks the column tables (or the DENSE / CAUSAL ranges) of
    every query head of its GQA group, so nothing is accumulated across programs. Keys past
    key_lengths[b] get zero gradients at the store. Its score tiles have the keys along the rows, or
    the queries where it streams more queries than it holds keys (QUERY_ROWS): Triton spreads the
    warps of a product whose result feeds another product over its rows only, and a tile of 64 rows
    on 8 warps is then computed twice, once per warpgroup (64 keys at head_dim 256, where 128 keys'
    dK and dV do not fit in registers).
  - dQ: one program per query tile of each query head of the group, walking the same row ranges
    as the forward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparseflash.attention.triton.launch import (STAND_IN_FROM_CPUS, Launcher, Standin, cdiv, run_stand_in, standing_in,
                                                 usable_cpus)
from sparseflash.attention.triton.plan import LaunchPlan, gluon_kernels
from sparseflash.attention.triton.tiles import (DROPOUT_ARGS, dropout_kept_tile, key_steps, key_tile_scores,
                                               listed_block, load_head_parts, load_part, load_seed, mma, mod_positions,
                                               modded_scores, row_term, row_tile_ranges, second_part_columns,
                                               store_head_parts, store_part, tile_start, tiles_before_bound)
from sparseflash.attention.triton.tuning import KernelConfig, fit, planned, run_tuned


@triton.jit(do_not_specialize=["q_len"])
def _bwd_preprocess(O, DO, LSE, DLSE, DELTA, LSE2, DQ_ACC, stride_ob, stride_oh, stride_om, stride_od,
                    stride_dob, stride_doh, stride_dom, stride_dod, heads, q_len, stats_stride, head_dim,
                    HAS_DLSE: tl.constexpr, ZERO_DQ: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    in_bounds = (offs_m[:, None] < q_len) & (offs_d[None, :] < head_dim)
    o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
                mask=in_bounds, other=0.0).to(tl.float32)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                 mask=in_bounds, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + bh * q_len + offs_m, mask=offs_m < q_len, other=0.0)
    tl.store(DELTA + bh * stats_stride + offs_m, delta, mask=offs_m < q_len)
    lse = tl.load(LSE + bh * q_len + offs_m, mask=offs_m < q_len, other=0.0)
    tl.store(LSE2 + bh * stats_stride + offs_m, tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634,
             mask=offs_m < q_len)
    if ZERO_DQ:  # the Gluon backward's fp32 dQ accumulator (B * H * q_len, head_dim), which it adds into
        rows = (bh * q_len + offs_m).to(tl.int64)
        tl.store(DQ_ACC + rows[:, None] * head_dim + offs_d[None, :], tl.zeros([BLOCK_M, HEAD_DIM], tl.float32),
                 mask=in_bounds)


@triton.jit
def _load_row_stats(LSE2, DELTA, row_off, offs_m, q_len, APPLY_ROW_BOUND: tl.constexpr):
    """lse2 (+inf for rows that saw no key and, with APPLY_ROW_BOUND, rows past q_len) and delta."""
    if APPLY_ROW_BOUND:
        lse2 = tl.load(LSE2 + row_off + offs_m, mask=offs_m < q_len, other=float("inf"))
        delta = tl.load(DELTA + row_off + offs_m, mask=offs_m < q_len, other=0.0)
    else:
        lse2 = tl.load(LSE2 + row_off + offs_m)
        delta = tl.load(DELTA + row_off + offs_m)
    return lse2, delta


@triton.jit
def _col_tile_ranges(FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, b, h, start_n, n_q_tiles,
                     stride_num_b, stride_num_h, stride_num_n, stride_idx_b, stride_idx_h, stride_idx_n,
                     MASK_KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     SPARSE_BLOCK_M: tl.constexpr, SPARSE_BLOCK_N: tl.constexpr):
    """Query tiles that see the key tile at start_n, as an unmasked and a masked run.

    Returns (full_idx, full_lo, full_hi, part_idx, part_lo, part_hi). SPARSE counts tiles of the
    blocks in its column tables; CAUSAL masks the query tiles that straddle the diagonal and
    leaves those wholly below it unmasked; DENSE reads every query tile unmasked."""
    if MASK_KIND == 2:
        tiles_per_block: tl.constexpr = SPARSE_BLOCK_M // BLOCK_M
        mask_col = start_n // SPARSE_BLOCK_N
        num_off = b * stride_num_b + h * stride_num_h + mask_col * stride_num_n
        idx_off = b * stride_idx_b + h * stride_idx_h + mask_col * stride_idx_n
        full_hi = tl.load(FULL_NUM + num_off) * tiles_per_block
        part_hi = tl.load(PART_NUM + num_off) * tiles_per_block
        return FULL_IDX + idx_off, 0, full_hi, PART_IDX + idx_off, 0, part_hi
    elif MASK_KIND == 1:
        diagonal_end = tl.minimum(tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M), n_q_tiles)
        return FULL_IDX, diagonal_end, n_q_tiles, PART_IDX, start_n // BLOCK_M, diagonal_end
    else:
        return FULL_IDX, 0, n_q_tiles, PART_IDX, 0, 0


@triton.jit
def _along_queries(x, QUERY_ROWS: tl.constexpr):
    """A vector over a dK/dV score tile's queries, shaped to broadcast against the tile."""
    if QUERY_ROWS:
        return x[:, None]
    else:
        return x[None, :]


@triton.jit
def _along_keys(x, QUERY_ROWS: tl.constexpr):
    """A vector over a dK/dV score tile's keys, shaped to broadcast against the tile."""
    if QUERY_ROWS:
        return x[None, :]
    else:
        return x[:, None]


@triton.jit
def _key_query_products(keys, queries, acc, QUERY_ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        WIDEN_DOTS: tl.constexpr):
    """``acc + keys @ queries^T`` (keys along the rows), or its transpose with QUERY_ROWS."""
    if QUERY_ROWS:
        return mma(queries, tl.trans(keys), acc, DOT_PRECISION, WIDEN_DOTS)
    else:
        return mma(keys, tl.trans(queries), acc, DOT_PRECISION, WIDEN_DOTS)


@triton.jit
def _keys_first(x, QUERY_ROWS: tl.constexpr):
    """A score tile with its keys along the rows, the left operand of dK's and dV's products."""
    if QUERY_ROWS:
        return tl.trans(x)
    else:
        return x


@triton.jit
def _dkdv_tiles(dk, dk2, dv, dv2, k, k2, v, v2, q_base, do_base, LSE2, DELTA, row_off,
                stride_qm, stride_qd, stride_dom, stride_dod, t_lo, t_hi, idx_ptr,
                start_n, offs_n, offs_d, offs_d2, q_len, kv_len, kv_bound, head_dim, qk_scale, b, h, MODS,
                seed, drop_row, drop_threshold, drop_scale,
                FROM_TABLE: tl.constexpr, APPLY_CAUSAL: tl.constexpr, APPLY_ROW_BOUND: tl.constexpr,
                APPLY_MASK_MOD: tl.constexpr, MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr,
                SCORE_KEYS: tl.constexpr, SCORE_ROW: tl.constexpr, SCORE_MOD_GRADS: tl.constexpr, DROPOUT: tl.constexpr,
                BLOCK_M: tl.constexpr, SPARSE_BLOCK_M: tl.constexpr, HEAD_DIM2: tl.constexpr, D_PADDED: tl.constexpr,
                DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr, QUERY_ROWS: tl.constexpr):
    """Accumulate dK, dV of one key tile over query tiles t_lo..t_hi-1 (score tiles with the keys along
    the rows, or the queries with QUERY_ROWS); with
    HEAD_DIM2 also the second part's dK2, dV2 of k2, v2 (columns offs_d2; all unused otherwise).
    APPLY_ROW_BOUND: the tiles may hold rows past q_len (loaded as zeros, lse +inf). Keys past
    kv_bound are not masked here (their gradients are zeroed at the store), except for the gradients
    of the score function's captured tensors. With DROPOUT, dV is left unscaled (the caller scales it).
    """
    offs_m0 = tl.arange(0, BLOCK_M)
    keys = key_steps(b, h, _along_keys(offs_n - start_n, QUERY_ROWS), MODS, SCORE_KEYS)
    block = listed_block(idx_ptr, t_lo, t_hi, FROM_TABLE, BLOCK_M, SPARSE_BLOCK_M)
    for t in range(t_lo, t_hi):
        q_start = tile_start(t, block, FROM_TABLE, BLOCK_M, SPARSE_BLOCK_M)
        offs_m = q_start + offs_m0
        q_ptrs = q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
        do_ptrs = do_base + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod
        if APPLY_ROW_BOUND or (D_PADDED and HEAD_DIM2 == 0):
            rows_in = (offs_m[:, None] < q_len) & (offs_d[None, :] < head_dim)
            q = tl.load(q_ptrs, mask=rows_in, other=0.0)
            do = tl.load(do_ptrs, mask=rows_in, other=0.0)
        else:
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
        lse, delta = _load_row_stats(LSE2, DELTA, row_off, offs_m, q_len, APPLY_ROW_BOUND)
        if SCORE_ROW is not None:  # the scores are taken at reference query q_start (codegen.py)
            lse -= row_term(b, h, tl.minimum(offs_m, q_len - 1), q_start, kv_len, MODS, SCORE_ROW)
        qk_t = _key_query_products(k, q, None, QUERY_ROWS, DOT_PRECISION, WIDEN_DOTS)  # (BN, BM) or (BM, BN)
        if HEAD_DIM2 > 0:
            rows_in = offs_m[:, None] < q_len
            q2 = load_part(q_base + offs_m[:, None] * stride_qm, stride_qd, rows_in, offs_d2, head_dim,
                           APPLY_ROW_BOUND or D_PADDED)
            do2 = load_part(do_base + offs_m[:, None] * stride_dom, stride_dod, rows_in, offs_d2, head_dim,
                            APPLY_ROW_BOUND or D_PADDED)
            qk_t = _key_query_products(k2, q2, qk_t, QUERY_ROWS, DOT_PRECISION, WIDEN_DOTS)
        rows, cols = _along_queries(offs_m, QUERY_ROWS), _along_keys(offs_n, QUERY_ROWS)
        q_idx, kv_idx = mod_positions(rows, cols, q_len, kv_len)
        s_t, d_score = modded_scores(qk_t, b, h, q_idx, kv_idx, q_start, start_n, keys, qk_scale, MODS, SCORE_MOD,
                                     SCORE_KEYS)
        if APPLY_CAUSAL or APPLY_MASK_MOD:
            if APPLY_CAUSAL:
                keep = rows >= cols
                if APPLY_MASK_MOD:
                    keep = keep & MASK_MOD(b, h, q_idx, kv_idx, MODS)
            else:
                keep = MASK_MOD(b, h, q_idx, kv_idx, MODS)
            s_t = tl.where(keep, s_t, float("-inf"))
        p_t = tl.math.exp2(s_t - _along_queries(lse, QUERY_ROWS))
        if DROPOUT:
            if QUERY_ROWS:
                kept_t = dropout_kept_tile(seed, drop_row, q_start, start_n, drop_threshold, BLOCK_M,
                                           offs_n.shape[0], True)
            else:
                kept_t = dropout_kept_tile(seed, drop_row, start_n, q_start, drop_threshold, offs_n.shape[0],
                                           BLOCK_M, False)
            p_kept = _keys_first(tl.where(kept_t, p_t, 0.0).to(do.dtype), QUERY_ROWS)
        else:
            p_kept = _keys_first(p_t.to(do.dtype), QUERY_ROWS)
        dv = mma(p_kept, do, dv, DOT_PRECISION, WIDEN_DOTS)
        dp_t = _key_query_products(v, do, None, QUERY_ROWS, DOT_PRECISION, WIDEN_DOTS)
        if HEAD_DIM2 > 0:
            dv2 = mma(p_kept, do2, dv2, DOT_PRECISION, WIDEN_DOTS)
            dp_t = _key_query_products(v2, do2, dp_t, QUERY_ROWS, DOT_PRECISION, WIDEN_DOTS)
        if DROPOUT:
            dp_t = tl.where(kept_t, dp_t * drop_scale, 0.0)
        ds_t = p_t * (dp_t - _along_queries(delta, QUERY_ROWS))
        if SCORE_MOD_GRADS is not None:  # keys past kv_bound must add nothing to the captured tensors
            SCORE_MOD_GRADS(tl.where(cols < kv_bound, ds_t, 0.0), qk_t * (qk_scale * 0.6931471805599453),
                            b, h, q_idx, kv_idx, MODS)
        ds_t = _keys_first((ds_t * d_score).to(q.dtype), QUERY_ROWS)
        dk = mma(ds_t, q, dk, DOT_PRECISION, WIDEN_DOTS)
        if HEAD_DIM2 > 0:
            dk2 = mma(ds_t, q2, dk2, DOT_PRECISION, WIDEN_DOTS)
        block = listed_block(idx_ptr, t + 1, t_hi, FROM_TABLE, BLOCK_M, SPARSE_BLOCK_M)
    return dk, dk2, dv, dv2


@triton.jit
def _dkdv_program(
    Q, K, V, DO, LSE2, DELTA, DK, DV, KEY_LENGTHS, FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, MODS,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_num_b, stride_num_h, stride_num_n, stride_idx_b, stride_idx_h, stride_idx_n,
    key_tile, b, hk, heads, groups, q_len, kv_len, head_dim, qk_scale, scale, stats_stride,
    seed, dropout_threshold, dropout_scale,
    MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_KEY_LENGTHS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPARSE_BLOCK_M: tl.constexpr, SPARSE_BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM2: tl.constexpr, D_PADDED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WIDEN_DOTS: tl.constexpr, EVEN_LENGTHS: tl.constexpr, MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr,
    SCORE_KEYS: tl.constexpr, SCORE_ROW: tl.constexpr, SCORE_MOD_GRADS: tl.constexpr, DROPOUT: tl.constexpr,
    QUERY_ROWS: tl.constexpr,
):
    """dK, dV of key tile ``key_tile`` (BLOCK_N keys) of key/value head hk, batch b."""
    tl.static_assert(SPARSE_BLOCK_M % BLOCK_M == 0, "BLOCK_M must divide SPARSE_BLOCK_M")
    tl.static_assert(SPARSE_BLOCK_N % BLOCK_N == 0, "BLOCK_N must divide SPARSE_BLOCK_N")
    start_n = key_tile * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    # the first part with one mask for K, V, dK and dV, not the part helpers: a mask of each load's own
    # changes this program's register allocation at power-of-two head dims
    kv_in = (offs_n[:, None] < kv_len) & (offs_d[None, :] < head_dim)
    k = tl.load(K + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=kv_in, other=0.0)
    v = tl.load(V + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=kv_in, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    offs_d2 = second_part_columns(HEAD_DIM, HEAD_DIM2)
    k2, v2, dk2, dv2 = (), (), (), ()
    keys_in = offs_n[:, None] < kv_len
    if HEAD_DIM2 > 0:
        k2 = load_part(K + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_kn, stride_kd, keys_in, offs_d2,
                       head_dim, True)
        v2 = load_part(V + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vn, stride_vd, keys_in, offs_d2,
                       head_dim, True)
        dk2 = tl.zeros([BLOCK_N, HEAD_DIM2], dtype=tl.float32)
        dv2 = tl.zeros([BLOCK_N, HEAD_DIM2], dtype=tl.float32)
    WALK_TABLES: tl.constexpr = MASK_KIND == 2
    # Rows past q_len: only in a ragged last query tile (SPARSE: in its partial blocks alone).
    FULL_ROWS_BOUNDED: tl.constexpr = not WALK_TABLES and not EVEN_LENGTHS
    kv_bound = kv_len
    if HAS_KEY_LENGTHS:
        kv_bound = tl.minimum(kv_bound, tl.load(KEY_LENGTHS + b).to(tl.int32))
    n_q_tiles = tl.cdiv(q_len, BLOCK_M)
    for g in range(groups):
        h = hk * groups + g
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        row_off = (b * heads + h) * stats_stride
        full_idx, full_lo, full_hi, part_idx, part_lo, part_hi = _col_tile_ranges(
            FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, b, h, start_n, n_q_tiles,
            stride_num_b, stride_num_h, stride_num_n, stride_idx_b, stride_idx_h, stride_idx_n,
            MASK_KIND, BLOCK_M, BLOCK_N, SPARSE_BLOCK_M, SPARSE_BLOCK_N)
        if HAS_KEY_LENGTHS:  # a key tile wholly past key_lengths[b] walks nothing
            full_hi = tl.where(start_n < kv_bound, full_hi, full_lo)
            part_hi = tl.where(start_n < kv_bound, part_hi, part_lo)
        drop_row = b * heads + h
        dk, dk2, dv, dv2 = _dkdv_tiles(
            dk, dk2, dv, dv2, k, k2, v, v2, q_base, do_base, LSE2, DELTA, row_off,
            stride_qm, stride_qd, stride_dom, stride_dod, full_lo, full_hi, full_idx,
            start_n, offs_n, offs_d, offs_d2, q_len, kv_len, kv_bound, head_dim, qk_scale, b, h, MODS,
            seed, drop_row, dropout_threshold, dropout_scale,
            WALK_TABLES, False, FULL_ROWS_BOUNDED, False, MASK_MOD, SCORE_MOD, SCORE_KEYS,
            SCORE_ROW, SCORE_MOD_GRADS, DROPOUT, BLOCK_M, SPARSE_BLOCK_M, HEAD_DIM2, D_PADDED, DOT_PRECISION,
            WIDEN_DOTS, QUERY_ROWS)
        if part_hi > part_lo:
            dk, dk2, dv, dv2 = _dkdv_tiles(
                dk, dk2, dv, dv2, k, k2, v, v2, q_base, do_base, LSE2, DELTA, row_off,
                stride_qm, stride_qd, stride_dom, stride_dod, part_lo, part_hi, part_idx,
                start_n, offs_n, offs_d, offs_d2, q_len, kv_len, kv_bound, head_dim, qk_scale, b, h, MODS,
                seed, drop_row, dropout_threshold, dropout_scale,
                WALK_TABLES, IS_CAUSAL, not EVEN_LENGTHS, MASK_MOD is not None, MASK_MOD,
                SCORE_MOD, SCORE_KEYS, SCORE_ROW, SCORE_MOD_GRADS, DROPOUT, BLOCK_M, SPARSE_BLOCK_M, HEAD_DIM2,
                D_PADDED, DOT_PRECISION, WIDEN_DOTS, QUERY_ROWS)
    visible = offs_n[:, None] < kv_bound  # masked keys get exactly zero gradient
    dk = tl.where(visible, dk * scale, 0.0)
    if DROPOUT:
        dv = dv * dropout_scale
    dv = tl.where(visible, dv, 0.0)
    if HEAD_DIM2 > 0:
        dk2 = tl.where(visible, dk2 * scale, 0.0)
        if DROPOUT:
            dv2 = dv2 * dropout_scale
        dv2 = tl.where(visible, dv2, 0.0)
    out = b * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd
    tl.store(DK + out, dk.to(DK.dtype.element_ty), mask=kv_in)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_in)
    if HEAD_DIM2 > 0:
        out_rows = b * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dkn
        store_part(DK + out_rows, stride_dkd, keys_in, dk2, offs_d2, head_dim)
        store_part(DV + out_rows, stride_dkd, keys_in, dv2, offs_d2, head_dim)


@triton.jit
def _dq_tiles(dq, dq2, q, q2, do, do2, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
              t_lo, t_hi, idx_ptr, q_start, offs_m, offs_n, offs_d, offs_d2, kv_bound, head_dim, qk_scale, b, h, q_len,
              kv_len, MODS, seed, drop_row, drop_threshold, drop_scale,
              FROM_TABLE: tl.constexpr, APPLY_CAUSAL: tl.constexpr, APPLY_KV_BOUND: tl.constexpr,
              APPLY_MASK_MOD: tl.constexpr, MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr,
              SCORE_KEYS: tl.constexpr, DROPOUT: tl.constexpr,
              BLOCK_N: tl.constexpr, SPARSE_BLOCK_N: tl.constexpr, HEAD_DIM2: tl.constexpr, D_PADDED: tl.constexpr,
              DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr):
    """Accumulate dQ of one query tile over key tiles t_lo..t_hi-1; with HEAD_DIM2 also the second
    part's dQ2 of q2, do2 (columns offs_d2; all unused otherwise)."""
    keys = key_steps(b, h, offs_n[None, :], MODS, SCORE_KEYS)
    block = listed_block(idx_ptr, t_lo, t_hi, FROM_TABLE, BLOCK_N, SPARSE_BLOCK_N)
    for t in range(t_lo, t_hi):
        kv_start = tile_start(t, block, FROM_TABLE, BLOCK_N, SPARSE_BLOCK_N)
        offs_kv = kv_start + offs_n
        s, k_t, v_t, k2_t, v2_t, d_score = key_tile_scores(
            q, q2, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, offs_m, offs_kv, offs_d, offs_d2,
            kv_bound, head_dim, qk_scale, b, h, q_len, kv_len, q_start, kv_start, keys, MODS, APPLY_CAUSAL,
            APPLY_KV_BOUND, APPLY_MASK_MOD, MASK_MOD, SCORE_MOD, SCORE_KEYS, HEAD_DIM2, D_PADDED, True, DOT_PRECISION,
            WIDEN_DOTS)
        p = tl.math.exp2(s - lse[:, None])
        dp = mma(do, v_t, None, DOT_PRECISION, WIDEN_DOTS)
        if HEAD_DIM2 > 0:
            dp = mma(do2, v2_t, dp, DOT_PRECISION, WIDEN_DOTS)
        if DROPOUT:
            kept = dropout_kept_tile(seed, drop_row, q_start, kv_start, drop_threshold, offs_m.shape[0], BLOCK_N, True)
            dp = tl.where(kept, dp * drop_scale, 0.0)
        ds = (p * (dp - delta[:, None]) * d_score).to(k_t.dtype)
        dq = mma(ds, tl.trans(k_t), dq, DOT_PRECISION, WIDEN_DOTS)
        if HEAD_DIM2 > 0:
            dq2 = mma(ds, tl.trans(k2_t), dq2, DOT_PRECISION, WIDEN_DOTS)
        block = listed_block(idx_ptr, t + 1, t_hi, FROM_TABLE, BLOCK_N, SPARSE_BLOCK_N)
    return dq, dq2


@triton.jit
def _dq_program(
    Q, K, V, DO, LSE2, DELTA, DQ, KEY_LENGTHS, FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, MODS,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_num_b, stride_num_h, stride_num_m, stride_idx_b, stride_idx_h, stride_idx_m,
    query_tile, b, h, heads, groups, q_len, kv_len, head_dim, qk_scale, scale, stats_stride,
    seed, dropout_threshold, dropout_scale,
    MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_KEY_LENGTHS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPARSE_BLOCK_M: tl.constexpr, SPARSE_BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM2: tl.constexpr, D_PADDED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WIDEN_DOTS: tl.constexpr, EVEN_LENGTHS: tl.constexpr, MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr,
    SCORE_KEYS: tl.constexpr, SCORE_ROW: tl.constexpr, DROPOUT: tl.constexpr,
):
    """dQ of query tile ``query_tile`` (BLOCK_M queries) of query head h, batch b."""
    tl.static_assert(SPARSE_BLOCK_M % BLOCK_M == 0, "BLOCK_M must divide SPARSE_BLOCK_M")
    tl.static_assert(SPARSE_BLOCK_N % BLOCK_N == 0, "BLOCK_N must divide SPARSE_BLOCK_N")
    q_start = query_tile * BLOCK_M
    bh = b * heads + h
    offs_m = q_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_d2 = second_part_columns(HEAD_DIM, HEAD_DIM2)
    rows_in = offs_m[:, None] < q_len
    q, q2 = load_head_parts(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm, stride_qd, rows_in,
                            offs_d, offs_d2, head_dim, HEAD_DIM2)
    do, do2 = load_head_parts(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom, stride_dod,
                              rows_in, offs_d, offs_d2, head_dim, HEAD_DIM2)
    lse, delta = _load_row_stats(LSE2, DELTA, bh * stats_stride, offs_m, q_len, True)
    if SCORE_ROW is not None:  # the scores are taken at reference query q_start (codegen.py)
        lse -= row_term(b, h, tl.minimum(offs_m, q_len - 1), q_start, kv_len, MODS, SCORE_ROW)
    k_base = K + b * stride_kb + (h // groups) * stride_kh
    v_base = V + b * stride_vb + (h // groups) * stride_vh
    kv_bound = kv_len
    if HAS_KEY_LENGTHS:
        kv_bound = tl.minimum(kv_bound, tl.load(KEY_LENGTHS + b).to(tl.int32))
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    dq2 = ()
    if HEAD_DIM2 > 0:
        dq2 = tl.zeros([BLOCK_M, HEAD_DIM2], dtype=tl.float32)
    WALK_TABLES: tl.constexpr = MASK_KIND == 2
    SPLIT_AT_BOUND: tl.constexpr = WALK_TABLES and HAS_KEY_LENGTHS  # as tiles.forward_row's
    PART_NEEDS_BOUND: tl.constexpr = HAS_KEY_LENGTHS or not EVEN_LENGTHS
    full_idx, full_hi, part_idx, part_lo, part_hi = row_tile_ranges(
        FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, b, h, q_start, kv_bound,
        stride_num_b, stride_num_h, stride_num_m, stride_idx_b, stride_idx_h, stride_idx_m,
        MASK_KIND, HAS_KEY_LENGTHS, BLOCK_M, BLOCK_N, SPARSE_BLOCK_M, SPARSE_BLOCK_N)
    full_bounded = full_hi
    if SPLIT_AT_BOUND:
        full_bounded = tiles_before_bound(full_idx, full_hi, kv_bound, BLOCK_N, SPARSE_BLOCK_N)
    dq, dq2 = _dq_tiles(dq, dq2, q, q2, do, do2, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn,
                        stride_vd, 0, full_bounded, full_idx, q_start, offs_m, offs_n, offs_d, offs_d2, kv_bound,
                        head_dim, qk_scale, b, h, q_len, kv_len, MODS, seed, bh, dropout_threshold, dropout_scale,
                        WALK_TABLES, False, False, False, MASK_MOD, SCORE_MOD, SCORE_KEYS, DROPOUT, BLOCK_N,
                        SPARSE_BLOCK_N, HEAD_DIM2, D_PADDED, DOT_PRECISION, WIDEN_DOTS)
    if SPLIT_AT_BOUND:
        if full_hi > full_bounded:
            dq, dq2 = _dq_tiles(dq, dq2, q, q2, do, do2, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn,
                                stride_vd, full_bounded, full_hi, full_idx, q_start, offs_m, offs_n, offs_d, offs_d2,
                                kv_bound, head_dim, qk_scale, b, h, q_len, kv_len, MODS, seed, bh, dropout_threshold,
                                dropout_scale, WALK_TABLES, False, True, False, MASK_MOD, SCORE_MOD, SCORE_KEYS,
                                DROPOUT, BLOCK_N, SPARSE_BLOCK_N, HEAD_DIM2, D_PADDED, DOT_PRECISION, WIDEN_DOTS)
    if part_hi > part_lo:
        dq, dq2 = _dq_tiles(dq, dq2, q, q2, do, do2, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn,
                            stride_vd, part_lo, part_hi, part_idx, q_start, offs_m, offs_n, offs_d, offs_d2, kv_bound,
                            head_dim, qk_scale, b, h, q_len, kv_len, MODS, seed, bh, dropout_threshold, dropout_scale,
                            WALK_TABLES, IS_CAUSAL, PART_NEEDS_BOUND, MASK_MOD is not None, MASK_MOD, SCORE_MOD,
                            SCORE_KEYS, DROPOUT, BLOCK_N, SPARSE_BLOCK_N, HEAD_DIM2, D_PADDED, DOT_PRECISION,
                            WIDEN_DOTS)
    if HEAD_DIM2 > 0:
        dq2 = dq2 * scale
    store_head_parts(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqm, stride_dqd, rows_in,
                     dq * scale, dq2, offs_d, offs_d2, head_dim, HEAD_DIM2)


@triton.jit(do_not_specialize=["q_len", "kv_len", "stride_col_num_b", "stride_col_num_h", "stride_col_num_n",
                               "stride_col_idx_b", "stride_col_idx_h", "stride_col_idx_n", "stride_row_num_b",
                               "stride_row_num_h", "stride_row_num_m", "stride_row_idx_b", "stride_row_idx_h",
                               "stride_row_idx_m", *DROPOUT_ARGS])
def _attn_bwd(
    Q, K, V, DO, LSE2, DELTA, DQ, DK, DV, KEY_LENGTHS,
    COL_FULL_NUM, COL_FULL_IDX, COL_PART_NUM, COL_PART_IDX,
    ROW_FULL_NUM, ROW_FULL_IDX, ROW_PART_NUM, ROW_PART_IDX, MODS, SEED,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_col_num_b, stride_col_num_h, stride_col_num_n, stride_col_idx_b, stride_col_idx_h, stride_col_idx_n,
    stride_row_num_b, stride_row_num_h, stride_row_num_m, stride_row_idx_b, stride_row_idx_h, stride_row_idx_m,
    heads, groups, q_len, kv_len, head_dim, qk_scale, scale, stats_stride, dropout_threshold, dropout_scale,
    MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_KEY_LENGTHS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPARSE_BLOCK_M: tl.constexpr, SPARSE_BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM2: tl.constexpr, D_PADDED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WIDEN_DOTS: tl.constexpr, EVEN_LENGTHS: tl.constexpr, MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr,
    SCORE_KEYS: tl.constexpr, SCORE_ROW: tl.constexpr, DROPOUT: tl.constexpr, SCORE_MOD_GRADS: tl.constexpr,
    PROGRAMS: tl.constexpr, QUERY_ROWS: tl.constexpr,
):
    """Grid (key tiles + groups x query tiles, batch x kv_heads): the first programs of a row are
    dK/dV programs (BLOCK_M keys held, BLOCK_N queries streamed), the rest dQ programs of the
    group's query heads (BLOCK_M queries held, BLOCK_N keys streamed). PROGRAMS 1 (2) launches only
    the dK/dV (dQ) programs, for a grid of key tiles (groups x query tiles) alone. Under CAUSAL both
    kinds start with their longest programs (the first key tiles, the last query tiles)."""
    tile = tl.program_id(0)
    bhk = tl.program_id(1)
    kv_heads = heads // groups
    b = bhk // kv_heads
    hk = bhk % kv_heads
    seed = load_seed(SEED, DROPOUT)
    n_key_tiles = tl.cdiv(kv_len, BLOCK_M)
    if PROGRAMS == 1 or (PROGRAMS == 0 and tile < n_key_tiles):
        _dkdv_program(
            Q, K, V, DO, LSE2, DELTA, DK, DV, KEY_LENGTHS, COL_FULL_NUM, COL_FULL_IDX, COL_PART_NUM, COL_PART_IDX,
            MODS, stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
            stride_vb, stride_vh, stride_vn, stride_vd, stride_dob, stride_doh, stride_dom, stride_dod,
            stride_dkb, stride_dkh, stride_dkn, stride_dkd,
            stride_col_num_b, stride_col_num_h, stride_col_num_n, stride_col_idx_b, stride_col_idx_h, stride_col_idx_n,
            tile, b, hk, heads, groups, q_len, kv_len, head_dim, qk_scale, scale, stats_stride,
            seed, dropout_threshold, dropout_scale,
            MASK_KIND, IS_CAUSAL, HAS_KEY_LENGTHS, BLOCK_N, BLOCK_M, SPARSE_BLOCK_M, SPARSE_BLOCK_N,
            HEAD_DIM, HEAD_DIM2, D_PADDED, DOT_PRECISION, WIDEN_DOTS, EVEN_LENGTHS, MASK_MOD, SCORE_MOD, SCORE_KEYS,
            SCORE_ROW, SCORE_MOD_GRADS, DROPOUT, QUERY_ROWS)
    else:
        if PROGRAMS == 0:
            tile -= n_key_tiles
        n_q_tiles = tl.cdiv(q_len, BLOCK_M)
        query_tile = tile % n_q_tiles
        if MASK_KIND == 1:  # CAUSAL: the longest dQ programs (the last query tiles) start first
            query_tile = n_q_tiles - 1 - query_tile
        _dq_program(
            Q, K, V, DO, LSE2, DELTA, DQ, KEY_LENGTHS, ROW_FULL_NUM, ROW_FULL_IDX, ROW_PART_NUM, ROW_PART_IDX,
            MODS, stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
            stride_vb, stride_vh, stride_vn, stride_vd, stride_dob, stride_doh, stride_dom, stride_dod,
            stride_dqb, stride_dqh, stride_dqm, stride_dqd,
            stride_row_num_b, stride_row_num_h, stride_row_num_m, stride_row_idx_b, stride_row_idx_h, stride_row_idx_m,
            query_tile, b, hk * groups + tile // n_q_tiles, heads, groups, q_len, kv_len, head_dim,
            qk_scale, scale, stats_stride, seed, dropout_threshold, dropout_scale,
            MASK_KIND, IS_CAUSAL, HAS_KEY_LENGTHS, BLOCK_M, BLOCK_N, SPARSE_BLOCK_M, SPARSE_BLOCK_N,
            HEAD_DIM, HEAD_DIM2, D_PADDED, DOT_PRECISION, WIDEN_DOTS, EVEN_LENGTHS, MASK_MOD, SCORE_MOD, SCORE_KEYS,
            SCORE_ROW, DROPOUT)


# ---------------------------------------------------------------------------------- launcher
PREPROCESS_BLOCK_M = 64
# One launch for both kinds of program from padded head dim 128 on, up to 256 columns computed; elsewhere
# two launches, so that each kind gets its own warps and tiles (H100, head_dim 64: dK/dV wants 8 warps,
# dQ 4, and one launch made the dense fwd+bwd rows 9-22% slower; 256 columns: dK/dV holds 64 keys and
# streams 128 queries, dQ holds 128 queries and streams 32 keys; docs/kernels.md, "The backward").
FUSED_FROM_HEAD_DIM = 128
SPLIT_FROM_COLUMNS = 256
FUSED, SPLIT = [("backward", 0)], [("dkdv", 1), ("dq", 2)]
# The fused kernel compiles in about the time of its two halves one after the other (~3 s at head_dim 128
# on an H100 host). A first call also compiles the halves ahead, each in a process of its own beside it,
# and its backward runs them, with the fused kernel's config, until the fused kernel is compiled: where the
# host has the cores to compile them all at once (``launch.STAND_IN_FROM_CPUS``; docs/kernels.md, "The first
# call"). Its halves stand in for the Gluon backward alike, with GLUON_STAND_IN's small tiles, which compile sooner
# than the Gluon backward (sm_90a on a CPU at 128, with a score function: dK/dV 1.2 s, dQ 0.9 s, the Gluon
# backward 2.0 s; the fused kernel's config 2.0 and 1.3 s, no sooner) and, at head dims 48 and 64, than the split
# kernel's own configs (which the first backward waited for after a first forward on 8 warps: 0.3-1.1 s at hd48
# on an H200 host, 0.01-0.08 s with the small tiles). At 256 columns (GLUON_STAND_IN_WIDE) a half's fp32 dK and dV
# (or dQ) of 256 columns take 8 warps; with one stage its compile is the shortest measured (a window + score
# function, sm_90a on a 2-core CPU, medians: dK/dV 1.7 s against 2.6 s with the split config, 64 x 128 tiles; dQ
# 1.4 against 1.9 s with 128 x 32, 3 stages); a first causal backward at hd256 on an H200 host waited 0.5 s for the
# split configs' halves, 0.02-0.03 s for these.
GLUON_STAND_IN = KernelConfig(64, 32, 4, 2)
GLUON_STAND_IN_WIDE = KernelConfig(64, 32, 8, 1)
PREPROCESS = Launcher(_bwd_preprocess)
BACKWARD = Launcher(_attn_bwd)


def gluon_stand_in(plan: LaunchPlan) -> KernelConfig:
    """The tiles of the Triton backward's halves where they stand in for the Gluon backward (before ``fit``)."""
    return GLUON_STAND_IN if plan.config_key.columns < SPLIT_FROM_COLUMNS else GLUON_STAND_IN_WIDE


def _kernels(plan: LaunchPlan) -> list[tuple[str, int]]:
    """The tuned kernels of a backward and their PROGRAMS flags: one launch, or dK/dV then dQ."""
    fused = plan.padded_dim >= FUSED_FROM_HEAD_DIM and plan.config_key.columns < SPLIT_FROM_COLUMNS
    return FUSED if fused else SPLIT


def query_rows(cfg: KernelConfig, programs: int) -> bool:
    """QUERY_ROWS of a launch with ``cfg`` and PROGRAMS ``programs``: where its dK/dV programs stream more
    queries than they hold keys, the longer side goes along the score tiles' rows (the module docstring)."""
    return programs != 2 and cfg.block_n > cfg.block_m


def _preprocess(plan: LaunchPlan, o, do, lse, dlse, delta, lse2, stats_stride: int, dq_acc=None,
                ahead: bool = False) -> None:
    """Launch the preprocess, which also zeroes ``dq_acc``, the Gluon backward's dQ accumulator, where given (one
    torch op less a call, and the launch is replayed with the call's others); ``ahead``: only compile it (every
    tensor but dlse may be a ``Standin``)."""
    has_dlse = dlse is not None
    (PREPROCESS.compile_ahead if ahead else PREPROCESS)(
        (cdiv(plan.q_len, PREPROCESS_BLOCK_M), plan.batch * plan.heads),
        (o, do, lse, dlse.contiguous() if has_dlse else lse, delta, lse2, lse if dq_acc is None else dq_acc),
        (*o.stride(), *do.stride(), plan.heads, plan.q_len, stats_stride, plan.head_dim),
        dict(HAS_DLSE=has_dlse, ZERO_DQ=dq_acc is not None, BLOCK_M=PREPROCESS_BLOCK_M, HEAD_DIM=plan.padded_dim))


def _launcher(plan: LaunchPlan, programs: int, q, k, v, do, lse2, delta, dq, dk, dv, key_lengths, mods, stats_stride,
              dropout, grads=()):
    """``launch(cfg, via=BACKWARD)``: the backward kernel with PROGRAMS ``programs`` (``dropout``:
    ``plan.dropout_args``) through ``via``: ``BACKWARD`` launches it, ``BACKWARD.compile_ahead`` only compiles
    it (the tensors past v may then be ``Standin``s), ``BACKWARD.compiling`` whether that compile is in flight. A launch
    of the dK/dV programs zeroes ``grads`` first: they add into them."""
    seed, *dropout_scalars = dropout
    tensors = (q, k, v, do, lse2, delta, dq, dk, dv, key_lengths, *plan.tables_of("q")[0], *plan.tables_of("kv")[0],
               mods, seed)
    scalars = (*q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(), *dk.stride(),
               *plan.tables_of("q")[1], *plan.tables_of("kv")[1], plan.heads, plan.groups, plan.q_len, plan.kv_len,
               plan.head_dim, plan.qk_scale, plan.scale, stats_stride, *dropout_scalars)

    def launch(cfg: KernelConfig, via=BACKWARD):
        key_tiles = cdiv(plan.kv_len, cfg.block_m)
        query_tiles = plan.groups * cdiv(plan.q_len, cfg.block_m)
        grid = ((key_tiles + query_tiles, key_tiles, query_tiles)[programs], plan.batch * plan.kv_heads)
        if programs != 2 and via is BACKWARD:  # the dK/dV programs add into the captured tensors' gradients
            for grad in grads:
                if grad is not None:
                    grad.zero_()
        return via(grid, tensors, scalars, plan.constexprs(cfg, PROGRAMS=programs, QUERY_ROWS=query_rows(cfg, programs),
                                                           SCORE_MOD_GRADS=plan.score_mod_grads))
    return launch


def _stats_stride(plan: LaunchPlan) -> int:
    # Rows of delta and lse2 start 64-byte aligned, so that the dK/dV loops' loads of a tile's
    # values vectorise (with rows at q_len, 4-byte copies: twice Flex's copy instructions per tile).
    return cdiv(plan.q_len, 16) * 16


def attention_backward(q, k, v, o, lse, do, dlse, key_lengths: torch.Tensor, plan: LaunchPlan, captures=(),
                       dropout=None):
    """``dq, dk, dv`` (dtypes and shapes of q, k, v) for the gradients ``do`` of o and ``dlse`` of
    lse (or None), and the fp32 gradients of the tensors the mask and score functions capture
    (``captures``, as ``plan.captures`` gives them; None for those that do not require grad);
    ``key_lengths`` as ``plan.key_lengths_arg`` gives it; ``dropout``: the forward's ``Dropout`` where the
    plan has one, else None."""
    if do.stride(-1) != 1 or do.data_ptr() % 16:
        # e.g. o.sum()'s gradient, expanded (strides 0), or a view 16 bytes do not align: the kernels compiled
        # ahead for a contiguous, aligned do would be specialised anew for it (seconds on a first call), so they
        # read a contiguous copy (a fresh one: a misaligned do may be contiguous)
        do = do.clone(memory_format=torch.contiguous_format)
    stats_stride = _stats_stride(plan)
    delta, lse2 = torch.empty((2, plan.batch * plan.heads, stats_stride), dtype=torch.float32, device=q.device)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    grads = [torch.zeros(t.shape, dtype=torch.float32, device=t.device)
             if t.requires_grad and t.dtype.is_floating_point else None for t in captures]
    mods = plan.mods_table(list(captures), grads)
    dropout_args = plan.dropout_args(dropout)
    deterministic = torch.are_deterministic_algorithms_enabled()
    gluon = gluon_kernels("backward") if plan.gluon_backward and not deterministic else None
    # dQ's accumulator, which the Gluon backward adds into (a slot of the call: also made where this call then runs
    # the Triton kernels, standing in on a first call or for a layout TMA cannot read)
    dq_acc = plan.placeholder if gluon is None else gluon.accumulator(plan, q)
    # (the tensors the launches take, the key lengths and the seed last: copied by graphs, as the forward's; and what
    # their scalars and kernels depend on besides the plan); a call that adds the captured tensors' gradients also
    # zeroes them: not replayed
    slots = (q, k, v, o, lse, do, plan.placeholder if dlse is None else dlse, delta, lse2, dq, dk, dv, mods, dq_acc,
             key_lengths, dropout_args[0])
    layout = (q.stride(), k.stride(), v.stride(), o.stride(), do.stride(), do.dtype,
              None if dlse is None else dlse.stride(), deterministic, *dropout_args[1:])
    replays, adds_grads = plan.replays["backward"], any(g is not None for g in grads)
    replay = None if adds_grads else replays.get(layout)
    if replay is None or not replay(slots):
        with replays.keep(layout, slots, plan.tensors, copied=2) as settled:
            ran = _launch(plan, q, k, v, o, lse, do, dlse, key_lengths, delta, lse2, dq, dk, dv, grads, mods,
                          stats_stride, dropout_args, gluon, dq_acc)
            settled[0] = None if adds_grads else ran
    return dq, dk, dv, grads


def _launch(plan, q, k, v, o, lse, do, dlse, key_lengths, delta, lse2, dq, dk, dv, grads, mods, stats_stride,
            dropout_args, gluon, dq_acc) -> str | None:
    """Launch the backward into delta, lse2, dq (where the Gluon backward ``gluon`` runs, through ``dq_acc``), dk,
    dv and grads: "tuned" where the tuned Triton kernels ran, "gluon" where the Gluon backward did, None where
    kernels standing in for one compiling ahead did."""
    _preprocess(plan, o, do, lse, dlse, delta, lse2, stats_stride, None if gluon is None else dq_acc)

    def launcher(programs: int):
        return _launcher(plan, programs, q, k, v, do, lse2, delta, dq, dk, dv, key_lengths, mods, stats_stride,
                         dropout_args, grads)

    def stood_in(state_name: str, compiling) -> bool:
        """Whether halves standing in for a kernel compiling ahead (``launch.standing_in``) ran on this call."""
        state = plan.per_layout.get(state_name, {})
        stand_in = standing_in(state, compiling)

        def launches():
            for cfg, programs in stand_in:
                launcher(programs)(cfg)

        return stand_in is not None and run_stand_in(state, launches)

    if gluon is not None:
        if stood_in("gluon_backward_stand_in",
                    lambda _: gluon.compiling(plan, q, k, v, do, key_lengths, mods, stats_stride)):
            return None
        if gluon.launch(plan, q, k, v, do, lse2, delta, dq_acc, dk, dv, key_lengths, mods, stats_stride):
            gluon.finish(plan, dq_acc, dq)
            return "gluon"
    kernels = _kernels(plan)
    if kernels is FUSED and stood_in("backward_stand_in",
                                     lambda launches: launcher(0)(launches[0][0], BACKWARD.compiling)):
        return None
    for kernel, programs in kernels:
        run_tuned(kernel, plan.backward_key, launcher(programs))
    return "tuned"


def compile_backward_ahead(q, k, v, key_lengths: torch.Tensor, plan: LaunchPlan, captures=()) -> None:
    """Start compiling the kernels that ``attention_backward`` will launch after a forward on these
    inputs (contiguous outputs and gradients, no gradient of lse; none where a launch tunes first), and where
    the process may use STAND_IN_FROM_CPUS CPUs, the halves that stand in for the fused kernel or the Gluon
    backward while it compiles (``launch.standing_in``)."""
    stats_stride = _stats_stride(plan)
    out = Standin(q.dtype, q.shape)  # o, do and dq
    stats = Standin(torch.float32, (plan.batch * plan.heads, stats_stride))
    deterministic = torch.are_deterministic_algorithms_enabled()  # (the Triton backward then: as attention_backward)
    gluon = gluon_kernels("backward") if plan.gluon_backward and not deterministic else None
    dq_acc = None if gluon is None else gluon.accumulator(plan, q, ahead=True)
    _preprocess(plan, out, out, Standin(torch.float32, q.shape[:3]), None, stats, stats, stats_stride, dq_acc,
                ahead=True)
    mods = plan.mods_table(list(captures))
    stand_ins = usable_cpus() >= STAND_IN_FROM_CPUS

    def launcher(programs: int):
        return _launcher(plan, programs, q, k, v, out, stats, stats, out, Standin(k.dtype, k.shape),
                         Standin(v.dtype, v.shape), key_lengths, mods, stats_stride, plan.dropout_args(None, ahead=True))

    def stand_in(state: str, halves: list) -> None:  # compile the halves ahead; they stand in from the next call
        for cfg, programs in halves:
            launcher(programs)(cfg, BACKWARD.compile_ahead)
        plan.per_layout.setdefault(state, {})["stand_in"] = halves

    kernels = _kernels(plan)
    if gluon is not None and gluon.compile_ahead(plan, q, k, v, key_lengths, mods, stats, stats_stride):
        # (without them, a new function's first backward waited for the Gluon backward's compile: on an H100 host
        # 1.0-1.2 s at head dim 64, 0.5-0.8 s at 128)
        if stand_ins and gluon.compiling(plan, q, k, v, out, key_lengths, mods, stats_stride):
            stand_in("gluon_backward_stand_in", [(fit(kernel, gluon_stand_in(plan), plan.backward_key), programs)
                                                 for kernel, programs in SPLIT])
        return
    for kernel, programs in kernels:
        cfg = planned(kernel, plan.backward_key)
        if cfg is None:
            continue
        launcher(programs)(cfg, BACKWARD.compile_ahead)
        # the halves stand in for the fused kernel only while its compile is in flight: a launch differing from a
        # compiled one only in its scalars, or a process that cannot fork, started none
        if programs == 0 and stand_ins and launcher(0)(cfg, BACKWARD.compiling):
            stand_in("backward_stand_in", [(cfg, half) for _, half in SPLIT])
