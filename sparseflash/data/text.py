"""Text classification (LRA "Text"): IMDb reviews from the ``aclImdb/`` folders as byte
sequences, truncated to ``max_len`` (4096 by default, as the LRA paper's byte-level task).

Token id = byte + 1 (0 is padding); label 1 = positive. Validation is a seeded ``val_fraction``
of the training reviews; the test folder is the test set.
"""

from __future__ import annotations

from pathlib import Path

from sparseflash.data.common import SequenceDataset, TaskData, bytes_to_tokens, require, seeded_split

LAYOUT = """<task.data_dir>/
  aclImdb/
    train/pos/*.txt  train/neg/*.txt     one review a file (UTF-8)
    test/pos/*.txt   test/neg/*.txt"""


def load_split(root: Path, max_len: int) -> SequenceDataset:
    seqs, labels = [], []
    for label, name in ((0, "neg"), (1, "pos")):
        for path in sorted((root / name).glob("*.txt")):
            seqs.append(bytes_to_tokens(path.read_bytes(), max_len))
            labels.append(label)
    return SequenceDataset(seqs, labels)


def build(cfg) -> TaskData:
    """``cfg``: the ``task`` config (data_dir, max_len, val_fraction, split_seed)."""
    root = Path(cfg.data_dir) / "aclImdb"
    require("IMDb", [root / s / c for s in ("train", "test") for c in ("pos", "neg")], LAYOUT)
    max_len = int(cfg.get("max_len", 4096))
    full, test = load_split(root / "train", max_len), load_split(root / "test", max_len)
    if not len(full) or not len(test):
        raise ValueError(f"no reviews (*.txt) found under {root}")
    tr, va = seeded_split(len(full), [1.0 - float(cfg.get("val_fraction", 0.1)), -1], int(cfg.get("split_seed", 0)))
    longest = max(len(s) for s in full.seqs + test.seqs)
    return TaskData("text", full.subset(tr), full.subset(va), test, num_classes=2, vocab_size=257,
                    max_len=min(max_len, longest), info={"majority": test.majority()})
