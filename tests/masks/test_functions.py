"""Mask and score functions: what the tracer takes and refuses, masks built from a mask_mod (tiles
classified without materialising S_q x S_kv), the built-in element patterns, and their algebra."""

from __future__ import annotations

import math

import pytest
import torch

import sparseflash
from sparseflash import masks
from sparseflash.masks import block_mask
from sparseflash.masks.functions import trace


def _brute_force(mod, q_len, kv_len, batch=1, heads=1):
    """bool [batch, heads, q_len, kv_len]: the function evaluated on every score."""
    b = torch.arange(batch)[:, None, None, None]
    h = torch.arange(heads)[None, :, None, None]
    q_idx = torch.arange(q_len)[None, None, :, None]
    kv_idx = torch.arange(kv_len)[None, None, None, :]
    return mod(b, h, q_idx, kv_idx).expand(batch, heads, q_len, kv_len)


def _tile_counts(dense, block):
    """Kept scores per tile of a [..., q_len, kv_len] bool mask."""
    bm, bn = block
    pad = torch.nn.functional.pad(dense.int(), (0, (-dense.shape[-1]) % bn, 0, (-dense.shape[-2]) % bm))
    return pad.unflatten(-1, (-1, bn)).unflatten(-3, (-1, bm)).sum((-3, -1))


# ---------------------------------------------------------------------------- what traces, what does not
def test_supported_ops_trace():
    table = torch.randn(3, 5)
    scalar = torch.tensor(2.0)

    def uses_everything(score, b, h, q_idx, kv_idx):
        d = (q_idx - kv_idx) // 2 % 5
        x = torch.where(d > 1, score * scalar, -score) + table[h, d] / 3 + abs(score) ** 2
        x = torch.maximum(x, torch.minimum(torch.exp(score), torch.log(abs(score) + 1)))
        x = torch.clamp(x, min=-10.0, max=10.0) + torch.tanh(score) + torch.sqrt(abs(score))
        return x + ((q_idx >= kv_idx) & ~(b == 1) | (h != 0) ^ (q_idx < 3)) * 1.0

    graph = trace(uses_everything, "score_mod")
    assert graph.output.kind == "float" and graph.captures[0] is scalar and graph.captures[1] is table
    assert {"where", "floordiv", "mod", "load", "exp", "log", "tanh", "sqrt", "minimum", "maximum",
            "pow", "not", "xor"} <= {n.op for n in graph.nodes}


