"""``MaskSpec``: a mask described by name, from a Hydra config or a dict to a ``BlockMask``.

A Hydra ``attention`` config, ``SparseAttention(mask=...)`` and the benchmark's ``patterns`` all
describe a mask the same way: a registered pattern, its parameters, the mask block, whether the
causal predicate applies inside blocks, and whether a per-head pattern differs between heads. That
description is checked once, when the spec is made (an unknown pattern, a parameter the pattern does
not take, a bad block), and builds a ``BlockMask`` for any length.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

from sparseflash.masks.block_mask import DEFAULT_BLOCK, BlockMask, normalize_block_size
from sparseflash.masks.patterns import get, make

FIELDS = ("pattern", "params", "block", "causal", "per_head")


@dataclass(frozen=True)
class MaskSpec:
    """A registered pattern with its parameters and block. ``key``: its fields as text (``from_key`` reads
    it back), what caches and custom ops key on.

    Args:
        pattern: a name in ``sparseflash.masks.registered()``.
        params: the pattern's own parameters, as a mapping or ``(name, value)`` pairs.
        block: the mask block, an int or ``(SPARSE_BLOCK_M, SPARSE_BLOCK_N)``.
        causal: apply ``q_idx >= kv_idx`` inside blocks (always on for causal patterns).
        per_head: a pattern that takes ``head`` differs between heads (``build(..., heads=H)``).
    """

    pattern: str = "dense"
    params: tuple[tuple[str, Any], ...] = ()
    block: Union[int, tuple[int, int]] = DEFAULT_BLOCK
    causal: bool = False
    per_head: bool = False

    def __post_init__(self):
        params = dict(self.params.items() if isinstance(self.params, Mapping) else self.params)
        pattern = get(str(self.pattern))  # an unknown name lists the registered ones
        unknown = sorted(set(params) - set(pattern.params))
        if unknown:
            raise ValueError(f"pattern {pattern.name!r} takes parameters {pattern.params}; got {unknown}")
        block = normalize_block_size(self.block)
        object.__setattr__(self, "pattern", pattern.name)
        object.__setattr__(self, "params", tuple(sorted(params.items())))
        object.__setattr__(self, "block", block[0] if block[0] == block[1] else block)
        object.__setattr__(self, "causal", bool(self.causal) or pattern.causal)
        object.__setattr__(self, "per_head", bool(self.per_head))
        object.__setattr__(self, "key", json.dumps(self.as_dict(), sort_keys=True))

    @classmethod
    def from_key(cls, key: str) -> "MaskSpec":
        """The spec whose ``key`` (its fields as JSON, made on construction) is ``key``."""
        fields = json.loads(key)
        block = fields.pop("block")
        return cls(**fields, block=block if isinstance(block, int) else tuple(block))

    @classmethod
    def from_config(cls, cfg: Union[None, str, Mapping[str, Any], "MaskSpec"], *,
                    other_keys: tuple[str, ...] = ()) -> "MaskSpec":
        """A spec from ``None`` (dense), a pattern name, a mapping with the fields above (a Hydra
        ``attention`` config; ``other_keys`` such as its ``backend`` are allowed and ignored) or a
        spec. Parameters a pattern does not take, left over when only ``attention.pattern`` is changed
        on the command line, are dropped with a warning."""
        if cfg is None or isinstance(cfg, MaskSpec):
            return cfg or cls()
        if isinstance(cfg, str):
            return cls(cfg)
        if not isinstance(cfg, Mapping):
            raise ValueError(f"a mask spec is None, a pattern name, a mapping or a MaskSpec; got {type(cfg).__name__}")
        unknown = sorted(set(cfg) - set(FIELDS) - set(other_keys))
        if unknown or "pattern" not in cfg:
            raise ValueError(f"a mask spec needs 'pattern' and may set {', '.join(FIELDS[1:])}; got keys {sorted(cfg)}")
        name = str(cfg["pattern"])
        params = dict(cfg.get("params") or {})
        accepted = get(name).params
        dropped = sorted(set(params) - set(accepted))
        if dropped:
            warnings.warn(f"attention.params {dropped} are not parameters of pattern {name!r} "
                          f"(it takes {sorted(accepted)}); ignoring them")
            params = {k: v for k, v in params.items() if k in accepted}
        block = cfg.get("block", DEFAULT_BLOCK)
        return cls(name, params, block if isinstance(block, int) else tuple(block), bool(cfg.get("causal", False)),
                   bool(cfg.get("per_head", False)))

    def build(self, q_len: int, kv_len: int | None = None, heads: int | None = None, device=None) -> BlockMask:
        """The mask for ``q_len`` queries and ``kv_len`` keys (default ``q_len``) on ``device`` (default
        the CPU); ``heads`` is used by per-head specs only."""
        return make(self.pattern, q_len, kv_len, block=self.block, heads=heads if self.per_head else None,
                    causal=self.causal, device=device, **dict(self.params))

    @property
    def block_size(self) -> tuple[int, int]:
        return normalize_block_size(self.block)

    def __str__(self) -> str:
        """``butterfly(factors=2) block 64, causal, per head``."""
        params = ",".join(f"{k}={v}" for k, v in self.params)
        text = f"{self.pattern}({params}) block {self.block}" if params else f"{self.pattern} block {self.block}"
        return text + (", causal" if self.causal else "") + (", per head" if self.per_head else "")

    def as_dict(self) -> dict:
        """The fields as plain values (for logs and configs)."""
        return {"pattern": self.pattern, "params": dict(self.params), "block": self.block, "causal": self.causal,
                "per_head": self.per_head}
