"""Dropout on the attention probabilities (``dropout_p``): every backend against the reference with the
same drawn pattern (o, lse, dq, dk, dv), over mask kinds, mask and score functions, GQA, key lengths,
empty rows, both low-precision dtypes and fp32, decoding shapes and torch.compile; and what a user
relies on: the same seed gives the same output and gradients bit for bit, ``dropout_p=0`` is no
dropout and draws nothing, the mean over seeds approaches the undropped output, and the generator
itself (PyTorch's Philox equals ``tl.philox``; the kept fraction is 1 - p).

On CPU the Triton kernels run under the interpreter on small shapes; the ``gpu`` tests repeat the
comparison compiled, at realistic sizes.
"""

from __future__ import annotations

import pytest
import torch

import sparseflash
from sparseflash import SparseAttention
from sparseflash.attention.dropout import ROUNDS, Dropout, kept, kept_blocks, philox
from sparseflash.attention.triton.tiles import dropout_kept_tile
from tests.attention.test_mods import _inputs, _mask
from tests.helpers import SeededDropout, attention_with_grads, check_backend, seeded

# torch's own Inductor code calls torch.jit.script_method, which warns
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
BACKENDS = ["triton", "blocked", "reference"]
CASES = [
    # kind, q_len, kv_len, dim, dtype, gqa, key_lengths, p
    ("dense", 77, 77, 16, torch.bfloat16, False, True, 0.1),
    ("causal", 100, 63, 16, torch.float16, True, False, 0.3),
    ("butterfly", 130, 130, 8, torch.float32, False, False, 0.5),
    ("document-lengths", 90, 60, 8, torch.bfloat16, False, True, 0.2),
    ("empty-rows", 100, 90, 16, torch.bfloat16, False, False, 0.25),
    ("alibi-causal", 63, 111, 8, torch.float16, True, True, 0.1),
    ("relative-bias-window", 80, 50, 8, torch.bfloat16, False, False, 0.4),
    ("decode-dense", 5, 200, 16, torch.bfloat16, True, True, 0.3),
    ("decode-causal-window", 3, 150, 16, torch.float32, False, False, 0.2),
    # head dims as two parts (48 = 32 + 16): the forward, dK/dV and dQ launches; the decode forward
    ("causal", 70, 70, 48, torch.bfloat16, True, True, 0.2),
    ("decode-dense", 4, 180, 48, torch.float16, False, False, 0.3),
]


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _case_id(case) -> str:
    kind, q_len, kv_len, dim, dtype, gqa, key_lengths, p = case
    return "-".join([kind, f"sq{q_len}", f"skv{kv_len}", f"d{dim}", str(dtype).removeprefix("torch."),
                     "gqa" if gqa else "mha", "keylen" if key_lengths else "nokeylen", f"p{p}"])


def _case_mask(kind, q_len, kv_len, batch, heads, device):
    """``(mask, score_mod)``: dense and causal by name, butterfly as a BlockMask, decoding shapes (a few
    queries against many keys: the split-KV forward), else the cases of test_mods."""
    if kind in ("dense", "decode-dense"):
        return None, None
    if kind == "causal":
        return "causal", None
    if kind == "butterfly":
        return sparseflash.masks.make("butterfly", q_len, kv_len, block=32, device=device), None
    if kind == "decode-causal-window":
        return sparseflash.masks.make("sliding_window", q_len, kv_len, block=16, window=40, causal=True,
                                      device=device), None
    return _mask(kind, q_len, kv_len, batch, heads, device)


