"""The backward for Hopper written in Gluon: FlashAttention-3's structure, dK, dV and dQ in one pass, dQ added
by TMA reduce-add (docs/kernels.md, "The Gluon backward").

A program holds one 128-key tile of one (batch, key/value head): every key tile of a head next to each other
(programs that stream the same queries run together, and share them in L2), within a head the longest
CAUSAL columns first.
It walks the query tiles (``BLOCK_M``: 64 rows at head dims 80-256, 128 at 48 and 64; FlashAttention-4's sizes at
64 and 128) that see its keys, for each query head of its GQA group in turn. Two consumer warpgroups, a producer
and a dQ writer (head dims 160-256: a tile of 64 keys, the warpgroups splitting its columns, below):
  producer   (one warp, two for SPARSE; 24 registers a thread) loads K and V once (two 64-row
             halves each; one box at 160-256), then Q_i, dO_i, lse2_i and delta_i of each query tile by
             TMA into a ring of STAGES buffers (``q_ready`` / ``q_empty`` mbarriers, two arrivals on
             ``q_empty``, one per consumer).
  consumers  two warpgroups, warpgroup w owning keys [64 w, 64 w + 64) of the tile. For each query tile,
             in FlashAttention-4's order:
             S^T = K_w Q^T and dP^T = V_w dO^T (issued together, S^T waited first);
             P^T = exp2(S^T * qk_scale - lse2) under dP^T; dS^T = P^T (dP^T - delta) to shared memory;
             dV_w += P^T dO (P^T from registers) issued; the two warpgroups meet (named barrier 10) once
             both halves of dS^T are in shared memory; warpgroup w computes its part of dQ_i = dS K: at
             head dim 128 columns [w D/2, (w + 1) D/2) of the 64 queries, at 64 queries [64 w, 64 w + 64)
             of the 128 and every column (64 x 64 fp32, 32 registers a thread either way; a head dim in two
             parts: at 80 and 96 warpgroup 0 the first part's columns, 1 the second's, at 48 a tile a part
             of its 64 queries: ``_dq_descriptors``); then
             dK_w += dS^T Q (dS^T from registers) runs while dQ_i goes to one of the warpgroup's two
             staging buffers (``dq_full`` / ``dq_empty``). dS^T has two buffers: a warpgroup rewrites one
             only after the barrier of the next tile, which the other passes only after its dQ product
             that read it.
  dQ writer  (one warp, 24 registers) walks the program's query tiles as the consumers do and adds each
             consumer's staged dQ tiles into an fp32 accumulator by TMA reduce-add (``_add_dq_tiles``),
             giving a buffer back once TMA has read it: the consumers neither issue the adds nor wait for
             their reads.
dQ accumulates in fp32 (B, H, q_len, D), scaled and converted after the kernel; the adds land in any order,
so under ``torch.use_deterministic_algorithms(True)`` the (deterministic) Triton backward runs instead.
Keeping dK and dV (64 + 64 fp32 registers a thread at head dim 128) and the score tiles leaves no room to
issue the next tile's products before the current dQ is stored (they spill, and ptxas then serialises every
wgmma).

Head dims 160, 192 and 256 (``WIDE``, ``_attn_bwd_gluon_wide``): dK and dV of 64 keys x 160-256 columns take
160-256 registers a thread, more than a warpgroup has beside its tiles, so the warpgroups split the columns instead
of the keys, as FlashAttention-3's widest backward does. A program holds 64 keys and the head dim in two parts of
columns (160 = 128 + 32, 192 = 128 + 64, 256 = 128 + 128), warpgroup w owning part w's columns of dK, dV and dQ.
Q_i with lse2_i and dO_i with delta_i come in rings of their own (``WIDE_BUFFERS``: at 256 two Q buffers, one dO
buffer, released as soon as both dV products read it, and one dQ staging buffer a warpgroup fit 230 KB). Per query
tile (64 rows), warpgroup w computes S^T and dP^T of its 32 queries over the whole head dim (two wgmmas each), P^T and
dS^T, and stores them as rows of P and dS (queries x keys) to shared memory; after named barrier 10 it issues dQ's
first chunk of its columns (dS K_w), dV_w += P^T dO_w and dK_w += dS^T Q_w, all from shared memory, stores and
adds the dQ chunk under them, then (a warpgroup of 128 columns) the second chunk (dQ in chunks of at most 64
columns: beside dK and dV, 128 registers at 128 columns, a whole dQ spilled). The work is even at 256 only; at 160
and 192 warpgroup 0 does 2-4x warpgroup 1's dQ, dV and dK products.

Constexpr flags:
  MASK_KIND      0 DENSE, 1 CAUSAL, 2 SPARSE (``plan.KIND_CODES``): query tiles 0.., those from the key tile's
                 first key on, or those of the blocks listed in the column tables (FULL_*, then PART_*).
  RAGGED         DENSE or CAUSAL on lengths the tiles do not divide: the last key tile (a program's) and the
                 last query tile of a walk end at kv_len and q_len (``gluon_tools.moved_back``), so that no TMA box
                 reads past a head's rows; their scores shared with the tile before are dropped (``_probabilities``)
                 and the program's keys shared with the tile before are not stored (``_store_dk_dv``).
  IS_CAUSAL      SPARSE only: the partial blocks are cut by q_idx >= kv_idx (top-left alignment).
  HAS_KEY_LENGTHS  KEY_LENGTHS[b] ends batch b's keys (``gluon_tools.key_end``): a program whose
                 own keys start at or past it walks no query tile (it stores zeros), the tile across it drops the
                 keys past it (``_probabilities``).
  MASK_MOD, SCORE_MOD, SCORE_KEYS  the generated helpers (codegen.py) as in backward.py, or None: MASK_MOD
                 cuts the partial blocks too; dS is scaled by SCORE_MOD's derivative. A separable function's
                 row terms are off lse2 before the kernel starts (``_lse2_less_rows``).
  SPARSE_BLOCK_M, SPARSE_BLOCK_N  SPARSE: the mask block, multiples of the tiles.
  HEAD_DIM, HEAD_DIM2  the head dim, 64 or 128 (HEAD_DIM2 = 0), or its two parts (``plan.head_dim_parts``: 96 =
                 64 + 32), each read by TMA boxes of its own width and multiplied apart as in forward_gluon.py
                 (S^T = K Q^T + K2 Q2^T, dV and dV2, dK and dK2 a part each; at 160-256 each warpgroup's dV
                 and dK are one part's): no column padded.
  STAGES         Q/dO buffers (the wide kernel's Q buffers).
  DO_STAGES, DQ_BUFFERS  the wide kernel's dO buffers and dQ staging buffers a warpgroup (``WIDE_BUFFERS``).

Scores in base 2 as in backward.py: p = exp2(s * qk_scale - lse2) with lse2 = lse * log2(e) from the
preprocess (+inf for a row that saw no key: p = 0); with a score function p = exp2(its base-2 score at the
query tile's first query - lse2), lse2 less the function's row terms (``_lse2_less_rows``), and dS is scaled
by its derivative; dK = scale * sum dS^T Q, dQ = scale * sum dS K.

Applies (``applies``) on Hopper with Triton >= 3.6 where ``gluon_tools.takes`` the inputs (query tiles of
``BLOCK_M``, key tiles of ``KEY_TILE``: 128, 64 at 160-256; DENSE and CAUSAL masks on lengths of at least a tile,
SPARSE ones on lengths the tiles divide; with or without key_lengths), no captured tensor takes a gradient, and the
layouts TMA can read; ``SPARSEFLASH_GLUON`` "auto" on rows of ``AUTO_ROW_KEYS`` keys (by head dim) or more on average,
"1" wherever it applies, "0" never.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from sparseflash.attention.triton import gluon_tools
from sparseflash.attention.triton.forward_persistent import row_view_rows
from sparseflash.attention.triton.gluon_tools import (issue_abt, issue_pv, key_end, listed_walk, load_box, moved_back,
                                                      named_sync, ring_index, row_view, row_view_coords,
                                                      thread_barrier, tma_load, tma_reduce_add, tma_store,
                                                      walk_tile_start)
from sparseflash.attention.triton.launch import Launcher, Standin, cdiv
from sparseflash.attention.triton.plan import KIND_CODES
from sparseflash.attention.triton.tiles import key_steps, modded_scores, row_term

# query rows of a streamed tile, by head dim (FlashAttention-4's at 64 and 128; head dims in two parts,
# plan.head_dim_parts, as the power of two above them: at 80 and 96 a consumer's dK and dV (80-96 registers a
# thread) leave room for scores of 64 queries, not 128)
BLOCK_M = {48: 128, 64: 128, 80: 64, 96: 64, 128: 64, 160: 64, 192: 64, 256: 64}
DQ_ROWS = 64  # query rows of a dQ tile a consumer warpgroup adds
# head dims whose dK and dV a warpgroup holds the columns of one part of (the first 128, and the rest: 160 = 128 + 32,
# 192 = 128 + 64, 256 = 128 + 128), 64 keys a program (_attn_bwd_gluon_wide), and their (dO buffers, dQ staging
# buffers a warpgroup): dO has a ring of its own there, released once dV's product read it. At 256 two of each
# would take 288 KB of shared memory; one of each leaves room for two Q buffers (230 KB). With one Q/dO buffer at
# 192, fwd+bwd ran 1.27-1.38x as long as with two on an H100
WIDE_BUFFERS = {160: (2, 2), 192: (2, 2), 256: (1, 1)}
WIDE = tuple(WIDE_BUFFERS)
KEY_TILE = {dim: 64 if dim in WIDE else 128 for dim in BLOCK_M}  # keys a program holds
TILES = {dim: (rows, KEY_TILE[dim]) for dim, rows in BLOCK_M.items()}  # (query, key) tiles by head dim
KV_BOX_ROWS = 64  # keys of a K or V box: one a program at 160-256, two of 128
# Q/dO buffers: with the dS^T and dQ staging buffers they fill shared memory at 64, 128 and 192 (226-231 KB); at 80
# and 96 (157-182 KB; 137-157 with one dQ staging buffer a consumer, when this was measured) three ran 0.90-1.05x
# as long as two on an H100, no better on the whole
STAGES = 2
# "auto" takes it from this mean number of keys a query row walks, by head dim. At 64 and 128, with dK and dV stored
# by TMA (``_store_dk_dv_staged``), fwd+bwd ran 0.85-0.97x the time it takes with the Triton backward on rows of
# 512-768 keys (DENSE, CAUSAL, random, butterfly and local masks; H200, docs/results/h200_gluon_backward_staged_dk_dv),
# 0.93-1.16x at 128-320 keys (no consistent side); head dims in two parts (fwd+bwd,
# docs/results/h100_gluon_backward_head_dim_parts): 1.02-1.34x from 576 keys (CAUSAL S=1024) at 80 and 96 and from 512
# at 48, 0.82-1.01x at 320-512 keys below them, 0.59-0.95x at 256 keys; at 160 and 192 (_attn_bwd_gluon_wide)
# 1.00-1.11x from 1,088 keys (CAUSAL S=2048), 0.95x at 1,024 (DENSE S=1024); at 256 1.04-1.24x from 576 keys (CAUSAL
# S=1024), not measured below
AUTO_ROW_KEYS = {48: 512, 64: 512, 80: 576, 96: 576, 128: 512, 160: 1088, 192: 1088, 256: 576}
# the column tables' strides change with the lengths: new lengths compile nothing new
TABLE_STRIDE_ARGS = ["stride_num_b", "stride_num_h", "stride_num_n", "stride_idx_b", "stride_idx_h", "stride_idx_n"]


@gluon.jit
def _program_tile(heads, groups, kv_len, KEY_LENGTHS, BLOCK_N: gl.constexpr, RAGGED: gl.constexpr,
                  HAS_KEY_LENGTHS: gl.constexpr):
    """(batch * key/value head, batch, key/value head, first key, first key of its own, end of the batch's keys
    (``gluon_tools.key_end``)) of this program: the key tiles of a head in turn. With RAGGED the last tile ends at
    kv_len (``moved_back``): its keys before the second start are the tile before's."""
    tiles = gl.cdiv(kv_len, BLOCK_N)
    bk = gl.program_id(0) // tiles
    kv_heads = heads // groups
    kv_own = (gl.program_id(0) % tiles) * BLOCK_N
    b = bk // kv_heads
    return bk, b, bk % kv_heads, moved_back(kv_own, kv_len, BLOCK_N, RAGGED), kv_own, key_end(KEY_LENGTHS, b, kv_len,
                                                                                            HAS_KEY_LENGTHS)


