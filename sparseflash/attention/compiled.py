"""What torch.compile sees of the attention backends: two custom ops (``torch.library``).

Dynamo cannot trace the ``triton`` and ``blocked`` backends' host code (block tables read on the host,
kernel launches), nor build a mask whose mask_mod is classified per tile, so under torch.compile
``attention`` calls ``sparseflash::attention_forward`` for every backend, and its autograd calls
``sparseflash::attention_backward``. The ops take tensors, numbers and strings only:

- the mask as ``BlockMask.parts()``: its tensors, its mask_mod's captured tensors, and a string of the
  rest (block size, lengths, causal, the mask_mod's graph); or a ``MaskSpec``'s key (a mask given by name,
  or by a ``SparseAttention`` config), which the op builds once per shape, outside the graph;
- the score function as its traced graph's captured tensors and text (``Graph.key``);
- dropout as its probability and seed tensor (drawn in the graph, from torch's generator; None without);

so a new BlockMask of the same shapes and functions, or a score function whose tensors changed, is a
new input to the same compiled graph, not a recompile, and a captured tensor that requires grad gets
its gradient. Inside the ops the backends run as they do eagerly, on a mask rebuilt from its parts
once per layout tensor (a mask reused across steps is rebuilt once, and keeps its launch plans).
The ``reference`` and ``standard`` backends' backward is ``torch.func.vjp`` of their forward.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from sparseflash.attention.api import built_mask
from sparseflash.attention.blocked import blocked_backward, blocked_forward
from sparseflash.attention.dropout import Dropout
from sparseflash.attention.reference import reference_attention
from sparseflash.masks import BlockMask, MaskSpec
from sparseflash.masks.functions import Graph, trace, trained_flags

# layout tensor -> (identities of the other parts, the mask rebuilt from them, where the parts live); dies
# with the layout
_MASKS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _triton_forward(q, k, v, mask, key_lengths, scale, score_graph, dropout):
    from sparseflash.attention.triton.op import triton_forward  # imports triton only when used
    from sparseflash.attention.triton.plan import LaunchPlan

    plan = LaunchPlan.of(q, k, mask, key_lengths is not None, scale, score_graph, dropout is not None)
    return triton_forward(q, k, v, plan, key_lengths, score_graph, dropout)


def _triton_backward(q, k, v, o, lse, do, dlse, mask, key_lengths, scale, score_graph, dropout):
    from sparseflash.attention.triton.op import triton_backward
    from sparseflash.attention.triton.plan import LaunchPlan

    plan = LaunchPlan.of(q, k, mask, key_lengths is not None, scale, score_graph, dropout is not None)
    return triton_backward(q, k, v, o, lse, do, dlse, plan, key_lengths, score_graph, dropout)


def _reference_forward(q, k, v, mask, key_lengths, scale, score_graph, dropout, *, upcast=True):
    return reference_attention(q, k, v, mask, key_lengths, scale, score_graph.evaluate if score_graph else None,
                               dropout, upcast=upcast)


def _reference_backward(q, k, v, o, lse, do, dlse, mask, key_lengths, scale, score_graph, dropout, *, upcast=True):
    """The reference's gradients by ``torch.func.vjp`` (autograd records nothing inside a custom op)."""
    def run(q, k, v, *trained):
        return reference_attention(q, k, v, mask, key_lengths, scale,
                                   score_graph.with_trained(trained) if score_graph else None, dropout,
                                   upcast=upcast)

    trained = [t.detach() for t in score_graph.trained] if score_graph else []
    _, vjp = torch.func.vjp(run, q, k, v, *trained)
    dq, dk, dv, *grads = vjp((do, torch.zeros_like(lse) if dlse is None else dlse))
    return dq, dk, dv, grads


FORWARD = {"triton": _triton_forward, "blocked": blocked_forward, "reference": _reference_forward,
           "standard": functools.partial(_reference_forward, upcast=False)}
