"""sparseflash: block-sparse and masked FlashAttention-2 for research.

Public surface: ``attention``, ``BlockMask``, ``masks`` (patterns, ``make``, ``register``),
``SparseAttention`` and ``tuned`` (tune the Triton kernels' configs for the shapes met inside a block).
"""

import contextlib
from typing import Iterator

from sparseflash import masks
from sparseflash.attention import SparseAttention, attention, warm_up
from sparseflash.masks import BlockMask, MaskKind

__all__ = ["attention", "BlockMask", "MaskKind", "masks", "SparseAttention", "tuned"]
__version__ = "0.1.0"

warm_up.start()  # with a CUDA build of torch: Triton's compiler hash, on a thread (attention/warm_up.py)


@contextlib.contextmanager
def tuned() -> Iterator[None]:
    """``with sparseflash.tuned(): step()``: the Triton kernels launched inside the block time their
    candidate configs for every new shape, mask kind or function (10-40 s each on an H100) and keep
    the fastest, on disk too, instead of taking the shipped table's. ``SPARSEFLASH_TUNE=1`` does the
    same for a whole process."""
    from sparseflash.attention.triton.tuning import tuned as tuning_block  # imports triton only when used

    with tuning_block():
        yield
