"""Every bad input of ``sparseflash.attention``, ``BlockMask`` and ``make`` raises a ValueError
whose message names what was expected and what was given."""

from __future__ import annotations

import re

import pytest
import torch

import sparseflash
from sparseflash.masks import BlockMask, from_block_fn, from_layout, from_mask_mod, make, patterns, register

B, H, H_KV, S, D = 2, 4, 2, 40, 16


def _qkv(**shapes):
    """Valid inputs, with ``q=(...)``, ``k=(...)``, ``v=(...)`` overriding a shape."""
    q = torch.randn(*shapes.get("q", (B, H, S, D)))
    k = torch.randn(*shapes.get("k", (B, H_KV, S, D)))
    v = torch.randn(*shapes.get("v", (B, H_KV, S, D)))
    return q, k, v


def _call(q=None, k=None, v=None, mask=None, **kwargs):
    dq, dk, dv = _qkv()
    return sparseflash.attention(dq if q is None else q, dk if k is None else k, dv if v is None else v,
                                 mask, **kwargs)


ATTENTION_ERRORS = {
    # id: (call, regex the message must match)
    "q-rank-3": (lambda: _call(q=torch.randn(H, S, D)), r"q must be 4-D \[B, H, S, D\]; got shape \(4, 40, 16\)"),
    "q-rank-5": (lambda: _call(q=torch.randn(1, B, H, S, D)), r"q must be 4-D .*got shape \(1, 2, 4, 40, 16\)"),
    "k-rank-3": (lambda: _call(k=torch.randn(B, S, D)), r"k must be 4-D .*got shape \(2, 40, 16\)"),
    "v-rank-2": (lambda: _call(v=torch.randn(S, D)), r"v must be 4-D .*got shape \(40, 16\)"),
    "q-not-tensor": (lambda: _call(q=[[1.0]]), r"q must be a torch.Tensor; got list"),
    "batch": (lambda: _call(k=torch.randn(1, H_KV, S, D), v=torch.randn(1, H_KV, S, D)),
              r"batch sizes differ: q has B=2, k and v have B=1"),
    "heads-not-multiple": (lambda: _call(k=torch.randn(B, 3, S, D), v=torch.randn(B, 3, S, D)),
                           r"multiple of k/v heads .*got H=4, H_kv=3"),
    "heads-more-kv": (lambda: _call(k=torch.randn(B, 8, S, D), v=torch.randn(B, 8, S, D)),
                      r"multiple of k/v heads .*got H=4, H_kv=8"),
    "head-dim-k": (lambda: _call(k=torch.randn(B, H_KV, S, 8), v=torch.randn(B, H_KV, S, 8)),
                   r"head_dim differs: q has D=16, k and v have D=8"),
    "k-v-shape": (lambda: _call(v=torch.randn(B, H_KV, S + 1, D)),
                  r"k and v must have the same shape .*got \(2, 2, 40, 16\) and \(2, 2, 41, 16\)"),
    "head-dim-0": (lambda: sparseflash.attention(*_qkv(q=(B, H, S, 0), k=(B, H_KV, S, 0), v=(B, H_KV, S, 0))),
                   r"head_dim must be in 1\.\.256; got 0"),
    "head-dim-257": (lambda: sparseflash.attention(*_qkv(q=(1, 1, 4, 257), k=(1, 1, 4, 257), v=(1, 1, 4, 257))),
                     r"head_dim must be in 1\.\.256; got 257"),
    "device-k": (lambda: _call(k=torch.empty(B, H_KV, S, D, device="meta")),
                 r"q, k, v must be on one device; got cpu, meta, cpu"),
    "device-q": (lambda: _call(q=torch.empty(B, H, S, D, device="meta")),
                 r"q, k, v must be on one device; got meta, cpu, cpu"),
    "dtype-mixed": (lambda: _call(k=torch.randn(B, H_KV, S, D, dtype=torch.bfloat16)),
                    r"q, k, v must share a dtype; got torch.float32, torch.bfloat16, torch.float32"),
    "dtype-float64": (lambda: sparseflash.attention(*(x.double() for x in _qkv())),
                      r"q must be float16, bfloat16 or float32; got torch.float64"),
    "dtype-int": (lambda: _call(v=torch.ones(B, H_KV, S, D, dtype=torch.int32)),
                  r"v must be float16, bfloat16 or float32; got torch.int32"),
    "empty-batch": (lambda: _call(*(torch.randn(0, heads, S, D) for heads in (H, H_KV, H_KV))),
                    r"B and H must be >= 1; got B=0, H=4"),
    "no-heads": (lambda: _call(q=torch.randn(B, 0, S, D)), r"B and H must be >= 1; got B=2, H=0"),
    "empty-q": (lambda: _call(q=torch.randn(B, H, 0, D)), r"S_q and S_kv must be >= 1; got S_q=0, S_kv=40"),
    "empty-kv": (lambda: _call(k=torch.randn(B, H_KV, 0, D), v=torch.randn(B, H_KV, 0, D)),
                 r"S_q and S_kv must be >= 1; got S_q=40, S_kv=0"),
    "mask-q-len": (lambda: _call(mask=make("dense", S + 1, S, block=16)),
                   r"mask was built for q_len=41, kv_len=40; the inputs have S_q=40, S_kv=40"),
    "mask-kv-len": (lambda: _call(mask=make("causal", S, 2 * S, block=16)),
                    r"mask was built for q_len=40, kv_len=80; the inputs have S_q=40, S_kv=40"),
    "mask-heads": (lambda: _call(mask=make("random", S, block=16, heads=3)), r"mask has 3 heads; expected 1 or H=4"),
    "mask-kv-heads": (lambda: _call(mask=make("random", S, block=16, heads=H_KV)),
                      r"mask has 2 heads; expected 1 or H=4"),
    "mask-mod-reads-h": (lambda: _call(mask=from_mask_mod(lambda b, h, q, kv: (q >= kv) | (h == 1), S, block=16)),
                         r"the mask's mask_mod reads h, but the mask was built for one head and the inputs have 4: "
                         r"build it with from_mask_mod\(\.\.\., heads=4\)"),
    "mask-mod-reads-b": (lambda: _call(mask=from_mask_mod(lambda b, h, q, kv: (q >= kv) | (b == 1), S, block=16)),
                         r"mask_mod reads b, but the mask was built for one batch element and the inputs have 2: "
                         r"build it with from_mask_mod\(\.\.\., batch=2\)"),
    "mask-string": (lambda: _call(mask="sliding"),
                    r"mask must be None, 'causal', a BlockMask or a MaskSpec; got the string 'sliding'"),
    "mask-type": (lambda: _call(mask=torch.ones(3, 3, dtype=torch.bool)),
                  r"mask must be None, 'causal', a BlockMask or a MaskSpec; got Tensor"),
    "backend": (lambda: _call(backend="flash"), r"unknown backend 'flash'; expected one of: auto, .*blocked"),
    "key-lengths-shape": (lambda: _call(key_lengths=torch.tensor([S])),
                          r"key_lengths must be an integer tensor of shape \(2,\); got torch.int64 \(1,\)"),
    "key-lengths-2d": (lambda: _call(key_lengths=torch.tensor([[S, S]])),
                       r"key_lengths must be an integer tensor of shape \(2,\); got torch.int64 \(1, 2\)"),
    "key-lengths-float": (lambda: _call(key_lengths=torch.tensor([S, S], dtype=torch.float32)),
                          r"key_lengths must be an integer tensor .*got torch.float32 \(2,\)"),
    "key-lengths-bool": (lambda: _call(key_lengths=torch.tensor([True, True])),
                         r"key_lengths must be an integer tensor .*got torch.bool \(2,\)"),
    "key-lengths-list": (lambda: _call(key_lengths=[S, S]), r"key_lengths must be an integer tensor .*got list"),
    "key-lengths-device": (lambda: _call(key_lengths=torch.empty(B, dtype=torch.int64, device="meta")),
                           r"key_lengths must be on cpu; got meta"),
    "key-lengths-above-s": (lambda: _call(key_lengths=torch.tensor([S, S + 1])),
                            r"key_lengths must lie in \[0, S_kv=40\]; got \[40, 41\]"),
    "key-lengths-negative": (lambda: _call(key_lengths=torch.tensor([-1, S])),
                             r"key_lengths must lie in \[0, S_kv=40\]; got \[-1, 40\]"),
    "bshd-layout": (lambda: sparseflash.attention(*(x.transpose(1, 2) for x in _qkv()), make("dense", S, block=16)),
                    r"mask was built for q_len=40, kv_len=40; the inputs have S_q=4, S_kv=2; the inputs look like "
                    r"\(B, S, H, D\): attention takes \(B, H, S, D\)"),
    "scale-negative": (lambda: _call(scale=-1.0), r"scale must be a positive finite number or None; got -1.0"),
    "scale-zero": (lambda: _call(scale=0), r"scale must be a positive finite number or None; got 0"),
    "scale-nan": (lambda: _call(scale=float("nan")), r"scale must be a positive finite number or None; got nan"),
    "scale-inf": (lambda: _call(scale=float("inf")), r"scale must be a positive finite number or None; got inf"),
    "scale-bool": (lambda: _call(scale=True), r"scale must be a positive finite number or None; got True"),
    "scale-string": (lambda: _call(scale="0.5"), r"scale must be a positive finite number or None; got '0.5'"),
}


