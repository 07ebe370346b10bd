"""The backends a sweep can time, by harness name.

Each entry says when it cannot run a case (``skip_reason``: a peer without that mask, score
function or dropout, CUDA-only on CPU, too much memory) and builds, once per case, a zero-argument forward
``fn() -> o`` so that per-case set-up (a Flex block mask) stays out of the timed loop. A padded batch's
``key_lengths`` (``(B,)``) come as a keyword, which each passes on as its own API takes them (a builder without
it runs sweeps without padding). Add an entry to ``REGISTRY`` to
time another implementation (the tests add a deliberately wrong one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from sparseflash.attention import attention, resolve_backend
from sparseflash.attention import baselines
from sparseflash.masks import BlockMask, MaskKind

Builder = Callable[..., Callable[[], torch.Tensor]]


def reference_bytes(batch: int, heads: int, q_len: int, kv_len: int) -> float:
    """Rough memory of the reference (fp32 scores, probabilities and a temporary: ~3 score matrices)."""
    return 3.0 * 4 * batch * heads * q_len * kv_len


@dataclass(frozen=True)
class Context:
    """What a backend may need besides the tensors."""

    device: torch.device
    reference_max_gb: float = 8.0
    flex_dynamic: Optional[bool] = None


@dataclass(frozen=True)
class HarnessBackend:
    name: str
    build: Builder  # (q, k, v, mask, ctx, score_mod, dropout_p[, key_lengths=]) -> fn() -> o
    impl: Callable[[torch.device], str]  # what actually runs (e.g. "auto" -> "blocked" on CPU)
    cuda_only: str = ""  # non-empty: the reason it is skipped off CUDA
    dense_causal_only: bool = False  # and no score function
    extra_skip: Optional[Callable[..., Optional[str]]] = None  # (q, mask, ctx) -> reason or None
    no_dropout: str = ""  # non-empty: the reason it is skipped for a case with dropout

    def skip_reason(self, q: torch.Tensor, mask: BlockMask, ctx: Context, score_mod=None,
                    dropout_p: float = 0.0) -> Optional[str]:
        if self.cuda_only and ctx.device.type != "cuda":
            return self.cuda_only
        if self.no_dropout and dropout_p:
            return self.no_dropout
        if self.dense_causal_only and mask.kind is MaskKind.SPARSE:
            return f"{self.name} takes only dense and causal masks (this one is block-sparse or element-masked)"
        if self.dense_causal_only and score_mod is not None:
            return f"{self.name} takes no score function"
        if self.extra_skip is not None:
            return self.extra_skip(q, mask, ctx)
        return None


def _sparseflash(backend: str) -> Builder:
    def build(q, k, v, mask, ctx, score_mod=None, dropout_p=0.0, key_lengths=None):
        return lambda: attention(q, k, v, mask, key_lengths=key_lengths, score_mod=score_mod, dropout_p=dropout_p,
                                 backend=backend)

    return build


def _reference_skip(q, mask, ctx):
    need = reference_bytes(q.shape[0], q.shape[1], mask.q_len, mask.kv_len) / 2**30
    if need > ctx.reference_max_gb:
        return f"the reference would need ~{need:.1f} GiB (> reference_max_gb={ctx.reference_max_gb:g})"
    return None


def _sdpa(kernel: Optional[str]) -> Builder:
    def build(q, k, v, mask, ctx, score_mod=None, dropout_p=0.0, key_lengths=None):
        return lambda: baselines.sdpa_attention(q, k, v, mask, key_lengths, kernel=kernel, dropout_p=dropout_p)

    return build


def _flex(backend: str) -> Builder:
    def build(q, k, v, mask, ctx, score_mod=None, dropout_p=0.0, key_lengths=None):
        block_mask = baselines.to_flex_block_mask(mask, q.device, key_lengths)
        return lambda: baselines.flex_attention(q, k, v, mask, block_mask=block_mask, dynamic=ctx.flex_dynamic,
                                                score_mod=score_mod, backend=backend)

    return build


def _flash_skip(q, mask, ctx):
    return None if baselines.flash_available() else baselines.FLASH_MISSING


_CPU_PEER = "the peers are timed on CUDA only (on CPU they are not the kernels one would compare with)"
_FLEX_NO_DROPOUT = "FlexAttention has no dropout on the probabilities"

REGISTRY: dict[str, HarnessBackend] = {
    "sparseflash": HarnessBackend("sparseflash", _sparseflash("auto"), lambda d: resolve_backend("auto", d)),
    "sparseflash-blocked": HarnessBackend("sparseflash-blocked", _sparseflash("blocked"), lambda d: "blocked"),
    "sparseflash-triton": HarnessBackend(
        "sparseflash-triton", _sparseflash("triton"), lambda d: "triton",
        cuda_only="timed on CUDA only (on CPU Triton runs under its interpreter)"),
    "reference": HarnessBackend("reference", _sparseflash("reference"), lambda d: "reference",
                                extra_skip=_reference_skip),
    "sdpa": HarnessBackend("sdpa", _sdpa(None), lambda d: "sdpa", cuda_only=_CPU_PEER, dense_causal_only=True),
    "sdpa-flash": HarnessBackend("sdpa-flash", _sdpa("flash"), lambda d: "sdpa:flash", cuda_only=_CPU_PEER,
                                 dense_causal_only=True),
    "sdpa-cudnn": HarnessBackend("sdpa-cudnn", _sdpa("cudnn"), lambda d: "sdpa:cudnn", cuda_only=_CPU_PEER,
                                 dense_causal_only=True),
    "flex": HarnessBackend("flex", _flex("TRITON"), lambda d: "flex (torch.compile)", cuda_only=_CPU_PEER,
                           no_dropout=_FLEX_NO_DROPOUT),
    # FlexAttention's FLASH backend: FlashAttention-4 (CuTe DSL); skipped, saying so, where its package is not
    # installed, so that the default runs report it as they report Flex
    "flex-flash": HarnessBackend("flex-flash", _flex("FLASH"), lambda d: "flex FLASH (FA4)", cuda_only=_CPU_PEER,
                                 no_dropout=_FLEX_NO_DROPOUT, extra_skip=_flash_skip),
}

# Errors that mean "this backend cannot run this case" rather than "this backend is broken".
UNSUPPORTED = (baselines.Unsupported,)
