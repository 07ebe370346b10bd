"""Dropout on the attention probabilities: which scores a seed drops, the same on every backend.

A call with ``dropout_p > 0`` draws one 64-bit seed from torch's generator of the inputs' device
(``torch.manual_seed`` makes it repeatable; every call draws a new one). Score ``(b, h, i, j)``
(batch, query head, query, key) is dropped when a random byte is below ``t = round(p * 256)``, and a
kept probability is scaled by ``1 / (1 - t / 256)``: the drop probability is p rounded to a multiple
of 1/256 (FlashAttention-2 also draws a byte per score), and since the scale uses that rounded
probability, the expected output is exactly the undropped one.
``o = (P * Z * scale) @ V`` with ``P`` the normalised probabilities and ``Z`` the keep mask; the
log-sum-exp is that of the scores, without dropout.

The random bytes come from Philox-4x32 with 7 rounds (``tl.philox(..., n_rounds=7)``, the
generator of ``tl.rand``, with the rounds of FlashAttention-2's dropout: Random123 found Philox-4x32
passes TestU01's BigCrush from 7 rounds and gives 10 as a safety margin; the draws are most of a
kernel's dropout work), keyed by the seed, at the counter
``(j // 32 * 4 + j % 8 // 2, i // 16 * 8 + i % 8, b * H + h, 0)``. Of its four 32-bit words score
``(i, j)`` takes word ``j // 8 % 4`` and of that word byte ``2 * (i // 8 % 2) + j % 2`` (from the
low end). So one counter serves sixteen scores, queries ``i, i + 8`` by keys ``j, j + 1`` and the
same 8, 16 and 24 keys on: on a tensor-core tile with the queries along the rows one thread holds
all sixteen, and with the keys along the rows (the dK/dV loop) keys ``j, j + 8`` sit with one thread,
which draws the counter for its four scores. No tile size enters the pattern, so the backward draws
the same numbers as the forward; nothing is stored. ``philox`` below is the same function in
PyTorch (int64 arithmetic on 32-bit values), which the ``reference`` and ``blocked`` backends use,
so that every backend drops the same scores.
"""

from __future__ import annotations

import dataclasses

import torch

ROUNDS = 7
KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85  # Philox-4x32's key schedule (Weyl increments)
ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57  # its round multipliers
WORD = 0xFFFFFFFF
SEED_HIGH = 2**63 - 1  # seeds are drawn in [0, SEED_HIGH)


@dataclasses.dataclass(frozen=True)
class Dropout:
    """Drop probability ``p`` (0 < p < 1) and ``seed``: an int64 tensor of shape () on the inputs' device."""

    p: float
    seed: torch.Tensor

    @property
    def threshold(self) -> int:
        """A score is dropped when its random byte is below this."""
        return threshold(self.p)

    @property
    def scale(self) -> float:
        """What a kept probability is multiplied by: 1 / the chance of being kept."""
        return 1.0 / (1.0 - self.threshold / 256)


def threshold(p: float) -> int:
    """The byte below which a score is dropped with probability ``p``: p * 256 rounded (half to even)."""
    return min(round(p * 256), 255)


def check_p(p, name: str = "dropout_p") -> float:
    """``p`` as a float in [0, 1), or a ValueError that says what ``name`` was given (also for a p > 0
    too small to drop anything once rounded to a multiple of 1/256)."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ValueError(f"{name} must be a number in [0, 1); got {p!r}")
    if p > 0 and threshold(p) == 0:
        raise ValueError(f"{name}={p!r} rounds to 0 at dropout's resolution of 1/256 (it would drop nothing); "
                         f"give 0 or more than 1/512")
    return float(p)


def draw_seed(device: torch.device) -> torch.Tensor:
    """A seed from torch's generator of ``device``: an int64 tensor of shape () there (drawn on the device,
    so that a GPU call does not wait for the host, and a CUDA graph replays a fresh one)."""
    return torch.randint(0, SEED_HIGH, (), dtype=torch.int64, device=device)


def _mul_parts(constant: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The high and low 32-bit words of ``constant * x`` for 32-bit values ``x`` (int64), computed from
    16-bit halves of x so that no product leaves int64."""
    high_half, low_half = x >> 16, x & 0xFFFF
    upper, lower = constant * high_half, constant * low_half  # each < 2**48
    high = (upper + (lower >> 16)) >> 16
    low = (((upper & 0xFFFF) << 16) + lower) & WORD
    return high, low


