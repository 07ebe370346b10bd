"""``@triton.jit`` building blocks shared by the forward and backward kernels.

Constexpr flags the helpers take (the kernels pass their own through):
  FROM_TABLE      a walk over the mask blocks listed in a table row (SPARSE) instead of tiles 0, 1, ...
  MASK_KIND       0 DENSE, 1 CAUSAL, 2 SPARSE (``plan.KIND_CODES``).
  IS_CAUSAL       SPARSE: its partial blocks are cut by q_idx >= kv_idx (``forward_row``).
  HAS_KEY_LENGTHS key_lengths[b] bounds the keys of batch b.
  EVEN_LENGTHS    DENSE and CAUSAL: the tiles divide both lengths, so no load needs a bound (``forward_row``).
  BOUNDED         a load of rows or keys some of which may lie past the tensor (``load_part``).
  APPLY_CAUSAL    apply q_idx >= kv_idx to the scores of a tile.
  APPLY_KV_BOUND  drop keys at or past kv_bound (ragged tail, key_lengths).
  MAY_BE_EMPTY    a row of a tile's scores may be all -inf (masked tiles).
  BLOCK_M/BLOCK_N kernel tile (queries/keys); each divides SPARSE_BLOCK_M/SPARSE_BLOCK_N, the mask block.
  HEAD_DIM        the head dim padded to a power of two >= 16; or, with HEAD_DIM2, the first of two parts.
  HEAD_DIM2       0, or the width of a second part of the head dim, columns [HEAD_DIM, HEAD_DIM + HEAD_DIM2)
                  (a power of two >= 16): the kernels compute a head dim that is not a power of two
                  (96 = 64 + 32) as two parts, two dots a product, instead of padding it. Without one, the
                  second part's values (q2, acc2, ...) are empty tuples, which compile to nothing (a 0
                  would become an i32 that loops and branches carry).
  D_PADDED        the real head dim is smaller than the columns computed: bound the loads (the last part's).
  V_TRANSPOSED    load the value tile as (D, BN) (the dQ loop's layout) instead of (BN, D).
  DOT_PRECISION   tl.dot input precision ("tf32" for fp32 inputs on the GPU, "ieee" otherwise).
  WIDEN_DOTS      interpreter only: widen dot operands to fp32 (its bf16 dot is wrong).
  MASK_MOD        a generated element predicate (codegen.py), applied with APPLY_MASK_MOD (partial
                  tiles), or None.
  SCORE_MOD       a generated score function (codegen.py) applied to every computed score, or None.
  SCORE_KEYS      a score function's key term's steps over a tile, where it is linear in kv_idx
                  (codegen.py): computed once, then one value per tile; or None.
  SCORE_ROW       its per-row term (codegen.py: a separable function's scores are computed at the
                  tile's reference query ``q_ref``, and the lse gets the difference back), or None.
  DROPOUT         drop probabilities (``dropout_kept``: seed, threshold) and scale the kept ones by
                  drop_scale (sparseflash.attention.dropout states the pattern).
  ALIGNED_ROWS    a forward tile's rows are BLOCK_M consecutive queries from a multiple of 16 (the
                  regular forward's; the decode forward packs heads): dropout draws per tile.

Scores are kept in base 2: the kernels scale q k^T by ``scale * log2(e)`` and use exp2/log2. A
score_mod sees the natural score ``scale * q.k`` and its result is then scaled by log2(e).
"""

import triton
import triton.language as tl

from sparseflash.attention import dropout

# Arguments that change with the sequence length and are not specialised on (``do_not_specialize``),
# so that a new length reuses the compiled kernel: the lengths and the strides of the row tables
# (block counts). The tensor strides stay specialised: their divisibility decides the width of
# vector loads.
ROW_LENGTH_ARGS = ["q_len", "kv_len", "stride_num_b", "stride_num_h", "stride_num_m", "stride_idx_b",
                   "stride_idx_h", "stride_idx_m"]
# The dropout threshold changes with the drop probability: a new probability compiles nothing new.
DROPOUT_ARGS = ["dropout_threshold"]

