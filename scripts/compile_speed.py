"""Eager vs ``torch.compile(fullgraph=True)``: a stack of four Transformer blocks with ``SparseAttention``
(bf16, width 1024, 8 heads) on a GPU, one forward+backward step per measurement.

Prints per mask: the median step time eager and compiled (CUDA events, 30 steps after 3 warm-up steps),
their ratio, each first step's seconds (the compiled one includes Dynamo and Inductor; both include any
kernel compilation not yet cached), and the largest output difference.

    python scripts/compile_speed.py
"""

from __future__ import annotations

import statistics
import time

import torch

from sparseflash import SparseAttention

CASES = [  # name, mask, score_mod, sequence length, batch
    ("butterfly", {"pattern": "butterfly", "block": 128}, None, 4096, 4),
    ("causal", "causal", None, 4096, 4),
    ("sliding_window+alibi", {"pattern": "sliding_window", "block": 128, "params": {"window": 512}, "causal": True},
     "alibi", 4096, 4),
    ("butterfly", {"pattern": "butterfly", "block": 128}, None, 16384, 1),
    ("butterfly block 64", {"pattern": "butterfly", "block": 64}, None, 1024, 32),
]


class Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int, mask, score_mod=None):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.attn = SparseAttention(dim, heads, mask=mask, score_mod=score_mod)
        self.ff = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.ff(self.norm2(x))


def step(model, x) -> None:
    model(x).float().square().mean().backward()


def median_ms(fn, steps: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def first_step_s(model, x) -> float:
    start = time.perf_counter()
    step(model, x)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    torch.manual_seed(0)
    dim, heads = 1024, 8
    for name, mask, score_mod, seq_len, batch in CASES:
        model = torch.nn.Sequential(*[Block(dim, heads, mask, score_mod) for _ in range(4)]).cuda().bfloat16()
        x = torch.randn(batch, seq_len, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        first_eager = first_step_s(model, x)
        eager = median_ms(lambda: step(model, x))
        torch._dynamo.reset()
        compiled_model = torch.compile(model, fullgraph=True)
        first_compiled = first_step_s(compiled_model, x)
        compiled = median_ms(lambda: step(compiled_model, x))
        with torch.no_grad():
            diff = (compiled_model(x) - model(x)).abs().max().item()
        print(f"{name:22s} S={seq_len:6d} B={batch:3d} eager {eager:8.3f} ms  compiled {compiled:8.3f} ms  "
              f"compiled/eager {compiled / eager:5.3f}  first step eager {first_eager:6.2f} s compiled "
              f"{first_compiled:6.2f} s  max|diff| {diff:.3g}", flush=True)


if __name__ == "__main__":
    main()
