"""The Gluon kernels for Hopper (forward_gluon.py, backward_gluon.py): which calls take them, and, on a Hopper
GPU (``pytest -m gpu``), their outputs and gradients against the reference."""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper", reason="Triton without Gluon for Hopper")
import sparseflash  # noqa: E402
from sparseflash.attention.triton import backward, backward_gluon, forward, forward_gluon, gluon_tools  # noqa: E402
from sparseflash.attention.triton.forward_persistent import row_view_rows  # noqa: E402
from sparseflash.attention.triton.launch import Launcher, Standin, gluon_hopper  # noqa: E402
from sparseflash.attention.triton.plan import LaunchPlan  # noqa: E402
from sparseflash.attention.triton.tuning import fit  # noqa: E402
from sparseflash import masks  # noqa: E402
from sparseflash.attention.score_mods import make_score_mod  # noqa: E402
from sparseflash.masks import from_layout, make  # noqa: E402
from sparseflash.masks.functions import trace  # noqa: E402
from tests.attention import sm90_compile  # noqa: E402
from tests.helpers import check_backend  # noqa: E402


def _empty_first_row(q_len: int, kv_len: int, heads: int):
    """Random 256 x 128 blocks, the first block row empty in every head (its rows see no key)."""
    layout = torch.rand(heads, q_len // 256, kv_len // 128) < 0.5
    layout[:, 1:, 0] = True
    layout[:, 0] = False
    return from_layout(layout, block=(256, 128), q_len=q_len, kv_len=kv_len)


MASKS = {  # every kind the kernel walks: SPARSE with full blocks only, with causal partial blocks, empty rows
    "dense": lambda q_len, kv_len, heads: make("dense", q_len, kv_len),
    "causal": lambda q_len, kv_len, heads: make("causal", q_len, kv_len),
    "butterfly": lambda q_len, kv_len, heads: make("butterfly", q_len, kv_len, block=128),
    "random-per-head": lambda q_len, kv_len, heads: make("random", q_len, kv_len, block=128, heads=heads,
                                                         density=0.3),
    "local-causal-256": lambda q_len, kv_len, heads: make("local", q_len, kv_len, block=256, causal=True, window=1),
    "empty-rows": _empty_first_row,
}
SHAPES = {  # (q_len, kv_len, layout): "bshd" is (B, S, H, D) memory seen as (B, H, S, D)
    "s256": (256, 256, "bhsd"),
    "q256-kv512": (256, 512, "bhsd"),
    "s768-bshd": (768, 768, "bshd"),
}


def _inputs(shape: str, dim: int, dtype: torch.dtype, heads: int = 4, kv_heads: int = 2):
    q_len, kv_len, layout = SHAPES[shape]

    def tensor(n_heads, length):
        if layout == "bshd":
            return torch.randn(2, length, n_heads, dim, dtype=dtype, device="cuda").transpose(1, 2)
        return torch.randn(2, n_heads, length, dim, dtype=dtype, device="cuda")

    return tensor(heads, q_len), tensor(kv_heads, kv_len), tensor(kv_heads, kv_len), tensor(heads, q_len)


def _spy_launches(monkeypatch) -> dict[str, list[bool]]:
    """What each Gluon kernel's ``launch`` returned in the calls after this (True: it ran; a launch ahead, which
    only compiles, is not counted), the Triton kernels never standing in for the Gluon kernels while they
    compile: the calls run the Gluon kernels, which the tests judge."""
    for module in (forward, backward):
        monkeypatch.setattr(module, "STAND_IN_FROM_CPUS", math.inf)
    launched = {"forward": [], "backward": []}
    for direction, module in (("forward", forward_gluon), ("backward", backward_gluon)):
        def launch(*args, _original=module.launch, _direction=direction, **kwargs):
            ran = _original(*args, **kwargs)
            if not kwargs.get("ahead"):
                launched[_direction].append(ran)
            return ran

        monkeypatch.setattr(module, "launch", launch)
    return launched


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("dim", [48, 64, 80, 96, 128, 160, 192, 256], ids=lambda dim: f"d{dim}")
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("pattern", list(MASKS))
def test_gpu_gluon_kernels_match_reference(pattern, shape, dim, dtype, monkeypatch):
    """o, lse and the gradients against the reference; GQA (4 query heads on 2 key/value heads); the Gluon
    forward and (head dims 48-192) backward launched for every call, head dims that are not powers of two in two
    parts (SPARSEFLASH_GLUON=1). At head dims 48 and 64 the dense and causal forward takes three warpgroups' query
    tiles of 192 rows at 768 queries, two at 256 (``forward_gluon.warpgroups``)."""
    if not gluon_hopper(torch.device("cuda")):
        pytest.skip("the Gluon kernels run on Hopper GPUs with Triton >= 3.6")
    monkeypatch.setenv("SPARSEFLASH_GLUON", "1")
    q, k, v, do = _inputs(shape, dim, dtype)
    mask = MASKS[pattern](q.shape[2], k.shape[2], q.shape[1])
    launched = _spy_launches(monkeypatch)
    check_backend("triton", q, k, v, mask, do)
    _assert_gluon_ran(launched, dim)


def _assert_gluon_ran(launched: dict[str, list[bool]], dim: int) -> None:
    """Every call ran the Gluon forward, and the Gluon backward where it takes the head dim."""
    expected = {"forward": True, "backward": dim in backward_gluon.TILES}
    ran = {direction: bool(calls) and all(calls) for direction, calls in launched.items()}
    assert ran == expected and (expected["backward"] or not launched["backward"]), f"launched: {launched}"


def _with_functions(case: str, seq_len: int, heads: int):
    """``(mask, score_mod)`` of one case of mask and score functions the Gluon kernels evaluate in their tiles
    (blocks of 128): mask_mods on the partial blocks (a token window, documents read from a captured tensor at
    every score, causal written as a function, rows that see no key), score functions of every form
    (``codegen.py``: linear in the keys, separable with a key table, neither), and a learnable table (the
    Gluon forward, the Triton backward)."""
    device = "cuda"
    if case == "window":
        return masks.make("sliding_window", seq_len, block=128, window=300, causal=True, device=device), None
    if case == "documents":
        return masks.make("document", seq_len, block=128, documents=5, seed=1, device=device), None
    if case == "causal-as-mask_mod":
        return masks.from_mask_mod(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, seq_len, block=128,
                                   device=device), None
    if case == "empty-rows":  # queries 130-299 see no key
        def hole(b, h, q_idx, kv_idx):
            return ((q_idx < 130) | (q_idx >= 300)) & ((kv_idx * 7 + q_idx) % 5 != 0)
        return masks.from_mask_mod(hole, seq_len, block=128, device=device), None
    if case == "butterfly-and-window":
        return masks.make("butterfly", seq_len, block=128, device=device) & masks.make(
            "sliding_window", seq_len, block=128, window=200, causal=True, device=device), None
    causal = make("causal", seq_len)
    if case == "alibi":
        return causal, make_score_mod("alibi", heads).to(device)
    if case == "alibi-and-key-table":  # separable, not linear in the keys: a load per key
        slopes, per_key = make_score_mod("alibi", heads).slopes.to(device), torch.randn(seq_len, device=device)
        return causal, lambda score, b, h, q_idx, kv_idx: score + slopes[h] * (kv_idx - q_idx) + per_key[kv_idx]
    if case == "softcap":
        return causal, make_score_mod("softcap", heads, cap=5.0)
    if case == "query-padding":  # a per-query table of -inf pads queries 130-299: they see no key
        pad = torch.zeros(seq_len, device=device)
        pad[130:300] = float("-inf")
        return causal, lambda score, b, h, q_idx, kv_idx: score + pad[q_idx]
    if case == "documents-and-alibi":
        return (masks.make("document", seq_len, block=128, documents=5, seed=1, device=device),
                make_score_mod("alibi", heads).to(device))
    if case == "learnable-bias":
        bias = make_score_mod("relative_bias", heads, max_distance=64).to(device)
        with torch.no_grad():
            bias.table.normal_(0, 0.5)
        return causal, bias
    raise ValueError(case)


FUNCTION_CASES = ["window", "documents", "causal-as-mask_mod", "empty-rows", "butterfly-and-window", "alibi",
                  "alibi-and-key-table", "softcap", "query-padding", "documents-and-alibi", "learnable-bias"]


@pytest.mark.gpu
@pytest.mark.parametrize("dim, dtype", [(64, torch.float16), (96, torch.float16), (128, torch.bfloat16),
                                        (192, torch.bfloat16), (256, torch.bfloat16)],
                         ids=["d64-fp16", "d96-fp16", "d128-bf16", "d192-bf16", "d256-bf16"])
@pytest.mark.parametrize("case", FUNCTION_CASES)
def test_gpu_gluon_kernels_with_functions_match_reference(case, dim, dtype, monkeypatch):
    """Mask and score functions in the Gluon kernels, against the reference: o, lse, dq, dk, dv (and a learnable
    table's gradient, which the Triton backward computes), GQA, 1,024 tokens in (B, S, H, D) memory; rows that
    see no key give 0 and no NaN."""
    if not gluon_hopper(torch.device("cuda")):
        pytest.skip("the Gluon kernels run on Hopper GPUs with Triton >= 3.6")
    monkeypatch.setenv("SPARSEFLASH_GLUON", "1")
    seq_len, heads = 1024, 4
    q, k, v, do = (torch.randn(2, seq_len, n, dim, dtype=dtype, device="cuda").transpose(1, 2)
                   for n in (heads, 2, 2, heads))
    mask, score_mod = _with_functions(case, seq_len, heads)
    launched = _spy_launches(monkeypatch)
    got = check_backend("triton", q, k, v, mask, do, score_mod=score_mod)
    if case in ("empty-rows", "query-padding"):
        assert torch.all(got.o[:, :, 130:300] == 0) and torch.all(got.dq[:, :, 130:300] == 0)
    assert bool(launched["forward"]) is (case != "softcap") and all(launched["forward"]), launched
    assert bool(launched["backward"]) is (case != "learnable-bias" and dim in backward_gluon.TILES) and all(
        launched["backward"]), launched


@pytest.mark.gpu
@pytest.mark.parametrize("dim, dtype", [(48, torch.bfloat16), (64, torch.float16), (80, torch.bfloat16),
                                        (96, torch.float16), (128, torch.bfloat16), (192, torch.bfloat16),
                                        (256, torch.bfloat16)],
                         ids=["d48-bf16", "d64-fp16", "d80-bf16", "d96-fp16", "d128-bf16", "d192-bf16", "d256-bf16"])
@pytest.mark.parametrize("case", ["window", "documents-and-alibi", "empty-rows"])
def test_gpu_the_triton_forward_standing_in_matches_reference(case, dim, dtype, monkeypatch):
    """The Triton forward with the config it stands in with for the Gluon forward while that compiles
    (``forward.stand_in_config``: 8 warps on 128-row tiles), made to stand in on every call the Gluon forward
    takes (lengths its tiles divide), with mask and score functions, 1,024 tokens, GQA, (B, S, H, D) memory,
    against the reference: o, lse and the gradients of the backward that reads its lse."""
    if not gluon_hopper(torch.device("cuda")):
        pytest.skip("the Gluon kernels run on Hopper GPUs with Triton >= 3.6")
    monkeypatch.setenv("SPARSEFLASH_GLUON", "1")
    stood_in = []

    def stand_in(plan, *args):
        plan.per_layout.setdefault("forward_stand_in", {})
        stood_in.append(forward.stand_in_config(plan.config_key))
        return stood_in[-1]

    monkeypatch.setattr(forward, "_triton_stand_in", stand_in)
    seq_len, heads = 1024, 4
    q, k, v, do = (torch.randn(2, seq_len, n, dim, dtype=dtype, device="cuda").transpose(1, 2)
                   for n in (heads, 2, 2, heads))
    mask, score_mod = _with_functions(case, seq_len, heads)
    got = check_backend("triton", q, k, v, mask, do, score_mod=score_mod)
    if case == "empty-rows":
        assert torch.all(got.o[:, :, 130:300] == 0)
    assert stood_in and all(cfg.num_warps * forward.WARPGROUP_ROWS >= 4 * cfg.block_m for cfg in stood_in), stood_in


@pytest.mark.gpu
@pytest.mark.parametrize("dim, dtype", [(48, torch.bfloat16), (64, torch.float16), (96, torch.bfloat16),
                                        (128, torch.float16), (192, torch.bfloat16), (256, torch.bfloat16)],
                         ids=["d48-bf16", "d64-fp16", "d96-bf16", "d128-fp16", "d192-bf16", "d256-bf16"])
@pytest.mark.parametrize("case", ["window", "documents-and-alibi", "empty-rows"])
def test_gpu_the_triton_backward_standing_in_matches_reference(case, dim, dtype, monkeypatch):
    """The Triton backward's halves with the configs they stand in with for the Gluon backward while that
    compiles (``backward.gluon_stand_in``: GLUON_STAND_IN, GLUON_STAND_IN_WIDE at 256), made to stand in on every
    backward (the Gluon backward's compile ahead never ends), with mask and score functions, 1,024 tokens, GQA,
    (B, S, H, D) memory, against the reference."""
    if not gluon_hopper(torch.device("cuda")):
        pytest.skip("the Gluon kernels run on Hopper GPUs with Triton >= 3.6")
    monkeypatch.setenv("SPARSEFLASH_GLUON", "1")
    monkeypatch.setattr(backward, "usable_cpus", lambda: backward.STAND_IN_FROM_CPUS)
    monkeypatch.setattr(backward_gluon, "compile_ahead", lambda *args: True)
    monkeypatch.setattr(backward_gluon, "compiling", lambda *args: True)
    seq_len, heads = 1024, 4
    q, k, v, do = (torch.randn(2, seq_len, n, dim, dtype=dtype, device="cuda").transpose(1, 2)
                   for n in (heads, 2, 2, heads))
    mask, score_mod = _with_functions(case, seq_len, heads)
    check_backend("triton", q, k, v, mask, do, score_mod=score_mod)
    # (the plans of the calls, kept on the mask: ``LaunchPlan.of``)
    states = {plan: plan.per_layout.get("gluon_backward_stand_in", {}) for plan in mask.derived["triton"].values()}
    stood_in = {plan: state["stand_in"] for plan, state in states.items() if "stand_in" in state}
    assert stood_in and all(cfg == fit(kernel, backward.gluon_stand_in(plan), plan.backward_key)
                            for plan, halves in stood_in.items()
                            for (cfg, _), (kernel, _) in zip(halves, backward.SPLIT)), stood_in


@pytest.mark.gpu
def test_gpu_gluon_alibi_keeps_precision_far_along_the_sequence(monkeypatch):
    """ALiBi at 16,384 tokens: its key term reaches slope * 16,384; the Gluon kernels take the scores at a query
    of each tile (``codegen.py``), so the lse stays within its fp32 bound against the reference."""
    if not gluon_hopper(torch.device("cuda")):
        pytest.skip("the Gluon kernels run on Hopper GPUs with Triton >= 3.6")
    monkeypatch.setenv("SPARSEFLASH_GLUON", "1")
    seq_len, heads = 16384, 2
    q, k, v, do = (torch.randn(1, heads, seq_len, 128, dtype=torch.bfloat16, device="cuda") for _ in range(4))
    launched = _spy_launches(monkeypatch)
    check_backend("triton", q, k, v, make("causal", seq_len), do, score_mod=make_score_mod("alibi", heads).cuda(),
                  dlse=torch.randn(1, heads, seq_len, device="cuda"))
    assert all(launched["forward"]) and all(launched["backward"]) and all(launched.values()), launched


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [96, 128], ids=["d96", "d128"])
@pytest.mark.parametrize("pattern", ["dense", "causal"])
def test_gpu_gluon_backward_of_query_tiles_of_64(pattern, dim, monkeypatch):
    """192 queries on 256 keys: the Gluon forward (its last query tile of 128 moved back to end at the last query),
    the Gluon backward (64 at head dims 80-192, in two parts at 96; 128 at 48 and 64)."""
    if not gluon_hopper(torch.device("cuda")):
        pytest.skip("the Gluon kernels run on Hopper GPUs with Triton >= 3.6")
    monkeypatch.setenv("SPARSEFLASH_GLUON", "1")
    q = torch.randn(2, 4, 192, dim, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(2, 2, 256, dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    launched = _spy_launches(monkeypatch)
    check_backend("triton", q, k, v, MASKS[pattern](192, 256, 4), torch.randn_like(q))
    assert all(launched["forward"]) and all(launched["backward"]) and all(launched.values()), launched


@pytest.mark.gpu
@pytest.mark.parametrize("dim, dtype", [(64, torch.float16), (80, torch.float16), (128, torch.bfloat16),
                                        (160, torch.bfloat16), (256, torch.bfloat16)],
                         ids=["d64-fp16", "d80-fp16", "d128-bf16", "d160-bf16", "d256-bf16"])
@pytest.mark.parametrize("pattern", list(MASKS))
def test_gpu_gluon_forward_many_items_a_program(pattern, dim, dtype, monkeypatch):
    """Three programs for the 2 x 4 x 6 query tiles (16 each; 2 x 4 x 4 of 192 rows at head dim 64, 10-11 each; CAUSAL
    and SPARSE rows of unequal lengths: as many key tiles each as the schedule could): the K/V ring, Q's buffer and
    the turns of the consumers carried from one work item to the next; the Gluon forward ran (no Triton forward
    standing in)."""
    if not gluon_hopper(torch.device("cuda")):
        pytest.skip("the Gluon forward runs on Hopper GPUs with Triton >= 3.6")
    monkeypatch.setenv("SPARSEFLASH_GLUON", "1")
    monkeypatch.setattr(forward_gluon, "multiprocessors", lambda device: 3)
    q, k, v, do = _inputs("s768-bshd", dim, dtype)
    launched = _spy_launches(monkeypatch)
    check_backend("triton", q, k, v, MASKS[pattern](q.shape[2], k.shape[2], q.shape[1]), do)
    _assert_gluon_ran(launched, dim)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("pattern", ["dense", "causal"])
@pytest.mark.parametrize("dim", [48, 64])
def test_gpu_gluon_forward_three_consumers_past_q_len(dim, pattern, layout, monkeypatch):
    """512 queries in three query tiles of 192 rows (three consumer warpgroups), the last one's 64 rows past q_len
    computed from whatever rows follow in memory (the next head's, in (B, S, H, D) memory the next batch's, TMA's
    zeros past the tensor's end) and not stored: o, lse and the gradients against the reference; GQA."""
    if not gluon_hopper(torch.device("cuda")):
        pytest.skip("the Gluon forward runs on Hopper GPUs with Triton >= 3.6")
    monkeypatch.setenv("SPARSEFLASH_GLUON", "1")
    shape = {"bhsd": (2, 4, 512, dim), "bshd": (2, 512, 4, dim)}[layout]
    q, do = (torch.randn(shape, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    k, v = (torch.randn(*shape[:-2], 2, dim, dtype=torch.bfloat16, device="cuda") if layout == "bshd" else
            torch.randn(2, 2, 512, dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    if layout == "bshd":
        q, k, v, do = (x.transpose(1, 2) for x in (q, k, v, do))
    mask = MASKS[pattern](512, 512, 4)
    assert forward_gluon.warpgroups(mask.kind, dim, False, 512) == 3
    launched = _spy_launches(monkeypatch)
    check_backend("triton", q, k, v, mask, do)
    _assert_gluon_ran(launched, dim)


@pytest.mark.gpu
@pytest.mark.parametrize("dim, dtype", [(48, torch.bfloat16), (64, torch.float16), (96, torch.bfloat16),
                                        (128, torch.bfloat16), (256, torch.float16)],
                         ids=["d48-bf16", "d64-fp16", "d96-bf16", "d128-bf16", "d256-fp16"])
@pytest.mark.parametrize("case, q_len, kv_len", [
    ("dense", 700, 700), ("causal", 700, 700), ("causal", 300, 1000), ("dense", 1000, 333), ("alibi", 700, 700),
    ("dense-nan-gaps", 700, 700), ("causal-nan-gaps-bshd", 700, 700), ("causal", 100, 700),
    ("dense-nan-gaps", 40, 700)], ids=str)
def test_gpu_gluon_forward_on_lengths_its_tiles_do_not_divide(case, q_len, kv_len, dim, dtype, monkeypatch):
    """DENSE and CAUSAL masks (causal top-left where q_len != kv_len; with ALiBi) on lengths that neither 128 nor 64
    divides: the Gluon forward, its last key tile ending at the last key (RAGGED_KEYS), and the Gluon backward, its
    programs' last key tile and their walks' last query tile ending at the last key and query (RAGGED). "nan-gaps":
    q, k, v and do slices of longer sequences whose other rows are NaN, which a tile running past a length would
    read (P = 0 times NaN is NaN), in (B, H, S, D) or (B, S, H, D) memory; GQA; 40 or 100 queries, fewer than a
    query tile (the forward's rows past q_len computed and not stored). o, lse and the gradients against the
    reference."""
    if not gluon_hopper(torch.device("cuda")):
        pytest.skip("the Gluon forward runs on Hopper GPUs with Triton >= 3.6")
    monkeypatch.setenv("SPARSEFLASH_GLUON", "1")

    def tensor(heads, length):
        if "nan-gaps" not in case:
            return torch.randn(2, heads, length, dim, dtype=dtype, device="cuda")
        longer = torch.full((2, length + 200, heads, dim) if "bshd" in case else (2, heads, length + 200, dim),
                            float("nan"), dtype=dtype, device="cuda")
        if "bshd" in case:
            longer[:, :length] = torch.randn(2, length, heads, dim, dtype=dtype, device="cuda")
            return longer[:, :length].transpose(1, 2)
        longer[:, :, :length] = torch.randn(2, heads, length, dim, dtype=dtype, device="cuda")
        return longer[:, :, :length]

    q, k, v, do = tensor(4, q_len), tensor(2, kv_len), tensor(2, kv_len), tensor(4, q_len)
    mask = make("dense" if case.startswith("dense") else "causal", q_len, kv_len)
    score_mod = make_score_mod("alibi", 4).to("cuda") if case == "alibi" else None
    launched = _spy_launches(monkeypatch)
    check_backend("triton", q, k, v, mask, do, score_mod=score_mod)
    if q_len >= backward_gluon.TILES[dim][0]:
        _assert_gluon_ran(launched, dim)
    else:  # fewer queries than a tile of the backward's: the Triton backward
        assert launched["forward"] and all(launched["forward"]) and not launched["backward"], launched


@pytest.mark.gpu
@pytest.mark.parametrize("dim, dtype", [(64, torch.bfloat16), (80, torch.float16), (128, torch.bfloat16),
                                        (256, torch.bfloat16)], ids=["d64-bf16", "d80-fp16", "d128-bf16", "d256-bf16"])
@pytest.mark.parametrize("pattern, q_len, kv_len", [
    ("dense", 512, 512), ("causal", 700, 700), ("dense", 300, 1000), ("causal", 1000, 700), ("butterfly", 512, 768),
    ("local-causal-256", 768, 768), ("random-per-head", 512, 512), ("empty-rows", 512, 512), ("document", 512, 512),
    ("random-per-batch", 512, 768), ("window-per-batch-and-head", 512, 512)],
    ids=str)
def test_gpu_gluon_kernels_take_key_lengths(pattern, q_len, kv_len, dim, dtype, monkeypatch):
    """key_lengths (``gluon_tools.key_end``): a batch of all its keys, one ending inside the last key tile, one a
    block and more before the end, one inside the first tile, one of none (rows of no key: o = 0, lse = -inf). The
    Gluon forward's walks end at each batch's last key (SPARSE: the listed blocks past it left out,
    ``gluon_tools.walk_before``, a full block across it masked), the Gluon backward's key tiles past it store
    zeros; every mask kind (SPARSE with full blocks only, causal partial blocks, empty rows, a mask function), GQA,
    lengths the tiles do not divide, masks with a batch dim (a block layout per batch, a window per batch and head).
    o, lse and the gradients against the reference."""
    if not gluon_hopper(torch.device("cuda")):
        pytest.skip("the Gluon kernels run on Hopper GPUs with Triton >= 3.6")
    monkeypatch.setenv("SPARSEFLASH_GLUON", "1")
    q = torch.randn(5, 4, q_len, dim, dtype=dtype, device="cuda")
    k, v = (torch.randn(5, 2, kv_len, dim, dtype=dtype, device="cuda") for _ in range(2))
    key_lengths = torch.tensor([kv_len, kv_len - 37, kv_len - 200, 5, 0], device="cuda")
    if pattern == "document":
        mask = make("document", q_len, block=128, documents=5, seed=1, device="cuda")
    elif pattern == "random-per-batch":  # a [B, 1, n_q, n_kv] layout
        layout = torch.rand(5, 1, q_len // 128, kv_len // 128, device="cuda") < 0.5
        mask = masks.BlockMask(layout, (128, 128), q_len, kv_len)
    elif pattern == "window-per-batch-and-head":  # a [B, H, n_q, n_kv] layout and its predicate
        widths = torch.randint(1, 400, (5, 4), device="cuda")
        mask = masks.from_mask_mod(lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() < widths[b, h], q_len,
                                   kv_len, block=128, batch=5, heads=4, device="cuda")
    else:
        mask = MASKS[pattern](q_len, kv_len, 4)
    launched = _spy_launches(monkeypatch)
    check_backend("triton", q, k, v, mask, torch.randn_like(q), key_lengths)
    _assert_gluon_ran(launched, dim)


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", ["dense", "blocks-of-64-keys"])
def test_gpu_gluon_forward_odd_key_tiles_across_items(pattern, monkeypatch):
    """Head dim 256 (two K/V buffers, K released apart from V): 5 key tiles an item (SPARSE: 3 or none, blocks of
    64 keys), three programs for the 2 x 4 x 6 query tiles, so that the ring's phases run on from item to item
    at odd offsets; an empty row; GQA."""
    if not gluon_hopper(torch.device("cuda")):
        pytest.skip("the Gluon forward runs on Hopper GPUs with Triton >= 3.6")
    monkeypatch.setenv("SPARSEFLASH_GLUON", "1")
    monkeypatch.setattr(forward_gluon, "multiprocessors", lambda device: 3)
    q, do = (torch.randn(2, 4, 768, 256, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    k, v = (torch.randn(2, 2, 320, 256, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    if pattern == "dense":
        mask = make("dense", 768, 320)
    else:  # rows of 3 blocks but one empty: 1.2x the mean at most (UNEQUAL_LINES), so programs take many items
        layout = torch.zeros(4, 6, 5, dtype=torch.bool)
        for row in (0, 1, 2, 3, 5):
            layout[:, row, torch.randperm(5)[:3]] = True
        mask = from_layout(layout, block=(128, 64), q_len=768, kv_len=320)
    launched = _spy_launches(monkeypatch)
    check_backend("triton", q, k, v, mask, do)
    _assert_gluon_ran(launched, 256)


@pytest.mark.gpu
@pytest.mark.parametrize("loss", ["sum", "sum-over-queries", "misaligned-gradient"])
def test_gpu_gluon_backward_of_a_gradient_tma_cannot_read(loss, monkeypatch):
    """o.sum()'s gradient reaches the backward expanded (strides 0), a gradient given by the caller may be
    contiguous but not 16-byte aligned: TMA reads neither, the Gluon backward reads a copy; the gradients
    against the reference's."""
    if not gluon_hopper(torch.device("cuda")):
        pytest.skip("the Gluon kernels run on Hopper GPUs with Triton >= 3.6")
    monkeypatch.setenv("SPARSEFLASH_GLUON", "1")
    q, k, v, _ = _inputs("s256", 128, torch.bfloat16)
    misaligned = torch.randn(q.numel() + 1, device="cuda", dtype=q.dtype)[1:].view(q.shape)  # 2 bytes off
    launched = _spy_launches(monkeypatch)
    grads = []
    for backend in ("triton", "reference"):
        leaves = [x.detach().float().requires_grad_() if backend == "reference" else x.detach().requires_grad_()
                  for x in (q, k, v)]
        o = sparseflash.attention(*leaves, make("causal", 256), backend=backend)
        if loss == "misaligned-gradient":
            o.backward(misaligned.to(o.dtype))
        else:
            (o.sum() if loss == "sum" else o.sum(dim=2).pow(2).sum()).backward()
        grads.append([x.grad.float() for x in leaves])
    for got, want in zip(*grads):
        assert torch.isfinite(got).all()
        assert (got - want).norm() / want.norm() < 3e-2
    assert launched["backward"] and all(launched["backward"]), launched


@pytest.mark.gpu
def test_gpu_deterministic_backward_repeats_bit_for_bit(monkeypatch):
    """With deterministic algorithms asked for, two backwards of one call give the same bits, the Gluon
    backward not launched."""
    if not gluon_hopper(torch.device("cuda")):
        pytest.skip("the Gluon kernels run on Hopper GPUs with Triton >= 3.6")
    monkeypatch.setenv("SPARSEFLASH_GLUON", "1")
    q, k, v, do = _inputs("s768-bshd", 128, torch.bfloat16)
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    launched = _spy_launches(monkeypatch)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        o = sparseflash.attention(q, k, v, make("causal", 768), backend="triton")
        first, second = (torch.autograd.grad(o, (q, k, v), do, retain_graph=True) for _ in range(2))
    finally:
        torch.use_deterministic_algorithms(before)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert not any(launched["backward"]), launched


@pytest.mark.gpu
def test_gpu_auto_takes_the_gluon_kernels_on_long_rows(monkeypatch):
    if not gluon_hopper(torch.device("cuda")):
        pytest.skip("the Gluon kernels run on Hopper GPUs with Triton >= 3.6")
    monkeypatch.delenv("SPARSEFLASH_GLUON", raising=False)
    q = torch.empty(1, 2, 4096, 128, dtype=torch.bfloat16, device="cuda")
    causal = LaunchPlan.of(q, q, make("causal", 4096), False, 128 ** -0.5)
    assert causal.gluon_forward and causal.gluon_backward
    butterfly = LaunchPlan.of(q, q, make("butterfly", 4096), False, 128 ** -0.5)  # 768 keys a row
    assert not butterfly.gluon_forward and butterfly.gluon_backward
    random = LaunchPlan.of(q, q, make("random", 4096, density=0.0625), False, 128 ** -0.5)  # 256 keys a row
    assert not random.gluon_forward and not random.gluon_backward


def _plan_inputs(q_len=256, kv_len=256, dim=128, dtype=torch.bfloat16):
    return torch.empty(2, 4, q_len, dim, dtype=dtype), torch.empty(2, 2, kv_len, dim, dtype=dtype)


@pytest.mark.parametrize("case, forward, backward", [
    ("dense", True, True), ("causal", True, True), ("butterfly", True, True), ("local-causal-256", True, True),
    ("fp32", False, False), ("d96", True, True), ("d48", True, True), ("d72", False, False), ("d112", False, False),
    ("d96-q192", True, True), ("d48-q192", True, True),
    ("d160-kv320", True, True), ("d192-kv320", True, True), ("d160-q192", True, True),
    ("d256", True, True), ("d256-kv320", True, True), ("d256-kv288", True, True), ("q192", True, True),
    ("d64-q192", True, True), ("d64-q384", True, True), ("q100", True, True), ("d64-q100", True, False),
    ("q200", True, True), ("kv300", True, True), ("kv100", False, False), ("causal-q200-kv300", True, True),
    ("blocks-64", False, False), ("ragged-last-block", False, False), ("random-kv300", False, False),
    ("dropout", False, False), ("trained-captures", True, False),
    ("special-per-score", False, True),
], ids=str)
def test_what_the_gluon_kernels_take(case, forward, backward, monkeypatch):
    """fp16/bf16 of head dim 64, 128 or 256 or one of two parts without padding (48, 80, 96, 160, 192; not 72, whose
    second part would be padded, nor 112, padded to 128); DENSE and CAUSAL masks on lengths of at least a tile, SPARSE
    masks on lengths that the tiles divide (forward: 128 queries and 128 keys, 64 at head dims 192 and 256; backward: 64
    queries at head dims 80-256, 128 at 48 and 64, and 128 keys, 64 at 160-256), with blocks that the tiles divide and
    that divide the lengths, with or without key_lengths, no dropout; the forward no score function
    that evaluates exp, log, tanh or sqrt per score, the backward none whose captured tensors take gradients
    (SPARSEFLASH_GLUON=1; the GPU and Triton are ``gluon_hopper``'s)."""
    monkeypatch.setenv("SPARSEFLASH_GLUON", "1")
    shapes = dict(fp32=dict(dtype=torch.float32), d96=dict(dim=96), d48=dict(dim=48), d72=dict(dim=72),
                  d112=dict(dim=112), **{"d96-q192": dict(q_len=192, dim=96), "d48-q192": dict(q_len=192, dim=48),
                                         "d160-q192": dict(q_len=192, dim=160)},
                  d256=dict(dim=256), q192=dict(q_len=192),
                  **{"d160-kv320": dict(kv_len=320, dim=160), "d192-kv320": dict(kv_len=320, dim=192)},
                  **{"d256-kv320": dict(kv_len=320, dim=256), "d256-kv288": dict(kv_len=288, dim=256)},
                  **{"d64-q192": dict(q_len=192, dim=64), "d64-q384": dict(q_len=384, dim=64)},
                  q200=dict(q_len=200), kv300=dict(kv_len=300), kv100=dict(kv_len=100), q100=dict(q_len=100),
                  **{"d64-q100": dict(q_len=100, dim=64)},
                  **{"causal-q200-kv300": dict(q_len=200, kv_len=300), "random-kv300": dict(kv_len=300)})
    q, k = _plan_inputs(**shapes.get(case, {}))
    if case in MASKS:
        mask = MASKS[case](q.shape[2], k.shape[2], q.shape[1])
    elif case == "blocks-64":
        mask = make("butterfly", 256, block=64)
    elif case == "ragged-last-block":  # 384 keys in 256-key blocks: the last block holds 128 of them
        q, k = _plan_inputs(384, 384)
        mask = make("random", 384, block=256, density=0.5)
    elif case.startswith(("causal-", "random-")):
        params = {"density": 0.5} if case.startswith("random") else {}
        mask = make(case.split("-")[0], q.shape[2], k.shape[2], **params)
    else:
        mask = make("dense", q.shape[2], k.shape[2])
    flags = dict(dropout=case == "dropout")
    assert forward_gluon.applies(q, k, mask, 256, **flags, special_per_score=case == "special-per-score",
                                 functions=False) is forward
    assert backward_gluon.applies(q, k, mask, 256, **flags, trains_captures=case == "trained-captures") is backward


def test_gluon_choice_auto_takes_rows_of_many_keys_and_0_none(monkeypatch):
    """"auto" takes the Gluon forward from the mean row keys of its table (AUTO_ROW_KEYS; AUTO_ROW_KEYS_THREE where
    three consumer warpgroups run: head dims 48 and 64, DENSE and CAUSAL masks without functions; AUTO_ROW_KEYS_STAGED
    where two store o through shared memory without functions: head dim 128, DENSE and CAUSAL), "1" always, "0"
    never."""
    mask = make("dense", 256)
    many, few = forward_gluon.AUTO_ROW_KEYS[128, False], forward_gluon.AUTO_ROW_KEYS[128, False] - 128
    monkeypatch.delenv("SPARSEFLASH_GLUON", raising=False)
    for functions, q_len in itertools.product((False, True), (256, 384)):  # 384 queries: three 192-row tiles
        inputs = {dim: _plan_inputs(q_len, q_len, dim) for dim in forward_gluon.KEY_TILE}
        for (dim, is_causal), keys in forward_gluon.AUTO_ROW_KEYS.items():  # head dims in parts among them
            pattern = make("causal" if is_causal else "dense", q_len)
            if forward_gluon.warpgroups(pattern.kind, dim, functions, q_len) == 3:
                keys = forward_gluon.AUTO_ROW_KEYS_THREE[dim, is_causal]
            elif not functions and forward_gluon.o_stored_staged(pattern.kind, dim, q_len, q_len):
                keys = forward_gluon.AUTO_ROW_KEYS_STAGED.get((dim, is_causal), keys)
            assert forward_gluon.applies(*inputs[dim], pattern, keys, False, False, functions)
            assert not forward_gluon.applies(*inputs[dim], pattern, keys - 64, False, False,
                                             functions), (dim, is_causal, functions, q_len)
    # at hd64 three consumers (dense, no function, 384 queries) from fewer keys than two
    assert forward_gluon.AUTO_ROW_KEYS_THREE[64, False] < forward_gluon.AUTO_ROW_KEYS[64, False]
    keys_64, dense_384 = forward_gluon.AUTO_ROW_KEYS_THREE[64, False], make("dense", 384)
    assert forward_gluon.applies(*_plan_inputs(384, 384, 64), dense_384, keys_64, False, False, False)
    assert not forward_gluon.applies(*_plan_inputs(384, 384, 64), dense_384, keys_64, False, False, True)
    assert not forward_gluon.applies(*_plan_inputs(256, 256, 64), mask, keys_64, False, False, False)
    assert set(forward_gluon.AUTO_ROW_KEYS) == {(dim, c) for dim in forward_gluon.KEY_TILE for c in (False, True)}
    # at hd128 dense rows store o through shared memory from fewer keys than SPARSE rows, which keep AUTO_ROW_KEYS
    keys_128, random_256 = forward_gluon.AUTO_ROW_KEYS_STAGED[128, False], make("random", 256, block=128, density=0.5)
    assert keys_128 < forward_gluon.AUTO_ROW_KEYS[128, False]
    assert forward_gluon.applies(*_plan_inputs(256, 256, 128), mask, keys_128, False, False, False)
    assert not forward_gluon.applies(*_plan_inputs(256, 256, 128), random_256, keys_128, False, False, False)
    assert not forward_gluon.applies(*_plan_inputs(256, 256, 128), mask, keys_128, False, False, True)
    monkeypatch.setenv("SPARSEFLASH_GLUON", "1")
    assert forward_gluon.applies(*_plan_inputs(), mask, few, False, False, False)
    monkeypatch.setenv("SPARSEFLASH_GLUON", "0")
    assert not forward_gluon.applies(*_plan_inputs(), mask, many, False, False, False)
    monkeypatch.setenv("SPARSEFLASH_GLUON", "yes")
    with pytest.raises(ValueError, match="SPARSEFLASH_GLUON must be auto, 0 or 1; got 'yes'"):
        forward_gluon.applies(*_plan_inputs(), mask, many, False, False, False)


@pytest.mark.parametrize("case, dim, q_len, consumers, items", [
    ("dense", 64, 512, 3, 3), ("causal", 64, 384, 3, 2), ("dense", 48, 512, 3, 3), ("dense", 64, 4096, 3, 22),
    ("dense", 64, 320, 3, 2), ("dense", 64, 256, 2, 2), ("causal", 64, 640, 2, 5), ("dense", 128, 512, 2, 4), ("dense", 80, 512, 2, 4),
    ("random", 64, 512, 2, 4), ("alibi", 64, 512, 2, 4), ("window", 64, 512, 2, 4)])
def test_the_gluon_forward_takes_three_consumers_at_head_dims_48_and_64(case, dim, q_len, consumers, items):
    """The launch's consumer warpgroups (WARPGROUPS) and work items: three (192-row query tiles, the last running
    past q_len where 192 does not divide it) for DENSE and CAUSAL masks without functions at head dims 48 and 64
    where that computes at most THREE_PADDING more rows than 128-row tiles (320 queries: 384 rows either way; not 256
    or 640 queries: 384 rows against 256, 768 against 640), two (128 rows) for
    SPARSE masks, a score function or a mask_mod and at other head dims; items = batch x heads x query tiles."""
    q = torch.randn(2, 4, q_len, dim, dtype=torch.bfloat16)
    k = torch.randn(2, 2, q_len, dim, dtype=torch.bfloat16)
    graph = trace(make_score_mod("alibi", 4), "score_mod") if case == "alibi" else None
    if case == "window":
        mask = masks.from_mask_mod(lambda b, h, q_idx, kv_idx: (q_idx - kv_idx < 100) & (kv_idx - q_idx < 100),
                                   q_len, block=128)
    else:
        mask = make("causal" if case == "alibi" else case, q_len, **({"density": 0.5} if case == "random" else {}))
    plan = LaunchPlan(q, k, mask, False, dim ** -0.5, graph)
    grid, tensors, scalars, constexprs = forward_gluon._arguments(
        plan, q, k, k, torch.empty_like(q), torch.empty(q.shape[:3]), plan.key_lengths_arg(None),
        plan.mods_table(plan.captures(graph)))
    assert constexprs["WARPGROUPS"] == consumers
    n_items = scalars[-3]  # (..., q_len, kv_len, n_items, programs, qk_scale)
    assert scalars[-5:-3] == (q_len, q_len) and n_items == 2 * 4 * items and grid[0] <= n_items


@pytest.mark.parametrize("case, dim, q_len, kv_len, staged, stages", [
    ("dense", 128, 512, 512, True, 2), ("causal", 128, 256, 8192, True, 2), ("dense", 128, 512, 8320, False, 3),
    ("dense", 128, 700, 700, False, 3), ("causal", 128, 320, 512, True, 2), ("random", 128, 512, 512, False, 3),
    ("dense", 64, 4096, 4096, True, 4), ("dense", 256, 512, 512, False, 2), ("dense", 96, 512, 512, False, 3)],
    ids=str)
def test_the_gluon_forward_stores_o_through_shared_memory_on_rows_up_to_8192_keys(case, dim, q_len, kv_len, staged,
                                                                                  stages):
    """O_STAGED (o by TMA from a shared buffer a consumer) for DENSE and CAUSAL masks at head dims 64 and 128, rows of at
    most O_STAGED_KEYS keys and q_len a multiple of 64, with the K/V buffers of O_STAGED_STAGES (two at 128, against
    three); o_desc reads o in 64-row boxes of its B * H * q_len rows; else q's descriptor stands in for it."""
    q = torch.randn(2, 4, q_len, dim, dtype=torch.bfloat16)
    k = torch.randn(2, 2, kv_len, dim, dtype=torch.bfloat16)
    mask = make(case, q_len, kv_len, **({"density": 0.5} if case == "random" else {}))
    plan = LaunchPlan(q, k, mask, False, dim ** -0.5, None)
    o = torch.empty_like(q)
    grid, tensors, scalars, constexprs = forward_gluon._arguments(
        plan, q, k, k, o, torch.empty(q.shape[:3]), plan.key_lengths_arg(None), plan.mods_table(plan.captures(None)))
    assert (constexprs["O_STAGED"], constexprs["STAGES"]) == (staged, stages)
    o_desc = tensors[6]  # after q, k, v and their second parts' descriptors
    if staged:
        assert o_desc.base is o and list(o_desc.shape) == [2 * 4 * q_len, dim] and list(o_desc.block_shape) == [64, dim]
    else:
        assert o_desc is tensors[0]


def _unequal_rows(q_len: int, kv_len: int, heads: int):
    """128 x 128 blocks, row r of each head holding r + 1 random blocks (the longest over UNEQUAL_LINES times the
    mean)."""
    layout = torch.zeros(heads, q_len // 128, kv_len // 128, dtype=torch.bool)
    for h, r in itertools.product(range(heads), range(q_len // 128)):
        layout[h, r, torch.randperm(kv_len // 128)[:r + 1]] = True
    return from_layout(layout, block=(128, 128), q_len=q_len, kv_len=kv_len)


@pytest.mark.parametrize("case, dim, q_len, kv_len", [
    ("causal", 128, 700, 700), ("causal", 64, 1000, 1000), ("causal", 128, 300, 1000), ("causal", 256, 1024, 512),
    ("unequal-rows", 128, 768, 768), ("dense", 128, 700, 700), ("butterfly", 128, 1024, 1024)])
def test_the_gluon_forward_schedules_rows_of_unequal_lengths(case, dim, q_len, kv_len, monkeypatch):
    """CAUSAL and SPARSE rows of unequal lengths (SCHEDULED): every work item in the schedule once, and no program's
    key tiles more than the longest item's past the mean (greedy list scheduling's bound), the schedule one of the
    plan's tensors (which replays launch with as they are); DENSE and SPARSE rows of equal lengths: items pid,
    pid + programs, ... (no schedule)."""
    monkeypatch.setattr(forward_gluon, "multiprocessors", lambda device: 5)
    q = torch.randn(2, 4, q_len, dim, dtype=torch.bfloat16)
    k = torch.randn(2, 4, kv_len, dim, dtype=torch.bfloat16)
    mask = _unequal_rows(q_len, kv_len, 4) if case == "unequal-rows" else make(case, q_len, kv_len)
    plan = LaunchPlan(q, k, mask, False, dim ** -0.5, None)
    grid, tensors, scalars, constexprs = forward_gluon._arguments(
        plan, q, k, k, torch.empty_like(q), torch.empty(q.shape[:3]), plan.key_lengths_arg(None),
        plan.mods_table(plan.captures(None)))
    programs, n_items = grid[0], scalars[-3]
    assert programs == 5 and constexprs["SCHEDULED"] == (case in ("causal", "unequal-rows"))
    if not constexprs["SCHEDULED"]:
        return
    block_m, key_tile = constexprs["WARPGROUPS"] * 64, constexprs["BLOCK_N"]
    m_tiles = -(-q_len // block_m)
    if case == "causal":  # the keys up to each query tile's last row
        row_tiles = [-(-min(kv_len, (t + 1) * block_m) // key_tile) for t in range(m_tiles)]
        tiles = torch.tensor(row_tiles).repeat(2 * 4)
    else:
        tiles = mask.layout.sum(-1).expand(2, 4, -1).flatten()  # 128 x 128 blocks: a key tile a block
    _assert_greedy_schedule(tensors[-3].tolist(), programs, n_items, tiles, forward_gluon.ITEM_COST)
    assert any(t is tensors[-3] for t in plan.tensors)


def _assert_greedy_schedule(schedule: list[int], programs: int, n_items: int, tiles: torch.Tensor, item_cost: float):
    """A ``work_schedule`` table lists every item once, and its programs' loads (tiles, at least one an item, and
    item_cost each) keep greedy list scheduling's bound: none past the mean by more than the longest item's cost."""
    starts, items = schedule[:programs + 1], schedule[programs + 1:]
    assert starts[0] == programs + 1 and starts[-1] == len(schedule) and sorted(items) == list(range(n_items))
    costs = tiles.clamp(min=1) + item_cost
    loads = [sum(costs[item].item() for item in schedule[starts[p]:starts[p + 1]]) for p in range(programs)]
    assert max(loads) - sum(loads) / programs <= costs.max().item(), loads


def test_gluon_backward_auto_takes_rows_of_many_keys(monkeypatch):
    mask = make("dense", 256)
    monkeypatch.delenv("SPARSEFLASH_GLUON", raising=False)
    for dim, many in backward_gluon.AUTO_ROW_KEYS.items():  # head dims in parts among them
        assert backward_gluon.applies(*_plan_inputs(dim=dim), mask, many, False, False), dim
        assert not backward_gluon.applies(*_plan_inputs(dim=dim), mask, many - 64, False, False), dim
    assert set(backward_gluon.AUTO_ROW_KEYS) == set(backward_gluon.TILES)
    monkeypatch.setenv("SPARSEFLASH_GLUON", "1")
    assert backward_gluon.applies(*_plan_inputs(dim=64), mask, 256, False, False)
    monkeypatch.setenv("SPARSEFLASH_GLUON", "0")
    assert not backward_gluon.applies(*_plan_inputs(), mask, backward_gluon.AUTO_ROW_KEYS[128], False, False)


def test_the_gluon_kernels_compile_for_hopper_without_a_gpu(tmp_path):
    """Each case of ``sm90_compile.cases`` (forward at head dims 48-256, backward at 48-256, causal,
    ALiBi, soft-capping, a document mask_mod with rows of unequal lengths) compiles through ptxas for sm_90a from the
    arguments its ``launch`` builds, in a child process without the interpreter: what a run without a GPU can
    check of kernels it cannot run (an argument the kernel does not take, a name it does not define, a helper
    Gluon cannot compile, tiles and stages past an H100's shared memory, products ptxas serializes for want of
    registers)."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "triton"),
           "SPARSEFLASH_CACHE_DIR": str(tmp_path / "sparseflash")}
    result = subprocess.run([sys.executable, "-m", "tests.attention.sm90_compile"], cwd=Path(__file__).parents[2],
                            env=env, capture_output=True, text=True, timeout=900)
    compiled = {line.split()[1] for line in result.stdout.splitlines() if line.startswith("compiled ")}
    assert result.returncode == 0 and compiled == set(sm90_compile.cases()), result.stderr[-4000:]


def test_no_gluon_kernels_off_a_gpu(monkeypatch):
    """The interpreter runs no Gluon: a plan on the CPU takes the Triton kernels whatever the shapes."""
    monkeypatch.setenv("SPARSEFLASH_GLUON", "1")
    q, k = _plan_inputs()
    assert not gluon_hopper(q.device)
    plan = LaunchPlan.of(q, k, make("dense", 256), False, 128 ** -0.5)
    assert not plan.gluon_forward and not plan.gluon_backward


def test_a_layout_tma_cannot_read_launches_nothing():
    """``launch`` returns False (the Triton kernel runs) for a head dim that is not contiguous."""
    q = torch.randn(1, 2, 256, 128, 2, dtype=torch.bfloat16)[..., 0]
    assert q.stride(3) == 2
    plan = LaunchPlan.of(q, q, make("dense", 256), False, 128 ** -0.5)
    mods = plan.mods_table([])
    assert not forward_gluon.launch(plan, q, q, q, torch.empty_like(q), torch.empty(1, 2, 256), plan.placeholder, mods)
    stats = torch.empty(2, 256)
    grads = [torch.empty(q.shape, dtype=q.dtype) for _ in range(3)]
    assert not backward_gluon.launch(plan, q, q, q, q, stats, stats, *grads, plan.placeholder, mods, 256)


@pytest.mark.parametrize("case", ["expanded", "pooled", "overlapping-rows", "strided-columns"])
def test_layouts_tma_cannot_read_have_no_row_view(case):
    """``row_view_rows`` says None (the caller falls back or copies) instead of failing, for the gradients
    autograd expands (o.sum(): every stride 0; o.sum(2): the sequence's), rows that overlap and columns
    that are not contiguous."""
    x = {"expanded": lambda: torch.ones(()).expand(2, 4, 256, 128),
         "pooled": lambda: torch.ones(2, 4, 1, 128).expand(2, 4, 256, 128),
         "overlapping-rows": lambda: torch.empty(4096).as_strided((1, 1, 256, 128), (0, 0, 8, 1)),
         "strided-columns": lambda: torch.empty(2, 4, 256, 256)[..., ::2]}[case]()
    assert row_view_rows(x) is None


def test_deterministic_algorithms_keep_the_triton_backward():
    """Under ``torch.use_deterministic_algorithms(True)`` the Gluon backward launches nothing (its dQ adds
    land in any order), before it looks at the inputs."""
    q = torch.randn(1, 2, 256, 128, dtype=torch.bfloat16)
    plan = LaunchPlan.of(q, q, make("dense", 256), False, 128 ** -0.5)
    stats = torch.empty(2, 256)
    grads = [torch.empty(q.shape, dtype=q.dtype) for _ in range(3)]
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert not backward_gluon.launch(plan, q, q, q, q, stats, stats, *grads, plan.placeholder, plan.mods_table([]),
                                         256)
    finally:
        torch.use_deterministic_algorithms(before)


def test_a_launch_key_tells_descriptors_by_dtype_and_box():
    """Two TMA descriptors over tensors of one dtype key alike where their boxes agree, apart where not; a
    stand-in for an output keys as a tensor does."""
    x = torch.empty(2, 4, 256, 128, dtype=torch.bfloat16)
    y = torch.empty(2, 4, 512, 128, dtype=torch.bfloat16)
    assert Launcher._tensor_key(gluon_tools.row_view(x, 2048, 128)) == Launcher._tensor_key(
        gluon_tools.row_view(y, 4096, 128))
    assert Launcher._tensor_key(gluon_tools.row_view(x, 2048, 64)) != Launcher._tensor_key(
        gluon_tools.row_view(x, 2048, 128))
    assert Launcher._tensor_key(gluon_tools.row_view(x, 2048, 64))[:2] == (torch.bfloat16, (64, 128))
    assert Launcher._tensor_key(Standin(torch.bfloat16, (2, 4, 256, 128))) == (torch.bfloat16, True)


@pytest.mark.parametrize("dim, parts", [(96, (64, 32)), (80, (64, 16)), (192, (128, 64)), (128, (128, 0))],
                         ids=lambda value: str(value))
def test_the_gluon_forward_reads_a_box_per_part_of_the_head_dim(dim, parts):
    """The launch's descriptors and constexprs: Q, K and V each in boxes of the first part's width, then of the
    second's (the same descriptors again without a second part), rows of 64 queries and KEY_TILE keys; HEAD_DIM and
    HEAD_DIM2 the parts."""
    q = torch.randn(2, 4, 256, dim, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 256, dim, dtype=torch.bfloat16)
    plan = LaunchPlan(q, k, make("causal", 256), False, dim ** -0.5, None)
    grid, tensors, scalars, constexprs = forward_gluon._arguments(
        plan, q, k, k, torch.empty_like(q), torch.empty(q.shape[:3]), plan.placeholder, plan.placeholder)
    first, second = parts
    key_tile = forward_gluon.KEY_TILE[dim]
    boxes = [list(d.block_shape) for d in tensors[:6]]
    assert boxes[:3] == [[64, first], [key_tile, first], [key_tile, first]]
    if second:
        assert boxes[3:] == [[64, second], [key_tile, second], [key_tile, second]]
    else:
        assert all(a is b for a, b in zip(tensors[:3], tensors[3:6]))
    assert (constexprs["HEAD_DIM"], constexprs["HEAD_DIM2"]) == parts and sum(parts) == dim


@pytest.mark.parametrize("dim, parts, dq_boxes", [(48, (32, 16), ([64, 32], [64, 16])),
                                                  (80, (64, 16), ([64, 64], [64, 16])),
                                                  (96, (64, 32), ([64, 64], [64, 32])),
                                                  (64, (64, 0), ([64, 64], [64, 64])),
                                                  (128, (128, 0), ([64, 64], [64, 64])),
                                                  (160, (128, 32), ([64, 64], [64, 32])),
                                                  (192, (128, 64), ([64, 64], [64, 64])),
                                                  (256, (128, 128), ([64, 64], [64, 64]))],
                         ids=lambda value: str(value))
def test_the_gluon_backward_reads_a_box_per_part_of_the_head_dim(dim, parts, dq_boxes):
    """The launch's kernel, descriptors and constexprs: Q, K, V and dO each in boxes of the first part's width, then
    of the second's (the same descriptors again without a second part), BLOCK_M queries and 64 keys; dQ's
    accumulator in the boxes of the consumers' dQ tiles (a part each, or at 128 half the columns each; at 160-256,
    whose warpgroups split the columns, chunks of at most 64); HEAD_DIM and HEAD_DIM2 the parts; the wide kernel's
    dO and dQ staging buffers by head dim (one each at 256, where two would not fit shared memory); dK's and dV's
    descriptors (stored by TMA) in boxes of 64 keys and each part's columns, q's in their place at 160-256 (unused)."""
    q = torch.randn(2, 4, 256, dim, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 256, dim, dtype=torch.bfloat16)
    plan = LaunchPlan(q, k, make("causal", 256), False, dim ** -0.5, None)
    stats = torch.zeros(8, 256)
    dq_acc = backward_gluon.accumulator(plan, q)
    dk, dv = torch.empty_like(k), torch.empty_like(k)
    kernel, (grid, tensors, scalars, constexprs) = backward_gluon._arguments(
        plan, q, k, k, torch.randn_like(q), (stats, stats), dq_acc, dk, dv, plan.placeholder, plan.placeholder, 256)
    wide = dim in backward_gluon.WIDE
    assert kernel is (backward_gluon.BACKWARD_GLUON_WIDE if wide else backward_gluon.BACKWARD_GLUON)
    assert grid == (2 * 2 * 256 // backward_gluon.KEY_TILE[dim],)
    first, second = parts
    block_m = backward_gluon.BLOCK_M[dim]
    boxes = [list(d.block_shape) for d in tensors[:10]]
    assert boxes[:4] == [[block_m, first], [64, first], [64, first], [block_m, first]]
    if second:
        assert boxes[4:8] == [[block_m, second], [64, second], [64, second], [block_m, second]]
    else:
        assert all(a is b for a, b in zip(tensors[:4], tensors[4:8]))
    assert tuple(boxes[8:10]) == dq_boxes and dq_acc.shape == (2 * 4 * 256, dim)
    assert tensors[8].base is dq_acc and tensors[9].base is dq_acc
    assert tensors[12] is dk and tensors[13] is dv
    if wide:
        assert all(d is tensors[0] for d in tensors[14:18])
    else:
        assert all(d.base is x for d, x in zip(tensors[14:18], (dk, dk, dv, dv)))
        assert list(tensors[14].shape) == [2 * 2 * 256, dim]
        assert [list(d.block_shape) for d in tensors[14:18]] == [[64, first], [64, second or first]] * 2
    assert (constexprs["HEAD_DIM"], constexprs["HEAD_DIM2"]) == parts and sum(parts) == dim
    buffers = (constexprs.get("DO_STAGES"), constexprs.get("DQ_BUFFERS"))
    assert buffers == ({256: (1, 1)}.get(dim, (2, 2)) if wide else (None, None)), buffers