@triton.jit
def mma(a, b, acc, DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr):
    """``tl.dot(a, b, acc)``; WIDEN_DOTS (interpreter only) widens the operands to fp32 first,
    since the interpreter's bf16 dot is wrong. The operands keep their bf16/fp16 rounding."""
    if WIDEN_DOTS:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def second_part_columns(HEAD_DIM: tl.constexpr, HEAD_DIM2: tl.constexpr):
    """The head dim's second part's columns, HEAD_DIM + [0, HEAD_DIM2), or without one ()."""
    if HEAD_DIM2 > 0:
        return HEAD_DIM + tl.arange(0, HEAD_DIM2)
    else:
        return ()


@triton.jit
def load_part(row_ptrs, stride_d, rows_in, offs_d, head_dim, BOUNDED: tl.constexpr):
    """Columns offs_d of rows of a (rows, head dim) tensor, ``row_ptrs`` (BM, 1) pointing at their
    column 0; with BOUNDED, rows outside rows_in (BM, 1) and columns past head_dim read 0."""
    if BOUNDED:
        return tl.load(row_ptrs + offs_d[None, :] * stride_d, mask=rows_in & (offs_d[None, :] < head_dim), other=0.0)
    else:
        return tl.load(row_ptrs + offs_d[None, :] * stride_d)


@triton.jit
def load_head_parts(row_ptrs, stride_d, rows_in, offs_d, offs_d2, head_dim, HEAD_DIM2: tl.constexpr):
    """``load_part`` of columns offs_d and, with HEAD_DIM2, of the second part's, offs_d2 (else ()),
    bounded."""
    x = load_part(row_ptrs, stride_d, rows_in, offs_d, head_dim, True)
    x2 = ()
    if HEAD_DIM2 > 0:
        x2 = load_part(row_ptrs, stride_d, rows_in, offs_d2, head_dim, True)
    return x, x2


@triton.jit
def store_part(row_ptrs, stride_d, rows_in, x, offs_d, head_dim):
    """Store x at columns offs_d of the rows ``load_part`` reads, in the tensor's dtype, in rows_in and below
    head_dim."""
    tl.store(row_ptrs + offs_d[None, :] * stride_d, x.to(row_ptrs.dtype.element_ty),
             mask=rows_in & (offs_d[None, :] < head_dim))


@triton.jit
def store_head_parts(row_ptrs, stride_d, rows_in, x, x2, offs_d, offs_d2, head_dim, HEAD_DIM2: tl.constexpr):
    """Store what ``load_head_parts`` reads: x at columns offs_d and, with HEAD_DIM2, x2 at offs_d2."""
    store_part(row_ptrs, stride_d, rows_in, x, offs_d, head_dim)
    if HEAD_DIM2 > 0:
        store_part(row_ptrs, stride_d, rows_in, x2, offs_d2, head_dim)