def _run_case(case, backend, device, compiler=None, batch=2, heads=4):
    kind, q_len, kv_len, dim, dtype, gqa, key_lengths, p = case
    q, k, v, do = _inputs(batch, heads, heads // 2 if gqa else heads, q_len, kv_len, dim, dtype, device)
    mask, score_mod = _case_mask(kind, q_len, kv_len, batch, heads, device)
    lengths = torch.tensor([kv_len * 2 // 3 + 1, 0], device=device) if key_lengths else None
    dropout = SeededDropout(p, int(torch.randint(0, 2**31, ())))
    got = check_backend(backend, q, k, v, mask, do, lengths, score_mod=score_mod, compiler=compiler, dropout=dropout)
    undropped = attention_with_grads(backend, q, k, v, mask, do, lengths, score_mod=score_mod)
    seen = torch.isfinite(undropped.lse)
    assert not torch.allclose(got.o[seen], undropped.o[seen]), "dropout changed nothing"
    assert torch.equal(got.lse, undropped.lse), "lse is that of the scores, without dropout"
    if key_lengths:  # batch element 1 sees no key: its rows stay 0 with dropout too
        assert torch.all(got.o[1] == 0) and torch.all(got.dq[1] == 0)
    if kind == "empty-rows":
        assert torch.all(got.o[:, :, 10:50] == 0) and torch.all(got.dq[:, :, 10:50] == 0)
    return got


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_dropout_matches_reference(case, backend, monkeypatch):
    from sparseflash.attention.api import resolve_mask
    from sparseflash.attention.triton import forward_decode
    from sparseflash.attention.triton.plan import LaunchPlan
    from sparseflash.attention.triton.tuning import planned

    monkeypatch.setattr(forward_decode, "SPLIT_MIN_TILES", 1)  # decoding: split the small shapes' rows too
    _run_case(case, backend, "cpu")
    if case[0] == "decode-dense" and backend == "triton":  # the split forward's shares drop their own scores
        q, k = torch.empty(2, 4, case[1], case[3]), torch.empty(2, 2, case[2], case[3])
        plan = LaunchPlan.of(q, k, resolve_mask(None, case[1], case[2], 4), True, case[3] ** -0.5, None, True)
        assert forward_decode.splits(plan, planned("decode", plan.config_key), q.device) > 1


@pytest.mark.parametrize("tiles", [(64, 16), (16, 64)], ids=lambda t: f"tiles{t[0]}x{t[1]}")
@pytest.mark.parametrize("head_dim", [16, 72], ids=["d16-dkdv-and-dq-launches", "d72-fused-backward"])
def test_kernel_tiles_other_than_the_interpreters(head_dim, tiles):
    """The interpreter's kernels run 32x32 tiles; pinned configs run taller and wider ones (with 16-key
    tiles, which draw score by score), and head_dim 72 (64 + 16 columns) the fused backward."""
    from sparseflash.attention.triton import tuning
    from sparseflash.attention.triton.plan import LaunchPlan

    q, k, v, do = _inputs(1, 4, 2, 80, 112, head_dim, torch.bfloat16)
    mask = sparseflash.masks.make("butterfly", 80, 112, block=64)
    key = LaunchPlan.of(q, k, mask, False, head_dim ** -0.5, None, True).config_key
    for kernel in ("forward", "dq", "dkdv", "backward"):
        tuning.pin(kernel, key, tuning.KernelConfig(*tiles, 4, 1))
    try:
        with tuning.recording() as launched:
            check_backend("triton", q, k, v, mask, do, dropout=SeededDropout(0.2, int(torch.randint(0, 2**31, ()))))
    finally:
        tuning.forget()
    ran = {(entry.kernel, str(entry.config)) for entry in launched}
    kernels = ("forward", "backward") if head_dim == 72 else ("forward", "dkdv", "dq")
    assert ran == {(kernel, f"{tiles[0]}x{tiles[1]}/w4/s1") for kernel in kernels}, f"launched {ran}"


@pytest.mark.parametrize("backend", ["triton", "blocked"])
@pytest.mark.parametrize("case", [CASES[0], CASES[6]], ids=_case_id)
def test_compiled_dropout_matches_reference(case, backend):
    """Under torch.compile(fullgraph=True) the seed is drawn in the graph (aot_eager: as eagerly)."""
    torch._dynamo.reset()
    try:
        _run_case(case, backend, "cpu", compiler="aot_eager")
    finally:
        torch._dynamo.reset()


def test_inductor_draws_from_its_own_stream_repeatably():
    """Under Inductor the seed comes from Inductor's random stream: repeated by torch.manual_seed,
    new at each call."""
    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    run = torch.compile(lambda q, k, v: sparseflash.attention(q, k, v, "causal", dropout_p=0.3, backend="blocked"),
                        backend="inductor", fullgraph=True)
    try:
        with seeded(3, "cpu"):
            first, second = run(q, k, v), run(q, k, v)
        with seeded(3, "cpu"):
            again = run(q, k, v)
    finally:
        torch._dynamo.reset()
    assert torch.equal(first, again) and not torch.equal(first, second)
    assert not torch.allclose(first, sparseflash.attention(q, k, v, "causal", backend="blocked"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_seed_same_result_bit_for_bit(backend):
    q, k, v, do = _inputs(2, 4, 2, 70, 90, 16, torch.bfloat16, _device())
    mask = sparseflash.masks.make("butterfly", 70, 90, block=32, device=_device())
    rng_seed = int(torch.randint(0, 2**31, ()))
    first, again = (attention_with_grads(backend, q, k, v, mask, do, dropout=SeededDropout(0.3, rng_seed))
                    for _ in range(2))
    for name, a, b in zip(first._fields, first, again):
        assert torch.equal(a, b), f"{name} differs between two calls with the same seed"
    other = attention_with_grads(backend, q, k, v, mask, do, dropout=SeededDropout(0.3, rng_seed + 1))
    assert not torch.equal(first.o, other.o), "another seed gave the same output"


def _generator_state(device) -> torch.Tensor:
    """The state of torch's generator on ``device`` (the one a call's seed is drawn from)."""
    device = torch.device(device)
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_dropout_is_no_dropout_and_draws_nothing(backend):
    q, k, v, do = _inputs(2, 4, 4, 50, 50, 16, torch.float16, _device())
    plain = attention_with_grads(backend, q, k, v, "causal", do)
    zero = attention_with_grads(backend, q, k, v, "causal", do, dropout=SeededDropout(0.0, 0))
    for name, a, b in zip(plain._fields, plain, zero):
        assert torch.equal(a, b), f"{name}: dropout_p=0 differs from no dropout"
    with seeded(5, q.device):
        before = _generator_state(q.device)
        sparseflash.attention(q, k, v, dropout_p=0.0, backend=backend)
        assert torch.equal(before, _generator_state(q.device)), "dropout_p=0 drew from the generator"
        sparseflash.attention(q, k, v, dropout_p=0.1, backend=backend)
        assert not torch.equal(before, _generator_state(q.device)), "dropout_p=0.1 drew nothing"


@pytest.mark.parametrize("backend", ["triton", "blocked"])
def test_mean_over_seeds_approaches_the_undropped_output(backend):
    """E[Z / (1 - p)] = 1 for each probability, so the mean of n draws is off by ~1/sqrt(n) of one draw."""
    draws = 96
    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))
    undropped = sparseflash.attention(q, k, v, "causal", backend=backend)
    outputs = torch.stack([sparseflash.attention(q, k, v, "causal", dropout_p=0.5, backend=backend)
                           for _ in range(draws)])
    one = (outputs[0] - undropped).norm() / undropped.norm()
    mean = (outputs.mean(0) - undropped).norm() / undropped.norm()
    assert one > 0.3, f"one draw is only {one:.2f} off the undropped output"
    assert mean < 3 * one / draws ** 0.5, f"the mean of {draws} draws is {mean:.3f} off; one draw {one:.3f}"


def test_torch_philox_equals_triton_philox():
    """The PyTorch Philox the reference and blocked backends use against ``tl.philox`` (interpreted on CPU,
    compiled on a GPU), for seeds using all 64 bits and counters using all 32."""
    triton = pytest.importorskip("triton")
    tl = triton.language

    @triton.jit
    def words(SEED, C0, C1, OUT, c2, N: tl.constexpr, ROUNDS: tl.constexpr):
        offs = tl.arange(0, N)
        w0, w1, w2, w3 = tl.philox(tl.load(SEED), tl.load(C0 + offs).to(tl.uint32), tl.load(C1 + offs).to(tl.uint32),
                                   c2, 0, ROUNDS)
        tl.store(OUT + offs * 4, w0.to(tl.int64))
        tl.store(OUT + offs * 4 + 1, w1.to(tl.int64))
        tl.store(OUT + offs * 4 + 2, w2.to(tl.int64))
        tl.store(OUT + offs * 4 + 3, w3.to(tl.int64))

    device = _device()
    for seed in (0, 123456789, 2**62 + 2**33 + 5, int(torch.randint(0, 2**62, ()))):
        c0, c1 = (torch.randint(0, 2**32, (64,), dtype=torch.int64, device=device) for _ in range(2))
        got = torch.empty(64, 4, dtype=torch.int64, device=device)
        words[(1,)](torch.tensor(seed, device=device), c0, c1, got, 12345, N=64, ROUNDS=ROUNDS)
        want = torch.stack(philox(torch.tensor(seed, device=device), c0, c1, 12345, 0), -1)
        assert torch.equal(got, want), f"seed {seed}: the words differ"


@pytest.mark.parametrize("rows,cols,rows_are_queries", [
    (16, 32, True), (128, 64, True), (32, 16, True), (32, 16, False), (64, 128, False), (16, 64, False)],
    ids=["q16xk32", "q128xk64", "q32xk16-score-by-score", "k32xq16", "k64xq128", "k16xq64-score-by-score"])
def test_kernel_tiles_drop_what_single_scores_drop(rows, cols, rows_are_queries):
    """``dropout_kept_tile`` (the kernels' keep mask of a tile, queries along its rows or keys) against
    ``kept`` (PyTorch, a draw per score), at random starts (multiples of the tile's sides)."""
    triton = pytest.importorskip("triton")
    tl = triton.language

    @triton.jit
    def keep_tile(SEED, OUT, drop_row, row_start, col_start, threshold, ROWS: tl.constexpr, COLS: tl.constexpr,
                  ROWS_ARE_QUERIES: tl.constexpr):
        keep = dropout_kept_tile(tl.load(SEED), drop_row, row_start, col_start, threshold, ROWS, COLS,
                                 ROWS_ARE_QUERIES)
        tl.store(OUT + tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :], keep.to(tl.int8))

    device = _device()
    heads, b, h = 3, 1, 2
    for p in (0.1, 0.6):
        dropout = Dropout(p, torch.randint(0, 2**62, (), device=device))
        row_start, col_start = int(torch.randint(0, 64, ())) * rows, int(torch.randint(0, 64, ())) * cols
        got = torch.empty(rows, cols, dtype=torch.int8, device=device)
        keep_tile[(1,)](dropout.seed, got, b * heads + h, row_start, col_start, dropout.threshold, rows, cols,
                        rows_are_queries)
        row_idx = row_start + torch.arange(rows, device=device)[:, None]
        col_idx = col_start + torch.arange(cols, device=device)[None, :]
        q_idx, kv_idx = (row_idx, col_idx) if rows_are_queries else (col_idx, row_idx)
        want = kept(dropout, heads, torch.tensor(b, device=device), torch.tensor(h, device=device), q_idx, kv_idx)
        assert torch.equal(got.bool(), want), f"p={p}: {(got.bool() != want).sum().item()} scores differ"


@pytest.mark.parametrize("block_m,block_n", [(32, 64), (16, 32), (48, 96), (32, 16), (8, 32)],
                         ids=["32x64", "16x32", "48x96", "32x16-score-by-score", "8x32-score-by-score"])
def test_whole_tiles_drop_what_single_scores_drop(block_m, block_n):
    """``kept_blocks`` (the blocked backend's: a draw per counter, or per score for key tiles narrower
    than 32) against ``kept`` (a draw per score) on tiles at random starts (multiples of the tile), of
    several heads and batch elements."""
    dropout = Dropout(0.3, torch.randint(0, 2**62, ()))
    b, h = torch.tensor([[0], [3]]), torch.tensor([[1, 0, 5]])  # (2, 1) and (1, 3): six tiles
    q_start, kv_start = torch.randint(0, 200, (2, 3)) * block_m, torch.randint(0, 200, (2, 3)) * block_n
    tiles = kept_blocks(dropout, 8, b, h, q_start, kv_start, block_m, block_n)
    assert tiles.shape == (2, 3, block_m, block_n)
    for x in range(2):
        for y in range(3):
            q_idx = q_start[x, y] + torch.arange(block_m)[:, None]
            kv_idx = kv_start[x, y] + torch.arange(block_n)[None, :]
            assert torch.equal(tiles[x, y], kept(dropout, 8, b[x, 0], h[0, y], q_idx, kv_idx))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.01])
