"""FlashAttention-2 forward for DENSE, CAUSAL and SPARSE block masks.

Constexpr flags (one kernel body, specialised by the compiler):
  MASK_KIND       0 DENSE: every key tile; only the ragged tail (and key_lengths) is masked.
                  1 CAUSAL: tiles below the diagonal unmasked, diagonal tiles masked, none above.
                  2 SPARSE: walk the row tables; full blocks unmasked, partial blocks masked.
  IS_CAUSAL       apply q_idx >= kv_idx in masked tiles (top-left alignment).
  HAS_KEY_LENGTHS key_lengths[b] bounds the keys of batch b (in SPARSE rows also the tiles of the full
                  block across it, tiles.tiles_before_bound).
  BLOCK_M/BLOCK_N kernel tile (queries/keys); each divides SPARSE_BLOCK_M/SPARSE_BLOCK_N.
  HEAD_DIM        head dim padded to a power of two >= 16, or the first of two parts (HEAD_DIM2: the
                  second's width, tiles.py); D_PADDED: the real head dim is smaller.
  DOT_PRECISION   tl.dot input precision: "tf32" for fp32 inputs on a GPU, else "ieee".
  WIDEN_DOTS      interpreter only: widen dot operands to fp32 (its bf16 dot is wrong).
  EVEN_LENGTHS    DENSE and CAUSAL only: both tiles divide q_len and kv_len, so no tile holds a
                  row or key past them and the loads need no bounds. The lengths themselves are
                  not specialised on: a new length compiles at most this one more variant.
  MASK_MOD        SPARSE only: a generated element predicate (codegen.py) for the partial blocks, or None.
  SCORE_MOD       a generated score function (codegen.py) for every computed score, or None; both read
                  their captured tensors through the MODS table.
  SCORE_KEYS      the steps of a score function's key term linear in kv_idx (codegen.py), or None.
  SCORE_ROW       a separable score function's term per query row (codegen.py), added to the lse, or None.
  DROPOUT         drop probabilities with the seed at SEED: a score is dropped when its random byte
                  is below dropout_threshold, a kept one scaled by dropout_scale
                  (sparseflash.attention.dropout); the sum l takes every probability.

The softmax runs in base 2: scores are scaled by scale * log2(e), the running max m and sum l
are kept per row and the output is divided by l once at the end; lse = (m + log2 l) * ln 2.
A row that sees no key keeps m = -inf, l = 0 and stores o = 0, lse = -inf. On Hopper long rows take
the Gluon forward (forward_gluon.py, ``plan.gluon_forward``), and the tuner may pick the persistent,
warp-specialised forward instead of this one (forward_persistent.py); up to
``forward_decode.MAX_QUERIES`` query rows (decoding) take the split-KV forward (forward_decode.py).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from sparseflash.attention.triton import forward_decode, forward_persistent
from sparseflash.attention.triton.launch import (STAND_IN_FROM_CPUS, Launcher, Standin, cdiv, run_stand_in, standing_in,
                                                 usable_cpus)
from sparseflash.attention.triton.plan import LaunchPlan, gluon_kernels
from sparseflash.attention.triton.tiles import (DROPOUT_ARGS, ROW_LENGTH_ARGS, forward_row, load_head_parts, load_seed,
                                                row_tile_ranges, second_part_columns, store_head_parts)
from sparseflash.attention.triton.tuning import ConfigKey, KernelConfig, candidates, fit, planned, run_tuned


@triton.jit(do_not_specialize=[*ROW_LENGTH_ARGS, *DROPOUT_ARGS])
def _attn_fwd(
    Q, K, V, O, LSE, KEY_LENGTHS,
    FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, MODS, SEED,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_num_b, stride_num_h, stride_num_m, stride_idx_b, stride_idx_h, stride_idx_m,
    heads, groups, q_len, kv_len, head_dim, qk_scale, dropout_threshold, dropout_scale,
    MASK_KIND: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_KEY_LENGTHS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPARSE_BLOCK_M: tl.constexpr, SPARSE_BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM2: tl.constexpr, D_PADDED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WIDEN_DOTS: tl.constexpr, EVEN_LENGTHS: tl.constexpr, MASK_MOD: tl.constexpr, SCORE_MOD: tl.constexpr,
    SCORE_KEYS: tl.constexpr, SCORE_ROW: tl.constexpr, DROPOUT: tl.constexpr,
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
    offs_d2 = second_part_columns(HEAD_DIM, HEAD_DIM2)
    rows_in = offs_m[:, None] < q_len

    q, q2 = load_head_parts(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm, stride_qd, rows_in,
                            offs_d, offs_d2, head_dim, HEAD_DIM2)
    k_base = K + b * stride_kb + (h // groups) * stride_kh
    v_base = V + b * stride_vb + (h // groups) * stride_vh

    kv_bound = kv_len
    if HAS_KEY_LENGTHS:
        kv_bound = tl.minimum(kv_bound, tl.load(KEY_LENGTHS + b).to(tl.int32))
    full_idx, full_hi, part_idx, part_lo, part_hi = row_tile_ranges(
        FULL_NUM, FULL_IDX, PART_NUM, PART_IDX, b, h, q_start, kv_bound,
        stride_num_b, stride_num_h, stride_num_m, stride_idx_b, stride_idx_h, stride_idx_m,
        MASK_KIND, HAS_KEY_LENGTHS, BLOCK_M, BLOCK_N, SPARSE_BLOCK_M, SPARSE_BLOCK_N)
    o, o2, lse = forward_row(
        q, q2, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, 0, full_hi, full_idx, part_lo, part_hi,
        part_idx, offs_m, offs_n, offs_d, offs_d2, kv_bound, head_dim, qk_scale, b, h, q_len, kv_len, q_start, MODS,
        load_seed(SEED, DROPOUT), bh, q_start, dropout_threshold, dropout_scale,
        MASK_KIND, IS_CAUSAL, HAS_KEY_LENGTHS, EVEN_LENGTHS, MASK_MOD, SCORE_MOD, SCORE_KEYS, SCORE_ROW, DROPOUT,
        True, BLOCK_M, BLOCK_N, SPARSE_BLOCK_N, HEAD_DIM, HEAD_DIM2, D_PADDED, DOT_PRECISION, WIDEN_DOTS)
    store_head_parts(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om, stride_od, rows_in, o, o2,
                     offs_d, offs_d2, head_dim, HEAD_DIM2)
    tl.store(LSE + bh * q_len + offs_m, lse, mask=offs_m < q_len)


# ---------------------------------------------------------------------------------- launcher
FORWARD = Launcher(_attn_fwd)


def _launch(plan: LaunchPlan, cfg: KernelConfig, q, k, v, o, lse, key_lengths, mods: torch.Tensor, dropout,
            ahead: bool = False) -> KernelConfig | None:
    """Launch the forward with ``cfg`` (``dropout``: ``plan.dropout_args``; ``ahead``: only compile what that
    launch needs; o and lse may be ``Standin``s). Configs with ``persistent`` go to forward_persistent.py
    where the tensors' layouts allow, else to this kernel with the same tiles; returns the config that ran
    (None where forward_persistent.py ran cfg)."""
    if cfg.persistent:
        if forward_persistent.launch(plan, cfg, q, k, v, o, lse, mods, ahead):
            return None
        cfg = dataclasses.replace(cfg, persistent=False)  # a layout TMA cannot read
    tables, table_strides = plan.tables_of("kv")
    seed, *dropout_scalars = dropout
    (FORWARD.compile_ahead if ahead else FORWARD)(
        (cdiv(plan.q_len, cfg.block_m), plan.batch * plan.heads), (q, k, v, o, lse, key_lengths, *tables, mods, seed),
        (*q.stride(), *k.stride(), *v.stride(), *o.stride(), *table_strides, plan.heads, plan.groups,
         plan.q_len, plan.kv_len, plan.head_dim, plan.qk_scale, *dropout_scalars), plan.constexprs(cfg))
    return cfg


def _kernel(plan: LaunchPlan):
    """The tuned kernel's name and launch function for ``plan``'s shapes."""
    return ("decode", forward_decode.launch) if forward_decode.applies(plan) else ("forward", _launch)


def attention_forward(q, k, v, key_lengths: torch.Tensor, plan: LaunchPlan, captures=(),
                      dropout=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``o (B, H, S_q, D)`` in ``q.dtype`` and ``lse (B, H, S_q)`` fp32; ``key_lengths`` as
    ``plan.key_lengths_arg`` gives it; ``dropout``: a ``Dropout`` where the plan has one, else None."""
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    mods = plan.mods_table(list(captures))
    dropout_args = plan.dropout_args(dropout)
    # (the tensors the launches take, and what their scalars depend on besides the plan); the key lengths (made on
    # each call in int32) and the dropout seed last: small tensors at addresses a loop does not repeat, which graphs
    # read from copies (``replay``)
    slots, layout = (q, k, v, o, lse, mods, key_lengths, dropout_args[0]), (q.stride(), k.stride(), v.stride(),
                                                                             *dropout_args[1:])
    replays = plan.replays["forward"]
    replay = replays.get(layout)
    if replay is not None and replay(slots):
        return o, lse
    with replays.keep(layout, slots, plan.tensors, copied=2) as settled:
        stand_in = _triton_stand_in(plan, q, k, v, o, lse, key_lengths, mods) if plan.gluon_forward else None
        if stand_in is not None and run_stand_in(plan.per_layout["forward_stand_in"], lambda: _launch(
                plan, stand_in, q, k, v, o, lse, key_lengths, mods, dropout_args)):
            return o, lse
        if plan.gluon_forward and gluon_kernels("forward").launch(plan, q, k, v, o, lse, key_lengths, mods):
            settled[0] = True
            return o, lse
        name, launch = _kernel(plan)
        run_tuned(name, plan.config_key, lambda cfg: launch(plan, cfg, q, k, v, o, lse, key_lengths, mods,
                                                            dropout_args))
        settled[0] = True
    return o, lse