def philox(seed: torch.Tensor, c0, c1, c2, c3) -> tuple[torch.Tensor, ...]:
    """Philox-4x32 (``ROUNDS`` rounds) of the counters ``c0..c3`` (int64 tensors or ints holding 32-bit
    values, broadcast together) under the 64-bit key ``seed`` (an int64 tensor of shape ()): four int64
    tensors of 32-bit words, as ``tl.philox(seed, c0, c1, c2, c3, ROUNDS)`` returns them."""
    seed = seed.to(torch.int64)
    k0, k1 = seed & WORD, (seed >> 32) & WORD
    c0, c1, c2, c3 = torch.broadcast_tensors(*(torch.as_tensor(c, dtype=torch.int64, device=seed.device)
                                               for c in (c0, c1, c2, c3)))
    for _ in range(ROUNDS):
        high_b, low_b = _mul_parts(ROUND_B, c2)
        high_a, low_a = _mul_parts(ROUND_A, c0)
        c0, c1, c2, c3 = high_b ^ c1 ^ k0, low_b, high_a ^ c3 ^ k1, low_a
        k0, k1 = (k0 + KEY_A) & WORD, (k1 + KEY_B) & WORD
    return c0, c1, c2, c3


def _kept_byte(word: torch.Tensor, byte, threshold: int) -> torch.Tensor:
    return ((word >> (byte * 8)) & 0xFF) >= threshold


def kept_blocks(dropout: Dropout, heads: int, b, h, q_start, kv_start, block_m: int, block_n: int) -> torch.Tensor:
    """``kept`` of whole tiles: bool ``L + (block_m, block_n)`` for the queries ``q_start + [0, block_m)``
    and keys ``kv_start + [0, block_n)``, where ``b, h, q_start, kv_start`` are int64 tensors that
    broadcast to the leading shape ``L`` (one tile each), each start a multiple of its size. With
    block_m a multiple of 16 and block_n of 32 it draws each counter once for its sixteen scores (the
    blocked backend's tiles), else score by score."""
    device = dropout.seed.device
    i, j = torch.arange(block_m, device=device)[:, None], torch.arange(block_n, device=device)
    if block_m % 16 or block_n % 32:
        q_idx, kv_idx = q_start[..., None, None] + i, kv_start[..., None, None] + j
        return kept(dropout, heads, b[..., None, None], h[..., None, None], q_idx, kv_idx)
    q_rows = (q_start // 2)[..., None, None] + torch.arange(block_m // 2, device=device)[:, None]
    key_groups = (kv_start // 8)[..., None, None] + torch.arange(block_n // 8, device=device)
    words = torch.stack(philox(dropout.seed, key_groups, q_rows, (b * heads + h)[..., None, None], 0), -1)
    q_row, key_group = ((i >> 4) << 3) | (i & 7), ((j >> 5) << 2) | ((j & 7) >> 1)
    word = words[..., q_row, key_group, (j >> 3) & 3]
    return _kept_byte(word, 2 * ((i >> 3) & 1) + (j & 1), dropout.threshold)


def kept(dropout: Dropout, heads: int, b, h, q_idx, kv_idx) -> torch.Tensor:
    """Bool tensor, True where score ``(b, h, q_idx, kv_idx)`` is kept: the int64 index tensors broadcast
    together (``heads``: the query heads H)."""
    key_group = ((kv_idx >> 5) << 2) | ((kv_idx & 7) >> 1)
    query_row = ((q_idx >> 4) << 3) | (q_idx & 7)
    words = torch.stack(philox(dropout.seed, key_group, query_row, b * heads + h, 0), -1)
    word = torch.gather(words, -1, torch.broadcast_to((kv_idx >> 3) & 3, words.shape[:-1])[..., None])[..., 0]
    return _kept_byte(word, 2 * ((q_idx >> 3) & 1) + (kv_idx & 1), dropout.threshold)
