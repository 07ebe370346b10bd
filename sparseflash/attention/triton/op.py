"""``torch.autograd.Function`` tying the Triton forward and backward kernels together."""

from __future__ import annotations

import torch

from sparseflash.attention.triton.backward import attention_backward
from sparseflash.attention.triton.forward import attention_forward
from sparseflash.attention.triton.plan import LaunchPlan
from sparseflash.masks import BlockMask
from sparseflash.masks.functions import trace


class TritonAttentionFunction(torch.autograd.Function):
    """Saves only ``q, k, v, o, lse`` (and key_lengths and the launch plan, which holds the mask's
    tables, as attributes). The tensors captured by the mask and score functions are inputs too, so
    that those that require grad get their gradients."""

    @staticmethod
    def forward(ctx, q, k, v, plan: LaunchPlan, key_lengths, *captures):
        key_lengths = plan.key_lengths_arg(key_lengths)
        o, lse = attention_forward(q, k, v, key_lengths, plan, captures)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.plan, ctx.key_lengths, ctx.captures = plan, key_lengths, captures
        ctx.set_materialize_grads(False)  # an unused lse gets dlse None, not a zero-filled tensor
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        if do is None:  # only lse was used
            do = torch.zeros_like(o)
        dq, dk, dv, capture_grads = attention_backward(q, k, v, o, lse, do, dlse, ctx.key_lengths, ctx.plan,
                                                       ctx.captures)
        capture_grads = [None if g is None else g.to(t.dtype) for g, t in zip(capture_grads, ctx.captures)]
        return dq, dk, dv, None, None, *capture_grads


def triton_attention(q, k, v, mask: BlockMask, key_lengths, scale: float, score_mod=None):
    """``(o, lse)`` through the Triton kernels, differentiable in ``q, k, v`` and in the tensors the
    mask's mask_mod and ``score_mod`` capture."""
    score_graph = trace(score_mod, "score_mod") if score_mod is not None else None
    plan = LaunchPlan.of(q, k, mask, key_lengths is not None, scale, score_graph)
    return TritonAttentionFunction.apply(q, k, v, plan, key_lengths, *plan.captures(score_graph))