def compile_forward_ahead(q, k, v, key_lengths: torch.Tensor, plan: LaunchPlan, captures=()) -> None:
    """Start compiling the forward kernels that ``attention_forward`` on these inputs will launch (none
    where that launch tunes first): the Gluon forward where it runs and, where that compile is in flight and the
    process may use STAND_IN_FROM_CPUS CPUs, the Triton forward beside it, which stands in for it until it ends
    (``_triton_stand_in``)."""
    mods = plan.mods_table(list(captures))
    o, lse = Standin(q.dtype, q.shape), Standin(torch.float32, q.shape[:3])
    gluon = gluon_kernels("forward") if plan.gluon_forward else None
    if gluon is not None and gluon.launch(plan, q, k, v, o, lse, key_lengths, mods, ahead=True):
        if usable_cpus() < STAND_IN_FROM_CPUS or not gluon.compiling(plan, q, k, v, o, lse, key_lengths, mods):
            return
        cfg = stand_in_config(plan.config_key)
        _launch(plan, cfg, q, k, v, o, lse, key_lengths, mods, plan.dropout_args(None, ahead=True), ahead=True)
        plan.per_layout.setdefault("forward_stand_in", {})["stand_in"] = cfg
        return
    name, launch = _kernel(plan)
    cfg = planned(name, plan.config_key)
    if cfg is not None:
        launch(plan, cfg, q, k, v, o, lse, key_lengths, mods, plan.dropout_args(None, ahead=True), ahead=True)