@gluon.jit
def _column(b, h, kv_start, kv_end, q_len, FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, stride_num_b, stride_num_h,
            stride_num_n, stride_idx_b, stride_idx_h, stride_idx_n, MASK_KIND: gl.constexpr,
            BLOCK_M: gl.constexpr, SPARSE_BLOCK_M: gl.constexpr, SPARSE_BLOCK_N: gl.constexpr):
    """The query tiles of head h (of batch b) that see the key tile at kv_start (the program's own keys'): (first,
    n_full, n_tiles, full_idx, part_idx), tile t of the walk at ``gluon_tools.walk_tile_start`` (moved back to end
    at q_len where RAGGED, ``moved_back``): DENSE every tile, CAUSAL the tiles from the key tile's first key on
    (first); SPARSE the tiles of the listed full blocks (n_full), then of the partial ones; none where the key tile
    starts at or past the end of the batch's keys kv_end."""
    first = 0
    full_idx = FULL_IDX
    part_idx = PART_IDX
    if MASK_KIND == 2:
        n_full, n_tiles, full_idx, part_idx = listed_walk(
            FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, b, h, kv_start // SPARSE_BLOCK_N, stride_num_b, stride_num_h,
            stride_num_n, stride_idx_b, stride_idx_h, stride_idx_n, SPARSE_BLOCK_M // BLOCK_M)
        n_tiles = gl.where(kv_start < kv_end, n_tiles, 0)
    elif MASK_KIND == 1:
        first = kv_start // BLOCK_M
        n_tiles = gl.where(kv_start < kv_end, gl.maximum(gl.cdiv(q_len, BLOCK_M) - first, 0), 0)
        n_full = 0
    else:
        n_tiles = gl.where(kv_start < kv_end, gl.cdiv(q_len, BLOCK_M), 0)
        n_full = n_tiles
    return first, n_full, n_tiles, full_idx, part_idx


@gluon.jit
def _probabilities(s_t, lse2, t, n_full, b, h, q_start, q_own, q_idx, kv_start, kv_own, kv_end, offs_kv, kv_first,
                   keys, qk_scale, soft_scale, MODS, MASK_KIND: gl.constexpr, RAGGED: gl.constexpr,
                   IS_CAUSAL: gl.constexpr, MASK_MOD: gl.constexpr, SCORE_MOD: gl.constexpr, SCORE_KEYS: gl.constexpr,
                   HAS_KEY_LENGTHS: gl.constexpr, BLOCK_N: gl.constexpr):
    """(P^T, dS^T's factor) of tile t of a walk from the products S^T (keys offs_kv x queries q_idx, a (1, queries)
    row): p = exp2(s * soft_scale - lse2), or with SCORE_MOD of its base-2 scores at reference query q_own, the
    tile's first query of its own (lse2 is less their row terms there), its derivative the factor (1.0 without); 0
    where CAUSAL's diagonal (the program's keys from kv_start, BLOCK_N of them, across the query tile) or the
    partial blocks' cut (IS_CAUSAL, MASK_MOD) drop it, (RAGGED) on the queries before q_own and the keys before
    kv_own, which a tile moved back to end at q_len or kv_len shares with the tile before (``moved_back``), and
    (HAS_KEY_LENGTHS) on the keys from the end of the batch's, kv_end."""
    d_score = 1.0
    if SCORE_MOD is not None:
        s_t, d_score = modded_scores(s_t, b, h, q_idx, offs_kv[:, None], q_own, kv_first, keys, qk_scale, MODS,
                                     SCORE_MOD, SCORE_KEYS)
    p_t = gl.exp2(s_t * soft_scale - lse2[None, :])
    if MASK_KIND == 1:
        if q_start < kv_start + BLOCK_N:  # the tiles across the diagonal
            p_t = gl.where(q_idx >= offs_kv[:, None], p_t, 0.0)
    elif IS_CAUSAL or MASK_MOD is not None:
        if t >= n_full:  # the partial blocks
            if MASK_MOD is not None:
                keep = MASK_MOD(b, h, q_idx, offs_kv[:, None], MODS)
                if IS_CAUSAL:
                    keep = keep & (q_idx >= offs_kv[:, None])
            else:
                keep = q_idx >= offs_kv[:, None]
            p_t = gl.where(keep, p_t, 0.0)
    if RAGGED:
        if (q_start != q_own) | (kv_start != kv_own):  # a tile moved back
            p_t = gl.where((offs_kv >= kv_own)[:, None] & (q_idx >= q_own), p_t, 0.0)
    if HAS_KEY_LENGTHS:
        if kv_start + BLOCK_N > kv_end:  # the tile across the batch's last key
            p_t = gl.where((offs_kv < kv_end)[:, None], p_t, 0.0)
    return p_t, d_score


@gluon.jit
def _store_dk_dv(DK, DV, dk, dv, first_row, own_row, first_column, pitch, scale, layout: gl.constexpr):
    """Store a warpgroup's dK (times ``scale``) and dV (registers of ``layout``, (keys, columns)) at rows
    first_row.. (those from own_row on: a key tile moved back to end at kv_len leaves the keys it shares with the
    tile before to that tile's program) and columns first_column.. of DK and DV, seen as rows of ``pitch``
    elements."""
    rows = first_row + gl.arange(0, dk.shape[0], layout=gl.SliceLayout(1, layout))
    cols = first_column + gl.arange(0, dk.shape[1], layout=gl.SliceLayout(0, layout))
    offs = rows.to(gl.int64)[:, None] * pitch + cols[None, :]
    own = (rows >= own_row)[:, None]
    gl.store(DK + offs, (dk * scale).to(DK.dtype.element_ty), mask=own)
    gl.store(DV + offs, dv.to(DV.dtype.element_ty), mask=own)


@gluon.jit
def _store_dk_dv_parts(DK, DV, dk, dv, dk2, dv2, first_row, own_row, scale, layout: gl.constexpr,
                       layout2: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM2: gl.constexpr):
    """``_store_dk_dv`` of both parts of the head dim (dk2, dv2: the second's, of ``layout2``, with HEAD_DIM2)."""
    _store_dk_dv(DK, DV, dk, dv, first_row, own_row, 0, HEAD_DIM + HEAD_DIM2, scale, layout)
    if HEAD_DIM2 > 0:
        _store_dk_dv(DK, DV, dk2, dv2, first_row, own_row, HEAD_DIM, HEAD_DIM + HEAD_DIM2, scale, layout2)


@gluon.jit
def _store_dk_dv_staged(dk_desc, dk2_desc, dv_desc, dv2_desc, dk, dk2, dv, dv2, dk_smem, dk2_smem, dv_smem, dv2_smem,
                        row, scale, HEAD_DIM: gl.constexpr, HEAD_DIM2: gl.constexpr):
    """Store a warpgroup's dK (times ``scale``) and dV (64 keys x HEAD_DIM, registers; with HEAD_DIM2 their second
    part's columns in dk2 and dv2) at row ``row`` of the descriptors' row views by TMA (dk2_desc and dv2_desc: the
    second part's boxes, HEAD_DIM columns on), through shared buffers of their boxes' shape that the walk no longer
    reads (dk_smem..dv2_smem). From registers, each thread's 64 four-byte stores at head dim 128, 16 bytes of a row
    for each warp, took as long as a key tile's work a program (as the forward's o, ``O_STAGED``)."""
    dk_smem.store((dk * scale).to(dk_desc.dtype))
    dv_smem.store(dv.to(dv_desc.dtype))
    if HEAD_DIM2 > 0:
        dk2_smem.store((dk2 * scale).to(dk2_desc.dtype))
        dv2_smem.store(dv2.to(dv2_desc.dtype))
    fence_async_shared()
    tma_store(dk_desc, [row, 0], dk_smem)
    tma_store(dv_desc, [row, 0], dv_smem)
    if HEAD_DIM2 > 0:
        tma_store(dk2_desc, [row, HEAD_DIM], dk2_smem)
        tma_store(dv2_desc, [row, HEAD_DIM], dv2_smem)
    tma.store_wait(0)  # the buffers read before the program ends


@gluon.jit
def _producer(q_desc, k_desc, v_desc, do_desc, q2_desc, k2_desc, v2_desc, do2_desc, lse_desc, delta_desc, q_smem,
              do_smem, q2_smem, do2_smem, lse_smem, delta_smem, k_smem, v_smem, k2_smem, v2_smem, kv_ready, q_ready,
              q_empty, do_ready, do_empty, FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, KEY_LENGTHS,
              stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
              stride_dob, stride_doh, stride_dom, stride_num_b, stride_num_h, stride_num_n, stride_idx_b,
              stride_idx_h, stride_idx_n, heads, groups, q_len, kv_len, stats_stride,
              MASK_KIND: gl.constexpr, RAGGED: gl.constexpr, HAS_KEY_LENGTHS: gl.constexpr, BLOCK_N: gl.constexpr,
              SPARSE_BLOCK_M: gl.constexpr, SPARSE_BLOCK_N: gl.constexpr, HEAD_DIM2: gl.constexpr,
              STAGES: gl.constexpr, DO_STAGES: gl.constexpr):
    """K and V of the program's key tile, then Q, dO, lse2 and delta of each query tile of its walk into the
    ring's next buffer once both consumers released the tile it held; with HEAD_DIM2, each of Q, K, V and dO
    with its second part (q2/k2/v2/do2). DO_STAGES 0: dO and delta ride in Q's ring (its barriers; do_ready and
    do_empty unused); else they have a ring of their own, of DO_STAGES buffers, behind do_ready / do_empty."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    K_ROWS: gl.constexpr = k_desc.block_type.shape[0]  # keys of a K or V box: 64, two boxes a tile of 128
    # bytes of a box of K (V's alike) and of Q (dO's alike) with its second part's (``load_box``)
    K_BYTES: gl.constexpr = k_desc.block_type.nbytes + (k2_desc.block_type.nbytes if HEAD_DIM2 > 0 else 0)
    Q_BYTES: gl.constexpr = q_desc.block_type.nbytes + (q2_desc.block_type.nbytes if HEAD_DIM2 > 0 else 0)
    ROW_BYTES: gl.constexpr = Q_BYTES + lse_desc.block_type.nbytes  # a tile's Q and lse2 (dO and delta alike)
    _, b, kv_head, kv_start, kv_own, kv_end = _program_tile(heads, groups, kv_len, KEY_LENGTHS, BLOCK_N, RAGGED,
                                                            HAS_KEY_LENGTHS)
    k_row, k_col = row_view_coords(b, kv_head, kv_start, stride_kb, stride_kh, stride_kn)
    v_row, v_col = row_view_coords(b, kv_head, kv_start, stride_vb, stride_vh, stride_vn)
    mbarrier.expect(kv_ready, 2 * (BLOCK_N // K_ROWS) * K_BYTES)
    for box in gl.static_range(BLOCK_N // K_ROWS):
        load_box(k_desc, k2_desc, k_row + box * K_ROWS, k_col, kv_ready, k_smem.slice(box * K_ROWS, K_ROWS),
                 k2_smem.slice(box * K_ROWS, K_ROWS), HEAD_DIM2)
        load_box(v_desc, v2_desc, v_row + box * K_ROWS, v_col, kv_ready, v_smem.slice(box * K_ROWS, K_ROWS),
                 v2_smem.slice(box * K_ROWS, K_ROWS), HEAD_DIM2)
    n = 0  # query tiles loaded so far: the ring's position
    for g in range(groups):
        h = kv_head * groups + g
        first, n_full, n_tiles, full_idx, part_idx = _column(
            b, h, kv_own, kv_end, q_len, FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, stride_num_b, stride_num_h,
            stride_num_n, stride_idx_b, stride_idx_h, stride_idx_n, MASK_KIND, BLOCK_M, SPARSE_BLOCK_M,
            SPARSE_BLOCK_N)
        stats_row = (b * heads + h) * stats_stride
        q_row, q_col = row_view_coords(b, h, 0, stride_qb, stride_qh, stride_qm)
        do_row, do_col = row_view_coords(b, h, 0, stride_dob, stride_doh, stride_dom)
        for t in range(n_tiles):
            q_own = walk_tile_start(t, first, n_full, full_idx, part_idx, MASK_KIND, BLOCK_M, SPARSE_BLOCK_M)
            q_start = moved_back(q_own, q_len, BLOCK_M, RAGGED)
            stage = ring_index(n, STAGES)
            mbarrier.wait(q_empty.index(stage), ((n // STAGES) - 1) & 1, pred=n >= STAGES)
            if DO_STAGES == 0:  # one barrier for the tile's four loads
                do_stage = stage
                do_bar = q_ready.index(stage)
                mbarrier.expect(do_bar, 2 * ROW_BYTES)
            else:
                do_stage = ring_index(n, DO_STAGES)
                do_bar = do_ready.index(do_stage)
                mbarrier.expect(q_ready.index(stage), ROW_BYTES)
            load_box(q_desc, q2_desc, q_row + q_start, q_col, q_ready.index(stage), q_smem.index(stage),
                     q2_smem.index(stage), HEAD_DIM2)
            if DO_STAGES > 0:  # Q and lse2 first: the tile's S^T waits for them only, while dO waits for its buffer
                tma_load(lse_desc, [stats_row + q_start], q_ready.index(stage), lse_smem.index(stage))
                mbarrier.wait(do_empty.index(do_stage), ((n // DO_STAGES) - 1) & 1, pred=n >= DO_STAGES)
                mbarrier.expect(do_bar, ROW_BYTES)
            load_box(do_desc, do2_desc, do_row + q_start, do_col, do_bar, do_smem.index(do_stage),
                     do2_smem.index(do_stage), HEAD_DIM2)
            if DO_STAGES == 0:
                tma_load(lse_desc, [stats_row + q_start], q_ready.index(stage), lse_smem.index(stage))
            tma_load(delta_desc, [stats_row + q_start], do_bar, delta_smem.index(do_stage))
            n += 1


@gluon.jit
def _consumer(q_smem, do_smem, q2_smem, do2_smem, lse_smem, delta_smem, k_smem, v_smem, k2_smem, v2_smem, ds_smem,
              dq_smem, dq2_smem, kv_ready, q_ready, q_empty, dq_full, dq_empty, DK, DV, dk_desc, dk2_desc, dv_desc,
              dv2_desc, FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, KEY_LENGTHS, MODS, stride_num_b, stride_num_h,
              stride_num_n, stride_idx_b, stride_idx_h, stride_idx_n, heads, groups, q_len, kv_len, qk_scale, scale,
              WG: gl.constexpr, MASK_KIND: gl.constexpr, RAGGED: gl.constexpr, IS_CAUSAL: gl.constexpr,
              MASK_MOD: gl.constexpr, SCORE_MOD: gl.constexpr, SCORE_KEYS: gl.constexpr, HAS_KEY_LENGTHS: gl.constexpr,
              BLOCK_N: gl.constexpr, SPARSE_BLOCK_M: gl.constexpr, SPARSE_BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
              HEAD_DIM2: gl.constexpr, STAGES: gl.constexpr):
    """Keys [WG * 64, WG * 64 + 64) of the program's tile: dK and dV over the walk, stored at the end by TMA through
    shared memory the walk no longer reads (``_store_dk_dv_staged``; dk_desc..dv2_desc over DK and DV,
    ``_attn_bwd_gluon``) or from registers (DK, DV: (B, key/value heads, kv_len, HEAD_DIM + HEAD_DIM2) contiguous;
    with HEAD_DIM2 their second part's columns in dk2 and dv2), and its part of each tile's dQ (``_dq_descriptors``),
    staged for ``_dq_writer`` in the two buffers of dq_smem (and dq2_smem) in turn, behind this warpgroup's pair of
    dq_full / dq_empty barriers (WG * 2 + buffer)."""
    BLOCK_M: gl.constexpr = q_smem.type.shape[1]
    HALF_N: gl.constexpr = BLOCK_N // 2
    PARTS: gl.constexpr = 2 if HEAD_DIM2 > 0 else 1  # wgmma groups of a product over the head dim
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM, 16])
    # the second part's (a placeholder width without one, unused)
    kv2_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM2 if HEAD_DIM2 > 0 else 16, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    a2_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv2_layout, k_width=2)
    # the warpgroup's dQ tiles (``_dq_descriptors``): the first at (DQ_ROW, DQ_COLUMN) of the query tile, of the keys'
    # columns dq_keys; with SECOND_DQ (query tiles of 128 rows, a head dim in two parts) the second part's beside it
    DQ_TILE_ROWS: gl.constexpr = dq_smem.type.shape[1]
    DQ_COLUMNS: gl.constexpr = dq_smem.type.shape[2]
    DQ_BY_ROWS: gl.constexpr = BLOCK_M == 2 * DQ_TILE_ROWS
    OWN_PART: gl.constexpr = not DQ_BY_ROWS and HEAD_DIM2 > 0 and WG == 1  # warpgroup 1 takes the second part
    SECOND_DQ: gl.constexpr = DQ_BY_ROWS and HEAD_DIM2 > 0
    DQ_GROUPS: gl.constexpr = 2 if SECOND_DQ else 1
    DQ_ROW: gl.constexpr = WG * DQ_TILE_ROWS if DQ_BY_ROWS else 0
    DQ_COLUMN: gl.constexpr = 0 if DQ_BY_ROWS else WG * (HEAD_DIM if HEAD_DIM2 > 0 else DQ_COLUMNS)
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_COLUMNS, 16])
    dq2_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, dq2_smem.type.shape[2], 16])
    if OWN_PART:
        dq_keys = k2_smem
    else:
        dq_keys = k_smem.slice(DQ_COLUMN, DQ_COLUMNS, dim=1)
    bk, b, kv_head, kv_start, kv_own, kv_end = _program_tile(heads, groups, kv_len, KEY_LENGTHS, BLOCK_N, RAGGED,
                                                             HAS_KEY_LENGTHS)
    my_keys = k_smem.slice(WG * HALF_N, HALF_N)
    my_values = v_smem.slice(WG * HALF_N, HALF_N)
    my_keys2 = k2_smem.slice(WG * HALF_N, HALF_N)
    my_values2 = v2_smem.slice(WG * HALF_N, HALF_N)
    kv_first = kv_start + WG * HALF_N
    offs_kv = kv_first + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, s_layout))
    cols_q = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    zero_s = gl.zeros([HALF_N, BLOCK_M], gl.float32, s_layout)
    zero_dq = gl.zeros([DQ_TILE_ROWS, DQ_COLUMNS], gl.float32, dq_layout)
    dk = gl.zeros([HALF_N, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([HALF_N, HEAD_DIM], gl.float32, kv_layout)
    dk2 = 0.0
    dv2 = 0.0
    zero_dq2 = 0.0
    if HEAD_DIM2 > 0:
        dk2 = gl.zeros([HALF_N, HEAD_DIM2], gl.float32, kv2_layout)
        dv2 = gl.zeros([HALF_N, HEAD_DIM2], gl.float32, kv2_layout)
    if SECOND_DQ:
        zero_dq2 = gl.zeros([DQ_TILE_ROWS, HEAD_DIM2], gl.float32, dq2_layout)
    sync = heads  # a value the named barrier passes along, which orders it among the products
    # the scale of the scores: the products', or 1 where the score function returns base-2 scores
    soft_scale = qk_scale
    if SCORE_MOD is not None:
        soft_scale = 1.0
    n = 0  # query tiles consumed so far: the ring's position
    mbarrier.wait(kv_ready, 0)
    for g in range(groups):
        h = kv_head * groups + g
        first, n_full, n_tiles, full_idx, part_idx = _column(
            b, h, kv_own, kv_end, q_len, FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, stride_num_b, stride_num_h,
            stride_num_n, stride_idx_b, stride_idx_h, stride_idx_n, MASK_KIND, BLOCK_M, SPARSE_BLOCK_M,
            SPARSE_BLOCK_N)
        keys = key_steps(b, h, (offs_kv - kv_first)[:, None], MODS, SCORE_KEYS)  # 0.0 without a linear key term
        for t in range(n_tiles):
            q_own = walk_tile_start(t, first, n_full, full_idx, part_idx, MASK_KIND, BLOCK_M, SPARSE_BLOCK_M)
            q_start = moved_back(q_own, q_len, BLOCK_M, RAGGED)
            stage = n % STAGES
            q = q_smem.index(stage)
            do = do_smem.index(stage)
            q2 = q2_smem.index(stage)
            do2 = do2_smem.index(stage)
            mbarrier.wait(q_ready.index(stage), (n // STAGES) & 1)
            s_t = issue_abt(my_keys, my_keys2, q, q2, zero_s, HEAD_DIM2)
            dp_t = issue_abt(my_values, my_values2, do, do2, zero_s, HEAD_DIM2)
            s_t = warpgroup_mma_wait(PARTS, deps=(s_t,))
            q_idx = (q_start + cols_q)[None, :]
            lse2 = lse_smem.index(stage).load(gl.SliceLayout(0, s_layout))
            p_t, d_score = _probabilities(s_t, lse2, t, n_full, b, h, q_start, q_own, q_idx, kv_start, kv_own, kv_end,
                                          offs_kv, kv_first, keys, qk_scale, soft_scale, MODS, MASK_KIND, RAGGED,
                                          IS_CAUSAL, MASK_MOD, SCORE_MOD, SCORE_KEYS, HAS_KEY_LENGTHS, BLOCK_N)
            p_op = gl.convert_layout(p_t.to(q.dtype), a_layout)
            dp_t = warpgroup_mma_wait(0, deps=(dp_t,))
            ds_t = p_t * (dp_t - delta_smem.index(stage).load(gl.SliceLayout(0, s_layout))[None, :])
            ds_t = (ds_t * d_score).to(q.dtype)  # the score function's derivative (1.0 without one)
            ds_tile = ds_smem.index(n % 2)
            ds_tile.slice(WG * HALF_N, HALF_N).store(ds_t)
            fence_async_shared()
            p2_op = 0.0
            if HEAD_DIM2 > 0:
                p2_op = gl.convert_layout(p_op, a2_layout)
            dv, dv2 = issue_pv(p_op, p2_op, do, do2, dv, dv2, HEAD_DIM2)
            # both halves of dS^T are in shared memory: the dQ product takes the barrier's value, so that it is issued
            # after it, and the second part's follows it in issue order (wgmmas keep their order)
            sync = named_sync(10, sync)
            ds_rows = ds_tile.slice(DQ_ROW, DQ_TILE_ROWS, dim=1).permute((1, 0))
            dq = warpgroup_mma(ds_rows, dq_keys, zero_dq + (sync * 0).to(gl.float32), use_acc=False, is_async=True)
            dq2 = 0.0
            if SECOND_DQ:
                dq2 = warpgroup_mma(ds_rows, k2_smem, zero_dq2, use_acc=False, is_async=True)
            if HEAD_DIM2 > 0:
                dv, dv2, p_op, p2_op = warpgroup_mma_wait(DQ_GROUPS, deps=(dv, dv2, p_op, p2_op))
            else:
                dv, p_op = warpgroup_mma_wait(DQ_GROUPS, deps=(dv, p_op))
            ds_op = gl.convert_layout(ds_t, a_layout)
            ds2_op = 0.0
            if HEAD_DIM2 > 0:
                ds2_op = gl.convert_layout(ds_op, a2_layout)
            dk, dk2 = issue_pv(ds_op, ds2_op, q, q2, dk, dk2, HEAD_DIM2)
            # dK's product runs under dQ's store
            if SECOND_DQ:
                dq, dq2 = warpgroup_mma_wait(PARTS, deps=(dq, dq2))
            else:
                dq = warpgroup_mma_wait(PARTS, deps=(dq,))
            # staged for the writer once its reduce of the tile before the last has read the buffer; every thread's
            # stores seen by TMA (the fence, then the warpgroup's barrier) before the arrival
            buffer = n % 2
            mbarrier.wait(dq_empty.index(WG * 2 + buffer), ((n // 2) - 1) & 1, pred=n >= 2)
            dq_smem.index(buffer).store(dq)
            if SECOND_DQ:
                dq2_smem.index(buffer).store(dq2)
            fence_async_shared()
            thread_barrier()
            mbarrier.arrive(dq_full.index(WG * 2 + buffer))
            if HEAD_DIM2 > 0:
                dk, dk2, ds_op, ds2_op = warpgroup_mma_wait(0, deps=(dk, dk2, ds_op, ds2_op))
            else:
                dk, ds_op = warpgroup_mma_wait(0, deps=(dk, ds_op))
            mbarrier.arrive(q_empty.index(stage))  # this warpgroup is done with Q and dO of the tile
            n += 1
    first_row = bk * kv_len + kv_start + WG * HALF_N
    own_row = bk * kv_len + kv_own
    # dK and dV go by TMA through buffers the walk no longer reads: dV through the warpgroup's half of V, which only
    # its own dP^T products read, dK through the first 64 rows of the ring's buffers of tile n - STAGES, which both
    # warpgroups have read (each gives a tile back before the named barrier of the next, which this one passed):
    # Q's for warpgroup 0, dO's for warpgroup 1 (none of them loaded where the walk has fewer tiles). Not at head
    # dim 48 (two parts, 128-query tiles), whose causal walk then spilled twice the bytes and ran 0.95-0.97x as fast,
    # nor on ragged lengths with a function, where both stores' code (one tile moved back) made ptxas spill in the
    # walk (hd64 with ALiBi: 34 spill instructions in a loop against 2, sm_90a)
    STAGED: gl.constexpr = (HEAD_DIM2 == 0 or BLOCK_M == HALF_N) and not (
        RAGGED and (MASK_MOD is not None or SCORE_MOD is not None))
    stage = n % STAGES
    if WG == 0:
        dk_smem = q_smem.index(stage).slice(0, HALF_N)
        dk2_smem = q2_smem.index(stage).slice(0, HALF_N)
    else:
        dk_smem = do_smem.index(stage).slice(0, HALF_N)
        dk2_smem = do2_smem.index(stage).slice(0, HALF_N)
    if not STAGED:
        _store_dk_dv_parts(DK, DV, dk, dv, dk2, dv2, first_row, own_row, scale, kv_layout, kv2_layout, HEAD_DIM,
                           HEAD_DIM2)
    elif RAGGED:  # the key tile moved back stores from registers only the keys it does not share with the one before
        # (two ifs: an if/else on this condition crashed Triton 3.6's lowering to LLVM)
        if kv_start == kv_own:
            _store_dk_dv_staged(dk_desc, dk2_desc, dv_desc, dv2_desc, dk, dk2, dv, dv2, dk_smem, dk2_smem, my_values,
                                my_values2, first_row, scale, HEAD_DIM, HEAD_DIM2)
        if kv_start != kv_own:
            _store_dk_dv_parts(DK, DV, dk, dv, dk2, dv2, first_row, own_row, scale, kv_layout, kv2_layout, HEAD_DIM,
                               HEAD_DIM2)
    else:
        _store_dk_dv_staged(dk_desc, dk2_desc, dv_desc, dv2_desc, dk, dk2, dv, dv2, dk_smem, dk2_smem, my_values,
                            my_values2, first_row, scale, HEAD_DIM, HEAD_DIM2)


@gluon.jit
def _add_dq_tiles(dq_desc, dq2_desc, dq_smem, dq2_smem, row, WG: gl.constexpr, BLOCK_M: gl.constexpr,
                  HEAD_DIM: gl.constexpr, HEAD_DIM2: gl.constexpr):
    """Add warpgroup WG's staged dQ tile(s) (dq_smem, dq2_smem: one buffer each) of the query tile at accumulator row
    ``row`` by TMA reduce-add (``_dq_descriptors``): with query tiles of two dQ tiles' rows, rows [64 WG, 64 WG + 64)
    of the first part's columns and of the second's (dq2_desc, HEAD_DIM on); else with a second part, warpgroup 0 the
    first part's columns and 1 the second's; else warpgroup WG half of the columns."""
    DQ_TILE_ROWS: gl.constexpr = dq_smem.type.shape[0]
    DQ_COLUMNS: gl.constexpr = dq_smem.type.shape[1]
    if BLOCK_M == 2 * DQ_TILE_ROWS:
        tma_reduce_add(dq_desc, [row + WG * DQ_TILE_ROWS, 0], dq_smem)
        if HEAD_DIM2 > 0:
            tma_reduce_add(dq2_desc, [row + WG * DQ_TILE_ROWS, HEAD_DIM], dq2_smem)
    elif HEAD_DIM2 > 0 and WG == 1:
        tma_reduce_add(dq2_desc, [row, HEAD_DIM], dq_smem)
    else:
        tma_reduce_add(dq_desc, [row, WG * DQ_COLUMNS], dq_smem)


@gluon.jit
def _dq_writer(dq_desc, dq2_desc, dq_smem0, dq2_smem0, dq_smem1, dq2_smem1, dq_full, dq_empty, FULL_NUM, FULL_IDX,
               PART_NUM, PART_IDX, KEY_LENGTHS, stride_num_b, stride_num_h, stride_num_n, stride_idx_b, stride_idx_h,
               stride_idx_n, heads, groups, q_len, kv_len, MASK_KIND: gl.constexpr, RAGGED: gl.constexpr,
               HAS_KEY_LENGTHS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               SPARSE_BLOCK_M: gl.constexpr, SPARSE_BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
               HEAD_DIM2: gl.constexpr):
    """The program's walk as the consumers take it: each query tile's dQ tiles, as each consumer staged them
    (dq_full: dq_smemW / dq2_smemW's buffer n % 2 for tile n), added into the accumulator (``_add_dq_tiles``), and
    the buffers given back (dq_empty) once TMA has read them."""
    _, b, kv_head, kv_start, kv_own, kv_end = _program_tile(heads, groups, kv_len, KEY_LENGTHS, BLOCK_N, RAGGED,
                                                            HAS_KEY_LENGTHS)
    n = 0  # query tiles added so far
    for g in range(groups):
        h = kv_head * groups + g
        first, n_full, n_tiles, full_idx, part_idx = _column(
            b, h, kv_own, kv_end, q_len, FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, stride_num_b, stride_num_h,
            stride_num_n, stride_idx_b, stride_idx_h, stride_idx_n, MASK_KIND, BLOCK_M, SPARSE_BLOCK_M,
            SPARSE_BLOCK_N)
        for t in range(n_tiles):
            q_own = walk_tile_start(t, first, n_full, full_idx, part_idx, MASK_KIND, BLOCK_M, SPARSE_BLOCK_M)
            q_start = moved_back(q_own, q_len, BLOCK_M, RAGGED)
            row = (b * heads + h) * q_len + q_start
            buffer = n % 2
            mbarrier.wait(dq_full.index(buffer), (n // 2) & 1)
            _add_dq_tiles(dq_desc, dq2_desc, dq_smem0.index(buffer), dq2_smem0.index(buffer), row, 0, BLOCK_M,
                          HEAD_DIM, HEAD_DIM2)
            mbarrier.wait(dq_full.index(2 + buffer), (n // 2) & 1)
            _add_dq_tiles(dq_desc, dq2_desc, dq_smem1.index(buffer), dq2_smem1.index(buffer), row, 1, BLOCK_M,
                          HEAD_DIM, HEAD_DIM2)
            tma.store_wait(0)
            mbarrier.arrive(dq_empty.index(buffer))
            mbarrier.arrive(dq_empty.index(2 + buffer))
            n += 1


@gluon.jit(do_not_specialize=["q_len", "kv_len", "stats_stride", *TABLE_STRIDE_ARGS])
def _attn_bwd_gluon(q_desc, k_desc, v_desc, do_desc, q2_desc, k2_desc, v2_desc, do2_desc, dq_desc, dq2_desc, lse_desc,
                    delta_desc, DK, DV, dk_desc, dk2_desc, dv_desc, dv2_desc, FULL_NUM, FULL_IDX, PART_NUM, PART_IDX,
                    KEY_LENGTHS, MODS, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb,
                    stride_vh, stride_vn, stride_dob, stride_doh, stride_dom, stride_num_b, stride_num_h, stride_num_n,
                    stride_idx_b, stride_idx_h, stride_idx_n, heads, groups, q_len, kv_len, stats_stride, qk_scale,
                    scale, MASK_KIND: gl.constexpr, RAGGED: gl.constexpr, IS_CAUSAL: gl.constexpr,
                    MASK_MOD: gl.constexpr, SCORE_MOD: gl.constexpr, SCORE_KEYS: gl.constexpr,
                    HAS_KEY_LENGTHS: gl.constexpr, SPARSE_BLOCK_M: gl.constexpr, SPARSE_BLOCK_N: gl.constexpr,
                    HEAD_DIM: gl.constexpr, HEAD_DIM2: gl.constexpr, STAGES: gl.constexpr):
    """One program per (batch, key/value head, 128-key tile) (``_program_tile``). q/k/v/do_desc read Q, K, V,
    dO as ``row_view`` matrices in boxes of HEAD_DIM columns, K and V in 64-row boxes, Q and dO in BLOCK_M-row
    ones; q2/k2/v2/do2_desc the HEAD_DIM2 columns after them (the same descriptors, unused, without a second
    part); dq_desc and dq2_desc the fp32 dQ accumulator (B * H * q_len, HEAD_DIM + HEAD_DIM2) in the boxes of
    the consumers' dQ tiles (``_dq_descriptors``); lse_desc and delta_desc lse2 and delta (B * H * stats_stride,
    from the preprocess) in boxes of BLOCK_M; DK, DV (B, key/value heads, kv_len, HEAD_DIM + HEAD_DIM2) contiguous,
    dk_desc and dv_desc over them as B * key/value heads * kv_len rows in 64-row boxes of HEAD_DIM columns, dk2_desc
    and dv2_desc of HEAD_DIM2 (``_store_dk_dv_staged``; the first part's again without a second); KEY_LENGTHS (B,)
    int32 with HAS_KEY_LENGTHS (a placeholder without)."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = 2 * k_desc.block_type.shape[0]
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], delta_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [BLOCK_N, HEAD_DIM], v_desc.layout)
    if HEAD_DIM2 > 0:
        q2_smem = gl.allocate_shared_memory(q2_desc.dtype, [STAGES, BLOCK_M, HEAD_DIM2], q2_desc.layout)
        do2_smem = gl.allocate_shared_memory(do2_desc.dtype, [STAGES, BLOCK_M, HEAD_DIM2], do2_desc.layout)
        k2_smem = gl.allocate_shared_memory(k2_desc.dtype, [BLOCK_N, HEAD_DIM2], k2_desc.layout)
        v2_smem = gl.allocate_shared_memory(v2_desc.dtype, [BLOCK_N, HEAD_DIM2], v2_desc.layout)
    else:  # no second part: its buffers are the first's, which nothing reads as theirs
        q2_smem = q_smem
        do2_smem = do_smem
        k2_smem = k_smem
        v2_smem = v_smem
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], q_desc.dtype)
    ds_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    # the consumers' dQ staging buffers (``_dq_descriptors``), two each, so that a consumer stages a tile's dQ while
    # the writer's reduce of the last still reads the other: warpgroup 1 stages the second part's tile where it takes
    # that part (query tiles of 64 rows, a head dim in two parts), each stages both parts' at 128 rows
    DQ_BOX: gl.constexpr = dq_desc.block_type.shape
    DQ2_BOX: gl.constexpr = dq2_desc.block_type.shape
    dq_smem0 = gl.allocate_shared_memory(gl.float32, [2, DQ_BOX[0], DQ_BOX[1]], dq_desc.layout)
    if BLOCK_M == 64 and HEAD_DIM2 > 0:
        dq_smem1 = gl.allocate_shared_memory(gl.float32, [2, DQ2_BOX[0], DQ2_BOX[1]], dq2_desc.layout)
    else:
        dq_smem1 = gl.allocate_shared_memory(gl.float32, [2, DQ_BOX[0], DQ_BOX[1]], dq_desc.layout)
    if BLOCK_M == 128 and HEAD_DIM2 > 0:
        dq2_smem0 = gl.allocate_shared_memory(gl.float32, [2, DQ2_BOX[0], DQ2_BOX[1]], dq2_desc.layout)
        dq2_smem1 = gl.allocate_shared_memory(gl.float32, [2, DQ2_BOX[0], DQ2_BOX[1]], dq2_desc.layout)
    else:  # no second dQ tile: the first's buffers, unused as the second's
        dq2_smem0 = dq_smem0
        dq2_smem1 = dq_smem1
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # a staging buffer's: consumer WG's buffer i at WG * 2 + i
    dq_full = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # one arrival per consumer warpgroup
    for i in gl.static_range(4):
        mbarrier.init(dq_full.index(i), count=1)  # the consumer's arrival
        mbarrier.init(dq_empty.index(i), count=1)  # the writer's

    # constexprs are passed to the partitions inline: a tuple variable holding them loses their constness
    gl.warp_specialize([
        (_consumer, (q_smem, do_smem, q2_smem, do2_smem, lse_smem, delta_smem, k_smem, v_smem, k2_smem, v2_smem,
                     ds_smem, dq_smem0, dq2_smem0, kv_ready, q_ready, q_empty, dq_full, dq_empty, DK, DV, dk_desc,
                     dk2_desc, dv_desc, dv2_desc, FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, KEY_LENGTHS, MODS,
                     stride_num_b, stride_num_h, stride_num_n, stride_idx_b, stride_idx_h, stride_idx_n, heads, groups,
                     q_len, kv_len, qk_scale, scale, 0, MASK_KIND, RAGGED, IS_CAUSAL, MASK_MOD, SCORE_MOD, SCORE_KEYS,
                     HAS_KEY_LENGTHS, BLOCK_N, SPARSE_BLOCK_M, SPARSE_BLOCK_N, HEAD_DIM, HEAD_DIM2, STAGES)),
        (_consumer, (q_smem, do_smem, q2_smem, do2_smem, lse_smem, delta_smem, k_smem, v_smem, k2_smem, v2_smem,
                     ds_smem, dq_smem1, dq2_smem1, kv_ready, q_ready, q_empty, dq_full, dq_empty, DK, DV, dk_desc,
                     dk2_desc, dv_desc, dv2_desc, FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, KEY_LENGTHS, MODS,
                     stride_num_b, stride_num_h, stride_num_n, stride_idx_b, stride_idx_h, stride_idx_n, heads, groups,
                     q_len, kv_len, qk_scale, scale, 1, MASK_KIND, RAGGED, IS_CAUSAL, MASK_MOD, SCORE_MOD, SCORE_KEYS,
                     HAS_KEY_LENGTHS, BLOCK_N, SPARSE_BLOCK_M, SPARSE_BLOCK_N, HEAD_DIM, HEAD_DIM2, STAGES)),
        (_producer, (q_desc, k_desc, v_desc, do_desc, q2_desc, k2_desc, v2_desc, do2_desc, lse_desc, delta_desc, q_smem,
                     do_smem, q2_smem, do2_smem, lse_smem, delta_smem, k_smem, v_smem, k2_smem, v2_smem, kv_ready,
                     q_ready, q_empty, q_ready, q_empty, FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, KEY_LENGTHS, stride_qb,
                     stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_dob,
                     stride_doh, stride_dom, stride_num_b, stride_num_h, stride_num_n, stride_idx_b, stride_idx_h,
                     stride_idx_n, heads, groups, q_len, kv_len, stats_stride, MASK_KIND, RAGGED, HAS_KEY_LENGTHS,
                     BLOCK_N, SPARSE_BLOCK_M, SPARSE_BLOCK_N, HEAD_DIM2, STAGES, 0)),
        (_dq_writer, (dq_desc, dq2_desc, dq_smem0, dq2_smem0, dq_smem1, dq2_smem1, dq_full, dq_empty, FULL_NUM,
                      FULL_IDX, PART_NUM, PART_IDX, KEY_LENGTHS, stride_num_b, stride_num_h, stride_num_n, stride_idx_b,
                      stride_idx_h, stride_idx_n, heads, groups, q_len, kv_len, MASK_KIND, RAGGED, HAS_KEY_LENGTHS,
                      BLOCK_M, BLOCK_N, SPARSE_BLOCK_M, SPARSE_BLOCK_N, HEAD_DIM, HEAD_DIM2)),
    # registers a thread: the consumers' dK, dV and tiles take 240, the producer's loads and the dQ writer's adds 24.
    # The producer is one warp for DENSE and CAUSAL, as the forward's (dense rows 1.03x as fast from S=16384 on an
    # H100, the rest within the spread), two for SPARSE, whose rows at head dim 64 ran 0.95-0.96x as fast with one
    # (H100). Four, as before the writer, would pad the kernel to four warpgroups and leave the first consumer 224
    # registers (its spills at head dim 64 with a mask function: 1,436 bytes, against 1,192 with two); two ran the
    # random 25 % rows 0.95-1.00x the time of four without the writer (H200)
    ], [4, 2 if MASK_KIND == 2 else 1, 1], [240, 24, 24])


