"""The forward for Hopper written in Gluon: FlashAttention-3's structure, which Triton's own warp
specialisation does not reach (docs/kernels.md, "The Gluon forward").

A work item is one query tile of WARPGROUPS x 64 rows of one (batch, head) (``_work_item``; a tile of three
may run past q_len: its rows past it are computed and not stored). A program per multiprocessor takes items pid,
pid + num_programs, ..., or (SCHEDULED: CAUSAL, and SPARSE rows of unequal lengths) the items a schedule made on
the host lists for it (``_schedule``). WARPGROUPS consumer warpgroups and a warp:
  producer   one warp (24 registers a thread) loads each item's Q (a 64-row box per consumer) once every
             consumer is done with the last one (``q_empty``), then each key tile's K and V by TMA into a ring of
             STAGES buffers that runs on from item to item; ``ready`` mbarriers say a buffer is full,
             ``empty`` ones (an arrival per consumer) that it may be refilled: ``v_empty`` once
             tile j's P V is done, and K's buffer with it unless K_EARLY, where ``k_empty`` frees it once
             tile j's scores are.
  consumers  two (three at head dims 48 and 64, ``warpgroups``) warpgroups of 64 query rows each. Each issues
             tile j's scores S_j = Q K_j^T and the previous tile's P_{j-1} V_{j-1} together, waits for S_j only
             and computes the softmax of tile j while P_{j-1} V_{j-1} still runs on the tensor cores (the
             overlap inside a warpgroup); they also take turns issuing their products (named barriers 8, 9 and
             10: a warpgroup waits on its own and arrives on the next one's), so that one warpgroup's softmax
             runs under the others' products; the turns go round strictly over all of a program's items (the
             last warpgroup arrives once before the item loop, warpgroup 0 syncs once after it), so that no
             arrival can meet another of the same warpgroup.

Constexpr flags:
  MASK_KIND      0 DENSE, 1 CAUSAL, 2 SPARSE (``plan.KIND_CODES``): tiles 0.. of every key, of the keys up to
                 the tile's last row, or of the blocks listed in the row tables (FULL_*, then PART_*).
  SCHEDULED      each program takes the items SCHEDULE lists for it (``_schedule``), not every num_programs-th.
  IS_CAUSAL      SPARSE only: the partial blocks are cut by q_idx >= kv_idx (top-left alignment).
  MASK_MOD, SCORE_MOD, SCORE_KEYS, SCORE_ROW  the generated helpers (codegen.py) as in forward.py, or None:
                 MASK_MOD cuts the partial blocks too; a score function gives the tiles' base-2 scores.
  RAGGED_KEYS    DENSE or CAUSAL, kv_len not a multiple of BLOCK_N: the last key tile ends at kv_len, overlapping
                 the tile before, whose keys it masks (``gluon_tools.moved_back``); no load reads past a head's keys.
  HAS_KEY_LENGTHS  KEY_LENGTHS[b] ends batch b's keys (``gluon_tools.key_end``): its rows walk the key tiles up to
                 it and mask the keys past it in the tile across it. SPARSE walks whole blocks: the listed blocks
                 with a key before it (``gluon_tools.walk_before``), so that a block across it has its tiles
                 computed and masked, those wholly past it too.
  BLOCK_N        key rows of a tile (``KEY_TILE``: 128, 64 at head dims 192 and 256).
  SPARSE_BLOCK_M, SPARSE_BLOCK_N  SPARSE: the mask block, multiples of the tiles.
  HEAD_DIM, HEAD_DIM2  the head dim, a power of two (HEAD_DIM2 = 0), or its two parts (``plan.head_dim_parts``:
                 96 = 64 + 32), each read by TMA boxes of its own width and multiplied apart (S = Q K^T + Q2 K2^T,
                 O and O2 from P V and P V2): no column padded.
  STAGES         K/V buffers. A consumer waits for K_{j+1} before it releases V_{j-1}, so that the wait's
                 branch sits between the softmax and the wait for PV_{j-1} (without one, ptxas hoists that
                 wait above the softmax): with 3 or more buffers K_{j+1} goes where tile j-2 was; with 2
                 (head dims 160 and 256, whose Q and 80 or 64 KiB a stage leave room for no third; 128 with
                 O_STAGED, whose buffers take the third's room), K_EARLY.
  WARPGROUPS     consumer warpgroups (``warpgroups``), each 64 rows of the query tile.
  O_STAGED       each consumer stores its rows of o into a shared buffer of its own and TMA writes them (o_desc: 64-row
                 boxes of o seen as B * H * q_len rows; a consumer whose rows are all past q_len stores none, so q_len
                 is a multiple of 64), not from registers (``O_STAGED_STAGES``).
  K_EARLY        STAGES < 3: K's buffer of tile j is released as soon as S_j is computed, so that K_{j+1}
                 can load into tile j-1's while P_{j-1} V_{j-1} still reads V_{j-1}.

Scores in base 2 as in forward.py: s * qk_scale with qk_scale = scale * log2(e) (SCORE_MOD's scores as they
are); lse = (m + log2 l + row term) ln 2; a row that sees no key (SPARSE, or a score function's -inf: the
softmax guards m = -inf and l = 0) stores o = 0, lse = -inf. A row
of no tile still gets one: the producer loads the first tile its walk would take (for SPARSE the block
at its table's first entry: a padding entry, or a block past the batch's keys) and the consumers mask all
of it, so that every loop has a first tile to peel.

Applies (``applies``) on Hopper (capability 9.x) with Triton >= 3.6 to fp16/bf16 inputs of head dim 48, 64, 80, 96, 128,
160, 192 or 256 (``KEY_TILE``): DENSE and CAUSAL masks on any lengths with a key tile of keys or more (the last query
tile's rows past q_len are computed and not stored, as a tile of three warpgroups'), SPARSE masks on lengths that the
tiles divide, with blocks that the tiles divide and that divide the lengths; with or without key_lengths; no
dropout, no score function that evaluates exp, log, tanh or sqrt per score, and layouts TMA can read
(``forward_persistent.row_view_rows``).
``SPARSEFLASH_GLUON``: "auto" (default) where it was measured faster than the Triton forward (rows of
``AUTO_ROW_KEYS`` keys or more on average), "1" wherever it applies, "0" never.
"""

from __future__ import annotations

import functools
import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma_wait

from sparseflash.attention.triton import gluon_tools
from sparseflash.attention.triton.gluon_tools import (issue_abt, issue_pv, key_end, listed_walk, load_box, moved_back,
                                                      named_arrive, named_sync, row_view, row_view_coords, tma_store,
                                                      walk_before, walk_tile_start)
from sparseflash.attention.triton.launch import Launcher, multiprocessors
from sparseflash.attention.triton.plan import KIND_CODES
from sparseflash.attention.triton.tiles import ROW_LENGTH_ARGS, key_steps, modded_scores, row_term
from sparseflash.attention.triton.work_schedule import UNEQUAL_LINES, kept_schedule, program_items, scheduled_item
from sparseflash.masks import MaskKind

