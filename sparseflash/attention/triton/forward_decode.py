"""The split-KV forward ("flash-decoding") for a few query rows against long keys.

Decoding asks for 1 to 16 new queries against a cache of thousands of keys. The forward of forward.py
then runs one program per (query tile, head) whose tile is mostly empty rows, with few programs
for the GPU and each streaming its head's whole K and V, once per query head of a GQA group. Here:

- a program holds the query rows of ``PACK`` heads that share a K/V head (the whole GQA group, or one
  head where the mask's layout differs per head), so that K and V are read once per group;
- the key tiles of each row are split into ``splits`` equal shares, one program each (the grid's third
  axis), so that a few heads fill the GPU; each share's o and lse go to fp32 partial buffers, and
  ``_combine_splits`` merges them (lse = log sum exp lse_s, o = sum exp(lse_s - lse) o_s).

Constexpr flags: those of forward.py (MASK_KIND, IS_CAUSAL, HAS_KEY_LENGTHS, BLOCK_M, BLOCK_N,
SPARSE_BLOCK_M, SPARSE_BLOCK_N, HEAD_DIM, HEAD_DIM2, D_PADDED, DOT_PRECISION, WIDEN_DOTS, EVEN_LENGTHS,
MASK_MOD, SCORE_MOD, SCORE_KEYS, SCORE_ROW, DROPOUT), and
  PACK      heads per program; row r of its tile is query r % q_len of head r // q_len of the pack.
  SPLIT     the program stores its share into the partial buffers (splits > 1), else o and lse.
The queries fit in one mask block (MAX_QUERIES is the smallest block), so every row of a program
walks the same row of the mask's tables: its first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from sparseflash.attention.triton.launch import Launcher, Standin, cdiv, multiprocessors
from sparseflash.attention.triton.tiles import (DROPOUT_ARGS, ROW_LENGTH_ARGS, forward_row, load_head_parts, load_seed,
                                                row_tile_ranges, second_part_columns, store_head_parts)
from sparseflash.attention.triton.tuning import KernelConfig

if TYPE_CHECKING:  # plan.py imports this module: it keys the tuning by group_rows
    from sparseflash.attention.triton.plan import LaunchPlan

MAX_QUERIES = 16  # query rows up to which a forward takes this kernel: no more than a mask block's (>= 16)


@triton.jit
def _split_share(full_hi, part_lo, part_hi, split, splits):
    """Split ``split``'s share of a row's tiles, which run [0, full_hi) unmasked then [part_lo, part_hi)
    masked: the same runs cut to the share's tiles."""
    share = tl.cdiv(full_hi + part_hi - part_lo, splits)
    lo, hi = split * share, (split + 1) * share
    n_part = part_hi - part_lo
    return (tl.minimum(lo, full_hi), tl.minimum(hi, full_hi),
            part_lo + tl.minimum(tl.maximum(lo - full_hi, 0), n_part),
            part_lo + tl.minimum(tl.maximum(hi - full_hi, 0), n_part))


