"""The split-KV forward (few query rows against long keys: decoding) against the reference.

Up to ``MAX_QUERIES`` query rows the forward packs the heads of a GQA group into one program, splits
each row's key tiles among programs and merges their outputs (forward_decode.py). The cases check
that it packs and splits (but for top-left causal, whose few query rows see a few keys), and compare
o, lse
and the three gradients (the backward runs on the split forward's o and lse) with the reference, over
every mask kind, a mask and a score function, GQA, key lengths cutting the keys and a batch row with
no key at all. On CPU the kernels run under the interpreter; the ``gpu`` cases run decoding shapes.
"""

from __future__ import annotations

import pytest
import torch

from sparseflash.attention.score_mods import make_score_mod
from sparseflash.attention.triton import forward_decode, tuning
from sparseflash.attention.triton.forward_decode import MAX_QUERIES, applies, pack, splits
from sparseflash.attention.triton.plan import LaunchPlan
from sparseflash.attention.triton.tuning import planned
from sparseflash.masks import from_mask_mod, make
from tests.helpers import check_backend


def _window(q_len, kv_len, device):
    """Each query sees the last third of the keys up to its own position counted from the end of the keys
    (bottom-right alignment)."""
    offset, width = kv_len - q_len, kv_len // 3

    def recent(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + offset) & (q_idx + offset - kv_idx < width)

    return from_mask_mod(recent, q_len, kv_len, block=32, device=device)


def _mask(kind, q_len, kv_len, heads, device):
    if kind == "window":
        return _window(q_len, kv_len, device)
    block = {"dense": 32, "causal": 32, "butterfly": (32, 32), "random-per-head": 32}[kind]
    params = dict(heads=heads, density=0.4) if kind == "random-per-head" else {}
    return make(kind.removesuffix("-per-head"), q_len, kv_len, block=block, **params)


