"""A one-minute demonstration: a butterfly mask, its picture, and dense vs butterfly attention.

Run with ``python -m sparseflash.demo`` (``make demo``). Uses the ``blocked`` backend on CPU and
``auto`` on CUDA, and checks the butterfly output against the fp32 reference.
"""

from __future__ import annotations

import argparse
import time

import torch

import sparseflash
from sparseflash.masks import make


def _timed(fn, repeats: int = 3) -> tuple[torch.Tensor, float]:
    out = fn()  # warm-up
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return out, sorted(times)[len(times) // 2]


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
    _, dense_s = _timed(lambda: sparseflash.attention(q, k, v, None, backend=backend))
    sparse_o, sparse_s = _timed(lambda: sparseflash.attention(q, k, v, mask, backend=backend))
    reference_o = sparseflash.attention(q, k, v, mask, backend="reference")
    print(f"backend {backend} on {device}, B=1 H={args.heads} S={args.seq_len} D={args.head_dim}")
    print(f"dense attention:     {dense_s * 1e3:8.1f} ms")
    print(f"butterfly attention: {sparse_s * 1e3:8.1f} ms  ({dense_s / sparse_s:.2f}x faster than dense)")
    print(f"max |butterfly - reference|: {(sparse_o - reference_o).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
