"""The host side of a launch: what every kernel launch of a call needs, built once per mask.

A ``LaunchPlan`` holds the shapes, the mask's block tables on the device, the tuning key, the
constexpr flags shared by the forward and backward kernels, and the helpers generated from the
mask's mask_mod and the call's score_mod with the tensors they capture. ``LaunchPlan.of`` keeps it
on the mask (``mask.derived``), keyed by what it depends on (shapes, dtype, device, scale,
key_lengths presence, score_mod, dropout presence): building it cost ~25 µs of host time per call on
an H100 host.
"""

from __future__ import annotations

import dataclasses
import importlib

import torch
import triton

from sparseflash.attention.dropout import Dropout
from sparseflash.attention.kept_tensors import made_outside_graph_pools
from sparseflash.attention.triton import codegen, forward_decode, forward_persistent
from sparseflash.attention.triton.launch import Standin, gluon_hopper, interpreting
from sparseflash.attention.triton.replay import Replays
from sparseflash.attention.triton.tuning import ConfigKey, KernelConfig
from sparseflash.masks import BlockMask, MaskKind, layout_to_tables
from sparseflash.masks.functions import Graph

LOG2E = 1.4426950408889634
KIND_CODES = {MaskKind.DENSE: 0, MaskKind.CAUSAL: 1, MaskKind.SPARSE: 2}  # the kernels' MASK_KIND
# MODS tables kept per plan, by the captured tensors' addresses: a function that captures a tensor made
# at each call (a key mask, a batch's document ids) meets a new address at most calls, and a table
# kept for each would grow without end; the allocator's reuse of addresses makes the few kept hit.
MODS_TABLES_KEPT = 16


