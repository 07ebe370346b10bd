import numpy as np
import pytest
from omegaconf import OmegaConf

from sparseflash.data import MissingDataError, build_task, collate, seeded_split
from tests.data.fixtures import write_aan, write_cifar, write_imdb


def test_cifar_grey_sequences(tmp_path):
    write_cifar(tmp_path, per_batch=10)
    cfg = OmegaConf.create({"name": "image", "source": "cifar10", "data_dir": str(tmp_path), "val_size": 5})
    task = build_task(cfg)
    assert (len(task.train), len(task.val), len(task.test)) == (45, 5, 10)
    seq, label = task.train[0]
    assert seq.shape == (1024,) and 1 <= seq.min() and seq.max() <= 256 and 0 <= label < 10


def test_digits_stand_in():
    task = build_task(OmegaConf.create({"name": "image", "source": "digits", "data_dir": None}))
    assert len(task.train) + len(task.val) + len(task.test) == 1797
    assert task.train[0][0].shape == (1024,)


def test_imdb_bytes(tmp_path):
    write_imdb(tmp_path, per_class=6)
    task = build_task(OmegaConf.create({"name": "text", "data_dir": str(tmp_path), "max_len": 40,
                                        "val_fraction": 0.25}))
    assert len(task.test) == 12 and len(task.train) + len(task.val) == 12
    assert max(len(s) for s in task.train.seqs) <= 40
    first = task.test.seqs[0]
    assert bytes((first - 1).astype(np.uint8).tolist()).startswith(b"dull")


def test_aan_pairs(tmp_path):
    write_aan(tmp_path, n=10)
    task = build_task(OmegaConf.create({"name": "retrieval", "data_dir": str(tmp_path), "max_len": 12}))
    assert task.pair and len(task.train) == 10 and list(task.test.labels[:4]) == [0, 1, 0, 1]
    batch = collate([task.train[i] for i in range(4)])
    assert set(batch) == {"x", "lengths", "x2", "lengths2", "y"} and batch["x"].shape[1] <= 12


@pytest.mark.parametrize("case", ["header", "commas", "empty"])
def test_bad_aan_files_are_explained(tmp_path, case):
    write_aan(tmp_path, n=4)
    train = tmp_path / "new_aan_pairs.train.tsv"
    if case == "header":
        train.write_text("label\tid1\tid2\ttext1\ttext2\n" + train.read_text())
        message = r"new_aan_pairs.train.tsv, line 1: expected 'label<TAB>id1<TAB>id2<TAB>text1<TAB>text2' .*got b'label"
    elif case == "commas":
        train.write_text(train.read_text().replace("\t", ","))
        message = r"line 1: expected 'label<TAB>id1<TAB>id2<TAB>text1<TAB>text2' with a label 0 or 1; got b'0.0,P00"
    else:
        train.write_text("\n")
        message = r"new_aan_pairs.train.tsv holds no pairs; expected lines \"1.0<TAB>P01-1005"
    with pytest.raises(ValueError, match=message):
        build_task(OmegaConf.create({"name": "retrieval", "data_dir": str(tmp_path), "max_len": 12}))


@pytest.mark.parametrize("name,extra,expect", [
    ("listops", {"generate": False}, "basic_train.tsv"),
    ("pathfinder", {"generate": False}, "curv_contour_length_14"),
    ("image", {"source": "cifar10"}, "cifar-10-batches-py"),
    ("text", {}, "aclImdb"),
    ("retrieval", {}, "new_aan_pairs"),
])
def test_missing_data_error(tmp_path, name, extra, expect):
    cfg = OmegaConf.create({"name": name, "data_dir": str(tmp_path / "nowhere"), "max_len": 100, **extra})
    with pytest.raises(MissingDataError) as err:
        build_task(cfg)
    msg = str(err.value)
    assert str(tmp_path / "nowhere") in msg and expect in msg and "task.data_dir" in msg
    assert "Expected layout" in msg


def test_collate_and_split():
    batch = collate([(np.array([3, 4, 5]), 1), (np.array([7]), 0)])
    assert batch["x"].tolist() == [[3, 4, 5], [7, 0, 0]] and batch["lengths"].tolist() == [3, 1]
    a, b, c = seeded_split(10, [0.6, 0.2, -1], seed=0)
    assert sorted(np.concatenate([a, b, c]).tolist()) == list(range(10)) and len(c) == 2
    assert (seeded_split(10, [5, -1], seed=1)[0] == seeded_split(10, [5, -1], seed=1)[0]).all()
