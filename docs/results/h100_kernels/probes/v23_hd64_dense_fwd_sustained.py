"""hd64 S=16384 dense fwd under continuous load (1.5 s blocks per config, like the harness's do_bench runs)."""
import os, statistics, sys, time
os.environ["SPARSEFLASH_TUNE"] = "0"
import torch, triton
sys.path.insert(0, "scripts")
import sparseflash
from sparseflash.attention.baselines import flex_attention, to_flex_block_mask
from sparseflash.attention.triton import configs
from sparseflash.masks import make
from kernel_probe import captured_launches
KC = configs.KernelConfig
dim, seq = 64, 16384
q, k, v = (torch.randn(1, 32, seq, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
mask = make("dense", seq, block=128)
key, launch = captured_launches(lambda: sparseflash.attention(q, k, v, mask, backend="triton"))["forward"]
fm = to_flex_block_mask(mask, q.device)
fns = {"128x128w4s2P": lambda: launch(KC(128, 128, 4, 2, True)), "128x64w8s3": lambda: launch(KC(128, 64, 8, 3)),
       "64x64w4s3": lambda: launch(KC(64, 64, 4, 3)), "128x64w4s3": lambda: launch(KC(128, 64, 4, 3)),
       "flex": lambda: flex_attention(q, k, v, mask, block_mask=fm, dynamic=False)}
for f in fns.values():
    f()
for rnd in range(2):
    for name, f in fns.items():
        ms = triton.testing.do_bench(f, warmup=300, rep=1500, return_mode="median")
        q20, q80 = triton.testing.do_bench(f, warmup=0, rep=300, quantiles=[0.2, 0.8])
        print(f"round {rnd} {name:14s} do_bench median {ms:.4f} (then p20 {q20:.4f} p80 {q80:.4f})", flush=True)
