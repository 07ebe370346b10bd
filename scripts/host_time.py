"""Host (CPU) time per call at S=1024, random 25%: sparseflash-triton against FlexAttention
(forward and forward+backward), each of our launch closures, an autograd Function that does
nothing, a Triton kernel of 3 arguments, and a cProfile of our fwd+bwd. Source of
docs/results/h100_kernels/probes/v16_host_time_*:

    PYTHONPATH=. python scripts/host_time.py

Calls are queued without a sync between them, so where the GPU is faster than the host the CPU
time per call is the host's cost of a call.
"""

import cProfile
import io
import pstats
import time

import torch
import triton
import triton.language as tl
from kernel_probe import captured_launches  # scripts/ is on the path when this file runs

import sparseflash
from sparseflash.attention.baselines import flex_attention, to_flex_block_mask
from sparseflash.attention.triton import configs
from sparseflash.masks import make


def cpu_per_call(step, n: int = 300) -> str:
    """CPU and wall ms per call of ``step`` over n calls, after 20 warm-up calls."""
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        step()
    cpu = (time.perf_counter() - start) / n * 1e3
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / n * 1e3
    return f"cpu {cpu:.4f} ms wall {wall:.4f} ms"


@triton.jit
def _tiny(X, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(X + offs, offs, mask=offs < n)


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


def floors() -> None:
    """The cost of a bare Triton launch and of autograd around a Function that does nothing."""
    x = torch.zeros(16, device="cuda", dtype=torch.int32)
    print("tiny triton launch (3 args):", cpu_per_call(lambda: _tiny[(1,)](x, 16, BLOCK=16), 2000))
    leaf = torch.randn(16, device="cuda", requires_grad=True)

    def identity_step():
        _Identity.apply(leaf).backward(torch.ones_like(leaf))
        leaf.grad = None

    print("autograd floor (clone fwd, identity bwd):", cpu_per_call(identity_step, 1000))


def attention_calls(dim: int, seq: int = 1024) -> None:
    heads, batch = 2048 // dim, 16384 // seq
    q, k, v, do = (torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    mask = make("random", seq, block=128, density=0.25)
    flex_mask = to_flex_block_mask(mask, "cuda")
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    peers = {"ours": lambda: sparseflash.attention(*leaves, mask, backend="triton"),
             "flex": lambda: flex_attention(*leaves, mask, block_mask=flex_mask, dynamic=False)}

    def fwd_bwd(fn):
        def step():
            fn().backward(do)
            for t in leaves:
                t.grad = None
        return step

    for name, fn in peers.items():
        with torch.no_grad():
            print(f"D={dim} {name} fwd:", cpu_per_call(fn))
        print(f"D={dim} {name} fwd+bwd:", cpu_per_call(fwd_bwd(fn)))
    for kernel, (key, launch) in captured_launches(fwd_bwd(peers["ours"])).items():
        cfg = configs._chosen[kernel, key]
        print(f"D={dim} launch closure {kernel} {cfg}:", cpu_per_call(lambda: launch(cfg), 1000))
    profiler = cProfile.Profile()
    step = fwd_bwd(peers["ours"])
    profiler.enable()
    for _ in range(200):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    report = io.StringIO()
    pstats.Stats(profiler, stream=report).sort_stats("tottime").print_stats(30)
    print(report.getvalue()[:6000])


def main() -> None:
    floors()
    for dim in (64, 128):
        attention_calls(dim)


if __name__ == "__main__":
    main()
