"""What the Hydra entry points (``experiments/train.py``, ``experiments/bench.py``) share: the body
of a task function runs inside ``job()``, which reports a failed run in one line.

A mistake the user can fix ends the program with ``error: <message>`` on stderr (and in the
job's log file) and exit status 2, without Hydra's traceback. Such a mistake is a ``RunError``, or
a ``ValueError``, ``FileNotFoundError`` or ``ImportError`` raised by sparseflash's own code, which
raises them on purpose with messages that say what to change (a bad config value, an unknown
pattern, a missing dataset or checkpoint, an optional package not installed). The same exceptions
raised inside torch or another library, and all other exceptions, are bugs: Hydra prints their
traceback as usual, as it does for every error when ``HYDRA_FULL_ERROR=1``. In a multirun (``-m``)
the error is logged the same way and then handed to Hydra as a ``RunError``, so that Hydra runs
the rest of the batch and reports it at the end (exit status 1).

A failed run whose directory holds only what Hydra wrote before the job started (``.hydra/``,
the job's log) leaves no directory behind. Ctrl-C ends the program with status 130, quietly.
Python warnings are logged (logger ``py.warnings``), so that the job's log file has them too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path
from typing import Iterator

from hydra.errors import CompactHydraException

log = logging.getLogger(__name__)
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


class RunError(CompactHydraException):
    """A run that cannot give what was asked, for the reason its message states."""


@contextlib.contextmanager
def job() -> Iterator[None]:
    """Run the body of a Hydra task function (see the module docstring)."""
    logging.captureWarnings(True)
    try:
        yield
    except KeyboardInterrupt:
        raise SystemExit(EXIT_INTERRUPTED) from None
    except Exception as err:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hydra = HydraConfig.get()
        main_rank = int(os.environ.get("RANK", "0")) == 0  # under torchrun every rank fails alike
        if main_rank:
            _remove_if_unused(Path(hydra.runtime.output_dir), hydra.job.name)
        if not _is_users_mistake(err) or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        if main_rank:
            log.error("error: %s", err)
        if hydra.mode == RunMode.MULTIRUN:
            raise RunError(str(err)) from err
        raise SystemExit(EXIT_ERROR) from None


def _is_users_mistake(err: Exception) -> bool:
    if isinstance(err, RunError):
        return True
    if not isinstance(err, (ValueError, FileNotFoundError, ImportError)):
        return False
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_globals.get("__name__", "").startswith("sparseflash.")


def _remove_if_unused(run_dir: Path, job_name: str) -> None:
    """Remove ``run_dir`` if it holds nothing but ``.hydra/`` and the job's log, and then the
    folders above it (``outputs/<task>/``, ...) that this leaves empty, up to the working directory."""
    if not run_dir.is_dir() or any(p.name not in (".hydra", f"{job_name}.log") for p in run_dir.iterdir()):
        return
    shutil.rmtree(run_dir)  # the log's file handler writes on into the removed file: harmless on POSIX
    cwd = Path.cwd().resolve()
    for parent in run_dir.resolve().parents:
        if cwd not in parent.parents or any(parent.iterdir()):
            break
        parent.rmdir()
