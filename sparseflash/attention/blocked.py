"""The FlashAttention-2 loop in plain PyTorch, over the computed tiles only (CPU path).

The mask's row tables (``kv_num_blocks``, ``kv_indices``) are flattened into one list of
computed tiles ``(head, query block, key block)``; a zero tile is never gathered. Tiles are
processed in chunks (vectorised over batch and tiles) and merged into each query row with the
online softmax: a running max ``m``, sum ``l`` and unnormalised output, rescaled once at the end,
and ``lse = m + log l`` kept for the backward. Memory is O(chunk x tile + the tensors), never
``S_q x S_kv``. The backward recomputes each tile's probabilities from ``q, k, lse`` and
scatters ``dQ`` by query block and ``dK, dV`` by key block. Arithmetic is fp32.

A mask's mask_mod and the score function's traced graph (``Graph.evaluate``) run on each chunk's tiles with
broadcast index tensors (positions clamped into the sequences, as the kernels do); the backward
differentiates the score function with ``torch.func.vjp``, chunk by chunk, which also gives the
gradients of the tensors it captures. A mask with a batch dimension is run one batch element at a time.
With dropout, each chunk's keep mask (``sparseflash.attention.dropout.kept_blocks``: the kernels' pattern,
a draw per sixteen scores) is drawn in the forward and drawn again in the backward.
"""

from __future__ import annotations

import torch

from sparseflash.attention.dropout import Dropout, kept_blocks
from sparseflash.masks import BlockMask, layout_to_tables
from sparseflash.masks.functions import Graph, trace

SCORE_BYTES_PER_CHUNK = 1 << 26  # bounds the fp32 score tiles held at once


