"""Block masks and the pattern library (imports nothing else of sparseflash)."""

from sparseflash.masks.block_mask import BlockMask, BlockTables, MaskKind, layout_to_tables
from sparseflash.masks.patterns import (from_block_fn, from_layout, get, import_patterns, make, register,
                                        registered)

__all__ = [
    "BlockMask", "BlockTables", "MaskKind", "layout_to_tables",
    "from_block_fn", "from_layout", "get", "import_patterns", "make", "register", "registered",
]
