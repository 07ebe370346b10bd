"""Tune the Triton kernels on this GPU over a sweep of shapes and write the shipped config table.

Kernels launch with configs looked up in ``sparseflash/attention/triton/config_table.json`` unless
asked to tune (``sparseflash.attention.triton.tuning``): this script fills that table for the GPU
it runs on. It runs forward and backward once per shape inside ``tuning.tuned()`` (10-40 s per new
key; keys already in the disk cache are not tuned again, so an interrupted run resumes), records the
config every kernel launched with, and merges those entries into the table after each shape:
entries of other GPUs and keys stay, entries of the same key are replaced. One tuning pass can miss
a config a few per cent faster (7 % once on an H100 backward): ``--passes 3`` tunes every shape in
three independent passes (each with its own disk cache) and keeps, per key, the config most passes
chose.

The shapes are the benchmark's: bf16, 16k tokens (batch = tokens // S), hidden 2048, 128 x 128 mask
blocks (``--block 64``: the LRA configs' blocks, keys of their own); dense, causal, butterfly, a
2-block local window, random 25 %, a causal token window and causal written as mask_mods, and causal
with ALiBi and with tanh soft-capping (score_mods: the cheap and the costly kind), at every
``--seq-lens`` and ``--head-dims``; then decoding (the split-KV forward of forward_decode.py):
``DECODE_SHAPES`` query rows against long dense caches, GQA 4 query heads per K/V head, forward
only:
  python scripts/build_config_table.py
  python scripts/build_config_table.py --head-dims 64 --out /tmp/table.json
  python scripts/build_config_table.py --passes 3
  python scripts/build_config_table.py --decode-only --passes 3   # add or renew the decoding entries
  python scripts/build_config_table.py --block 64 --head-dims 64 --hidden 512 --tokens 65536 --no-decode \
      --seq-lens 1024 2048 4096 --patterns dense butterfly local random   # the LRA models' shapes
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

import torch

import sparseflash
from sparseflash import masks
from sparseflash.attention.score_mods import make_score_mod
from sparseflash.attention.triton import launch, tuning

PATTERNS = {  # label: (pattern name, make's keyword arguments, score_mod name)
    "dense": ("dense", {}, None),
    "causal": ("causal", {}, None),
    "butterfly": ("butterfly", {}, None),
    "local": ("local", {"window": 2}, None),
    "random": ("random", {"density": 0.25}, None),
    "sliding window": ("sliding_window", {"window": 1024, "causal": True}, None),
    "causal as mask_mod": ("prefix_lm", {"prefix": 0}, None),
    "causal + alibi": ("causal", {}, "alibi"),
    "causal + softcap": ("causal", {}, "softcap"),
}


# (q, kv, batch); with 4 query heads per K/V head, 1 and 4 queries make 16-row program groups, 8 and 16 queries
# 32 and 64 rows (tuning.ConfigKey.decode_rows)
DECODE_SHAPES = [(1, 8192, 16), (1, 32768, 8), (4, 32768, 8), (8, 32768, 8), (16, 32768, 8), (1, 131072, 2)]


def run_decode(q_len: int, kv_len: int, batch: int, head_dim: int, hidden: int) -> list[tuning.Launched]:
    """A decoding forward once on one shape; the launches it made."""
    heads = hidden // head_dim
    q = torch.randn(batch, heads, q_len, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, heads // 4, kv_len, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    with tuning.tuned(), tuning.recording() as launched, torch.no_grad():
        sparseflash.attention(q, k, v, backend="triton")
    return launched


def run_shape(seq_len: int, head_dim: int, label: str, tokens: int, hidden: int, block: int) -> list[tuning.Launched]:
    """Forward and backward once on one shape (``block``: the mask's block size); the launches they made."""
    name, params, score_mod_name = PATTERNS[label]
    batch, heads = max(1, tokens // seq_len), hidden // head_dim
    mask = masks.make(name, seq_len, block=block, device="cuda", **params)
    score_mod = make_score_mod(score_mod_name, heads) if score_mod_name else None
    if isinstance(score_mod, torch.nn.Module):  # ALiBi's slopes: a buffer
        score_mod = score_mod.to("cuda")
    q, k, v = (torch.randn(batch, heads, seq_len, head_dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    with tuning.tuned(), tuning.recording() as launched:
        o = sparseflash.attention(q, k, v, mask, score_mod=score_mod, backend="triton")
        torch.autograd.grad(o, (q, k, v), torch.randn_like(o))
    return launched


def run_pass(index: int, cache_root: str, run) -> list[tuning.Launched]:
    """One tuning pass of ``run()`` (one shape). Passes after the first tune with a disk cache of their
    own (``<cache_root>/pass<i>``) and forget the choices of the passes before, so that each pass
    decides afresh; an interrupted run still resumes from every pass's cache."""
    os.environ["SPARSEFLASH_CACHE_DIR"] = cache_root if index == 0 else os.path.join(cache_root, f"pass{index}")
    tuning.forget()
    return run()


def merge(path: Path, entries: list[dict], meta: dict) -> int:
    """Merge ``entries`` into the table at ``path`` (same kernel and key: replaced); its size after."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {"entries": []}
    fresh = {(e["kernel"], json.dumps(e["key"], sort_keys=True)) for e in entries}
    kept = [e for e in table["entries"] if (e["kernel"], json.dumps(e["key"], sort_keys=True)) not in fresh]
    table["entries"] = kept + entries
    table.setdefault("built_on", {})[meta["gpu"]] = meta
    lines = ",\n".join(json.dumps(e, sort_keys=True) for e in table["entries"])  # one entry per line
    path.write_text(f'{{"built_on": {json.dumps(table["built_on"], sort_keys=True)},\n"entries": [\n{lines}\n]}}\n')
    return len(table["entries"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=list(PATTERNS))
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--block", type=int, default=128, help="the masks' block size")
    parser.add_argument("--out", type=Path, default=tuning.TABLE_PATH)
    parser.add_argument("--passes", type=int, default=1, help="independent tuning passes per shape (majority vote)")
    decode = parser.add_mutually_exclusive_group()
    decode.add_argument("--no-decode", action="store_true", help="skip the decoding shapes")
    decode.add_argument("--decode-only", action="store_true", help="only the decoding shapes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: the table holds configs tuned on a GPU; this machine has no CUDA device")

    import triton

    meta = {"gpu": torch.cuda.get_device_name(), **tuning.architecture(torch.cuda.current_device()),
            "torch": torch.__version__, "triton": triton.__version__, "date": time.strftime("%Y-%m-%d")}
    cache_root = str(launch.cache_root())
    shapes = [(f"hd{head_dim} S={seq_len} {label}", functools.partial(run_shape, seq_len, head_dim, label,
                                                                       args.tokens, args.hidden, args.block))
              for head_dim in args.head_dims for seq_len in args.seq_lens for label in args.patterns
              if not args.decode_only]
    if not args.no_decode:
        shapes += [(f"hd{head_dim} decode {q_len}x{kv_len} B{batch}",
                    functools.partial(run_decode, q_len, kv_len, batch, head_dim, args.hidden))
                   for head_dim in args.head_dims for q_len, kv_len, batch in DECODE_SHAPES]
    for name, run in shapes:
        start = time.perf_counter()
        passes = [run_pass(i, cache_root, run) for i in range(args.passes)]
        size = merge(args.out, tuning.table_entries(*passes), meta)  # after each shape: nothing lost
        print(f"{name}: {time.perf_counter() - start:.1f} s ({' | '.join(tuning.summary(p) for p in passes)}); "
              f"{size} entries in {args.out}", flush=True)


if __name__ == "__main__":
    main()
