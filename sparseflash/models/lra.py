"""The LRA Transformer encoder, its classifier and the dual encoder for retrieval.

``tokens (B, S) + lengths (B,) -> encoder -> pooled (B, dim) -> classifier -> logits``.
Pre-LN blocks of ``SparseAttention`` + MLP; padding never receives attention because the true
lengths are passed to the attention as ``key_lengths``. With CLS pooling a learned vector is put
in front of the sequence (it is then one longer); with mean pooling the valid tokens are averaged.
The sequence is zero-padded up to a multiple of ``pad_multiple`` (the mask block by default), so
the number of distinct lengths (and hence of masks built) stays small.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn

from sparseflash.attention import SparseAttention
from sparseflash.masks import MaskSpec


def sinusoidal_positions(length: int, dim: int) -> torch.Tensor:
    """The fixed sin/cos table of "Attention is all you need", ``(length, dim)``."""
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)[:, : dim // 2]
    return table


class Block(nn.Module):
    """Pre-LN Transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, dim: int, heads: int, mlp_dim: int, dropout: float, mask, backend: str, score_mod=None,
                 attention_dropout: float = 0.0):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = SparseAttention(dim, heads, mask=mask, backend=backend, dropout=dropout, score_mod=score_mod,
                                    attn_dropout=attention_dropout)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_dim), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(mlp_dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor, key_lengths: torch.Tensor | None,
                key_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), key_lengths, key_mask)
        return x + self.mlp(self.ln2(x))


