"""``SparseAttention``: multi-head self-attention over a block mask, as an ``nn.Module``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Union

import torch
from einops import rearrange
from torch import nn

from sparseflash.attention.api import attention, built_mask, resolve_backend
from sparseflash.attention.dropout import check_p
from sparseflash.attention.score_mods import make_score_mod
from sparseflash.masks import BlockMask, MaskSpec

# None (dense) | "causal" | a pattern name | a MaskSpec or its fields as a mapping ({"pattern": name,
# "block": 128, "causal": False, "per_head": False, "params": {...}}) | a BlockMask built for one length.
AttentionMask = Union[None, str, Mapping[str, Any], MaskSpec, BlockMask]
# None | a registered score function's name | {"name": ..., "params": {...}} | a score_mod callable
# (an nn.Module one is held as a submodule, so that its parameters train).
ScoreModArg = Union[None, str, Mapping[str, Any], Callable]


class SparseAttention(nn.Module):
    """Self-attention ``x (B, S, dim) -> (B, S, dim)`` with a block-sparse mask.

    Args:
        dim: model width; heads: query heads (``dim % heads == 0``); kv_heads: key/value heads
            for GQA (default ``heads``).
        mask: see ``AttentionMask``. A name, mapping or ``MaskSpec`` is checked here and built for
            each sequence length met (and cached); a ``BlockMask`` serves its own length only.
        backend: an ``attention`` backend name.
        dropout: dropout on the output projection.
        attn_dropout: dropout on the attention probabilities (``attention(dropout_p=...)``, in the
            kernels), in training mode only.
        score_mod: see ``ScoreModArg``; a name is made for ``heads`` heads (``make_score_mod``).
    """

    def __init__(self, dim: int, heads: int, mask: AttentionMask = None, backend: str = "auto",
                 kv_heads: int | None = None, dropout: float = 0.0, bias: bool = True,
                 score_mod: ScoreModArg = None, attn_dropout: float = 0.0):
        super().__init__()
        for name, value in (("dim", dim), ("heads", heads), ("kv_heads", heads if kv_heads is None else kv_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SparseAttention's {name} must be an int >= 1; got {value!r}")
        kv_heads = heads if kv_heads is None else kv_heads
        resolve_backend(backend, torch.device("cpu"))  # an unknown name fails here, not at the first forward
        if dim % heads or heads % kv_heads:
            raise ValueError(f"need dim % heads == 0 and heads % kv_heads == 0; got dim={dim}, "
                             f"heads={heads}, kv_heads={kv_heads}")
        self.dim, self.heads, self.kv_heads, self.head_dim = dim, heads, kv_heads, dim // heads
        self.attn_dropout = check_p(attn_dropout, "attn_dropout")
        self.backend = backend
        self.mask = mask if mask is None or isinstance(mask, BlockMask) else MaskSpec.from_config(mask)
        self.score_mod = _score_mod(score_mod, heads)
        self.to_q = nn.Linear(dim, dim, bias=bias)
        self.to_kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=bias)
        self.to_out = nn.Linear(dim, dim, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def mask_for(self, seq_len: int, device: torch.device | str = "cpu") -> BlockMask | None:
        """The mask used at ``seq_len`` (built on ``device`` once per length and device from a spec;
        None: dense)."""
        if not isinstance(self.mask, MaskSpec):
            return self.mask
        return built_mask(self.mask, seq_len, seq_len, self.heads, device)

    def forward(self, x: torch.Tensor, key_lengths: torch.Tensor | None = None,
                key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x (B, S, dim)``; ``key_lengths (B,)``: keys from there on are padding; ``key_mask (B, S)``
        bool: the keys any query may attend to (False ones are left out wherever they are)."""
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.dim:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"SparseAttention(dim={self.dim}) takes x of shape (B, S, {self.dim}); got {got}")
        if key_mask is not None and not isinstance(key_mask, torch.Tensor):
            raise ValueError(f"key_mask must be a bool tensor of shape {tuple(x.shape[:2])} (B, S); "
                             f"got {type(key_mask).__name__}")
        if key_mask is not None and (key_mask.dtype != torch.bool or tuple(key_mask.shape) != tuple(x.shape[:2])
                                     or key_mask.device != x.device):
            raise ValueError(f"key_mask must be a bool tensor of shape {tuple(x.shape[:2])} (B, S) on {x.device}; "
                             f"got {key_mask.dtype} of shape {tuple(key_mask.shape)} on {key_mask.device}")
        q = rearrange(self.to_q(x), "b s (h d) -> b h s d", h=self.heads)
        k, v = rearrange(self.to_kv(x), "b s (two h d) -> two b h s d", two=2, h=self.kv_heads)
        score_mod = self.score_mod if key_mask is None else _leaving_out_keys(self.score_mod, key_mask)
        o = attention(q, k, v, self.mask, score_mod=score_mod, key_lengths=key_lengths,
                      dropout_p=self.attn_dropout if self.training else 0.0, backend=self.backend)
        return self.dropout(self.to_out(rearrange(o, "b h s d -> b s (h d)")))


def _leaving_out_keys(score_mod: Callable | None, key_mask: torch.Tensor) -> Callable:
    """``score_mod`` (or the score itself) plus -inf at the keys ``key_mask`` (B, S) leaves out: a term of
    the key alone, read from a captured table, which the kernels add once per key (a separable score
    function). The table is flat, indexed by ``b * S + kv_idx``: Dynamo cannot trace a tensor indexed by
    a tuple of traced values (``RelativeBias`` says the same)."""
    length = key_mask.shape[1]
    bias = torch.zeros(key_mask.numel(), dtype=torch.float32, device=key_mask.device).masked_fill(
        ~key_mask.reshape(-1), float("-inf"))

    def keys_left_out(score, b, h, q_idx, kv_idx):
        kept = score if score_mod is None else score_mod(score, b, h, q_idx, kv_idx)
        return kept + bias[b * length + kv_idx]
    return keys_left_out


def _score_mod(score_mod: ScoreModArg, heads: int) -> Callable | None:
    """``score_mod`` as a callable: a name or ``{"name", "params"}`` made by ``make_score_mod``."""
    if score_mod is None or callable(score_mod):
        return score_mod
    if isinstance(score_mod, str):
        return make_score_mod(score_mod, heads)
    if isinstance(score_mod, Mapping) and set(score_mod) <= {"name", "params"} and "name" in score_mod:
        return make_score_mod(str(score_mod["name"]), heads, **dict(score_mod.get("params") or {}))
    raise ValueError(f"score_mod must be None, a registered name, {{'name': ..., 'params': {{...}}}} or a "
                     f"callable; got {score_mod!r}")
