"""A/B of the persistent forward with and without ping-pong between its consumer warpgroups."""
import os, statistics
os.environ["SPARSEFLASH_PERSISTENT"] = "1"
import torch
import sparseflash
from sparseflash.attention.triton import tuning
from sparseflash.attention.baselines import flex_attention, sdpa_attention, to_flex_block_mask
from sparseflash.masks import make
from sparseflash.timing import interleaved_times

PATTERNS = {"dense": {}, "causal": {}, "butterfly": {}, "local": {"window": 2}, "random": {"density": 0.25}}
dims = [int(x) for x in os.environ.get("DIMS", "128 64").split()]
seqs = [int(x) for x in os.environ.get("SEQS", "4096 16384").split()]
pats = os.environ.get("PATS", "dense causal local butterfly random").split()
heads = int(os.environ.get("HEADS", "16"))
flex_on = os.environ.get("FLEX", "1") == "1"
fa4_on = os.environ.get("FA4", "0") == "1"

def setpp(flag):
    os.environ["SPARSEFLASH_PINGPONG"] = flag

for hd in dims:
    for S in seqs:
        for pat in pats:
            B = 16384 // S
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(B, heads, S, hd, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
            mask = make(pat, S, block=128, **PATTERNS[pat])
            outs = {}
            with torch.no_grad():
                for flag in ("0", "1"):
                    setpp(flag)
                    with tuning.recording() as launched:
                        o, lse = sparseflash.attention(q, k, v, mask, backend="triton", return_lse=True)
                    torch.cuda.synchronize()
                    outs[flag] = (o.clone(), lse.clone())
                entry = [e for e in launched if e.kernel == "forward"][0]
                same = torch.equal(outs["0"][0], outs["1"][0]) and torch.equal(outs["0"][1], outs["1"][1])
                nan = bool(outs["1"][0].isnan().any())
                cfgs = tuning.PERSISTENT_FORWARD
                fns, names = [], []
                for cfg in cfgs:
                    for flag in ("0", "1"):
                        def f(cfg=cfg, flag=flag):
                            setpp(flag)
                            entry.relaunch(cfg)
                        fns.append(f); names.append(f"{cfg.block_m}x{cfg.block_n}{'pp' if flag=='1' else ''}")
                if flex_on:
                    fm = to_flex_block_mask(mask, "cuda")
                    fns.append(lambda: flex_attention(q, k, v, mask, block_mask=fm, dynamic=False)); names.append("flex")
                if fa4_on:
                    fm4 = to_flex_block_mask(mask, "cuda")
                    fns.append(lambda: flex_attention(q, k, v, mask, block_mask=fm4, dynamic=False, backend="FLASH")); names.append("fa4")
                if pat in ("dense", "causal"):
                    fns.append(lambda: sdpa_attention(q, k, v, mask)); names.append("sdpa")
                times = interleaved_times(fns, 3, 60, 15, catch=(Exception,))
            flops = 4 * B * heads * S * S * hd * mask.density
            row = []
            for n, t in zip(names, times):
                if isinstance(t, BaseException):
                    row.append(f"{n} ERR {type(t).__name__}")
                else:
                    ms = statistics.median(t)
                    row.append(f"{n} {ms:.4f} ({flops / ms / 1e9:.0f})")
            print(f"hd{hd} S{S} {pat:9} same={same} nan={nan} chosen={entry.config} | " + " | ".join(row), flush=True)
