"""Image classification (LRA "Image"): CIFAR-10 as 1024-pixel grey-level sequences, and an
offline stand-in from scikit-learn's bundled 8x8 digits, upsampled to 32x32.

CIFAR-10's python batches (``cifar-10-batches-py/data_batch_{1..5}``, ``test_batch``: pickled
dicts with ``b"data"`` ``(N, 3072)`` uint8 — the red, green and blue planes — and ``b"labels"``)
are turned to grey with ITU-R 601 weights (as ``tf.image.rgb_to_grayscale`` in LRA) and read row
by row. Token id = grey level + 1 (0 is padding). 45,000 training images and 5,000 for validation
(seeded split of the training batches), as LRA; the test batch is the test set.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from sparseflash.data.common import SequenceDataset, TaskData, require, seeded_split

LAYOUT = """<task.data_dir>/
  cifar-10-batches-py/
    data_batch_1 ... data_batch_5    pickled dicts {b"data": uint8 (10000, 3072), b"labels": [...]}
    test_batch"""


def to_grey(rgb: np.ndarray) -> np.ndarray:
    """``(N, 3072)`` CIFAR rows (R, G, B planes) -> ``(N, 1024)`` uint8 grey levels."""
    planes = rgb.reshape(-1, 3, 1024).astype(np.float32)
    grey = 0.2989 * planes[:, 0] + 0.5870 * planes[:, 1] + 0.1140 * planes[:, 2]
    return np.clip(np.round(grey), 0, 255).astype(np.uint8)


def _load_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with open(path, "rb") as f:
        d = pickle.load(f, encoding="bytes")
    return to_grey(np.asarray(d[b"data"], dtype=np.uint8)), np.asarray(d[b"labels"], dtype=np.int64)


def _dataset(pixels: np.ndarray, labels: np.ndarray) -> SequenceDataset:
    return SequenceDataset([p.astype(np.int16) + 1 for p in pixels], labels)


def load_cifar10(data_dir, val_size: int = 5000, split_seed: int = 0):
    root = Path(data_dir) / "cifar-10-batches-py"
    files = [root / f"data_batch_{i}" for i in range(1, 6)] + [root / "test_batch"]
    require("CIFAR-10", files, LAYOUT,
            hint="Or use the offline stand-in: task=image_digits (scikit-learn's digits).")
    parts = [_load_batch(f) for f in files[:5]]
    x, y = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    train_idx, val_idx = seeded_split(len(y), [len(y) - val_size, val_size], split_seed)
    full = _dataset(x, y)
    return full.subset(train_idx), full.subset(val_idx), _dataset(*_load_batch(files[5]))


def load_digits_32(split_seed: int = 0):
    """scikit-learn's 1,797 8x8 digits (levels 0-16), each pixel repeated 4x4 -> 32x32, 0-255."""
    try:
        from sklearn.datasets import load_digits  # bundled with scikit-learn: no download
    except ImportError as err:
        raise ImportError("task=image_digits needs scikit-learn: pip install 'sparseflash[lra]'") from err

    digits = load_digits()
    img = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)
    img = img.repeat(4, axis=1).repeat(4, axis=2).reshape(len(img), 1024)
    full = _dataset(img, digits.target)
    tr, va, te = seeded_split(len(full), [0.8, 0.1, -1], split_seed)
    return full.subset(tr), full.subset(va), full.subset(te)


def build(cfg) -> TaskData:
    """``cfg``: the ``task`` config (source: cifar10 | digits, data_dir, val_size)."""
    source = str(cfg.get("source", "cifar10"))
    if source == "digits":
        train, val, test = load_digits_32(int(cfg.get("split_seed", 0)))
    elif source == "cifar10":
        train, val, test = load_cifar10(cfg.data_dir, int(cfg.get("val_size", 5000)), int(cfg.get("split_seed", 0)))
    else:
        raise ValueError(f"task.source must be 'cifar10' or 'digits'; got {source!r}")
    return TaskData(f"image-{source}", train, val, test, num_classes=10, vocab_size=257, max_len=1024,
                    info={"majority": test.majority()}, image_size=32)
