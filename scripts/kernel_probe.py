"""Kernel work on a GPU: the matmul and copy ceilings, then the Triton kernels against the peers.

    PYTHONPATH=. python scripts/kernel_probe.py [--dims 128 64] [--modes fwd fwdbwd]
    PYTHONPATH=. python scripts/kernel_probe.py --sweep --dims 128 --seqs 1024 --patterns dense random

Prints one row per (head_dim, S, pattern, mode): median ms (triton.testing.do_bench, the peers
taking turns in rounds) of sparseflash-triton, FlexAttention and SDPA, triton's TFLOP/s
(density-weighted) and the ratios; ``--no-gluon`` adds sparseflash with its Triton kernels where it takes
the Gluon ones (forward_gluon.py, backward_gluon.py), ``--flash`` Flex's FLASH backend (FlashAttention-4),
``--variant backward:FILE`` (or ``forward:FILE``) sparseflash with the Gluon kernels of FILE, a modified copy of
backward_gluon.py (forward_gluon.py), its outputs compared with the tree's before it is timed:

    cp sparseflash/attention/triton/backward_gluon.py /tmp/bwd_variant.py   # then edit the copy
    PYTHONPATH=. python scripts/kernel_probe.py --dims 128 64 --seqs 4096 16384 --modes fwdbwd --no-flex \
        --variant backward:/tmp/bwd_variant.py

``--sweep`` instead times every kernel (forward, and backward or dkdv and dq) of one fwd+bwd call over a wide grid of
tile configs (taking turns), next to the one the tuner chose, and prints a CUDA-kernel profile of the call for
sparseflash-triton and FlexAttention. A quick loop for kernel work (docs/kernels.md); the benchmark
harness (experiments/bench.py) is the record.
"""

import argparse
import contextlib
import copy as copy_module
import functools
import importlib
import importlib.util
import itertools
import os
import statistics
import sys

import torch
from triton.testing import do_bench

import sparseflash
from sparseflash.attention.baselines import Unsupported, flex_attention, sdpa_attention, to_flex_block_mask
from sparseflash.attention.triton import tuning
from sparseflash.bench.spec import attention_flops
from sparseflash.masks import make
from sparseflash.timing import interleaved_times

PATTERNS = {"dense": {}, "causal": {}, "butterfly": {}, "local": {"window": 2}, "random": {"density": 0.25}}


def ceilings() -> None:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ a, return_mode="median")
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    copy_ms = do_bench(lambda: y.copy_(x), return_mode="median")
    print(f"ceilings: bf16 matmul {2 * 8192**3 / ms / 1e9:.0f} TFLOP/s, copy {2 * 2**30 / copy_ms / 1e9:.2f} TB/s")


def peer_medians(fns: dict, q, k, v, mode: str, contexts: dict | None = None) -> dict[str, float]:
    """Median ms of each peer's call (a function of q, k, v; None: not run) in ``mode``, the peers
    taking turns (``sparseflash.timing``); NaN for a peer that cannot run the case. ``contexts``: a context
    manager factory by peer, entered around each of its steps (forward and backward)."""
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    do = torch.randn_like(q)

    def step_of(name):
        fn, context = fns[name], (contexts or {}).get(name, contextlib.nullcontext)

        def step():
            with context():
                if mode == "fwd":
                    fn(q, k, v)
                else:
                    fn(*leaves).backward(do)

        return step

    names = [name for name, fn in fns.items() if fn is not None]
    with torch.no_grad() if mode == "fwd" else contextlib.nullcontext():
        for name in names:  # first calls, then their kernels compiled ahead: what stands in for them is not timed
            try:
                step_of(name)()
            except Unsupported:
                pass
        sparseflash.wait_for_compiles()
        times = interleaved_times([step_of(name) for name in names], 3, 70, 20,
                                  grad_to_none=leaves if mode != "fwd" else None, catch=(Unsupported,))
    ms = {name: float("nan") for name in fns}
    ms.update({name: statistics.median(t) for name, t in zip(names, times) if isinstance(t, list)})
    return ms


BACKWARD_SWEEP = ((64, 128), (32, 64), (4, 8), (2, 3))
SWEEP_GRID = {  # (block_m held, block_n streamed, warps, stages) ranges per kernel
    "forward": ((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)),
    "backward": BACKWARD_SWEEP,
    "dkdv": BACKWARD_SWEEP,
    "dq": BACKWARD_SWEEP,
}


