"""Training batches: which examples (``BatchStream``, seeded and resumable) and the tensors on the
device (``load_batch``, and ``BatchLoader``, which prepares the next batch while the device runs
the current step)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from sparseflash.data.common import SequenceDataset, collate


class BatchStream:
    """Resumable, seeded batches of a dataset: epoch ``e`` is the permutation drawn from
    ``(seed, e)``; a global batch is ``batch_size`` consecutive indices of it, and rank ``r`` of
    ``world`` takes every ``world``-th of them. ``state()``/``load()`` save the position."""

    def __init__(self, n: int, batch_size: int, seed: int, rank: int = 0, world: int = 1):
        if batch_size % world:
            raise ValueError(f"trainer.batch_size={batch_size} must be divisible by the {world} processes")
        if n < batch_size:
            raise ValueError(f"the training set has {n} examples, fewer than trainer.batch_size={batch_size}")
        self.n, self.batch_size, self.seed, self.rank, self.world = n, batch_size, seed, rank, world
        self.epoch, self.pos = 0, 0
        self._perm: np.ndarray | None = None

    def _permutation(self) -> np.ndarray:
        if self._perm is None:
            self._perm = np.random.default_rng([self.seed, self.epoch]).permutation(self.n)
        return self._perm

    def next(self) -> np.ndarray:
        """This rank's indices of the next global batch."""
        if self.pos + self.batch_size > self.n:  # drop the ragged tail, start the next epoch
            self.epoch, self.pos, self._perm = self.epoch + 1, 0, None
        batch = self._permutation()[self.pos:self.pos + self.batch_size]
        self.pos += self.batch_size
        return batch[self.rank::self.world]

    def peek(self) -> np.ndarray:
        """The indices ``next()`` will return, without taking them."""
        saved = self.epoch, self.pos, self._perm
        try:
            return self.next()
        finally:
            self.epoch, self.pos, self._perm = saved

    def state(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load(self, state: dict) -> None:
        self.epoch, self.pos, self._perm = int(state["epoch"]), int(state["pos"]), None


def load_batch(dataset: SequenceDataset, indices: Sequence[int], device: torch.device) -> dict[str, torch.Tensor]:
    """The examples ``indices`` of ``dataset``, collated (padded, with lengths) and on ``device``
    (copied from pinned memory without waiting, on CUDA)."""
    batch = collate([dataset[i] for i in indices])
    if device.type == "cuda":
        batch = {k: v.pin_memory() for k, v in batch.items()}
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


class BatchLoader:
    """Training batches of ``dataset`` on ``device``, one step ahead: ``prefetch(indices)``, called
    once the step's work is queued on the device, collates the next batch on the host and queues
    its copy, so that the host work overlaps the device's; ``load(indices)`` returns that batch
    when it holds the same indices, and loads them otherwise."""

    def __init__(self, dataset: SequenceDataset, device: torch.device):
        self.dataset, self.device = dataset, device
        self._ahead: tuple[np.ndarray, dict[str, torch.Tensor]] | None = None

    def load(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        ahead, self._ahead = self._ahead, None
        if ahead is not None and np.array_equal(ahead[0], indices):
            return ahead[1]
        return load_batch(self.dataset, indices, self.device)

    def prefetch(self, indices: Sequence[int]) -> None:
        indices = np.array(indices)
        self._ahead = indices, load_batch(self.dataset, indices, self.device)


def count_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens in a batch, padding excluded (both documents of a pair)."""
    return int(batch["lengths"].sum()) + int(batch["lengths2"].sum() if "lengths2" in batch else 0)