@gluon.jit
def _consumer_wide(q_smem, do_smem, q2_smem, do2_smem, lse_smem, delta_smem, k_smem, v_smem, k2_smem, v2_smem, p_smem,
                   ds_smem, dq_smem, kv_ready, q_ready, q_empty, do_ready, do_empty, dq_desc, DK, DV, FULL_NUM,
                   FULL_IDX, PART_NUM, PART_IDX, KEY_LENGTHS, MODS, stride_num_b, stride_num_h, stride_num_n,
                   stride_idx_b, stride_idx_h, stride_idx_n, heads, groups, q_len, kv_len, qk_scale, scale,
                   WG: gl.constexpr, MASK_KIND: gl.constexpr, RAGGED: gl.constexpr, IS_CAUSAL: gl.constexpr,
                   MASK_MOD: gl.constexpr, SCORE_MOD: gl.constexpr, SCORE_KEYS: gl.constexpr,
                   HAS_KEY_LENGTHS: gl.constexpr, BLOCK_N: gl.constexpr,
                   SPARSE_BLOCK_M: gl.constexpr, SPARSE_BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                   HEAD_DIM2: gl.constexpr, STAGES: gl.constexpr, DO_STAGES: gl.constexpr):
    """Head dims 160-256 (``_attn_bwd_gluon_wide``): every key of the program's tile, and the columns of part WG
    (the first HEAD_DIM, or the HEAD_DIM2 after them): S^T and dP^T of query rows [WG * BLOCK_M / 2, ...) over
    the whole head dim, P and dS to shared memory, then its columns of dV, dK (stored at the end; DK, DV:
    (B, key/value heads, kv_len, HEAD_DIM + HEAD_DIM2) contiguous) and of each tile's dQ (dq_desc: its part's
    boxes, a chunk each), staged in dq_smem's buffers in turn. Q and lse2 in a ring of STAGES buffers, dO and delta
    in one of DO_STAGES, released after dV's product."""
    BLOCK_M: gl.constexpr = q_smem.type.shape[1]
    HALF_M: gl.constexpr = BLOCK_M // 2
    COLUMNS: gl.constexpr = HEAD_DIM if WG == 0 else HEAD_DIM2  # the warpgroup's columns of dK, dV and dQ
    FIRST_COLUMN: gl.constexpr = WG * HEAD_DIM
    # dQ in chunks of at most 64 columns, one product and TMA reduce-add each: beside dK and dV (128 registers a
    # thread at 128 columns) a dQ of 128 columns (64 more) spilled
    CHUNK: gl.constexpr = dq_smem.type.shape[2]
    DQ_CHUNKS: gl.constexpr = COLUMNS // CHUNK
    DQ_BUFFERS: gl.constexpr = dq_smem.type.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, COLUMNS, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, CHUNK, 16])
    if WG == 0:
        my_q = q_smem
        my_do = do_smem
        my_keys = k_smem
    else:
        my_q = q2_smem
        my_do = do2_smem
        my_keys = k2_smem
    bk, b, kv_head, kv_start, kv_own, kv_end = _program_tile(heads, groups, kv_len, KEY_LENGTHS, BLOCK_N, RAGGED,
                                                             HAS_KEY_LENGTHS)
    offs_kv = kv_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    cols_q = WG * HALF_M + gl.arange(0, HALF_M, layout=gl.SliceLayout(0, s_layout))
    zero_s = gl.zeros([BLOCK_N, HALF_M], gl.float32, s_layout)
    zero_dq = gl.zeros([BLOCK_M, CHUNK], gl.float32, dq_layout)
    dk = gl.zeros([BLOCK_N, COLUMNS], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, COLUMNS], gl.float32, acc_layout)
    sync = heads  # a value the named barrier passes along, which orders it among the products
    soft_scale = qk_scale
    if SCORE_MOD is not None:
        soft_scale = 1.0
    n = 0  # query tiles consumed so far: the ring's position
    mbarrier.wait(kv_ready, 0)
    for g in range(groups):
        h = kv_head * groups + g
        first, n_full, n_tiles, full_idx, part_idx = _column(
            b, h, kv_own, kv_end, q_len, FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, stride_num_b, stride_num_h,
            stride_num_n, stride_idx_b, stride_idx_h, stride_idx_n, MASK_KIND, BLOCK_M, SPARSE_BLOCK_M,
            SPARSE_BLOCK_N)
        bh = b * heads + h
        keys = key_steps(b, h, (offs_kv - kv_start)[:, None], MODS, SCORE_KEYS)  # 0.0 without a linear key term
        for t in range(n_tiles):
            q_own = walk_tile_start(t, first, n_full, full_idx, part_idx, MASK_KIND, BLOCK_M, SPARSE_BLOCK_M)
            q_start = moved_back(q_own, q_len, BLOCK_M, RAGGED)
            stage = ring_index(n, STAGES)
            do_stage = ring_index(n, DO_STAGES)
            mbarrier.wait(q_ready.index(stage), (n // STAGES) & 1)
            # S^T and dP^T of the warpgroup's half of the queries, over both parts of the head dim
            s_t = issue_abt(k_smem, k2_smem, q_smem.index(stage).slice(WG * HALF_M, HALF_M),
                            q2_smem.index(stage).slice(WG * HALF_M, HALF_M), zero_s, HEAD_DIM2)
            mbarrier.wait(do_ready.index(do_stage), (n // DO_STAGES) & 1)
            dp_t = issue_abt(v_smem, v2_smem, do_smem.index(do_stage).slice(WG * HALF_M, HALF_M),
                             do2_smem.index(do_stage).slice(WG * HALF_M, HALF_M), zero_s, HEAD_DIM2)
            s_t = warpgroup_mma_wait(2, deps=(s_t,))
            q_idx = (q_start + cols_q)[None, :]
            lse2 = lse_smem.index(stage).slice(WG * HALF_M, HALF_M).load(gl.SliceLayout(0, s_layout))
            p_t, d_score = _probabilities(s_t, lse2, t, n_full, b, h, q_start, q_own, q_idx, kv_start, kv_own, kv_end,
                                          offs_kv, kv_start, keys, qk_scale, soft_scale, MODS, MASK_KIND, RAGGED,
                                          IS_CAUSAL, MASK_MOD, SCORE_MOD, SCORE_KEYS, HAS_KEY_LENGTHS, BLOCK_N)
            dp_t = warpgroup_mma_wait(0, deps=(dp_t,))
            delta = delta_smem.index(do_stage).slice(WG * HALF_M, HALF_M).load(gl.SliceLayout(0, s_layout))
            ds_t = (p_t * (dp_t - delta[None, :]) * d_score).to(my_q.dtype)
            # P and dS (queries x keys) of this tile: the warpgroup's rows; a buffer is rewritten two tiles on, after
            # the next tile's barrier, which the other warpgroup passes only once its products of this one are done
            p_tile = p_smem.index(n % 2)
            ds_tile = ds_smem.index(n % 2)
            p_tile.slice(WG * HALF_M, HALF_M).permute((1, 0)).store(p_t.to(my_q.dtype))
            ds_tile.slice(WG * HALF_M, HALF_M).permute((1, 0)).store(ds_t)
            fence_async_shared()
            # both warpgroups' rows of P and dS are in shared memory: dQ's product takes the barrier's value, dV's
            # and dK's follow it in issue order (wgmmas keep their order)
            sync = named_sync(10, sync)
            dq = warpgroup_mma(ds_tile, my_keys.slice(0, CHUNK, dim=1), zero_dq + (sync * 0).to(gl.float32),
                               use_acc=False, is_async=True)
            dv = warpgroup_mma(p_tile.permute((1, 0)), my_do.index(do_stage), dv, is_async=True)
            dk = warpgroup_mma(ds_tile.permute((1, 0)), my_q.index(stage), dk, is_async=True)
            # dK's product runs under dQ's first chunk's store; with dV's done, the next tile's dO may load
            dq, dv = warpgroup_mma_wait(1, deps=(dq, dv))
            mbarrier.arrive(do_empty.index(do_stage))
            dq_row = bh * q_len + q_start
            for chunk in gl.static_range(DQ_CHUNKS):  # (the wait for a later chunk's product waits for dK's)
                if chunk > 0:
                    dq = warpgroup_mma(ds_tile, my_keys.slice(chunk * CHUNK, CHUNK, dim=1), zero_dq, use_acc=False,
                                       is_async=True)
                    dq = warpgroup_mma_wait(0, deps=(dq,))
                if chunk % DQ_BUFFERS == 0:  # the reduces from the buffers (the last tile's at chunk 0) have read them
                    tma.store_wait(0)
                dq_smem.index(chunk % DQ_BUFFERS).store(dq)
                fence_async_shared()
                tma_reduce_add(dq_desc, [dq_row, FIRST_COLUMN + chunk * CHUNK], dq_smem.index(chunk % DQ_BUFFERS))
            dk = warpgroup_mma_wait(0, deps=(dk,))
            mbarrier.arrive(q_empty.index(stage))  # this warpgroup is done with Q of the tile
            n += 1
    _store_dk_dv(DK, DV, dk, dv, bk * kv_len + kv_start, bk * kv_len + kv_own, FIRST_COLUMN, HEAD_DIM + HEAD_DIM2,
                 scale, acc_layout)
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["q_len", "kv_len", "stats_stride", *TABLE_STRIDE_ARGS])
def _attn_bwd_gluon_wide(q_desc, k_desc, v_desc, do_desc, q2_desc, k2_desc, v2_desc, do2_desc, dq_desc, dq2_desc,
                         lse_desc, delta_desc, DK, DV, dk_desc, dk2_desc, dv_desc, dv2_desc, FULL_NUM, FULL_IDX,
                         PART_NUM, PART_IDX, KEY_LENGTHS, MODS, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh,
                         stride_kn, stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom, stride_num_b,
                         stride_num_h, stride_num_n, stride_idx_b, stride_idx_h, stride_idx_n, heads, groups, q_len,
                         kv_len, stats_stride, qk_scale, scale, MASK_KIND: gl.constexpr, RAGGED: gl.constexpr,
                         IS_CAUSAL: gl.constexpr, MASK_MOD: gl.constexpr, SCORE_MOD: gl.constexpr,
                         SCORE_KEYS: gl.constexpr, HAS_KEY_LENGTHS: gl.constexpr, SPARSE_BLOCK_M: gl.constexpr,
                         SPARSE_BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM2: gl.constexpr,
                         STAGES: gl.constexpr, DO_STAGES: gl.constexpr, DQ_BUFFERS: gl.constexpr):
    """The backward at head dims 160-256: one program per (batch, key/value head, 64-key tile), the arguments
    as ``_attn_bwd_gluon``'s with K and V in boxes of the whole tile, always two parts (``WIDE``; dk_desc to
    dv2_desc unused: dK and dV go from registers), and dq_desc, dq2_desc in boxes of at most 64 columns: dK and dV of
    64 keys x 160-256 columns do not fit one warpgroup's registers, so warpgroup w holds the columns of part w
    (``_consumer_wide``), and S^T, dP^T of half the queries each, exchanged through shared memory as P and dS. Q and
    lse2 in a ring of STAGES buffers, dO and delta in one of DO_STAGES; DQ_BUFFERS: a warpgroup's dQ staging buffers
    at most."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    q2_smem = gl.allocate_shared_memory(q2_desc.dtype, [STAGES, BLOCK_M, HEAD_DIM2], q2_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [DO_STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    do2_smem = gl.allocate_shared_memory(do2_desc.dtype, [DO_STAGES, BLOCK_M, HEAD_DIM2], do2_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [DO_STAGES, BLOCK_M], delta_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [BLOCK_N, HEAD_DIM], k_desc.layout)
    k2_smem = gl.allocate_shared_memory(k2_desc.dtype, [BLOCK_N, HEAD_DIM2], k2_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [BLOCK_N, HEAD_DIM], v_desc.layout)
    v2_smem = gl.allocate_shared_memory(v2_desc.dtype, [BLOCK_N, HEAD_DIM2], v2_desc.layout)
    pds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], q_desc.dtype)
    p_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_M, BLOCK_N], pds_layout)
    ds_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_M, BLOCK_N], pds_layout)
    # a warpgroup's dQ staging buffers: a chunk of its part's columns each (dq_desc's and dq2_desc's boxes), at
    # most DQ_BUFFERS
    CHUNK: gl.constexpr = dq_desc.block_type.shape[1]
    CHUNK2: gl.constexpr = dq2_desc.block_type.shape[1]
    dq_smem0 = gl.allocate_shared_memory(gl.float32, [min(HEAD_DIM // CHUNK, DQ_BUFFERS), BLOCK_M, CHUNK],
                                         dq_desc.layout)
    dq_smem1 = gl.allocate_shared_memory(gl.float32, [min(HEAD_DIM2 // CHUNK2, DQ_BUFFERS), BLOCK_M, CHUNK2],
                                         dq2_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [DO_STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [DO_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # one arrival per consumer warpgroup
    for i in gl.static_range(DO_STAGES):
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(do_empty.index(i), count=2)

    gl.warp_specialize([
        (_consumer_wide, (q_smem, do_smem, q2_smem, do2_smem, lse_smem, delta_smem, k_smem, v_smem, k2_smem, v2_smem,
                          p_smem, ds_smem, dq_smem0, kv_ready, q_ready, q_empty, do_ready, do_empty, dq_desc, DK, DV,
                          FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, KEY_LENGTHS, MODS, stride_num_b, stride_num_h,
                          stride_num_n, stride_idx_b, stride_idx_h, stride_idx_n, heads, groups, q_len, kv_len,
                          qk_scale, scale, 0, MASK_KIND, RAGGED, IS_CAUSAL, MASK_MOD, SCORE_MOD, SCORE_KEYS,
                          HAS_KEY_LENGTHS, BLOCK_N, SPARSE_BLOCK_M,
                          SPARSE_BLOCK_N, HEAD_DIM, HEAD_DIM2, STAGES, DO_STAGES)),
        (_consumer_wide, (q_smem, do_smem, q2_smem, do2_smem, lse_smem, delta_smem, k_smem, v_smem, k2_smem, v2_smem,
                          p_smem, ds_smem, dq_smem1, kv_ready, q_ready, q_empty, do_ready, do_empty, dq2_desc, DK, DV,
                          FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, KEY_LENGTHS, MODS, stride_num_b, stride_num_h,
                          stride_num_n, stride_idx_b, stride_idx_h, stride_idx_n, heads, groups, q_len, kv_len,
                          qk_scale, scale, 1, MASK_KIND, RAGGED, IS_CAUSAL, MASK_MOD, SCORE_MOD, SCORE_KEYS,
                          HAS_KEY_LENGTHS, BLOCK_N, SPARSE_BLOCK_M,
                          SPARSE_BLOCK_N, HEAD_DIM, HEAD_DIM2, STAGES, DO_STAGES)),
        (_producer, (q_desc, k_desc, v_desc, do_desc, q2_desc, k2_desc, v2_desc, do2_desc, lse_desc, delta_desc, q_smem,
                     do_smem, q2_smem, do2_smem, lse_smem, delta_smem, k_smem, v_smem, k2_smem, v2_smem, kv_ready,
                     q_ready, q_empty, do_ready, do_empty, FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, KEY_LENGTHS,
                     stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                     stride_dob, stride_doh, stride_dom, stride_num_b, stride_num_h, stride_num_n, stride_idx_b,
                     stride_idx_h, stride_idx_n, heads, groups, q_len, kv_len, stats_stride, MASK_KIND, RAGGED,
                     HAS_KEY_LENGTHS, BLOCK_N, SPARSE_BLOCK_M, SPARSE_BLOCK_N, HEAD_DIM2, STAGES, DO_STAGES)),
    ], [4, 4 if MASK_KIND == 2 else 1], [240, 24])


@triton.jit
def _lse2_less_rows(LSE2, MODS, heads, q_len, kv_len, stats_stride, SCORE_ROW: tl.constexpr, BLOCK: tl.constexpr,
                    TILE: tl.constexpr):
    """lse2 (B * H, stats_stride) less the row terms of a separable score function (``tiles.row_term``) at the
    reference query of each TILE-row query tile, its first, as the backward's scores are taken: in place, once
    per call, so that the backward's tiles subtract only lse2."""
    bh = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ptrs = LSE2 + bh * stats_stride + offs
    lse2 = tl.load(ptrs, mask=offs < q_len)
    rows = tl.minimum(offs, q_len - 1)  # a captured table of q_len entries is read within it (rows past go unstored)
    lse2 -= row_term(bh // heads, bh % heads, rows, rows - rows % TILE, kv_len, MODS, SCORE_ROW)
    tl.store(ptrs, lse2, mask=offs < q_len)


# ---------------------------------------------------------------------------------- when it applies
def applies(q: torch.Tensor, k: torch.Tensor, mask, row_keys: float, dropout: bool, trains_captures: bool) -> bool:
    """Whether calls with these inputs and mask take this backward (on a GPU ``launch.gluon_hopper``
    admits): ``gluon_tools.takes`` them, no tensor a score function captures takes a gradient
    (``trains_captures``: this kernel computes none), and with "auto", rows of ``row_keys`` keys on average,
    at least AUTO_ROW_KEYS's. The layouts are checked at launch."""
    return not trains_captures and gluon_tools.chosen(q, k, mask, TILES, row_keys,
                                                      AUTO_ROW_KEYS.get(q.shape[3], math.inf), dropout,
                                                      ragged=(True, True))


# ---------------------------------------------------------------------------------- launcher
BACKWARD_GLUON = Launcher(_attn_bwd_gluon)
BACKWARD_GLUON_WIDE = Launcher(_attn_bwd_gluon_wide)
LSE2_LESS_ROWS = Launcher(_lse2_less_rows)
ROWS_BLOCK = 128  # rows of lse2 a program of _lse2_less_rows takes


def _rows_off(plan, lse2, mods: torch.Tensor, stats_stride: int, block_m: int, ahead: bool) -> None:
    """Take the score function's row terms off ``lse2`` (``_lse2_less_rows``; ``ahead``: only compile)."""
    (LSE2_LESS_ROWS.compile_ahead if ahead else LSE2_LESS_ROWS)(
        (cdiv(plan.q_len, ROWS_BLOCK), plan.batch * plan.heads), (lse2, mods),
        (plan.heads, plan.q_len, plan.kv_len, stats_stride), dict(SCORE_ROW=plan.score_row, BLOCK=ROWS_BLOCK,
                                                                  TILE=block_m))


def _dq_descriptors(dq_acc: torch.Tensor, parts: tuple[int, int], block_m: int) -> tuple[TensorDescriptor,
                                                                                         TensorDescriptor]:
    """The descriptors over dQ's fp32 accumulator (rows, head dim) of the consumers' dQ tiles of DQ_ROWS query
    rows, (dq_desc, dq2_desc): with query tiles of 2 x DQ_ROWS rows (head dims 48 and 64) each warpgroup adds its
    half of the rows, a tile a part of the head dim (``plan.head_dim_parts``: the first's columns, then the
    second's); with tiles of DQ_ROWS rows every row, warpgroup 0 the first part's columns and 1 the second's (at
    160-256 in chunks of at most 64 columns, a box each), or half the columns each at a power of two (128).
    Boxes of fp32 rows of 128 bytes a swizzle atom where they are that wide: TMA reduces at ~1.8x the rate of
    unswizzled boxes (H100)."""
    first, second = parts
    rows, head_dim = dq_acc.shape
    if head_dim in WIDE:  # chunks of at most 64 columns (``_consumer_wide``)
        widths = (min(first, 64), min(second, 64))
    elif second:
        widths = (first, second)
    else:
        widths = (first if block_m == 2 * DQ_ROWS else first // 2,) * 2
    boxes = {width: TensorDescriptor(dq_acc, [rows, head_dim], [head_dim, 1], [DQ_ROWS, width],
                                     gluon_tools.shared_layout(DQ_ROWS, width, torch.float32))
             for width in set(widths)}  # one descriptor where both tiles' boxes agree: a launch's host time
    return boxes[widths[0]], boxes[widths[1]]


@functools.lru_cache(maxsize=None)
def _stats_layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)


def _stats(x: torch.Tensor, block_m: int) -> TensorDescriptor:
    """A TMA descriptor of block_m-row boxes over lse2 or delta (B * H, stats_stride), seen flat."""
    return TensorDescriptor(x, [x.numel()], [1], [block_m], _stats_layout())


@functools.lru_cache(maxsize=None)
def _constexprs(mask_kind: int, ragged: bool, causal: bool, sparse_block: tuple[int, int], parts: tuple[int, int],
                mods: tuple, key_lengths: bool) -> dict:
    mask_mod, score_mod, score_keys = mods
    return dict(MASK_KIND=mask_kind, RAGGED=ragged, IS_CAUSAL=causal, MASK_MOD=mask_mod, SCORE_MOD=score_mod,
                SCORE_KEYS=score_keys, HAS_KEY_LENGTHS=key_lengths,
                SPARSE_BLOCK_M=sparse_block[0], SPARSE_BLOCK_N=sparse_block[1],
                HEAD_DIM=parts[0], HEAD_DIM2=parts[1], STAGES=STAGES, num_warps=4,
                **dict(zip(("DO_STAGES", "DQ_BUFFERS"), WIDE_BUFFERS.get(sum(parts), ()))))


def accumulator(plan, q: torch.Tensor, ahead: bool = False) -> torch.Tensor | Standin:
    """dQ's fp32 accumulator (B * H * q_len, head dim), not zeroed (the preprocess zeroes it: ``backward._preprocess``):
    ``launch`` adds dQ into it, ``finish`` makes dq of it. The caller makes it, so that the launches read only the
    call's tensors (``replay.py``); ``ahead``: a ``Standin`` of it, for compiling ahead."""
    shape = (plan.batch * plan.heads * plan.q_len, q.shape[3])
    return Standin(torch.float32, shape) if ahead else torch.empty(shape, dtype=torch.float32, device=q.device)


def launch(plan, q, k, v, do, lse2, delta, dq_acc, dk, dv, key_lengths: torch.Tensor, mods: torch.Tensor,
           stats_stride: int, ahead: bool = False) -> bool:
    """Add dQ into ``dq_acc`` (``accumulator``) and compute dk, dv (contiguous) on a problem ``applies`` admits, from
    ``lse2`` and ``delta`` of the preprocess, less the score function's row terms (``_lse2_less_rows``, in place),
    ``key_lengths`` as ``plan.key_lengths_arg`` gives it, and the plan's MODS table ``mods`` (``ahead``: only compile,
    with ``Standin``s for do and all past it: a contiguous do, as the usual loss gives); do is read from a fresh
    contiguous copy where TMA cannot read its layout. False (nothing launched) where TMA cannot read one of q, k, v's
    layouts, or where torch is asked for deterministic algorithms (``torch.use_deterministic_algorithms``): dQ's TMA
    adds land in any order, so its last bits vary from run to run, and the Triton backward's do not."""
    prepared = _arguments(plan, q, k, v, do, None if ahead else (lse2, delta), dq_acc, dk, dv, key_lengths, mods,
                          stats_stride)
    if prepared is None:
        return False
    kernel, arguments = prepared
    if plan.score_row is not None:
        _rows_off(plan, lse2, mods, stats_stride, BLOCK_M[q.shape[3]], ahead)
    (kernel.compile_ahead if ahead else kernel)(*arguments)
    return True


@triton.jit
def _dq_of_accumulator(DQ_ACC, DQ, n, scale, BLOCK: tl.constexpr):
    """dq = scale * dQ's fp32 accumulator, in dq's dtype; both contiguous, ``n`` elements."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(DQ + offs, (tl.load(DQ_ACC + offs, mask=offs < n) * scale).to(DQ.dtype.element_ty), mask=offs < n)


FINISH = Launcher(_dq_of_accumulator)
FINISH_BLOCK = 4096  # elements a program converts


def finish(plan, dq_acc: torch.Tensor, dq: torch.Tensor, ahead: bool = False) -> None:
    """Launch the kernel that makes dq (contiguous, q's dtype) of the accumulator a ``launch`` added dQ into (a
    kernel, not a torch op: replays launch it with the call's others; ``ahead``: only compile it, ``Standin``s)."""
    n = math.prod(dq_acc.shape)
    (FINISH.compile_ahead if ahead else FINISH)((cdiv(n, FINISH_BLOCK),), (dq_acc, dq), (n, plan.scale),
                                                dict(BLOCK=FINISH_BLOCK))


def compile_ahead(plan, q, k, v, key_lengths: torch.Tensor, mods: torch.Tensor, stats: Standin,
                  stats_stride: int) -> bool:
    """Start compiling the kernel ``launch`` will run after a forward on q, k, v; False where it will not."""
    out = Standin(q.dtype, q.shape)
    if not launch(plan, q, k, v, out, stats, stats, _small_accumulator(q), Standin(k.dtype, k.shape),
                  Standin(v.dtype, v.shape), key_lengths, mods, stats_stride, ahead=True):
        return False
    finish(plan, accumulator(plan, q, ahead=True), out, ahead=True)
    return True


def compiling(plan, q, k, v, do, key_lengths: torch.Tensor, mods: torch.Tensor, stats_stride: int) -> bool:
    """Whether the compile ahead of the kernel that ``launch`` would run on these inputs is in flight
    (``Launcher.compiling``: what the Triton backward standing in for it waits on); False where ``launch``
    would launch nothing."""
    prepared = _arguments(plan, q, k, v, do, None, _small_accumulator(q), Standin(k.dtype, k.shape),
                          Standin(v.dtype, v.shape), key_lengths, mods, stats_stride)
    return prepared is not None and prepared[0].compiling(*prepared[1])


def _small_accumulator(q: torch.Tensor) -> torch.Tensor:
    """An accumulator of one query tile's rows: its descriptors key a launch as the whole one's do (a compile ahead
    needs no more)."""
    return torch.empty(BLOCK_M[q.shape[3]], q.shape[3], dtype=torch.float32, device=q.device)


def _arguments(plan, q, k, v, do, stats: tuple | None, dq_acc, dk, dv, key_lengths: torch.Tensor, mods: torch.Tensor,
               stats_stride: int):
    """(the kernel's Launcher, the launch's (grid, tensors, scalars, constexprs)), or None where ``launch`` launches
    nothing. ``stats``: (lse2, delta); None for the arguments of a compile ahead (descriptors that key alike in
    place of dO's and the statistics', over ``dq_acc``, which may then be a small one)."""
    if torch.are_deterministic_algorithms_enabled():
        return None
    rows = gluon_tools.layout_rows(plan.per_layout.setdefault("gluon_backward", {}), (q, k, v, do))
    if None in rows[:3]:
        return None
    ahead = stats is None
    if rows[3] is None:  # a layout TMA cannot read: read a copy (a fresh one: a misaligned do may be contiguous)
        do = Standin(do.dtype, do.shape) if ahead else do.clone(memory_format=torch.contiguous_format)
        rows = [*rows[:3], row_view_rows(do)]
    block_m, key_tile = BLOCK_M[q.shape[3]], KEY_TILE[q.shape[3]]
    # the head dim's parts (BLOCK_M lists none with a padded part); in the wide kernel a warpgroup's columns each
    parts = (128, q.shape[3] - 128) if q.shape[3] in WIDE else (plan.head_dim_parts["HEAD_DIM"],
                                                                plan.head_dim_parts["HEAD_DIM2"])

    def boxes(width: int) -> tuple:  # q, k, v and do's descriptors of boxes of a part's columns
        q_desc = row_view(q, rows[0], block_m, width)
        # a descriptor's key is its dtype, box and layout: q's stands for dO's ahead, the accumulator's for the stats'
        return (q_desc, row_view(k, rows[1], KV_BOX_ROWS, width), row_view(v, rows[2], KV_BOX_ROWS, width),
                q_desc if ahead else row_view(do, rows[3], block_m, width))

    # a box per part of the head dim, the first part's again without a second
    first_part = boxes(parts[0])
    descriptors = (*first_part, *(boxes(parts[1]) if parts[1] else first_part))
    dq_descs = _dq_descriptors(dq_acc, parts, block_m)
    # dK's and dV's 64-row boxes of each part (``_store_dk_dv_staged``: dk, dk2, dv, dv2; the first part's objects
    # again without a second, as q's above: two descriptors built a launch, not four, and a replay rebases each object
    # once), q's in the wide kernel (unused)
    if q.shape[3] in WIDE:
        dkv_descs = descriptors[:1] * 4
    else:
        first = [row_view(x, math.prod(x.shape[:3]), KV_BOX_ROWS, parts[0]) for x in (dk, dv)]
        second = [row_view(x, math.prod(x.shape[:3]), KV_BOX_ROWS, parts[1]) for x in (dk, dv)] if parts[1] else first
        dkv_descs = (first[0], second[0], first[1], second[1])
    lse_desc, delta_desc = (_stats(dq_acc, block_m), _stats(dq_acc, block_m)) if ahead else (
        _stats(stats[0], block_m), _stats(stats[1], block_m))
    tables, table_strides = plan.tables_of("q")
    return BACKWARD_GLUON_WIDE if q.shape[3] in WIDE else BACKWARD_GLUON, (
        (plan.batch * plan.kv_heads * cdiv(plan.kv_len, key_tile),),
        (*descriptors, *dq_descs, lse_desc, delta_desc, dk, dv, *dkv_descs, *tables, key_lengths, mods),
        (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *table_strides, plan.heads,
         plan.groups, plan.q_len, plan.kv_len, stats_stride, plan.qk_scale, plan.scale),
        _constexprs(KIND_CODES[plan.kind], plan.q_len % block_m != 0 or plan.kv_len % key_tile != 0, plan.causal,
                    plan.sparse_block, parts, (plan.mask_mod, plan.score_mod, plan.score_keys), plan.has_key_lengths))
