"""Prototype, kept as the record of kernel notes versions 21-22 (not part of the package): a persistent
SPARSE forward over full mask blocks only, with Q/K/V/O through device-side TMA descriptors and
Triton's warp specialisation on the outer (row) loop or the inner (key tile) loop. Even lengths, no
key_lengths, head_dim = HEAD_DIM, bf16, mask block SB. Its outputs: v21_autows_forward_prototype.txt
(version 21's variant table, LSE_MODE 0 and 1) and v22_lse_fix_prototype_*.txt (this table: LSE_MODE 2
and 4, lse addresses apart from o's coordinates; env S and D set the shape).

    PYTHONPATH=/tmp/t36:. python <this file> compile            # Triton 3.6 for sm_90a, no GPU needed
    PYTHONPATH=. python <this file> gpu local butterfly random  # H100: checked against the production
                                                                # kernel, then timed against it
"""
import os
import sys

import triton
import triton.language as tl


@triton.jit
def ws_fwd(Q, K, V, O, LSE, FULL_NUM, FULL_IDX,
           n_bh, heads, seq, n_qblk, n_kblk, qk_scale,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, SB: tl.constexpr,
           NUM_PROGRAMS: tl.constexpr, WS_OUTER: tl.constexpr, WS_INNER: tl.constexpr,
           INNER_STAGES: tl.constexpr, LSE_MODE: tl.constexpr = 0):
    rows = n_bh * seq
    q_desc = tl.make_tensor_descriptor(Q, shape=[rows, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK_M, HEAD_DIM])
    k_desc = tl.make_tensor_descriptor(K, shape=[rows, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V, shape=[rows, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM])
    o_desc = tl.make_tensor_descriptor(O, shape=[rows, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK_M, HEAD_DIM])
    TILES_PER_BLOCK: tl.constexpr = SB // BLOCK_N
    m_tiles = seq // BLOCK_M
    n_tiles = n_bh * m_tiles
    for tile in tl.range(tl.program_id(0), n_tiles, NUM_PROGRAMS, warp_specialize=WS_OUTER):
        bh = tile // m_tiles
        m_start = (tile % m_tiles) * BLOCK_M
        h = bh % heads
        table_row = h * n_qblk + m_start // SB
        num = tl.load(FULL_NUM + table_row)
        idx_row = FULL_IDX + table_row * n_kblk
        q = q_desc.load([bh * seq + m_start, 0])
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        for t in tl.range(0, num * TILES_PER_BLOCK, num_stages=INNER_STAGES, warp_specialize=WS_INNER):
            block = tl.load(idx_row + t // TILES_PER_BLOCK)
            kv_row = bh * seq + block * SB + (t % TILES_PER_BLOCK) * BLOCK_N
            k = k_desc.load([kv_row, 0])
            v = v_desc.load([kv_row, 0])
            s = tl.dot(q, k.T) * qk_scale
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc)
            m_i = m_new
        seen = l_i > 0.0
        l_safe = tl.where(seen, l_i, 1.0)
        lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        offs = bh * seq + m_start + tl.arange(0, BLOCK_M)
        if LSE_MODE == 1:  # lse stored before o
            tl.store(LSE + offs, lse)
        if LSE_MODE == 2:  # pointer advanced per head, row index separately
            tl.store(LSE + bh * seq + (m_start + tl.arange(0, BLOCK_M)), lse)
        if LSE_MODE == 3:  # row offsets as a 2D column
            rows2 = (m_start + tl.arange(0, BLOCK_M))[:, None]
            tl.store(LSE + bh * seq + rows2, lse[:, None])
        if LSE_MODE == 4:  # lse stored in a second O-like column... via tile index
            tl.store(LSE + tile * BLOCK_M + tl.arange(0, BLOCK_M), lse)
        o_desc.store([bh * seq + m_start, 0], (acc / l_safe[:, None]).to(O.dtype.element_ty))
        if LSE_MODE == 0:
            tl.store(LSE + offs, lse)


VARIANTS = {  # name: (BLOCK_M, BLOCK_N, warps, stages, ws_outer, ws_inner, inner_stages, programs per SM (0: one per tile), LSE_MODE)
    "persist-plain-64x64w4s3": (64, 64, 4, 3, False, False, 3, 2, 0),
    "persist-wsouter-128x64w4s2-lse2": (128, 64, 4, 2, True, False, 2, 1, 2),
    "persist-wsouter-128x64w4s3-lse2": (128, 64, 4, 3, True, False, 3, 1, 2),
    "persist-wsouter-128x128w4s2-lse2": (128, 128, 4, 2, True, False, 2, 1, 2),
    "persist-wsouter-128x128w4s2-lse4": (128, 128, 4, 2, True, False, 2, 1, 4),
}


def compile_local(name):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    bm, bn, warps, stages, wso, wsi, ist, per_sm, lse_mode = VARIANTS[name]
    fn = ws_fwd
    constants = dict(BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=int(os.environ.get('D', 128)), SB=128, NUM_PROGRAMS=132 * per_sm or 2048, WS_OUTER=wso, WS_INNER=wsi,
                     INNER_STAGES=ist, LSE_MODE=lse_mode)
    signature, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in constants:
            signature[arg] = "constexpr"
        elif arg in ("Q", "K", "V", "O"):
            signature[arg] = "*bf16"; attrs[(i,)] = [["tt.divisibility", 16]]
        elif arg == "LSE":
            signature[arg] = "*fp32"; attrs[(i,)] = [["tt.divisibility", 16]]
        elif arg.isupper():
            signature[arg] = "*i32"; attrs[(i,)] = [["tt.divisibility", 16]]
        elif arg == "qk_scale":
            signature[arg] = "fp32"
        else:
            signature[arg] = "i32"
            if arg == "seq":
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, attrs=attrs,
                    constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))


