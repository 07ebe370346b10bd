"""Split backward at hd128 too: which persistent dq tiles are right, and dkdv / dq timings per config."""
import functools, os, statistics, sys
os.environ.setdefault("SPARSEFLASH_TUNE", "0")
import torch
sys.path.insert(0, "scripts")
import sparseflash
from sparseflash.attention.triton import backward, configs
from sparseflash.masks import make
from sparseflash.timing import interleaved_times
from kernel_probe import captured_launches
backward.FUSED_FROM_HEAD_DIM = 1000
KC = configs.KernelConfig
REG = {"dkdv": [KC(128, 64, 8, 3), KC(64, 64, 4, 2), KC(64, 64, 4, 3)], "dq": [KC(128, 64, 8, 3), KC(64, 64, 4, 2), KC(128, 64, 4, 3), KC(64, 64, 4, 3)]}
PERS = {"dkdv": [KC(128, 64, 4, 2, True), KC(64, 64, 4, 2, True)], "dq": [KC(128, 64, 4, 2, True), KC(128, 128, 4, 2, True), KC(64, 64, 4, 2, True), KC(64, 128, 4, 2, True)]}
PAT = {"local": {"window": 2}, "butterfly": {}, "random": {"density": 0.25}, "dense": {}, "causal": {}}
def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
def setup(dim, seq, pattern):
    heads, batch = 2048 // dim, 16384 // seq
    q, k, v, do = (torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    mask = make(pattern, seq, block=128, **PAT[pattern])
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    cap = captured_launches(lambda: sparseflash.attention(*leaves, mask, backend="triton").backward(do))
    def grads_with(cfgs):
        for n, c in cfgs.items():
            configs._chosen[(n, cap[n][0])] = c
        for x in leaves:
            x.grad = None
        try:
            sparseflash.attention(*leaves, mask, backend="triton").backward(do)
        except Exception as e:
            return type(e).__name__
        return [x.grad.clone() for x in leaves]
    return cap, grads_with
mode = sys.argv[1]
if mode == "check":
    for dim in (128, 64):
        for pattern in ("butterfly", "causal"):
            cap, grads_with = setup(dim, 4096, pattern)
            ref = grads_with({"dkdv": REG["dkdv"][0], "dq": REG["dq"][0]})
            for kern in ("dkdv", "dq"):
                for c in PERS[kern]:
                    other = "dq" if kern == "dkdv" else "dkdv"
                    g = grads_with({kern: c, other: REG[other][0]})
                    if isinstance(g, str):
                        print(f"hd{dim} {pattern} {kern} {c.block_m}x{c.block_n}P: {g}", flush=True); continue
                    i = 0 if kern == "dq" else 1
                    errs = " ".join(f"{nm} {rel(a, b):.1e}" for nm, a, b in zip(("dq", "dk", "dv"), g, ref))
                    print(f"hd{dim} {pattern} {kern} {c.block_m}x{c.block_n}P: {errs} nan={any(torch.isnan(x).any().item() for x in g)}", flush=True)
else:
    for dim in (128,):
        for pattern in mode.split(","):
            cap, _ = setup(dim, 16384, pattern)
            for n in ("dkdv", "dq"):
                key, launch = cap[n]
                cfgs = REG[n] + PERS[n]
                times = interleaved_times([functools.partial(launch, c) for c in cfgs], 4, 60, 10, catch=(Exception,))
                row = [f"{c.block_m}x{c.block_n}w{c.num_warps}s{c.num_stages}{'P' if c.persistent else ''} "
                       + (f"{statistics.median(t):.4f}" if isinstance(t, list) else type(t).__name__) for c, t in zip(cfgs, times)]
                print(f"hd{dim} S=16384 {pattern} {n}: " + ", ".join(row), flush=True)
