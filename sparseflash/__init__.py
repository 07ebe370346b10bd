"""sparseflash: block-sparse and masked FlashAttention-2 for research.

Public surface: ``attention``, ``BlockMask``, ``masks`` (patterns, ``make``, ``register``) and
``SparseAttention``.
"""

from sparseflash import masks
from sparseflash.attention import SparseAttention, attention
from sparseflash.masks import BlockMask, MaskKind

__all__ = ["attention", "BlockMask", "MaskKind", "masks", "SparseAttention"]
__version__ = "0.1.0"
