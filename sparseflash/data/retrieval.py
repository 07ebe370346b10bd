"""Document retrieval (LRA "Retrieval", AAN): does paper 1 cite paper 2? Byte-level pairs from
``new_aan_pairs.{train,eval,test}.tsv``, each side truncated to ``max_len`` (4000 as LRA).

Files have no header and tab-separated columns ``label id1 id2 text1 text2`` (label written
as a float, ``0.0``/``1.0``; no quoting), read as LRA's ``matching/input_pipeline.py`` does.
Token id = byte + 1 (0 is padding). The model is a dual encoder (one encoder for both sides).
"""

from __future__ import annotations

from pathlib import Path

from sparseflash.data.common import SequenceDataset, TaskData, bytes_to_tokens, require

EXAMPLE_LINE = '"1.0<TAB>P01-1005<TAB>W04-1013<TAB>text of 1<TAB>text of 2"'
LAYOUT = f"""<task.data_dir>/                    (LRA's lra_release/tsv_data/)
  new_aan_pairs.train.tsv    no header; tab-separated: label id1 id2 text1 text2
  new_aan_pairs.eval.tsv     e.g. {EXAMPLE_LINE}
  new_aan_pairs.test.tsv"""

SPLITS = {"train": "train", "val": "eval", "test": "test"}


def load_tsv(path: Path, max_len: int) -> SequenceDataset:
    """The pairs of one AAN file (``LAYOUT``); blank lines are skipped, any other line must have its five
    tab-separated columns and a label 0 or 1."""
    pairs, labels = [], []
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            cols = line.rstrip(b"\r\n").split(b"\t")
            if cols == [b""]:
                continue
            try:
                label = float(cols[0]) if len(cols) >= 5 else None
            except ValueError:
                label = None
            if label not in (0.0, 1.0):
                raise ValueError(f"{path}, line {number}: expected 'label<TAB>id1<TAB>id2<TAB>text1<TAB>text2' "
                                 f"with a label 0 or 1; got {line[:60]!r}")
            labels.append(int(label))
            pairs.append((bytes_to_tokens(cols[3], max_len), bytes_to_tokens(cols[4], max_len)))
    if not pairs:
        raise ValueError(f"{path} holds no pairs; expected lines {EXAMPLE_LINE}")
    return SequenceDataset(pairs, labels, pair=True)


def build(cfg) -> TaskData:
    """``cfg``: the ``task`` config (data_dir, prefix, max_len)."""
    root = Path(cfg.data_dir)
    prefix = str(cfg.get("prefix", "new_aan_pairs"))
    files = {k: root / f"{prefix}.{v}.tsv" for k, v in SPLITS.items()}
    require("AAN retrieval", list(files.values()), LAYOUT)
    max_len = int(cfg.get("max_len", 4000))
    train, val, test = (load_tsv(files[k], max_len) for k in ("train", "val", "test"))
    longest = max(max(len(a), len(b)) for d in (train, val, test) for a, b in d.seqs)
    return TaskData("retrieval", train, val, test, num_classes=2, vocab_size=257,
                    max_len=min(max_len, longest), pair=True, info={"majority": test.majority()})
