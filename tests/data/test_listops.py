import numpy as np
import pytest

from sparseflash.data import listops
from sparseflash.data.common import MissingDataError
from tests.data.fixtures import write_listops


def _evaluate(tokens):
    """An independent evaluator of ``[OP a b ... ]`` token lists."""
    inv = {v: k for k, v in listops.VOCAB.items()}
    stack = []
    for t in tokens:
        tok = inv[int(t)]
        if tok.startswith("["):
            stack.append([tok])
        elif tok == "]":
            op, *args = stack.pop()
            val = {"[MIN": min, "[MAX": max, "[MED": lambda a: int(np.median(a)),
                   "[SM": lambda a: sum(a) % 10}[op](args)
            if stack:
                stack[-1].append(val)
            else:
                return val
        else:
            if stack:
                stack[-1].append(int(tok))
            else:
                return int(tok)


def test_generator_is_faithful_and_seeded():
    rows = listops.generate(300, min_length=20, max_length=80, max_depth=4, max_args=5, seed=3, workers=1, chunk=100)
    assert len({r[0] for r in rows}) == 300  # no duplicates
    for text, value in rows:
        tokens = listops.tokenize(text)
        assert 20 < len(tokens) < 80
        assert _evaluate(tokens) == value and 0 <= value <= 9
        assert text.startswith("(") and text.endswith("] )")  # LRA's bracketing
    ops = {t for text, _ in rows for t in text.split() if t.startswith("[")}
    assert ops == {"[MIN", "[MAX", "[MED", "[SM"}
    again = listops.generate(300, min_length=20, max_length=80, max_depth=4, max_args=5, seed=3, workers=2, chunk=100)
    assert again == rows  # seeded, independent of the number of processes
    other = listops.generate(300, min_length=20, max_length=80, max_depth=4, max_args=5, seed=4, workers=1, chunk=100)
    assert other != rows


def test_tokenize_released_format():
    tokens = listops.tokenize("( ( ( [MAX 2 ) 9 ) ( ( ( [MIN 4 ) 7 ) ] ) ) ] )")
    names = [{v: k for k, v in listops.VOCAB.items()}[int(t)] for t in tokens]
    assert names == ["[MAX", "2", "9", "[MIN", "4", "7", "]", "]"]
    assert _evaluate(tokens) == 9


def test_loader_reads_lra_tsv(tmp_path):
    rows = write_listops(tmp_path, n=20)
    header = (tmp_path / "basic_train.tsv").read_text().splitlines()[0]
    assert header == "Source\tTarget"
    ds = listops.load_tsv(tmp_path / "basic_val.tsv")
    assert len(ds) == 20 and list(ds.labels) == [v for _, v in rows[20:40]]
    assert all(_evaluate(s) == y for s, y in zip(ds.seqs, ds.labels))


def _slow_tokens(expression: str) -> list[int]:
    """The obvious tokeniser, to check the fast one against (an unknown token: UNK per character)."""
    return [i for t in expression.split() if t not in ("(", ")")
            for i in ([listops.VOCAB[t]] if t in listops.VOCAB else [listops.UNK] * len(t))]


@pytest.mark.parametrize("newline", ["\n", "\r\n"], ids=["lf", "crlf"])
def test_loader_tokenises_as_the_obvious_tokeniser(tmp_path, newline):
    rows = listops.generate(60, min_length=5, max_length=300, max_depth=6, max_args=6, seed=5, workers=1)
    rows += [("( ( [MAX 7 ) ( ( [XY 3 ) ] ) ] )", 7), ("[SM 1 2 ]", 3)]  # an unknown token; no brackets
    lines = ["Source\tTarget"] + [f"{text}\t{value}" for text, value in rows[:30]] + ["", "no tab here"]
    lines += [f"{text}\t{value}" for text, value in rows[30:]]
    path = tmp_path / "basic_test.tsv"
    path.write_bytes(newline.join(lines).encode())  # no newline after the last line
    ds = listops.load_tsv(path)
    assert list(ds.labels) == [value for _, value in rows]
    assert [list(s) for s in ds.seqs] == [_slow_tokens(text) for text, _ in rows]
    assert all(s.dtype == np.int8 for s in ds.seqs)
    short = listops.load_tsv(path, max_len=10)
    assert [list(s) for s in short.seqs] == [_slow_tokens(text)[:10] for text, _ in rows]


def test_loader_refuses_a_file_without_the_header_or_a_value(tmp_path):
    (tmp_path / "x.tsv").write_text("[MAX 1 2 ]\t2\n")
    with pytest.raises(ValueError, match="expected the header 'Source<TAB>Target'"):
        listops.load_tsv(tmp_path / "x.tsv")
    (tmp_path / "y.tsv").write_text("Source\tTarget\n[MAX 1 2 ]\t2\n[MIN 1 2 ]\tone\n")
    with pytest.raises(ValueError, match="line 3: expected the value"):
        listops.load_tsv(tmp_path / "y.tsv")


def test_generated_files_are_cached(tmp_path):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"name": "listops", "data_dir": str(tmp_path), "generate": True, "max_len": 64,
                            "generator": {"min_length": 5, "max_length": 40, "max_depth": 3, "max_args": 4},
                            "sizes": {"train": 30, "val": 10, "test": 10}})
    task = listops.build(cfg)
    assert (len(task.train), len(task.val), len(task.test)) == (30, 10, 10)
    stamp = (tmp_path / "basic_train.tsv").stat().st_mtime_ns
    listops.build(cfg)
    assert (tmp_path / "basic_train.tsv").stat().st_mtime_ns == stamp  # not regenerated
    cfg.generate = False
    cfg.data_dir = str(tmp_path / "missing")
    with pytest.raises(MissingDataError, match="task.data_dir"):
        listops.build(cfg)
