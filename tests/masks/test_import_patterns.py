"""import_patterns: a user's pattern module, named on the command line, is registered before use."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from sparseflash.masks import import_patterns, make, patterns

PATTERN_SOURCE = '''
import torch
from sparseflash import masks

@masks.register("{name}")
def every_third(n_q, n_kv, offset: int = 0):
    i, j = torch.meshgrid(torch.arange(n_q), torch.arange(n_kv), indexing="ij")
    return (i - j + offset) % 3 == 0
'''
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def private_registry(monkeypatch):
    monkeypatch.setattr(patterns, "_REGISTRY", dict(patterns._REGISTRY))


def _write(tmp_path: Path) -> tuple[Path, str]:
    name = f"third_{uuid.uuid4().hex[:8]}"
    path = tmp_path / f"{name}.py"
    path.write_text(PATTERN_SOURCE.format(name=name))
    return path, name


def test_file_is_imported_once(tmp_path, private_registry):
    path, name = _write(tmp_path)
    import_patterns([str(path)])
    import_patterns([str(path)])  # a second import would register twice and raise
    mask = make(name, 96, block=16, offset=1)
    assert mask.layout.sum().item() == sum((i - j + 1) % 3 == 0 for i in range(6) for j in range(6))


def test_same_file_name_in_two_folders_is_two_modules(tmp_path, private_registry):
    names = []
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        name = f"third_{uuid.uuid4().hex[:8]}"
        (tmp_path / folder / "patterns_here.py").write_text(PATTERN_SOURCE.format(name=name))
        names.append(name)
    import_patterns([str(tmp_path / "a" / "patterns_here.py"), str(tmp_path / "b" / "patterns_here.py")])
    assert set(names) <= set(patterns.registered())


def test_a_failed_import_is_retried(tmp_path, private_registry):
    path, name = _write(tmp_path)
    source = path.read_text()
    path.write_text("raise RuntimeError('not yet')\n")
    with pytest.raises(RuntimeError, match="not yet"):
        import_patterns([str(path)])
    path.write_text(source)
    import_patterns([str(path)])
    assert name in patterns.registered()


def test_module_name_is_found_from_the_working_directory(tmp_path, private_registry, monkeypatch):
    path, name = _write(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    import_patterns([name])
    assert name in patterns.registered()


def test_missing_file_says_which(tmp_path):
    with pytest.raises(ValueError, match="import_patterns: no file .*nowhere.py"):
        import_patterns([str(tmp_path / "nowhere.py")])


def test_bench_command_line_uses_a_registered_file(tmp_path):
    path, name = _write(tmp_path)
    out = tmp_path / "bench"
    cmd = [sys.executable, str(ROOT / "experiments" / "bench.py"), "bench=smoke", f"import_patterns=[{path}]",
           f"patterns=[dense,{name}]", "seq_lens=[64]", "modes=[fwd]", "backends=[sparseflash-blocked]",
           "plots.enabled=false", f"hydra.run.dir={out}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = (out / "results.csv").read_text().splitlines()
    assert any(name in row and ",ok," in row for row in rows), rows
