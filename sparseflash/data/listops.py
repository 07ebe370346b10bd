"""ListOps (LRA): a generator faithful to LRA's ``lra_benchmarks/data/listops.py`` and a loader
for its released ``listops-1000/basic_{train,val,test}.tsv``.

An expression is a tree of operators ``[MIN``, ``[MAX``, ``[MED`` (median, truncated to an int),
``[SM`` (sum mod 10) over digits 0-9, each with 2..``max_args`` arguments, closed by ``]``. A node
at depth < ``max_depth`` is an operator with probability 0.25, else a digit. Its *length* counts
operators, digits and ``]`` (not parentheses); LRA keeps trees with ``min_length < length <
max_length`` (500 and 2000) and no duplicates. The released files write each tree with LRA's
bracketing, ``( ( ( [MAX 2 ) 9 ) ] )`` for ``[MAX 2 9 ]``; the loader drops the parentheses, so
the model reads ``[MAX 2 9 ]``. Label = the value, 0-9.

Generation is split into fixed chunks, each with its own seed, run in worker processes and merged
in chunk order: the result depends on the seed only, not on the number of processes.
"""

from __future__ import annotations

import csv
import json
import os
import random
import sys
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from sparseflash.atomic_write import replacing
from sparseflash.data.common import SequenceDataset, TaskData, require

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
END = "]"
VALUE_P = 0.25  # probability that a node above max_depth is an operator (LRA's VALUE_P)
# Token ids: 0 padding, then ], the operators, the digits; 16 unknown.
VOCAB = {END: 1, "[MIN": 2, "[MAX": 3, "[MED": 4, "[SM": 5, **{str(d): 6 + d for d in range(10)}}
UNK = 16
VOCAB_SIZE = 17
SPLITS = ("train", "val", "test")
LAYOUT = """<task.data_dir>/
  basic_train.tsv   header "Source<TAB>Target", then one expression and its value (0-9) a line
  basic_val.tsv     e.g. "( ( ( [MAX 2 ) 9 ) ] )<TAB>9"
  basic_test.tsv    (LRA's release: lra_release/listops-1000/)"""

# The tokeniser: each operator becomes the byte of its id, then one bytes.translate maps every other
# byte to its id and deletes LRA's parentheses and the spaces; any other character becomes UNK.
_OPERATOR_BYTES = {op.encode(): bytes([VOCAB[op]]) for op in OPERATORS}
_IDS = bytearray([UNK]) * 256
for _tok in (END, *map(str, range(10))):
    _IDS[ord(_tok)] = VOCAB[_tok]
for _op in OPERATORS:
    _IDS[VOCAB[_op]] = VOCAB[_op]
_IDS = bytes(_IDS)
_DROPPED = b"() \t\r"


class _TooLong(Exception):
    pass


def _tree(rng: random.Random, depth: int, max_depth: int, max_args: int, budget: list[int]):
    """One random subtree as ``(text, value, length)``; LRA's ``generate_tree`` in string form.

    ``budget`` (remaining allowed length) stops trees that already exceed the maximum: they
    would be rejected anyway, so the accepted trees keep LRA's distribution."""
    r = rng.random() if depth < max_depth else 1.0
    if r > VALUE_P:
        value = rng.choice(range(10))
        budget[0] -= 1
        if budget[0] < 0:
            raise _TooLong
        return str(value), value, 1
    budget[0] -= 2
    num_values = rng.randint(2, max_args)
    subs = [_tree(rng, depth + 1, max_depth, max_args, budget) for _ in range(num_values)]
    op = rng.choice(OPERATORS)
    values = [v for _, v, _ in subs]
    # LRA nests (((op, v0), v1), ..., END): one "( " per argument plus one for END
    text = "( " * (num_values + 1) + op + " " + " ) ".join(t for t, _, _ in subs) + " ) ] )"
    if op == "[MIN":
        value = min(values)
    elif op == "[MAX":
        value = max(values)
    elif op == "[MED":
        value = int(np.median(values))
    else:
        value = sum(values) % 10
    return text, value, 2 + sum(n for _, _, n in subs)


def _chunk(args) -> list[tuple[str, int]]:
    seed, count, min_length, max_length, max_depth, max_args = args
    rng, out, seen = random.Random(seed), [], set()
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * max_depth + 100))
    while len(out) < count:
        try:
            text, value, length = _tree(rng, 1, max_depth, max_args, [max_length])
        except _TooLong:
            continue
        if min_length < length < max_length and text not in seen:
            seen.add(text)
            out.append((text, value))
    return out