@pytest.mark.parametrize("case", list(ATTENTION_ERRORS))
def test_attention_errors(case):
    call, message = ATTENTION_ERRORS[case]
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("backend", ["reference", "blocked", "triton"])
def test_errors_do_not_depend_on_backend(backend):
    with pytest.raises(ValueError, match=r"batch sizes differ"):
        _call(k=torch.randn(1, H_KV, S, D), v=torch.randn(1, H_KV, S, D), backend=backend)
    with pytest.raises(ValueError, match=r"mask was built for q_len=41"):
        _call(mask=make("dense", S + 1, S, block=16), backend=backend)
    with pytest.raises(ValueError, match=r"mask_mod reads h, but the mask was built for one head"):
        _call(mask=from_mask_mod(lambda b, h, q, kv: (q >= kv) | (h == 1), S, block=16), backend=backend)


def test_the_triton_backend_on_cpu_tensors_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"backend 'triton' runs on CUDA tensors, or on the CPU under Triton's "
                                         r"interpreter \(TRITON_INTERPRET=1, slow\); got tensors on cpu"):
        _call(backend="triton")


def test_valid_inputs_pass():
    """The inputs the error cases start from are valid (so each error comes from its one change)."""
    o, lse = _call(mask=make("butterfly", S, block=16), key_lengths=torch.tensor([S, 3]), scale=0.5,
                   return_lse=True)
    assert o.shape == (B, H, S, D) and lse.shape == (B, H, S)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()


