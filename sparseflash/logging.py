"""Metric sinks for training and benchmarks: JSONL (always) and W&B (optional).

``RunLogger`` fans one ``log(metrics, step)`` out to every sink. ``metrics.jsonl`` is always
written in the run directory so results can be read without W&B; wandb is imported only when a
W&B sink is asked for, and runs offline unless told otherwise. ``drop_records_after`` trims a
JSONL file to the steps a resumed run restarts from.

Console lines go through the standard ``logging`` module (loggers under ``sparseflash``), so that
Hydra's job logging sends them to the console and to the run's log file; ``console_fallback`` shows
them when nothing has configured logging (a notebook, a script calling ``train.run``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

from sparseflash.atomic_write import replacing


def output_dir(configured: str | os.PathLike | None, fallback: str) -> Path:
    """Where a run writes: ``configured`` where set, else Hydra's output directory when Hydra runs the job,
    else ``fallback/<date>_<time>``."""
    if configured:
        return Path(configured)
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return Path(HydraConfig.get().runtime.output_dir)
    except ImportError:  # Hydra is a dependency; a bare install of the kernels may still lack it
        pass
    return Path(fallback) / time.strftime("%Y-%m-%d_%H-%M-%S")


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


class JsonlSink:
    """Appends one JSON object per ``log`` call to ``path`` (flushed at once, so a crash loses nothing)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, metrics: Mapping[str, Any], step: int | None) -> None:
        record = {"step": step, "time": time.time(), **_jsonable(dict(metrics))}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records of a ``JsonlSink`` file (``metrics.jsonl``), in order."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def drop_records_after(path: str | os.PathLike, step: int) -> int:
    """Remove the records of ``path`` (a ``JsonlSink`` file) whose step is above ``step``; returns
    how many. A run resumed from a checkpoint of step ``step`` logs the later steps again, and the
    run it continues may have logged some of them before it was stopped. The file is replaced
    atomically (tmp file + rename): a crash leaves either the old or the new file."""
    path = Path(path)
    if not path.exists():
        return 0
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    # a last record cut short by a crash (no newline) goes too: the checkpoint was written before it
    keep = [line for line in lines if line.endswith("\n") and (json.loads(line).get("step") or 0) <= step]
    if len(keep) < len(lines):
        with replacing(path) as tmp:
            tmp.write_text("".join(keep), encoding="utf-8")
    return len(lines) - len(keep)


class WandbSink:
    """Logs to Weights & Biases; ``mode`` is ``offline`` (default), ``online`` or ``disabled``."""

    def __init__(self, run_dir: str | os.PathLike, config: Mapping[str, Any] | None = None,
                 project: str = "sparseflash", mode: str = "offline", name: str | None = None,
                 group: str | None = None, tags: list[str] | None = None, resume_id: str | None = None):
        try:
            import wandb
        except ImportError as err:
            raise ImportError("logger=wandb needs the wandb package: pip install 'sparseflash[wandb]'") from err
        self.wandb = wandb
        self.run = wandb.init(project=project, mode=mode, dir=str(run_dir), config=dict(config or {}),
                              name=name, group=group, tags=tags, id=resume_id,
                              resume="allow" if resume_id else None)

    def log(self, metrics: Mapping[str, Any], step: int | None) -> None:
        self.run.log(dict(metrics), step=step)

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        self.run.log({key: self.wandb.Table(columns=columns, data=rows)})

    def close(self) -> None:
        self.run.finish()


class RunLogger:
    """Every sink of one run. ``metrics.jsonl`` goes into ``run_dir``; ``wandb`` adds a W&B sink
    (a mapping of ``WandbSink`` arguments). Only rank 0 should build one with sinks; other ranks pass
    ``enabled=False`` and log nowhere."""

    def __init__(self, run_dir: str | os.PathLike, *, wandb: Mapping[str, Any] | None = None,
                 config: Mapping[str, Any] | None = None, enabled: bool = True):
        self.run_dir = Path(run_dir)
        self.sinks: list[Any] = []
        self.wandb: WandbSink | None = None
        if not enabled:
            return
        self.sinks.append(JsonlSink(self.run_dir / "metrics.jsonl"))
        if wandb is not None:
            self.wandb = WandbSink(self.run_dir, config=config, **dict(wandb))
            self.sinks.append(self.wandb)

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        for sink in self.sinks:
            sink.log(metrics, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


@contextlib.contextmanager
def console_fallback() -> Iterator[None]:
    """Within the block, print the INFO records of the ``sparseflash`` loggers to stdout (the message
    alone) if the program has not configured logging, i.e. no handler would receive them. Under
    Hydra, whose job logging already sends them to the console and the log file, it does nothing."""
    package = logging.getLogger("sparseflash")
    if package.hasHandlers():
        yield
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = package.level
    package.addHandler(handler)
    package.setLevel(logging.INFO)
    try:
        yield
    finally:
        package.removeHandler(handler)
        package.setLevel(level)
