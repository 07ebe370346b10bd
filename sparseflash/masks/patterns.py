"""Block-sparsity patterns, element-level mask patterns, and their one registry.

A block pattern is a function ``fn(n_q, n_kv, **params) -> bool [n_q, n_kv]`` from block counts to a
layout (True = the tile is computed). A pattern that takes a ``head`` keyword is called once per
head, so it can differ between heads (e.g. a random seed per head). Register one with
``@register("name")``.

An element pattern is a factory ``fn(q_len, kv_len, **params) -> mask_mod``, registered with
``@register_mask_mod("name")``: the ``mask_mod(b, h, q_idx, kv_idx) -> bool`` it returns becomes a
mask through ``from_mask_mod`` (a factory that takes ``device`` gets the device the mask is built
on, for the tensors it captures; one that takes ``heads`` gets the heads and may depend on ``h``).

Either kind builds with ``make("name", q_len, block=..., **params)``; that is also what the Hydra
configs call, so a registered pattern is at once usable from the command line.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from sparseflash.masks.block_mask import DEFAULT_BLOCK, BlockMask, check_count, normalize_block_size
from sparseflash.masks.functions import trace

PatternFn = Callable[..., torch.Tensor]


SUPPLIED = ("n_q", "n_kv", "head", "q_len", "kv_len", "heads", "device")  # arguments make() passes itself


@dataclass(frozen=True)
class Pattern:
    name: str
    fn: PatternFn
    causal: bool  # the pattern implies the element-level causal predicate
    element: bool = False  # fn is a mask_mod factory (register_mask_mod), not a block pattern

    def takes(self, argument: str) -> bool:
        return argument in inspect.signature(self.fn).parameters

    @property
    def per_head(self) -> bool:
        return self.takes("heads" if self.element else "head")

    @property
    def params(self) -> list[str]:
        """Keyword parameters a user may set (the lengths, ``head``/``heads`` and ``device`` are
        supplied by ``make``)."""
        return [p for p in inspect.signature(self.fn).parameters if p not in SUPPLIED]


_REGISTRY: dict[str, Pattern] = {}


def register(name: str, *, causal: bool = False) -> Callable[[PatternFn], PatternFn]:
    """Decorator adding ``fn(n_q, n_kv, **params) -> bool [n_q, n_kv]`` to the registry.

    ``causal=True`` marks patterns that imply the causal predicate (``make`` then sets it)."""
    return _registrar(name, causal, element=False)


def register_mask_mod(name: str) -> Callable[[PatternFn], PatternFn]:
    """Decorator adding an element pattern, ``fn(q_len, kv_len, **params) -> mask_mod``, to the
    registry (see the module docstring)."""
    return _registrar(name, False, element=True)


def _registrar(name: str, causal: bool, element: bool) -> Callable[[PatternFn], PatternFn]:
    if not isinstance(name, str) or not name:
        raise ValueError(f"a pattern's name must be a non-empty string; got {name!r}")

    def decorate(fn: PatternFn) -> PatternFn:
        if name in _REGISTRY and _REGISTRY[name].fn is not fn:
            raise ValueError(f"pattern {name!r} is already registered (by {_REGISTRY[name].fn.__module__})")
        _REGISTRY[name] = Pattern(name, fn, causal, element)
        return fn

    return decorate


def import_patterns(sources: Iterable[str]) -> None:
    """Import the modules that register a user's patterns, so that configs can name them.

    Each source is a ``.py`` file path or a dotted module name (found from the working
    directory too), e.g. ``import_patterns=[my_patterns.py]`` on the experiments' command line."""
    if isinstance(sources, str):
        raise ValueError(f"import_patterns takes a list of files or modules; got the string {sources!r}: "
                         f"write [{sources}]")
    for source in sources:
        if source.endswith(".py") or os.sep in source:
            path = Path(source).resolve()
            if not path.is_file():
                raise ValueError(f"import_patterns: no file {path} (from {source!r})")
            # one module name per file (not per stem): two folders' patterns.py are two modules
            name = f"sparseflash_user_patterns.{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
            if name in sys.modules:  # already imported: registering again would clash
                continue
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]  # a failed import is not "already imported"
                raise
        else:  # found from the working directory too, for this import only
            added = os.getcwd() not in sys.path
            if added:
                sys.path.insert(0, os.getcwd())
            try:
                importlib.import_module(source)
            finally:
                if added:
                    sys.path.remove(os.getcwd())


def registered() -> list[str]:
    """Names of the registered patterns, sorted."""
    return sorted(_REGISTRY)