class LaunchPlan:
    """Shapes, tables, tuning key and flags of every launch with one mask, shapes, dtype, device,
    scale and key_lengths presence."""

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, mask: BlockMask, has_key_lengths: bool,
           scale: float, score_graph: Graph | None = None, dropout: bool = False) -> "LaunchPlan":
        per_mask = mask.derived.setdefault("triton", {})
        key = (q.shape, k.shape, q.dtype, q.device, has_key_lengths, scale,
               None if score_graph is None else score_graph.key(), dropout)
        plan = per_mask.get(key)
        if plan is None:
            plan = per_mask[key] = made_outside_graph_pools(
                lambda: cls(q, k, mask, has_key_lengths, scale, score_graph, dropout), q.device)
        return plan

    def __init__(self, q: torch.Tensor, k: torch.Tensor, mask: BlockMask, has_key_lengths: bool, scale: float,
                 score_graph: Graph | None = None, dropout: bool = False):
        self.batch, self.heads, self.q_len, self.head_dim = q.shape
        self.kv_heads, self.kv_len = k.shape[1], k.shape[2]
        self.groups = self.heads // self.kv_heads
        self.scale, self.qk_scale = scale, scale * LOG2E
        self.padded_dim = max(16, triton.next_power_of_2(self.head_dim))
        self.head_dim_parts = head_dim_parts(self.head_dim)
        self.has_key_lengths = has_key_lengths
        self.dropout = dropout  # the kernels drop probabilities (DROPOUT): every call then gives a Dropout
        self.kind, self.causal, self.sparse_block = mask.kind, mask.causal, mask.block_size
        self.mean_row_keys = max(1.0, mask.mean_row_blocks) * mask.block_size[1]  # keys a query row walks
        self.layout_heads = mask.num_heads if mask.kind is MaskKind.SPARSE else 1  # 1: shared by the heads
        # fp32 inputs use TF32 tensor-core dots on the GPU (exact IEEE in the interpreter)
        self.dot_precision = "tf32" if q.dtype is torch.float32 and not interpreting() else "ieee"
        self.placeholder = torch.empty(1, dtype=torch.int32, device=q.device)  # for absent tensors
        self._mods(mask, score_graph)
        # loads of captured tensors at per-score addresses fail Triton 3.6's warp-specialisation pass;
        # the persistent forward has no dropout
        persistent = "" if dropout or self._loads_per_score(mask, score_graph) else forward_persistent.mode(
            q, k, mask, has_key_lengths, self.padded_dim)
        gluon_inputs = (q, k, mask, self.mean_row_keys, dropout)
        special_per_score = score_graph is not None and score_graph.uses_special_functions and not score_graph.separable
        self.gluon_forward = gluon_hopper(q.device) and gluon_kernels("forward").applies(
            *gluon_inputs, special_per_score, self.functions)
        self.gluon_backward = gluon_hopper(q.device) and gluon_kernels("backward").applies(
            *gluon_inputs, self.score_mod_grads is not None)
        score = "score-special" if score_graph is not None and score_graph.uses_special_functions else "score"
        mods = "+".join(name for name, on in (("mask", self.mask_mod is not None),
                                              (score, self.score_mod is not None), ("dropout", dropout)) if on)
        first, second = self.head_dim_parts["HEAD_DIM"], self.head_dim_parts["HEAD_DIM2"]
        decode_rows = forward_decode.group_rows(self) if forward_decode.applies(self) else 0
        self.config_key = ConfigKey.of(q, mask, self.padded_dim, persistent, mods,
                                       f"{first}+{second}" if second else "", decode_rows)
        # the backward kernels' key: "grads" where they also add the gradients of captured tensors (more shared
        # memory and registers than the same function with frozen captures)
        self.backward_key = self.config_key if self.score_mod_grads is None else dataclasses.replace(
            self.config_key, mods=f"{mods}+grads")
        tables = mask.tables(q.device) if mask.kind is MaskKind.SPARSE else None
        self._tables = {side: self._tables_of(tables, side) for side in ("kv", "q")}
        self.has_partial_tiles = mask.kind is MaskKind.SPARSE and bool(mask.partial_layout.any())
        if self.has_partial_tiles:  # every computed tile in one table, for the persistent forward
            every = layout_to_tables(mask.layout.to(q.device))
            self._tables["all"] = ((*every, *every), (*_strides(every[0], 1), *_strides(every[1], 2)))
        self._constexprs: dict[tuple, dict] = {}
        self.per_layout: dict[str, dict] = {}  # what a kernel keeps per input layout, under its own key
        self.replays = {"forward": Replays(), "backward": Replays()}  # settled calls, by layout (replay.py)
        # the tensors the plan holds for every call (its tables; what a kernel made once for its calls: ``hold``):
        # what a replay takes as they are
        self.tensors = [self.placeholder, *(t for tables, _ in self._tables.values() for t in tables)]

    def hold(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, made once for this plan's calls (a work schedule), kept among ``tensors``: the calls that
        launch with it are replayed."""
        self.tensors.append(tensor)
        return tensor

    def _mods(self, mask: BlockMask, score_graph: Graph | None) -> None:
        """The helpers generated from the mask's mask_mod (only where some tile needs it evaluated) and
        the score function's graph (None where absent), and the tensors the mask_mod captures. A
        score function's captured tensors are given with each call (``captures``): the generated code
        depends on the graph's structure only, so a new closure of the same function reuses the plan."""
        mask_graph = mask.mask_graph if mask.needs_mask_mod else None
        self.mask_captures = list(mask_graph.captures) if mask_graph is not None else []
        helpers = codegen.helpers(mask_graph, score_graph) if mask_graph or score_graph else None
        self.mask_mod = helpers.mask_mod if helpers else None
        self.score_mod = helpers.score_mod if helpers else None
        self.score_keys = helpers.score_keys if helpers else None
        self.score_row = helpers.score_row if helpers else None
        self.score_mod_grads = helpers.score_mod_grads if helpers else None
        # the table without captured tensors made with the plan (on the thread that keeps it out of graph pools)
        self._mods_tables: dict[tuple, torch.Tensor] = {(): codegen.mods_table([], [], self.placeholder.device)}

    @property
    def functions(self) -> bool:
        """Whether the kernels call a generated mask or score function (``_mods``)."""
        return self.mask_mod is not None or self.score_mod is not None

    @staticmethod
    def _loads_per_score(mask: BlockMask, score_graph: Graph | None) -> bool:
        """Whether a generated helper loads a captured tensor at an address that varies per score."""
        graphs = [g for g in (mask.mask_graph if mask.needs_mask_mod else None, score_graph) if g is not None]
        return any(n.op == "load" and n.deps & {"q_idx", "kv_idx", "score"} for g in graphs for n in g.nodes)

    def captures(self, score_graph: Graph | None) -> list[torch.Tensor]:
        """The tensors the generated helpers read, in MODS order: the mask_mod's, then the score
        function's (of this call's trace), each checked to be on the inputs' device."""
        captures = self.mask_captures + (list(score_graph.captures) if score_graph is not None else [])
        device = self.placeholder.device
        for t in captures:
            if t.device != device:
                raise ValueError(f"a tensor captured by a mask or score function is on {t.device}; the inputs "
                                 f"are on {device} (create it there, or build the mask with device={device})")
        return captures

    def mods_table(self, captures: list[torch.Tensor], grads: list | None = None) -> torch.Tensor:
        """The MODS table of the captured tensors (and their gradient buffers), kept per layout when
        there are no gradient buffers."""
        if grads is not None and any(g is not None for g in grads):
            return codegen.mods_table(captures, grads, self.placeholder.device)
        layout = tuple((t.data_ptr(), t.stride()) for t in captures)
        if layout not in self._mods_tables:
            if len(self._mods_tables) >= MODS_TABLES_KEPT:  # the oldest goes
                del self._mods_tables[next(iter(self._mods_tables))]
            self._mods_tables[layout] = made_outside_graph_pools(
                lambda: codegen.mods_table(captures, [None] * len(captures), self.placeholder.device),
                self.placeholder.device)
        return self._mods_tables[layout]

    def dropout_args(self, dropout: Dropout | None, ahead: bool = False) -> tuple:
        """The kernels' dropout arguments: the seed tensor (a placeholder without dropout; a ``Standin``
        with ``ahead``), the threshold and the scale of the kept probabilities."""
        if not self.dropout:
            return self.placeholder, 0, 1.0
        if ahead:
            return Standin(torch.int64, ()), 0, 1.0
        return dropout.seed, dropout.threshold, dropout.scale

    def key_lengths_arg(self, key_lengths: torch.Tensor | None) -> torch.Tensor:
        """``key_lengths`` as the kernels read it (int32), or a placeholder (HAS_KEY_LENGTHS is off)."""
        return self.placeholder if key_lengths is None else key_lengths.to(torch.int32).contiguous()

    def tables_of(self, side: str) -> tuple[tuple, tuple]:
        """``side`` "kv" (row tables), "q" (column tables) or, for a SPARSE mask with partial tiles,
        "all" (row tables of every computed tile, as both the full and the partial ones): the tensors
        full num/idx and partial num/idx, and the (batch, head, row) strides of num and idx; a batch
        or head stride is 0 where the layout is shared."""
        return self._tables[side]

    def _tables_of(self, tables, side: str) -> tuple[tuple, tuple]:
        if tables is None:  # DENSE and CAUSAL kernels read no table
            return (self.placeholder,) * 4, (0,) * 6
        full_num, full_idx = getattr(tables, f"full_{side}_num_blocks"), getattr(tables, f"full_{side}_indices")
        part_num, part_idx = getattr(tables, f"partial_{side}_num_blocks"), getattr(tables, f"partial_{side}_indices")
        return (full_num, full_idx, part_num, part_idx), (*_strides(full_num, 1), *_strides(full_idx, 2))

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
            **self.head_dim_parts,
            DOT_PRECISION=self.dot_precision, WIDEN_DOTS=interpreting(), EVEN_LENGTHS=even,
            MASK_MOD=self.mask_mod, SCORE_MOD=self.score_mod, SCORE_KEYS=self.score_keys, SCORE_ROW=self.score_row,
            DROPOUT=self.dropout,
        )


