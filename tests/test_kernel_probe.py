"""scripts/kernel_probe.py's ``--variant``: a modified copy of a Gluon kernels' module, loaded as a module of its own,
is what the launches find inside ``gluon_module`` (and the tree's after); its outputs are compared with the tree's.
The timing itself needs a GPU."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper", reason="Triton without Gluon for Hopper")
import sparseflash  # noqa: E402
from sparseflash.attention.triton import backward_gluon  # noqa: E402
from sparseflash.attention.triton.plan import gluon_kernels  # noqa: E402
from tests.helpers import module_from_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def probe():
    return module_from_file(ROOT / "scripts" / "kernel_probe.py", "kernel_probe")


def test_a_variant_is_what_the_launches_find_inside_its_context(probe, tmp_path):
    copy = tmp_path / "backward_variant.py"
    shutil.copy(backward_gluon.__file__, copy)
    direction, variant = probe.load_variant(f"backward:{copy}")
    assert direction == "backward" and variant is not backward_gluon
    assert variant.BACKWARD_GLUON is not backward_gluon.BACKWARD_GLUON  # kernels of its own
    with probe.gluon_module(direction, variant):
        assert gluon_kernels("backward") is variant
        assert gluon_kernels("forward") is not variant
    assert gluon_kernels("backward") is backward_gluon


@pytest.mark.parametrize("spec", ["sideways:{file}", "backward:{missing}", "{file}"],
                         ids=["unknown-direction", "missing-file", "no-direction"])
def test_a_bad_variant_says_what_it_expected(probe, tmp_path, spec):
    file = tmp_path / "variant.py"
    file.write_text("")
    with pytest.raises(SystemExit, match="expected forward:FILE or backward:FILE"):
        probe.load_variant(spec.format(file=file, missing=tmp_path / "missing.py"))


def test_outputs_are_compared_with_the_trees(probe):
    """The same function differs by 0 from itself; one whose output is off by 1 % of its largest entry reads ~1e-2,
    and a NaN reads nan."""
    q, k, v = (torch.randn(1, 2, 37, 16) for _ in range(3))

    def tree(q, k, v):
        return sparseflash.attention(q, k, v, "causal", backend="reference")

    def off(q, k, v):
        o = tree(q, k, v)
        return o + 0.01 * o.detach().abs().max() * (torch.arange(o.numel()).reshape(o.shape) == 5)

    def nan(q, k, v):
        return tree(q, k, v) * float("nan")

    same = probe.compare_outputs(tree, tree, probe.contextlib.nullcontext, q, k, v)
    assert same == "o 0.0e+00 dq 0.0e+00 dk 0.0e+00 dv 0.0e+00", same
    differs = dict(zip(*[iter(probe.compare_outputs(tree, off, probe.contextlib.nullcontext, q, k, v).split())] * 2))
    assert 0.009 < float(differs["o"]) < 0.011 and float(differs["dq"]) == 0.0, differs
    assert "nan" in probe.compare_outputs(tree, nan, probe.contextlib.nullcontext, q, k, v)