@triton.jit(do_not_specialize=[*ROW_LENGTH_ARGS, *DROPOUT_ARGS, "splits", "stride_lse_split"])
def _attn_fwd_decode(
    Q, K, V, O, LSE, KEY_LENGTHS,
    FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, MODS, SEED,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_num_b, stride_num_h, stride_num_m, stride_idx_b, stride_idx_h, stride_idx_m,
    heads, groups, q_len, kv_len, head_dim, qk_scale, splits, stride_o_split, stride_lse_split,
    dropout_threshold, dropout_scale,
    MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_KEY_LENGTHS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPARSE_BLOCK_M: tl.constexpr, SPARSE_BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM2: tl.constexpr, D_PADDED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WIDEN_DOTS: tl.constexpr, EVEN_LENGTHS: tl.constexpr, MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr,
    SCORE_KEYS: tl.constexpr, SCORE_ROW: tl.constexpr, DROPOUT: tl.constexpr, PACK: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Grid (row tiles of PACK * q_len rows, batch x heads / PACK, splits)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    bp = tl.program_id(1)
    packs = heads // PACK
    b = bp // packs
    first_head = (bp % packs) * PACK
    rows_in = rows < PACK * q_len
    h = first_head + tl.where(rows_in, rows // q_len, 0)  # each row's head and query position
    offs_m = rows % q_len
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_d2 = second_part_columns(HEAD_DIM, HEAD_DIM2)

    q, q2 = load_head_parts(Q + b * stride_qb + h[:, None] * stride_qh + offs_m[:, None] * stride_qm, stride_qd,
                            rows_in[:, None], offs_d, offs_d2, head_dim, HEAD_DIM2)
    kv_head = first_head // groups  # every head of a pack reads the same K/V head
    k_base = K + b * stride_kb + kv_head * stride_kh
    v_base = V + b * stride_vb + kv_head * stride_vh

    kv_bound = kv_len
    if HAS_KEY_LENGTHS:
        kv_bound = tl.minimum(kv_bound, tl.load(KEY_LENGTHS + b).to(tl.int32))
    # the rows' tile ranges from query 0, with the tile as tall as BLOCK_M >= q_len; the head of a
    # table lookup is the pack's first (PACK > 1 only where the layout is shared by the heads)
    full_idx, full_hi, part_idx, part_lo, part_hi = row_tile_ranges(
        FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, b, first_head, 0, kv_bound,
        stride_num_b, stride_num_h, stride_num_m, stride_idx_b, stride_idx_h, stride_idx_m,
        MASK_KIND, HAS_KEY_LENGTHS, BLOCK_M, BLOCK_N, SPARSE_BLOCK_M, SPARSE_BLOCK_N)
    full_lo = 0
    if SPLIT:
        split = tl.program_id(2)
        full_lo, full_hi, part_lo, part_hi = _split_share(full_hi, part_lo, part_hi, split, splits)
        O += split * stride_o_split
        LSE += split * stride_lse_split
    o, o2, lse = forward_row(
        q, q2, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, full_lo, full_hi, full_idx, part_lo,
        part_hi, part_idx, offs_m, offs_n, offs_d, offs_d2, kv_bound, head_dim, qk_scale, b, h[:, None], q_len, kv_len,
        0, MODS, load_seed(SEED, DROPOUT), (b * heads + h)[:, None], 0, dropout_threshold, dropout_scale,
        MASK_KIND, IS_CAUSAL, HAS_KEY_LENGTHS, EVEN_LENGTHS, MASK_MOD, SCORE_MOD, SCORE_KEYS, SCORE_ROW, DROPOUT,
        False, BLOCK_M, BLOCK_N, SPARSE_BLOCK_N, HEAD_DIM, HEAD_DIM2, D_PADDED, DOT_PRECISION, WIDEN_DOTS)
    store_head_parts(O + b * stride_ob + h[:, None] * stride_oh + offs_m[:, None] * stride_om, stride_od,
                     rows_in[:, None], o, o2, offs_d, offs_d2, head_dim, HEAD_DIM2)
    tl.store(LSE + (b * heads + h) * q_len + offs_m, lse, mask=rows_in)


@triton.jit(do_not_specialize=["q_len", "splits", "stride_lse_split"])
def _combine_splits(O_PART, LSE_PART, O, LSE, splits, q_len, head_dim, stride_part_split, stride_lse_split,
                    stride_pb, stride_ph, stride_pm, stride_ob, stride_oh, stride_om, stride_od, heads,
                    SPLITS_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """o and lse of query row program_id(0) of head program_id(1) from the splits' o_s and lse_s (fp32):
    lse = log sum_s exp(lse_s) and o = sum_s exp(lse_s - lse) o_s; a row no split saw gets 0 and -inf.
    SPLITS_BLOCK splits at a time: their loads are issued together (one after the other, a merge of 64
    splits took ~60 µs of load latency)."""
    row = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    offs_s = tl.arange(0, SPLITS_BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    lse_ptrs = LSE_PART + bh * q_len + row
    part_ptrs = O_PART + b * stride_pb + h * stride_ph + row * stride_pm + offs_d[None, :]
    m = float("-inf")
    weight_sum = 0.0
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for first in range(0, splits, SPLITS_BLOCK):
        in_split = first + offs_s < splits
        lse_s = tl.load(lse_ptrs + (first + offs_s) * stride_lse_split, mask=in_split, other=float("-inf"))
        o_s = tl.load(part_ptrs + (first + offs_s)[:, None] * stride_part_split,
                      mask=in_split[:, None] & (offs_d[None, :] < head_dim), other=0.0)
        m_new = tl.maximum(m, tl.max(lse_s, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no split has seen the row yet
        weight = tl.exp(lse_s - m_ref)
        alpha = tl.exp(m - m_ref)
        weight_sum = weight_sum * alpha + tl.sum(weight, 0)
        acc = acc * alpha + tl.sum(weight[:, None] * o_s, 0)
        m = m_new
    seen = weight_sum > 0.0
    safe_sum = tl.where(seen, weight_sum, 1.0)
    o_ptrs = O + b * stride_ob + h * stride_oh + row * stride_om + offs_d * stride_od
    tl.store(o_ptrs, (acc / safe_sum).to(O.dtype.element_ty), mask=offs_d < head_dim)
    tl.store(LSE + bh * q_len + row, tl.where(seen, m + tl.log(safe_sum), float("-inf")))


# ---------------------------------------------------------------------------------- launcher
DECODE = Launcher(_attn_fwd_decode)
COMBINE = Launcher(_combine_splits)
COMBINE_SPLITS = 64  # splits a merge program loads at once
SPLIT_WAVES = 4  # split until the grid holds this many programs per multiprocessor,
SPLIT_MIN_TILES = 4  # while each split keeps at least this many key tiles (a split costs a merge),
MAX_SPLITS = 32  # and into no more than this many: beyond it a share's fixed cost outweighs the parallelism
# (H100, GPU time of one call: 66-128 splits 6-9 % slower than 32 on the rows that split that much)


def applies(plan: LaunchPlan) -> bool:
    """Whether a forward with ``plan`` takes this kernel: up to MAX_QUERIES query rows."""
    return plan.q_len <= MAX_QUERIES


def pack(plan: LaunchPlan) -> int:
    """Heads per program: the GQA group where every head walks the same mask tables, else 1."""
    return plan.groups if plan.layout_heads == 1 else 1


def group_rows(plan: LaunchPlan) -> int:
    """The query rows of a program group (``pack`` heads' queries), rounded up to a power of two >= 16: the
    tuning key's ``decode_rows``, which decides the query tile."""
    return max(16, triton.next_power_of_2(pack(plan) * plan.q_len))


def splits(plan: LaunchPlan, cfg: KernelConfig, device: torch.device) -> int:
    """How many shares each row's key tiles are split into with ``cfg`` (1: no split)."""
    programs = plan.batch * plan.heads // pack(plan) * cdiv(pack(plan) * plan.q_len, cfg.block_m)
    row_tiles = plan.mean_row_keys / cfg.block_n
    wanted = cdiv(SPLIT_WAVES * multiprocessors(device), programs)
    return max(1, min(MAX_SPLITS, wanted, int(row_tiles // SPLIT_MIN_TILES)))


class _Launches:
    """The two launches of a decoding call with one plan, config, input layout and dropout scalars: grids,
    scalars and constexprs assembled once, and after a first launch with every tensor 16-byte aligned,
    the compiled kernels bound to them (``Launcher.bound``), so that a call takes ~20 µs less host time."""

    def __init__(self, plan: LaunchPlan, cfg: KernelConfig, q, k, v, dropout_scalars: tuple):
        self.splits, heads_per_program = splits(plan, cfg, q.device), pack(plan)
        # o is contiguous (attention_forward allocates it); the shares' o and lse share one fp32 allocation
        # (host time), lse's part starting 16-byte aligned, as a tensor of its own would
        self.shapes = ((self.splits, *q.shape), (self.splits, *q.shape[:3]))
        self.o_size = self.splits * q.numel()
        self.lse_offset = cdiv(self.o_size, 4) * 4
        self.scratch_size = self.lse_offset + self.splits * plan.batch * plan.heads * plan.q_len
        out_strides, o_strides = Standin(torch.float32, self.shapes[0]).stride(), Standin(q.dtype, q.shape).stride()
        lse_split_stride = Standin(torch.float32, self.shapes[1]).stride()[0]
        split_strides = (out_strides[0], lse_split_stride) if self.splits > 1 else (0, 0)
        self.tables, table_strides = plan.tables_of("kv")
        self.decode = ((cdiv(heads_per_program * plan.q_len, cfg.block_m),
                        plan.batch * plan.heads // heads_per_program, self.splits),
                       (*q.stride(), *k.stride(), *v.stride(), *(out_strides[1:] if self.splits > 1 else o_strides),
                        *table_strides, plan.heads, plan.groups, plan.q_len, plan.kv_len, plan.head_dim, plan.qk_scale,
                        self.splits, *split_strides, *dropout_scalars),
                       plan.constexprs(cfg, PACK=heads_per_program, SPLIT=self.splits > 1))
        self.combine = ((plan.q_len, plan.batch * plan.heads),
                        (self.splits, plan.q_len, plan.head_dim, *split_strides, *out_strides[1:4], *o_strides,
                         plan.heads),
                        dict(SPLITS_BLOCK=min(COMBINE_SPLITS, 1 << (self.splits - 1).bit_length()),
                             HEAD_DIM=plan.padded_dim))
        self.bound = None  # (decode, combine) bound to their compiled kernels, once launched aligned

    def __call__(self, q, k, v, o, lse, key_lengths, mods, seed, ahead: bool) -> None:
        out, out_lse = o, lse
        if self.splits > 1:  # the shares' o and lse, merged below
            if ahead:
                out, out_lse = (Standin(torch.float32, shape) for shape in self.shapes)
            else:
                scratch = torch.empty(self.scratch_size, dtype=torch.float32, device=q.device)
                out, out_lse = (scratch[:self.o_size].view(self.shapes[0]),
                                scratch[self.lse_offset:].view(self.shapes[1]))
        decode_tensors = (q, k, v, out, out_lse, key_lengths, *self.tables, mods, seed)
        combine_tensors = (out, out_lse, o, lse)
        if ahead:
            DECODE.compile_ahead(self.decode[0], decode_tensors, *self.decode[1:])
            if self.splits > 1:
                COMBINE.compile_ahead(self.combine[0], combine_tensors, *self.combine[1:])
            return
        # the tensors a call brings (the others are the plan's or fresh allocations, which torch aligns)
        aligned = not (q.data_ptr() | k.data_ptr() | v.data_ptr() | key_lengths.data_ptr() | mods.data_ptr()
                       | seed.data_ptr()) & 15
        if aligned and self.bound is not None:
            self.bound[0](decode_tensors)
            if self.splits > 1:
                self.bound[1](combine_tensors)
            return
        DECODE(self.decode[0], decode_tensors, *self.decode[1:])
        if self.splits > 1:
            COMBINE(self.combine[0], combine_tensors, *self.combine[1:])
        if aligned and all(t.data_ptr() % 16 == 0 for t in self.tables):
            decode = DECODE.bound(self.decode[0], decode_tensors, *self.decode[1:])
            combine = COMBINE.bound(self.combine[0], combine_tensors, *self.combine[1:]) if self.splits > 1 else None
            self.bound = None if decode is None else (decode, combine)  # None: the interpreter


def launch(plan: LaunchPlan, cfg: KernelConfig, q, k, v, o, lse, key_lengths, mods: torch.Tensor, dropout,
           ahead: bool = False) -> None:
    """Launch the split-KV forward with ``cfg`` into o and lse (``dropout``: ``plan.dropout_args``;
    ``ahead``: only compile what that launch needs; o and lse may be ``Standin``s)."""
    seed, *dropout_scalars = dropout
    key = (cfg, q.stride(), k.stride(), v.stride(), *dropout_scalars)
    launches = plan.per_layout.setdefault("decode", {}).get(key)
    if launches is None:
        launches = plan.per_layout["decode"][key] = _Launches(plan, cfg, q, k, v, tuple(dropout_scalars))
    launches(q, k, v, o, lse, key_lengths, mods, seed, ahead)
