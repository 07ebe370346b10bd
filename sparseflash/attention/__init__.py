"""Attention over block masks: the public ``attention`` function, its backends and the module."""

from sparseflash.attention.api import BACKENDS, attention, resolve_backend, resolve_mask
from sparseflash.attention.module import SparseAttention

__all__ = ["BACKENDS", "attention", "resolve_backend", "resolve_mask", "SparseAttention"]