# ---------------------------------------------------------------------------- BlockMask
MASK_ERRORS = {
    "layout-1d": (lambda: BlockMask(torch.ones(4, dtype=torch.bool)),
                  r"layout must be \[n_q_blocks, n_kv_blocks\], \[H, n_q_blocks, n_kv_blocks\] or "
                  r"\[B, H, n_q_blocks, n_kv_blocks\]; got shape \(4,\)"),
    "layout-5d": (lambda: BlockMask(torch.ones(1, 1, 1, 2, 2, dtype=torch.bool)),
                  r"layout must be .*got shape \(1, 1, 1, 2, 2\)"),
    "layout-dtype": (lambda: BlockMask(torch.ones(2, 2)), r"layout must be a bool tensor; got dtype torch.float32"),
    "block-8": (lambda: BlockMask(torch.ones(2, 2, dtype=torch.bool), 8),
                r"SPARSE_BLOCK_M must be a power of two from 16 to 256; got 8"),
    "block-512": (lambda: BlockMask(torch.ones(2, 2, dtype=torch.bool), 512),
                  r"SPARSE_BLOCK_M must be a power of two from 16 to 256; got 512"),
    "block-48": (lambda: BlockMask(torch.ones(2, 2, dtype=torch.bool), 48),
                 r"SPARSE_BLOCK_M must be a power of two from 16 to 256; got 48"),
    "block-n-24": (lambda: BlockMask(torch.ones(2, 2, dtype=torch.bool), (16, 24)),
                   r"SPARSE_BLOCK_N must be a power of two from 16 to 256; got 24"),
    "block-0": (lambda: BlockMask(torch.ones(2, 2, dtype=torch.bool), 0), r"power of two from 16 to 256; got 0"),
    "block-triple": (lambda: BlockMask(torch.ones(2, 2, dtype=torch.bool), (16, 16, 16)),
                     r"block_size must be an int or a pair \(M, N\); got \(16, 16, 16\)"),
    "q-len-too-long": (lambda: BlockMask(torch.ones(2, 3, dtype=torch.bool), 16, q_len=33, kv_len=48),
                       r"q_len=33 with block 16 needs 3 blocks; the layout has 2"),
    "kv-len-too-short": (lambda: BlockMask(torch.ones(2, 3, dtype=torch.bool), 16, q_len=32, kv_len=32),
                         r"kv_len=32 with block 16 needs 2 blocks; the layout has 3"),
    "q-len-0": (lambda: BlockMask(torch.ones(1, 1, dtype=torch.bool), 16, q_len=0), r"q_len must be >= 1; got 0"),
    "kv-len-negative": (lambda: BlockMask(torch.ones(1, 1, dtype=torch.bool), 16, kv_len=-5),
                        r"kv_len must be >= 1; got -5"),
    "from-layout-block": (lambda: from_layout(torch.ones(2, 2, dtype=torch.bool), block=100),
                          r"power of two from 16 to 256; got 100"),
    "block-float": (lambda: BlockMask(torch.ones(2, 2, dtype=torch.bool), 64.0),
                    r"block_size must be an int or a pair \(M, N\); got 64.0"),
    "q-len-float": (lambda: BlockMask(torch.ones(2, 2, dtype=torch.bool), 16, q_len=30.7),
                    r"q_len must be an int >= 1; got 30.7"),
}


