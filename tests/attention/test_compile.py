"""``torch.compile(fullgraph=True)`` over ``sparseflash.attention`` and ``SparseAttention`` on every backend:
outputs and gradients (a captured table's included) against the reference, one compiled graph for
masks of the same shapes, and a compiled model equal to the eager one.

On CPU the Triton kernels run under the interpreter, inside the custom ops that torch.compile sees;
the ``gpu`` tests run them compiled, at realistic sizes.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import sparseflash
from sparseflash import SparseAttention, masks
from tests.attention.test_mods import _case_id, _inputs, _mask
from tests.helpers import _grads, check_backend, check_outputs

# torch's own Inductor code calls torch.jit.script_method, which warns
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
BACKENDS = ["blocked", "triton", "reference"]
CASES = [
    # kind, q_len, kv_len, dim, dtype, gqa, key_lengths
    ("dense", 70, 70, 16, torch.float32, False, True),
    ("causal", 100, 63, 16, torch.bfloat16, True, False),
    ("butterfly", 130, 130, 8, torch.float16, False, False),
    ("document-lengths", 90, 60, 8, torch.bfloat16, False, True),
    ("per-batch-and-head", 100, 100, 8, torch.float16, True, False),
    ("empty-rows", 100, 90, 16, torch.bfloat16, False, False),
    ("alibi-causal", 63, 111, 8, torch.bfloat16, False, True),
    ("softcap-dense", 70, 70, 16, torch.bfloat16, False, False),
    ("relative-bias-window", 80, 50, 8, torch.float16, True, False),
]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: Dynamo's per-code-object recompile limit and its automatic dynamic
    shapes would otherwise carry over from earlier tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _case_mask(kind, q_len, kv_len, batch, heads, device):
    if kind in ("dense", "causal"):  # by name: built outside the graph, once
        return (None if kind == "dense" else "causal"), None
    if kind == "butterfly":
        return masks.make("butterfly", q_len, kv_len, block=32, device=device), None
    return _mask(kind, q_len, kv_len, batch, heads, device)


def _check_compiled(case, backend, compiler, batch=2, heads=4, device="cpu"):
    kind, q_len, kv_len, dim, dtype, gqa, key_lengths = case
    q, k, v, do = _inputs(batch, heads, heads // 2 if gqa else heads, q_len, kv_len, dim, dtype, device)
    mask, score_mod = _case_mask(kind, q_len, kv_len, batch, heads, device)
    lengths = torch.tensor([kv_len * 2 // 3 + 1, 0], device=device) if key_lengths else None
    counter = CompileCounterWithBackend(compiler)
    got = check_backend(backend, q, k, v, mask, do, lengths, score_mod=score_mod, compiler=counter)
    assert counter.frame_count == 1  # fullgraph: one graph, no break
    if kind == "empty-rows":  # rows that see no key: output 0, lse -inf, no gradient, never NaN
        assert torch.all(got.o[:, :, 10:50] == 0) and torch.all(got.lse[:, :, 10:50] == float("-inf"))
        assert torch.all(got.dq[:, :, 10:50] == 0)
    if kind == "relative-bias-window":
        assert len(got.dcaptures) == 1 and got.dcaptures[0].abs().sum() > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_compiled_matches_reference(case, backend):
    _check_compiled(case, backend, "aot_eager")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", [CASES[3], CASES[8]], ids=_case_id)
def test_inductor_matches_reference(case, backend):
    _check_compiled(case, backend, "inductor")


GPU_CASES = [
    ("causal", 2048, 2048, 128, torch.bfloat16, True, False),
    ("butterfly", 1000, 1000, 64, torch.float16, False, True),
    ("document-lengths", 4096, 4096, 64, torch.bfloat16, True, False),
    ("alibi-causal", 2048, 2048, 128, torch.bfloat16, False, False),
    ("relative-bias-window", 2000, 2000, 64, torch.bfloat16, True, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_gpu_compiled_matches_reference(case, compiler):
    _check_compiled(case, "triton", compiler, device="cuda")


REDUCE_OVERHEAD_CASES = [
    # mask, q_len, kv_len, dim, heads, kv_heads: decoding (split-KV) against a cache, and training steps
    ("dense", 1, 8192, 128, 8, 1),
    ("causal", 2048, 2048, 64, 4, 2),
    ("causal-persistent", 2048, 2048, 128, 4, 4),  # the persistent forward: its TMA scratch is kept too
    ("butterfly", 1000, 1000, 128, 4, 4),
    ("document", 1024, 1024, 64, 4, 4),  # a mask_mod capturing document ids
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", REDUCE_OVERHEAD_CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}-d{c[3]}")
def test_gpu_reduce_overhead_cuda_graphs_match_reference(case, monkeypatch):
    """``torch.compile(mode="reduce-overhead")`` replays the forward and backward graphs as CUDA graphs, which
    allow no allocation to outlive a call in their memory pool: the masks, plans and tables the op keeps
    are made outside it (``kept_tensors``). Three steps, each with new random inputs copied into the
    graphs, each against the reference, and no graph skipped; a mask given by name, or a BlockMask whose
    tensors (and a mask_mod's captured ones) are static."""
    kind, q_len, kv_len, dim, heads, kv_heads = case
    mask = kind.split("-")[0] if kind.startswith("causal") else None
    if kind == "causal-persistent":
        monkeypatch.setenv("SPARSEFLASH_PERSISTENT", "1")
    if kind in ("butterfly", "document"):  # a BlockMask: its tensors static, so that the graphs read them in place
        if kind == "butterfly":
            mask = masks.make("butterfly", q_len, block=128, device="cuda")
        else:
            ids = torch.randint(0, 5, (q_len,), device="cuda").sort().values
            mask = masks.from_mask_mod(lambda b, h, q_idx, kv_idx: ids[q_idx] == ids[kv_idx], q_len, block=128)
        for t in (*mask.parts()[0], *mask.parts()[1]):
            torch._dynamo.mark_static_address(t)

    def run(q, k, v):
        return sparseflash.attention(q, k, v, mask, return_lse=True)

    compiled = torch.compile(run, mode="reduce-overhead", fullgraph=True)
    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    for _ in range(3):
        torch.compiler.cudagraph_mark_step_begin()
        q, k, v, do = _inputs(2, heads, kv_heads, q_len, kv_len, dim, torch.bfloat16, "cuda")
        got = _grads(compiled, q, k, v, do, None)
        check_outputs(got, q, k, v, mask, do)
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == skips  # the steps ran as CUDA graphs


@pytest.mark.parametrize("backend", BACKENDS)
def test_new_mask_of_the_same_shapes_does_not_recompile(backend):
    """Random layouts, and document masks whose captured ids differ, same shapes: one graph for each kind of
    mask, each call the eager result of its own mask."""
    counter = CompileCounterWithBackend("aot_eager")

    def run(q, k, v, mask):
        return sparseflash.attention(q, k, v, mask, backend=backend)

    compiled = torch.compile(run, backend=counter, fullgraph=True)
    q, k, v, _ = _inputs(2, 2, 2, 96, 96, 16, torch.float32)
    for seed in range(3):
        layout = masks.make("random", 96, block=32, density=0.5, seed=seed)
        ids = torch.randint(0, 4, (96,)).sort().values

        def same_document(b, h, q_idx, kv_idx):
            return ids[q_idx] == ids[kv_idx]

        documents = masks.from_mask_mod(same_document, 96, block=32)
        for mask in (layout, documents):
            torch.testing.assert_close(compiled(q, k, v, mask), run(q, k, v, mask), rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 2  # one graph for the layouts, one for the masks with a mask_mod


class _Block(torch.nn.Module):
    def __init__(self, mask, score_mod, backend):
        super().__init__()
        self.attn = SparseAttention(32, 4, mask=mask, backend=backend, score_mod=score_mod)
        self.ff = torch.nn.Linear(32, 32)

    def forward(self, x):
        return self.ff(torch.relu(self.attn(x))) + x


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask,score_mod", [
    ({"pattern": "butterfly", "block": 32}, None),
    ({"pattern": "sliding_window", "block": 32, "params": {"window": 20}, "causal": True}, "relative_bias"),
    ("causal", "alibi"),
], ids=["butterfly", "sliding-window-relative-bias", "causal-alibi"])
def test_compiled_module_matches_eager(mask, score_mod, backend):
    """A block with SparseAttention compiled with fullgraph=True: the output and every parameter's gradient
    equal the eager model's; the mask is built from its spec outside the graph, so a second step does
    not recompile."""
    torch.manual_seed(0)
    model = _Block(mask, score_mod, backend)
    if score_mod == "relative_bias":
        with torch.no_grad():
            model.attn.score_mod.table.normal_()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    x = torch.randn(2, 93, 32)
    grads = []
    for run in (model, compiled, compiled):
        model.zero_grad()
        out = run(x)
        out.square().sum().backward()
        grads.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
    for out, params in grads[1:]:
        torch.testing.assert_close(out, grads[0][0], rtol=1e-5, atol=1e-5)
        for got, want in zip(params, grads[0][1]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert counter.frame_count == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_key_mask_matches_eager_and_a_new_mask_does_not_recompile(backend):
    """SparseAttention's key_mask (a score function over a captured table made in the graph) under
    fullgraph=True: output and input gradient as in eager mode, for two different masks, one graph."""
    model = SparseAttention(32, 4, mask="causal", backend=backend)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda x, keys: model(x, key_mask=keys), backend=counter, fullgraph=True)
    for _ in range(2):
        x = torch.randn(2, 45, 32, requires_grad=True)
        keys = torch.rand(2, 45) < 0.6
        want = model(x, key_mask=keys)
        got = compiled(x, keys)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        grad = torch.randn_like(want)
        torch.testing.assert_close(torch.autograd.grad(got, x, grad)[0], torch.autograd.grad(want, x, grad)[0],
                                   rtol=1e-4, atol=1e-5)
    assert counter.frame_count == 1
