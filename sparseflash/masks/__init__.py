"""Block masks and the pattern library (imports nothing else of sparseflash)."""

from sparseflash.masks.block_mask import DEFAULT_BLOCK, BlockMask, BlockTables, MaskKind, layout_to_tables
from sparseflash.masks.patterns import (from_block_fn, from_layout, get, import_patterns, make, register,
                                        registered)
from sparseflash.masks.spec import MaskSpec

__all__ = [
    "DEFAULT_BLOCK", "BlockMask", "BlockTables", "MaskKind", "MaskSpec", "layout_to_tables",
    "from_block_fn", "from_layout", "get", "import_patterns", "make", "register", "registered",
]
