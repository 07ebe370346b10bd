"""Built-in score functions and their registry.

A score function is ``score_mod(score, b, h, q_idx, kv_idx) -> score`` (FlexAttention's signature,
``sparseflash.masks.functions`` lists what it may use), passed as ``attention(..., score_mod=fn)``.
A registered factory ``fn(heads, **params) -> score_mod`` makes one by name:
``make_score_mod("alibi", heads=8)``, which is what ``SparseAttention(score_mod="alibi")`` and the
Hydra key ``attention.score_mod=alibi`` (or ``{name: softcap, params: {cap: 30}}``) call. A factory may
return an ``nn.Module`` whose ``forward`` is the score function: ``SparseAttention`` then holds it as
a submodule, so its parameters train (``relative_bias``) and its buffers follow ``.to(device)``.
"""

from __future__ import annotations

import inspect
import math
from typing import Callable

import torch
from torch import nn

ScoreMod = Callable[..., torch.Tensor]
_REGISTRY: dict[str, Callable[..., ScoreMod]] = {}


def register_score_mod(name: str) -> Callable:
    """Decorator adding a factory ``fn(heads, **params) -> score_mod`` to the registry."""

    def decorate(fn):
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"score_mod {name!r} is already registered (by {_REGISTRY[name].__module__})")
        _REGISTRY[name] = fn
        return fn

    return decorate


def registered_score_mods() -> list[str]:
    """Names of the registered score functions, sorted."""
    return sorted(_REGISTRY)


def make_score_mod(name: str, heads: int, **params) -> ScoreMod:
    """The registered score function ``name`` for ``heads`` query heads, with its ``params``."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown score_mod {name!r}; registered: {', '.join(registered_score_mods())}")
    factory = _REGISTRY[name]
    accepted = [p for p in inspect.signature(factory).parameters if p != "heads"]
    try:
        inspect.signature(factory).bind(heads, **params)
    except TypeError:
        raise ValueError(f"score_mod {name!r} takes parameters {accepted}; got {sorted(params)}") from None
    return factory(heads, **params)


def alibi_slopes(heads: int) -> torch.Tensor:
    """ALiBi's per-head slopes (Press et al.): the geometric sequence ``2^(-8 i / n)``, i = 1..n, for
    ``n = heads`` when heads is a power of two; otherwise, as the paper's reference code, those of the
    largest power of two below heads followed by every other slope of twice that many."""
    def powers(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if heads & (heads - 1) == 0:
        slopes = powers(heads)
    else:
        lower = 1 << (heads.bit_length() - 1)
        slopes = powers(lower) + powers(2 * lower)[0::2][: heads - lower]
    return torch.tensor(slopes, dtype=torch.float32)


class Alibi(nn.Module):
    """ALiBi: ``score + slope[h] * (kv_idx - q_idx)``, a linear penalty on distance per head (a buffer
    of ``heads`` slopes, moved with the module)."""

    def __init__(self, heads: int):
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(heads), persistent=False)

    def forward(self, score, b, h, q_idx, kv_idx):
        return score + self.slopes[h] * (kv_idx - q_idx)


class RelativeBias(nn.Module):
    """A learnable bias per head and relative position: ``score + bias[h, clamp(kv_idx - q_idx)]`` with
    distances clamped to ``[-max_distance, max_distance]`` (a T5-style table without buckets, initialised to
    zero). The table is kept flat, ``table[h * (2 max_distance + 1) + max_distance + distance]``: Dynamo
    (torch 2.13) cannot trace a tensor indexed by a tuple of traced values, and torch.compile traces this."""

    def __init__(self, heads: int, max_distance: int = 128):
        super().__init__()
        if max_distance < 1:
            raise ValueError(f"relative_bias max_distance must be >= 1; got {max_distance}")
        self.max_distance = int(max_distance)
        self.table = nn.Parameter(torch.zeros(heads * (2 * self.max_distance + 1)))

    def forward(self, score, b, h, q_idx, kv_idx):
        distance = torch.clamp(kv_idx - q_idx, -self.max_distance, self.max_distance)
        return score + self.table[h * (2 * self.max_distance + 1) + self.max_distance + distance]


@register_score_mod("alibi")
def alibi(heads: int) -> ScoreMod:
    """ALiBi (``Alibi``)."""
    return Alibi(heads)


@register_score_mod("softcap")
def softcap(heads: int, cap: float = 30.0) -> ScoreMod:
    """Tanh soft-capping (Gemma 2, Grok): ``cap * tanh(score / cap)``."""
    if not cap > 0 or math.isinf(cap):
        raise ValueError(f"softcap cap must be a positive number; got {cap}")
    cap = float(cap)

    def softcap_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return softcap_mod


@register_score_mod("relative_bias")
def relative_bias(heads: int, max_distance: int = 128) -> ScoreMod:
    """A learnable relative-position bias (``RelativeBias``)."""
    return RelativeBias(heads, max_distance)
