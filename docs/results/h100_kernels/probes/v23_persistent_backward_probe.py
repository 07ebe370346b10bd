"""Persistent backward against the regular one: correctness (grads vs regular config) and backward-only timings."""
import functools, os, statistics, sys
os.environ.setdefault("SPARSEFLASH_TUNE", "0")
import torch
sys.path.insert(0, "scripts")
import sparseflash
from sparseflash.attention.baselines import flex_attention, to_flex_block_mask
from sparseflash.attention.triton import configs
from sparseflash.masks import make
from sparseflash.timing import interleaved_times
from kernel_probe import captured_launches
KC = configs.KernelConfig
REG = {128: {"backward": [KC(128, 64, 8, 3), KC(64, 64, 4, 2)]},
       64: {"dkdv": [KC(128, 64, 8, 3), KC(64, 64, 4, 3)], "dq": [KC(128, 64, 4, 3), KC(64, 64, 4, 3)]}}
PERS = {128: {"backward": [KC(128, 64, 4, 2, True)]},
        64: {"dkdv": [KC(128, 64, 4, 2, True), KC(128, 128, 4, 2, True)], "dq": [KC(128, 128, 4, 2, True), KC(128, 64, 4, 2, True)]}}
PAT = {"local": {"window": 2}, "butterfly": {}, "random": {"density": 0.25}, "dense": {}, "causal": {}}
dims = [int(d) for d in os.environ.get("DIMS", "128 64").split()]
seqs = [int(s) for s in os.environ.get("SEQS", "16384 4096 1024").split()]
pats = os.environ.get("PATS", "local butterfly random dense causal").split()
def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
for dim in dims:
    for seq in seqs:
        for pattern in pats:
            heads, batch = 2048 // dim, 16384 // seq
            q, k, v, do = (torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            mask = make(pattern, seq, block=128, **PAT[pattern])
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
            cap = captured_launches(lambda: sparseflash.attention(*leaves, mask, backend="triton").backward(do))
            kernels = [n for n in cap if n != "forward"]
            def grads_with(cfgs):
                for n in kernels:
                    configs._chosen[(n, cap[n][0])] = cfgs[n]
                for x in leaves:
                    x.grad = None
                sparseflash.attention(*leaves, mask, backend="triton").backward(do)
                return [x.grad.clone() for x in leaves]
            reg = grads_with({n: REG[dim][n][0] for n in kernels})
            per = grads_with({n: PERS[dim][n][0] for n in kernels})
            errs = " ".join(f"{nm} {rel(a, b):.2e}" for nm, a, b in zip(("dq", "dk", "dv"), per, reg))
            nan = any(torch.isnan(g).any().item() for g in per)
            print(f"hd{dim} S={seq} {pattern}: persistent vs regular rel err {errs} nan={nan}", flush=True)
            for n in kernels:
                key, launch = cap[n]
                cfgs = REG[dim][n] + PERS[dim][n]
                times = interleaved_times([functools.partial(launch, c) for c in cfgs], 4, 60, 10, catch=(Exception,))
                row = []
                for c, t in zip(cfgs, times):
                    tag = f"{c.block_m}x{c.block_n}w{c.num_warps}s{c.num_stages}{'P' if c.persistent else ''}"
                    row.append(f"{tag} {statistics.median(t):.4f}" if isinstance(t, list) else f"{tag} {type(t).__name__}")
                print(f"  {n}: " + ", ".join(row), flush=True)
