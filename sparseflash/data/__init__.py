"""LRA tasks, one module each; ``build_task(task_cfg)`` returns a ``TaskData``.

``task.name`` picks the module: listops, pathfinder, image, text, retrieval.
"""

from __future__ import annotations

import importlib

from sparseflash.data.common import (MissingDataError, SequenceDataset, TaskData, collate, pad_batch,
                                     seeded_split)

TASKS = ("listops", "pathfinder", "image", "text", "retrieval")


def build_task(cfg) -> TaskData:
    """The datasets of the task described by a ``task`` config."""
    name = str(cfg.name)
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; expected one of {', '.join(TASKS)}")
    return importlib.import_module(f"sparseflash.data.{name}").build(cfg)


__all__ = ["TASKS", "MissingDataError", "SequenceDataset", "TaskData", "build_task", "collate", "pad_batch",
           "seeded_split"]