class _Tiles:
    """The computed tiles of a mask for ``H`` query heads, as flat index vectors.

    ``head``, ``q_block``, ``kv_block`` index each tile; ``row = head * n_q + q_block`` names
    its query-block row; ``kv_head`` is the key/value head it reads (GQA)."""

    def __init__(self, mask: BlockMask, heads: int, kv_heads: int, device):
        num, idx = layout_to_tables(mask.layout.to(device).expand(heads, -1, -1))
        n_q, n_kv = mask.layout.shape[1:]
        slot = torch.arange(n_kv, device=device)
        self.head, self.q_block, t = (slot < num[..., None]).nonzero(as_tuple=True)
        self.kv_block = idx[self.head, self.q_block, t].long()
        self.row = self.head * n_q + self.q_block
        self.kv_head = self.head // (heads // kv_heads)
        self.count = self.head.numel()

    def chunks(self, batch: int, block_m: int, block_n: int):
        size = max(1, SCORE_BYTES_PER_CHUNK // (4 * batch * block_m * block_n))
        for start in range(0, self.count, size):
            yield slice(start, start + size)


def _as_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """(B, H, S, D) -> fp32 (B, H, n_blocks, block, D), zero-padded past S."""
    batch, heads, length, dim = x.shape
    n = -(-length // block)
    x = torch.nn.functional.pad(x.float(), (0, 0, 0, n * block - length))
    return x.view(batch, heads, n, block, dim)


def _indices(mask: BlockMask, tiles: _Tiles, part: slice, batch: int, first_batch: int, device):
    """``b (B,1,1,1)``, ``h (1,c,1,1)``, ``q_idx (1,c,bm,1)``, ``kv_idx (1,c,1,bn)`` of the chunk's
    scores as a mask or score function sees them (positions clamped into the sequences)."""
    block_m, block_n = mask.block_size
    q_pos = tiles.q_block[part, None] * block_m + torch.arange(block_m, device=device)  # (c, bm)
    kv_pos = tiles.kv_block[part, None] * block_n + torch.arange(block_n, device=device)  # (c, bn)
    b = first_batch + torch.arange(batch, device=device)[:, None, None, None]
    return (b, tiles.head[part][None, :, None, None], q_pos.clamp(max=mask.q_len - 1)[None, :, :, None],
            kv_pos.clamp(max=mask.kv_len - 1)[None, :, None, :])


def _keep(mask: BlockMask, tiles: _Tiles, part: slice, key_lengths, idx) -> torch.Tensor:
    """Bool ``[B|1, c, bm|1, bn]``: which scores of the chunk's tiles are kept (``idx``: ``_indices``)."""
    block_m, block_n = mask.block_size
    device = tiles.kv_block.device
    kv_pos = tiles.kv_block[part, None] * block_n + torch.arange(block_n, device=device)  # (c, bn)
    keep = (kv_pos < mask.kv_len)[None, :, None, :]
    if mask.causal:
        q_pos = tiles.q_block[part, None] * block_m + torch.arange(block_m, device=device)  # (c, bm)
        keep = keep & (q_pos[:, :, None] >= kv_pos[:, None, :])[None]
    if mask.mask_mod is not None:
        keep = keep & mask.mask_mod(*idx)
    if key_lengths is not None:
        keep = keep & (kv_pos[None] < key_lengths.to(device)[:, None, None])[:, :, None, :]
    return keep


def _raw_scores(q_blk, k_blk, tiles, part, scale) -> torch.Tensor:
    """fp32 ``scale * q.k`` of the chunk's tiles ``[B, c, bm, bn]``."""
    q_t = q_blk[:, tiles.head[part], tiles.q_block[part]]  # (B, c, bm, D)
    k_t = k_blk[:, tiles.kv_head[part], tiles.kv_block[part]]  # (B, c, bn, D)
    return q_t @ k_t.transpose(-1, -2) * scale


def _tile_scores(raw, keep, score_mod, idx) -> torch.Tensor:
    """The chunk's scores after ``score_mod``, dropped ones ``-inf``."""
    s = raw if score_mod is None else score_mod(raw, *idx)
    return s.masked_fill(~keep, float("-inf"))


def _finite(m: torch.Tensor, fill: float) -> torch.Tensor:
    return torch.where(torch.isinf(m) & (m < 0), torch.full_like(m, fill), m)


def _kept(dropout: Dropout | None, mask: BlockMask, tiles: _Tiles, part: slice, batch: int, first_batch: int,
          heads: int) -> torch.Tensor | float:
    """The chunk's dropout keep mask ``[B, c, bm, bn]`` times the kept probabilities' scale (1.0 without
    dropout)."""
    if dropout is None:
        return 1.0
    block_m, block_n = mask.block_size
    b = first_batch + torch.arange(batch, device=tiles.head.device)[:, None]
    keep = kept_blocks(dropout, heads, b, tiles.head[part][None], tiles.q_block[part][None] * block_m,
                       tiles.kv_block[part][None] * block_n, block_m, block_n)
    return keep * dropout.scale


def _forward(q, k, v, mask: BlockMask, key_lengths, scale, score_graph: Graph | None, dropout: Dropout | None,
             first_batch: int):
    """``blocked_forward`` for a mask without a batch dimension; ``first_batch``: the batch index of q's first
    element (what the mask and score functions see, and dropout's row streams)."""
    batch, heads, q_len, dim = q.shape
    block_m, block_n = mask.block_size
    n_q = mask.layout.shape[1]
    tiles = _Tiles(mask, heads, k.shape[1], q.device)
    q_blk, k_blk, v_blk = _as_blocks(q, block_m), _as_blocks(k, block_n), _as_blocks(v, block_n)
    m = torch.full((batch, heads * n_q, block_m), float("-inf"), device=q.device)
    l = torch.zeros_like(m)
    acc = torch.zeros(batch, heads * n_q, block_m, dim, device=q.device)
    score_mod = score_graph.evaluate if score_graph is not None else None
    for part in tiles.chunks(batch, block_m, block_n):
        idx = _indices(mask, tiles, part, batch, first_batch, q.device)
        keep = _keep(mask, tiles, part, key_lengths, idx)
        s = _tile_scores(_raw_scores(q_blk, k_blk, tiles, part, scale), keep, score_mod, idx)  # (B, c, bm, bn)
        m_tile = s.amax(-1)
        p = torch.exp(s - _finite(m_tile, 0.0)[..., None])
        row = tiles.row[part]
        m_new = m.scatter_reduce(1, row[None, :, None].expand_as(m_tile), m_tile, "amax")
        m_ref = _finite(m_new, 0.0)
        rescale = torch.exp(m - m_ref)
        weight = torch.exp(m_tile - m_ref[:, row])  # rescales each tile to its row's new max
        v_t = v_blk[:, tiles.kv_head[part], tiles.kv_block[part]]  # (B, c, bn, D)
        l = (l * rescale).index_add(1, row, p.sum(-1) * weight)
        kept_p = p * _kept(dropout, mask, tiles, part, batch, first_batch, heads)  # l takes all of p
        acc = (acc * rescale[..., None]).index_add(1, row, (kept_p @ v_t) * weight[..., None])
        m = m_new
    visible = l > 0
    o = acc / torch.where(visible, l, torch.ones_like(l))[..., None]
    lse = torch.where(visible, m + torch.log(l), torch.full_like(m, float("-inf")))
    o = o.view(batch, heads, n_q * block_m, dim)[:, :, :q_len]
    lse = lse.view(batch, heads, n_q * block_m)[:, :, :q_len]
    return o.to(q.dtype), lse


def _scores_and_vjp(raw, keep, score_graph: Graph, idx):
    """The chunk's scores after the score function (``_tile_scores``) and their vjp with respect to the raw
    scores and the captured tensors that require grad (torch.func: no autograd graph is needed, so this
    also runs inside a custom op)."""
    def scores(raw, *trained):
        return _tile_scores(raw, keep, score_graph.with_trained(trained), idx)

    return torch.func.vjp(scores, raw, *(t.detach() for t in score_graph.trained))


def _backward(q, k, v, o, lse, do, dlse, mask: BlockMask, key_lengths, scale, score_graph: Graph | None,
              dropout: Dropout | None, first_batch: int):
    """``blocked_backward`` for a mask without a batch dimension."""
    batch, heads, q_len, dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    block_m, block_n = mask.block_size
    n_q, n_kv = mask.layout.shape[1:]
    tiles = _Tiles(mask, heads, kv_heads, q.device)
    q_blk, k_blk, v_blk = _as_blocks(q, block_m), _as_blocks(k, block_n), _as_blocks(v, block_n)
    do_blk = _as_blocks(do, block_m)
    # d lse / d s = p, so a gradient through lse shifts delta = rowsum(o * do).
    delta = (o.float() * do.float()).sum(-1)
    if dlse is not None:
        delta = delta - dlse.float()
    pad = n_q * block_m - q_len
    delta = torch.nn.functional.pad(delta, (0, pad)).view(batch, heads * n_q, block_m)
    # rows without a kept score, and the padding rows past q_len (whose scores a score function may push past
    # exp's range: inf * 0 would be NaN), get lse = inf, hence p = 0
    lse_blk = torch.nn.functional.pad(_finite(lse, float("inf")), (0, pad), value=float("inf"))
    lse_blk = lse_blk.view(batch, heads * n_q, block_m)
    dq = torch.zeros(batch, heads * n_q, block_m, dim, device=q.device)
    dk = torch.zeros(batch, kv_heads * n_kv, block_n, dim, device=q.device)
    dv = torch.zeros_like(dk)
    capture_grads = [torch.zeros(t.shape, device=t.device) for t in score_graph.trained] if score_graph else []
    for part in tiles.chunks(batch, block_m, block_n):
        idx = _indices(mask, tiles, part, batch, first_batch, q.device)
        keep = _keep(mask, tiles, part, key_lengths, idx)
        row = tiles.row[part]
        raw = _raw_scores(q_blk, k_blk, tiles, part, scale)
        if score_graph is None:
            s = _tile_scores(raw, keep, None, idx)
        else:
            s, vjp = _scores_and_vjp(raw, keep, score_graph, idx)
        p = torch.exp(s - lse_blk[:, row, :, None])
        k_t = k_blk[:, tiles.kv_head[part], tiles.kv_block[part]]
        v_t = v_blk[:, tiles.kv_head[part], tiles.kv_block[part]]
        q_t = q_blk[:, tiles.head[part], tiles.q_block[part]]
        do_t = do_blk[:, tiles.head[part], tiles.q_block[part]]
        kept_scaled = _kept(dropout, mask, tiles, part, batch, first_batch, heads)
        # (B, c, bm, bn), d loss / d s: delta = rowsum(o * do) holds the dropout already
        ds = p * (do_t @ v_t.transpose(-1, -2) * kept_scaled - delta[:, row, :, None])
        if score_graph is not None:  # d loss / d raw score, and the captured tensors' share
            ds, *shares = vjp(ds)
            for grad, share in zip(capture_grads, shares):
                grad += share
        col = tiles.kv_head[part] * n_kv + tiles.kv_block[part]
        dq.index_add_(1, row, ds @ k_t * scale)
        dk.index_add_(1, col, ds.transpose(-1, -2) @ q_t * scale)
        dv.index_add_(1, col, (p * kept_scaled).transpose(-1, -2) @ do_t)
    dq = dq.view(batch, heads, n_q * block_m, dim)[:, :, :q_len]
    dk = dk.view(batch, kv_heads, n_kv * block_n, dim)[:, :, :kv_len]
    dv = dv.view(batch, kv_heads, n_kv * block_n, dim)[:, :, :kv_len]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), capture_grads


def _batches(mask: BlockMask, batch: int):
    """``(slice of the batch, the mask it sees, its first index)``: the whole batch for a mask without a
    batch dimension, else one element at a time."""
    if mask.num_batches == 1:
        return [(slice(None), mask.batch_view(0), 0)]
    return [(slice(b, b + 1), mask.batch_view(b), b) for b in range(batch)]


def _part(key_lengths, rows: slice):
    return None if key_lengths is None else key_lengths[rows]


def blocked_forward(q, k, v, mask: BlockMask, key_lengths, scale, score_graph: Graph | None = None,
                    dropout: Dropout | None = None):
    """Returns ``o (B, H, S_q, D)`` in ``q.dtype`` and ``lse (B, H, S_q)`` fp32; ``score_graph``: the traced
    score function, or None; ``dropout``: drop probabilities with it, or None."""
    outs = [_forward(q[rows], k[rows], v[rows], view, _part(key_lengths, rows), scale, score_graph, dropout, first)
            for rows, view, first in _batches(mask, q.shape[0])]
    return torch.cat([o for o, _ in outs]), torch.cat([lse for _, lse in outs])


def blocked_backward(q, k, v, o, lse, do, dlse, mask: BlockMask, key_lengths, scale, score_graph: Graph | None = None,
                     dropout: Dropout | None = None):
    """Gradients ``dq, dk, dv`` (dtypes of the inputs) of a loss through ``o`` and ``lse``, and those of the
    score function's captured tensors that require grad, in slot order (fp32); ``dropout``: the forward's."""
    grads = [_backward(q[rows], k[rows], v[rows], o[rows], lse[rows], do[rows],
                       None if dlse is None else dlse[rows], view, _part(key_lengths, rows), scale, score_graph,
                       dropout, first)
             for rows, view, first in _batches(mask, q.shape[0])]
    dq, dk, dv = (torch.cat([g[i] for g in grads]) for i in range(3))
    return dq, dk, dv, [sum(shares) for shares in zip(*(g[3] for g in grads))]


class BlockedAttentionFunction(torch.autograd.Function):
    """Autograd for the blocked loop: saves ``q, k, v, o, lse`` (and the mask and dropout seed). The score
    function's captured tensors that require grad are inputs too, so that they get their gradients."""

    @staticmethod
    def forward(ctx, q, k, v, mask, key_lengths, scale, score_graph, dropout, *grad_captures):
        o, lse = blocked_forward(q, k, v, mask, key_lengths, scale, score_graph, dropout)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.mask, ctx.key_lengths, ctx.scale, ctx.score_graph = mask, key_lengths, scale, score_graph
        ctx.dropout = dropout
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):  # a backward run under autocast stays fp32
            dq, dk, dv, capture_grads = blocked_backward(q, k, v, o, lse, do, dlse, ctx.mask, ctx.key_lengths,
                                                         ctx.scale, ctx.score_graph, ctx.dropout)
        trained = ctx.score_graph.trained if ctx.score_graph else []
        return (dq, dk, dv, None, None, None, None, None, *(g.to(t.dtype) for g, t in zip(capture_grads, trained)))


def blocked_attention(q, k, v, mask: BlockMask, key_lengths, scale, score_mod=None, dropout: Dropout | None = None):
    """``(o, lse)`` through the blocked loop, differentiable in ``q, k, v`` and in the tensors
    ``score_mod`` captures; a mask with a batch dimension runs one batch element at a time; ``dropout``:
    drop probabilities with it, or None."""
    score_graph = trace(score_mod, "score_mod") if score_mod is not None else None
    trained = score_graph.trained if score_graph is not None else []
    return BlockedAttentionFunction.apply(q, k, v, mask, key_lengths, scale, score_graph, dropout, *trained)
