"""Built-in element patterns: factories of ``mask_mod(b, h, q_idx, kv_idx) -> bool``.

Each is registered by name (``patterns.register_mask_mod``), so ``make("sliding_window", 4096,
window=300)`` and the Hydra config ``attention=sliding_window attention.params.window=300`` build its
mask; called directly, a factory returns the mask_mod itself, for ``from_mask_mod`` or for combining
with other functions. Positions are absolute token indices from 0 (top-left alignment). None takes a
``causal`` parameter: ``make(..., causal=True)`` (the config's ``causal: true``) adds ``q_idx >= kv_idx``
to any of them, and the tiles above the diagonal are then never computed.
"""

from __future__ import annotations

from typing import Sequence

import torch

from sparseflash.masks.patterns import register_mask_mod


@register_mask_mod("sliding_window")
def sliding_window(q_len: int, kv_len: int, window: int = 256):
    """Each query sees the keys less than ``window`` positions away on either side; with causal, the
    ``window`` keys ending at its own position."""
    if window < 1:
        raise ValueError(f"sliding_window window must be >= 1 token; got {window}")

    def sliding_window_mod(b, h, q_idx, kv_idx):
        return abs(q_idx - kv_idx) < window

    return sliding_window_mod


def document_ids(length: int, documents: int = 4, lengths: Sequence[int] | None = None,
                 device: torch.device | str | None = None, seed: int | None = None) -> torch.Tensor:
    """int32 ``[length]``: the document of each position of a packed sequence, from the documents'
    ``lengths`` (summing to ``length``) or, without them, ``documents`` parts: equal, or of random
    lengths drawn with ``seed`` (boundaries uniform over the sequence, as packed corpora are)."""
    if lengths is None and not 1 <= documents <= length:
        raise ValueError(f"documents must be in [1, {length}]; got {documents}")
    if lengths is None and seed is not None:
        cuts = torch.randperm(length - 1, generator=torch.Generator().manual_seed(int(seed)))[: documents - 1] + 1
        edges = torch.cat([torch.tensor([0]), cuts.sort().values, torch.tensor([length])])
        lengths = edges.diff().tolist()
    if lengths is not None:
        lengths = [int(n) for n in lengths]
        if sum(lengths) != length or min(lengths, default=0) < 1:
            raise ValueError(f"document lengths must be >= 1 and sum to the sequence length {length}; "
                             f"got {lengths} (sum {sum(lengths)})")
        counts = torch.tensor(lengths)
        return torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), counts).to(device)
    return (torch.arange(length, dtype=torch.int64) * documents // length).to(torch.int32).to(device)


@register_mask_mod("document")
def document(q_len: int, kv_len: int, documents: int = 4, lengths: Sequence[int] | None = None,
             seed: int | None = None, device: torch.device | str | None = None):
    """Packed sequences: a query sees the keys of its own document only. The documents are
    ``lengths`` (summing to the longer of q_len and kv_len) or ``documents`` parts, equal or, with a
    ``seed``, of random lengths; their ids are a captured tensor on ``device``."""
    doc = document_ids(max(q_len, kv_len), documents, lengths, device, seed)

    def document_mod(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    return document_mod


@register_mask_mod("prefix_lm")
def prefix_lm(q_len: int, kv_len: int, prefix: int = 256):
    """Prefix LM: every query sees the first ``prefix`` keys (bidirectional), and the keys up to its
    own position (causal)."""
    if prefix < 0:
        raise ValueError(f"prefix_lm prefix must be >= 0 tokens; got {prefix}")

    def prefix_lm_mod(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (q_idx >= kv_idx)

    return prefix_lm_mod


@register_mask_mod("dilated")
def dilated(q_len: int, kv_len: int, dilation: int = 2, window: int | None = None):
    """Dilated attention: a query sees the keys whose distance to it is a multiple of ``dilation``
    (within ``window`` tokens on either side when given)."""
    if dilation < 1 or (window is not None and window < 1):
        raise ValueError(f"dilated needs dilation >= 1 and window None or >= 1; got {dilation}, {window}")

    def dilated_mod(b, h, q_idx, kv_idx):
        distance = q_idx - kv_idx
        keep = distance % dilation == 0
        return keep & (abs(distance) < window) if window is not None else keep

    return dilated_mod
