"""``attention(q, k, v, mask, ...)``: checks its inputs, resolves the mask and picks a backend."""

from __future__ import annotations

import functools
import math
from typing import Callable, Union

import torch

from sparseflash.attention.blocked import blocked_attention
from sparseflash.attention.dropout import Dropout, check_p, draw_seed
from sparseflash.attention.kept_tensors import made_outside_graph_pools
from sparseflash.attention.reference import reference_attention
from sparseflash.masks import DEFAULT_BLOCK, BlockMask, MaskSpec
from sparseflash.masks.functions import trace

MaskArg = Union[None, str, BlockMask, MaskSpec]
Backend = Callable[..., tuple[torch.Tensor, torch.Tensor]]

# made once: torch.compile traces mask_spec, and cannot trace a MaskSpec's construction (json)
STANDARD_MASKS = {name: MaskSpec(name, block=DEFAULT_BLOCK) for name in ("dense", "causal")}
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def _triton_attention(q, k, v, mask, key_lengths, scale, score_mod, dropout):
    from sparseflash.attention.triton import triton_attention  # imports triton only when used

    return triton_attention(q, k, v, mask, key_lengths, scale, score_mod, dropout)


BACKENDS: dict[str, Backend] = {
    "triton": _triton_attention,
    "reference": reference_attention,
    "blocked": blocked_attention,
    # a plain Transformer's attention (materialised scores in the inputs' dtype): the speed baseline
    "standard": functools.partial(reference_attention, upcast=False),
}


def resolve_backend(backend: str, device: torch.device) -> str:
    """The concrete backend name: ``auto`` is ``triton`` on CUDA and ``blocked`` elsewhere."""
    if backend == "auto":
        return "triton" if device.type == "cuda" else "blocked"
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of: auto, {', '.join(BACKENDS)}")
    if backend == "triton" and device.type != "cuda":
        from sparseflash.attention.triton.launch import interpreting  # imports triton only when used

        if not interpreting():  # (its launches would hand the GPU the CPU's addresses)
            raise ValueError(f"backend 'triton' runs on CUDA tensors, or on the CPU under Triton's interpreter "
                             f"(TRITON_INTERPRET=1, slow); got tensors on {device}")
    return backend


@functools.lru_cache(maxsize=64)
def _built_mask(key: str, q_len: int, kv_len: int, heads: int | None, device: str) -> BlockMask:
    spec = MaskSpec.from_key(key)
    if spec.pattern in STANDARD_MASKS and torch.device(device).type == "cuda":
        # a decoding loop over a growing cache meets a new length each step: built on the CPU, where reading
        # its kind and row density syncs nothing, a standard mask costs the GPU two small copies
        mask = spec.build(q_len, kv_len, heads=heads)
        mask.kind, mask.mean_row_blocks  # noqa: B018 (computed and kept by the properties; .to() keeps them)
        return made_outside_graph_pools(lambda: mask.to(device), torch.device(device))
    return made_outside_graph_pools(lambda: spec.build(q_len, kv_len, heads=heads, device=device),
                                    torch.device(device))


def built_mask(spec: MaskSpec, q_len: int, kv_len: int, heads: int, device: torch.device | str) -> BlockMask:
    """``spec``'s mask for these lengths (and heads, for a per-head spec) on ``device``, built once (the 64
    most recent are kept)."""
    return _built_mask(spec.key, q_len, kv_len, heads if spec.per_head else None, str(device))


def mask_spec(mask: None | str | MaskSpec) -> MaskSpec:
    """``None`` -> dense, ``"dense"`` and ``"causal"`` (block DEFAULT_BLOCK), a MaskSpec as it is; any other
    string is an error."""
    if isinstance(mask, MaskSpec):
        return mask
    if mask is not None and mask not in STANDARD_MASKS:
        raise ValueError(
            f"mask must be None, 'causal', a BlockMask or a MaskSpec; got the string {mask!r} "
            f"(build other patterns with sparseflash.masks.make({mask!r}, ...))"
        )
    return STANDARD_MASKS[mask or "dense"]


