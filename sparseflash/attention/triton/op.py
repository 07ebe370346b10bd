"""The Triton kernels as functions of a mask and a traced score function, and the ``torch.autograd.Function``
that ties them together in eager mode (``sparseflash.attention.compiled`` ties them under torch.compile)."""

from __future__ import annotations

import torch

from sparseflash.attention.dropout import Dropout
from sparseflash.attention.triton.backward import attention_backward, compile_backward_ahead
from sparseflash.attention.triton.forward import attention_forward, compile_forward_ahead
from sparseflash.attention.triton.launch import interpreting
from sparseflash.attention.triton.plan import LaunchPlan
from sparseflash.masks import BlockMask
from sparseflash.masks.functions import Graph, trace


def triton_forward(q, k, v, plan: LaunchPlan, key_lengths, score_graph: Graph | None, dropout: Dropout | None = None):
    """``(o, lse)``; ``plan``: ``LaunchPlan.of`` the inputs (with dropout where ``dropout`` is given);
    ``score_graph``: the traced score function, or None."""
    return attention_forward(q, k, v, plan.key_lengths_arg(key_lengths), plan, plan.captures(score_graph), dropout)


def triton_backward(q, k, v, o, lse, do, dlse, plan: LaunchPlan, key_lengths, score_graph: Graph | None,
                    dropout: Dropout | None = None):
    """``dq, dk, dv`` and the gradients of the score function's captured tensors that require grad, in slot
    order, in their dtypes. ``do`` None: only lse was used; ``dropout``: the forward's."""
    captures = plan.captures(score_graph)
    dq, dk, dv, grads = attention_backward(q, k, v, o, lse, torch.zeros_like(o) if do is None else do, dlse,
                                           plan.key_lengths_arg(key_lengths), plan, captures, dropout)
    score_part = slice(len(plan.mask_captures), None)  # a mask_mod's captured tensors get no gradient
    return dq, dk, dv, [g.to(t.dtype) for g, t in zip(grads[score_part], captures[score_part]) if g is not None]


def compile_ahead(q, k, v, plan: LaunchPlan, key_lengths, score_graph: Graph | None, backward: bool) -> None:
    """On the first call of a plan with these layouts, start compiling the forward kernels (and with
    ``backward`` the backward's) in child processes, so that they compile at once, not one after the
    other. Only on the GPU."""
    if interpreting() or q.device.type != "cuda":
        return
    seen = plan.per_layout.setdefault("compiled_ahead", set())
    layout = (q.stride(), k.stride(), v.stride(), backward)
    if layout in seen:
        return
    seen.add(layout)
    captures, lengths = plan.captures(score_graph), plan.key_lengths_arg(key_lengths)
    compile_forward_ahead(q, k, v, lengths, plan, captures)  # first: the call waits for it
    if backward:
        compile_backward_ahead(q, k, v, lengths, plan, captures)


class TritonAttentionFunction(torch.autograd.Function):
    """Saves only ``q, k, v, o, lse`` (and key_lengths, the launch plan, the score graph and the dropout
    seed as attributes). The captured tensors of the score function that require grad are inputs too, so
    that they get their gradients."""

    @staticmethod
    def forward(ctx, q, k, v, plan, key_lengths, score_graph, dropout, *trained):
        if key_lengths is not None:  # as the kernels read them, once for both passes (an int64 copy: a launch each)
            key_lengths = plan.key_lengths_arg(key_lengths)
        o, lse = triton_forward(q, k, v, plan, key_lengths, score_graph, dropout)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.plan, ctx.key_lengths, ctx.score_graph, ctx.dropout = plan, key_lengths, score_graph, dropout
        ctx.set_materialize_grads(False)  # an unused lse gets dlse None, not a zero-filled tensor
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv, capture_grads = triton_backward(q, k, v, o, lse, do, dlse, ctx.plan, ctx.key_lengths,
                                                    ctx.score_graph, ctx.dropout)
        return dq, dk, dv, None, None, None, None, *capture_grads


def triton_attention(q, k, v, mask: BlockMask, key_lengths, scale: float, score_mod=None,
                     dropout: Dropout | None = None):
    """``(o, lse)`` through the Triton kernels, differentiable in ``q, k, v`` and in the tensors ``score_mod``
    captures; ``dropout``: drop probabilities with it, or None."""
    score_graph = trace(score_mod, "score_mod") if score_mod is not None else None
    plan = LaunchPlan.of(q, k, mask, key_lengths is not None, scale, score_graph, dropout is not None)
    trained = score_graph.trained if score_graph is not None else []
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *trained))
    compile_ahead(q, k, v, plan, key_lengths, score_graph, needs_grad)
    if not needs_grad:  # no graph to record: the autograd Function would only cost host time (~10 µs a call)
        return triton_forward(q, k, v, plan, key_lengths, score_graph, dropout)
    return TritonAttentionFunction.apply(q, k, v, plan, key_lengths, score_graph, dropout, *trained)
