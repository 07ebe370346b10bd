"""Adapters for the peers sparseflash is compared with: torch SDPA and FlexAttention.

Both take sparseflash's ``(q, k, v, mask)`` (``[B, H, S, D]`` tensors and a ``BlockMask``) and return
``o [B, H, S_q, D]`` in ``q.dtype``. They serve the benchmarks (``sparseflash.bench``) and may serve
tests as second opinions; they never import ``reference.py``.

- ``sdpa_attention``: ``torch.nn.functional.scaled_dot_product_attention``, dense and causal masks
  only (``mask.kind`` DENSE or CAUSAL; causal is top-left aligned, as ``is_causal=True``). ``kernel``
  pins one SDPA backend (``flash``, ``cudnn``, ``efficient``, ``math``) through
  ``torch.nn.attention.sdpa_kernel``; a kernel that cannot take the inputs raises ``Unsupported``.
- ``flex_attention``: ``torch.compile``'d ``flex_attention`` with a Flex ``BlockMask`` built from the
  same tables (``to_flex_block_mask``): every tile our mask computes in full is a Flex *full* block
  (``full_kv_num_blocks/full_kv_indices``: the kernel applies no ``mask_mod`` there); the tiles that
  need an element mask (a causal diagonal, the ragged last key tile) are *partial* blocks
  (``kv_num_blocks/kv_indices``). The ``mask_mod`` states the same mask element by element, as
  Flex's contract asks (its eager path ignores the block tables and reads only ``mask_mod``): none
  for DENSE, ``q_idx >= kv_idx`` for CAUSAL, a lookup in the block layout for SPARSE (and the mask's
  own mask_mod, the same Python function sparseflash compiles), and ``kv_idx < key_lengths[b]`` with
  padding (then the tables are each batch's: the blocks past its last key left out, those across it
  partial). The compiled kernel evaluates it on partial blocks only, so a mask of full blocks pays
  nothing for it. Mask blocks smaller than 128 (the LRA configs' 64) become 128-blocks, as
  ``create_block_mask``'s default BLOCK_SIZE makes them from the element mask: Flex's kernels take tiles of
  128 that must divide its blocks (its Triton template fails on 64-blocks with its default tiles). A
  ``score_mod`` is passed through as it is. ``backend="FLASH"`` runs Flex's FLASH backend,
  FlashAttention-4 (needs its package, ``flash_attn.cute``). Works with torch 2.6 and later.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from sparseflash.masks import BlockMask, MaskKind


class Unsupported(ValueError):
    """These inputs or this mask are outside what the peer can do (the benchmark records a skip)."""


# ---------------------------------------------------------------------------- torch SDPA


def _sdpa_context(kernel: str | None):
    if kernel is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
             "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}
    if kernel not in names:
        raise ValueError(f"SDPA kernel must be one of {', '.join(names)} or None; got {kernel!r}")
    if not hasattr(SDPBackend, names[kernel]):
        raise Unsupported(f"this torch ({torch.__version__}) has no SDPA {kernel} backend")
    return sdpa_kernel([getattr(SDPBackend, names[kernel])])


def sdpa_attention(
    q: torch.Tensor,  # (B, H, S_q, D)
    k: torch.Tensor,  # (B, H_kv, S_kv, D)
    v: torch.Tensor,  # (B, H_kv, S_kv, D)
    mask: BlockMask | None = None,
    key_lengths: torch.Tensor | None = None,  # (B,) int
    scale: float | None = None,
    kernel: str | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Attention through torch SDPA for a dense or causal ``mask`` (None = dense); ``dropout_p``: SDPA's
    dropout on the probabilities (FlashAttention-2's, in its flash kernel)."""
    kind = MaskKind.DENSE if mask is None else mask.kind
    if kind is MaskKind.SPARSE:
        raise Unsupported("torch SDPA takes only dense and causal masks (this one is block-sparse)")
    causal = kind is MaskKind.CAUSAL
    attn_mask = None
    if key_lengths is not None:  # padding: an explicit bool mask (flash and cuDNN then refuse)
        kv_idx = torch.arange(k.shape[2], device=q.device)
        attn_mask = (kv_idx[None, :] < key_lengths.to(q.device)[:, None])[:, None, None, :]
        if causal:
            q_idx = torch.arange(q.shape[2], device=q.device)
            attn_mask = attn_mask & (q_idx[:, None] >= kv_idx[None, :])
            causal = False
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    try:
        with _sdpa_context(kernel):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=causal, scale=scale, **gqa)
    except RuntimeError as err:
        if "No available kernel" in str(err):
            first = str(err).strip().splitlines()[0]
            raise Unsupported(f"SDPA {kernel or 'dispatch'} cannot run these inputs ({first})") from None
        raise