def get(name: str) -> Pattern:
    """The registered pattern ``name``; an unknown name lists the known ones."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown pattern {name!r}; registered patterns: {', '.join(registered())}")
    return _REGISTRY[name]


def _bind(pattern: Pattern, args: tuple, kwargs: dict, params: dict) -> None:
    try:
        inspect.signature(pattern.fn).bind(*args, **kwargs)
    except TypeError as err:
        raise ValueError(
            f"pattern {pattern.name!r} takes parameters {pattern.params}; got {sorted(params)} ({err})"
        ) from None


def _call_pattern(pattern: Pattern, n_q: int, n_kv: int, params: dict, head: int | None) -> torch.Tensor:
    kwargs = dict(params, head=head) if head is not None else dict(params)
    _bind(pattern, (n_q, n_kv), kwargs, params)
    layout = torch.as_tensor(pattern.fn(n_q, n_kv, **kwargs))
    if layout.shape != (n_q, n_kv) or layout.dtype != torch.bool:
        raise ValueError(
            f"pattern {pattern.name!r} must return a bool tensor of shape ({n_q}, {n_kv}); "
            f"got {layout.dtype} {tuple(layout.shape)}"
        )
    return layout


def make(
    name: str,
    q_len: int,
    kv_len: int | None = None,
    block: int | tuple[int, int] = DEFAULT_BLOCK,
    heads: int | None = None,
    causal: bool = False,
    device: torch.device | str | None = None,
    **params,
) -> BlockMask:
    """Build the registered pattern ``name`` as a ``BlockMask``.

    Args:
        q_len, kv_len: sequence lengths (``kv_len`` defaults to ``q_len``); need not be multiples
            of the block.
        block: ``SPARSE_BLOCK_M`` and ``SPARSE_BLOCK_N`` (an int sets both).
        heads: for a per-head pattern (one taking ``head``, or an element pattern taking ``heads``),
            build ``[heads, n_q, n_kv]``; other patterns are shared by every head (``[1, n_q, n_kv]``).
        causal: apply ``q_idx >= kv_idx`` inside tiles (always on for causal patterns).
        device: where the mask is built and kept (default: the CPU); an element pattern's mask_mod
            is evaluated there, and the tensors it captures live there.
        **params: the pattern's own parameters.
    """
    pattern = get(name)
    q_len, kv_len, (block_m, block_n), n_q, n_kv = _geometry(q_len, kv_len, block, heads=heads)
    if pattern.element:
        return _element_mask(pattern, q_len, kv_len, (block_m, block_n), heads, causal, device, params)
    if heads is not None and pattern.per_head:
        layout = torch.stack([_call_pattern(pattern, n_q, n_kv, params, h) for h in range(heads)])
    else:
        layout = _call_pattern(pattern, n_q, n_kv, params, 0 if pattern.per_head else None)[None]
    mask = BlockMask(layout, (block_m, block_n), q_len, kv_len, causal=causal or pattern.causal)
    return mask if device is None else mask.to(device)


def _geometry(q_len, kv_len, block, **counts) -> tuple[int, int, tuple[int, int], int, int]:
    """``(q_len, kv_len, (SPARSE_BLOCK_M, SPARSE_BLOCK_N), n_q_blocks, n_kv_blocks)``, checked, kv_len defaulting to
    q_len; each of ``counts`` (heads, batch) None or an int >= 1."""
    for name, value in counts.items():
        if value is not None and (isinstance(value, bool) or not hasattr(value, "__index__") or value < 1):
            raise ValueError(f"{name} must be None or an int >= 1; got {value!r}")
    q_len = check_count(q_len, "q_len")
    kv_len = q_len if kv_len is None else check_count(kv_len, "kv_len")
    block_m, block_n = normalize_block_size(block)
    return q_len, kv_len, (block_m, block_n), -(-q_len // block_m), -(-kv_len // block_n)


def _element_mask(pattern: Pattern, q_len: int, kv_len: int, block: tuple[int, int], heads: int | None,
                  causal: bool, device, params: dict) -> BlockMask:
    """An element pattern's mask: its factory's mask_mod, classified per tile on ``device``."""
    device = torch.device("cpu") if device is None else torch.device(device)
    supplied = {"device": device, "heads": heads or 1}
    kwargs = dict(params, **{k: v for k, v in supplied.items() if pattern.takes(k)})
    _bind(pattern, (q_len, kv_len), kwargs, params)
    mask_mod = pattern.fn(q_len, kv_len, **kwargs)
    return _mask_from_mod(mask_mod, q_len, kv_len, block, None, heads if pattern.per_head else None, device,
                          causal)


def from_layout(
    layout: torch.Tensor,
    block: int | tuple[int, int] = DEFAULT_BLOCK,
    q_len: int | None = None,
    kv_len: int | None = None,
    causal: bool = False,
) -> BlockMask:
    """A ``BlockMask`` from an explicit bool layout ``[n_q, n_kv]`` or ``[H, n_q, n_kv]``."""
    return BlockMask(layout, block, q_len, kv_len, causal)


def from_mask_mod(
    mask_mod: Callable[..., torch.Tensor],
    q_len: int,
    kv_len: int | None = None,
    *,
    block: int | tuple[int, int] = DEFAULT_BLOCK,
    batch: int | None = None,
    heads: int | None = None,
    device: torch.device | str | None = None,
) -> BlockMask:
    """A ``BlockMask`` from an element predicate ``mask_mod(b, h, q_idx, kv_idx) -> bool``
    (FlexAttention's signature; ``sparseflash.masks.functions`` lists what it may use).

    Every tile is classified by evaluating the predicate on its scores, a few tiles at a time on
    ``device`` (default: where the function's captured tensors are, else the CPU), never on all
    ``q_len x kv_len`` scores at once: tiles where it keeps nothing are never computed, tiles where it
    keeps everything are computed without evaluating it, the others evaluate it per score.
    ``batch``/``heads``: the function depends on ``b``/``h`` (None: it does not, and is evaluated
    with 0), giving a layout with a batch dimension of ``batch`` / ``heads`` heads.
    """
    q_len, kv_len, block, _, _ = _geometry(q_len, kv_len, block, batch=batch, heads=heads)
    if device is None:
        captured = trace(mask_mod, "mask_mod").captures
        device = next((t.device for t in captured if t.device.type != "cpu"), torch.device("cpu"))
    return _mask_from_mod(mask_mod, q_len, kv_len, block, batch, heads, device, False)


def _mask_from_mod(mask_mod, q_len: int, kv_len: int, block: tuple[int, int], batch: int | None,
                   heads: int | None, device, causal: bool) -> BlockMask:
    shape = ((batch,) if batch else ()) + (heads or 1, -(-q_len // block[0]), -(-kv_len // block[1]))
    layout = torch.ones(shape, dtype=torch.bool, device=device)
    return BlockMask(layout, block, q_len, kv_len, causal=causal, mask_mod=mask_mod)


def from_block_fn(
    fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    q_len: int,
    kv_len: int | None = None,
    block: int | tuple[int, int] = DEFAULT_BLOCK,
    heads: int | None = None,
    causal: bool = False,
) -> BlockMask:
    """A ``BlockMask`` from a predicate on block indices, called once on broadcast index tensors.

    ``fn(h, i, j)`` gets ``h [H,1,1]``, ``i [1,n_q,1]``, ``j [1,1,n_kv]`` (``H = heads or 1``) and
    returns a bool tensor broadcastable to ``[H, n_q, n_kv]``, e.g.
    ``from_block_fn(lambda h, i, j: (i - j).abs() <= 2, q_len=4096)``.
    """
    q_len, kv_len, block, n_q, n_kv = _geometry(q_len, kv_len, block, heads=heads)
    h = torch.arange(heads or 1)[:, None, None]
    i = torch.arange(n_q)[None, :, None]
    j = torch.arange(n_kv)[None, None, :]
    layout, shape = torch.as_tensor(fn(h, i, j)), (heads or 1, n_q, n_kv)
    try:
        fits = layout.dtype == torch.bool and torch.broadcast_shapes(layout.shape, shape) == shape
    except RuntimeError:  # shapes that do not broadcast
        fits = False
    if not fits:
        raise ValueError(f"fn must return a bool tensor broadcastable to {shape}; got {layout.dtype} "
                         f"{tuple(layout.shape)}")
    return BlockMask(layout.expand(shape).clone(), block, q_len, kv_len, causal)


# ---------------------------------------------------------------------------- built-in patterns
def _grid(n_q: int, n_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(n_q)[:, None], torch.arange(n_kv)[None, :]


def _generator(seed: int, head: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed) * 1_000_003 + int(head))


def _global(n_q: int, n_kv: int, global_blocks: int) -> torch.Tensor:
    """The first ``global_blocks`` rows and columns."""
    if global_blocks < 0:
        raise ValueError(f"global_blocks must be >= 0; got {global_blocks}")
    i, j = _grid(n_q, n_kv)
    return (i < global_blocks) | (j < global_blocks)


def _window(n_q: int, n_kv: int, window: int) -> torch.Tensor:
    if window < 0:
        raise ValueError(f"window must be >= 0 blocks; got {window}")
    i, j = _grid(n_q, n_kv)
    return (i - j).abs() <= window


@register("dense")
def dense(n_q: int, n_kv: int) -> torch.Tensor:
    """Every tile."""
    return torch.ones(n_q, n_kv, dtype=torch.bool)


@register("causal", causal=True)
def causal(n_q: int, n_kv: int) -> torch.Tensor:
    """Every tile, with the causal predicate (the mask drops tiles above the diagonal)."""
    return torch.ones(n_q, n_kv, dtype=torch.bool)


@register("butterfly")
def butterfly(n_q: int, n_kv: int, factors: int | None = None, global_blocks: int = 0) -> torch.Tensor:
    """Flat butterfly: tile (i, j) when ``j == i`` or ``i XOR j == 2**f`` for ``f < factors``.

    ``factors=None`` keeps every factor (``log2`` of the block count, rounded up); with ``n`` a
    power of two each row then has ``factors + 1`` tiles and the layout is symmetric.
    ``global_blocks`` adds that many global rows and columns."""
    n_factors = max(n_q, n_kv, 2).bit_length() if factors is None else int(factors)
    if n_factors < 0:
        raise ValueError(f"butterfly factors must be >= 0; got {factors}")
    i, j = _grid(n_q, n_kv)
    x = i ^ j
    is_power_of_two = (x > 0) & ((x & (x - 1)) == 0) & (x < (1 << n_factors))
    return (x == 0) | is_power_of_two | _global(n_q, n_kv, global_blocks)


@register("local")
def local(n_q: int, n_kv: int, window: int = 1) -> torch.Tensor:
    """Sliding window: tile (i, j) when ``|i - j| <= window`` (in blocks, on each side).

    With ``causal=True`` in ``make`` only the window's past half and the diagonal remain."""
    return _window(n_q, n_kv, window)


@register("fixed")
def fixed(n_q: int, n_kv: int, stride: int = 4, summary: int = 1) -> torch.Tensor:
    """Sparse Transformer "fixed": tiles in the query's own chunk of ``stride`` blocks, plus the
    last ``summary`` blocks of every chunk (the summary columns every query reads)."""
    if stride < 1 or not 1 <= summary <= stride:
        raise ValueError(f"fixed needs stride >= 1 and 1 <= summary <= stride; got {stride}, {summary}")
    i, j = _grid(n_q, n_kv)
    return (i // stride == j // stride) | (j % stride >= stride - summary)


@register("strided")
def strided(n_q: int, n_kv: int, stride: int = 4) -> torch.Tensor:
    """Sparse Transformer "strided": the ``stride`` - 1 blocks each side of the diagonal, plus every
    ``stride``-th block before and after it (with ``causal=True``, the paper's causal form)."""
    if stride < 1:
        raise ValueError(f"strided needs stride >= 1; got {stride}")
    i, j = _grid(n_q, n_kv)
    return ((i - j).abs() < stride) | ((i - j) % stride == 0)


@register("longformer")
def longformer(n_q: int, n_kv: int, window: int = 1, global_blocks: int = 1) -> torch.Tensor:
    """Sliding window of ``window`` blocks each side plus ``global_blocks`` global rows/columns."""
    return _window(n_q, n_kv, window) | _global(n_q, n_kv, global_blocks)


@register("bigbird")
def bigbird(
    n_q: int, n_kv: int, window: int = 1, global_blocks: int = 1, random_blocks: int = 2,
    seed: int = 0, head: int = 0,
) -> torch.Tensor:
    """BigBird: window + global + ``random_blocks`` seeded random tiles per row (per head)."""
    if random_blocks < 0:
        raise ValueError(f"bigbird random_blocks must be >= 0; got {random_blocks}")
    layout = _window(n_q, n_kv, window) | _global(n_q, n_kv, global_blocks)
    scores = torch.rand(n_q, n_kv, generator=_generator(seed, head))
    picks = scores.argsort(-1)[:, : min(random_blocks, n_kv)]
    return layout.scatter(1, picks, True)


@register("random")
def random(n_q: int, n_kv: int, density: float = 0.25, seed: int = 0, head: int = 0) -> torch.Tensor:
    """Seeded random tiles: ``round(density * n_kv)`` per row (at least 1), the diagonal kept."""
    if not 0.0 < density <= 1.0:
        raise ValueError(f"random density must be in (0, 1]; got {density}")
    per_row = max(1, round(density * n_kv))
    i, j = _grid(n_q, n_kv)
    scores = torch.rand(n_q, n_kv, generator=_generator(seed, head))
    scores = torch.where(i == j, torch.full_like(scores, -1.0), scores)  # the diagonal goes first
    picks = scores.argsort(-1)[:, :per_row]
    return torch.zeros(n_q, n_kv, dtype=torch.bool).scatter(1, picks, True)
