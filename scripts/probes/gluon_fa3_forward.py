"""Prototype: a Gluon FlashAttention forward for Hopper with FA3's intra-warpgroup overlap
(S_j = Q K_j^T issued, then O += P_{j-1} V_{j-1} issued, wait for S_j only, softmax of S_j under the PV
product, then wait for it). Dense and causal, S a multiple of 128, (B, H, S, D) contiguous bf16."""
import math
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)


@gluon.jit
def _load_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, row, stage, pred):
    mbarrier.expect(k_bars.index(stage), k_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(k_desc, [row, 0], k_bars.index(stage), k_smem.index(stage), pred=pred)
    mbarrier.expect(v_bars.index(stage), v_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(v_desc, [row, 0], v_bars.index(stage), v_smem.index(stage), pred=pred)


@gluon.jit
def fa_fwd(q_desc, k_desc, v_desc, o_desc, LSE, seq_len, qk_scale,
           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
           CAUSAL: gl.constexpr, OVERLAP: gl.constexpr, num_warps: gl.constexpr):
    m_tiles = seq_len // BLOCK_M
    if CAUSAL:
        start_m = m_tiles - 1 - gl.program_id(0)
    else:
        start_m = gl.program_id(0)
    bh = gl.program_id(1)
    row0 = bh * seq_len
    q_row = row0 + start_m * BLOCK_M
    if CAUSAL:
        n_tiles = (start_m + 1) * BLOCK_M // BLOCK_N
    else:
        n_tiles = seq_len // BLOCK_N

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        _load_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, row0 + i * BLOCK_N, i, i < n_tiles)

    offs_m = start_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_s)
    offs_n = gl.arange(0, BLOCK_N, layout=col_s)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)

    # tile 0
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bars.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    if CAUSAL:
        s = gl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
    m_i = gl.max(s, 1)
    p = gl.exp2(s * qk_scale - (m_i * qk_scale)[:, None])
    l_i = gl.sum(p, 1)
    p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    mbarrier.wait(k_bars.index(1 % STAGES), 0, pred=1 < n_tiles)

    for j in range(1, n_tiles):
        stage = j % STAGES
        prev = (j - 1) % STAGES
        s = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        if not OVERLAP:
            s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.wait(v_bars.index(prev), ((j - 1) // STAGES) & 1)
        acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        if OVERLAP:
            s = warpgroup_mma_wait(1, deps=(s,))
        if CAUSAL:
            s = gl.where(offs_m[:, None] >= (j * BLOCK_N + offs_n)[None, :], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        alpha = gl.exp2((m_i - m_new) * qk_scale)
        p = gl.exp2(s * qk_scale - (m_new * qk_scale)[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        # the next key tile's wait sits here: its branch keeps ptxas from hoisting the PV wait above the softmax
        nxt_k = j + 1
        mbarrier.wait(k_bars.index(nxt_k % STAGES), (nxt_k // STAGES) & 1, pred=nxt_k < n_tiles)
        # the softmax's results pass through the wait, so that nothing of it sinks below it
        p_new = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        alpha_o = gl.convert_layout(alpha, row_o)
        acc, p_op, p_new, alpha_o, l_i = warpgroup_mma_wait(0, deps=(acc, p_op, p_new, alpha_o, l_i))
        acc = acc * alpha_o[:, None]
        p_op = p_new
        # both warpgroups are done with stage prev (K_{j-1}, V_{j-1}): refill it
        gl.thread_barrier()
        nxt = j - 1 + STAGES
        _load_kv(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, row0 + nxt * BLOCK_N, prev, nxt < n_tiles)

    last = (n_tiles - 1) % STAGES
    mbarrier.wait(v_bars.index(last), ((n_tiles - 1) // STAGES) & 1)
    acc = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))

    l_o = gl.convert_layout(l_i, row_o)
    o = acc / l_o[:, None]
    lse = (m_i * qk_scale + gl.log2(l_i)) * 0.6931471805599453
    gl.store(LSE + q_row + gl.arange(0, BLOCK_M, layout=row_s), lse)
    q_smem.store(o.to(gl.bfloat16))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row, 0], q_smem)
    tma.store_wait(pendings=0)
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))


def descriptors(q, k, v, o, block_m, block_n):
    d = q.shape[-1]
    q_layout = gl.NVMMASharedLayout.get_default_for([block_m, d], gl.bfloat16)
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, d], gl.bfloat16)
    flat = lambda x: x.reshape(-1, d)
    return (TensorDescriptor.from_tensor(flat(q), [block_m, d], q_layout),
            TensorDescriptor.from_tensor(flat(k), [block_n, d], kv_layout),
            TensorDescriptor.from_tensor(flat(v), [block_n, d], kv_layout),
            TensorDescriptor.from_tensor(flat(o), [block_m, d], q_layout))


def forward(q, k, v, causal, block_m=128, block_n=128, stages=3, num_warps=8, overlap=True):
    assert stages >= 3, "the next key tile is waited for before the stage freed this iteration is refilled"
    B, H, S, D = q.shape
    o = torch.empty_like(q)
    lse = torch.empty(B, H, S, device=q.device, dtype=torch.float32)
    descs = descriptors(q, k, v, o, block_m, block_n)
    fa_fwd[(S // block_m, B * H)](*descs, lse, S, D ** -0.5 * math.log2(math.e), block_m, block_n, D, stages,
                                   causal, overlap, num_warps=num_warps)
    return o, lse


def compile_offline(d=128, causal=False, block_m=128, block_n=128, stages=3, num_warps=8, overlap=True):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type
    x = torch.empty(4 * 4096, d, dtype=torch.bfloat16)
    descs = descriptors(x, x, x, x, block_m, block_n)
    fn = fa_fwd
    sig = {name: mangle_type(a) for name, a in zip(fn.arg_names[:4], descs)}
    sig.update(LSE="*fp32", seq_len="i32", qk_scale="fp32")
    consts = dict(BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, STAGES=stages, CAUSAL=causal, OVERLAP=overlap,
                  num_warps=num_warps)
    for name in consts:
        sig[name] = "constexpr"
    src = GluonASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))