def gluon_kernels(direction: str):
    """The module forward_gluon.py or backward_gluon.py (``direction`` "forward" or "backward"), imported
    only where Gluon's Hopper API is there (``gluon_hopper``): its kernels are defined at import."""
    return importlib.import_module(f"sparseflash.attention.triton.{direction}_gluon")


def head_dim_parts(head_dim: int) -> dict:
    """The head-dim constexprs the kernels share (``constexprs``): a head dim that two powers of two
    >= 16 cover with fewer columns than its padding to one (48 = 32 + 16, 80 = 64 + 16, 96 = 64 + 32,
    160 = 128 + 32, 192 = 128 + 64) is computed as those two parts (HEAD_DIM, HEAD_DIM2), two dots a
    product, up to seven sixteenths less matmul work; others are padded (HEAD_DIM2 = 0). The persistent
    forward takes powers of two only, the Gluon forward those without padding (``forward_gluon.KEY_TILE``); the
    small kernels around the loops pad (``padded_dim``)."""
    padded = max(16, triton.next_power_of_2(head_dim))
    first = padded // 2
    second = max(16, triton.next_power_of_2(max(1, head_dim - first)))
    if first < 16 or first + second >= padded:
        return dict(HEAD_DIM=padded, HEAD_DIM2=0, D_PADDED=padded != head_dim)
    return dict(HEAD_DIM=first, HEAD_DIM2=second, D_PADDED=first + second != head_dim)


def _strides(x: torch.Tensor, dims: int) -> tuple[int, int, int]:
    """(batch, head, row) strides of a table with ``dims`` trailing dims (1 for counts, 2 for
    indices); 0 where the layout is shared."""
    lead = x.dim() - dims  # 1 (heads) or 2 (batch, heads)
    batch = x.stride(0) if lead == 2 and x.shape[0] > 1 else 0
    head = x.stride(lead - 1) if x.shape[lead - 1] > 1 else 0
    return batch, head, x.stride(lead)