BACKWARD = {"triton": _triton_backward, "blocked": blocked_backward, "reference": _reference_backward,
            "standard": functools.partial(_reference_backward, upcast=False)}


def _parts(mask: BlockMask | MaskSpec) -> tuple[list, list, str]:
    """``mask.parts()``, or for a MaskSpec its key (the op builds it for the inputs' shapes, once)."""
    if isinstance(mask, MaskSpec):
        return [], [], mask.key
    return mask.parts()


def _mask(tensors: list[torch.Tensor], captures: list[torch.Tensor], spec: str, q, k) -> BlockMask:
    """The mask of ``_parts``: built from its MaskSpec for q and k, or rebuilt once per layout tensor and
    parts."""
    if not tensors:
        return built_mask(MaskSpec.from_key(spec), q.shape[2], k.shape[2], q.shape[1], q.device)
    identity = (tuple(id(t) for t in tensors[1:]), tuple(id(t) for t in captures), spec)
    held = _MASKS.get(tensors[0])
    if held is None or held[0] != identity:
        memory = _memory(tensors, captures, spec)
        if tensors[0].is_cuda and torch.cuda.is_current_stream_capturing():
            # A capture may hand the op other tensor objects over the memory the warm-up call saw (static
            # tensors): that mask's, held. Anything else would be derived on the host, which a capture cannot
            # wait for.
            held = next((entry for entry in _MASKS.values() if entry[2] == memory), None)
            if held is None:
                raise RuntimeError(
                    "a BlockMask met for the first time inside a CUDA graph capture: its tables are derived on "
                    "the host, which a capture cannot wait for. Under torch.compile(mode='reduce-overhead'), give "
                    "the mask by name or as a MaskSpec, or mark its tensors static before the first call: "
                    "for t in (*mask.parts()[0], *mask.parts()[1]): torch._dynamo.mark_static_address(t)")
            return held[1]
        held = _MASKS[tensors[0]] = (identity, BlockMask.from_parts(tensors, captures, spec), memory)
    return held[1]


def _memory(tensors: list[torch.Tensor], captures: list[torch.Tensor], spec: str) -> tuple:
    """Where a mask's parts live (addresses, shapes, strides, dtypes) and its spec: what identifies it
    inside a CUDA graph capture, whose inputs are static there."""
    return tuple((t.data_ptr(), t.shape, t.stride(), t.dtype) for t in (*tensors, *captures)), spec


def _score_graph(captures: list[torch.Tensor], key: str) -> Graph | None:
    return Graph.parse(key, captures) if key else None


def _dropout(p: float, seed: torch.Tensor | None) -> Dropout | None:
    return None if seed is None else Dropout(p, seed)


