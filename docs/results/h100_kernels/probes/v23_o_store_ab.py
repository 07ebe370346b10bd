# Ran against a prototype with a constexpr O_BY_TMA (both stores in one kernel) and a module flag O_BY_TMA_DEFAULT in forward.py (commit 1b6ca3a keeps the plain store for SPARSE only).
"""Persistent forward: o through TMA (descriptor store, consumers wait for it) vs a plain tl.store."""
import functools, os, statistics, sys
os.environ["SPARSEFLASH_PERSISTENT"] = "1"
os.environ["SPARSEFLASH_TUNE"] = "0"
import torch
sys.path.insert(0, "scripts")
import sparseflash
from sparseflash.attention.triton import configs, forward
from sparseflash.masks import make
from sparseflash.timing import interleaved_times
from kernel_probe import captured_launches
KC = configs.KernelConfig
PAT = {"local": {"window": 2}, "butterfly": {}, "random": {"density": 0.25}, "dense": {}, "causal": {}}
for dim in (128, 64):
    for seq in (16384, 4096, 1024):
        for pattern in PAT:
            heads, batch = 2048 // dim, 16384 // seq
            q, k, v = (torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            mask = make(pattern, seq, block=128, **PAT[pattern])
            outs = {}
            for flag in (True, False):
                forward.O_BY_TMA_DEFAULT = flag
                o, lse = sparseflash.attention(q, k, v, mask, backend="triton", return_lse=True)
                outs[flag] = (o.clone(), lse.clone())
            same = all(torch.equal(a, b) for a, b in zip(outs[True], outs[False]))
            nan = any(torch.isnan(x).any().item() for x in outs[False])
            cap = captured_launches(lambda: sparseflash.attention(q, k, v, mask, backend="triton"))
            key, launch = cap["forward"]
            cfgs = [KC(128, 128, 4, 2, True), KC(128, 64, 4, 2, True)]
            fns, names = [], []
            for c in cfgs:
                for flag in (True, False):
                    def run(c=c, flag=flag):
                        forward.O_BY_TMA_DEFAULT = flag
                        launch(c)
                    fns.append(run); names.append(f"{c.block_m}x{c.block_n} {'tma' if flag else 'st'}")
            times = interleaved_times(fns, 6, 50, 10)
            med = [statistics.median(t) for t in times]
            print(f"hd{dim} S={seq} {pattern:9s} same={same} nan={nan}: " + ", ".join(f"{n} {m:.4f}" for n, m in zip(names, med))
                  + f" | st/tma 128x128 {med[1]/med[0]:.3f} 128x64 {med[3]/med[2]:.3f}", flush=True)
