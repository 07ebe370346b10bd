"""The host side of a launch: what every kernel launch of a call needs, built once per mask.

A ``LaunchPlan`` holds the shapes, the mask's block tables on the device, the tuning key and the
constexpr flags shared by the forward and backward kernels. ``LaunchPlan.of`` keeps it on the mask
(``mask.derived``), keyed by what it depends on (shapes, dtype, device, scale, key_lengths
presence): building it cost ~25 µs of host time per call on an H100 host.
"""

from __future__ import annotations

import torch
import triton

from sparseflash.attention.triton import forward_persistent
from sparseflash.attention.triton.launch import interpreting
from sparseflash.attention.triton.tuning import ConfigKey, KernelConfig
from sparseflash.masks import BlockMask, MaskKind

LOG2E = 1.4426950408889634
KIND_CODES = {MaskKind.DENSE: 0, MaskKind.CAUSAL: 1, MaskKind.SPARSE: 2}  # the kernels' MASK_KIND


class LaunchPlan:
    """Shapes, tables, tuning key and flags of every launch with one mask, shapes, dtype, device,
    scale and key_lengths presence."""

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, mask: BlockMask, has_key_lengths: bool,
           scale: float) -> "LaunchPlan":
        per_mask = mask.derived.setdefault("triton", {})
        key = (q.shape, k.shape, q.dtype, q.device, has_key_lengths, scale)
        plan = per_mask.get(key)
        if plan is None:
            plan = per_mask[key] = cls(q, k, mask, has_key_lengths, scale)
        return plan

    def __init__(self, q: torch.Tensor, k: torch.Tensor, mask: BlockMask, has_key_lengths: bool, scale: float):
        self.batch, self.heads, self.q_len, self.head_dim = q.shape
        self.kv_heads, self.kv_len = k.shape[1], k.shape[2]
        self.groups = self.heads // self.kv_heads
        self.scale, self.qk_scale = scale, scale * LOG2E
        self.padded_dim = max(16, triton.next_power_of_2(self.head_dim))
        self.has_key_lengths = has_key_lengths
        self.kind, self.causal, self.sparse_block = mask.kind, mask.causal, mask.block_size
        # fp32 inputs use TF32 tensor-core dots on the GPU (exact IEEE in the interpreter)
        self.dot_precision = "tf32" if q.dtype is torch.float32 and not interpreting() else "ieee"
        persistent = forward_persistent.mode(q, k, mask, has_key_lengths, self.padded_dim)
        self.config_key = ConfigKey.of(q, mask, self.padded_dim, persistent)
        self._placeholder = torch.empty(1, dtype=torch.int32, device=q.device)  # for absent tensors
        tables = mask.tables(q.device) if mask.kind is MaskKind.SPARSE else None
        self._tables = {side: self._tables_of(tables, side) for side in ("kv", "q")}
        self._constexprs: dict[tuple, dict] = {}
        self.per_layout: dict[str, dict] = {}  # what a kernel keeps per input layout, under its own key

    def key_lengths_arg(self, key_lengths: torch.Tensor | None) -> torch.Tensor:
        """``key_lengths`` as the kernels read it (int32), or a placeholder (HAS_KEY_LENGTHS is off)."""
        return self._placeholder if key_lengths is None else key_lengths.to(torch.int32).contiguous()

    def tables_of(self, side: str) -> tuple[tuple, tuple]:
        """``side`` "kv" (row tables) or "q" (column tables): the tensors full num/idx and partial
        num/idx, and the (head, row) strides of num and idx; the head stride is 0 for a shared layout."""
        return self._tables[side]

    def _tables_of(self, tables, side: str) -> tuple[tuple, tuple]:
        if tables is None:  # DENSE and CAUSAL kernels read no table
            return (self._placeholder,) * 4, (0, 0, 0, 0)
        full_num, full_idx = getattr(tables, f"full_{side}_num_blocks"), getattr(tables, f"full_{side}_indices")
        part_num, part_idx = getattr(tables, f"partial_{side}_num_blocks"), getattr(tables, f"partial_{side}_indices")
        shared = full_num.shape[0] == 1
        return ((full_num, full_idx, part_num, part_idx),
                (0 if shared else full_num.stride(0), full_num.stride(1),
                 0 if shared else full_idx.stride(0), full_idx.stride(1)))

    def constexprs(self, cfg: KernelConfig, **extra) -> dict:
        """The constexprs and launch options of a launch with ``cfg``: its tiles, warps and stages,
        the flags that forward and backward kernels share, and ``extra`` flags."""
        key = (cfg, *extra.items())
        if key not in self._constexprs:
            self._constexprs[key] = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
                                         num_stages=cfg.num_stages, **self._flags_of(cfg), **extra)
        return self._constexprs[key]

    def _flags_of(self, cfg: KernelConfig) -> dict:
        even = self.kind is not MaskKind.SPARSE and all(
            length % tile == 0 for length in (self.q_len, self.kv_len) for tile in (cfg.block_m, cfg.block_n))
        return dict(
            MASK_KIND=KIND_CODES[self.kind], IS_CAUSAL=self.causal, HAS_KEY_LENGTHS=self.has_key_lengths,
            SPARSE_BLOCK_M=self.sparse_block[0], SPARSE_BLOCK_N=self.sparse_block[1],
            HEAD_DIM=self.padded_dim, D_PADDED=self.padded_dim != self.head_dim,
            DOT_PRECISION=self.dot_precision, WIDEN_DOTS=interpreting(), EVEN_LENGTHS=even,
        )