WARPGROUP_ROWS = 64  # query rows of a Hopper warpgroup's product (wgmma's m64)
# The stand-in's key tile and stages (``stand_in_config``): 32 keys and one stage compiled in 0.6-0.85x the time of
# the first candidate's 64 keys and 2-3 stages (a window + score function, sm_90a on a 2-core CPU, medians: hd256
# 1.65 against 2.17 s, hd192 1.64 / 2.50, hd160 1.38 / 2.18, hd128 1.14 / 1.47, hd64 0.84 / 1.02)
STAND_IN_KEYS, STAND_IN_STAGES = 32, 1


def stand_in_config(key: ConfigKey) -> KernelConfig:
    """The config of the Triton forward where it stands in for the Gluon forward (it runs a few calls; its compile
    is what the first call waits for): the first candidate that is not persistent (the persistent forward's warp
    specialisation compiles in ~1.5x the time: a window + score function at head dim 128, 1.84 against 1.27 s for
    sm_90a on a CPU), on tiles of STAND_IN_KEYS keys with STAND_IN_STAGES, and a warpgroup for each 64 rows of its
    tile. One warpgroup holding 128 rows issues two products for each of the tile's: 128 x 64 tiles on 4 warps
    compiled in 1.1-1.7x the time of 8 warps (a window + score function at head dims 48-96; docs/kernels.md, "The
    first call")."""
    cfg = candidates("forward", dataclasses.replace(key, persistent=""))[0]
    cfg = fit("forward", dataclasses.replace(cfg, block_n=min(cfg.block_n, STAND_IN_KEYS), num_stages=STAND_IN_STAGES),
              key)
    return dataclasses.replace(cfg, num_warps=max(cfg.num_warps, cfg.block_m // WARPGROUP_ROWS * 4))


def _triton_stand_in(plan: LaunchPlan, q, k, v, o, lse, key_lengths, mods) -> KernelConfig | None:
    """The config of the Triton forward where it runs in place of the Gluon forward on this call
    (``launch.standing_in``): from a first call that compiled both ahead (``compile_forward_ahead``; a Gluon
    forward with mask or score functions compiles in 3.6-4.4 s on an H100 host, the Triton forward in 1.5-2.5)
    while the Gluon forward's compile ahead is in flight; else None. A call the Gluon forward cannot take (a
    layout TMA cannot read) ends it too."""
    return standing_in(plan.per_layout.get("forward_stand_in", {}),
                       lambda _: gluon_kernels("forward").compiling(plan, q, k, v, o, lse, key_lengths, mods))