def resolve_mask(mask: MaskArg, q_len: int, kv_len: int, heads: int, kv_heads: int | None = None,
                 device: torch.device | str = "cpu") -> BlockMask:
    """``None`` (dense), ``"causal"``, a ``MaskSpec`` (built on ``device``) or a ``BlockMask`` -> a ``BlockMask``
    checked against the shapes (``kv_heads``, when given, lets the error spot inputs passed as (B, S, H, D))."""
    if mask is None or isinstance(mask, (str, MaskSpec)):
        return built_mask(mask_spec(mask), q_len, kv_len, heads, device)
    if not isinstance(mask, BlockMask):
        raise ValueError(f"mask must be None, 'causal', a BlockMask or a MaskSpec; got {type(mask).__name__}")
    if (mask.q_len, mask.kv_len) != (q_len, kv_len):
        hint = ""
        if (mask.q_len, mask.kv_len) == (heads, kv_heads):
            hint = ("; the inputs look like (B, S, H, D): attention takes (B, H, S, D), "
                    "e.g. q.transpose(1, 2)")
        raise ValueError(
            f"mask was built for q_len={mask.q_len}, kv_len={mask.kv_len}; "
            f"the inputs have S_q={q_len}, S_kv={kv_len}{hint}"
        )
    if mask.num_heads not in (1, heads):
        raise ValueError(f"mask has {mask.num_heads} heads; expected 1 or H={heads}")
    return mask


AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps")  # checked by name: torch.compile (torch 2.11) cannot trace
# torch.amp.is_autocast_available


def _autocast_dtype(q) -> torch.dtype | None:
    """The autocast dtype if autocast is on for q's device, else None."""
    if not isinstance(q, torch.Tensor) or q.device.type not in AUTOCAST_DEVICES:
        return None
    return torch.get_autocast_dtype(q.device.type) if torch.is_autocast_enabled(q.device.type) else None


