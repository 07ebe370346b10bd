"""Minimal reproducers of the Triton bugs that abort its warp-specialisation pass (docs/kernels.md, "Triton bugs
worked around, and how to check they still bite"), compiled for sm_90a on a machine without a GPU:
``python -m tests.attention.sm90_ws_bugs VARIANT ...`` (with TRITON_INTERPRET unset) prints ``compiled VARIANT`` or
``failed VARIANT`` for each; the pass writes its own messages to stderr. test_triton_bugs.py runs it in a child
process, since the interpreter a CPU test run sets is read when kernels are defined.

``_attention_rows`` is the persistent forward's shape in a few lines: a warp-specialised loop over query tiles
(TMA loads of Q, K and V, two products a key tile, an online softmax, a TMA store of o and a store of each row's
log-sum-exp). ``plain`` compiles; each other variant adds one construct the pass aborts on:
  second_loop  a second key walk inside the tile loop (CAUSAL's diagonal tiles apart from its full ones)
  column_sum   a row term summed over a 1-wide column (a score function's row term, ``tl.sum(term[:, None], 1)``)
  row_load     a per-row vector loaded by ``tl.load`` in the tile loop (a dQ program's lse2 and delta)
"""

from __future__ import annotations

import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

VARIANTS = ("plain", "second_loop", "column_sum", "row_load")


@triton.jit
def _online_softmax_tile(q, k, v, acc, l_i, m_i, bias):
    s = tl.dot(q, tl.trans(k)) + bias[:, None]
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v), l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _attention_rows(Q, K, V, O, LSE, n_tiles, n_keys, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
                    NUM_PROGRAMS: tl.constexpr, VARIANT: tl.constexpr):
    """Query tiles of BLOCK rows of Q ``(n_tiles * BLOCK, HEAD_DIM)`` against K, V ``(n_keys, HEAD_DIM)``."""
    q_desc = tl.make_tensor_descriptor(Q, shape=[n_tiles * BLOCK, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK, HEAD_DIM])
    k_desc = tl.make_tensor_descriptor(K, shape=[n_keys, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V, shape=[n_keys, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK, HEAD_DIM])
    o_desc = tl.make_tensor_descriptor(O, shape=[n_tiles * BLOCK, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK, HEAD_DIM])
    key_tiles = n_keys // BLOCK
    for tile in tl.range(tl.program_id(0), n_tiles, NUM_PROGRAMS, warp_specialize=True):
        rows = tile * BLOCK + tl.arange(0, BLOCK)
        q = q_desc.load([tile * BLOCK, 0])
        m_i = tl.full([BLOCK], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK], tl.float32)
        acc = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
        if VARIANT == "row_load":
            bias = tl.load(LSE + rows)
        else:
            bias = tl.zeros([BLOCK], tl.float32)
        first_walk = key_tiles // 2 if VARIANT == "second_loop" else key_tiles
        for j in tl.range(0, first_walk):
            acc, l_i, m_i = _online_softmax_tile(q, k_desc.load([j * BLOCK, 0]), v_desc.load([j * BLOCK, 0]), acc,
                                                 l_i, m_i, bias)
        if VARIANT == "second_loop":
            for j in tl.range(first_walk, key_tiles):
                acc, l_i, m_i = _online_softmax_tile(q, k_desc.load([j * BLOCK, 0]), v_desc.load([j * BLOCK, 0]),
                                                     acc, l_i, m_i, bias)
        if VARIANT == "column_sum":
            term = tl.sum((rows.to(tl.float32) * 0.5)[:, None], 1)
        else:
            term = tl.zeros([BLOCK], tl.float32)
        o_desc.store([tile * BLOCK, 0], (acc / l_i[:, None]).to(O.dtype.element_ty))
        tl.store(LSE + rows, m_i + tl.log2(l_i) + term)


def compile_for_hopper(variant: str):
    """``_attention_rows`` of ``variant`` compiled for sm_90a (bf16, 128-row tiles, head dim 64, 132 programs)."""
    signature = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "LSE": "*fp32", "n_tiles": "i32",
                 "n_keys": "i32", "BLOCK": "constexpr", "HEAD_DIM": "constexpr", "NUM_PROGRAMS": "constexpr",
                 "VARIANT": "constexpr"}
    constexprs = {"BLOCK": 128, "HEAD_DIM": 64, "NUM_PROGRAMS": 132, "VARIANT": variant}
    source = ASTSource(fn=_attention_rows, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})


def main(variants: list[str]) -> None:
    for variant in variants:
        if variant not in VARIANTS:
            raise SystemExit(f"unknown variant {variant!r}; expected one of {', '.join(VARIANTS)}")
        try:
            compiled = compile_for_hopper(variant)
        except RuntimeError as error:  # (the pass's failure; its messages went to stderr)
            print("failed", variant, error, flush=True)
            continue
        assert "warp_specialize" in compiled.asm["ttgir"], f"{variant}: the loop was not warp-specialised"
        print("compiled", variant, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