def main_compile():
    import re
    import subprocess
    import tempfile
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in sys.argv[2:] or VARIANTS:
        try:
            k = compile_local(name)
        except Exception as err:  # noqa: BLE001
            print(f"{name}: FAILED {type(err).__name__}: {str(err)[:400]}")
            continue
        ttgir = k.asm["ttgir"]
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"]); f.flush()
            sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", f.name], capture_output=True,
                                  text=True).stdout
        n_instr = len(re.findall(r'/\*[0-9a-f]{4,}\*/', sass))
        print(f"{name}: ws ops in ttgir {ttgir.count('ttg.warp_specialize')} partitions "
              f"{ttgir.count('partition')} | SASS {n_instr} instr, "
              f"SETMAXNREG {sass.count('SETMAXNREG')}, HGMMA {sass.count('HGMMA')}, UTMALDG {sass.count('UTMALDG')}, "
              f"LDGSTS {sass.count('LDGSTS')}, spills {sass.count('STL')}, smem {k.metadata.shared}")
        with open(f"/tmp/ws_{name}.ttgir", "w") as f:
            f.write(ttgir)
        with open(f"/tmp/ws_{name}.sass", "w") as f:
            f.write(sass)


def main_gpu():
    import functools
    import statistics

    import torch

    import sparseflash
    from sparseflash.masks import make
    from sparseflash.timing import interleaved_times

    triton.set_allocator(lambda size, align, stream: torch.empty(size, device="cuda", dtype=torch.int8))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    S, D = int(os.environ.get('S', 16384)), int(os.environ.get('D', 128)); H = 16 * 128 // D; B = 16384 // S
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qk_scale = D ** -0.5 * 1.4426950408889634
    dense = lambda: sparseflash.attention(q, k, v, make("dense", S, block=128), backend="triton")  # noqa: E731
    dense_ms = statistics.median(interleaved_times([dense], 2, 200, 50)[0])
    print(f"dense production fwd {dense_ms:.4f} ms", flush=True)
    params_of = {"local": {"window": 2}, "butterfly": {}, "random": {"density": 0.25}}
    for name in sys.argv[2:]:
        params = params_of[name]
        mask = make(name, S, block=128, **params)
        tables = mask.tables("cuda")
        assert int(tables.partial_kv_num_blocks.sum()) == 0, "prototype walks full blocks only"
        num = tables.full_kv_num_blocks.expand(H, -1).contiguous()
        idx = tables.full_kv_indices.expand(H, -1, -1).contiguous()
        n_qblk, n_kblk = idx.shape[1], idx.shape[2]
        o_ref, lse_ref = sparseflash.attention(q, k, v, mask, backend="triton", return_lse=True)
        fns = {"production": lambda: sparseflash.attention(q, k, v, mask, backend="triton")}
        for var, (bm, bn, warps, stages, wso, wsi, ist, per_sm, lse_mode) in VARIANTS.items():
            o = torch.empty_like(q)
            lse = torch.empty(B, H, S, device="cuda", dtype=torch.float32)
            programs = sms * per_sm or B * H * S // bm
            launch = functools.partial(
                ws_fwd[(programs,)], q, k, v, o, lse, num, idx, B * H, H, S, n_qblk, n_kblk, qk_scale,
                BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=D, SB=128, NUM_PROGRAMS=programs, WS_OUTER=wso,
                WS_INNER=wsi, INNER_STAGES=ist, LSE_MODE=lse_mode, num_warps=warps, num_stages=stages)
            try:
                o.fill_(float("nan"))
                launch()
                torch.cuda.synchronize()
            except Exception as err:  # noqa: BLE001
                print(f"  {name} {var}: FAILED {type(err).__name__}: {str(err)[:300]}", flush=True)
                continue
            err_o = ((o.float() - o_ref.float()).norm() / o_ref.float().norm()).item()
            err_l = ((lse - lse_ref).abs().max()).item()
            ok = err_o < 1e-2 and err_l < 1e-2 and not o.isnan().any().item()
            bad = ((lse - lse_ref).abs() > 1e-2).flatten()
            half = (torch.arange(bad.numel(), device="cuda") % 128) >= 64
            print(f"  {name} {var}: rel err o {err_o:.2e} lse max abs {err_l:.2e} {'OK' if ok else 'WRONG'}; "
                  f"bad lse rows {bad.float().mean().item():.3f} (first halves {bad[~half].float().mean().item():.3f}, "
                  f"second {bad[half].float().mean().item():.3f})", flush=True)
            fns[var + ("" if ok else " (WRONG)")] = launch
        times = interleaved_times(list(fns.values()), 4, 60, 15)
        for var, ts in zip(fns, times):
            ms = statistics.median(ts)
            print(f"  {name} {var:30s} {ms:.4f} ms  bar ratio {ms / (mask.density * dense_ms):.3f}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        main_compile()
    else:
        main_gpu()