HALF_M = 64  # query rows of a consumer warpgroup
BLOCK_M = 2 * HALF_M
# key rows of a tile and K/V buffers by head dim (head dims that are not powers of two in two parts,
# plan.head_dim_parts): 3 of 128 rows fill Hopper's shared memory at 128, 2 of 64 at 256 (beside Q's 64 KiB); at
# 256 a consumer's O (128 registers a thread) leaves room for scores of 64 keys only; at 192 a stage of 128 keys
# (96 KiB) leaves room for no second. On an H100 two stages of 128 keys ran 1.08-1.14x three of 64 at 160; 3 or 4
# stages alike at 80 and 96
KEY_TILE = {48: 128, 64: 128, 80: 128, 96: 128, 128: 128, 160: 128, 192: 64, 256: 64}
STAGES = {48: 4, 64: 4, 80: 3, 96: 3, 128: 3, 160: 2, 192: 3, 256: 2}
TILES = {dim: (BLOCK_M, keys) for dim, keys in KEY_TILE.items()}  # the lengths these divide, by head dim
# "auto" takes it from this mean number of keys a query row walks, by head dim and whether the mask is
# CAUSAL. On an H100 it ran 1.01-1.33x the Triton forward at or above them, 0.62-0.97x below (one item
# a program: three warpgroups to start and a pipeline to fill for each); the Triton forward's CAUSAL at
# head dim 128 is weaker (1.07x from 576 keys). At head dim 256 (64-key tiles, Triton's forward weaker there):
# 1.11-1.32x from 320 keys, 0.99x at 192-256. Head dims in two parts, against the Triton forward's two parts:
# 1.05-1.43x from 1,024 keys (160: 1.21x at 576 causal), 0.86-1.02x at 576 causal (48: 0.97x at 1,088 causal).
AUTO_ROW_KEYS = {(128, True): 512, (128, False): 2048, (64, True): 4096, (64, False): 4096, (256, True): 256,
                 (256, False): 512, (48, True): 2048, (48, False): 1024, (80, True): 1024, (80, False): 1024,
                 (96, True): 1024, (96, False): 1024, (160, True): 512, (160, False): 1024, (192, True): 1024,
                 (192, False): 1024}
# Head dims whose DENSE and CAUSAL query tiles without functions take three consumer warpgroups (``warpgroups``), and
# "auto"'s thresholds for them, as AUTO_ROW_KEYS's. Head dim 64 (H200): DENSE 1.14-1.22x the Triton forward from
# 2,048 keys, 1.01x at 1,024, and with o stored through shared memory (O_STAGED) 1.21x at 2,048, 1.07x at 1,024;
# CAUSAL 0.94x at 2,048 keys on average (S=4096). Head dim 48 keeps two's thresholds (three ran its DENSE rows 1.16x
# as fast as two at 4,096 keys and more)
AUTO_ROW_KEYS_THREE = {(64, True): 4096, (64, False): 1024, (48, True): 2048, (48, False): 1024}
# "auto"'s thresholds where two consumers store o through shared memory (O_STAGED, ``o_stored_staged``; three take
# AUTO_ROW_KEYS_THREE) and no function comes with the mask (not measured with one). Head dim 128 (H200, forward alone,
# against the Triton forward): DENSE 1.07x at 256 keys, 1.09-1.16x at 512-2,048; CAUSAL 1.17x at 128 keys on average
# (S=256), 1.17-1.39x at 256-1,024
AUTO_ROW_KEYS_STAGED = {(128, True): 128, (128, False): 256}
# How many more rows three consumers' 192-row tiles may compute than two's 128-row tiles, as a share of two's: a row
# took ~0.85x the time with three (hd64 and hd48 dense, H200), and q_len 192-1,536 against 8,192 keys ran
# three/two = 0.85 x that ratio of rows (256 queries, 384 rows against 256: 1.23x; 640, 768 against 640: 1.01x; 512,
# 576 against 512: 0.96x; 320, 384 either way: 0.84x), so the break-even is ~1/6 and an eighth keeps a margin
THREE_PADDING = 0.125
# What an item costs a program besides its key tiles, in key tiles (``_schedule``): its Q load, stores and the wait
# for its first tile. Causal forward on an H200 against one item a program: counted as 0, hd128 S=4096 ran
# 1.05-1.06x the time; as 1, hd64 S=2304 1.09-1.10x (one program then took 64 of the shortest items, the others
# 12-24; not understood further); as 0.5, 0.93-1.00x everywhere measured (hd64 and hd128, S 2304-16384)
ITEM_COST = 0.5
# Head dims whose consumers store o through shared memory by TMA (O_STAGED; DENSE and CAUSAL masks), and the K/V
# buffers they keep then, on rows of at most O_STAGED_KEYS keys. From registers, a warpgroup's o (64 x 128 bf16) took
# 32 four-byte stores a thread (a warp's store: 16 bytes in each of eight rows), and clock stamps put 3,000-5,000
# cycles between the wait for its last product and the end of its stores (H200, hd128, S=512-16384): a fifth to a
# third of a short item. Through shared memory (H200, forward alone, against registers): hd128 0.86-0.94x the time at
# S=512-2048, 0.95-0.97x at 4096; hd64 0.93-0.98x at 1024-4096. The buffers (16 KiB a consumer at hd128) leave room
# for two K/V stages of 128 keys only, against three, and at S=16384 the third paid more (causal 1.03x the time
# staged): long rows keep it
O_STAGED_STAGES = {64: 4, 128: 2}
O_STAGED_KEYS = 8192


@gluon.jit
def _key_term(b, h, q_start, qk_scale, MODS, SCORE_MOD: gl.constexpr, SCORE_KEYS: gl.constexpr):
    """A score function linear in kv_idx (SCORE_KEYS) at reference query q_start, as scalars of a work item:
    (at, step, scale), its base-2 term at kv_idx = q_start (its float terms of the query alone left out, as
    ``score_mod`` does), the term's step per key and the products' scale, so that a tile's scores are
    ``products * scale + keys`` shifted by ``at + (kv_start - q_start) * step`` (``_scores``): the function is
    evaluated once per item, no captured tensor loaded per tile."""
    at, d_score = SCORE_MOD(0.0, qk_scale, b, h, q_start, q_start, q_start, 0.0, MODS)
    return at, SCORE_KEYS(b, h, 1, MODS), qk_scale * d_score