def kernel_times(step, calls: int = 5) -> list[tuple[float, float, str]]:
    """``(us, launches, name)`` per CUDA kernel of one call of ``step``, averaged over ``calls``
    calls after one warm-up call (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    return [(event.device_time_total / calls, event.count / calls, event.key)
            for event in prof.key_averages() if event.device_time_total > 0]


def profile_kernels(step, label: str) -> None:
    """CUDA time per kernel of one call of ``step``, and their total."""
    kernels = [row for row in kernel_times(step) if row[0] > 0.5]
    for us, launches, name in kernels:
        print(f"  {label:7} {us:9.1f} us  x{launches:g}  {name[:90]}")
    print(f"  {label:7} {sum(us for us, _, _ in kernels):9.1f} us  total")


def sweep(q, k, v, mask, flex_mask, kernels, only=None) -> None:
    """Time every SWEEP_GRID config (or the ``only`` list of (block_m, block_n, warps, stages)) of
    each of ``kernels`` that one fwd+bwd call launches; profile FlexAttention's call too unless
    ``flex_mask`` is None."""
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    do = torch.randn_like(q)
    with tuning.recording() as launched:
        sparseflash.attention(*leaves, mask, backend="triton").backward(do)
    for entry in launched:
        kernel, key, chosen = entry.kernel, entry.key, entry.config
        if kernel not in kernels:
            continue
        options = list(dict.fromkeys(tuning.fit(kernel, tuning.KernelConfig(*row), key)
                                     for row in only or itertools.product(*SWEEP_GRID[kernel])))
        times = interleaved_times([functools.partial(entry.relaunch, cfg) for cfg in options], 2, 50, 10,
                                  catch=(Exception,))  # out of shared memory or registers
        timings = {}
        for cfg, t in zip(options, times):
            if isinstance(t, BaseException):
                print(f"  {kernel} {cfg}: {type(t).__name__}")
            timings[cfg] = float("nan") if isinstance(t, BaseException) else statistics.median(t)
        ranked = sorted((t, c) for c, t in timings.items() if t == t)
        print(f"  {kernel}: tuned {chosen} {timings.get(chosen, float('nan')):.4f} ms; best "
              + ", ".join(f"({c.block_m},{c.block_n},{c.num_warps},{c.num_stages}) {t:.4f}" for t, c in ranked[:6]))

    def triton_step():
        sparseflash.attention(*leaves, mask, backend="triton").backward(do)

    def flex_step():
        flex_attention(*leaves, mask, block_mask=flex_mask, dynamic=False).backward(do)

    profile_kernels(triton_step, "triton")
    if flex_mask is not None:
        profile_kernels(flex_step, "flex")


def with_own_plans(mask):
    """A copy of ``mask`` that keeps launch plans (and the replays of their calls) of its own."""
    copy = copy_module.copy(mask)
    copy.derived = {}  # where plans are kept
    return copy


def with_triton_kernels(mask, q, k, v):
    """A copy of ``mask`` whose calls on inputs like q, k, v take the Triton kernels, not the Gluon ones:
    its launch plans are made here under SPARSEFLASH_GLUON=0 (a plan keeps its choice)."""
    copy = with_own_plans(mask)
    before = os.environ.get("SPARSEFLASH_GLUON")
    os.environ["SPARSEFLASH_GLUON"] = "0"
    try:
        with torch.no_grad():
            sparseflash.attention(q, k, v, copy, backend="triton")
    finally:
        if before is None:
            del os.environ["SPARSEFLASH_GLUON"]
        else:
            os.environ["SPARSEFLASH_GLUON"] = before
    return copy


def load_variant(spec: str):
    """``(direction, module)`` of ``--variant DIRECTION:FILE``: FILE imported as a module of its own, a modified copy of
    ``{DIRECTION}_gluon.py`` (its kernels are new functions to Triton, compiled apart from the tree's)."""
    direction, _, path = spec.partition(":")
    if direction not in ("forward", "backward") or not os.path.isfile(path):
        raise SystemExit(f"--variant: expected forward:FILE or backward:FILE with FILE a copy of {{forward,backward}}"
                         f"_gluon.py, got {spec!r}")
    module_spec = importlib.util.spec_from_file_location(f"sparseflash_variant_{direction}_gluon", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return direction, module


@contextlib.contextmanager
def gluon_module(direction: str, module):
    """Inside: the launches take ``module``'s Gluon kernels for ``direction``, which they find by its module name
    (``plan.gluon_kernels``)."""
    name = f"sparseflash.attention.triton.{direction}_gluon"
    tree = importlib.import_module(name)
    sys.modules[name] = module
    try:
        yield
    finally:
        sys.modules[name] = tree


def compare_outputs(tree_fn, variant_fn, context, q, k, v) -> str:
    """The largest difference of the variant's o, dq, dk and dv from the tree's, relative to the tree's largest
    entry, as "o 1e-07 dq ..."; NaN in either is reported as nan."""
    do = torch.randn_like(q)
    outputs = []
    for fn, around in ((tree_fn, contextlib.nullcontext), (variant_fn, context)):
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
        with around():
            o = fn(*leaves)
            o.backward(do)
        outputs.append([o.detach().float()] + [x.grad.float() for x in leaves])
    return " ".join(f"{name} {((b - a).abs().max() / a.abs().max()).item():.1e}"
                    for name, a, b in zip(("o", "dq", "dk", "dv"), *outputs))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", type=int, nargs="+", default=[128])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"])
    parser.add_argument("--patterns", nargs="+", default=list(PATTERNS))
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument("--flash", action="store_true", help="also Flex's FLASH backend (FlashAttention-4)")
    parser.add_argument("--no-gluon", action="store_true", help="also sparseflash without its Gluon kernels")
    parser.add_argument("--variant", metavar="DIRECTION:FILE",
                        help="also sparseflash with the Gluon kernels of FILE, a modified copy of forward_gluon.py "
                             "(forward:FILE) or backward_gluon.py (backward:FILE)")
    parser.add_argument("--sweep", action="store_true", help="time tile configs per kernel, profile one call")
    parser.add_argument("--kernels", nargs="+", default=list(SWEEP_GRID), help="the kernels --sweep times")
    parser.add_argument("--configs", nargs="+", help="--sweep only these, as BLOCK_M,BLOCK_N,WARPS,STAGES")
    args = parser.parse_args()
    variant = load_variant(args.variant) if args.variant else None
    print(torch.cuda.get_device_name(), torch.__version__)
    if not args.sweep:
        ceilings()
    print("| D | S | pattern | mode | density | triton ms | TFLOP/s | flex ms | sdpa ms | flex/triton | sdpa/triton |"
          " flash/triton | no-gluon/triton | variant/triton |")
    for dim in args.dims:
        heads = 2048 // dim
        for seq in args.seqs:
            batch = 16384 // seq
            q, k, v = (torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            for name in args.patterns:
                mask = make(name, seq, block=128, **PATTERNS[name])
                flex_mask = None if args.no_flex else to_flex_block_mask(mask, "cuda")
                if args.sweep:
                    print(f"sweep D={dim} S={seq} {name} density={mask.density:.3f}", flush=True)
                    only = [tuple(map(int, c.split(","))) for c in args.configs] if args.configs else None
                    sweep(q, k, v, mask, flex_mask, args.kernels, only)
                    continue
                peers = {
                    "triton": lambda q, k, v: sparseflash.attention(q, k, v, mask, backend="triton"),
                    "flex": None if args.no_flex else (
                        lambda q, k, v: flex_attention(q, k, v, mask, block_mask=flex_mask, dynamic=False)),
                    "sdpa": lambda q, k, v: sdpa_attention(q, k, v, mask),
                    "flash": None if not args.flash else (
                        lambda q, k, v: flex_attention(q, k, v, mask, block_mask=flex_mask, dynamic=False,
                                                       backend="FLASH")),
                    "no-gluon": None,
                    "variant": None,
                }
                if args.no_gluon:
                    triton_mask = with_triton_kernels(mask, q, k, v)
                    peers["no-gluon"] = lambda q, k, v: sparseflash.attention(q, k, v, triton_mask, backend="triton")
                contexts = {}
                if variant is not None:
                    variant_mask = with_own_plans(mask)
                    peers["variant"] = lambda q, k, v: sparseflash.attention(q, k, v, variant_mask, backend="triton")
                    contexts["variant"] = functools.partial(gluon_module, *variant)
                    print(f"variant D={dim} S={seq} {name}: largest difference from the tree's, relative: "
                          f"{compare_outputs(peers['triton'], peers['variant'], contexts['variant'], q, k, v)}",
                          flush=True)
                for mode in args.modes:
                    ms = peer_medians(peers, q, k, v, mode, contexts)
                    flops = attention_flops(batch, heads, seq, seq, dim, mask.density, mode)
                    print(f"| {dim} | {seq} | {name} | {mode} | {mask.density:.3f} | {ms['triton']:.3f} | "
                          f"{flops / ms['triton'] / 1e9:.0f} | {ms['flex']:.3f} | {ms['sdpa']:.3f} | "
                          f"{ms['flex'] / ms['triton']:.2f} | {ms['sdpa'] / ms['triton']:.2f} | "
                          f"{ms['flash'] / ms['triton']:.2f} | {ms['no-gluon'] / ms['triton']:.2f} | "
                          f"{ms['variant'] / ms['triton']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