def generate(num: int, *, min_length: int = 500, max_length: int = 2000, max_depth: int = 10,
             max_args: int = 10, seed: int = 0, workers: int | None = None,
             chunk: int = 2000) -> list[tuple[str, int]]:
    """``num`` distinct ``(expression, value)`` pairs in LRA's text format, seeded."""
    workers = workers or min(16, os.cpu_count() or 1)
    data: dict[str, int] = {}
    next_chunk = 0
    while len(data) < num:
        need = num - len(data)
        n_chunks = max(1, -(-need // chunk))
        jobs = [(seed * 1_000_003 + next_chunk + c, min(chunk, need), min_length, max_length, max_depth,
                 max_args) for c in range(n_chunks)]
        next_chunk += n_chunks
        if workers > 1 and n_chunks > 1:
            with ProcessPoolExecutor(min(workers, n_chunks)) as pool:
                results = list(pool.map(_chunk, jobs))
        else:
            results = [_chunk(j) for j in jobs]
        for part in results:
            for text, value in part:
                if len(data) < num:
                    data.setdefault(text, value)
    return list(data.items())


def write_tsv(rows, path: str | os.PathLike) -> None:
    """LRA's file format: header ``Source<TAB>Target``, one example a line. Atomic."""
    with replacing(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, delimiter="\t")
        writer.writerow(["Source", "Target"])
        writer.writerows(rows)


def _ids(expression: bytes) -> np.ndarray:
    for op, code in _OPERATOR_BYTES.items():
        expression = expression.replace(op, code)
    return np.frombuffer(expression.translate(_IDS, _DROPPED), dtype=np.int8)


def tokenize(text: str) -> np.ndarray:
    """``( ( [MAX 2 ) 9 ) ] )`` -> ids of ``[MAX 2 9 ]`` (parentheses dropped), int8."""
    return _ids(text.encode("ascii", "replace"))


def load_tsv(path: str | os.PathLike, max_len: int | None = None) -> SequenceDataset:
    """Read one LRA ListOps file (header ``Source<TAB>Target``, then ``expression<TAB>value`` a line;
    lines without a tab are skipped) into token sequences."""
    lines = Path(path).read_bytes().split(b"\n")
    header = lines[0].decode("utf-8", "replace").rstrip("\r").split("\t")
    if [h.strip() for h in header[:2]] != ["Source", "Target"]:
        raise ValueError(f"{path}: expected the header 'Source<TAB>Target'; got {header!r}")
    seqs, labels = [], []
    for number, line in enumerate(lines[1:], start=2):
        expression, tab, value = line.partition(b"\t")
        if not tab:
            continue
        if not value.strip().isdigit():
            raise ValueError(f"{path}, line {number}: expected the value (0-9) after the tab; got {value[:20]!r}")
        tokens = _ids(expression)
        seqs.append(tokens[:max_len] if max_len else tokens)
        labels.append(int(value))
    return SequenceDataset(seqs, labels)


def ensure_generated(data_dir: str | os.PathLike, prefix: str, params: dict, sizes: dict, seed: int) -> None:
    """Generate ``{prefix}_{train,val,test}.tsv`` into ``data_dir`` unless it already holds files
    made with the same parameters (recorded in ``generator.json``)."""
    data_dir = Path(data_dir)
    stamp = data_dir / "generator.json"
    want = {"params": params, "sizes": sizes, "seed": seed, "prefix": prefix}
    files = [data_dir / f"{prefix}_{s}.tsv" for s in SPLITS]
    if all(f.exists() for f in files):
        if not stamp.exists():
            return  # released (or hand-made) files: use them as they are
        if json.loads(stamp.read_text()) == want:
            return
        warnings.warn(f"{data_dir} holds ListOps made with other parameters; regenerating")
    total = sum(sizes.values())
    print(f"generating {total} ListOps examples into {data_dir} ...", flush=True)
    rows = generate(total, seed=seed, **params)
    # like LRA: train first, then val, then test
    start = 0
    for split in SPLITS:
        write_tsv(rows[start:start + sizes[split]], data_dir / f"{prefix}_{split}.tsv")
        start += sizes[split]
    with replacing(stamp) as tmp:
        tmp.write_text(json.dumps(want, indent=1))


def build(cfg) -> TaskData:
    """``cfg``: the ``task`` config (data_dir, prefix, max_len, generate, generator, sizes)."""
    data_dir = Path(cfg.data_dir)
    prefix = cfg.get("prefix", "basic")
    if cfg.get("generate", False):
        gen = dict(cfg.generator)
        sizes = {s: int(cfg.sizes[s]) for s in SPLITS}
        ensure_generated(data_dir, prefix, gen, sizes, int(cfg.get("data_seed", 0)))
    files = [data_dir / f"{prefix}_{s}.tsv" for s in SPLITS]
    require("ListOps", files, LAYOUT, hint="Or generate it with task.generate=true (LRA's generator).")
    max_len = int(cfg.max_len)
    train, val, test = (load_tsv(f, max_len) for f in files)
    longest = max(max((len(s) for s in d.seqs), default=1) for d in (train, val, test))
    return TaskData("listops", train, val, test, num_classes=10, vocab_size=VOCAB_SIZE,
                    max_len=min(max_len, longest), info={"majority": test.majority()})


def main(argv=None) -> None:
    """``python -m sparseflash.data.listops OUT_DIR``: write LRA's ListOps files (defaults: 96K/2K/2K
    expressions of length 500-2000) into OUT_DIR, with every CPU core."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("out_dir")
    ap.add_argument("--train", type=int, default=96000)
    ap.add_argument("--val", type=int, default=2000)
    ap.add_argument("--test", type=int, default=2000)
    ap.add_argument("--min-length", type=int, default=500)
    ap.add_argument("--max-length", type=int, default=2000)
    ap.add_argument("--max-depth", type=int, default=10)
    ap.add_argument("--max-args", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefix", default="basic")
    a = ap.parse_args(argv)
    params = {"min_length": a.min_length, "max_length": a.max_length, "max_depth": a.max_depth, "max_args": a.max_args}
    ensure_generated(a.out_dir, a.prefix, params, {"train": a.train, "val": a.val, "test": a.test}, a.seed)


if __name__ == "__main__":
    main()