@pytest.mark.parametrize("case", list(MASK_ERRORS))
def test_block_mask_errors(case):
    call, message = MASK_ERRORS[case]
    with pytest.raises(ValueError, match=message):
        call()


def test_algebra_errors():
    a = make("dense", 64, block=16)
    with pytest.raises(ValueError, match=re.escape("& needs masks of the same (block_size, q_len, kv_len); "
                                                   "got ((16, 16), 64, 64) and ((32, 32), 64, 64)")):
        a & make("dense", 64, block=32)
    with pytest.raises(ValueError, match=re.escape("| needs masks of the same (block_size, q_len, kv_len); "
                                                   "got ((16, 16), 64, 64) and ((16, 16), 64, 48)")):
        a | make("dense", 64, 48, block=16)
    with pytest.raises(ValueError, match=r"&: layouts of 2 and 3 heads do not broadcast"):
        make("random", 64, block=16, heads=2) & make("random", 64, block=16, heads=3)
    with pytest.raises(TypeError, match=r"& needs two BlockMasks; got Tensor"):
        a & torch.ones(4, 4, dtype=torch.bool)


# ---------------------------------------------------------------------------- make and the registry
MAKE_ERRORS = {
    "unknown-name": (lambda: make("no-such-pattern", 64),
                     r"unknown pattern 'no-such-pattern'; registered patterns: .*bigbird, butterfly, causal, dense"),
    "unknown-param": (lambda: make("butterfly", 64, block=16, windo=2),
                      r"pattern 'butterfly' takes parameters \['factors', 'global_blocks'\]; got \['windo'\]"),
    "param-of-other-pattern": (lambda: make("local", 64, block=16, density=0.5),
                               r"pattern 'local' takes parameters \['window'\]; got \['density'\]"),
    "make-block": (lambda: make("dense", 64, block=(16, 300)), r"SPARSE_BLOCK_N must be a power of two .*got 300"),
    "make-q-len-0": (lambda: make("dense", 0, block=16), r"q_len must be >= 1; got 0"),
    "butterfly-factors": (lambda: make("butterfly", 64, block=16, factors=-1), r"butterfly factors must be >= 0; got -1"),
    "local-window": (lambda: make("local", 64, block=16, window=-1), r"window must be >= 0 blocks; got -1"),
    "strided-stride": (lambda: make("strided", 64, block=16, stride=0), r"strided needs stride >= 1; got 0"),
    "fixed-stride": (lambda: make("fixed", 64, block=16, stride=0),
                     r"fixed needs stride >= 1 and 1 <= summary <= stride; got 0, 1"),
    "fixed-summary": (lambda: make("fixed", 64, block=16, stride=2, summary=3),
                      r"fixed needs stride >= 1 and 1 <= summary <= stride; got 2, 3"),
    "random-density-0": (lambda: make("random", 64, block=16, density=0.0), r"random density must be in \(0, 1\]; got 0.0"),
    "random-density-big": (lambda: make("random", 64, block=16, density=1.5), r"random density must be in \(0, 1\]; got 1.5"),
    "longformer-window": (lambda: make("longformer", 64, block=16, window=-1), r"window must be >= 0 blocks; got -1"),
    "bigbird-window": (lambda: make("bigbird", 64, block=16, window=-2), r"window must be >= 0 blocks; got -2"),
    "butterfly-global": (lambda: make("butterfly", 64, block=16, global_blocks=-1),
                         r"global_blocks must be >= 0; got -1"),
    "longformer-global": (lambda: make("longformer", 64, block=16, global_blocks=-1),
                          r"global_blocks must be >= 0; got -1"),
    "bigbird-random-blocks": (lambda: make("bigbird", 64, block=16, random_blocks=-1),
                              r"bigbird random_blocks must be >= 0; got -1"),
    "register-int": (lambda: register(3), r"a pattern's name must be a non-empty string; got 3"),
    "import-patterns-string": (lambda: patterns.import_patterns("my_patterns.py"),
                               r"import_patterns takes a list of files or modules; got the string 'my_patterns.py'"),
    "make-heads-0": (lambda: make("random", 64, block=16, heads=0), r"heads must be None or an int >= 1; got 0"),
    "from-block-fn-heads-0": (lambda: from_block_fn(lambda h, i, j: i == j, 64, block=16, heads=0),
                              r"heads must be None or an int >= 1; got 0"),
    "from-block-fn-dtype": (lambda: from_block_fn(lambda h, i, j: (i - j).abs(), 64, block=16),
                            r"fn must return a bool tensor broadcastable to \(1, 4, 4\); got torch.int64 \(1, 4, 4\)"),
    "from-block-fn-shape": (lambda: from_block_fn(lambda h, i, j: torch.ones(3, 5, dtype=torch.bool), 64, block=16),
                            r"fn must return a bool tensor broadcastable to \(1, 4, 4\); got torch.bool \(3, 5\)"),
    "make-float-length": (lambda: make("dense", 100.5, block=16), r"q_len must be an int >= 1; got 100.5"),
    "make-string-block": (lambda: make("dense", 64, block="64"),
                          r"block_size must be an int or a pair \(M, N\); got '64'"),
    "make-float-heads": (lambda: make("random", 64, block=16, heads=2.5),
                         r"heads must be None or an int >= 1; got 2.5"),
    "from-mask-mod-batch": (lambda: from_mask_mod(lambda b, h, q, kv: q >= kv, 64, block=16, batch=True),
                            r"batch must be None or an int >= 1; got True"),
}


