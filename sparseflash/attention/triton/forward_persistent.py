"""The persistent, warp-specialised forward for Hopper (TMA), and when it applies.

Constexpr flags: those of forward.py (MASK_KIND, IS_CAUSAL, HAS_KEY_LENGTHS, BLOCK_M, BLOCK_N,
SPARSE_BLOCK_M, SPARSE_BLOCK_N, HEAD_DIM, HEAD_DIM2, D_PADDED, DOT_PRECISION, WIDEN_DOTS, EVEN_LENGTHS,
MASK_MOD, SCORE_MOD, SCORE_KEYS, SCORE_ROW; DROPOUT off), and
  NUM_PROGRAMS     programs launched (the GPU's SM count): program p takes tiles p, p + NUM_PROGRAMS, ...
  MASK_EVERY_TILE  SPARSE with partial tiles: walk every computed tile in one loop and mask each.

It takes the problems whose tiles need no bounds (``mode``): DENSE and CAUSAL masks whose lengths
128-row tiles divide, SPARSE masks whose lengths their blocks divide; no key_lengths, no dropout
(``LaunchPlan``), an unpadded head dim (<= 128), fp16/bf16; and inputs whose rows TMA can read
(``row_view_rows``). A SPARSE mask with partial tiles (a causal diagonal, a mask_mod that cuts tiles)
walks all its computed tiles in one loop and masks every tile, as CAUSAL does: a second loop makes the
warp-specialisation pass fail. A score function applies to every tile. Triton's warp specialisation
(num_warps=4) splits its tile loop into a producer warp that loads by TMA and two consumer warpgroups
of BLOCK_M / 2 rows each; the producer loads the next tile's Q while the consumers finish the current
one. ``SPARSEFLASH_PERSISTENT``: "auto" (default) lets the tuner time it against the other forward
where it applies on Hopper, "1" takes it wherever it applies (also under the interpreter), "0" never
does.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from sparseflash.attention.kept_tensors import made_outside_graph_pools
from sparseflash.attention.triton.launch import Launcher, interpreting, kernel_switch, multiprocessors
from sparseflash.attention.triton.tiles import (ROW_LENGTH_ARGS, finish_rows, key_steps, listed_block, mma,
                                               modded_scores, online_softmax_step, row_term, row_tile_ranges,
                                               tile_start)
from sparseflash.masks import BlockMask, MaskKind

PERSISTENT_LENGTH_ARGS = [*ROW_LENGTH_ARGS, "q_rows", "k_rows", "v_rows", "o_rows", "n_tiles"]
TILE_ROWS = 128  # the query rows of its tiles, whatever the config: DENSE/CAUSAL lengths must divide it
MAX_HEAD_DIM = 128  # larger heads do not fit its shared memory


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
                   qk_scale, b, h, MODS, FROM_TABLE: tl.constexpr, APPLY_CAUSAL: tl.constexpr,
                   MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr, SCORE_KEYS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, SPARSE_BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   WIDEN_DOTS: tl.constexpr):
    """``tiles.forward_tiles`` over tiles 0..t_hi-1 for the persistent forward: K and V through the
    ``row_view`` descriptors, no bounds; the causal predicate and MASK_MOD on every tile."""
    MASKED: tl.constexpr = APPLY_CAUSAL or MASK_MOD is not None
    MAY_BE_EMPTY: tl.constexpr = MASKED or SCORE_MOD is not None  # a score function may return -inf
    keys = key_steps(b, h, tl.arange(0, BLOCK_N)[None, :], MODS, SCORE_KEYS)
    for t in tl.range(0, t_hi):
        block = listed_block(idx_ptr, t, t_hi, FROM_TABLE, BLOCK_N, SPARSE_BLOCK_N)
        kv_start = tile_start(t, block, FROM_TABLE, BLOCK_N, SPARSE_BLOCK_N)
        k = k_desc.load([k_row + kv_start, k_col])
        v = v_desc.load([v_row + kv_start, v_col])
        offs_m = q_start + tl.arange(0, BLOCK_M)
        offs_kv = kv_start + tl.arange(0, BLOCK_N)
        s, _ = modded_scores(mma(q, tl.trans(k), None, DOT_PRECISION, WIDEN_DOTS), b, h, offs_m[:, None],
                             offs_kv[None, :], q_start, kv_start, keys, qk_scale, MODS, SCORE_MOD, SCORE_KEYS)
        if MASKED:
            if APPLY_CAUSAL:
                keep = offs_m[:, None] >= offs_kv[None, :]
                if MASK_MOD is not None:
                    keep = keep & MASK_MOD(b, h, offs_m[:, None], offs_kv[None, :], MODS)
            else:
                keep = MASK_MOD(b, h, offs_m[:, None], offs_kv[None, :], MODS)
            s = tl.where(keep, s, float("-inf"))
        acc, _, l_i, m_i = online_softmax_step(acc, (), l_i, m_i, s, v, (), 0, MAY_BE_EMPTY, False, 0, DOT_PRECISION,
                                               WIDEN_DOTS)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=PERSISTENT_LENGTH_ARGS)
def _attn_fwd_persistent(
    Q, K, V, O, LSE, FULL_NUM, FULL_IDX, MODS,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
    q_rows, k_rows, v_rows, o_rows,
    stride_num_b, stride_num_h, stride_num_m, stride_idx_b, stride_idx_h, stride_idx_m,
    heads, groups, q_len, kv_len, n_tiles, qk_scale,
    MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_KEY_LENGTHS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPARSE_BLOCK_M: tl.constexpr, SPARSE_BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM2: tl.constexpr, D_PADDED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WIDEN_DOTS: tl.constexpr, EVEN_LENGTHS: tl.constexpr, MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr,
    SCORE_KEYS: tl.constexpr, SCORE_ROW: tl.constexpr, DROPOUT: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    MASK_EVERY_TILE: tl.constexpr,
):
    """The forward of masks whose tiles divide the lengths, as NUM_PROGRAMS programs that each take
    every NUM_PROGRAMS-th (batch x head, query tile), with Q, K, V (and, for DENSE and CAUSAL, O) moved
    by TMA. SPARSE masks walk FULL_NUM/FULL_IDX: their full tiles, or with MASK_EVERY_TILE all their
    computed tiles, each masked by the causal predicate (IS_CAUSAL) and MASK_MOD.
    Triton's warp specialisation (Hopper, num_warps=4) splits the tile loop into a producer warp
    that loads and two consumer warpgroups of BLOCK_M / 2 rows each; the producer loads the next
    tile's Q while the consumers finish the current one."""
    tl.static_assert(not HAS_KEY_LENGTHS and not D_PADDED and HEAD_DIM2 == 0 and not DROPOUT,
                     "the persistent forward takes no key_lengths and no dropout, and power-of-two heads only")
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
            FULL_NUM, FULL_IDX, FULL_NUM, FULL_IDX, b, h, q_start, kv_len,
            stride_num_b, stride_num_h, stride_num_m, stride_idx_b, stride_idx_h, stride_idx_m,
            MASK_KIND, False, BLOCK_M, BLOCK_N, SPARSE_BLOCK_M, SPARSE_BLOCK_N)
        q_row, q_col = row_view_coords(b, h, q_start, stride_qb, stride_qh, stride_qm)
        k_row, k_col = row_view_coords(b, h // groups, 0, stride_kb, stride_kh, stride_kn)
        v_row, v_col = row_view_coords(b, h // groups, 0, stride_vb, stride_vh, stride_vn)
        q = q_desc.load([q_row, q_col])
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        # CAUSAL runs its diagonal tiles in the same loop, masking every tile: a second loop makes
        # the warp-specialisation pass fail (Triton 3.6, 3.9; tests/attention/test_triton_bugs.py)
        acc, l_i, m_i = _fwd_tiles_tma(
            acc, l_i, m_i, q, k_desc, v_desc, k_row, k_col, v_row, v_col, part_hi if CAUSAL else full_hi,
            full_idx, q_start, qk_scale, b, h, MODS, WALK_TABLES, CAUSAL or (MASK_EVERY_TILE and IS_CAUSAL),
            MASK_MOD if MASK_EVERY_TILE else None, SCORE_MOD, SCORE_KEYS, BLOCK_M, BLOCK_N, SPARSE_BLOCK_N,
            DOT_PRECISION, WIDEN_DOTS)
        # the row term as a vector: a reduction over a 1-wide column fails the warp-specialisation pass
        o, _, lse = finish_rows(acc, (), l_i, m_i, row_term(b, h, q_start + tl.arange(0, BLOCK_M), q_start, kv_len,
                                                           MODS, SCORE_ROW), 0)
        if WALK_TABLES:  # rows of few tiles: o straight from registers, not waiting for a TMA store
            o_offs = (q_start + tl.arange(0, BLOCK_M))[:, None] * stride_om + tl.arange(0, HEAD_DIM)[None, :]
            tl.store(O + (b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh) + o_offs, o.to(O.dtype.element_ty))
        else:
            o_row, o_col = row_view_coords(b, h, q_start, stride_ob, stride_oh, stride_om)
            o_desc.store([o_row, o_col], o.to(O.dtype.element_ty))
        # lse's addresses share no value with o's TMA coordinates: Triton 3.6-3.9's warp specialisation
        # offsets such a shared value by the second consumer's first row and then adds that
        # consumer's row range to it again, writing its lse BLOCK_M / 2 rows too far (docs/kernels.md,
        # "Triton bugs worked around").
        tl.store(LSE + bh * q_len + (q_start + tl.arange(0, BLOCK_M)), lse)



# ---------------------------------------------------------------------------------- when it applies
@functools.lru_cache(maxsize=None)
def _supported(device: torch.device) -> bool:
    """Hopper GPUs, whose warp specialisation and TMA it was built and measured on, and the interpreter."""
    if device.type != "cuda":
        return interpreting()
    return torch.cuda.get_device_capability(device)[0] == 9


def mode(q: torch.Tensor, k: torch.Tensor, mask: BlockMask, has_key_lengths: bool, padded_dim: int) -> str:
    """How the forward configs may use the persistent forward for this problem: "" not at all, "auto"
    among the other candidates (the shipped table's entry, or the tuner, chooses), "only" instead of
    them (``SPARSEFLASH_PERSISTENT=1``). The layout of each call's tensors is checked at launch
    (``launch``). Not bf16 under the interpreter, whose TMA loads corrupt bf16 (Triton 3.9)."""
    choice = kernel_switch("SPARSEFLASH_PERSISTENT")
    if choice == "0":
        return ""
    if mask.kind is MaskKind.SPARSE:  # no ragged tile: partial tiles are cut by predicates only (MASK_EVERY_TILE)
        even_tiles = q.shape[2] % mask.block_size[0] == 0 and k.shape[2] % mask.block_size[1] == 0
    else:
        even_tiles = q.shape[2] % TILE_ROWS == 0 and k.shape[2] % TILE_ROWS == 0
    applies = (even_tiles and not has_key_lengths and padded_dim == q.shape[3] <= MAX_HEAD_DIM
               and (q.dtype is torch.float16 or (q.dtype is torch.bfloat16 and not interpreting()))
               and _supported(q.device))
    if not applies:
        return ""
    if choice == "1":
        return "only"
    return "" if interpreting() else "auto"


def row_view_rows(x: torch.Tensor) -> int | None:
    """Rows of the matrix that ``row_view`` sees x (B, H, S, D) as: rows of pitch x.stride(2),
    where element (b, h, s, 0) is at column (b * stride_b + h * stride_h) % pitch. None where TMA
    cannot read x that way: a head's D elements crossing a pitch, or an address or pitch that is
    not 16-byte aligned, or rows that overlap (a pitch below D: the expanded gradient of ``o.sum()`` has
    every stride 0)."""
    batch, heads, seq, dim = x.shape
    stride_b, stride_h, pitch, stride_d = x.stride()
    if stride_d != 1 or pitch < dim:
        return None
    in_pitch = (batch == 1 or stride_b % pitch == 0) and (
        heads == 1 or stride_h % pitch == 0 or (stride_h > 0 and (heads - 1) * stride_h + dim <= pitch))
    if not in_pitch or x.data_ptr() % 16 or pitch * x.element_size() % 16:
        return None
    return ((batch - 1) * stride_b + (heads - 1) * stride_h) // pitch + seq


# ---------------------------------------------------------------------------------- launcher
_SCRATCH: dict[tuple, list[torch.Tensor]] = {}


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Triton's allocator for the global scratch where the kernel builds its TMA descriptors: one
    buffer per device and stream, kept and grown (launches on one stream run in turn, so they can
    share it; a fresh allocation cost ~5 µs of host time per launch). A buffer outgrown stays
    allocated: a CUDA graph captured with it writes there at every replay."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    buffers = _SCRATCH.setdefault((device, stream), [])
    if not buffers or buffers[-1].numel() < size:
        buffers.append(made_outside_graph_pools(lambda: torch.empty(size, dtype=torch.int8, device=device),
                                                torch.device(device)))
    return buffers[-1]


FORWARD_PERSISTENT = Launcher(_attn_fwd_persistent, scratch=_scratch)


def _scalars(plan, q, k, v, o) -> tuple | None:
    """The kernel's scalars up to n_tiles: the (batch, head, row) strides and ``row_view_rows`` of
    q, k, v, o, the table strides, heads, groups and lengths; None where TMA cannot read a layout.
    Kept on the plan per layout (strides and 16-byte alignment): ~10 µs of host time per launch."""
    per_layout = plan.per_layout.setdefault("persistent", {})
    layout = (q.stride(), k.stride(), v.stride(), q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16)
    if layout not in per_layout:
        rows = [row_view_rows(x) for x in (q, k, v, o)]
        per_layout[layout] = None if None in rows else (
            *[s for x in (q, k, v, o) for s in x.stride()[:3]], *rows,
            *plan.tables_of("all" if plan.has_partial_tiles else "kv")[1],
            plan.heads, plan.groups, plan.q_len, plan.kv_len)
    return per_layout[layout]


def launch(plan, cfg, q, k, v, o, lse, mods: torch.Tensor, ahead: bool = False) -> bool:
    """Launch the persistent forward with ``cfg`` on a problem ``mode`` admits (``mods``: the MODS
    table; ``ahead``: only compile what that launch needs); False (nothing launched) where TMA cannot
    read one of the tensors' layouts."""
    scalars = _scalars(plan, q, k, v, o)
    if scalars is None:
        return False
    programs = multiprocessors(q.device)
    n_tiles = plan.batch * plan.heads * (plan.q_len // cfg.block_m)
    every_tile = plan.has_partial_tiles  # SPARSE only: DENSE and CAUSAL tables are placeholders
    tables = plan.tables_of("all" if every_tile else "kv")[0][:2]
    arguments = ((min(n_tiles, programs),), (q, k, v, o, lse, *tables, mods), (*scalars, n_tiles, plan.qk_scale),
                 plan.constexprs(cfg, NUM_PROGRAMS=programs, MASK_EVERY_TILE=every_tile))
    (FORWARD_PERSISTENT.compile_ahead if ahead else FORWARD_PERSISTENT)(*arguments)
    return True
