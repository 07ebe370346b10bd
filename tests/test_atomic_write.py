"""``atomic_write.replacing``: a file replaced whole, or left as it was."""

from __future__ import annotations

import pytest

from sparseflash.atomic_write import replacing


def test_the_block_s_file_replaces_the_old_one_and_no_temporary_file_stays(tmp_path):
    path = tmp_path / "a" / "b" / "results.json"  # its folders made
    for text in ("old", "new"):
        with replacing(path) as tmp:
            assert tmp.parent == path.parent and tmp != path
            tmp.write_text(text)
            assert not path.exists() or path.read_text() == "old"  # not replaced before the block ends
    assert path.read_text() == "new"
    assert sorted(p.name for p in path.parent.iterdir()) == ["results.json"]


def test_an_error_in_the_block_leaves_the_old_file_and_removes_the_temporary_one(tmp_path):
    path = tmp_path / "state.pt"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="interrupted"):
        with replacing(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("interrupted")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["state.pt"]


def test_the_suffix_ends_the_temporary_name(tmp_path):
    import numpy as np

    path = tmp_path / "images.npz"
    with replacing(path, suffix=".npz") as tmp:
        assert tmp.name.endswith(".npz")
        np.savez_compressed(tmp, x=np.arange(3))  # adds no suffix of its own to such a name
    with np.load(path) as f:
        assert f["x"].tolist() == [0, 1, 2]