def test_kept_fraction_is_one_minus_p(p):
    """Over 2^20 scores the kept fraction is within 5 standard deviations of 1 - p (p rounded to 1/256),
    also in each of the sixteen positions a counter serves (query row half, key column quarter, key
    parity), and neighbouring scores are independent."""
    dropout = Dropout(p, torch.randint(0, 2**62, ()))
    assert abs(dropout.threshold / 256 - p) <= 1 / 512
    keep_p = 1 - dropout.threshold / 256
    q_idx, kv_idx = torch.arange(512)[:, None], torch.arange(512)[None, :]
    keep = kept(dropout, 4, torch.arange(2)[:, None, None, None], torch.arange(2)[None, :, None, None], q_idx, kv_idx)
    sigma = (keep_p * (1 - keep_p) / keep.numel()) ** 0.5
    assert abs(keep.float().mean().item() - keep_p) < 5 * sigma
    # (b, h, i // 16, i // 8 % 2, i % 8, j // 32, j // 8 % 4, j % 8 // 2, j % 2)
    sixteen = keep.view(2, 2, 32, 2, 8, 16, 4, 4, 2).float().mean((0, 1, 2, 4, 5, 7))
    assert (sixteen - keep_p).abs().max().item() < 5 * sigma * 16 ** 0.5, f"counter positions keep {sixteen.tolist()}"
    for shifted in (keep[..., :, 1:] & keep[..., :, :-1], keep[..., 1:, :] & keep[..., :-1, :]):
        assert abs(shifted.float().mean().item() - keep_p ** 2) < 5 * sigma * 2


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, True, "0.1", float("nan")])
def test_bad_dropout_p_is_refused(bad):
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match=r"dropout_p must be a number in \[0, 1\)"):
        sparseflash.attention(q, q, q, dropout_p=bad)


