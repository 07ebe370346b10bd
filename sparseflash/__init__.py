"""sparseflash: block-sparse and masked FlashAttention-2 for research.

Public surface: ``attention``, ``BlockMask``, ``masks`` (patterns, ``make``, ``register``),
``SparseAttention``, ``tuned`` (tune the Triton kernels' configs for the shapes met inside a block) and
``wait_for_compiles`` (for the kernels that first calls compile ahead, before timing or capturing calls).
"""

import contextlib
from typing import Iterator

from sparseflash import masks
from sparseflash.attention import SparseAttention, attention, warm_up
from sparseflash.masks import BlockMask, MaskKind

__all__ = ["attention", "BlockMask", "MaskKind", "masks", "SparseAttention", "tuned", "wait_for_compiles"]
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


def wait_for_compiles(timeout: float = 300.0) -> bool:
    """Wait, ``timeout`` seconds at most, for the kernels that first calls started compiling ahead (in forked
    children; docs/kernels.md, "The first call"), so that the calls after it run them and not the kernels that
    stand in while they compile (the Triton forward for the Gluon forward, a backward's halves): call it after a
    first step and before timing steps or capturing them in a CUDA graph. Whether every compile ended (True where
    none was started: kernels compiled before, the interpreter, no Triton)."""
    try:
        from sparseflash.attention.triton import forked
    except ImportError:  # no Triton: nothing compiles
        return True
    return forked.wait_all(timeout)