# ---------------------------------------------------------------------------- FlexAttention
def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _mask_mod(mask: BlockMask, layout: torch.Tensor, key_lengths: torch.Tensor | None):
    """The element-level predicate of ``mask`` (and padding) as a Flex ``mask_mod``, or None."""
    block_m, block_n = mask.block_size
    sparse = mask.kind is MaskKind.SPARSE
    layout = layout if layout.dim() == 4 else layout[None]  # (B_or_1, H_or_1, n_q, n_kv)
    one_batch, one_head = layout.shape[0] == 1, layout.shape[1] == 1
    own_mod = mask.mask_mod
    if not sparse and key_lengths is None:
        return _causal if mask.causal else None  # module-level functions: no recompiles
    # a shared batch or head dim is dropped, not indexed by a constant 0: Flex's FLASH backend
    # (CuTe DSL) fails on constant indices in a mask_mod
    table = layout[0] if one_batch else layout
    table = table.select(-3, 0) if one_head else table

    def mask_mod(b, h, q_idx, kv_idx):
        keep = kv_idx >= 0
        if sparse:
            keep = keep & table[(*(() if one_batch else (b,)), *(() if one_head else (h,)), q_idx // block_m,
                                 kv_idx // block_n)]
        if mask.causal:
            keep = keep & (q_idx >= kv_idx)
        if own_mod is not None:
            keep = keep & own_mod(b, h, q_idx, kv_idx)
        if key_lengths is not None:
            keep = keep & (kv_idx < key_lengths[b])
        return keep

    return mask_mod


FLEX_BLOCK = 128  # create_block_mask's default BLOCK_SIZE and Flex's kernel tiles


def _merged(layout: torch.Tensor, factors: tuple[int, int], reduce) -> torch.Tensor:
    """A bool ``[B, H, n_q, n_kv]`` block layout with each ``factors`` (rows, columns) of blocks merged into one by
    ``reduce`` (``torch.all`` or ``torch.any``); a last group that the sequence ends inside counts only its
    blocks."""
    rows, columns = factors
    pad = (0, -layout.shape[3] % columns, 0, -layout.shape[2] % rows)
    padded = torch.nn.functional.pad(layout.to(torch.uint8), pad, value=int(reduce is torch.all)).bool()
    grouped = padded.unflatten(3, (-1, columns)).unflatten(2, (-1, rows))  # [B, H, n_q', rows, n_kv', columns]
    return reduce(reduce(grouped, dim=5), dim=3)


def to_flex_block_mask(mask: BlockMask, device: torch.device | str, key_lengths: torch.Tensor | None = None):
    """A ``torch.nn.attention.flex_attention.BlockMask`` selecting the same scores as ``mask``.

    Tiles computed in full become Flex full blocks, the others partial blocks (see the module
    docstring); a block side that divides FLEX_BLOCK is merged up to it (a merged block is full where all of its
    blocks are, partial where some are computed). Tables are ``[B_or_1, H_or_1, n_q]`` /
    ``[B_or_1, H_or_1, n_q, n_kv]`` int32 (a shared batch and shared heads broadcast). With ``key_lengths``
    (padding) the tables are each batch's, as ``create_block_mask`` makes them from a mask_mod with
    ``kv_idx < key_lengths[b]``: the tiles wholly past a batch's last key are left out, those across it are
    partial, the full tiles before it stay full.
    """
    from torch.nn.attention.flex_attention import BlockMask as FlexBlockMask

    from sparseflash.masks import layout_to_tables

    device = torch.device(device)
    as_4d = (lambda x: x.to(device)) if mask.layout.dim() == 4 else (lambda x: x.to(device)[None])
    full, partial = as_4d(mask.full_layout), as_4d(mask.partial_layout)  # [B_or_1, H_or_1, n_q, n_kv]
    factors = tuple(FLEX_BLOCK // side if FLEX_BLOCK % side == 0 else 1 for side in mask.block_size)
    block_size = tuple(side * factor for side, factor in zip(mask.block_size, factors))
    if factors != (1, 1):
        full, computed = _merged(full, factors, torch.all), _merged(full | partial, factors, torch.any)
        partial = computed & ~full
    if key_lengths is not None:
        key_lengths = key_lengths.to(device)
        starts = torch.arange(full.shape[-1], device=device) * block_size[1]
        some = (starts < key_lengths[:, None])[:, None, None, :]  # [B, 1, 1, n_kv]: a key before the end
        whole = (starts + block_size[1] <= key_lengths[:, None])[:, None, None, :]  # every key before it
        computed = (full | partial) & some
        full = full & whole
        partial = computed & ~full
    mask_mod = _mask_mod(mask, mask.layout.to(device), key_lengths)
    return FlexBlockMask.from_kv_blocks(
        *layout_to_tables(partial), *layout_to_tables(full),
        BLOCK_SIZE=block_size, mask_mod=mask_mod, seq_lengths=(mask.q_len, mask.kv_len),
    )


def _raise_recompile_limit(limit: int = 64) -> None:
    """Many (mask_mod, grad mode, shape) combinations in one sweep: allow more recompiles."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):  # renamed in torch 2.7; keep both
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), limit))


@functools.lru_cache(maxsize=None)
def compiled_flex(dynamic: bool | None = None, backend: str = "TRITON"):
    """``torch.compile(flex_attention)``, one per ``dynamic`` setting (None: automatic) and Flex
    backend (``TRITON``, or ``FLASH`` for FlashAttention-4, compiled for static shapes)."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    _raise_recompile_limit()
    if backend == "FLASH":
        return torch.compile(functools.partial(flex, kernel_options={"BACKEND": "FLASH"}), dynamic=False)
    return torch.compile(flex, dynamic=dynamic)


FLASH_MISSING = "Flex's FLASH backend needs FlashAttention-4 (the flash_attn.cute package), which is not installed"


def flash_available() -> bool:
    """Whether Flex's FLASH backend can run here: FlashAttention-4's package is installed."""
    import importlib.util

    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ImportError:  # no flash_attn at all
        return False


def flex_attention(
    q: torch.Tensor,  # (B, H, S_q, D)
    k: torch.Tensor,  # (B, H_kv, S_kv, D)
    v: torch.Tensor,  # (B, H_kv, S_kv, D)
    mask: BlockMask | None = None,
    key_lengths: torch.Tensor | None = None,  # (B,) int
    scale: float | None = None,
    *,
    block_mask=None,
    compile: bool = True,
    dynamic: bool | None = None,
    score_mod=None,
    backend: str = "TRITON",
) -> torch.Tensor:
    """Attention through FlexAttention. Pass a prebuilt ``block_mask`` (``to_flex_block_mask``) to keep
    its construction out of a timed loop; ``compile=False`` runs the eager (unfused) path;
    ``backend="FLASH"`` Flex's FlashAttention-4 backend (``Unsupported`` where it is not installed)."""
    if backend not in ("TRITON", "FLASH"):
        raise ValueError(f"Flex backend must be TRITON or FLASH; got {backend!r}")
    if backend == "FLASH" and not flash_available():
        raise Unsupported(FLASH_MISSING)
    if mask is None:
        from sparseflash.masks import make

        mask = make("dense", q.shape[2], k.shape[2])
    if block_mask is None:
        block_mask = to_flex_block_mask(mask, q.device, key_lengths)
    if compile:
        fn = compiled_flex(dynamic, backend)
    else:
        from torch.nn.attention.flex_attention import flex_attention as fn
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    return fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, **gqa)
