"""Host (CPU) cost against GPU time per call at S=1024: sparseflash-triton against FlexAttention,
forward and forward+backward, per pattern; plus each of our launch closures, an autograd Function
that does nothing and a Triton kernel of 3 arguments. Source of
docs/results/h100_kernels/probes/*host_time*:

    PYTHONPATH=. python scripts/host_time.py [--dims 64 128] [--patterns random dense] [--profile]

host: CPU time to queue one call, from bursts of a few calls after a sync (short enough that the
launch queue never fills, so the host never waits for the GPU). gpu: the kernels' own time per call
(torch.profiler). bench: the median of triton.testing.do_bench as the harness takes it. A call
whose host time exceeds its GPU time is host-bound: its bench time follows the host.
"""

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
import triton
import triton.language as tl
from kernel_probe import PATTERNS, captured_launches, kernel_times  # scripts/ is on the path when run
from triton.testing import do_bench

import sparseflash
from sparseflash.attention.baselines import flex_attention, to_flex_block_mask
from sparseflash.attention.triton import configs
from sparseflash.masks import make


def host_ms(step, calls: int = 10, rounds: int = 40) -> float:
    """Median over ``rounds`` of the CPU ms per call of a burst of ``calls`` calls after a sync."""
    for _ in range(5):
        step()
    per_call = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            step()
        per_call.append((time.perf_counter() - start) / calls * 1e3)
    torch.cuda.synchronize()
    return statistics.median(per_call)


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
    print(f"floor: tiny triton launch (3 args) host {host_ms(lambda: _tiny[(1,)](x, 16, BLOCK=16)):.4f} ms")
    leaf = torch.randn(16, device="cuda", requires_grad=True)

    def identity_step():
        _Identity.apply(leaf).backward(torch.ones_like(leaf))
        leaf.grad = None

    print(f"floor: autograd (clone fwd, identity bwd) host {host_ms(identity_step):.4f} ms")


def attention_calls(dim: int, pattern: str, profile: bool, seq: int = 1024) -> None:
    heads, batch = 2048 // dim, 16384 // seq
    q, k, v, do = (torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    mask = make(pattern, seq, block=128, **PATTERNS[pattern])
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

    def forward_only(fn):
        def step():
            with torch.no_grad():
                fn()
        return step

    for name, fn in peers.items():
        for mode, step in (("fwd", forward_only(fn)), ("fwdbwd", fwd_bwd(fn))):
            kernels = kernel_times(step, calls=10)
            gpu = sum(us for us, _, _ in kernels) / 1e3
            bench = do_bench(step, warmup=25, rep=300, return_mode="median", grad_to_none=leaves)
            print(f"D={dim} {pattern:9} {mode:6} {name}: host {host_ms(step):.4f} gpu {gpu:.4f} bench {bench:.4f} ms")
            for us, launches, kernel in kernels:
                print(f"     {us:8.1f} us x{launches:g} {kernel[:80]}")
    for kernel, (key, launch) in captured_launches(fwd_bwd(peers["ours"])).items():
        cfg = configs._chosen[kernel, key]
        print(f"D={dim} {pattern:9} launch closure {kernel} {cfg}: host {host_ms(lambda: launch(cfg)):.4f} ms")
    if profile:
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--patterns", nargs="+", default=["random"], choices=list(PATTERNS))
    parser.add_argument("--profile", action="store_true", help="cProfile 200 of our fwd+bwd calls")
    args = parser.parse_args()
    floors()
    for dim in args.dims:
        for pattern in args.patterns:
            attention_calls(dim, pattern, args.profile)


if __name__ == "__main__":
    main()
