"""Triton kernels against the reference: forward, lse and the three gradients.

On CPU the kernels run under TRITON_INTERPRET=1 (set by conftest) on small shapes. The ``gpu``
tests run the same comparisons at realistic sizes on CUDA, and also against FlexAttention. On Hopper,
long rows take the Gluon kernels by default; these tests keep to the Triton ones (test_gluon.py tests
the others).
"""

from __future__ import annotations

import pytest
import torch

from sparseflash.attention.score_mods import make_score_mod
from sparseflash.attention.triton.plan import head_dim_parts
from sparseflash.masks import make
from tests.helpers import REL_TOL as TOL
from tests.helpers import assert_close, assert_dkdv_query_rows, attention_with_grads, check_backend, dkdv_query_rows


@pytest.fixture(autouse=True)
def triton_kernels_only(monkeypatch):
    monkeypatch.setenv("SPARSEFLASH_GLUON", "0")


def _mask(kind: str, q_len: int, kv_len: int, heads: int):
    """One mask of each kind the kernels specialise on, with small blocks for the interpreter."""
    if kind == "dense":
        return make("dense", q_len, kv_len, block=32)
    if kind == "causal":
        return make("causal", q_len, kv_len, block=64)
    if kind == "butterfly":
        return make("butterfly", q_len, kv_len, block=(32, 64))
    if kind == "local-causal":
        return make("local", q_len, kv_len, block=(64, 32), causal=True, window=1)
    if kind == "random-per-head":
        return make("random", q_len, kv_len, block=16, heads=heads, density=0.3)
    if kind == "bigbird":
        return make("bigbird", q_len, kv_len, block=32, heads=heads, window=1, global_blocks=1)
    if kind == "random-256x16":  # the largest query blocks, the smallest key blocks
        return make("random", q_len, kv_len, block=(256, 16), heads=heads, density=0.5)
    if kind == "local-16x128":
        return make("local", q_len, kv_len, block=(16, 128), window=1)
    if kind == "empty-rows":  # the first query block sees nothing
        layout = torch.ones(heads, -(-q_len // 32), -(-kv_len // 32), dtype=torch.bool)
        layout[:, 0] = False
        from sparseflash.masks import from_layout

        return from_layout(layout, block=32, q_len=q_len, kv_len=kv_len)
    if kind == "causal-below-diagonal":  # causal, but only blocks wholly below the diagonal: no partial one
        from sparseflash.masks import from_layout

        n = -(-q_len // 32)
        return from_layout(torch.ones(n, n, dtype=torch.bool).tril(-1), block=32, q_len=q_len, kv_len=kv_len,
                           causal=True)
    raise ValueError(kind)


def _inputs(batch, heads, kv_heads, q_len, kv_len, dim, dtype, device):
    q = torch.randn(batch, heads, q_len, dim, dtype=dtype, device=device)
    k = torch.randn(batch, kv_heads, kv_len, dim, dtype=dtype, device=device)
    v = torch.randn(batch, kv_heads, kv_len, dim, dtype=dtype, device=device)
    do = torch.randn(batch, heads, q_len, dim, dtype=dtype, device=device)
    return q, k, v, do


def _compare(kind, q_len, kv_len, dim, dtype, gqa, key_lengths, device, batch=2, heads=4):
    kv_heads = heads // 2 if gqa else heads
    q, k, v, do = _inputs(batch, heads, kv_heads, q_len, kv_len, dim, dtype, device)
    mask = _mask(kind, q_len, kv_len, heads)
    lengths = None
    if key_lengths == "cut":  # key lengths inside the sequence: blocks partly and wholly past them
        lengths = torch.tensor([kv_len * 2 // 3 + 1, 17][:batch], device=device)
    elif key_lengths:  # one full batch row and one with no key at all
        lengths = torch.tensor([kv_len, 0][:batch], device=device)
    got = check_backend("triton", q, k, v, mask, do, lengths)
    if key_lengths is True:  # the padded batch row: output 0, lse -inf, gradients 0
        assert torch.all(got[0][1] == 0) and torch.all(got[1][1] == float("-inf"))
        assert all(torch.all(g[1] == 0) for g in got[2:])
    if kind == "empty-rows":
        assert torch.all(got[0][:, :, :32] == 0) and torch.all(got[2][:, :, :32] == 0)


CPU_CASES = [
    # kind, q_len, kv_len, dim, dtype, gqa, key_lengths
    ("dense", 63, 63, 8, torch.float16, False, False),
    ("dense", 111, 111, 64, torch.bfloat16, True, True),
    ("causal", 111, 111, 64, torch.float16, False, False),
    ("causal", 100, 37, 8, torch.bfloat16, True, True),
    ("causal", 37, 100, 128, torch.float16, False, False),
    ("butterfly", 111, 111, 8, torch.bfloat16, False, False),
    ("butterfly", 63, 130, 64, torch.float16, True, True),
    ("local-causal", 111, 111, 64, torch.float16, True, False),
    ("local-causal", 130, 63, 8, torch.bfloat16, False, True),
    ("random-per-head", 111, 111, 8, torch.float16, True, True),
    ("random-per-head", 63, 111, 128, torch.bfloat16, False, False),
    ("bigbird", 111, 111, 64, torch.bfloat16, False, True),
    ("empty-rows", 100, 100, 8, torch.float16, False, False),
    ("dense", 63, 63, 40, torch.float32, False, False),
    ("causal", 45, 45, 1, torch.float16, False, True),
    ("random-per-head", 70, 70, 256, torch.bfloat16, True, False),
    ("butterfly", 100, 100, 24, torch.float32, True, True),
    ("random-256x16", 300, 200, 16, torch.float16, True, True),
    ("local-16x128", 150, 290, 16, torch.bfloat16, False, False),
    ("butterfly", 111, 200, 64, torch.bfloat16, True, "cut"),
    ("random-per-head", 130, 130, 16, torch.float16, False, "cut"),
    ("bigbird", 100, 150, 8, torch.float16, True, "cut"),
    ("causal", 150, 150, 16, torch.bfloat16, False, "cut"),
    ("local-16x128", 150, 290, 32, torch.float16, True, "cut"),  # a full block of several key tiles across the end
    # lengths that the tiles divide: the kernels' EVEN_LENGTHS variant, which loads without bounds
    ("dense", 64, 128, 64, torch.bfloat16, True, "cut"),
    ("dense", 96, 64, 16, torch.float16, False, False),
    ("causal", 96, 96, 16, torch.float16, False, True),
    ("causal", 128, 64, 32, torch.bfloat16, True, False),
    # head dims the forward computes as two parts (plan.head_dim_parts): exactly (96 = 64 + 32,
    # 48 = 32 + 16), and with the second part padded (72 in 64 + 16), EVEN_LENGTHS and ragged
    ("causal", 111, 111, 96, torch.bfloat16, True, False),
    ("butterfly", 63, 100, 48, torch.float16, False, True),
    ("dense", 64, 64, 72, torch.bfloat16, True, "cut"),
    ("random-per-head", 70, 90, 72, torch.float32, False, False),
]


def _case_id(case) -> str:
    kind, q_len, kv_len, dim, dtype, gqa, key_lengths = case
    return "-".join([kind, f"sq{q_len}", f"skv{kv_len}", f"d{dim}", str(dtype).removeprefix("torch."),
                     "gqa" if gqa else "mha", {True: "keylen", "cut": "keylen-cut", False: "nokeylen"}[key_lengths]])


@pytest.mark.parametrize("case", CPU_CASES, ids=_case_id)
def test_triton_matches_reference(case):
    _compare(*case, device="cuda" if torch.cuda.is_available() else "cpu")


QUERY_ROWS_CASES = [  # mask blocks of at least 16 keys x 32 queries, so that the pinned tiles stay uneven
    ("causal", 111, 111, 64, torch.bfloat16, True, "cut"),
    ("local-causal", 130, 63, 8, torch.bfloat16, False, True),
    ("butterfly", 63, 130, 64, torch.float16, True, True),
    ("dense", 63, 63, 40, torch.float32, False, False),
    ("empty-rows", 100, 100, 8, torch.float16, False, False),
    ("causal", 111, 111, 96, torch.bfloat16, True, False),  # 64 + 32 columns: the fused backward
    ("causal", 70, 70, 200, torch.bfloat16, True, True),  # padded to 256 columns: dK/dV and dQ launches
]


@pytest.mark.parametrize("case", QUERY_ROWS_CASES, ids=_case_id)
def test_dkdv_score_tiles_with_queries_along_rows_match_reference(case, monkeypatch):
    """dK/dV programs that stream more queries than they hold keys compute their score tiles query-major
    (QUERY_ROWS, the head-dim-256 configs on a GPU): every mask kind, GQA, ragged and cut key lengths."""
    from sparseflash.attention.triton import tuning

    dkdv_query_rows(monkeypatch)
    with tuning.recording() as launched:
        _compare(*case, device="cuda" if torch.cuda.is_available() else "cpu")
    assert_dkdv_query_rows(launched)


def test_forward_head_dim_parts():
    """For every head dim 1-256: two parts where two powers of two >= 16 cover it with fewer columns
    than its padding, one padded part otherwise; D_PADDED exactly where the columns exceed it."""
    powers = (16, 32, 64, 128, 256)
    for dim in range(1, 257):
        parts = head_dim_parts(dim)
        padded = min(p for p in powers if p >= dim)
        first, second = parts["HEAD_DIM"], parts["HEAD_DIM2"]
        assert first in powers and second in (0, *powers), (dim, parts)
        assert dim <= first + second <= padded and parts["D_PADDED"] == (first + second != dim), (dim, parts)
        would_save = any(dim <= a + b < padded for a in powers for b in powers)
        assert (second > 0) == would_save, (dim, parts)


@pytest.mark.parametrize("dim, parts", [(96, (64, 32)), (72, (64, 16)), (128, (128, 0))], ids=["d96", "d72", "d128"])
@pytest.mark.parametrize("q_len", [40, 3], ids=["forward", "decode"])
def test_the_forward_launches_with_the_head_dim_parts(dim, parts, q_len, monkeypatch):
    """The regular and decode forwards and the backward run the split variant where head_dim_parts
    splits (the comparisons above would pass padded too); the kernels around them pad."""
    from sparseflash.attention.triton.launch import Launcher

    launched = {}
    real_call = Launcher.__call__

    def spy(self, grid, tensors, scalars, constexprs):
        launched[self.kernel.__name__] = (constexprs.get("HEAD_DIM"), constexprs.get("HEAD_DIM2"))
        return real_call(self, grid, tensors, scalars, constexprs)

    monkeypatch.setattr(Launcher, "__call__", spy)
    q, k, v, do = _inputs(1, 2, 1, q_len, 50, dim, torch.bfloat16, "cpu")
    check_backend("triton", q, k, v, make("causal", q_len, 50, block=16), do)
    assert launched.pop("_attn_fwd" if q_len > 16 else "_attn_fwd_decode") == parts
    assert launched.pop("_attn_bwd") == parts
    assert all(dims in ((128, None), (None, None)) for dims in launched.values()), launched


@pytest.mark.gpu
@pytest.mark.parametrize("case", CPU_CASES, ids=_case_id)
def test_gpu_odd_shapes(case):
    """The interpreter's grid (ragged lengths, S_q != S_kv, blocks of 16 to 256, empty rows, padded
    head dims, fp32, key_lengths) through the compiled kernels, where `pytest -m gpu` selects it."""
    _compare(*case, device="cuda")


def test_non_contiguous_inputs():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = torch.randn(2, 111, 4, 3 * 64, dtype=torch.float16, device=device)
    q, k, v = (base[..., i * 64:(i + 1) * 64].transpose(1, 2) for i in range(3))  # (B, H, S, D) views
    assert not q.is_contiguous()
    mask = make("butterfly", 111, block=32)
    do = torch.randn_like(q)
    check_backend("triton", q, k, v, mask, do)


def test_gradient_through_lse():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    import sparseflash

    q, k, v, _ = _inputs(1, 2, 2, 63, 63, 16, torch.float16, device)
    mask = make("random", 63, block=16, density=0.5)
    grads = []
    for backend in ("triton", "reference"):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        _, lse = sparseflash.attention(*leaves, mask, backend=backend, return_lse=True)
        grads.append(torch.autograd.grad(lse.sum(), leaves, allow_unused=True, materialize_grads=True))
    for name, a, b in zip(("dq", "dk"), *grads):
        assert_close(a, b, TOL[torch.float16], f"{name} through lse")
    assert torch.all(grads[0][2] == 0), "lse does not depend on v"


# --------------------------------------------------------------------- the persistent forward
PERSISTENT_CASES = {
    # id: (mask kind, q_len = kv_len, dim, gqa, layout, expected to run the persistent kernel)
    "dense-s128-d16-mha": ("dense", 128, 16, False, "contiguous", True),
    "dense-s128-d64-gqa": ("dense", 128, 64, True, "contiguous", True),
    "butterfly-s128-d32-gqa": ("butterfly", 128, 32, True, "contiguous", True),
    "random-per-head-s96-d16-mha": ("random-per-head", 96, 16, False, "contiguous", True),
    "empty-rows-s128-d16-mha": ("empty-rows", 128, 16, False, "contiguous", True),
    "causal-below-diagonal-s128-d16-mha": ("causal-below-diagonal", 128, 16, False, "contiguous", True),
    "butterfly-s128-d32-bshd": ("butterfly", 128, 32, False, "bshd", True),  # heads side by side in a row
    "butterfly-s128-d32-misaligned": ("butterfly", 128, 32, False, "misaligned", False),  # TMA cannot read it
    "causal-s128-d16-gqa": ("causal", 128, 16, True, "contiguous", True),
    "causal-s128-d32-bshd": ("causal", 128, 32, False, "bshd", True),
    "local-causal-s128-d16-mha": ("local-causal", 128, 16, False, "contiguous", True),  # causal partial tiles
    "sliding-window-s128-d32-gqa": ("sliding-window", 128, 32, True, "contiguous", True),  # mask_mod partial tiles
    "causal-alibi-s128-d16-mha": ("causal-alibi", 128, 16, False, "contiguous", True),  # a score function
    "butterfly-window-s96-d16-bshd": ("butterfly-window", 96, 16, False, "bshd", True),  # layout & mask_mod
    "sliding-window-s111-d16-mha": ("sliding-window", 111, 16, False, "contiguous", False),  # ragged tiles
    "dense-s111-d16-mha": ("dense", 111, 16, False, "contiguous", False),  # a ragged tail
    "butterfly-s128-d40-mha": ("butterfly", 128, 40, False, "contiguous", False),  # padded head dim
}


def _layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """x (B, H, S, D) with the same values in another memory layout."""
    if layout == "contiguous":
        return x
    batch, heads, seq, dim = x.shape
    if layout == "bshd":
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    storage = torch.empty(batch, seq, heads, dim + 1, dtype=x.dtype, device=x.device)  # misaligned
    out = storage[..., 1:].transpose(1, 2)
    out.copy_(x)
    return out


@pytest.mark.parametrize("case", list(PERSISTENT_CASES), ids=str)
def test_persistent_forward_matches_reference(case, monkeypatch):
    """SPARSEFLASH_PERSISTENT=1: the persistent forward where it applies (then the backward), against
    the reference; the problems it cannot take fall back to the other kernel."""
    from sparseflash.attention.triton import tuning

    kind, seq_len, dim, gqa, layout, persistent = PERSISTENT_CASES[case]
    monkeypatch.setenv("SPARSEFLASH_PERSISTENT", "1")
    tuning.forget()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, do = (_layout(x, layout) for x in _inputs(2, 4, 2 if gqa else 4, seq_len, seq_len, dim,
                                                          torch.float16, device))
    score_mod = None
    if kind == "sliding-window":
        mask = make("sliding_window", seq_len, block=32, window=23, causal=gqa, device=device)
    elif kind == "butterfly-window":
        mask = make("butterfly", seq_len, block=32, device=device) & make("sliding_window", seq_len, block=32,
                                                                            window=40, device=device)
    elif kind == "causal-alibi":
        mask, score_mod = make("causal", seq_len, block=64), make_score_mod("alibi", 4).to(device)
    else:
        mask = _mask(kind, seq_len, seq_len, 4)
    with tuning.recording() as launched:
        got = check_backend("triton", q, k, v, mask, do, score_mod=score_mod)
    assert launched[0].kernel == "forward" and launched[0].config.persistent is persistent
    if kind == "empty-rows":
        assert torch.all(got[0][:, :, :32] == 0) and torch.all(got[1][:, :, :32] == float("-inf"))


@pytest.mark.parametrize("dtype, key_lengths", [(torch.bfloat16, False), (torch.float16, True)],
                         ids=["bf16-interpreter", "key-lengths"])
def test_persistent_forward_not_taken(dtype, key_lengths, monkeypatch):
    """key_lengths keep the other kernel, and so does bf16 under the interpreter (whose TMA loads
    corrupt bf16); on a Hopper GPU bf16 takes the persistent one."""
    from sparseflash.attention.triton import forward_persistent, tuning

    monkeypatch.setenv("SPARSEFLASH_PERSISTENT", "1")
    tuning.forget()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, do = _inputs(2, 4, 4, 128, 128, 16, dtype, device)
    lengths = torch.tensor([100, 128], device=device) if key_lengths else None
    mask = _mask("butterfly", 128, 128, 4)
    with tuning.recording() as launched:
        check_backend("triton", q, k, v, mask, do, lengths)
    on_hopper = device == "cuda" and forward_persistent._supported(q.device)
    assert launched[0].config.persistent is (on_hopper and not key_lengths)


# ------------------------------------------------------------------------------ GPU, realistic sizes
GPU_PATTERNS = {
    "dense": {}, "causal": {}, "butterfly": {}, "local": {"window": 2}, "random": {"density": 0.25},
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("dim", [64, 128], ids=["d64", "d128"])
@pytest.mark.parametrize("seq_len", [1000, 4096], ids=["s1000", "s4096"])
@pytest.mark.parametrize("pattern", list(GPU_PATTERNS))
def test_gpu_matches_reference(pattern, seq_len, dim, dtype):
    heads = 8
    q, k, v, do = _inputs(2, heads, heads // 2, seq_len, seq_len, dim, dtype, "cuda")
    mask = make(pattern, seq_len, block=128, heads=heads, **GPU_PATTERNS[pattern])
    lengths = torch.tensor([seq_len, seq_len // 3 + 1], device="cuda")
    check_backend("triton", q, k, v, mask, do, lengths)


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", list(GPU_PATTERNS))
def test_gpu_long_sequences(pattern):
    """S = 16384 (the benchmark's longest) against the reference: one batch row, two query heads
    on one key/value head, the last 999 keys masked by key_lengths (S x S fp32 scores: ~2 GB each)."""
    seq_len = 16384
    q, k, v, do = _inputs(1, 2, 1, seq_len, seq_len, 128, torch.bfloat16, "cuda")
    mask = make(pattern, seq_len, block=128, **GPU_PATTERNS[pattern])
    lengths = torch.tensor([seq_len - 999], device="cuda")
    got = attention_with_grads("triton", q, k, v, mask, do, lengths)
    want = attention_with_grads("reference", q, k, v, mask, do, lengths)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        assert_close(a, b, TOL[torch.bfloat16], name)


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [1, 40, 80, 96, 160, 192, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("pattern", ["causal", "butterfly"])
def test_gpu_padded_head_dims(pattern, dim):
    q, k, v, do = _inputs(2, 4, 2, 1000, 1000, dim, torch.bfloat16, "cuda")
    check_backend("triton", q, k, v, make(pattern, 1000, block=128), do)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel, dim", [("forward", 96), ("forward", 160), ("forward", 200), ("backward", 96),
                                         ("backward", 160), ("dkdv", 200), ("dq", 200)], ids=lambda x: str(x))
@pytest.mark.parametrize("pattern", ["dense", "causal"])
def test_gpu_every_candidate_of_the_wide_head_dims(pattern, kernel, dim):
    """Each candidate config of ``kernel`` (a tuner may pick any of them), pinned in turn, against the
    reference: the lists of 96 columns (64 + 32), 192 (160 as 128 + 32) and 256 (200, padded: the dK/dV
    and dQ launches); GQA, a ragged length."""
    from sparseflash.attention.triton import tuning
    from sparseflash.attention.triton.plan import LaunchPlan

    q, k, v, do = _inputs(2, 4, 2, 1000, 1000, dim, torch.bfloat16, "cuda")
    mask = make(pattern, 1000, block=128)
    key = LaunchPlan.of(q, k, mask, False, dim ** -0.5).config_key
    for cfg in tuning.candidates(kernel, key):
        tuning.pin(kernel, key, cfg)
        try:
            with tuning.recording() as launched:
                check_backend("triton", q, k, v, mask, do)
        finally:
            tuning.forget()
        assert (kernel, cfg) in {(entry.kernel, entry.config) for entry in launched}, f"{cfg} was not launched"


@pytest.mark.gpu
def test_gpu_relaunch_across_layouts():
    """``Launcher`` reuses a compiled kernel only for the specialisation it was compiled for: one
    mask and shape called with contiguous, strided and misaligned (offset by one element) inputs in
    turn, then contiguous again, each against the reference (forward and gradients)."""
    mask = make("butterfly", 1000, block=128)
    base = torch.randn(2, 1000, 4, 3 * 64 + 1, dtype=torch.bfloat16, device="cuda")
    layouts = {
        "contiguous": tuple(x.contiguous() for x in _inputs(2, 4, 4, 1000, 1000, 64, torch.bfloat16, "cuda")[:3]),
        "strided": tuple(base[..., i * 64:(i + 1) * 64].transpose(1, 2) for i in range(3)),
        "misaligned": tuple(base[..., 1 + i * 64:1 + (i + 1) * 64].transpose(1, 2) for i in range(3)),
    }
    assert layouts["misaligned"][0].data_ptr() % 16 != 0
    do = torch.randn(2, 4, 1000, 64, dtype=torch.bfloat16, device="cuda")
    for layout in ("contiguous", "strided", "misaligned", "contiguous"):
        check_backend("triton", *layouts[layout], mask, do)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "bshd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("dim", [64, 128], ids=["d64", "d128"])
@pytest.mark.parametrize("pattern", ["dense", "causal", "butterfly", "local", "random"])
def test_gpu_persistent_forward(pattern, dim, dtype, layout, monkeypatch):
    """The persistent, warp-specialised forward (SPARSEFLASH_PERSISTENT=1) at S=4096, GQA, against the
    reference (forward, lse and the gradients of the backward that reads its lse)."""
    from sparseflash.attention.triton import tuning

    monkeypatch.setenv("SPARSEFLASH_PERSISTENT", "1")
    tuning.forget()
    seq_len, heads = 4096, 8
    q, k, v, do = (_layout(x, layout) for x in _inputs(2, heads, heads // 2, seq_len, seq_len, dim, dtype, "cuda"))
    mask = make(pattern, seq_len, block=128, heads=heads, **GPU_PATTERNS[pattern])
    with tuning.recording() as launched:
        check_backend("triton", q, k, v, mask, do)
    assert launched[0].config.persistent


@pytest.mark.gpu
@pytest.mark.parametrize("seq_len", [4096, 16384], ids=["s4096", "s16384"])
@pytest.mark.parametrize("pattern", list(GPU_PATTERNS))
def test_gpu_matches_flex(pattern, seq_len):
    from sparseflash.attention.baselines import flex_attention

    heads, dim = 16, 128
    q, k, v, do = _inputs(16384 // seq_len, heads, heads, seq_len, seq_len, dim, torch.bfloat16, "cuda")
    mask = make(pattern, seq_len, block=128, **GPU_PATTERNS[pattern])
    got = attention_with_grads("triton", q, k, v, mask, do)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    o_flex = flex_attention(*leaves, mask)
    want = (o_flex, *torch.autograd.grad(o_flex, leaves, do))
    for name, a, b in zip(("o", "dq", "dk", "dv"), (got[0], *got[2:]), want):
        assert_close(a, b, TOL[torch.bfloat16], f"{name} vs FlexAttention")
