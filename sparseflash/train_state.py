"""``TrainState``: what a training run carries across an interruption, and its checkpoint file.

The object holds the loop's own progress: the step, the best validation accuracy with its step
and weights, the seconds trained and the W&B run id. ``save`` writes it together with the state
of what the loop drives (model, optimizer, scheduler, data position, every rank's RNG states) into
one file, atomically; ``load`` puts all of it back, so that a resumed run continues bit for bit.
``resume_path`` reads the ``resume`` setting.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sparseflash.atomic_write import replacing
from sparseflash.data.stream import BatchStream
from sparseflash.distributed import Dist


@dataclass
class TrainState:
    """The loop's progress. ``seconds()`` counts from the object's creation, plus ``elapsed``,
    the seconds of the processes before a resume."""

    step: int = 0
    best_val: float = -1.0  # best validation accuracy so far (-1: none yet)
    best_step: int = -1
    best_weights: dict[str, torch.Tensor] | None = None
    elapsed: float = 0.0
    wandb_id: str | None = None
    started: float = field(default_factory=time.time)

    def seconds(self) -> float:
        """Seconds this run has taken, over all its processes."""
        return self.elapsed + time.time() - self.started

    def keep_if_best(self, val_acc: float, module: torch.nn.Module) -> bool:
        """Record ``module``'s weights as the best if ``val_acc`` beats the best so far (ties keep
        the earlier weights); returns whether it did."""
        if val_acc <= self.best_val:
            return False
        self.best_val, self.best_step = val_acc, self.step
        self.best_weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
        return True

    def save(self, path: Path, *, module, optimizer, scheduler, stream: BatchStream, ctx: Dist,
             config: Any = None) -> None:
        """Write the checkpoint (rank 0 writes; tmp file + rename, so a crash never leaves half a
        file). Every rank must call it: the RNG states of all ranks are gathered, and it returns
        once the file is written."""
        rngs = ctx.gather(_rng_state())
        if ctx.main:
            # best_state: the best weights (the key every checkpoint written so far uses, so all of them load)
            _save_atomic({"step": self.step, "model": module.state_dict(), "optimizer": optimizer.state_dict(),
                          "scheduler": scheduler.state_dict(), "stream": stream.state(), "rng": rngs,
                          "best_val": self.best_val, "best_step": self.best_step, "best_state": self.best_weights,
                          "elapsed": self.seconds(), "wandb_id": self.wandb_id, "config": config}, path)
        ctx.barrier()

    def load(self, path: Path, *, module, optimizer, scheduler, stream: BatchStream, rank: int,
             device: torch.device) -> None:
        """Restore everything ``save`` wrote. A rank the checkpoint has no RNG state for (more
        processes than when it was written) takes rank 0's."""
        ckpt = torch.load(path, map_location=device, weights_only=False)
        module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        stream.load(ckpt["stream"])
        self.step, self.best_val, self.best_step = ckpt["step"], ckpt["best_val"], ckpt["best_step"]
        self.best_weights, self.elapsed, self.wandb_id = ckpt["best_state"], ckpt["elapsed"], ckpt.get("wandb_id")
        rngs = ckpt["rng"]
        _set_rng_state(rngs[rank] if rank < len(rngs) else rngs[0])


def resume_path(resume: Any, run_dir: Path) -> Path | None:
    """The checkpoint the ``resume`` setting names, or None to start from scratch.

    - ``false``: none;
    - ``true``: ``<run_dir>/checkpoints/last.pt``, which must exist;
    - ``auto``: that file when it exists, else none (a requeued job runs one command, first and
      every time after);
    - anything else: a checkpoint file, or a run directory holding ``checkpoints/last.pt``, which
      must exist.

    A checkpoint that should be there and is not raises ``FileNotFoundError``: training from
    scratch instead would quietly throw away the run being continued."""
    if resume is None or resume is False or str(resume).lower() == "false":
        return None
    own = run_dir / "checkpoints" / "last.pt"
    if resume is True or str(resume).lower() == "true":
        if not own.exists():
            raise FileNotFoundError(
                f"resume=true but there is no checkpoint at {own}. Point hydra.run.dir at the run to "
                f"continue, or name its checkpoint (resume=<last.pt or its run dir>); resume=auto starts "
                f"from scratch when there is none")
        return own
    if str(resume).lower() == "auto":
        return own if own.exists() else None
    path = Path(str(resume))
    if path.is_dir():
        path = path / "checkpoints" / "last.pt" if (path / "checkpoints").is_dir() else path / "last.pt"
    if not path.exists():
        raise FileNotFoundError(f"resume={resume}: no checkpoint at {path} (expected a last.pt file, or a run "
                                f"directory holding checkpoints/last.pt)")
    return path


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    """Restore ``_rng_state()``; the generators take their states as CPU byte tensors, which a checkpoint
    loaded onto a GPU (``map_location``) has moved there."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def _save_atomic(obj: Any, path: Path) -> None:
    with replacing(path) as tmp:
        torch.save(obj, tmp)