class Encoder(nn.Module):
    """Embedding + positions + pre-LN blocks + final LayerNorm + pooling -> ``(B, dim)``.

    Args:
        vocab_size: token ids in ``[0, vocab_size)``, 0 = padding.
        embedding: ``token`` (a lookup table) or ``pixel`` (a linear map of the grey level
            ``(id - 1) / 255``; for image tasks whose ids are ``pixel + 1``).
        embed_std: the standard deviation of the token table's initial entries (padding's row stays
            0): 1.0 as PyTorch's default and LRA's Flax code, 0.02 as the Nyströmformer authors' LRA
            code, where the learned positions (std 0.02) are then as large as the tokens.
        masked_token: a token id whose positions no query attends to and the mean pooling leaves out
            (still dividing by the valid length), or None. The Nyströmformer authors' LRA code does so
            with its id 0, which in Pathfinder is every black pixel (here id 1: ids are pixel + 1).
        positions: ``learned`` or ``sinusoidal``; max_len: the longest input (without CLS).
        pool: ``cls`` or ``mean`` (over valid tokens).
        mask: the attention mask of ``SparseAttention`` (a ``MaskSpec`` or its fields); backend: its backend;
            score_mod: its score function (a registered name or ``{"name", "params"}``; one per block).
        dropout: dropout after the embedding, in the MLPs and on the attention output projection;
            attention_dropout: dropout on the attention probabilities (LRA's ``attention_dropout_rate``).
    """

    def __init__(self, vocab_size: int, max_len: int, dim: int = 64, depth: int = 2, heads: int = 4,
                 mlp_dim: int = 128, dropout: float = 0.1, embedding: str = "token",
                 positions: str = "learned", pool: str = "cls", mask: Any = None,
                 backend: str = "auto", pad_multiple: int = 1, score_mod: Any = None,
                 attention_dropout: float = 0.0, embed_std: float = 1.0, masked_token: int | None = None):
        super().__init__()
        if embedding not in ("token", "pixel"):
            raise ValueError(f"model.embedding must be 'token' or 'pixel'; got {embedding!r}")
        if positions not in ("learned", "sinusoidal"):
            raise ValueError(f"model.positions must be 'learned' or 'sinusoidal'; got {positions!r}")
        if pool not in ("cls", "mean"):
            raise ValueError(f"model.pool must be 'cls' or 'mean'; got {pool!r}")
        if embedding == "pixel" and embed_std != 1.0:
            raise ValueError(f"model.embed_std sets the token table's init; the pixel embedding has none (got "
                             f"embed_std={embed_std})")
        self.embedding_kind, self.pool, self.pad_multiple = embedding, pool, max(1, int(pad_multiple))
        self.masked_token = masked_token
        self.max_len = max_len + (pool == "cls")
        self.embed = nn.Embedding(vocab_size, dim, padding_idx=0) if embedding == "token" else nn.Linear(1, dim)
        if embedding == "token" and embed_std != 1.0:  # 1.0 draws nothing more: a seed gives PyTorch's init
            with torch.no_grad():
                self.embed.weight.normal_(0.0, embed_std)
                self.embed.weight[0].zero_()
        if positions == "learned":
            self.pos = nn.Parameter(torch.randn(self.max_len, dim) * 0.02)
        else:
            self.register_buffer("pos", sinusoidal_positions(self.max_len, dim), persistent=False)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02) if pool == "cls" else None
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dim, heads, mlp_dim, dropout, mask, backend, score_mod, attention_dropout)
                                    for _ in range(depth))
        self.ln = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq = x.shape  # (B, S) token ids
        if lengths is None:
            lengths = torch.full((batch,), seq, dtype=torch.long, device=x.device)
        if self.embedding_kind == "token":
            h = self.embed(x)
        else:
            h = self.embed(((x.float() - 1.0) / 255.0).clamp_min(0.0)[..., None])
        if self.cls is not None:
            h = torch.cat([self.cls.expand(batch, -1, -1).to(h.dtype), h], dim=1)
            lengths = lengths + 1
        if h.shape[1] > self.max_len:
            raise ValueError(f"input of length {h.shape[1]} exceeds the model's max_len {self.max_len}")
        h = h + self.pos[: h.shape[1]].to(h.dtype)
        valid = torch.arange(h.shape[1], device=x.device)[None, :] < lengths[:, None]  # (B, S)
        h = h * valid[..., None]
        keys = None  # (B, S) the keys attended to, where a token is left out
        if self.masked_token is not None:
            keys = x != self.masked_token
            if self.cls is not None:
                keys = nn.functional.pad(keys, (1, 0), value=True)
        total = -(-h.shape[1] // self.pad_multiple) * self.pad_multiple
        if total > h.shape[1]:
            h = nn.functional.pad(h, (0, 0, 0, total - h.shape[1]))
            valid = nn.functional.pad(valid, (0, total - valid.shape[1]))
            keys = None if keys is None else nn.functional.pad(keys, (0, total - keys.shape[1]))
        h = self.drop(h)
        for block in self.blocks:
            h = block(h, lengths, keys)
        h = self.ln(h)
        if self.cls is not None:
            return h[:, 0]
        weights = valid.to(h.dtype)[..., None]
        pooled = weights if keys is None else (valid & keys).to(h.dtype)[..., None]
        return (h * pooled).sum(1) / weights.sum(1).clamp_min(1.0)


class Classifier(nn.Module):
    """``Encoder`` + LRA's head (Dense(mlp_dim) -> ReLU -> Dense(num_classes))."""

    def __init__(self, encoder: Encoder, dim: int, mlp_dim: int, num_classes: int):
        super().__init__()
        self.encoder = encoder
        self.head = nn.Sequential(nn.Linear(dim, mlp_dim), nn.ReLU(), nn.Linear(mlp_dim, num_classes))

    def forward(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.head(self.encoder(batch["x"], batch["lengths"]))


class DualEncoderClassifier(nn.Module):
    """Retrieval (AAN): one shared ``Encoder`` for both documents; LRA's interaction
    ``[u, v, u * v, u - v]`` -> Dense(mlp_dim) -> ReLU -> Dense(num_classes)."""

    def __init__(self, encoder: Encoder, dim: int, mlp_dim: int, num_classes: int):
        super().__init__()
        self.encoder = encoder
        self.head = nn.Sequential(nn.Linear(4 * dim, mlp_dim), nn.ReLU(), nn.Linear(mlp_dim, num_classes))

    def forward(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        u = self.encoder(batch["x"], batch["lengths"])
        v = self.encoder(batch["x2"], batch["lengths2"])
        return self.head(torch.cat([u, v, u * v, u - v], dim=-1))


# What an ``attention`` config holds beside its mask spec.
ATTENTION_KEYS = ("backend", "score_mod")


def _plain(value: Any) -> Any:
    """A config value as plain Python (an OmegaConf mapping as a dict)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def build_model(model_cfg: Mapping[str, Any], attention_cfg: Mapping[str, Any], *, vocab_size: int,
                max_len: int, num_classes: int, pair: bool = False) -> nn.Module:
    """The classifier (or dual encoder when ``pair``) described by the ``model`` and
    ``attention`` configs for a task with the given vocabulary, length and classes."""
    dim, mlp_dim = int(model_cfg["dim"]), int(model_cfg["mlp_dim"])
    spec = MaskSpec.from_config(attention_cfg, other_keys=ATTENTION_KEYS)
    pad_multiple = model_cfg.get("pad_multiple") or max(spec.block_size)
    encoder = Encoder(vocab_size, max_len, dim=dim, depth=int(model_cfg["depth"]), heads=int(model_cfg["heads"]),
                      mlp_dim=mlp_dim, dropout=float(model_cfg.get("dropout", 0.0)),
                      embedding=str(model_cfg.get("embedding", "token")),
                      positions=str(model_cfg.get("positions", "learned")), pool=str(model_cfg.get("pool", "cls")),
                      mask=spec, backend=str(attention_cfg.get("backend", "auto")), pad_multiple=int(pad_multiple),
                      score_mod=_plain(attention_cfg.get("score_mod")),
                      attention_dropout=float(model_cfg.get("attention_dropout", 0.0)),
                      embed_std=float(model_cfg.get("embed_std", 1.0)),
                      masked_token=None if model_cfg.get("masked_token") is None else int(model_cfg["masked_token"]))
    head_dim = int(model_cfg.get("head_mlp_dim") or mlp_dim)
    cls = DualEncoderClassifier if pair else Classifier
    return cls(encoder, dim, head_dim, num_classes)
