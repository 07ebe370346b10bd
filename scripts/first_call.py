"""How long a new mask, score function, shape or head dim takes on its first call, and on later ones.

A first call builds the launch plan, traces and generates the helpers of a mask or score function
(written to ``$SPARSEFLASH_CACHE_DIR/codegen``) and compiles the kernels it needs (Triton's cache,
``$TRITON_CACHE_DIR``, keeps those). With ``--mask window`` the sliding window and the ALiBi-like
score function take their constants from ``--variant``, so a variant never run before is a new
function. The script times on CUDA, after CUDA and torch's autograd have run once (torch's own
one-time costs, paid by the first backward of any model in a process):

  mask             building the mask;
  first fwd        the first forward (kernel compiles; tuning too with SPARSEFLASH_TUNE=1);
  first bwd        the first backward after it;
  second fwd+bwd   the call after it;
  calls 2-10       the nine calls after the first, in all (at head_dim 128 the first backward may run
                   two kernels that stand in for one still compiling: docs/kernels.md, "The first call");
  steady fwd+bwd   the median of 20 calls once the kernels compiling ahead are compiled
                   (``sparseflash.wait_for_compiles``).

Point both caches at empty directories to see a first call on a new machine, or run the script
twice with the same arguments to see the cost in a new process once the caches hold its kernels:
  TRITON_CACHE_DIR=$(mktemp -d) SPARSEFLASH_CACHE_DIR=$(mktemp -d) python scripts/first_call.py --mask butterfly
  python scripts/first_call.py --mask window --variant 17
  python scripts/first_call.py --mask window --variant 17
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


def _warm_torch() -> None:
    """Run CUDA and autograd once: the first backward of a process given output gradients imports
    torch's symbolic shapes (sympy: 2-3 s on an H100 host)."""
    x = torch.randn(8, 8, device="cuda", requires_grad=True)
    torch.autograd.grad(x @ x, x, torch.ones(8, 8, device="cuda"))
    torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mask", choices=["butterfly", "causal", "window"], default="window",
                        help="window: a token sliding window with an ALiBi-like score function (default)")
    parser.add_argument("--variant", type=int, default=int(time.time()) % 100_000,
                        help="sets the window's constants: a new value is a new function (default: the clock)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: this script times the compiled kernels and needs a CUDA device")
    _warm_torch()

    shape = (args.batch, args.heads, args.seq_len, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    start = time.perf_counter()
    if args.mask == "window":
        window = 512 + args.variant
        slope = 1.0 / (1000 + args.variant)

        def sliding(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

        def score_mod(score, b, h, q_idx, kv_idx):
            return score - slope * (h + 1) * (q_idx - kv_idx)

        mask = masks.from_mask_mod(sliding, args.seq_len, block=128, device="cuda")
    else:
        mask, score_mod = masks.make(args.mask, args.seq_len, block=128), None
    build = time.perf_counter() - start

    outputs = {}
    first_fwd = _synced(lambda: outputs.setdefault("o", sparseflash.attention(q, k, v, mask, score_mod=score_mod)))
    first_bwd = _synced(lambda: torch.autograd.grad(outputs["o"], (q, k, v), do))

    def step():
        torch.autograd.grad(sparseflash.attention(q, k, v, mask, score_mod=score_mod), (q, k, v), do)

    second = _synced(step)
    next_nine = second + _synced(lambda: [step() for _ in range(8)])
    sparseflash.wait_for_compiles()  # the kernels compiling ahead, which those calls may have run stand-ins for
    for _ in range(3):
        step()
    steady = statistics.median(_synced(step) for _ in range(20))
    print(f"{args.mask} (variant {args.variant}): S={args.seq_len} hd{args.head_dim} B={args.batch} "
          f"H={args.heads}, mask density {mask.density:.3f}")
    print(f"mask {build:.3f} s   first fwd {first_fwd:.3f} s   first bwd {first_bwd:.3f} s   "
          f"first fwd+bwd {first_fwd + first_bwd:.3f} s   second fwd+bwd {second * 1e3:.1f} ms   "
          f"calls 2-10 {next_nine * 1e3:.1f} ms   "
          f"steady fwd+bwd {steady * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
