"""Small files in LRA's released formats, written into a temporary folder."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from sparseflash.data import listops


def write_listops(root: Path, n: int = 40, seed: int = 0) -> list:
    rows = listops.generate(3 * n, min_length=5, max_length=60, max_depth=3, max_args=4, seed=seed, workers=1)
    for i, split in enumerate(("train", "val", "test")):
        listops.write_tsv(rows[i * n:(i + 1) * n], root / f"basic_{split}.tsv")
    return rows


def write_pathfinder_release(root: Path, n: int = 24, bad: int = 1) -> Path:
    """``root/curv_contour_length_14/{imgs/0/sample_k.png, metadata/0.npy}``; ``bad`` corrupt PNGs."""
    from PIL import Image

    base = root / "curv_contour_length_14"
    (base / "imgs" / "0").mkdir(parents=True, exist_ok=True)
    (base / "metadata").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    lines = []
    for k in range(n):
        name = f"sample_{k}.png"
        if k < bad:
            (base / "imgs" / "0" / name).write_bytes(b"not a png")
        else:
            Image.fromarray(rng.integers(0, 255, (32, 32), dtype=np.uint8)).save(base / "imgs" / "0" / name)
        lines.append(f"imgs/0 {name} 0 {k % 2} 2 1.5 14 1 7.0 1.0 0.75")
    (base / "metadata" / "0.npy").write_text("\n".join(lines) + "\n")
    return base


def write_cifar(root: Path, per_batch: int = 12) -> Path:
    base = root / "cifar-10-batches-py"
    base.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        d = {b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
             b"labels": [int(x) for x in rng.integers(0, 10, per_batch)]}
        with open(base / name, "wb") as f:
            pickle.dump(d, f)
    return base


def write_imdb(root: Path, per_class: int = 8) -> Path:
    base = root / "aclImdb"
    for split in ("train", "test"):
        for label in ("pos", "neg"):
            folder = base / split / label
            folder.mkdir(parents=True, exist_ok=True)
            for k in range(per_class):
                word = "great fun " if label == "pos" else "dull, awful "
                (folder / f"{k}_{7 if label == 'pos' else 2}.txt").write_text(word * (5 + k) + "é<br />")
    return base


def write_aan(root: Path, n: int = 16) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for split in ("train", "eval", "test"):
        lines = [f"{float(k % 2)}\tP{k:02d}-1000\tW{k:02d}-2000\tpaper {k} text \"quoted\"\tcited text {k % 3}"
                 for k in range(n)]
        (root / f"new_aan_pairs.{split}.tsv").write_text("\n".join(lines) + "\n")