def _check(kind, q_len, kv_len, dim, dtype, gqa, key_lengths, score, device, batch=2, heads=4):
    kv_heads = heads // 4 if gqa else heads
    q = torch.randn(batch, heads, q_len, dim, dtype=dtype, device=device)
    k, v = (torch.randn(batch, kv_heads, kv_len, dim, dtype=dtype, device=device) for _ in range(2))
    do = torch.randn_like(q)
    mask = _mask(kind, q_len, kv_len, heads, device)
    lengths = {"none": None, "cut": [kv_len * 2 // 3 + 1, 41], "empty": [kv_len, 0]}[key_lengths]
    lengths = None if lengths is None else torch.tensor(lengths, device=device)
    score_mod = make_score_mod(score, heads=heads) if score else None
    if isinstance(score_mod, torch.nn.Module):  # ALiBi's slopes
        score_mod = score_mod.to(device)

    plan = LaunchPlan.of(q, k, mask, lengths is not None, dim ** -0.5)
    assert applies(plan) and pack(plan) == (1 if kind.endswith("per-head") else heads // kv_heads)
    # top-left causal: a few query rows see a few keys, too few to split
    expected = (lambda n: n == 1) if kind == "causal" else (lambda n: n > 1)
    assert expected(splits(plan, planned("decode", plan.config_key), q.device))
    got = check_backend("triton", q, k, v, mask, do, lengths, score_mod=score_mod)
    if key_lengths == "empty":  # the batch row with no key: output 0, lse -inf, gradients 0
        assert torch.all(got[0][1] == 0) and torch.all(got[1][1] == float("-inf"))
        assert all(torch.all(g[1] == 0) for g in got[2:])


CPU_CASES = [
    # kind, q_len, kv_len, dim, dtype, gqa, key_lengths, score
    ("dense", 1, 300, 32, torch.float16, True, "cut", None),
    ("dense", 16, 257, 16, torch.bfloat16, False, "empty", None),
    ("causal", 5, 300, 32, torch.bfloat16, True, "none", None),
    ("dense", 9, 300, 32, torch.bfloat16, True, "none", None),
    ("butterfly", 3, 301, 32, torch.float16, False, "cut", None),
    ("random-per-head", 7, 300, 24, torch.float16, True, "empty", None),
    ("window", 2, 333, 32, torch.bfloat16, True, "cut", "alibi"),
    ("dense", 4, 290, 32, torch.float16, False, "none", "softcap"),
    # head dims computed as two parts (plan.head_dim_parts): 48 = 32 + 16, 40 padded within 32 + 16
    ("causal", 3, 300, 48, torch.bfloat16, True, "cut", None),
    ("butterfly", 2, 290, 40, torch.float16, False, "none", "alibi"),
]


def _case_id(case):
    kind, q_len, kv_len, dim, dtype, gqa, key_lengths, score = case
    return (f"{kind}-sq{q_len}-skv{kv_len}-d{dim}-{str(dtype).removeprefix('torch.')}{'-gqa' if gqa else ''}"
            f"-keys-{key_lengths}{'-' + score if score else ''}")


@pytest.mark.parametrize("case", CPU_CASES, ids=_case_id)
def test_split_forward_matches_reference(case, monkeypatch):
    monkeypatch.setattr(forward_decode, "SPLIT_MIN_TILES", 1)  # split the short rows of these small shapes too
    monkeypatch.setattr(forward_decode, "COMBINE_SPLITS", 2)  # and merge in several rounds
    _check(*case, device="cuda" if torch.cuda.is_available() else "cpu")


def test_more_queries_go_to_the_forward():
    q, k = torch.randn(1, 2, MAX_QUERIES + 1, 32), torch.randn(1, 2, 4096, 32)
    assert not applies(LaunchPlan.of(q, k, make("dense", MAX_QUERIES + 1, 4096, block=32), False, 32 ** -0.5))


@pytest.mark.parametrize("q_len, heads, kv_heads, kind, rows", [
    (1, 8, 1, "dense", 16), (4, 16, 4, "causal", 16), (1, 4, 4, "dense", 16), (3, 28, 4, "dense", 32),
    (16, 32, 8, "butterfly", 64), (16, 16, 1, "dense", 256), (16, 8, 2, "random-per-head", 16)])
def test_decode_tiles_follow_the_query_rows_sharing_a_kv_head(q_len, heads, kv_heads, kind, rows, monkeypatch):
    """The tuning key knows how many query rows a program group holds (a GQA group's queries, one head's
    where the layout differs per head), and groups taller than 16 rows take 64-row tiles first."""
    monkeypatch.setattr(tuning, "interpreting", lambda: False)  # the GPU's candidates, not the interpreter's tile

    def mask(q_len):  # mask blocks of 128, which a 64-row tile fits
        params = dict(heads=heads, density=0.4) if kind.endswith("per-head") else {}
        return make(kind.removesuffix("-per-head"), q_len, 5000, block=128, **params)

    q, k = torch.randn(2, heads, q_len, 64), torch.randn(2, kv_heads, 5000, 64)
    key = LaunchPlan.of(q, k, mask(q_len), False, 0.125).config_key
    assert key.decode_rows == rows
    assert tuning.candidates("decode", key)[0].block_m == (16 if rows == 16 else 64)
    more = torch.randn(2, heads, MAX_QUERIES + 1, 64)
    assert LaunchPlan.of(more, k, mask(MAX_QUERIES + 1), False, 0.125).config_key.decode_rows == 0


GPU_CASES = [
    # kind, q_len, kv_len, dim, dtype, gqa, key_lengths, score: decoding against long caches
    ("dense", 1, 32768, 128, torch.bfloat16, True, "cut", None),
    ("dense", 16, 20000, 128, torch.float16, True, "empty", None),
    ("dense", 4, 65536, 64, torch.bfloat16, False, "none", None),
    ("butterfly", 2, 16384, 128, torch.bfloat16, True, "cut", None),
    ("window", 1, 30000, 128, torch.bfloat16, True, "none", "alibi"),
    ("dense", 1, 32768, 96, torch.bfloat16, True, "cut", None),
    ("dense", 8, 20000, 80, torch.float16, True, "none", None),
    # program groups of 48, 64 and 36 query rows: 64-row tiles (tuning.DECODE_TALL)
    ("dense", 12, 30000, 256, torch.bfloat16, True, "cut", None),
    ("butterfly", 16, 16384, 192, torch.float16, True, "none", None),
    ("dense", 9, 40000, 64, torch.bfloat16, True, "empty", "softcap"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_gpu_decoding(case):
    _check(*case, device="cuda", batch=2, heads=8)
