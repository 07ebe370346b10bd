"""Dense forward under sustained load: persistent vs regular configs vs Flex (6 interleaved rounds of 200 ms)."""
import functools, os, statistics, sys
os.environ["SPARSEFLASH_TUNE"] = "0"
import torch
sys.path.insert(0, "scripts")
import sparseflash
from sparseflash.attention.baselines import flex_attention, to_flex_block_mask
from sparseflash.attention.triton import configs
from sparseflash.masks import make
from sparseflash.timing import interleaved_times
from kernel_probe import captured_launches
KC = configs.KernelConfig
def q_(ts, p):
    s = sorted(ts); return s[int(p * (len(s) - 1))]
for dim, seq in ((64, 16384), (64, 4096), (128, 16384)):
    heads, batch = 2048 // dim, 16384 // seq
    q, k, v = (torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = make("dense", seq, block=128)
    key, launch = captured_launches(lambda: sparseflash.attention(q, k, v, mask, backend="triton"))["forward"]
    cfgs = [KC(128, 128, 4, 2, True), KC(128, 64, 4, 2, True), KC(128, 64, 8, 3), KC(64, 64, 4, 3), KC(128, 128, 8, 3), KC(128, 64, 4, 3)]
    fm = to_flex_block_mask(mask, q.device)
    fns = [functools.partial(launch, c) for c in cfgs] + [lambda: flex_attention(q, k, v, mask, block_mask=fm, dynamic=False)]
    names = [f"{c.block_m}x{c.block_n}w{c.num_warps}s{c.num_stages}{'P' if c.persistent else ''}" for c in cfgs] + ["flex"]
    for f in fns:
        f()
    times = interleaved_times(fns, 6, 200, 20)
    for n, ts in zip(names, times):
        print(f"hd{dim} S={seq} dense fwd {n:14s} median {statistics.median(ts):.4f} p20 {q_(ts, .2):.4f} p80 {q_(ts, .8):.4f} n={len(ts)}", flush=True)