@pytest.mark.parametrize("p", [1e-3, 1 / 512], ids=["1e-3", "1_512-rounds-half-to-even"])
def test_dropout_p_that_rounds_to_nothing_is_refused(p):
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match=rf"dropout_p={p!r} rounds to 0 at dropout's resolution of 1/256"):
        sparseflash.attention(q, q, q, dropout_p=p)
    assert Dropout(2 / 512, torch.zeros((), dtype=torch.int64)).threshold == 1  # the smallest that drops


def test_module_drops_in_training_only():
    torch.manual_seed(0)
    module = SparseAttention(32, 4, mask="causal", backend="blocked", attn_dropout=0.3)
    x = torch.randn(2, 40, 32)
    module.train()
    a, b = module(x), module(x)
    assert not torch.equal(a, b), "training: two calls drew the same dropout"
    with seeded(7, "cpu"):
        c = module(x)
    with seeded(7, "cpu"):
        d = module(x)
    assert torch.equal(c, d)
    module.eval()
    plain = SparseAttention(32, 4, mask="causal", backend="blocked")
    plain.load_state_dict(module.state_dict())
    plain.eval()
    assert torch.equal(module(x), plain(x)), "eval: attention dropout must be off"


def test_module_rejects_bad_attn_dropout():
    with pytest.raises(ValueError, match="attn_dropout"):
        SparseAttention(32, 4, attn_dropout=1.0)


GPU_CASES = [
    ("dense", 1024, 1024, 64, torch.bfloat16, False, True, 0.1),
    ("causal", 1000, 1000, 128, torch.float16, True, False, 0.1),
    ("butterfly", 2048, 2048, 128, torch.bfloat16, False, False, 0.2),
    ("alibi-causal", 777, 777, 64, torch.bfloat16, True, True, 0.1),
    ("decode-dense", 4, 4096, 128, torch.bfloat16, True, True, 0.1),
    ("causal", 1000, 1000, 96, torch.bfloat16, True, True, 0.1),
    ("causal", 1000, 1000, 256, torch.bfloat16, True, True, 0.1),  # dK/dV score tiles query-major (QUERY_ROWS)
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_gpu_dropout_matches_reference(case):
    _run_case(case, "triton", "cuda", heads=8)
