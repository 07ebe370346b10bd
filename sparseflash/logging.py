"""Metric sinks for training and benchmarks: console, JSONL (always) and W&B (optional).

``RunLogger`` fans one ``log(metrics, step)`` out to every sink. ``metrics.jsonl`` is always
written in the run directory so results can be read without W&B; wandb is imported only when a
W&B sink is asked for, and runs offline unless told otherwise.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Mapping


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


class ConsoleSink:
    """Prints ``step k | name value ...`` lines (floats with 4 significant digits)."""

    def log(self, metrics: Mapping[str, Any], step: int | None) -> None:
        parts = [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()]
        print((f"step {step} | " if step is not None else "") + " | ".join(parts), flush=True)

    def close(self) -> None:
        pass


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
    (a mapping of ``WandbSink`` arguments), ``console`` prints. Only rank 0 should build one with
    sinks; other ranks pass ``enabled=False`` and log nowhere."""

    def __init__(self, run_dir: str | os.PathLike, *, console: bool = True,
                 wandb: Mapping[str, Any] | None = None, config: Mapping[str, Any] | None = None,
                 enabled: bool = True, jsonl_name: str = "metrics.jsonl"):
        self.run_dir = Path(run_dir)
        self.sinks: list[Any] = []
        self.wandb: WandbSink | None = None
        if not enabled:
            return
        self.sinks.append(JsonlSink(self.run_dir / jsonl_name))
        if console:
            self.sinks.append(ConsoleSink())
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