ERRORS = {
    "python-if": (lambda b, h, q, kv: q if q > kv else kv, "mask_mod", r"uses a traced value in a Python condition"),
    "python-and": (lambda b, h, q, kv: (q > kv) and (q < 5), "mask_mod", r"Python condition"),
    "math-call": (lambda s, b, h, q, kv: s + math.sqrt(q), "score_mod", r"turns a traced value into a Python number"),
    "unsupported-torch": (lambda s, b, h, q, kv: torch.sin(s), "score_mod",
                          r"calls torch's sin, which sparseflash cannot compile; supported: "),
    "mask-returns-int": (lambda b, h, q, kv: q - kv, "mask_mod", r"must return a boolean .*it returns a int"),
    "score-returns-bool": (lambda s, b, h, q, kv: s > 0, "score_mod", r"must return a number"),
    "index-argument": (lambda b, h, q, kv: q[0] > kv, "mask_mod", r"indexes an argument: only captured tensors"),
    "whole-capture": (lambda s, b, h, q, kv: s + torch.ones(4), "score_mod",
                      r"uses a captured tensor of shape \(4,\) whole"),
    "float-index": (lambda s, b, h, q, kv: s + torch.ones(4)[s], "score_mod", r"indices must be integers"),
    "float-floordiv": (lambda s, b, h, q, kv: s // 2, "score_mod", r"uses // or % on a float"),
    "big-power": (lambda s, b, h, q, kv: s ** 5, "score_mod", r"raises to the power 5"),
    "mask-arity": (lambda q, kv: q >= kv, "mask_mod", r"a mask_mod takes \(b, h, q_idx, kv_idx\); .* takes \(q, kv\)"),
    "score-arity": (lambda s, q, kv: s, "score_mod", r"a score_mod takes \(score, b, h, q_idx, kv_idx\)"),
    "keyword-call": (lambda s, b, h, q, kv: torch.where(s > 0, s, other=0.0), "score_mod", r"keyword arguments"),
    "float8-capture": (lambda s, b, h, q, kv: s + torch.ones(4, dtype=torch.float8_e4m3fn)[h], "score_mod",
                       r"captures a tensor of dtype torch.float8_e4m3fn; captured tensors may be float32, "),
}


@pytest.mark.parametrize("case", ERRORS, ids=list(ERRORS))
def test_unsupported_constructs_are_named(case):
    fn, what, message = ERRORS[case]
    with pytest.raises(ValueError, match=message):
        trace(fn, what)


@pytest.mark.parametrize("what", ["mask_mod", "score_mod"])
def test_a_function_that_is_not_callable_is_named(what):
    with pytest.raises(TypeError, match=rf"a {what} must be a function of \(.*\); got int"):
        trace(3, what)


def test_errors_come_when_the_mask_or_call_is_built():
    """A bad mask_mod fails in from_mask_mod; a bad score_mod fails at the call, on every backend,
    before any kernel runs."""
    with pytest.raises(ValueError, match=r"mask_mod .* Python condition"):
        masks.from_mask_mod(lambda b, h, q, kv: q if q > kv else kv, 64)
    q = torch.randn(1, 1, 32, 16)
    for backend in ("reference", "blocked", "triton"):
        with pytest.raises(ValueError, match=r"score_mod .*calls torch's sin"):
            sparseflash.attention(q, q, q, score_mod=lambda s, b, h, qi, kv: torch.sin(s), backend=backend)


# ---------------------------------------------------------------------------- from_mask_mod
@pytest.mark.parametrize("q_len, kv_len, block", [(100, 100, 16), (70, 130, (32, 16)), (257, 63, 64)],
                         ids=["square-16", "70x130-32x16", "257x63-64"])
def test_tiles_are_classified_from_the_function(q_len, kv_len, block):
    """Empty tiles are off, full tiles need no predicate, partial ones do; to_dense and density are
    the function's own."""
    def window_and_stripes(b, h, q_idx, kv_idx):
        return ((q_idx - kv_idx).abs() < 23) & ((kv_idx // 40) % 2 == 0)

    mask = masks.from_mask_mod(window_and_stripes, q_len, kv_len, block=block)
    want = _brute_force(window_and_stripes, q_len, kv_len)[0, 0]
    assert torch.equal(mask.to_dense()[0], want)
    assert mask.density == pytest.approx(want.float().mean().item())
    bm, bn = mask.block_size
    counts = _tile_counts(want, (bm, bn))
    rows = torch.arange(counts.shape[0])[:, None] * bm
    cols = torch.arange(counts.shape[1])[None, :] * bn
    sizes = (torch.clamp(q_len - rows, max=bm) * torch.clamp(kv_len - cols, max=bn))
    assert torch.equal(mask.layout[0], counts > 0)
    assert torch.equal(mask.full_layout[0], (counts == sizes) & (counts > 0) & (sizes == bm * bn))
    assert mask.needs_mask_mod and mask.kind is masks.MaskKind.SPARSE


def test_batch_and_head_dependent_functions():
    widths = torch.tensor([[3, 40, 7], [100, 1, 20]])

    def per_batch_and_head(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < widths[b, h])

    mask = masks.from_mask_mod(per_batch_and_head, 90, block=16, batch=2, heads=3)
    assert mask.shape == (2, 3, 6, 6) and mask.num_batches == 2 and mask.num_heads == 3
    assert torch.equal(mask.to_dense(), _brute_force(per_batch_and_head, 90, 90, 2, 3))


def test_never_evaluates_all_scores_at_once(monkeypatch):
    """Building a mask evaluates the function a chunk of tiles at a time, and not at all on chunks
    whose tiles are all off already."""
    monkeypatch.setattr(block_mask, "EVAL_ELEMENTS", 64 * 64 * 8)
    sizes = []

    def causal_window(b, h, q_idx, kv_idx):
        if isinstance(q_idx, torch.Tensor):  # an evaluation, not the trace
            sizes.append(torch.broadcast_shapes(q_idx.shape, kv_idx.shape).numel())
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 100)

    mask = masks.make("causal", 2048, block=64) & masks.from_mask_mod(causal_window, 2048, block=64)
    sizes.clear()
    masks.from_mask_mod(causal_window, 2048, block=64)  # the first call traced; count evaluations only
    assert max(sizes) <= 64 * 64 * 8 < 2048 * 2048
    assert mask.density == pytest.approx(_brute_force(causal_window, 2048, 2048).float().mean().item())


def test_full_tiles_need_no_predicate():
    """Documents that start on tile edges: every computed tile is full, so the kernels never
    evaluate the function (needs_mask_mod is False), and the mask equals the block layout."""
    mask = masks.make("document", 256, block=64, documents=4)
    assert not mask.needs_mask_mod and not mask.partial_layout.any()
    assert torch.equal(mask.layout[0], torch.eye(4, dtype=torch.bool))


def test_mask_mod_rejects_bad_sizes():
    with pytest.raises(ValueError, match=r"heads must be None or an int >= 1; got 0"):
        masks.from_mask_mod(lambda b, h, q, kv: q >= kv, 64, heads=0)


# ---------------------------------------------------------------------------- built-ins
def _dense_of(name, q_len, kv_len, **params):
    return masks.make(name, q_len, kv_len, block=16, **params).to_dense()[0]


def test_built_in_element_patterns():
    q = torch.arange(90)[:, None]
    kv = torch.arange(110)[None, :]
    assert torch.equal(_dense_of("sliding_window", 90, 110, window=7), (q - kv).abs() < 7)
    assert torch.equal(_dense_of("sliding_window", 90, 110, window=7, causal=True), (q >= kv) & (q - kv < 7))
    assert torch.equal(_dense_of("prefix_lm", 90, 110, prefix=20), (kv < 20) | (q >= kv))
    assert torch.equal(_dense_of("dilated", 90, 110, dilation=3), (q - kv) % 3 == 0)
    assert torch.equal(_dense_of("dilated", 90, 110, dilation=3, window=10), ((q - kv) % 3 == 0) & ((q - kv).abs() < 10))
    doc = torch.tensor([0] * 30 + [1] * 5 + [2] * 75)
    assert torch.equal(_dense_of("document", 90, 110, lengths=[30, 5, 75]), doc[:90, None] == doc[None, :])
    assert torch.equal(_dense_of("document", 90, 110, lengths=[30, 5, 75], causal=True),
                       (doc[:90, None] == doc[None, :]) & (q >= kv))
    seeded = masks.mask_mods.document_ids(110, documents=6, seed=3)
    assert torch.equal(seeded, masks.mask_mods.document_ids(110, documents=6, seed=3))
    assert seeded.unique().tolist() == list(range(6)) and bool((seeded.diff() >= 0).all())
    assert not torch.equal(seeded, masks.mask_mods.document_ids(110, documents=6))


@pytest.mark.parametrize("name, params, message", [
    ("sliding_window", {"window": 0}, r"window must be >= 1 token; got 0"),
    ("document", {"lengths": [10, 20]}, r"document lengths must be >= 1 and sum to the sequence length 64"),
    ("document", {"documents": 0}, r"documents must be in \[1, 64\]; got 0"),
    ("prefix_lm", {"prefix": -1}, r"prefix must be >= 0 tokens"),
    ("dilated", {"dilation": 0}, r"dilated needs dilation >= 1"),
    ("sliding_window", {"width": 3}, r"pattern 'sliding_window' takes parameters \['window'\]; got \['width'\]"),
])
def test_built_in_parameters_are_checked(name, params, message):
    with pytest.raises(ValueError, match=message):
        masks.make(name, 64, **params)


def test_register_a_mask_mod_pattern():
    @masks.register_mask_mod("test_every_third_key")
    def every_third_key(q_len, kv_len, offset: int = 0):
        def mod(b, h, q_idx, kv_idx):
            return (kv_idx + offset) % 3 == 0
        return mod

    mask = masks.MaskSpec("test_every_third_key", {"offset": 1}, block=16).build(48)
    assert torch.equal(mask.to_dense()[0], ((torch.arange(48) + 1) % 3 == 0).expand(48, 48))


# ---------------------------------------------------------------------------- algebra
def test_layout_and_element_predicates_combine():
    """A butterfly layout AND a token-level causal window keeps exactly the scores both keep; OR with
    a causal layout keeps the scores either keeps."""
    butterfly = masks.make("butterfly", 200, block=16)
    window = masks.make("sliding_window", 200, block=16, window=50, causal=True)
    both = butterfly & window
    assert torch.equal(both.to_dense(), butterfly.to_dense() & window.to_dense())
    assert both.density < min(butterfly.density, window.density)
    either = masks.make("local", 200, block=16, window=1, causal=True) | masks.make("dilated", 200, block=16,
                                                                                    dilation=7)
    assert torch.equal(either.to_dense(), masks.make("local", 200, block=16, window=1, causal=True).to_dense()
                       | masks.make("dilated", 200, block=16, dilation=7).to_dense())
    two_mods = window & masks.make("prefix_lm", 200, block=16, prefix=30)
    assert torch.equal(two_mods.to_dense(), window.to_dense() & masks.make("prefix_lm", 200, block=16,
                                                                           prefix=30).to_dense())


def test_element_mask_picture(tmp_path):
    pytest.importorskip("matplotlib")
    mask = masks.make("butterfly", 256, block=32) & masks.make("sliding_window", 256, block=32, window=40)
    path = tmp_path / "mask.png"
    mask.plot(str(path))
    assert path.stat().st_size > 1000
    assert "mask_mod=sliding_window_mod" in repr(mask)


@pytest.mark.parametrize("name, special", [("alibi", False), ("softcap", True)])
def test_special_functions_are_seen(name, special):
    """A score function using tanh (softcap) is told from one of arithmetic only (ALiBi): the kernels'
    configs are keyed on it."""
    from sparseflash.attention.score_mods import make_score_mod

    assert trace(make_score_mod(name, 4), "score_mod").uses_special_functions is special


def test_building_a_function_mask_imports_no_symbolic_machinery():
    """A new process's first from_mask_mod must not import sympy (torch.broadcast_shapes did, through
    torch._refs: 0.3 s here, seconds on a GPU host, paid on every first call)."""
    import subprocess
    import sys

    code = ("import sys, sparseflash\n"
            "from sparseflash import masks\n"
            "masks.from_mask_mod(lambda b, h, q, k: (q >= k) & (q - k < 50), 256, block=64)\n"
            "assert 'sympy' not in sys.modules, 'sympy was imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


_SLOPES, _TABLE = torch.rand(4) + 0.1, torch.rand(4, 9)
SEPARABLE = {  # name: (score function, separable, linear in the key position)
    "alibi": (lambda s, b, h, q, kv: s + _SLOPES[h] * (kv - q), True, True),
    "distance-times-head": (lambda s, b, h, q, kv: s - _SLOPES[h] * (h + 1) * (q - kv), True, True),
    "scaled-score-key-table-query-term": (lambda s, b, h, q, kv: s * _SLOPES[h] * 2.0 + _TABLE[h, kv % 9] - q * 0.5,
                                          True, False),
    "divided": (lambda s, b, h, q, kv: (s + kv) / 2.0 - q, True, True),
    "per-query-only": (lambda s, b, h, q, kv: s + _TABLE[h, q % 9], True, True),
    "key-squared": (lambda s, b, h, q, kv: s + kv * kv * 0.01 - q, True, False),
    "position-product": (lambda s, b, h, q, kv: s + q * kv, False, False),
    "score-squared": (lambda s, b, h, q, kv: s * s, False, False),
    "score-times-query": (lambda s, b, h, q, kv: s * q, False, False),
    "where-on-positions": (lambda s, b, h, q, kv: torch.where(q >= kv, s, s - 1.0), False, False),
    "table-of-the-distance": (lambda s, b, h, q, kv: s + _TABLE[h, (kv - q) % 9], False, False),
    "softcap": (lambda s, b, h, q, kv: torch.tanh(s / 2.0) * 2.0, False, False),
}


@pytest.mark.parametrize("name", sorted(SEPARABLE))
def test_separable_functions_are_linear_in_the_score_without_mixed_position_terms(name):
    fn, separable, linear = SEPARABLE[name]
    graph = trace(fn, "score_mod")
    assert graph.separable is separable and graph.linear_in_keys is linear
    if separable:  # f(s, q, kv) - f(s, q_ref, kv) = f(0, q, kv_ref) - f(0, q_ref, kv_ref) for any references:
        # the kernels' scores at the tile's reference query differ from f by their row term (codegen.py)
        b, h = torch.arange(2)[:, None, None, None], torch.arange(4)[None, :, None, None]
        q, kv = torch.arange(7)[None, None, :, None], torch.arange(5)[None, None, None, :]
        s, zero = torch.randn(2, 4, 7, 5), torch.zeros(())
        for q_ref, kv_ref in ((0, 0), (3, 4), (6, 1)):
            q_at, kv_at = torch.full_like(q, q_ref), torch.full_like(kv, kv_ref)
            row = fn(zero, b, h, q, kv_at) - fn(zero, b, h, q_at, kv_at)
            got = fn(s, b, h, q, kv) - fn(s, b, h, q_at, kv)
            assert torch.allclose(got, torch.broadcast_to(row, got.shape).float(), atol=1e-5)
    if linear:  # f(s, q, kv0 + j) - f(s, q, kv0) = f(0, 0, j) - f(0, 0, 0): steps computed once, one value a tile
        b, h = torch.arange(2)[:, None, None, None], torch.arange(4)[None, :, None, None]
        q, j = torch.arange(7)[None, None, :, None], torch.arange(5)[None, None, None, :]
        s, zero = torch.randn(2, 4, 7, 5), torch.zeros(())
        for kv0 in (0, 3, 11):
            got = fn(s, b, h, q, kv0 + j) - fn(s, b, h, q, torch.full_like(j, kv0))
            steps = fn(zero, b, h, torch.zeros_like(q), j) - fn(zero, b, h, torch.zeros_like(q), torch.zeros_like(j))
            assert torch.allclose(got, torch.broadcast_to(steps, got.shape).float(), atol=1e-5)
