"""``SparseAttention``: multi-head self-attention over a block mask, as an ``nn.Module``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Union

import torch
from einops import rearrange
from torch import nn

from sparseflash.attention.api import attention
from sparseflash.masks import BlockMask, make

# None (dense) | "causal" | a pattern name | {"pattern": name, "block": 128, "causal": False,
# "per_head": False, "params": {...}} | a BlockMask built for one sequence length.
AttentionMaskSpec = Union[None, str, Mapping[str, Any], BlockMask]


class SparseAttention(nn.Module):
    """Self-attention ``x (B, S, dim) -> (B, S, dim)`` with a block-sparse mask.

    Args:
        dim: model width; heads: query heads (``dim % heads == 0``); kv_heads: key/value heads
            for GQA (default ``heads``).
        mask: a mask spec (see ``AttentionMaskSpec``). A pattern spec is built with
            ``sparseflash.masks.make`` for each sequence length met, and cached.
        backend: an ``attention`` backend name.
        dropout: dropout on the output projection.
    """

    def __init__(self, dim: int, heads: int, mask: AttentionMaskSpec = None, backend: str = "auto",
                 kv_heads: int | None = None, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        kv_heads = kv_heads or heads
        if dim % heads or heads % kv_heads:
            raise ValueError(f"need dim % heads == 0 and heads % kv_heads == 0; got dim={dim}, "
                             f"heads={heads}, kv_heads={kv_heads}")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.backend = backend
        self.mask_spec = mask
        self._masks: dict[int, BlockMask | str | None] = {}
        self.to_q = nn.Linear(dim, dim, bias=bias)
        self.to_kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=bias)
        self.to_out = nn.Linear(dim, dim, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def mask_for(self, seq_len: int) -> BlockMask | str | None:
        """The mask used at ``seq_len`` (built once per length from a pattern spec)."""
        spec = self.mask_spec
        if spec is None or isinstance(spec, BlockMask) or spec in ("dense", "causal"):
            return spec
        if seq_len not in self._masks:
            spec = {"pattern": spec} if isinstance(spec, str) else dict(spec)
            unknown = set(spec) - {"pattern", "block", "causal", "per_head", "params"}
            if "pattern" not in spec or unknown:
                raise ValueError(f"a mask spec needs 'pattern' and may set block, causal, per_head, "
                                 f"params; got keys {sorted(spec)}")
            self._masks[seq_len] = make(
                spec["pattern"], seq_len, block=spec.get("block", 128),
                heads=self.heads if spec.get("per_head", False) else None,
                causal=bool(spec.get("causal", False)), **dict(spec.get("params") or {}),
            )
        return self._masks[seq_len]

    def forward(self, x: torch.Tensor, key_lengths: torch.Tensor | None = None) -> torch.Tensor:
        q = rearrange(self.to_q(x), "b s (h d) -> b h s d", h=self.heads)
        k, v = rearrange(self.to_kv(x), "b s (two h d) -> two b h s d", two=2, h=self.kv_heads)
        o = attention(q, k, v, self.mask_for(x.shape[1]), key_lengths=key_lengths, backend=self.backend)
        return self.dropout(self.to_out(rearrange(o, "b h s d -> b s (h d)")))
