"""Host (CPU) time per call, S=1024 random 25%: sparseflash-triton against FlexAttention (forward and
forward+backward), each of our launch closures, an autograd Function that does nothing, a Triton
kernel of 3 arguments, and a cProfile of our fwd+bwd. Source of probes/v16_host_time_*:

    PYTHONPATH=. python scripts/host_time.py
"""
import cProfile
import io
import pstats
import time

import torch
import triton
import triton.language as tl

import sparseflash
from sparseflash.attention.baselines import flex_attention, to_flex_block_mask
from sparseflash.attention.triton import configs
from sparseflash.masks import make

def cpu_per_call(step, n=300):
    """(CPU ms, wall ms) per call of ``step`` over n calls queued without a sync between them."""
    for _ in range(20): step()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n): step()
    cpu = (time.perf_counter() - t0) / n * 1e3
    torch.cuda.synchronize(); wall = (time.perf_counter() - t0) / n * 1e3
    return cpu, wall

@triton.jit
def _tiny(X, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(X + offs, offs, mask=offs < n)

x = torch.zeros(16, device="cuda", dtype=torch.int32)
print("tiny triton launch (3 args): cpu %.4f ms wall %.4f ms" % cpu_per_call(lambda: _tiny[(1,)](x, 16, BLOCK=16), 2000))
class Ident(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q):
        return q.clone()
    @staticmethod
    def backward(ctx, g):
        return g
leaf = torch.randn(16, device="cuda", requires_grad=True)
def ident_step():
    Ident.apply(leaf).backward(torch.ones_like(leaf))
    leaf.grad = None
print("autograd floor (clone fwd, identity bwd): cpu %.4f ms wall %.4f ms" % cpu_per_call(ident_step, 1000))
for dim in (64, 128):
    seq = 1024; heads, batch = 2048 // dim, 16384 // seq
    q, k, v, do = (torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    mask = make("random", seq, block=128, density=0.25)
    fm = to_flex_block_mask(mask, "cuda")
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    ours = lambda: sparseflash.attention(*leaves, mask, backend="triton")
    flex = lambda: flex_attention(*leaves, mask, block_mask=fm, dynamic=False)
    for name, fn in (("ours", ours), ("flex", flex)):
        with torch.no_grad():
            print(f"D={dim} {name} fwd: cpu %.4f ms wall %.4f ms" % cpu_per_call(fn))
        def step(fn=fn):
            fn().backward(do)
            for t in leaves: t.grad = None
        print(f"D={dim} {name} fwd+bwd: cpu %.4f ms wall %.4f ms" % cpu_per_call(step))
    captured = {}
    tuned = configs.run_tuned

    def capture(kernel, key, launch):
        captured[kernel] = (key, launch)
        return tuned(kernel, key, launch)

    configs.run_tuned = capture
    try:
        ours().backward(do)
    finally:
        configs.run_tuned = tuned
    for kernel, (key, launch) in captured.items():
        cfg = configs._chosen[kernel, key]
        print(f"D={dim} launch closure {kernel} {cfg}: cpu %.4f ms wall %.4f ms" % cpu_per_call(lambda: launch(cfg), 1000))
    def step():
        ours().backward(do)
        for t in leaves: t.grad = None
    pr = cProfile.Profile(); pr.enable()
    for _ in range(200): step()
    torch.cuda.synchronize(); pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30); print(s.getvalue()[:6000])
