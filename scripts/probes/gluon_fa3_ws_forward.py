"""Prototype: FA3's forward structure in Gluon for Hopper. A producer warpgroup loads Q (two 64-row halves)
and K/V tiles by TMA into STAGES buffers (ready/empty mbarriers); two consumer warpgroups, each a partition
holding 64 query rows, take turns issuing their products (named barriers 8 and 9, PINGPONG), and overlap
their softmax with their own PV product (issue S_j and PV_{j-1}, wait for S_j only). Dense and causal,
S a multiple of 128, (B, H, S, D) contiguous bf16."""
import math
import os
import subprocess
import sys
import tempfile

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def _named_sync(barrier: gl.constexpr, x):
    """bar.sync ``barrier`` for the two consumer warpgroups (256 threads); returns x."""
    return gl.inline_asm_elementwise(f"bar.sync {barrier}, 256; mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _named_arrive(barrier: gl.constexpr, x):
    """bar.arrive ``barrier`` for the two consumer warpgroups (256 threads); returns x."""
    return gl.inline_asm_elementwise(f"bar.arrive {barrier}, 256; mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, q_row, row0,
              n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_ready, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [q_row + q_desc.block_type.shape[0], 0], q_ready, q_smem.index(1))
    for j in range(n_tiles):
        stage = j % STAGES
        mbarrier.wait(kv_empty.index(stage), ((j // STAGES) - 1) & 1, pred=j >= STAGES)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row0 + j * BLOCK_N, 0], k_ready.index(stage), k_smem.index(stage))
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row0 + j * BLOCK_N, 0], v_ready.index(stage), v_smem.index(stage))


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, O, LSE, q_row, m_start, n_tiles, qk_scale,
              WG: gl.constexpr, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
              STAGES: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    MY_TURN: gl.constexpr = 8 + WG
    THEIR_TURN: gl.constexpr = 9 - WG

    q = q_smem.index(WG)
    offs_m = m_start + WG * HALF_M + gl.arange(0, HALF_M, layout=row_s)
    offs_n = gl.arange(0, BLOCK_N, layout=col_s)
    zero_s = gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout)
    turn = n_tiles
    if PINGPONG:
        if WG == 1:
            turn = _named_arrive(8, turn)  # warpgroup 0 goes first
    mbarrier.wait(q_ready, 0)
    mbarrier.wait(k_ready.index(0), 0)
    if PINGPONG:
        turn = _named_sync(MY_TURN, turn)
    s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    if PINGPONG:
        turn = _named_arrive(THEIR_TURN, turn)
    s = warpgroup_mma_wait(0, deps=(s,))
    if CAUSAL:
        s = gl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
    m_i = gl.max(s, 1)
    p = gl.exp2(s * qk_scale - (m_i * qk_scale)[:, None])
    l_i = gl.sum(p, 1)
    p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    acc = gl.zeros([HALF_M, HEAD_DIM], gl.float32, o_layout)
    mbarrier.wait(k_ready.index(1 % STAGES), 0, pred=1 < n_tiles)
    for j in range(1, n_tiles):
        stage = j % STAGES
        prev = (j - 1) % STAGES
        if PINGPONG:
            turn = _named_sync(MY_TURN, turn)
        s = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        if PINGPONG:
            turn = _named_arrive(THEIR_TURN, turn)
        s = warpgroup_mma_wait(1, deps=(s,))
        if CAUSAL:
            s = gl.where(offs_m[:, None] >= (j * BLOCK_N + offs_n)[None, :], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        alpha = gl.exp2((m_i - m_new) * qk_scale)
        p = gl.exp2(s * qk_scale - (m_new * qk_scale)[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        # the next key tile's wait sits here: its branch keeps ptxas from hoisting the PV wait above the softmax
        mbarrier.wait(k_ready.index((j + 1) % STAGES), ((j + 1) // STAGES) & 1, pred=j + 1 < n_tiles)
        p_new = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        alpha_o = gl.convert_layout(alpha, row_o)
        acc, p_op, p_new, alpha_o, l_i = warpgroup_mma_wait(0, deps=(acc, p_op, p_new, alpha_o, l_i))
        mbarrier.arrive(kv_empty.index(prev))  # this warpgroup is done with K_{j-1} and V_{j-1}
        acc = acc * alpha_o[:, None]
        p_op = p_new
    last = (n_tiles - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // STAGES) & 1)
    acc = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    if PINGPONG:
        if WG == 0:
            turn = _named_sync(8, turn)  # warpgroup 1's last turn, so that the counts balance
    l_o = gl.convert_layout(l_i, row_o)
    o = acc / l_o[:, None]
    rows = q_row + WG * HALF_M + gl.arange(0, HALF_M, layout=row_o)
    gl.store(O + rows[:, None] * HEAD_DIM + gl.arange(0, HEAD_DIM, layout=col_o)[None, :], o.to(gl.bfloat16))
    lse = (m_i * qk_scale + gl.log2(l_i)) * 0.6931471805599453
    gl.store(LSE + q_row + WG * HALF_M + gl.arange(0, HALF_M, layout=row_s), lse + (turn * 0).to(gl.float32))


@gluon.jit
def fa_fwd_ws(q_desc, k_desc, v_desc, O, LSE, seq_len, qk_scale,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, PINGPONG: gl.constexpr):
    HALF_M: gl.constexpr = BLOCK_M // 2
    m_tiles = seq_len // BLOCK_M
    if CAUSAL:
        start_m = m_tiles - 1 - gl.program_id(0)
        n_tiles = (start_m + 1) * BLOCK_M // BLOCK_N
    else:
        start_m = gl.program_id(0)
        n_tiles = seq_len // BLOCK_N
    row0 = gl.program_id(1) * seq_len
    m_start = start_m * BLOCK_M
    q_row = row0 + m_start

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, HALF_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)  # one arrival per consumer warpgroup

    gl.warp_specialize([
        (_consumer, (q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, O, LSE, q_row, m_start, n_tiles,
                     qk_scale, 0, HALF_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, PINGPONG)),
        (_consumer, (q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, O, LSE, q_row, m_start, n_tiles,
                     qk_scale, 1, HALF_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, PINGPONG)),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, v_ready, kv_empty, q_row,
                     row0, n_tiles, BLOCK_N, STAGES)),
    ], [4, 4], [240, 24])


def descriptors(q, k, v, block_m, block_n):
    d = q.shape[-1]
    q_layout = gl.NVMMASharedLayout.get_default_for([block_m // 2, d], gl.bfloat16)
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, d], gl.bfloat16)
    flat = lambda x: x.reshape(-1, d)  # noqa: E731
    return (TensorDescriptor.from_tensor(flat(q), [block_m // 2, d], q_layout),
            TensorDescriptor.from_tensor(flat(k), [block_n, d], kv_layout),
            TensorDescriptor.from_tensor(flat(v), [block_n, d], kv_layout))


def forward(q, k, v, causal, block_m=128, block_n=128, stages=3, pingpong=True):
    assert stages >= 3, "a consumer waits for K_{j+1} before it releases the stage of tile j-1"
    B, H, S, D = q.shape
    o = torch.empty_like(q)
    lse = torch.empty(B, H, S, device=q.device, dtype=torch.float32)
    fa_fwd_ws[(S // block_m, B * H)](*descriptors(q, k, v, block_m, block_n), o, lse, S,
                                      D ** -0.5 * math.log2(math.e), block_m, block_n, D, stages, causal, pingpong,
                                      num_warps=4)
    return o, lse


def compile_offline(d=128, causal=False, block_m=128, block_n=128, stages=3, pingpong=True):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type
    x = torch.empty(4 * 4096, d, dtype=torch.bfloat16)
    descs = descriptors(x, x, x, block_m, block_n)
    fn = fa_fwd_ws
    sig = {name: mangle_type(a) for name, a in zip(fn.arg_names[:3], descs)}
    sig.update(O="*bf16", LSE="*fp32", seq_len="i32", qk_scale="fp32")
    consts = dict(BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, STAGES=stages, CAUSAL=causal, PINGPONG=pingpong)
    for name in consts:
        sig[name] = "constexpr"
    src = GluonASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                         attrs={(fn.arg_names.index("O"),): [["tt.divisibility", 16]],
                                (fn.arg_names.index("LSE"),): [["tt.divisibility", 16]]})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


def sass_of(kernel):
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        open(ptx, "w").write(kernel.asm["ptx"])
        open(cubin, "wb").write(kernel.asm["cubin"])
        usage = subprocess.run([os.path.join(tools, "ptxas"), "-arch=sm_90a", "-v", ptx, "-o", os.devnull],
                               capture_output=True, text=True).stderr
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout
    return sass, [line.strip() for line in usage.splitlines() if "Used" in line or "spill" in line or "arning" in line]


if __name__ == "__main__" and sys.argv[1:2] == ["offline"]:
    for args in eval(sys.argv[2]) if len(sys.argv) > 2 else [dict()]:
        kernel = compile_offline(**args)
        sass, usage = sass_of(kernel)
        name = "_".join(f"{a}{b}" for a, b in args.items()) or "base"
        open(f"/tmp/ws_{name}.sass", "w").write(sass)
        open(f"/tmp/ws_{name}.ttgir", "w").write(kernel.asm["ttgir"])
        print(args, "shared", kernel.metadata.shared, usage)


CASES = [("S256 d64", 256, 64, {}), ("S512 d128", 512, 128, {}), ("S512 d128 nopp", 512, 128, dict(pingpong=False)),
         ("S1024 d128 causal", 1024, 128, dict(causal=True))]

if __name__ == "__main__" and sys.argv[1:2] == ["check"]:  # each case in a subprocess with a timeout: a hang shows
    for i, case in enumerate(CASES):
        try:
            r = subprocess.run([sys.executable, __file__, "case", str(i)], capture_output=True, text=True, timeout=60)
            print(case[0], "rc", r.returncode, r.stdout.strip()[-200:], r.stderr.strip()[-400:], flush=True)
        except subprocess.TimeoutExpired:
            print(case[0], "TIMEOUT (hang)", flush=True)

if __name__ == "__main__" and sys.argv[1:2] == ["case"]:
    name, S, d, kw = CASES[int(sys.argv[2])]
    causal = kw.pop("causal", False)
    q, k, v = (torch.randn(2, 2, S, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    o, lse = forward(q, k, v, causal, **kw)
    torch.cuda.synchronize()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    print("err", ((o.float() - ref.float()).norm() / ref.float().norm()).item(), "nan", bool(o.isnan().any()))

if __name__ == "__main__" and sys.argv[1:2] == ["bench"]:
    import statistics
    import sparseflash
    from sparseflash.masks import make
    from sparseflash.timing import interleaved_times
    for d in (128, 64):
        for S in (4096, 16384):
            for causal in (False, True):
                B, heads = 16384 // S, 2048 // d
                q, k, v = (torch.randn(B, heads, S, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                mask = make("causal" if causal else "dense", S, block=128)
                ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
                names, fns, notes = [], [], []
                for name, kw in {"ws_pp": {}, "ws": dict(pingpong=False)}.items():
                    o, _ = forward(q, k, v, causal, **kw)
                    err = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
                    notes.append(f"{name} err {err:.1e}")
                    names.append(name)
                    fns.append(lambda kw=kw: forward(q, k, v, causal, **kw))
                with torch.no_grad():
                    sparseflash.attention(q, k, v, mask, backend="triton")
                    names += ["sparseflash", "sdpa"]
                    fns += [lambda: sparseflash.attention(q, k, v, mask, backend="triton"),
                            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)]
                    times = interleaved_times(fns, 3, 60, 15)
                flops = 4 * B * heads * S * S * d * (0.5 if causal else 1.0)
                print(f"hd{d} S{S} {'causal' if causal else 'dense'} ({'; '.join(notes)}): " + " | ".join(
                    f"{n} {statistics.median(t):.4f} ms ({flops / statistics.median(t) / 1e9:.0f})"
                    for n, t in zip(names, times)), flush=True)