@pytest.mark.parametrize("case", list(MAKE_ERRORS))
def test_make_errors(case):
    call, message = MAKE_ERRORS[case]
    with pytest.raises(ValueError, match=message):
        call()


def test_pattern_with_wrong_output(monkeypatch):
    monkeypatch.setattr(patterns, "_REGISTRY", dict(patterns._REGISTRY))

    @register("test-errors-wrong-shape")
    def wrong_shape(n_q, n_kv):
        return torch.ones(n_q, n_kv + 1, dtype=torch.bool)

    @register("test-errors-wrong-dtype")
    def wrong_dtype(n_q, n_kv):
        return torch.ones(n_q, n_kv)

    with pytest.raises(ValueError, match=re.escape("pattern 'test-errors-wrong-shape' must return a bool tensor "
                                                   "of shape (4, 4); got torch.bool (4, 5)")):
        make("test-errors-wrong-shape", 64, block=16)
    with pytest.raises(ValueError, match=re.escape("pattern 'test-errors-wrong-dtype' must return a bool tensor "
                                                   "of shape (4, 4); got torch.float32 (4, 4)")):
        make("test-errors-wrong-dtype", 64, block=16)


def test_register_twice(monkeypatch):
    monkeypatch.setattr(patterns, "_REGISTRY", dict(patterns._REGISTRY))

    def first(n_q, n_kv):
        return torch.ones(n_q, n_kv, dtype=torch.bool)

    def second(n_q, n_kv):
        return torch.zeros(n_q, n_kv, dtype=torch.bool)

    register("test-errors-twice")(first)
    assert register("test-errors-twice")(first) is first  # the same function again is harmless
    with pytest.raises(ValueError, match=r"pattern 'test-errors-twice' is already registered \(by .*test_errors\)"):
        register("test-errors-twice")(second)
    with pytest.raises(ValueError, match=r"pattern 'butterfly' is already registered \(by sparseflash.masks.patterns\)"):
        register("butterfly")(second)
