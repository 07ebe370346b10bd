"""Shared pieces of the LRA tasks: the missing-data error, in-memory datasets, padding with
lengths, seeded splits and the ``TaskData`` bundle every task module returns."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

PAD = 0  # token id 0 is padding in every task


class MissingDataError(FileNotFoundError):
    """A dataset is not where the config says; the message names the path, the layout and the key."""

    def __init__(self, task: str, path: str | os.PathLike, layout: str, hint: str = ""):
        self.path = Path(path)
        msg = (f"{task} data not found: expected {self.path.resolve()}\n"
               f"Expected layout:\n{layout.rstrip()}\n"
               f"Point the config key task.data_dir at the folder that holds it, e.g. "
               f"`python experiments/train.py ... task.data_dir=/path/to/data`.")
        if hint:
            msg += f"\n{hint}"
        super().__init__(msg)


def require(task: str, paths: Sequence[str | os.PathLike], layout: str, hint: str = "") -> None:
    """Raise ``MissingDataError`` naming the first of ``paths`` that does not exist."""
    for path in paths:
        if not Path(path).exists():
            raise MissingDataError(task, path, layout, hint)


class SequenceDataset(torch.utils.data.Dataset):
    """Token sequences (1-D integer arrays, 0 = padding) and integer labels, in memory.

    ``pair=True`` holds two sequences per example (retrieval): ``seqs`` is then a list of
    ``(a, b)`` tuples."""

    def __init__(self, seqs: list, labels: Sequence[int] | np.ndarray, pair: bool = False):
        if len(seqs) != len(labels):
            raise ValueError(f"{len(seqs)} sequences but {len(labels)} labels")
        self.seqs, self.labels, self.pair = list(seqs), np.asarray(labels, dtype=np.int64), pair

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int):
        return self.seqs[i], int(self.labels[i])

    def subset(self, idx: Sequence[int] | np.ndarray) -> "SequenceDataset":
        return SequenceDataset([self.seqs[i] for i in idx], self.labels[np.asarray(idx, dtype=np.int64)], self.pair)

    def majority(self) -> float:
        """Fraction of the most frequent label (the accuracy of always guessing it)."""
        return float(np.bincount(self.labels).max() / max(1, len(self.labels))) if len(self.labels) else 0.0


def pad_batch(seqs: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1-D token arrays with ``PAD``: ``(tokens [B, S_max], lengths [B])``."""
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    width = int(lengths.max()) if len(seqs) else 0
    if len(seqs) and (lengths == width).all():  # equal lengths (images): one copy, no per-row work
        out = np.stack(seqs).astype(np.int64, copy=False)
    else:
        out = np.full((len(seqs), width), PAD, dtype=np.int64)
        for row, s in enumerate(seqs):
            out[row, : len(s)] = s
    return torch.from_numpy(out), torch.from_numpy(lengths)


def collate(examples: Sequence[tuple]) -> dict[str, torch.Tensor]:
    """A list of ``(seq, label)`` or ``((a, b), label)`` -> a padded batch with lengths.

    Single: ``{"x", "lengths", "y"}``; pairs: ``{"x", "lengths", "x2", "lengths2", "y"}``."""
    y = torch.tensor([label for _, label in examples], dtype=torch.long)
    first = examples[0][0]
    if isinstance(first, tuple):
        x, lengths = pad_batch([a for (a, _), _ in examples])
        x2, lengths2 = pad_batch([b for (_, b), _ in examples])
        return {"x": x, "lengths": lengths, "x2": x2, "lengths2": lengths2, "y": y}
    x, lengths = pad_batch([s for s, _ in examples])
    return {"x": x, "lengths": lengths, "y": y}


def seeded_split(n: int, sizes: Sequence[int | float], seed: int) -> list[np.ndarray]:
    """Shuffle ``range(n)`` with ``seed`` and cut it into parts of the given sizes (counts, or
    fractions of ``n``; the last part may be ``-1`` for "the rest")."""
    perm = np.random.default_rng(seed).permutation(n)
    counts = [int(round(s * n)) if isinstance(s, float) else int(s) for s in sizes]
    if counts and counts[-1] < 0:
        counts[-1] = n - sum(counts[:-1])
    if sum(counts) > n:
        raise ValueError(f"split sizes {counts} exceed the {n} examples")
    cuts = np.cumsum([0] + counts)
    return [perm[a:b] for a, b in zip(cuts[:-1], cuts[1:])]


def bytes_to_tokens(data: bytes, max_len: int) -> np.ndarray:
    """UTF-8 bytes -> token ids ``byte + 1`` (0 stays padding), truncated to ``max_len``."""
    return np.frombuffer(data[:max_len], dtype=np.uint8).astype(np.int16) + 1


@dataclass
class TaskData:
    """What a task module hands to the model and the loop."""

    name: str
    train: SequenceDataset
    val: SequenceDataset
    test: SequenceDataset
    num_classes: int
    vocab_size: int  # token ids are in [0, vocab_size); 0 is padding
    max_len: int  # longest sequence (per side for pairs)
    pair: bool = False
    info: dict = field(default_factory=dict)
    image_size: int | None = None  # side of the square images read row by row (Pathfinder, Image)