def _check_inputs(q, k, v, key_lengths, scale) -> float:
    """Raise ValueError on malformed inputs; return the softmax scale."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, S, D]; got shape {tuple(x.shape)}")
        if x.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} must be float16, bfloat16 or float32; got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    (batch, heads, _, dim), (kb, kv_heads, kv_len, kd) = q.shape, k.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape [B, H_kv, S_kv, D]; got {tuple(k.shape)} and {tuple(v.shape)}")
    if kb != batch:
        raise ValueError(f"batch sizes differ: q has B={batch}, k and v have B={kb}")
    if batch < 1 or heads < 1:
        raise ValueError(f"B and H must be >= 1; got B={batch}, H={heads}")
    if q.shape[2] < 1 or kv_len < 1:
        raise ValueError(f"S_q and S_kv must be >= 1; got S_q={q.shape[2]}, S_kv={kv_len}")
    if kd != dim:
        raise ValueError(f"head_dim differs: q has D={dim}, k and v have D={kd}")
    if not 1 <= dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in 1..{MAX_HEAD_DIM}; got {dim}")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"q heads must be a multiple of k/v heads (GQA); got H={heads}, H_kv={kv_heads}")
    if key_lengths is not None:
        if not isinstance(key_lengths, torch.Tensor) or key_lengths.shape != (batch,) or (
            key_lengths.dtype.is_floating_point or key_lengths.dtype == torch.bool
        ):
            got = (f"{key_lengths.dtype} {tuple(key_lengths.shape)}" if isinstance(key_lengths, torch.Tensor)
                   else type(key_lengths).__name__)
            raise ValueError(f"key_lengths must be an integer tensor of shape ({batch},); got {got}")
        if key_lengths.device != q.device:
            raise ValueError(f"key_lengths must be on {q.device}; got {key_lengths.device}")
        # On the CPU the values are checked too; on a GPU that would cost a device sync per call.
        if key_lengths.device.type == "cpu" and not torch.compiler.is_compiling() and not (
                0 <= int(key_lengths.min()) and int(key_lengths.max()) <= kv_len):
            raise ValueError(f"key_lengths must lie in [0, S_kv={kv_len}]; got {key_lengths.tolist()}")
    if scale is None:
        return 1.0 / math.sqrt(dim)
    if isinstance(scale, bool) or not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number or None; got {scale!r}")
    return float(scale)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: MaskArg = None,
    *,
    score_mod: Callable | None = None,
    key_lengths: torch.Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    return_lse: bool = False,
):
    """Exact softmax attention restricted to a mask.

    Args:
        q: ``(B, H, S_q, D)``; k, v: ``(B, H_kv, S_kv, D)`` with ``H % H_kv == 0`` (GQA), one
            dtype (float16, bfloat16 or float32) and device; ``1 <= D <= 256``.
        mask: ``None`` (dense), ``"causal"``, a ``BlockMask`` built for ``(S_q, S_kv)`` with
            1 or H heads (and 1 or B batch elements), possibly with an element predicate
            (``masks.from_mask_mod``), or a ``MaskSpec`` (built for the inputs' lengths once and kept).
            Causal masks align at the top left: query ``i`` sees keys ``<= i``.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` (FlexAttention's signature),
            applied to every kept score ``scale * q.k`` (fp32) before the softmax, and differentiated
            in the backward, its captured tensors that require grad included
            (``sparseflash.masks.functions`` lists what it may use).
        key_lengths: optional int ``(B,)`` with values in ``[0, S_kv]``; keys at index
            ``>= key_lengths[b]`` are masked (checked on the CPU; not on a GPU, where it would sync).
        scale: softmax scale, default ``1/sqrt(D)``.
        dropout_p: drop each normalised probability with this chance (in [0, 1), rounded to a multiple
            of 1/256, so 0 or more than 1/512) and scale the kept ones by the inverse of the chance of
            being kept, in the kernels, with a seed drawn from torch's generator of the inputs' device
            (``torch.manual_seed`` repeats it; ``sparseflash.attention.dropout`` states the pattern,
            which every backend shares). Always applied when given: pass 0 outside training.
        backend: ``auto`` (``triton`` on CUDA, ``blocked`` elsewhere), ``triton``, ``blocked``,
            ``reference`` or ``standard`` (what a plain Transformer computes: the whole score matrix
            in the inputs' dtype, the softmax in fp32; the baseline the kernels are timed against).
        return_lse: also return the log-sum-exp of the kept scores.

    Returns:
        ``o (B, H, S_q, D)`` in the dtype of ``q``, and with ``return_lse`` also
        ``lse (B, H, S_q)`` fp32. A query that keeps no score gets ``o = 0``, ``lse = -inf``.

    Under ``torch.autocast``, as with SDPA, q, k and v are cast to the autocast dtype and each
    backend then keeps its own precision (the reference and blocked backends compute in fp32).
    """
    dtype = _autocast_dtype(q)
    if dtype is not None:
        q, k, v = (x.to(dtype) if isinstance(x, torch.Tensor) else x for x in (q, k, v))
        with torch.autocast(q.device.type, enabled=False):
            return attention(q, k, v, mask, score_mod=score_mod, key_lengths=key_lengths, scale=scale,
                             dropout_p=dropout_p, backend=backend, return_lse=return_lse)
    scale = _check_inputs(q, k, v, key_lengths, scale)
    dropout_p = check_p(dropout_p)
    name = resolve_backend(backend, q.device)
    # Under torch.compile the backends are custom ops (sparseflash.attention.compiled); a mask given by name
    # or MaskSpec goes in as its spec, built once outside the graph.
    as_op = torch.compiler.is_compiling()
    if as_op and (mask is None or isinstance(mask, (str, MaskSpec))):
        mask = mask_spec(mask)
    else:
        mask = resolve_mask(mask, q.shape[2], k.shape[2], q.shape[1], k.shape[1], q.device)
        if mask.num_batches not in (1, q.shape[0]):
            raise ValueError(f"mask has {mask.num_batches} batch elements; expected 1 or B={q.shape[0]}")
        mask.check_shared_dims(q.shape[0], q.shape[1])
    if score_mod is not None and name in ("reference", "standard"):  # the others trace it themselves
        trace(score_mod, "score_mod")  # a function the kernels cannot run fails on every backend
    seed = draw_seed(q.device) if dropout_p > 0 else None
    if as_op:
        from sparseflash.attention.compiled import compiled_attention

        o, lse = compiled_attention(q, k, v, mask, key_lengths, scale, score_mod, name, dropout_p, seed)
    else:
        o, lse = BACKENDS[name](q, k, v, mask, key_lengths, scale, score_mod,
                                None if seed is None else Dropout(dropout_p, seed))
    return (o, lse) if return_lse else o
