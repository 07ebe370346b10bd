"""A one-minute demonstration: a butterfly mask, its picture, and dense vs butterfly attention.

Run with ``python -m sparseflash.demo`` (``make demo``). Uses the ``blocked`` backend on CPU and
``auto`` on CUDA, and checks the butterfly output against the fp32 reference.

On CPU the speed-up can exceed ``1/density``: the blocked backend's dense call holds temporaries
of tens of MiB (its score chunks: 64 MiB at the default size), which the C allocator takes from
the OS afresh on every call (glibc maps blocks above its mmap threshold, at most 32 MiB, and
unmaps them when freed), so the call also pays for the kernel zero-filling them page by page;
butterfly's smaller chunks are reused. With glibc told to keep freed memory
(``MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=4294967296``) the page faults vanish
and the speed-up falls to about ``1/density``. The demo measures that kernel time and says so.
"""

from __future__ import annotations

import argparse
import resource
import time
from dataclasses import dataclass

import torch

import sparseflash
from sparseflash.masks import make


@dataclass
class Timing:
    """Medians over the timed calls: wall seconds, user and system CPU seconds, minor page faults."""

    wall: float
    user: float
    system: float
    faults: int


def _timed(fn, repeats: int = 5) -> tuple[torch.Tensor, Timing]:
    out = fn()  # warm-up
    samples = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        usage, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
        samples.append((wall, after.ru_utime - usage.ru_utime, after.ru_stime - usage.ru_stime,
                        after.ru_minflt - usage.ru_minflt))
    median = lambda i: sorted(s[i] for s in samples)[len(samples) // 2]  # noqa: E731
    return out, Timing(median(0), median(1), median(2), median(3))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = "auto" if device == "cuda" else "blocked"
    mask = make("butterfly", args.seq_len, block=args.block)
    print(mask)
    print(f"butterfly density: {mask.density:.4f} of the {args.seq_len}x{args.seq_len} scores\n")

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, args.seq_len, args.head_dim, device=device) for _ in range(3))
    _, dense = _timed(lambda: sparseflash.attention(q, k, v, None, backend=backend))
    sparse_o, sparse = _timed(lambda: sparseflash.attention(q, k, v, mask, backend=backend))
    reference_o = sparseflash.attention(q, k, v, mask, backend="reference")
    speedup, ideal = dense.wall / sparse.wall, 1.0 / mask.density
    print(f"backend {backend} on {device}, B=1 H={args.heads} S={args.seq_len} D={args.head_dim}")
    print(f"dense attention:     {dense.wall * 1e3:8.1f} ms")
    print(f"butterfly attention: {sparse.wall * 1e3:8.1f} ms  ({speedup:.2f}x faster than dense; "
          f"1/density = {ideal:.2f}x)")
    if device == "cpu" and speedup > 1.1 * ideal and dense.system > 0.2 * dense.wall:
        print(f"  above 1/density: the dense call spends {dense.system * 1e3:.0f} ms in the kernel zero-filling "
              f"{dense.faults * resource.getpagesize() / 2**20:.0f} MiB of memory the allocator takes from the OS "
              f"afresh each call (butterfly: {sparse.system * 1e3:.0f} ms); in user CPU time butterfly is "
              f"{dense.user / max(sparse.user, 1e-9):.2f}x faster")
    print(f"max |butterfly - reference|: {(sparse_o - reference_o).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
