"""Training batches: the seeded stream, ``peek``, and the loader that prepares the next batch ahead."""

import numpy as np
import torch

from sparseflash.data import SequenceDataset, collate
from sparseflash.data.stream import BatchLoader, BatchStream, load_batch


def _dataset(n: int, lengths) -> SequenceDataset:
    rng = np.random.default_rng()
    seqs = [rng.integers(1, 257, int(lengths[i % len(lengths)])).astype(np.int16) for i in range(n)]
    return SequenceDataset(seqs, rng.integers(0, 2, n))


def test_equal_lengths_collate_as_the_rows_are():
    data = _dataset(6, [9])
    batch = collate([data[i] for i in range(6)])
    assert batch["x"].dtype == torch.long and batch["lengths"].tolist() == [9] * 6
    assert (batch["x"].numpy() == np.stack(data.seqs)).all()


def test_peek_is_what_next_returns_across_epochs_and_ranks():
    for rank in (0, 1):
        stream = BatchStream(10, batch_size=4, seed=3, rank=rank, world=2)
        for _ in range(7):  # 2 batches an epoch: crosses three epoch boundaries
            ahead = stream.peek().copy()
            assert (stream.peek() == ahead).all()
            assert (stream.next() == ahead).all()


def test_loader_returns_the_prefetched_batch_only_for_its_indices():
    data = _dataset(12, [5, 3, 7])
    loader = BatchLoader(data, torch.device("cpu"))
    stream = BatchStream(len(data), batch_size=4, seed=0)
    for _ in range(5):
        indices = stream.next()
        batch = loader.load(indices)
        expected = load_batch(data, indices, torch.device("cpu"))
        assert all(torch.equal(batch[k], expected[k]) for k in expected)
        loader.prefetch(stream.peek())
    ahead = loader._ahead[1]
    assert loader.load(stream.peek()) is ahead        # the batch made ahead
    loader.prefetch(stream.peek())
    other = np.array([0, 1, 2, 3])
    assert loader.load(other)["lengths"].tolist() == [len(data.seqs[i]) for i in other]  # not the prefetched one