@gluon.jit
def _scores(s, t, n_full, b, h, q_start, offs_m, offs_n, full_idx, part_idx, kv_len, kv_end, keys, key_term, qk_scale,
            MODS, MASK_KIND: gl.constexpr, IS_CAUSAL: gl.constexpr, MASK_MOD: gl.constexpr, SCORE_MOD: gl.constexpr,
            SCORE_KEYS: gl.constexpr, RAGGED_KEYS: gl.constexpr, HAS_KEY_LENGTHS: gl.constexpr, BLOCK_N: gl.constexpr,
            SPARSE_BLOCK_N: gl.constexpr):
    """(scores, shift): the products s of key tile t as the softmax takes them: SCORE_MOD's base-2 scores at
    reference query q_start (``tiles.modded_scores``; the products themselves without a score function), then
    -inf where the tile is past the unmasked ones (CAUSAL's diagonal, SPARSE's partial blocks) and the element
    is dropped by q_idx < kv_idx (CAUSAL, IS_CAUSAL) or by MASK_MOD (by either where both apply), and (RAGGED_KEYS)
    where the last tile, moved back to end at kv_len (``gluon_tools.moved_back``), overlaps the tile before, and
    (HAS_KEY_LENGTHS) at the batch's keys from kv_end on (``gluon_tools.key_end``). With
    SCORE_KEYS the scores less the key term's value at the tile's first key, ``shift`` (the item's
    ``_key_term``), which the softmax adds to the rows' max instead: a vector add per tile less; shift is 0.0
    otherwise."""
    shift = 0.0
    if SCORE_MOD is not None or MASK_KIND == 1 or IS_CAUSAL or MASK_MOD is not None or RAGGED_KEYS or HAS_KEY_LENGTHS:
        kv_start = moved_back(walk_tile_start(t, 0, n_full, full_idx, part_idx, MASK_KIND, BLOCK_N, SPARSE_BLOCK_N),
                              kv_len, BLOCK_N, RAGGED_KEYS)
        q_idx = offs_m[:, None]
        kv_idx = (kv_start + offs_n)[None, :]
        if SCORE_KEYS is not None:
            at, step, scale = key_term
            s = s * scale + keys
            shift = at + (kv_start - q_start) * step
        elif SCORE_MOD is not None:
            s = modded_scores(s, b, h, q_idx, kv_idx, q_start, kv_start, keys, qk_scale, MODS, SCORE_MOD,
                              SCORE_KEYS)[0]
        if MASK_KIND == 1 or IS_CAUSAL or MASK_MOD is not None or RAGGED_KEYS or HAS_KEY_LENGTHS:
            cut = t >= n_full
            if MASK_KIND == 2 and HAS_KEY_LENGTHS:  # a listed full block may run past the batch's last key
                cut = cut | (kv_start + BLOCK_N > kv_end)
            OWN_CUT: gl.constexpr = MASK_MOD is not None or MASK_KIND == 1 or IS_CAUSAL
            if cut:
                if OWN_CUT:
                    if MASK_MOD is not None:
                        keep = MASK_MOD(b, h, q_idx, kv_idx, MODS)
                        if IS_CAUSAL:
                            keep = keep & (q_idx >= kv_idx)
                    else:
                        keep = q_idx >= kv_idx
                    if HAS_KEY_LENGTHS:
                        keep = keep & (kv_idx < kv_end)
                else:  # no cut of its own: the keys up to the batch's end (every key of the tile without key_lengths)
                    keep = kv_idx < kv_end
                if RAGGED_KEYS:  # not a key of the tile before (all but the last tile's are not)
                    keep = keep & (kv_idx >= t * BLOCK_N)
                s = gl.where(keep, s, float("-inf"))
    return s, shift


@gluon.jit
def _tile_max(s, shift, SHIFTED: gl.constexpr):
    """The row max of a tile's scores ``s + shift`` (``_scores``)."""
    if SHIFTED:
        return gl.max(s, 1) + shift
    else:
        return gl.max(s, 1)


@gluon.jit
def _safe_max(m, MAY_BE_EMPTY: gl.constexpr):
    """The running max as the exponents subtract it: 0 for a row that has seen no key yet (m = -inf),
    whose probabilities are then exp2(-inf) = 0 instead of NaN."""
    if MAY_BE_EMPTY:
        return gl.where(m == float("-inf"), 0.0, m)
    else:
        return m


