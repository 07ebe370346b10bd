"""Files replaced whole: a reader (another process, or a run resumed after a crash) sees the old file or
the new one, never half of one."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def replacing(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """A temporary path beside ``path`` (its folder made if missing) for the block to write; leaving the
    block renames it over ``path``, an error in the block removes it and leaves ``path`` as it was.
    ``suffix`` ends the temporary name, for writers that add one otherwise (``numpy.savez`` adds ".npz").
    The name holds the process and thread, so that writers of one file at once do not share it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp{suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # an error in the block, or in the rename
