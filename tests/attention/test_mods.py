"""Mask and score functions on every backend against the reference: o, lse, dq, dk, dv and the
gradients of captured tensors that require grad.

On CPU the Triton kernels run under the interpreter on small shapes; the ``gpu`` tests run the same
comparisons compiled, at realistic sizes.
"""

from __future__ import annotations

import pytest
import torch

from sparseflash import masks
from sparseflash.attention.score_mods import make_score_mod
from sparseflash.masks.functions import trace
from tests.helpers import assert_dkdv_query_rows, attention_with_grads, check_backend, dkdv_query_rows

BACKENDS = ["blocked", "triton"]


def _inputs(batch, heads, kv_heads, q_len, kv_len, dim, dtype, device="cpu"):
    shapes = [(batch, heads, q_len, dim), (batch, kv_heads, kv_len, dim), (batch, kv_heads, kv_len, dim),
              (batch, heads, q_len, dim)]
    return [torch.randn(s, dtype=dtype, device=device) for s in shapes]


def _table(shape, device):
    """A learnable table with random entries (never zeros), as a relative-bias parameter would be."""
    return (torch.randn(shape, device=device) * 0.5).requires_grad_(True)


def _mask(kind: str, q_len: int, kv_len: int, batch: int, heads: int, device):
    """``(mask, score_mod)`` for one case: built-in element patterns, user functions with captured
    tensors, b/h-dependent functions, combinations with block layouts."""
    block = (32, 16)
    if kind == "sliding-causal":
        return masks.make("sliding_window", q_len, kv_len, block=block, window=37, causal=True, device=device), None
    if kind == "sliding-both-sides":
        return masks.make("sliding_window", q_len, kv_len, block=32, window=20, device=device), None
    if kind == "document-lengths":  # documents of ragged lengths, captured ids
        total = max(q_len, kv_len)
        lengths = [total // 3, 7, total - total // 3 - 7]
        return masks.make("document", q_len, kv_len, block=block, lengths=lengths, causal=True, device=device), None
    if kind == "prefix-lm":
        return masks.make("prefix_lm", q_len, kv_len, block=32, prefix=40, device=device), None
    if kind == "dilated":
        return masks.make("dilated", q_len, kv_len, block=16, dilation=3, window=50, device=device), None
    if kind == "per-batch-and-head":  # a window whose width depends on b and h: a [B, H, n_q, n_kv] layout
        widths = torch.tensor([[5, 60, 17, 1], [33, 2, 90, 9]], device=device)[:batch, :heads]

        def per_batch_and_head(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx >= 0) & (q_idx - kv_idx < widths[b, h])
        return masks.from_mask_mod(per_batch_and_head, q_len, kv_len, block=block, batch=batch, heads=heads,
                                   device=device), None
    if kind == "per-batch-layout":  # a [B, 1, n_q, n_kv] block layout without an element predicate
        layout = torch.rand(batch, 1, -(-q_len // block[0]), -(-kv_len // block[1]), device=device) < 0.6
        return masks.BlockMask(layout, block, q_len, kv_len), None
    if kind == "empty-rows":  # queries 10-49 see no key at all; others keep a few
        def hole(b, h, q_idx, kv_idx):
            return ((q_idx < 10) | (q_idx >= 50)) & ((kv_idx * 7 + q_idx) % 5 != 0)
        return masks.from_mask_mod(hole, q_len, kv_len, block=block, device=device), None
    if kind == "butterfly-and-window":  # a block layout AND a token-level causal window
        window = masks.make("sliding_window", q_len, kv_len, block=32, window=45, causal=True, device=device)
        return masks.make("butterfly", q_len, kv_len, block=32, device=device) & window, None
    if kind == "causal-or-window":  # a union of a causal layout and a non-causal token window
        window = masks.make("sliding_window", q_len, kv_len, block=32, window=9, device=device)
        return masks.make("local", q_len, kv_len, block=32, window=1, causal=True, device=device) | window, None
    if kind == "alibi-causal":
        return masks.make("causal", q_len, kv_len, block=32, device=device), make_score_mod("alibi", heads).to(device)
    if kind == "softcap-dense":
        return None, make_score_mod("softcap", heads, cap=2.0)
    if kind == "relative-bias-window":  # a learnable 2-D table indexed by h and a clamped distance
        bias = make_score_mod("relative_bias", heads, max_distance=24).to(device)
        with torch.no_grad():
            bias.table.normal_(0, 0.5)
        return masks.make("sliding_window", q_len, kv_len, block=32, window=30, causal=True, device=device), bias
    if kind == "every-op-score":  # where, exp, log, sqrt, minimum, //, %, a 1-D and a 0-d capture, b
        table = _table((heads, 7), device)
        gain = _table((batch,), device)
        temperature = torch.tensor(1.5, device=device)

        def every_op(score, b, h, q_idx, kv_idx):
            bucket = torch.minimum((q_idx - kv_idx) // 3 % 7, torch.tensor(6, device=device))
            shaped = torch.where(score > 0, torch.sqrt(abs(score) + 1.0), -torch.log(1.0 - score * 0.5 + score * score))
            return shaped * gain[b] / temperature + table[h, bucket] + torch.exp(-abs(q_idx - kv_idx) * 0.1)
        return masks.make("random", q_len, kv_len, block=16, heads=heads, density=0.5, device=device), every_op
    raise ValueError(kind)


CPU_CASES = [
    # kind, q_len, kv_len, dim, dtype, gqa, key_lengths
    ("sliding-causal", 111, 111, 16, torch.float16, False, False),
    ("sliding-causal", 70, 130, 8, torch.bfloat16, True, True),
    ("sliding-both-sides", 100, 63, 16, torch.bfloat16, False, False),
    ("document-lengths", 111, 111, 16, torch.float16, True, False),
    ("per-batch-layout", 100, 70, 16, torch.float16, True, True),
    ("document-lengths", 90, 60, 8, torch.bfloat16, False, True),
    ("prefix-lm", 100, 100, 16, torch.bfloat16, False, False),
    ("dilated", 77, 77, 8, torch.float16, False, False),
    ("per-batch-and-head", 100, 100, 8, torch.float16, True, False),
    ("empty-rows", 100, 90, 16, torch.bfloat16, False, False),
    ("butterfly-and-window", 130, 130, 8, torch.float16, False, True),
    ("causal-or-window", 100, 100, 16, torch.bfloat16, False, False),
    ("alibi-causal", 100, 100, 16, torch.float16, True, False),
    ("alibi-causal", 63, 111, 8, torch.bfloat16, False, True),
    ("softcap-dense", 70, 70, 16, torch.bfloat16, False, False),
    ("relative-bias-window", 100, 100, 16, torch.float16, True, False),
    ("relative-bias-window", 80, 50, 8, torch.bfloat16, False, True),
    ("relative-bias-window", 70, 60, 72, torch.float16, True, True),  # head dim 64 + 16 (padded) columns
    ("every-op-score", 64, 64, 16, torch.float32, False, False),
    ("every-op-score", 70, 90, 8, torch.bfloat16, True, False),
]


def _case_id(case) -> str:
    kind, q_len, kv_len, dim, dtype, gqa, key_lengths = case
    return "-".join([kind, f"sq{q_len}", f"skv{kv_len}", f"d{dim}", str(dtype).removeprefix("torch."),
                     "gqa" if gqa else "mha", "keylen" if key_lengths else "nokeylen"])


def _check(case, backend, device, batch=2, heads=4):
    kind, q_len, kv_len, dim, dtype, gqa, key_lengths = case
    q, k, v, do = _inputs(batch, heads, heads // 2 if gqa else heads, q_len, kv_len, dim, dtype, device)
    mask, score_mod = _mask(kind, q_len, kv_len, batch, heads, device)
    lengths = torch.tensor([kv_len * 2 // 3 + 1, 0][:batch], device=device) if key_lengths else None
    got = check_backend(backend, q, k, v, mask, do, lengths, score_mod=score_mod)
    if kind == "empty-rows":  # rows that see no key: output 0, lse -inf, no gradient, never NaN
        assert torch.all(got.o[:, :, 10:50] == 0) and torch.all(got.lse[:, :, 10:50] == float("-inf"))
        assert torch.all(got.dq[:, :, 10:50] == 0)
    trained = [t for t in trace(score_mod, "score_mod").captures if t.requires_grad] if score_mod else []
    assert len(got.dcaptures) == len(trained) and all(g.abs().sum() > 0 for g in got.dcaptures)
    return got


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CPU_CASES, ids=_case_id)
def test_mods_match_reference(case, backend):
    _check(case, backend, "cpu")


@pytest.mark.parametrize("case", [case for case in CPU_CASES if case[0] in (
    "sliding-causal", "document-lengths", "empty-rows", "alibi-causal", "relative-bias-window")], ids=_case_id)
def test_mods_with_dkdv_score_tiles_query_major_match_reference(case, monkeypatch):
    """Mask and score functions, a captured table's gradient and empty rows where the dK/dV programs
    compute their score tiles with the queries along the rows (backward.py, QUERY_ROWS)."""
    from sparseflash.attention.triton import tuning

    dkdv_query_rows(monkeypatch)
    with tuning.recording() as launched:
        _check(case, "triton", "cuda" if torch.cuda.is_available() else "cpu")
    assert_dkdv_query_rows(launched)


def test_learnable_bias_gets_its_gradient_on_every_backend():
    """The relative-bias table's gradient (through atomics in the kernels) equals the reference's,
    and the captured every-op tensors' too (checked in test_mods_match_reference); here the values
    agree across backends beyond the tolerance rule: same signs, same zero entries."""
    grads = {}
    for backend in ("reference", "blocked", "triton"):
        torch.manual_seed(0)
        bias = make_score_mod("relative_bias", 2, max_distance=8)
        q, k, v, do = _inputs(1, 2, 2, 40, 40, 16, torch.float32)
        mask = masks.make("sliding_window", 40, block=16, window=10, causal=True)
        grads[backend] = attention_with_grads(backend, q, k, v, mask, do, score_mod=bias).dcaptures[0]
    want = grads["reference"]
    assert torch.equal(want == 0, grads["triton"] == 0) and torch.equal(want == 0, grads["blocked"] == 0)
    for backend in ("blocked", "triton"):
        assert torch.allclose(grads[backend], want, rtol=1e-4, atol=1e-5), backend


def _linear_in_positions(heads: int, q_len: int, kv_len: int, device, key_table: bool):
    """A separable score function (``Graph.separable``) with learnable per-head slopes and a per-query
    term (integer division on the position), and with ``key_table`` a per-key one: the kernels take
    its scores at one query per tile and add the difference per row to the lse; without the table
    its key term is linear in kv_idx (``Graph.linear_in_keys``: steps computed once, one value per
    key tile)."""
    slopes, per_query, per_key = _table((heads,), device), _table((q_len,), device), _table((kv_len,), device)

    def linear(score, b, h, q_idx, kv_idx):
        terms = score * 0.75 + slopes[h] * (kv_idx - q_idx) * 0.05 + per_query[q_idx // 3] * 3.0
        return terms - per_key[kv_idx] if key_table else terms
    graph = trace(linear, "score_mod")
    assert graph.separable and graph.linear_in_keys is not key_table
    return linear


SEPARABLE_CASES = [  # q_len, kv_len, dim, dtype, gqa, key_lengths, compiler
    (100, 100, 16, torch.float32, False, False, None),
    (70, 130, 8, torch.bfloat16, True, True, None),
    (90, 60, 16, torch.float16, False, False, "aot_eager"),
    (5, 1300, 16, torch.bfloat16, True, False, None),  # decoding: split-KV forward (3 shares here), tile at query 0
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("key_table", [True, False], ids=["key-table", "linear-in-keys"])
@pytest.mark.parametrize("case", SEPARABLE_CASES, ids=lambda c: "-".join(
    [f"sq{c[0]}", f"skv{c[1]}", f"d{c[2]}", str(c[3]).removeprefix("torch."), "gqa" if c[4] else "mha",
     "keylen" if c[5] else "nokeylen", c[6] or "eager"]))
def test_separable_score_function_through_o_and_lse(case, key_table, backend):
    """o, the lse (to which the kernels add the per-row term their scores leave out) and every gradient
    of a loss of both, the captured tensors' included, against the reference; rows that see no key stay
    0 / -inf."""
    _check_separable(case, backend, "cpu", key_table)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_blocked_backward_ignores_padding_rows_a_score_function_pushes_past_exp(dtype):
    """5 queries in a 16-row block: the blocked backward's padding rows see the last query's position, and a
    score function adding 100 there once made exp(s - lse) inf on them and their gradients inf * 0 = NaN."""
    q, k, v, do = _inputs(2, 2, 2, 5, 40, 16, dtype)
    check_backend("blocked", q, k, v, masks.make("dense", 5, 40, block=16), do, None,
                  score_mod=lambda score, b, h, q_idx, kv_idx: score + 100.0)


def _check_separable(case, backend, device, key_table, batch=2, heads=4):
    q_len, kv_len, dim, dtype, gqa, key_lengths, compiler = case
    torch._dynamo.reset()
    q, k, v, do = _inputs(batch, heads, heads // 2 if gqa else heads, q_len, kv_len, dim, dtype, device)
    score_mod = _linear_in_positions(heads, q_len, kv_len, device, key_table)
    mask, _ = _mask("empty-rows", q_len, kv_len, batch, heads, device)
    lengths = torch.tensor([kv_len * 2 // 3 + 1, 0], device=device) if key_lengths else None
    dlse = torch.randn(batch, heads, q_len, device=device)
    got = check_backend(backend, q, k, v, mask, do, lengths, dlse=dlse, score_mod=score_mod, compiler=compiler)
    assert torch.all(got.lse[:, :, 10:50] == float("-inf")) and not got.lse.isnan().any()
    assert len(got.dcaptures) == (3 if key_table else 2) and all(g.abs().sum() > 0 for g in got.dcaptures)


def _padding_by_score(kind: str, batch: int, heads: int, q_len: int, kv_len: int, device):
    """A separable score function that pads with -inf through a captured table: batch 0's keys from 20
    on (``key-padding``, with a per-query term) or its first 5 queries (``query-padding``, with a key
    term linear in kv_idx); the reference's rows whose every score is -inf see no key."""
    slopes = torch.rand(heads, device=device) * 0.1
    per_query = torch.randn(q_len, device=device)
    bias = torch.zeros(batch, kv_len if kind == "key-padding" else q_len, device=device)
    if kind == "key-padding":
        bias[0, 20:] = float("-inf")

        def padded(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx) + per_query[q_idx // 3] + bias[b, kv_idx]
    else:
        bias[0, :5] = float("-inf")

        def padded(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx) + bias[b, q_idx]
    graph = trace(padded, "score_mod")
    assert graph.separable and graph.linear_in_keys is (kind == "query-padding")
    return padded


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["key-padding", "query-padding"])
def test_separable_score_function_padding_with_infinite_terms(kind, backend):
    """-inf from a captured table reaches neither a NaN nor a wrong row: the kernels leave a term of one
    position out of the differences they take (codegen.single_position_terms), and a row whose own term
    is -inf sees no key (o 0, lse -inf, no gradient)."""
    batch, heads, q_len, kv_len = 2, 2, 70, 90
    q, k, v, do = _inputs(batch, heads, heads, q_len, kv_len, 16, torch.float32)
    score_mod = _padding_by_score(kind, batch, heads, q_len, kv_len, "cpu")
    dlse = torch.randn(batch, heads, q_len)
    got = check_backend(backend, q, k, v, masks.make("causal", q_len, kv_len, block=16), do, dlse=dlse,
                        score_mod=score_mod)
    assert not any(t.isnan().any() for t in (got.o, got.lse, got.dq, got.dk, got.dv))
    if kind == "query-padding":
        assert torch.all(got.lse[0, :, :5] == float("-inf")) and torch.all(got.o[0, :, :5] == 0)
        assert torch.isfinite(got.lse[0, :, 5:]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_score_function_with_an_infinite_constant(backend):
    """``torch.where(..., score, float("-inf"))``, the usual way to mask through a score function: the
    generated code writes the constant as ``float("-inf")`` (a bare ``-inf`` is a NameError)."""
    q, k, v, do = _inputs(2, 2, 2, 50, 70, 16, torch.float32)

    def causal_by_score(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx >= kv_idx, score, float("-inf"))
    check_backend(backend, q, k, v, masks.make("dense", 50, 70, block=16), do, dlse=torch.randn(2, 2, 50),
                  score_mod=causal_by_score)


def _far_along(q_len: int, heads: int, device, key_table: bool, dtype=torch.float32, dim=16):
    """Inputs, a causal window of 100 and ALiBi with steep slopes (with ``key_table`` plus a per-key
    table, which takes the kernels' other path: the key term evaluated on each tile's keys): far
    along the sequence its key term ``slope * kv_idx`` is large while the scores a row sees stay small."""
    q, k, v, do = _inputs(1, heads, heads, q_len, q_len, dim, dtype, device)
    slopes = torch.tensor([0.5, 0.125] * (heads // 2), device=device)
    per_key = torch.randn(q_len, device=device) * 0.1

    def alibi(score, b, h, q_idx, kv_idx):
        biased = score + slopes[h] * (kv_idx - q_idx)
        return biased + per_key[kv_idx] if key_table else biased
    assert trace(alibi, "score_mod").linear_in_keys is not key_table
    mask = masks.make("sliding_window", q_len, block=64, window=100, causal=True, device=device)
    return q, k, v, do, mask, alibi, torch.randn(1, heads, q_len, device=device)


@pytest.mark.parametrize("key_table", [False, True], ids=["alibi", "alibi-and-key-table"])
def test_separable_score_function_keeps_fp32_precision_far_along_the_sequence(key_table):
    """The kernels evaluate a separable function's key term at a query of each tile, so fp32 o, lse and
    gradients stay within fp32's tolerance at position 3000 (at query 0 the term reaches slope * 3000, and
    its rounding, and that of adding the per-query term back to the lse, alone exceed it)."""
    q, k, v, do, mask, alibi, dlse = _far_along(3001, 2, "cpu", key_table)
    check_backend("triton", q, k, v, mask, do, dlse=dlse, score_mod=alibi)


@pytest.mark.gpu
def test_gpu_separable_score_function_keeps_precision_far_along_the_sequence():
    """As on the CPU, at 8,192 tokens in bf16 with head_dim 128: the lse within its fp32 bound."""
    q, k, v, do, mask, alibi, dlse = _far_along(8192, 2, "cuda", False, torch.bfloat16, 128)
    check_backend("triton", q, k, v, mask, do, dlse=dlse, score_mod=alibi)


@pytest.mark.gpu
@pytest.mark.parametrize("key_table", [True, False], ids=["key-table", "linear-in-keys"])
@pytest.mark.parametrize("compiler", [None, "inductor"], ids=["eager", "inductor"])
def test_gpu_separable_score_function_through_o_and_lse(compiler, key_table):
    _check_separable((2048, 2048, 128, torch.bfloat16, True, True, compiler), "triton", "cuda", key_table)


GPU_CASES = [
    ("sliding-causal", 2048, 2048, 128, torch.bfloat16, False, False),
    ("sliding-both-sides", 1000, 3000, 64, torch.float16, True, True),
    ("document-lengths", 4096, 4096, 64, torch.bfloat16, True, False),
    ("prefix-lm", 1500, 1500, 128, torch.float16, False, False),
    ("dilated", 1024, 1024, 64, torch.bfloat16, False, False),
    ("per-batch-and-head", 1000, 1000, 64, torch.bfloat16, False, False),
    ("empty-rows", 1000, 777, 64, torch.float16, False, False),
    ("butterfly-and-window", 2048, 2048, 128, torch.bfloat16, False, True),
    ("causal-or-window", 1111, 1111, 64, torch.bfloat16, False, False),
    ("alibi-causal", 2048, 2048, 128, torch.bfloat16, True, False),
    ("softcap-dense", 1024, 1024, 64, torch.float16, False, False),
    ("relative-bias-window", 2000, 2000, 64, torch.bfloat16, True, True),
    ("every-op-score", 1024, 1024, 64, torch.bfloat16, False, False),
    ("every-op-score", 500, 700, 32, torch.float32, True, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_gpu_mods_match_reference(case):
    _check(case, "triton", "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [64, 128], ids=["d64", "d128"])
@pytest.mark.parametrize("kind", ["sliding-causal", "document", "butterfly-and-window", "alibi", "softcap"])
def test_gpu_persistent_forward_with_functions(kind, dim, monkeypatch):
    """The persistent forward (SPARSEFLASH_PERSISTENT=1) masking every tile with a mask_mod, or applying
    a score function, at S=4096 with GQA, against the reference."""
    from sparseflash.attention.triton import tuning

    monkeypatch.setenv("SPARSEFLASH_PERSISTENT", "1")
    monkeypatch.setenv("SPARSEFLASH_GLUON", "0")  # ALiBi's causal rows would take the Gluon forward (test_gluon.py)
    tuning.forget()
    seq_len, heads, device = 4096, 8, "cuda"
    q, k, v, do = _inputs(2, heads, heads // 2, seq_len, seq_len, dim, torch.bfloat16, device)
    score_mod = None
    if kind == "sliding-causal":
        mask = masks.make("sliding_window", seq_len, block=128, window=700, causal=True, device=device)
    elif kind == "document":
        mask = masks.make("document", seq_len, block=128, documents=9, seed=1, device=device)
    elif kind == "butterfly-and-window":
        mask = masks.make("butterfly", seq_len, block=128, device=device) & masks.make(
            "sliding_window", seq_len, block=128, window=1000, device=device)
    else:
        mask = masks.make("causal", seq_len, block=128)
        score_mod = make_score_mod("alibi", heads).to(device) if kind == "alibi" else make_score_mod("softcap", heads,
                                                                                                     cap=5.0)
    with tuning.recording() as launched:
        check_backend("triton", q, k, v, mask, do, score_mod=score_mod)
    assert launched[0].config.persistent is (kind != "document")  # per-score loads of its ids: the other kernel