if __name__ == "__main__" and sys.argv[1:2] == ["offline"]:
    for args in [dict(), dict(causal=True), dict(d=64), dict(overlap=False)]:
        k = compile_offline(**args)
        sass = k.asm.get("sass", "")
        print(args, "shared", k.metadata.shared, "regs?", k.n_regs if hasattr(k, "n_regs") else "-")
        open(f"/tmp/gl_{'_'.join(f'{a}{b}' for a, b in args.items()) or 'base'}.ptx", "w").write(k.asm["ptx"])


if __name__ == "__main__" and sys.argv[1:2] == ["sass"]:
    import subprocess, tempfile
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for args in [dict(), dict(overlap=False), dict(d=64)]:
        k = compile_offline(**args)
        with tempfile.TemporaryDirectory() as tmp:
            ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
            open(ptx, "w").write(k.asm["ptx"])
            open(cubin, "wb").write(k.asm["cubin"])
            usage = subprocess.run([os.path.join(tools, "ptxas"), "-arch=sm_90a", "-v", ptx, "-o", os.devnull],
                                   capture_output=True, text=True).stderr
            sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout
        name = "_".join(f"{a}{b}" for a, b in args.items()) or "base"
        open(f"/tmp/gl_{name}.sass", "w").write(sass)
        print(args, [l for l in usage.splitlines() if "Used" in l or "spill" in l or "arn" in l])


if __name__ == "__main__" and sys.argv[1:2] == ["bench"]:
    import statistics
    import sparseflash
    from sparseflash.attention.baselines import sdpa_attention
    from sparseflash.masks import make
    from sparseflash.timing import interleaved_times
    heads = 16
    for d in (128, 64):
        for S in (4096, 16384):
            for causal in (False, True):
                B = 16384 // S
                q, k, v = (torch.randn(B, heads, S, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                mask = make("causal" if causal else "dense", S, block=128)
                ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
                variants = {"ov3": dict(), "noov3": dict(overlap=False)}
                if d == 64:
                    variants["ov3n64"] = dict(block_n=64)
                row = []
                fns, names = [], []
                for name, kw in variants.items():
                    try:
                        o, lse = forward(q, k, v, causal, **kw)
                        torch.cuda.synchronize()
                        err = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
                        row.append(f"{name} err {err:.1e} nan {bool(o.isnan().any())}")
                        fns.append(lambda kw=kw: forward(q, k, v, causal, **kw)); names.append(name)
                    except Exception as e:  # noqa
                        row.append(f"{name} FAILED {type(e).__name__}: {str(e)[:200]}")
                with torch.no_grad():
                    sparseflash.attention(q, k, v, mask, backend="triton")
                    fns.append(lambda: sparseflash.attention(q, k, v, mask, backend="triton")); names.append("sf")
                    fns.append(lambda: sdpa_attention(q, k, v, mask)); names.append("sdpa")
                    times = interleaved_times(fns, 3, 60, 15, catch=(Exception,))
                flops = 4 * B * heads * S * S * d * (0.5 if causal else 1.0)
                res = " | ".join(f"{n} {statistics.median(t):.4f} ({flops / statistics.median(t) / 1e9:.0f})"
                                 if isinstance(t, list) else f"{n} ERR" for n, t in zip(names, times))
                print(f"hd{d} S{S} {'causal' if causal else 'dense'}: " + "; ".join(row) + "\n    " + res, flush=True)
