"""How long a new mask or score function takes on its first call, and the same function in a new process.

A function's first call traces it, generates its ``@triton.jit`` helpers (written to
``$SPARSEFLASH_CACHE_DIR/codegen``) and compiles the kernels specialised on them (Triton's own cache
keeps those). This script builds a sliding window and an ALiBi-like score function whose constants
come from ``--variant``, so a variant never run before is a new function, and times on CUDA:

  trace+generate   building the mask and the launch plan (no kernel yet);
  first fwd+bwd    the first forward and backward (kernel compiles; tuning too with SPARSEFLASH_TUNE=1);
  steady fwd+bwd   the median of later calls.

Run it twice with the same ``--variant`` to see the cost in a new process once the caches hold it:
  python scripts/first_call.py --variant 17
  python scripts/first_call.py --variant 17
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import sparseflash
from sparseflash import masks


def _synced(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", type=int, default=int(time.time()) % 100_000,
                        help="sets the functions' constants: a new value is a new function (default: the clock)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: this script times the compiled kernels and needs a CUDA device")

    window = 512 + args.variant
    slope = 1.0 / (1000 + args.variant)

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    def distance_penalty(score, b, h, q_idx, kv_idx):
        return score - slope * (h + 1) * (q_idx - kv_idx)

    shape = (args.batch, args.heads, args.seq_len, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    start = time.perf_counter()
    mask = masks.from_mask_mod(sliding, args.seq_len, block=128, device="cuda")
    from sparseflash.attention.triton.plan import LaunchPlan
    from sparseflash.masks.functions import trace

    LaunchPlan.of(q, k, mask, False, args.head_dim ** -0.5, trace(distance_penalty, "score_mod"))
    prepare = time.perf_counter() - start

    def step():
        o = sparseflash.attention(q, k, v, mask, score_mod=distance_penalty)
        torch.autograd.grad(o, (q, k, v), do)

    first = _synced(step)
    steady = statistics.median(_synced(step) for _ in range(20))
    print(f"variant {args.variant}: S={args.seq_len} hd{args.head_dim} B={args.batch} H={args.heads} "
          f"(window {window}, mask density {mask.density:.3f})")
    print(f"trace+generate {prepare:.3f} s   first fwd+bwd {first:.3f} s   steady fwd+bwd {steady * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