@torch.library.custom_op("sparseflash::attention_forward", mutates_args=())
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_tensors: list[torch.Tensor],
                      mask_captures: list[torch.Tensor], key_lengths: Optional[torch.Tensor],
                      score_captures: list[torch.Tensor], scale: float, mask_spec: str, score_key: str,
                      backend: str, dropout_p: float, dropout_seed: Optional[torch.Tensor]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` of ``backend`` (a key of ``FORWARD``)."""
    mask = _mask(mask_tensors, mask_captures, mask_spec, q, k)
    o, lse = FORWARD[backend](q, k, v, mask, key_lengths, scale, _score_graph(score_captures, score_key),
                              _dropout(dropout_p, dropout_seed))
    return o.contiguous(), lse.contiguous()  # what the fake returns: later views depend on the strides


@attention_forward.register_fake
def _(q, k, v, mask_tensors, mask_captures, key_lengths, score_captures, scale, mask_spec, score_key, backend,
      dropout_p, dropout_seed):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("sparseflash::attention_backward", mutates_args=())
def attention_backward(do: Optional[torch.Tensor], dlse: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, mask_tensors: list[torch.Tensor],
                       mask_captures: list[torch.Tensor], key_lengths: Optional[torch.Tensor],
                       score_captures: list[torch.Tensor], scale: float, mask_spec: str, score_key: str,
                       backend: str, dropout_p: float, dropout_seed: Optional[torch.Tensor]
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """``dq, dk, dv`` and the gradients of the score function's captured tensors that require grad."""
    mask = _mask(mask_tensors, mask_captures, mask_spec, q, k)
    do = torch.zeros_like(o) if do is None else do
    dq, dk, dv, grads = BACKWARD[backend](q, k, v, o, lse, do, dlse, mask, key_lengths, scale,
                                          _score_graph(score_captures, score_key), _dropout(dropout_p, dropout_seed))
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), [g.contiguous() for g in grads]


@attention_backward.register_fake
def _(do, dlse, q, k, v, o, lse, mask_tensors, mask_captures, key_lengths, score_captures, scale, mask_spec,
      score_key, backend, dropout_p, dropout_seed):
    flags = trained_flags(score_key)
    grads = [t.new_empty(t.shape) for t, flag in zip(score_captures, flags) if flag]
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), grads


def _setup_context(ctx, inputs, output):
    (q, k, v, mask_tensors, mask_captures, key_lengths, score_captures, scale, mask_spec, score_key, backend,
     dropout_p, dropout_seed) = inputs
    o, lse = output
    optional = [t for t in (key_lengths, dropout_seed) if t is not None]
    ctx.counts = (len(mask_tensors), len(mask_captures), len(score_captures), key_lengths is not None,
                  dropout_seed is not None)
    ctx.save_for_backward(q, k, v, o, lse, *mask_tensors, *mask_captures, *score_captures, *optional)
    ctx.statics = (scale, mask_spec, score_key, backend, dropout_p)


def _backward(ctx, do, dlse):
    q, k, v, o, lse, *rest = ctx.saved_tensors
    n_tensors, n_mask_captures, n_score_captures, has_key_lengths, has_dropout = ctx.counts
    mask_tensors, rest = rest[:n_tensors], rest[n_tensors:]
    mask_captures, rest = rest[:n_mask_captures], rest[n_mask_captures:]
    score_captures, rest = rest[:n_score_captures], rest[n_score_captures:]
    key_lengths, rest = (rest[0], rest[1:]) if has_key_lengths else (None, rest)
    dropout_seed = rest[0] if has_dropout else None
    scale, mask_spec, score_key, backend, dropout_p = ctx.statics
    dq, dk, dv, grads = attention_backward(do, dlse, q, k, v, o, lse, mask_tensors, mask_captures, key_lengths,
                                           score_captures, scale, mask_spec, score_key, backend, dropout_p,
                                           dropout_seed)
    flags = trained_flags(score_key)
    grads = iter(grads)
    score_grads = [next(grads) if flag else None for flag in flags]
    return (dq, dk, dv, [None] * n_tensors, [None] * n_mask_captures, None, score_grads, None, None, None,
            None, None, None)


attention_forward.register_autograd(_backward, setup_context=_setup_context)


def compiled_attention(q, k, v, mask: BlockMask | MaskSpec, key_lengths, scale: float, score_mod, backend: str,
                       dropout_p: float = 0.0, dropout_seed: torch.Tensor | None = None):
    """``(o, lse)`` of ``backend`` through the custom ops: what ``attention`` calls under torch.compile.
    ``mask``: a BlockMask, or a MaskSpec that the op builds for the inputs; ``dropout_seed``: the
    ``Dropout`` seed where ``dropout_p > 0``."""
    score_graph = trace(score_mod, "score_mod") if score_mod is not None else None
    mask_tensors, mask_captures, mask_spec = _parts(mask)
    return attention_forward(q, k, v, mask_tensors, mask_captures, key_lengths,
                             [] if score_graph is None else list(score_graph.captures), float(scale), mask_spec,
                             "" if score_graph is None else score_graph.key(), backend, float(dropout_p),
                             dropout_seed)
