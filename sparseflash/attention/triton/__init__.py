"""Triton FlashAttention-2 kernels specialised for DENSE, CAUSAL and SPARSE block masks."""

from sparseflash.attention.triton.op import triton_attention

__all__ = ["triton_attention"]