@triton.jit
def listed_block(idx_ptr, t, t_hi, FROM_TABLE: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_BLOCK_N: tl.constexpr):
    """The mask block that holds tile ``t`` of a walk over the blocks listed at idx_ptr: 0 without a table, and
    for tiles from t_hi on but tile 0, which always reads the table's first entry (below).

    The loops read it for the next tile at the end of each tile and carry it. A read that feeds
    the tile's own addresses makes Triton's pipeliner copy it asynchronously too, and then wait
    for every copy in flight at each tile (``DEPBAR.LE SB0, 0x0``) instead of keeping
    num_stages - 1 tiles of K/V (or Q/dO) in flight; a read at the start of the tile lives across
    its dots and made the dK/dV loop spill (docs/kernels.md, "The table walk").

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
PHILOX_ROUNDS = tl.constexpr(dropout.ROUNDS)


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
def row_tile_ranges(FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, b, h, q_start, kv_bound,
                    stride_num_b, stride_num_h, stride_num_m, stride_idx_b, stride_idx_h, stride_idx_m,
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
        num_off = b * stride_num_b + h * stride_num_h + mask_row * stride_num_m
        idx_off = b * stride_idx_b + h * stride_idx_h + mask_row * stride_idx_m
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
def tiles_before_bound(full_idx, full_hi, kv_bound, BLOCK_N: tl.constexpr, SPARSE_BLOCK_N: tl.constexpr):
    """How many of the first full_hi tiles of a walk over the full blocks listed at full_idx end at or before
    kv_bound, and so need no key bound: all but those of the walk's last block past it. ``row_tile_ranges`` keeps
    the blocks below cdiv(kv_bound, SPARSE_BLOCK_N), ascending, so only the last may run across kv_bound. Its
    entry is read even at full_hi = 0: every table row holds an entry 0 (``listed_block``)."""
    tiles_per_block: tl.constexpr = SPARSE_BLOCK_N // BLOCK_N
    last = tl.maximum(full_hi - 1, 0) // tiles_per_block
    last_start = tl.load(full_idx + last) * SPARSE_BLOCK_N
    inside = tl.minimum(tl.maximum(kv_bound - last_start, 0) // BLOCK_N, tiles_per_block)
    return tl.minimum(full_hi, last * tiles_per_block + inside)


@triton.jit
def mod_positions(offs_m, offs_kv, q_len, kv_len):
    """Query and key positions as a mask or score function sees them, clamped into the sequences (a
    tile's rows or keys past them are dropped anyway, and a captured tensor as long as a sequence is
    then never read past its end)."""
    return tl.minimum(offs_m, q_len - 1), tl.minimum(offs_kv, kv_len - 1)


@triton.jit
def modded_scores(qk, b, h, q_idx, kv_idx, q_ref, kv_start, keys, qk_scale, MODS, SCORE_MOD: tl.constexpr,
                  SCORE_KEYS: tl.constexpr):
    """Base-2 scores of the products q.k in ``qk`` (any tile layout; q_idx and kv_idx broadcast to
    it) and the score function's derivative with respect to the natural score (1.0 without one).
    ``q_ref``: the tile's reference query, a scalar position in the sequence (``row_term``);
    ``kv_start``: its first key, and ``keys`` the steps of a key term linear in kv_idx over the tile
    (``key_steps``, in qk's layout)."""
    if SCORE_KEYS is not None:
        return SCORE_MOD(qk, qk_scale, b, h, q_idx, kv_start, q_ref, keys, MODS)
    elif SCORE_MOD is not None:
        return SCORE_MOD(qk, qk_scale, b, h, q_idx, kv_idx, q_ref, keys, MODS)
    else:
        return qk * qk_scale, 1.0


@triton.jit
def key_steps(b, h, offs, MODS, SCORE_KEYS: tl.constexpr):
    """The base-2 steps, over key offsets ``offs`` within a tile (their layout kept), of a score
    function's key term linear in kv_idx, which ``modded_scores`` adds to the term at the tile's first
    key: computed once per program, not per tile. 0.0 without SCORE_KEYS."""
    if SCORE_KEYS is not None:
        return SCORE_KEYS(b, h, offs, MODS)
    else:
        return 0.0


@triton.jit
def row_term(b, h, q_idx, q_ref, kv_len, MODS, SCORE_ROW: tl.constexpr):
    """The base-2 term per row that scores computed at reference query q_ref leave out of a separable
    score function (q_idx: the rows' positions in the sequence, broadcastable with h; the result has
    their shape): what the forward adds to its lse and the backward takes off the lse it subtracts.
    0.0 without SCORE_ROW. The reference key is the valid key nearest the diagonal at q_ref."""
    if SCORE_ROW is not None:
        return SCORE_ROW(b, h, q_idx, q_ref, tl.minimum(q_ref, kv_len - 1), MODS)
    else:
        return 0.0


@triton.jit
def load_key_part(k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, offs_kv, offs_d, kv_bound, head_dim,
                  BOUNDED: tl.constexpr, V_TRANSPOSED: tl.constexpr):
    """k^T (D, BN) and v (BN, D), or (D, BN) with V_TRANSPOSED, at keys offs_kv and columns offs_d; with
    BOUNDED, keys past kv_bound and columns past head_dim read 0."""
    k_ptrs = k_base + offs_kv[None, :] * stride_kn + offs_d[:, None] * stride_kd
    if V_TRANSPOSED:
        v_ptrs = v_base + offs_kv[None, :] * stride_vn + offs_d[:, None] * stride_vd
    else:
        v_ptrs = v_base + offs_kv[:, None] * stride_vn + offs_d[None, :] * stride_vd
    if BOUNDED:
        k_in = (offs_kv[None, :] < kv_bound) & (offs_d[:, None] < head_dim)
        k_t = tl.load(k_ptrs, mask=k_in, other=0.0)
        if V_TRANSPOSED:
            v = tl.load(v_ptrs, mask=k_in, other=0.0)
        else:
            v = tl.load(v_ptrs, mask=(offs_kv[:, None] < kv_bound) & (offs_d[None, :] < head_dim), other=0.0)
    else:
        k_t = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    return k_t, v


@triton.jit
def key_tile_scores(q, q2, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, offs_m, offs_kv, offs_d,
                    offs_d2, kv_bound, head_dim, qk_scale, b, h, q_len, kv_len, q_ref, kv_start, keys, MODS,
                    APPLY_CAUSAL: tl.constexpr, APPLY_KV_BOUND: tl.constexpr, APPLY_MASK_MOD: tl.constexpr,
                    MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr, SCORE_KEYS: tl.constexpr,
                    HEAD_DIM2: tl.constexpr, D_PADDED: tl.constexpr, V_TRANSPOSED: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr):
    """Load the key tile at offs_kv and score it against q (columns offs_d) and, with HEAD_DIM2, q2
    (columns offs_d2; q2 and offs_d2 are unused otherwise).

    Returns the base-2 scores (BM, BN) with dropped ones at -inf (keys past kv_bound; with
    APPLY_CAUSAL, keys after the query; with APPLY_MASK_MOD, what MASK_MOD drops), k^T (D, BN), v as
    (BN, D), or (D, BN) with V_TRANSPOSED, the second part's k^T and v (() without HEAD_DIM2), and
    SCORE_MOD's derivative (``modded_scores``)."""
    k_t, v = load_key_part(k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, offs_kv, offs_d, kv_bound,
                           head_dim, APPLY_KV_BOUND or (D_PADDED and HEAD_DIM2 == 0), V_TRANSPOSED)
    qk = mma(q, k_t, None, DOT_PRECISION, WIDEN_DOTS)
    k2_t, v2 = (), ()
    if HEAD_DIM2 > 0:
        k2_t, v2 = load_key_part(k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, offs_kv, offs_d2,
                                 kv_bound, head_dim, APPLY_KV_BOUND or D_PADDED, V_TRANSPOSED)
        qk = mma(q2, k2_t, qk, DOT_PRECISION, WIDEN_DOTS)
    q_idx, kv_idx = mod_positions(offs_m[:, None], offs_kv[None, :], q_len, kv_len)
    s, d_score = modded_scores(qk, b, h, q_idx, kv_idx, q_ref, kv_start, keys, qk_scale, MODS, SCORE_MOD, SCORE_KEYS)
    if APPLY_CAUSAL or APPLY_KV_BOUND or APPLY_MASK_MOD:
        keep = offs_kv[None, :] < kv_bound
        if APPLY_CAUSAL:
            keep = keep & (offs_m[:, None] >= offs_kv[None, :])
        if APPLY_MASK_MOD:
            keep = keep & MASK_MOD(b, h, q_idx, kv_idx, MODS)
        s = tl.where(keep, s, float("-inf"))
    return s, k_t, v, k2_t, v2, d_score


@triton.jit
def load_seed(SEED, DROPOUT: tl.constexpr):
    """The dropout seed (int64) at SEED, or 0 without DROPOUT."""
    if DROPOUT:
        return tl.load(SEED)
    else:
        return 0


@triton.jit
def _kept_byte(word, byte, threshold):
    """A score with the random byte ``(word >> 8 * byte) & 0xFF`` is kept when the byte is at least
    threshold; compared as the byte moved to the top (unsigned): the top byte needs no instruction
    to extract it."""
    return (word << (24 - 8 * byte)) >= (threshold.to(tl.uint32) << 24)


@triton.jit
def dropout_kept(seed, drop_row, q_idx, kv_idx, threshold):
    """Whether dropout keeps the scores at query positions q_idx and key positions kv_idx (tiles that
    broadcast together, either way round) of row stream drop_row (b * H + h: a scalar, or a tile for
    rows of several heads), score by score: Philox-4x32 (PHILOX_ROUNDS rounds) keyed by seed (int64)
    at the counter (kv_idx // 32 * 4 + kv_idx % 8 // 2, q_idx // 16 * 8 + q_idx % 8, drop_row, 0); of
    its four words the score takes word kv_idx // 8 % 4, of that word byte 2 * (q_idx // 8 % 2) +
    kv_idx % 2, and is kept when the byte is at least threshold (sparseflash.attention.dropout states
    it, and computes the same in PyTorch)."""
    c0 = (((kv_idx >> 5) << 2) | ((kv_idx & 7) >> 1)).to(tl.uint32)
    c1 = (((q_idx >> 4) << 3) | (q_idx & 7)).to(tl.uint32)
    w0, w1, w2, w3 = tl.philox(seed, c0, c1, drop_row, 0, PHILOX_ROUNDS)
    word_index = (kv_idx >> 3) & 3
    word = tl.where(word_index < 2, tl.where(word_index == 0, w0, w1), tl.where(word_index == 2, w2, w3))
    return _kept_byte(word, (2 * ((q_idx >> 3) & 1) + (kv_idx & 1)).to(tl.uint32), threshold)


@triton.jit
def _kept_bytes(word, threshold):
    """The four scores of a word: [..., j % 2, i // 8 % 2] (byte 2 * (i // 8 % 2) + j % 2)."""
    return tl.join(tl.join(_kept_byte(word, 0, threshold), _kept_byte(word, 1, threshold)),
                   tl.join(_kept_byte(word, 2, threshold), _kept_byte(word, 3, threshold)))


@triton.jit
def _kept_query_rows(seed, drop_row, row_start, col_start, threshold, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``dropout_kept_tile`` with the queries along the rows: a (ROWS/2, COLS/8) grid of counters, each
    for its sixteen scores (i, j), (i, j + 1), (i, j + 8), (i, j + 9), ... (i, j + 25) and the same at
    i + 8, all held by one thread of a tensor-core tile."""
    rows = (row_start // 2 + tl.arange(0, ROWS // 2)).to(tl.uint32)[:, None]  # q' of the rows i
    cols = (col_start // 8 + tl.arange(0, COLS // 8)).to(tl.uint32)[None, :]  # the key groups
    w0, w1, w2, w3 = tl.philox(seed, cols, rows, drop_row, 0, PHILOX_ROUNDS)  # word j // 8 % 4
    sixteens = tl.join(tl.join(_kept_bytes(w0, threshold), _kept_bytes(w1, threshold)),
                       tl.join(_kept_bytes(w2, threshold), _kept_bytes(w3, threshold)))
    # [q', group, j % 2, i // 8 % 2, j // 8 % 2, j // 16 % 2]
    #   -> [i // 16, i // 8 % 2, i % 8, j // 32, j // 16 % 2, j // 8 % 2, j % 8 // 2, j % 2]
    sixteens = tl.reshape(sixteens, [ROWS // 16, 8, COLS // 32, 4, 2, 2, 2, 2])
    return tl.reshape(tl.permute(sixteens, 0, 5, 1, 2, 7, 6, 3, 4), [ROWS, COLS])


@triton.jit
def _kept_key_rows(seed, drop_row, row_start, col_start, threshold, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``dropout_kept_tile`` with the keys along the rows: of a counter's sixteen scores a thread of a
    tensor-core tile holds those of keys j and j + 8 (j + 1 and j + 16 sit with other threads), so
    each thread draws the counter of its keys (a (ROWS/2, COLS/2) grid whose rows for keys j, j + 1,
    j + 16 and j + 17 draw the same counters) for the four scores (j, i), (j, i + 8), (j + 8, i),
    (j + 8, i + 8)."""
    r = tl.arange(0, ROWS // 2)  # the rows j of the quads: row_start + r // 8 * 16 + r % 8
    groups = (row_start // 8 + (r >> 4) * 4 + ((r & 7) >> 1)).to(tl.uint32)[:, None]
    cols = (col_start // 2 + tl.arange(0, COLS // 2)).to(tl.uint32)[None, :]  # q' of the columns i
    w0, w1, w2, w3 = tl.philox(seed, groups, cols, drop_row, 0, PHILOX_ROUNDS)
    odd = (((r >> 3) & 1) == 1)[:, None]  # the rows j with j // 16 odd take words 2 and 3 (j // 8 % 4)
    low, high = tl.where(odd, w2, w0), tl.where(odd, w3, w1)  # the words of keys j and j + 8
    byte = (r & 1).to(tl.uint32)[:, None]  # j % 2; + 2 for the columns i + 8
    quads = tl.join(tl.join(_kept_byte(low, byte, threshold), _kept_byte(low, byte + 2, threshold)),
                    tl.join(_kept_byte(high, byte, threshold), _kept_byte(high, byte + 2, threshold)))
    # [row', column', column half, row half] -> [row blocks of 16, row half, 8, column blocks, column half, 8]
    quads = tl.reshape(quads, [ROWS // 16, 8, COLS // 16, 8, 2, 2])
    return tl.reshape(tl.permute(quads, 0, 5, 1, 2, 4, 3), [ROWS, COLS])


@triton.jit
def dropout_kept_tile(seed, drop_row, row_start, col_start, threshold, ROWS: tl.constexpr, COLS: tl.constexpr,
                      ROWS_ARE_QUERIES: tl.constexpr):
    """``dropout_kept`` of the (ROWS, COLS) tile of positions row_start + [0, ROWS) and col_start + [0, COLS)
    (each start a multiple of its size, the query side at least 16), queries along the rows
    (ROWS_ARE_QUERIES) or along the columns. Where the key side is at least 32 it draws each counter
    once per thread that holds its scores and spreads the words by join, reshape and permute, in the
    order a thread of a tensor-core tile holds the scores (rows r and r + 8, columns c, c + 1, c + 8,
    c + 9, ...), so that the tile comes out in the dot's layout without moving data: 16 scores a draw
    with the queries along the rows, 4 with the keys. Narrower key tiles draw score by score."""
    if ROWS_ARE_QUERIES:
        if COLS % 32 == 0:
            return _kept_query_rows(seed, drop_row, row_start, col_start, threshold, ROWS, COLS)
        else:
            return dropout_kept(seed, drop_row, (row_start + tl.arange(0, ROWS))[:, None],
                                (col_start + tl.arange(0, COLS))[None, :], threshold)
    else:
        if ROWS % 32 == 0:
            return _kept_key_rows(seed, drop_row, row_start, col_start, threshold, ROWS, COLS)
        else:
            return dropout_kept(seed, drop_row, (col_start + tl.arange(0, COLS))[None, :],
                                (row_start + tl.arange(0, ROWS))[:, None], threshold)


@triton.jit
def forward_kept(seed, drop_row, row_start, col_start, offs_m, offs_kv, threshold, DROPOUT: tl.constexpr,
                 ALIGNED_ROWS: tl.constexpr):
    """The dropout keep mask of a forward tile (rows offs_m from row_start, keys offs_kv from col_start):
    by ``dropout_kept_tile`` where the rows are consecutive queries from a multiple of 16 (ALIGNED_ROWS),
    else score by score; 0 (unused) without DROPOUT."""
    if DROPOUT:
        if ALIGNED_ROWS:
            return dropout_kept_tile(seed, drop_row, row_start, col_start, threshold, offs_m.shape[0],
                                     offs_kv.shape[0], True)
        else:
            return dropout_kept(seed, drop_row, offs_m[:, None], offs_kv[None, :], threshold)
    else:
        return 0


@triton.jit
def online_softmax_step(acc, acc2, l_i, m_i, s, v, v2, kept, MAY_BE_EMPTY: tl.constexpr, DROPOUT: tl.constexpr,
                        HEAD_DIM2: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr):
    """Fold one key tile, base-2 scores s (BM, BN) and values v (BN, D), into the running output
    acc (BM, D), sum l and max m; with HEAD_DIM2 also the second part's values v2 into acc2 (both
    unused otherwise). MAY_BE_EMPTY: a row of s may be all -inf (masked tiles). With DROPOUT the sum
    takes every probability and the output only those ``kept`` (BM, BN) keeps, unscaled."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MAY_BE_EMPTY:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
    else:
        m_ref = m_new
    p = tl.math.exp2(s - m_ref[:, None])
    alpha = tl.math.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if DROPOUT:
        p = tl.where(kept, p, 0.0)
    p = p.to(v.dtype)
    acc = mma(p, v, acc, DOT_PRECISION, WIDEN_DOTS)
    if HEAD_DIM2 > 0:
        acc2 = mma(p, v2, acc2 * alpha[:, None], DOT_PRECISION, WIDEN_DOTS)
    return acc, acc2, l_i, m_new


@triton.jit
def finish_rows(acc, acc2, l_i, m_i, row, HEAD_DIM2: tl.constexpr):
    """The rows' output (fp32, BM x D), its second part's (from acc2; () without HEAD_DIM2) and
    natural-log lse, with ``row`` (``row_term``, base 2) added to it; a row that saw no key, or whose
    row term is -inf, gets 0 and -inf."""
    seen = (l_i > 0.0) & (m_i + row > float("-inf"))
    l_safe = tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe) + row) * 0.6931471805599453, float("-inf"))  # * ln 2
    o2 = ()
    if HEAD_DIM2 > 0:
        o2 = tl.where(seen[:, None], acc2 / l_safe[:, None], 0.0)
    return tl.where(seen[:, None], acc / l_safe[:, None], 0.0), o2, lse


@triton.jit
def forward_tiles(acc, acc2, l_i, m_i, q, q2, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
               t_lo, t_hi, idx_ptr, offs_m, offs_n, offs_d, offs_d2, kv_bound, head_dim, qk_scale, b, h, q_len, kv_len,
               q_ref, MODS, seed, drop_row, row_start, drop_threshold,
               FROM_TABLE: tl.constexpr, APPLY_CAUSAL: tl.constexpr, APPLY_KV_BOUND: tl.constexpr,
               APPLY_MASK_MOD: tl.constexpr, MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr,
               SCORE_KEYS: tl.constexpr, DROPOUT: tl.constexpr, ALIGNED_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
               SPARSE_BLOCK_N: tl.constexpr, HEAD_DIM2: tl.constexpr, D_PADDED: tl.constexpr,
               DOT_PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr):
    """Online softmax over key tiles t_lo..t_hi-1 of one query tile (the forward kernels' loop); with
    HEAD_DIM2, over the head dim's two parts (q2, offs_d2, acc2). ``offs_m`` are the rows' query
    positions and ``h`` their head, ``drop_row`` their dropout row stream: each a scalar, or a column
    of one per row (``forward_kept`` says what ALIGNED_ROWS and row_start are)."""
    # a row of a tile may lose every key to the masks, or to a score function returning -inf
    MAY_BE_EMPTY: tl.constexpr = APPLY_CAUSAL or APPLY_KV_BOUND or APPLY_MASK_MOD or SCORE_MOD is not None
    keys = key_steps(b, h, offs_n[None, :], MODS, SCORE_KEYS)
    block = listed_block(idx_ptr, t_lo, t_hi, FROM_TABLE, BLOCK_N, SPARSE_BLOCK_N)
    for t in range(t_lo, t_hi):
        kv_start = tile_start(t, block, FROM_TABLE, BLOCK_N, SPARSE_BLOCK_N)
        offs_kv = kv_start + offs_n
        s, _, v, _, v2, _ = key_tile_scores(q, q2, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                                            offs_m, offs_kv, offs_d, offs_d2, kv_bound, head_dim, qk_scale, b, h, q_len,
                                            kv_len, q_ref, kv_start, keys, MODS, APPLY_CAUSAL, APPLY_KV_BOUND,
                                            APPLY_MASK_MOD, MASK_MOD, SCORE_MOD, SCORE_KEYS, HEAD_DIM2, D_PADDED, False,
                                            DOT_PRECISION, WIDEN_DOTS)
        kept = forward_kept(seed, drop_row, row_start, kv_start, offs_m, offs_kv, drop_threshold, DROPOUT,
                            ALIGNED_ROWS)
        acc, acc2, l_i, m_i = online_softmax_step(acc, acc2, l_i, m_i, s, v, v2, kept, MAY_BE_EMPTY, DROPOUT,
                                                  HEAD_DIM2, DOT_PRECISION, WIDEN_DOTS)
        block = listed_block(idx_ptr, t + 1, t_hi, FROM_TABLE, BLOCK_N, SPARSE_BLOCK_N)
    return acc, acc2, l_i, m_i


@triton.jit
def forward_row(q, q2, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, full_lo, full_hi, full_idx,
                part_lo, part_hi, part_idx, offs_m, offs_n, offs_d, offs_d2, kv_bound, head_dim, qk_scale, b, h, q_len,
                kv_len, q_ref, MODS, seed, drop_row, row_start, drop_threshold, drop_scale,
                MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_KEY_LENGTHS: tl.constexpr,
                EVEN_LENGTHS: tl.constexpr, MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr, SCORE_KEYS: tl.constexpr,
                SCORE_ROW: tl.constexpr, DROPOUT: tl.constexpr, ALIGNED_ROWS: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE_BLOCK_N: tl.constexpr,
                HEAD_DIM: tl.constexpr, HEAD_DIM2: tl.constexpr, D_PADDED: tl.constexpr, DOT_PRECISION: tl.constexpr,
                WIDEN_DOTS: tl.constexpr):
    """The rows' output (fp32, BLOCK_M x HEAD_DIM), its second part's (BLOCK_M x HEAD_DIM2, for q2's
    columns offs_d2; () without HEAD_DIM2) and lse over their unmasked tiles [full_lo, full_hi),
    then their masked tiles [part_lo, part_hi) (``row_tile_ranges``' runs, or a share of them); with
    DROPOUT the output of the kept probabilities, scaled by drop_scale. ``q_ref``: a query position
    next to the rows, their reference for a separable score function (``row_term``)."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    acc2 = ()
    if HEAD_DIM2 > 0:
        acc2 = tl.zeros([BLOCK_M, HEAD_DIM2], dtype=tl.float32)
    WALK_TABLES: tl.constexpr = MASK_KIND == 2
    # SPARSE's last full block may run across key_lengths[b]: its tiles from full_bounded on take the key bound,
    # the others none (bounding them all ran the forward 1-11 % slower); DENSE/CAUSAL runs stop before it
    SPLIT_AT_BOUND: tl.constexpr = WALK_TABLES and HAS_KEY_LENGTHS
    PART_NEEDS_BOUND: tl.constexpr = HAS_KEY_LENGTHS or not EVEN_LENGTHS
    full_bounded = full_hi
    if SPLIT_AT_BOUND:
        full_bounded = tl.maximum(tiles_before_bound(full_idx, full_hi, kv_bound, BLOCK_N, SPARSE_BLOCK_N), full_lo)
    acc, acc2, l_i, m_i = forward_tiles(
        acc, acc2, l_i, m_i, q, q2, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        full_lo, full_bounded, full_idx, offs_m, offs_n, offs_d, offs_d2, kv_bound, head_dim, qk_scale, b, h, q_len,
        kv_len, q_ref, MODS, seed, drop_row, row_start, drop_threshold, WALK_TABLES, False, False, False, MASK_MOD,
        SCORE_MOD, SCORE_KEYS, DROPOUT, ALIGNED_ROWS, BLOCK_N, SPARSE_BLOCK_N, HEAD_DIM2, D_PADDED, DOT_PRECISION,
        WIDEN_DOTS)
    if SPLIT_AT_BOUND:
        if full_hi > full_bounded:
            acc, acc2, l_i, m_i = forward_tiles(
                acc, acc2, l_i, m_i, q, q2, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                full_bounded, full_hi, full_idx, offs_m, offs_n, offs_d, offs_d2, kv_bound, head_dim, qk_scale, b, h,
                q_len, kv_len, q_ref, MODS, seed, drop_row, row_start, drop_threshold, WALK_TABLES, False, True, False,
                MASK_MOD, SCORE_MOD, SCORE_KEYS, DROPOUT, ALIGNED_ROWS, BLOCK_N, SPARSE_BLOCK_N, HEAD_DIM2, D_PADDED,
                DOT_PRECISION, WIDEN_DOTS)
    if part_hi > part_lo:  # rows without partial blocks skip the masked run's set-up and drain
        acc, acc2, l_i, m_i = forward_tiles(
            acc, acc2, l_i, m_i, q, q2, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
            part_lo, part_hi, part_idx, offs_m, offs_n, offs_d, offs_d2, kv_bound, head_dim, qk_scale, b, h, q_len,
            kv_len, q_ref, MODS, seed, drop_row, row_start, drop_threshold, WALK_TABLES, IS_CAUSAL, PART_NEEDS_BOUND,
            MASK_MOD is not None, MASK_MOD, SCORE_MOD, SCORE_KEYS, DROPOUT, ALIGNED_ROWS, BLOCK_N, SPARSE_BLOCK_N,
            HEAD_DIM2, D_PADDED, DOT_PRECISION, WIDEN_DOTS)
    row = 0.0
    if SCORE_ROW is not None:  # h may be a column (the decode forward's heads): the term as one, summed to a row
        row = tl.sum(row_term(b, h, tl.minimum(offs_m, q_len - 1)[:, None], q_ref, kv_len, MODS, SCORE_ROW), 1)
    o, o2, lse = finish_rows(acc, acc2, l_i, m_i, row, HEAD_DIM2)
    if DROPOUT:
        o = o * drop_scale
        if HEAD_DIM2 > 0:
            o2 = o2 * drop_scale
    return o, o2, lse
