"""``torch.autograd.Function`` tying the Triton forward and backward kernels together."""

from __future__ import annotations

import torch

from sparseflash.attention.triton.backward import attention_backward
from sparseflash.attention.triton.forward import attention_forward
from sparseflash.attention.triton.plan import LaunchPlan
from sparseflash.masks import BlockMask


class TritonAttentionFunction(torch.autograd.Function):
    """Saves only ``q, k, v, o, lse`` (and key_lengths and the launch plan, which holds the mask's
    tables, as attributes)."""

    @staticmethod
    def forward(ctx, q, k, v, mask: BlockMask, key_lengths, scale: float):
        plan = LaunchPlan.of(q, k, mask, key_lengths is not None, scale)
        key_lengths = plan.key_lengths_arg(key_lengths)
        o, lse = attention_forward(q, k, v, key_lengths, plan)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.plan, ctx.key_lengths = plan, key_lengths
        ctx.set_materialize_grads(False)  # an unused lse gets dlse None, not a zero-filled tensor
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        if do is None:  # only lse was used
            do = torch.zeros_like(o)
        dq, dk, dv = attention_backward(q, k, v, o, lse, do, dlse, ctx.key_lengths, ctx.plan)
        return dq, dk, dv, None, None, None


def triton_attention(q, k, v, mask: BlockMask, key_lengths, scale: float):
    """``(o, lse)`` through the Triton kernels, differentiable in ``q, k, v``."""
    return TritonAttentionFunction.apply(q, k, v, mask, key_lengths, scale)
