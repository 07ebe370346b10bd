"""The README's "Define your own pattern" example, verbatim, runs and is right.

The snippet is executed as written (in a private copy of the pattern registry, so that running
this file twice, or beside another test that registers "dilated_blocks", cannot collide). Keep it in
step with README.md.
"""

from __future__ import annotations

import pytest
import torch

import sparseflash
from sparseflash.masks import patterns
from tests.helpers import assert_close

README_EXAMPLE = '''
import torch
import sparseflash
from sparseflash import masks

@masks.register("dilated_blocks")
def dilated_blocks(n_q, n_kv, dilation: int = 2):
    i, j = torch.meshgrid(torch.arange(n_q), torch.arange(n_kv), indexing="ij")
    return (i - j) % dilation == 0

mask = masks.make("dilated_blocks", q_len=4096, block=128, dilation=4)
print(mask.density)  # 0.25
q = k = v = torch.randn(1, 8, 4096, 64)
o = sparseflash.attention(q, k, v, mask)
'''


@pytest.fixture
def private_registry(monkeypatch):
    monkeypatch.setattr(patterns, "_REGISTRY", dict(patterns._REGISTRY))


def _run_example() -> dict:
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(README_EXAMPLE, "README.md", "exec"), namespace)
    return namespace


def test_readme_example(private_registry, capsys):
    ns = _run_example()
    assert capsys.readouterr().out.strip() == "0.25"

    mask, q, k, v, o = ns["mask"], ns["q"], ns["k"], ns["v"], ns["o"]
    assert "dilated_blocks" in sparseflash.masks.registered()
    assert mask.density == 0.25 and mask.shape == (1, 32, 32) and mask.kind is sparseflash.MaskKind.SPARSE
    expected = torch.tensor([[(i - j) % 4 == 0 for j in range(32)] for i in range(32)])
    assert torch.equal(mask.layout[0], expected)

    assert o.shape == (1, 8, 4096, 64) and o.dtype == torch.float32
    # the reference materialises 4096 x 4096 scores per head: compare two heads (the mask is shared)
    want = sparseflash.attention(q[:, :2], k[:, :2], v[:, :2], mask, backend="reference")
    assert_close(o[:, :2], want, 1e-5, "o of the README example")


def test_readme_example_with_gradients(private_registry):
    """The registered pattern also works with a smaller input, through backward."""
    ns = _run_example()
    mask = ns["masks"].make("dilated_blocks", q_len=300, block=32, dilation=3)
    assert mask.density == pytest.approx(mask.to_dense().double().mean().item(), abs=1e-12)
    q, k, v = (torch.randn(2, 2, 300, 16, requires_grad=True) for _ in range(3))
    do = torch.randn(2, 2, 300, 16)
    grads = []
    for backend in ("blocked", "reference"):
        o = sparseflash.attention(q, k, v, mask, backend=backend)
        grads.append((o, *torch.autograd.grad(o, (q, k, v), do)))
    for name, a, b in zip(("o", "dq", "dk", "dv"), *grads):
        assert_close(a, b, 1e-5, name)


def test_registering_the_example_twice_raises(private_registry):
    """The example registers "dilated_blocks" once; running it again defines a new function and raises."""
    _run_example()
    with pytest.raises(ValueError, match=r"pattern 'dilated_blocks' is already registered"):
        _run_example()
