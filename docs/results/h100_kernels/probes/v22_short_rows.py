"""Kernel notes version 22. S=1024 random 25% and local (hd64 and hd128): regular vs persistent forward, alone and inside fwd+bwd; host time per forward launch."""
import functools, os, statistics, sys, time
os.environ["SPARSEFLASH_TUNE"] = "0"
import torch
sys.path.insert(0, "scripts")
import sparseflash
from sparseflash.attention.baselines import flex_attention, to_flex_block_mask
from sparseflash.attention.triton import configs
from sparseflash.masks import make
from sparseflash.timing import interleaved_times
from kernel_probe import captured_launches
def q_(ts, p):
    s = sorted(ts); return s[int(p * (len(s) - 1))]
for dim in (64, 128):
    for pattern, params in (("random", {"density": 0.25}), ("local", {"window": 2})):
        seq = 1024
        heads, batch = 2048 // dim, 16384 // seq
        q, k, v, do = (torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        mask = make(pattern, seq, block=128, **params)
        cap = captured_launches(lambda: sparseflash.attention(q, k, v, mask, backend="triton"))
        key, launch = cap["forward"]
        cfgs = {"regular 128x64w8s3": configs.KernelConfig(128, 64, 8, 3), "regular 64x64w4s3": configs.KernelConfig(64, 64, 4, 3),
                "persistent 128x128": configs.KernelConfig(128, 128, 4, 2, True)}
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        def fwdbwd(cfg):
            configs._chosen[("forward", key)] = cfg
            o = sparseflash.attention(*leaves, mask, backend="triton")
            o.backward(do)
        flex_mask = to_flex_block_mask(mask, q.device)
        def flex_fb():
            o = flex_attention(*leaves, mask, block_mask=flex_mask, dynamic=False)
            o.backward(do)
        fns = {}
        for n, c in cfgs.items():
            fns[f"fwd {n}"] = functools.partial(launch, c)
        for n, c in cfgs.items():
            fns[f"fwdbwd {n}"] = functools.partial(fwdbwd, c)
        fns["fwdbwd flex"] = flex_fb
        for f in fns.values():
            f()
        torch.cuda.synchronize()
        for n, c in cfgs.items():  # host time of a forward launch (no sync), after warm-up
            t = time.perf_counter()
            for _ in range(200):
                launch(c)
            host = (time.perf_counter() - t) / 200 * 1e6
            torch.cuda.synchronize()
            print(f"hd{dim} {pattern} host per forward launch {n}: {host:.1f} us", flush=True)
        times = interleaved_times(list(fns.values()), 6, 100, 20, grad_to_none=leaves)
        for n, ts in zip(fns, times):
            print(f"hd{dim} {pattern} S={seq} {n:30s} median {statistics.median(ts):.4f} p20 {q_(ts, .2):.4f} p80 {q_(ts, .8):.4f} n={len(ts)}", flush=True)