@gluon.jit
def _work_item(item, FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, SCHEDULE, KEY_LENGTHS, stride_num_b, stride_num_h,
               stride_num_m, stride_idx_b, stride_idx_h, stride_idx_m, heads, q_len, kv_len, MASK_KIND: gl.constexpr,
               SCHEDULED: gl.constexpr, HAS_KEY_LENGTHS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               SPARSE_BLOCK_M: gl.constexpr, SPARSE_BLOCK_N: gl.constexpr):
    """Work item ``item``: the one SCHEDULE's entry ``item`` names (SCHEDULED: bh * query tiles + query tile), or
    the query tiles of each (batch, head) in turn. Its (batch, head) bh, first query q_start, key tiles n_full that
    need no mask of theirs (SPARSE: the full blocks', which key_lengths may cut all the same, ``_scores``), key tiles
    n_tiles, (SPARSE) the row tables' entries of its mask row and the end of its batch's keys kv_end
    (``gluon_tools.key_end``)."""
    m_tiles = gl.cdiv(q_len, BLOCK_M)
    item = scheduled_item(SCHEDULE, item, SCHEDULED)
    bh = item // m_tiles
    q_start = (item % m_tiles) * BLOCK_M
    kv_end = key_end(KEY_LENGTHS, bh // heads, kv_len, HAS_KEY_LENGTHS)
    full_idx = FULL_IDX
    part_idx = PART_IDX
    if MASK_KIND == 2:
        n_full, n_tiles, full_idx, part_idx = listed_walk(
            FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, bh // heads, bh % heads, q_start // SPARSE_BLOCK_M,
            stride_num_b, stride_num_h, stride_num_m, stride_idx_b, stride_idx_h, stride_idx_m,
            SPARSE_BLOCK_N // BLOCK_N)
        if HAS_KEY_LENGTHS:  # the blocks past the batch's last key left out
            n_full, n_tiles = walk_before(n_full, n_tiles, full_idx, part_idx, gl.cdiv(kv_end, SPARSE_BLOCK_N),
                                          SPARSE_BLOCK_N // BLOCK_N)
    elif MASK_KIND == 1:  # key tiles wholly at or below the tile's first row need no mask
        n_full = gl.minimum(q_start + 1, kv_end) // BLOCK_N
        n_tiles = gl.cdiv(gl.minimum(kv_end, q_start + BLOCK_M), BLOCK_N)
    else:
        n_full = kv_end // BLOCK_N
        n_tiles = gl.cdiv(kv_end, BLOCK_N)
    return bh, q_start, n_full, n_tiles, full_idx, part_idx, kv_end


@gluon.jit
def _producer(load_args, MASK_KIND: gl.constexpr, SCHEDULED: gl.constexpr, RAGGED_KEYS: gl.constexpr,
              HAS_KEY_LENGTHS: gl.constexpr, BLOCK_N: gl.constexpr, SPARSE_BLOCK_M: gl.constexpr,
              SPARSE_BLOCK_N: gl.constexpr, HEAD_DIM2: gl.constexpr, STAGES: gl.constexpr):
    """For each work item: Q (a 64-row box per consumer) once every consumer is done with the previous Q, then K
    and V of each key tile into the ring's next buffer once every consumer released its previous tile (K and V
    apart with K_EARLY); with HEAD_DIM2, each with its second part (q2/k2/v2). ``load_args``: the kernel's
    arguments the loads take (``_attn_fwd_gluon``)."""
    (q_desc, k_desc, v_desc, q2_desc, k2_desc, v2_desc, q_smem, k_smem, v_smem, q2_smem, k2_smem, v2_smem, q_ready,
     q_empty, k_ready, v_ready, k_empty, v_empty, FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, SCHEDULE, KEY_LENGTHS,
     stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_num_b,
     stride_num_h, stride_num_m, stride_idx_b, stride_idx_h, stride_idx_m, heads, groups, q_len, kv_len, n_items,
     num_programs) = load_args
    HALF_M: gl.constexpr = q_desc.block_type.shape[0]
    WARPGROUPS: gl.constexpr = q_smem.type.shape[0]
    K_EARLY: gl.constexpr = STAGES < 3
    # bytes of a box of Q, K and V with its second part's (``_load_box``)
    Q_BYTES: gl.constexpr = q_desc.block_type.nbytes + (q2_desc.block_type.nbytes if HEAD_DIM2 > 0 else 0)
    K_BYTES: gl.constexpr = k_desc.block_type.nbytes + (k2_desc.block_type.nbytes if HEAD_DIM2 > 0 else 0)
    V_BYTES: gl.constexpr = v_desc.block_type.nbytes + (v2_desc.block_type.nbytes if HEAD_DIM2 > 0 else 0)
    loads = 0  # key tiles loaded so far: the ring's position
    i = 0  # work items so far: the phase of q_empty
    first, end, step = program_items(SCHEDULE, n_items, num_programs, SCHEDULED)
    for item in range(first, end, step):
        bh, q_start, n_full, n_tiles, full_idx, part_idx, kv_end = _work_item(
            item, FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, SCHEDULE, KEY_LENGTHS, stride_num_b, stride_num_h,
            stride_num_m, stride_idx_b, stride_idx_h, stride_idx_m, heads, q_len, kv_len, MASK_KIND, SCHEDULED,
            HAS_KEY_LENGTHS, WARPGROUPS * HALF_M, BLOCK_N, SPARSE_BLOCK_M, SPARSE_BLOCK_N)
        b = bh // heads
        h = bh % heads
        q_row, q_col = row_view_coords(b, h, q_start, stride_qb, stride_qh, stride_qm)
        k_row, k_col = row_view_coords(b, h // groups, 0, stride_kb, stride_kh, stride_kn)
        v_row, v_col = row_view_coords(b, h // groups, 0, stride_vb, stride_vh, stride_vn)
        mbarrier.wait(q_empty, (i - 1) & 1, pred=i > 0)
        mbarrier.expect(q_ready, WARPGROUPS * Q_BYTES)
        for w in gl.static_range(WARPGROUPS):
            load_box(q_desc, q2_desc, q_row + w * HALF_M, q_col, q_ready, q_smem.index(w), q2_smem.index(w), HEAD_DIM2)
        for t in range(gl.maximum(n_tiles, 1)):  # a row of no tile loads a first one, which the consumers mask
            stage = loads % STAGES
            kv_start = moved_back(walk_tile_start(t, 0, n_full, full_idx, part_idx, MASK_KIND, BLOCK_N,
                                                  SPARSE_BLOCK_N), kv_len, BLOCK_N, RAGGED_KEYS)
            phase = ((loads // STAGES) - 1) & 1
            if K_EARLY:
                mbarrier.wait(k_empty.index(stage), phase, pred=loads >= STAGES)
            else:
                mbarrier.wait(v_empty.index(stage), phase, pred=loads >= STAGES)
            mbarrier.expect(k_ready.index(stage), K_BYTES)
            load_box(k_desc, k2_desc, k_row + kv_start, k_col, k_ready.index(stage), k_smem.index(stage),
                     k2_smem.index(stage), HEAD_DIM2)
            if K_EARLY:
                mbarrier.wait(v_empty.index(stage), phase, pred=loads >= STAGES)
            mbarrier.expect(v_ready.index(stage), V_BYTES)
            load_box(v_desc, v2_desc, v_row + kv_start, v_col, v_ready.index(stage), v_smem.index(stage),
                     v2_smem.index(stage), HEAD_DIM2)
            loads += 1
        i += 1


@gluon.jit
def _consumer(shared, WG: gl.constexpr, MASK_KIND: gl.constexpr, SCHEDULED: gl.constexpr, IS_CAUSAL: gl.constexpr,
              MASK_MOD: gl.constexpr, SCORE_MOD: gl.constexpr, SCORE_KEYS: gl.constexpr, SCORE_ROW: gl.constexpr,
              RAGGED_KEYS: gl.constexpr, HAS_KEY_LENGTHS: gl.constexpr, BLOCK_N: gl.constexpr,
              SPARSE_BLOCK_M: gl.constexpr, SPARSE_BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
              HEAD_DIM2: gl.constexpr, STAGES: gl.constexpr, O_STAGED: gl.constexpr):
    """For each work item, rows [WG * 64, WG * 64 + 64) of its query tile: the online softmax over the key
    tiles the producer loads, then o (O seen as (rows, HEAD_DIM + HEAD_DIM2); with O_STAGED through o_smem's
    buffer WG and o_desc) and the lse. With HEAD_DIM2, the output's second part accumulates in acc2 (0.0 without).
    ``shared``: the kernel's arguments the consumers take (``_attn_fwd_gluon``)."""
    (q_smem, k_smem, v_smem, q2_smem, k2_smem, v2_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, O, LSE,
     o_desc, o_smem, FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, SCHEDULE, KEY_LENGTHS, MODS, stride_num_b, stride_num_h,
     stride_num_m, stride_idx_b, stride_idx_h, stride_idx_m, heads, q_len, kv_len, n_items, num_programs,
     qk_scale) = shared
    HALF_M: gl.constexpr = q_smem.type.shape[1]
    WARPGROUPS: gl.constexpr = q_smem.type.shape[0]
    K_EARLY: gl.constexpr = STAGES < 3
    PV_GROUPS: gl.constexpr = 2 if HEAD_DIM2 > 0 else 1  # wgmma groups of a P V, which may stay in flight
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    # the second part's (a placeholder width without one, unused)
    o2_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_DIM2 if HEAD_DIM2 > 0 else 16, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    p2_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o2_layout, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    row_o2: gl.constexpr = gl.SliceLayout(1, o2_layout)
    MY_TURN: gl.constexpr = 8 + WG
    THEIR_TURN: gl.constexpr = 8 + (WG + 1) % WARPGROUPS  # the next warpgroup's turn
    # a score function may return -inf; a batch's key length may be 0
    MAY_BE_EMPTY: gl.constexpr = MASK_KIND == 2 or SCORE_MOD is not None or HAS_KEY_LENGTHS
    # the scale of what _scores returns: the products, or base-2 scores already scaled by the score function
    soft_scale = qk_scale
    if SCORE_MOD is not None:
        soft_scale = 1.0

    q = q_smem.index(WG)
    q2 = q2_smem.index(WG)
    rows_s = WG * HALF_M + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, s_layout))
    rows_o = WG * HALF_M + gl.arange(0, HALF_M, layout=row_o)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    zero_s = gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout)
    turn = n_items  # a value the named barriers pass along, which orders them among the products
    used = 0  # key tiles consumed so far: the ring's position
    i = 0  # work items so far: the phase of q_ready
    # The turns go round strictly over all items: the last warpgroup lets warpgroup 0 go first once, and
    # warpgroup 0 takes a last turn after the last item, so that no arrival can meet another of the same warpgroup
    if WG == WARPGROUPS - 1:
        turn = named_arrive(8, turn)
    first, end, step = program_items(SCHEDULE, n_items, num_programs, SCHEDULED)
    for item in range(first, end, step):
        bh, q_start, n_full, n_tiles, full_idx, part_idx, kv_end = _work_item(
            item, FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, SCHEDULE, KEY_LENGTHS, stride_num_b, stride_num_h,
            stride_num_m, stride_idx_b, stride_idx_h, stride_idx_m, heads, q_len, kv_len, MASK_KIND, SCHEDULED,
            HAS_KEY_LENGTHS, WARPGROUPS * HALF_M, BLOCK_N, SPARSE_BLOCK_M, SPARSE_BLOCK_N)
        n_loads = gl.maximum(n_tiles, 1)
        offs_m = q_start + rows_s
        b = bh // heads
        h = bh % heads
        # a key term's steps (linear in kv_idx), a separable function's term of each row that scores taken at
        # q_start leave out (codegen.py); 0.0 without. At the item's start, where their loads of captured
        # tensors may run while its first tiles load
        keys = key_steps(b, h, offs_n[None, :], MODS, SCORE_KEYS)
        row = row_term(b, h, offs_m, q_start, kv_len, MODS, SCORE_ROW)
        key_term = 0.0
        if SCORE_KEYS is not None:
            key_term = _key_term(b, h, q_start, qk_scale, MODS, SCORE_MOD, SCORE_KEYS)
        mbarrier.wait(q_ready, i & 1)
        mbarrier.wait(k_ready.index(used % STAGES), (used // STAGES) & 1)
        turn = named_sync(MY_TURN, turn)
        s = issue_abt(q, q2, k_smem.index(used % STAGES), k2_smem.index(used % STAGES), zero_s, HEAD_DIM2)
        turn = named_arrive(THEIR_TURN, turn)
        s = warpgroup_mma_wait(0, deps=(s,))
        if K_EARLY:
            mbarrier.arrive(k_empty.index(used % STAGES))
        s, shift = _scores(s, 0, n_full, b, h, q_start, offs_m, offs_n, full_idx, part_idx, kv_len, kv_end, keys,
                           key_term, qk_scale, MODS, MASK_KIND, IS_CAUSAL, MASK_MOD, SCORE_MOD, SCORE_KEYS,
                           RAGGED_KEYS, HAS_KEY_LENGTHS, BLOCK_N, SPARSE_BLOCK_N)
        if MAY_BE_EMPTY:
            if n_tiles == 0:  # the producer loaded tile 0 all the same
                s = gl.full_like(s, float("-inf"))
        m_i = _tile_max(s, shift, SCORE_KEYS is not None)
        p = gl.exp2(s * soft_scale - (_safe_max(m_i, MAY_BE_EMPTY) * soft_scale - shift)[:, None])
        l_i = gl.sum(p, 1)
        p_op = gl.convert_layout(p.to(q.dtype), p_layout)
        acc = gl.zeros([HALF_M, HEAD_DIM], gl.float32, o_layout)
        acc2 = 0.0
        p2_op = 0.0
        if HEAD_DIM2 > 0:
            acc2 = gl.zeros([HALF_M, HEAD_DIM2], gl.float32, o2_layout)
            p2_op = gl.convert_layout(p_op, p2_layout)
        mbarrier.wait(k_ready.index((used + 1) % STAGES), ((used + 1) // STAGES) & 1, pred=1 < n_loads)
        for j in range(1, n_loads):
            tile = used + j
            stage = tile % STAGES
            prev = (tile - 1) % STAGES
            turn = named_sync(MY_TURN, turn)
            s = issue_abt(q, q2, k_smem.index(stage), k2_smem.index(stage), zero_s, HEAD_DIM2)
            mbarrier.wait(v_ready.index(prev), ((tile - 1) // STAGES) & 1)
            acc, acc2 = issue_pv(p_op, p2_op, v_smem.index(prev), v2_smem.index(prev), acc, acc2, HEAD_DIM2)
            turn = named_arrive(THEIR_TURN, turn)
            s = warpgroup_mma_wait(PV_GROUPS, deps=(s,))
            if K_EARLY:
                mbarrier.arrive(k_empty.index(stage))
            s, shift = _scores(s, j, n_full, b, h, q_start, offs_m, offs_n, full_idx, part_idx, kv_len, kv_end,
                               keys, key_term, qk_scale, MODS, MASK_KIND, IS_CAUSAL, MASK_MOD, SCORE_MOD,
                               SCORE_KEYS, RAGGED_KEYS, HAS_KEY_LENGTHS, BLOCK_N, SPARSE_BLOCK_N)
            m_new = gl.maximum(m_i, _tile_max(s, shift, SCORE_KEYS is not None))
            m_use = _safe_max(m_new, MAY_BE_EMPTY)
            alpha = gl.exp2((m_i - m_use) * soft_scale)
            p = gl.exp2(s * soft_scale - (m_use * soft_scale - shift)[:, None])
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            # the next key tile's wait sits here: its branch keeps ptxas from hoisting the PV wait above the
            # softmax
            mbarrier.wait(k_ready.index((tile + 1) % STAGES), ((tile + 1) // STAGES) & 1, pred=j + 1 < n_loads)
            p_new = gl.convert_layout(p.to(q.dtype), p_layout)
            alpha_o = gl.convert_layout(alpha, row_o)
            if HEAD_DIM2 > 0:
                acc, acc2, p_op, p2_op, p_new, alpha_o, l_i = warpgroup_mma_wait(
                    0, deps=(acc, acc2, p_op, p2_op, p_new, alpha_o, l_i))
                acc2 = acc2 * gl.convert_layout(alpha, row_o2)[:, None]
                p2_op = gl.convert_layout(p_new, p2_layout)
            else:
                acc, p_op, p_new, alpha_o, l_i = warpgroup_mma_wait(0, deps=(acc, p_op, p_new, alpha_o, l_i))
            mbarrier.arrive(v_empty.index(prev))  # done with V of tile j - 1 (and K, unless K_EARLY)
            acc = acc * alpha_o[:, None]
            p_op = p_new
        mbarrier.arrive(q_empty)  # every product with Q is done: the producer may load the next item's
        last = used + n_loads - 1
        mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
        acc, acc2 = issue_pv(p_op, p2_op, v_smem.index(last % STAGES), v2_smem.index(last % STAGES), acc, acc2,
                             HEAD_DIM2)
        if HEAD_DIM2 > 0:
            acc, acc2 = warpgroup_mma_wait(0, deps=(acc, acc2))
        else:
            acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(v_empty.index(last % STAGES))
        used += n_loads
        l_o = l_i
        if MAY_BE_EMPTY:
            l_o = gl.where(l_i == 0.0, 1.0, l_i)
        if SCORE_ROW is not None:  # a row whose term is -inf (a query a -inf table pads) sees no key: o = 0
            l_o = gl.where(row == float("-inf"), float("inf"), l_o)
        o = acc / gl.convert_layout(l_o, row_o)[:, None]
        # the rows of the item's tile within q_len: a tile of three warpgroups' rows may run past it (its rows
        # past q_len read whatever rows follow in memory, or TMA's zeros past the tensor's end, and are not stored;
        # each row's softmax and products are its own)
        out_row = bh * q_len + q_start
        if O_STAGED:
            o_buffer = o_smem.index(WG)
            tma.store_wait(0)  # the last item's store has read the buffer
            o_buffer.store(o.to(O.dtype.element_ty))
            fence_async_shared()
            if q_start + WG * HALF_M < q_len:
                tma_store(o_desc, [out_row + WG * HALF_M, 0], o_buffer)
        else:
            out_rows = (out_row + rows_o).to(gl.int64)[:, None] * (HEAD_DIM + HEAD_DIM2)
            gl.store(O + out_rows + cols[None, :], o.to(O.dtype.element_ty), mask=(q_start + rows_o < q_len)[:, None])
        if HEAD_DIM2 > 0:
            o2 = acc2 / gl.convert_layout(l_o, row_o2)[:, None]
            cols2 = HEAD_DIM + gl.arange(0, HEAD_DIM2, layout=gl.SliceLayout(0, o2_layout))
            rows_o2 = WG * HALF_M + gl.arange(0, HALF_M, layout=row_o2)
            out_rows2 = (out_row + rows_o2).to(gl.int64)[:, None]
            gl.store(O + out_rows2 * (HEAD_DIM + HEAD_DIM2) + cols2[None, :], o2.to(O.dtype.element_ty),
                     mask=(q_start + rows_o2 < q_len)[:, None])
        lse = (m_i * soft_scale + gl.log2(l_i) + row) * 0.6931471805599453
        # the turn value joins the stores, so the named barriers are not dead code
        gl.store(LSE + out_row + rows_s, lse + (turn * 0).to(gl.float32), mask=offs_m < q_len)
        i += 1
    if O_STAGED:
        tma.store_wait(0)  # the buffer read before the program ends
    if WG == 0:
        turn = named_sync(8, turn)  # the last warpgroup's last arrival, so that the barrier counts balance


@gluon.jit(do_not_specialize=[*ROW_LENGTH_ARGS, "n_items"])
def _attn_fwd_gluon(q_desc, k_desc, v_desc, q2_desc, k2_desc, v2_desc, o_desc, O, LSE, FULL_NUM, FULL_IDX, PART_NUM,
                    PART_IDX, SCHEDULE, KEY_LENGTHS, MODS,
                    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                    stride_num_b, stride_num_h, stride_num_m, stride_idx_b, stride_idx_h, stride_idx_m,
                    heads, groups, q_len, kv_len, n_items, num_programs, qk_scale,
                    MASK_KIND: gl.constexpr, SCHEDULED: gl.constexpr, IS_CAUSAL: gl.constexpr,
                    MASK_MOD: gl.constexpr, SCORE_MOD: gl.constexpr, SCORE_KEYS: gl.constexpr,
                    SCORE_ROW: gl.constexpr, RAGGED_KEYS: gl.constexpr, HAS_KEY_LENGTHS: gl.constexpr,
                    BLOCK_N: gl.constexpr, SPARSE_BLOCK_M: gl.constexpr, SPARSE_BLOCK_N: gl.constexpr,
                    HEAD_DIM: gl.constexpr, HEAD_DIM2: gl.constexpr, STAGES: gl.constexpr, WARPGROUPS: gl.constexpr,
                    O_STAGED: gl.constexpr):
    """The program's work items (batch, head, query tile) (``work_schedule.program_items``, ``_work_item``). q/k/v_desc
    read Q, K, V as ``row_view`` matrices (rows of pitch stride_*m, element (b, h, s, 0) at row (b * stride_b + h *
    stride_h) // pitch + s and column (...) % pitch) in boxes of HEAD_DIM columns, q2/k2/v2_desc the HEAD_DIM2 columns
    after them (the same descriptors, unused, without a second part); O (B, H, q_len, HEAD_DIM + HEAD_DIM2) and LSE (B,
    H, q_len) are contiguous, o_desc reads O as B * H * q_len rows in boxes of 64 (O_STAGED; q_desc without);
    KEY_LENGTHS (B,) int32 with HAS_KEY_LENGTHS (a placeholder without)."""
    HALF_M: gl.constexpr = q_desc.block_type.shape[0]
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [WARPGROUPS, HALF_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    if HEAD_DIM2 > 0:
        q2_smem = gl.allocate_shared_memory(q2_desc.dtype, [WARPGROUPS, HALF_M, HEAD_DIM2], q2_desc.layout)
        k2_smem = gl.allocate_shared_memory(k2_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM2], k2_desc.layout)
        v2_smem = gl.allocate_shared_memory(v2_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM2], v2_desc.layout)
    else:  # no second part: its buffers are the first's, which nothing reads as theirs
        q2_smem = q_smem
        k2_smem = k_smem
        v2_smem = v_smem
    if O_STAGED:
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [WARPGROUPS, HALF_M, HEAD_DIM], o_desc.layout)
    else:  # a stand-in nothing reads
        o_smem = q_smem
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    mbarrier.init(q_empty, count=WARPGROUPS)  # one arrival per consumer warpgroup
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=WARPGROUPS)
        mbarrier.init(v_empty.index(i), count=WARPGROUPS)

    # the partitions' arguments but their constexprs (and the consumers' warpgroup), which are passed inline: a
    # tuple variable holding them would lose their constness
    shared = (q_smem, k_smem, v_smem, q2_smem, k2_smem, v2_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
              O, LSE, o_desc, o_smem, FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, SCHEDULE, KEY_LENGTHS, MODS, stride_num_b,
              stride_num_h, stride_num_m, stride_idx_b, stride_idx_h, stride_idx_m, heads, q_len, kv_len, n_items,
              num_programs, qk_scale)
    load_args = (q_desc, k_desc, v_desc, q2_desc, k2_desc, v2_desc, q_smem, k_smem, v_smem, q2_smem, k2_smem, v2_smem,
                 q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, SCHEDULE,
                 KEY_LENGTHS, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
                 stride_vn, stride_num_b, stride_num_h, stride_num_m, stride_idx_b, stride_idx_h, stride_idx_m, heads,
                 groups, q_len, kv_len, n_items, num_programs)
    # Registers a thread: two consumers' tiles take 240; of three, the first (Triton's default partition, given what
    # the others leave of the 64K with the warps padded to whole warpgroups) 168 and the others 160 (168 each left it
    # 152, too few for its products in flight: ptxas then serialized every product of the kernel). The producer's
    # loads take 24. It is one warp, as FlashAttention-4's (whose other three exit): four spun on the same
    # mbarriers, 8 % of the instructions issued, and took issue slots from the consumers (one warp: 0.99-1.05x on an
    # H100, most at hd64). The partitions are written out for each number of consumers, their constexprs inline
    # (Gluon's front end takes no list comprehension or list arithmetic here).
    if WARPGROUPS == 3:
        gl.warp_specialize([
            (_consumer, (shared, 0, MASK_KIND, SCHEDULED, IS_CAUSAL, MASK_MOD, SCORE_MOD, SCORE_KEYS, SCORE_ROW,
                         RAGGED_KEYS, HAS_KEY_LENGTHS, BLOCK_N, SPARSE_BLOCK_M, SPARSE_BLOCK_N, HEAD_DIM, HEAD_DIM2,
                         STAGES, O_STAGED)),
            (_consumer, (shared, 1, MASK_KIND, SCHEDULED, IS_CAUSAL, MASK_MOD, SCORE_MOD, SCORE_KEYS, SCORE_ROW,
                         RAGGED_KEYS, HAS_KEY_LENGTHS, BLOCK_N, SPARSE_BLOCK_M, SPARSE_BLOCK_N, HEAD_DIM, HEAD_DIM2,
                         STAGES, O_STAGED)),
            (_consumer, (shared, 2, MASK_KIND, SCHEDULED, IS_CAUSAL, MASK_MOD, SCORE_MOD, SCORE_KEYS, SCORE_ROW,
                         RAGGED_KEYS, HAS_KEY_LENGTHS, BLOCK_N, SPARSE_BLOCK_M, SPARSE_BLOCK_N, HEAD_DIM, HEAD_DIM2,
                         STAGES, O_STAGED)),
            (_producer, (load_args, MASK_KIND, SCHEDULED, RAGGED_KEYS, HAS_KEY_LENGTHS, BLOCK_N, SPARSE_BLOCK_M,
                         SPARSE_BLOCK_N, HEAD_DIM2, STAGES)),
        ], [4, 4, 1], [160, 160, 24])
    else:
        gl.warp_specialize([
            (_consumer, (shared, 0, MASK_KIND, SCHEDULED, IS_CAUSAL, MASK_MOD, SCORE_MOD, SCORE_KEYS, SCORE_ROW,
                         RAGGED_KEYS, HAS_KEY_LENGTHS, BLOCK_N, SPARSE_BLOCK_M, SPARSE_BLOCK_N, HEAD_DIM, HEAD_DIM2,
                         STAGES, O_STAGED)),
            (_consumer, (shared, 1, MASK_KIND, SCHEDULED, IS_CAUSAL, MASK_MOD, SCORE_MOD, SCORE_KEYS, SCORE_ROW,
                         RAGGED_KEYS, HAS_KEY_LENGTHS, BLOCK_N, SPARSE_BLOCK_M, SPARSE_BLOCK_N, HEAD_DIM, HEAD_DIM2,
                         STAGES, O_STAGED)),
            (_producer, (load_args, MASK_KIND, SCHEDULED, RAGGED_KEYS, HAS_KEY_LENGTHS, BLOCK_N, SPARSE_BLOCK_M,
                         SPARSE_BLOCK_N, HEAD_DIM2, STAGES)),
        ], [4, 1], [240, 24])


# ---------------------------------------------------------------------------------- when it applies
def applies(q: torch.Tensor, k: torch.Tensor, mask, row_keys: float, dropout: bool, special_per_score: bool,
            functions: bool) -> bool:
    """Whether calls with these inputs and mask take this forward (on a GPU ``launch.gluon_hopper``
    admits): ``gluon_tools.takes`` them, the score function (if any) evaluates no exp, log, tanh or sqrt
    per score (``special_per_score``: one that is not separable; tanh soft-capping ran 0.72x the Triton
    forward at S=4096 on an H100, its exp and division beside the softmax's exp2 on the special-function
    units of warpgroups that take turns), and with "auto", rows of ``row_keys`` keys on average, at least
    the threshold of the kernel it would run (AUTO_ROW_KEYS; AUTO_ROW_KEYS_THREE for three consumers,
    AUTO_ROW_KEYS_STAGED for two that store o through shared memory without a function: ``functions`` says whether a
    mask or score function comes with the mask). The layout of each call's tensors is checked at
    launch. A plan keeps the answer: SPARSEFLASH_GLUON set later changes the plans made after it."""
    key = q.shape[3], mask.kind is MaskKind.CAUSAL
    threshold = AUTO_ROW_KEYS.get(key, math.inf)
    if warpgroups(mask.kind, q.shape[3], functions, q.shape[2]) == 3:
        threshold = AUTO_ROW_KEYS_THREE[key]
    elif not functions and o_stored_staged(mask.kind, q.shape[3], q.shape[2], k.shape[2]):
        threshold = AUTO_ROW_KEYS_STAGED.get(key, threshold)
    return not special_per_score and gluon_tools.chosen(
        q, k, mask, TILES, row_keys, threshold, dropout,
        ragged=(False, True))  # a query tile past q_len: its rows past it are computed, not stored


def warpgroups(kind: MaskKind, head_dim: int, functions: bool, q_len: int) -> int:
    """The consumer warpgroups of a query tile: three at head dims 48 and 64 (AUTO_ROW_KEYS_THREE) for DENSE and
    CAUSAL masks without a mask or score function (``functions``) where 192-row tiles compute at most THREE_PADDING
    more rows than two's 128-row tiles, else two. At hd64 a warpgroup's softmax of a
    64 x 128 score tile takes longer than the other's two products (a tile's exponentials take as long as its
    products on the tensor cores), so that with two each waits on its own softmax; a third keeps the tensor cores
    fed. Not for SPARSE (it walks blocks of 128 query rows, which 192-row tiles do not divide), with a function
    (its registers spill at three warpgroups' 160 a thread) nor at head dims 80 and 96 (ptxas serializes the
    products)."""
    three = kind is not MaskKind.SPARSE and not functions and (head_dim, False) in AUTO_ROW_KEYS_THREE
    rows_three, rows_two = (math.ceil(q_len / (n * HALF_M)) * n * HALF_M for n in (3, 2))
    return 3 if three and rows_three <= rows_two * (1 + THREE_PADDING) else 2


# ---------------------------------------------------------------------------------- launcher
FORWARD_GLUON = Launcher(_attn_fwd_gluon)


@functools.lru_cache(maxsize=None)
def _constexprs(mask_kind: int, scheduled: bool, causal: bool, sparse_block: tuple[int, int], head_dim: int,
                parts: tuple[int, int], mods: tuple, warpgroups: int, ragged_keys: bool, key_lengths: bool,
                o_staged: bool) -> dict:
    mask_mod, score_mod, score_keys, score_row = mods
    first, second = parts
    return dict(MASK_KIND=mask_kind, SCHEDULED=scheduled, IS_CAUSAL=causal, MASK_MOD=mask_mod, SCORE_MOD=score_mod,
                SCORE_KEYS=score_keys, SCORE_ROW=score_row, RAGGED_KEYS=ragged_keys, HAS_KEY_LENGTHS=key_lengths,
                BLOCK_N=KEY_TILE[head_dim], SPARSE_BLOCK_M=sparse_block[0], SPARSE_BLOCK_N=sparse_block[1],
                HEAD_DIM=first, HEAD_DIM2=second,
                STAGES=(O_STAGED_STAGES if o_staged else STAGES)[head_dim], WARPGROUPS=warpgroups, O_STAGED=o_staged,
                num_warps=4)


def launch(plan, q, k, v, o, lse, key_lengths: torch.Tensor, mods: torch.Tensor, ahead: bool = False) -> bool:
    """Launch the forward on a problem ``applies`` admits (o and lse contiguous, or ``Standin``s with
    ``ahead``: only compile; key_lengths as ``plan.key_lengths_arg`` gives it; mods: the plan's MODS table of the
    captured tensors); False (nothing launched) where TMA cannot read one of q, k, v's layouts."""
    arguments = _arguments(plan, q, k, v, o, lse, key_lengths, mods)
    if arguments is None:
        return False
    (FORWARD_GLUON.compile_ahead if ahead else FORWARD_GLUON)(*arguments)
    return True


def compiling(plan, q, k, v, o, lse, key_lengths: torch.Tensor, mods: torch.Tensor) -> bool:
    """Whether the compile ahead of ``launch`` with these arguments is in flight (``Launcher.compiling``);
    False where TMA cannot read a layout (``launch`` launches nothing)."""
    arguments = _arguments(plan, q, k, v, o, lse, key_lengths, mods)
    return arguments is not None and FORWARD_GLUON.compiling(*arguments)


def _arguments(plan, q, k, v, o, lse, key_lengths: torch.Tensor, mods: torch.Tensor) -> tuple | None:
    """The launch's (grid, tensors, scalars, constexprs), or None where TMA cannot read q, k or v."""
    rows = gluon_tools.layout_rows(plan.per_layout.setdefault("gluon", {}), (q, k, v))
    if None in rows:
        return None
    key_tile = KEY_TILE[q.shape[3]]
    # the head dim's parts (``plan.head_dim_parts``; KEY_TILE lists none with a padded part): a box per part of
    # each of q, k, v, the first part's again where there is no second
    parts = plan.head_dim_parts["HEAD_DIM"], plan.head_dim_parts["HEAD_DIM2"]
    boxes = list(zip((q, k, v), rows, (HALF_M, key_tile, key_tile)))
    descriptors = [row_view(x, x_rows, box_rows, width) for width in parts if width
                   for x, x_rows, box_rows in boxes]
    if not parts[1]:
        descriptors *= 2
    o_staged = o_stored_staged(plan.kind, q.shape[3], plan.q_len, plan.kv_len)
    o_desc = row_view(o, math.prod(o.shape[:3]), HALF_M) if o_staged else descriptors[0]
    tables, table_strides = plan.tables_of("kv")
    consumers = warpgroups(plan.kind, q.shape[3], plan.functions, plan.q_len)
    n_items = plan.batch * plan.heads * math.ceil(plan.q_len / (consumers * HALF_M))
    programs = min(n_items, multiprocessors(q.device))
    schedule = _schedule(plan, consumers, key_tile, programs)
    return ((programs,), (*descriptors, o_desc, o, lse, *tables, plan.placeholder if schedule is None else schedule,
                          key_lengths, mods),
            (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *table_strides, plan.heads, plan.groups,
             plan.q_len, plan.kv_len, n_items, programs, plan.qk_scale),
            _constexprs(KIND_CODES[plan.kind], schedule is not None, plan.causal, plan.sparse_block, q.shape[3],
                        parts, (plan.mask_mod, plan.score_mod, plan.score_keys, plan.score_row), consumers,
                        plan.kv_len % key_tile != 0, plan.has_key_lengths, o_staged))


def o_stored_staged(kind: MaskKind, head_dim: int, q_len: int, kv_len: int) -> bool:
    """Whether the consumers store o through shared memory (O_STAGED): DENSE and CAUSAL masks at the head dims of
    ``O_STAGED_STAGES``, on rows of at most ``O_STAGED_KEYS`` keys, q_len a multiple of a consumer's 64 rows. SPARSE
    masks keep their stores and K/V buffers (unmeasured there; with a document mask_mod at hd128 ptxas spilled 68
    bytes a thread staged, none otherwise)."""
    return (kind is not MaskKind.SPARSE and head_dim in O_STAGED_STAGES and kv_len <= O_STAGED_KEYS
            and q_len % HALF_M == 0)


def _schedule(plan, consumers: int, key_tile: int, programs: int) -> torch.Tensor | None:
    """The table of each program's work items (``work_schedule``: item bh * query tiles + query tile) where rows
    differ in length (CAUSAL, and SPARSE masks whose longest row of blocks has over ``work_schedule.UNEQUAL_LINES``
    times the mean), else None (items pid, pid + programs, ...). Kept in the plan.

    The items of each (batch, head) in turn, the longest rows first, each go to the program whose items so far cost
    least (``work_schedule.greedy_schedule``, an item costing ITEM_COST besides its key tiles). Causal forward on an
    H200, against one item a program: 0.93-0.96x the time at S=2304, 0.95-0.96x at 3000, 0.96x at 4096,
    0.97-0.99x at 7000, 1.00x at 16384 (hd64 and hd128). Items dealt out in turn instead (item pid + i * programs)
    gave program p the query tiles p, p + 4, ... of each head's 128 at S=16384, only long or only short rows (0.72x
    as fast)."""
    # kept by programs (consumers and key_tile follow the plan)
    return kept_schedule(plan, "gluon_schedule", programs, lambda: _item_tiles(plan, consumers, key_tile), ITEM_COST)


def _item_tiles(plan, consumers: int, key_tile: int) -> torch.Tensor | None:
    """(B * H, query tiles) key tiles of each work item where rows differ in length (``_schedule``), else None."""
    block_m = consumers * HALF_M
    m_tiles = math.ceil(plan.q_len / block_m)
    if plan.kind is MaskKind.CAUSAL:
        ends = torch.clamp(torch.arange(1, m_tiles + 1) * block_m, max=plan.kv_len)
        return ((ends + key_tile - 1) // key_tile).expand(plan.batch * plan.heads, -1)
    if plan.kind is not MaskKind.SPARSE:
        return None
    full_num, _, part_num, _ = plan.tables_of("kv")[0]
    blocks = (full_num + part_num).float().cpu()  # (heads or batch, heads, rows) of the layout
    if blocks.amax().item() <= UNEQUAL_LINES * blocks.mean().item():
        return None
    per_block = (plan.sparse_block[0] // block_m, plan.sparse_block[1] // key_tile)
    tiles = blocks.repeat_interleave(per_block[0], dim=-1)[..., :m_tiles] * per_block[1]
    while tiles.dim() < 3:
        tiles = tiles.unsqueeze(0)
    return tiles.expand(plan.batch, plan.heads, -1).reshape(plan.batch * plan.heads, m_tiles)
