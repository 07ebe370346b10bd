"""The oracle: fp32 attention over materialised scores. Obviously correct, never fast.

It defines sparseflash's semantics; every other backend is tested against it:
- scores ``s = scale * q @ k^T`` in fp32 for each query head; with GQA query head ``h`` reads
  key/value head ``h // (H // H_kv)``;
- a ``score_mod(score, b, h, q_idx, kv_idx)`` replaces each score (called once on the whole
  ``(B, H, S_q, S_kv)`` score tensor with broadcast index tensors);
- a score is kept when the mask keeps it (``BlockMask.to_dense()``, its mask_mod included) and its
  key index is below ``key_lengths[b]``; dropped scores get no probability;
- a score the score function makes ``-inf`` gets no probability either; a query row left with no
  finite score has output 0, log-sum-exp ``-inf`` and zero gradients (never NaN);
- with dropout, the probabilities ``sparseflash.attention.dropout.kept`` drops are 0 and the others are
  scaled by ``dropout.scale`` (1 / the chance of being kept) before ``@ v``; ``lse`` is that of the scores;
- the output has the dtype of ``q``; ``lse`` (natural log) is fp32.
"""

from __future__ import annotations

import torch

from sparseflash.attention.dropout import Dropout, kept
from sparseflash.masks import BlockMask


def allowed_scores(mask: BlockMask, key_lengths: torch.Tensor | None, device) -> torch.Tensor:
    """Element-level bool ``[B or 1, H_or_1, S_q, S_kv]``: True where a score is kept."""
    allowed = mask.to(device).to_dense()
    allowed = allowed if allowed.dim() == 4 else allowed[None]
    if key_lengths is not None:
        kv_idx = torch.arange(mask.kv_len, device=device)
        allowed = allowed & (kv_idx[None, :] < key_lengths.to(device)[:, None])[:, None, None, :]
    return allowed


def score_mod_indices(s: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``b, h, q_idx, kv_idx`` as int64 tensors that broadcast against scores ``s (B, H, S_q, S_kv)``."""
    return tuple(torch.arange(n, device=s.device).view([-1 if i == d else 1 for i in range(4)])
                 for d, n in enumerate(s.shape))


def reference_attention(
    q: torch.Tensor,  # (B, H, S_q, D)
    k: torch.Tensor,  # (B, H_kv, S_kv, D)
    v: torch.Tensor,  # (B, H_kv, S_kv, D)
    mask: BlockMask,
    key_lengths: torch.Tensor | None,  # (B,) int
    scale: float,
    score_mod=None,
    dropout: Dropout | None = None,
    *,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``o (B, H, S_q, D)`` in ``q.dtype`` and ``lse (B, H, S_q)`` (fp32, fp64 for fp64
    inputs); differentiable. Computes in fp32 (fp64 for fp64 inputs). ``upcast=False`` is instead the
    plain implementation in the inputs' precision that the tests measure the kernels' error against
    (as FlashAttention's tests do): scores and ``p @ v`` in q's dtype, the softmax in fp32."""
    groups = q.shape[1] // k.shape[1]
    work = torch.promote_types(q.dtype, torch.float32) if upcast else q.dtype
    qf = q.to(work)
    kf = k.to(work).repeat_interleave(groups, dim=1)
    vf = v.to(work).repeat_interleave(groups, dim=1)
    allowed = allowed_scores(mask, key_lengths, q.device)  # (B|1, H|1, S_q, S_kv)
    s = (qf @ kf.transpose(-1, -2)) * scale
    if score_mod is not None:
        s = score_mod(s, *score_mod_indices(s))
    s = s.to(torch.promote_types(work, torch.float32)).masked_fill(~allowed, float("-inf"))
    empty = (s == float("-inf")).all(-1, keepdim=True)  # rows that keep no finite score
    s = s.masked_fill(empty, 0.0)  # keeps softmax and its gradient finite on those rows
    p = torch.softmax(s, dim=-1).masked_fill(empty, 0.0)
    if dropout is not None:
        p = p * (kept(dropout, q.shape[1], *score_mod_indices(p)) * dropout.scale)
    o = p.to(work) @ vf
    lse = torch.logsumexp(s, dim=-1).masked_fill(empty.squeeze(-1), float("-inf"))
    return o.to(q.dtype), lse
