"""Block masks, the pattern library and element patterns (imports nothing else of sparseflash)."""

from sparseflash.masks.block_mask import DEFAULT_BLOCK, BlockMask, BlockTables, MaskKind, layout_to_tables
from sparseflash.masks.patterns import (from_block_fn, from_layout, from_mask_mod, get, import_patterns, make,
                                        register, register_mask_mod, registered)
from sparseflash.masks import mask_mods  # noqa: F401  (registers the built-in element patterns)
from sparseflash.masks.spec import MaskSpec

__all__ = [
    "DEFAULT_BLOCK", "BlockMask", "BlockTables", "MaskKind", "MaskSpec", "layout_to_tables",
    "from_block_fn", "from_layout", "from_mask_mod", "get", "import_patterns", "make", "register",
    "register_mask_mod", "registered", "mask_mods",
]
