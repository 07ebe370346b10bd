"""The processes of a training run: ``Dist`` says which one this is and does the few collectives
the loop needs.

Under ``torchrun`` (``WORLD_SIZE`` > 1) it joins the process group (nccl on CUDA, gloo on CPU);
without it, it is one process and every collective returns its input. The device is
``cuda:LOCAL_RANK`` when CUDA is asked for (or ``auto`` finds it), else the CPU. ``end_worker`` ends a
torchrun worker whose run finished.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from typing import Any

import torch
import torch.distributed as dist


class Dist:
    """Rank, world size and device of this process (a single process when not under torchrun)."""

    def __init__(self, device_cfg: str = "auto"):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if device_cfg not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda; got {device_cfg!r}")
        want_cuda = device_cfg == "cuda" or (device_cfg == "auto" and torch.cuda.is_available())
        if want_cuda and not torch.cuda.is_available():
            raise ValueError("device=cuda but no CUDA device is available")
        self.device = torch.device(f"cuda:{self.local_rank}" if want_cuda else "cpu")
        if want_cuda:
            torch.cuda.set_device(self.device)
        self.enabled = self.world > 1
        if self.enabled and not dist.is_initialized():
            # nccl binds to this rank's GPU at once (device_id), instead of guessing it at the first barrier
            dist.init_process_group("nccl" if want_cuda else "gloo", device_id=self.device if want_cuda else None)

    @property
    def main(self) -> bool:
        """Rank 0: the process that logs and writes files."""
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over the ranks (in float64, so that counts stay exact)."""
        if not self.enabled:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (any picklable object)."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def close(self, wait: bool = True) -> None:
        """Leave the process group; ``wait=False`` for a failing rank, which must not wait for the others."""
        if self.enabled and dist.is_initialized():
            try:
                if wait:  # let every rank finish (rank 0 writes last) before tearing gloo down
                    dist.barrier()
            finally:
                dist.destroy_process_group()


def end_worker() -> None:
    """End a torchrun worker whose run finished as multiprocessing's children end: everything flushed, then
    ``os._exit(0)``. A DistributedDataParallel model keeps gloo's threads running after ``destroy_process_group``
    (torch holds the process group: pytorch/pytorch#107298), and the interpreter's teardown around them can abort
    the rank ("terminate called without an active exception") after its work is written. What the teardown would
    have done is done here: the log handlers closed, W&B's service ended, Python's and C's stdio flushed. Threads
    still running end with the process (the warm-up's, long done after a run)."""
    logging.shutdown()
    if "wandb" in sys.modules:  # its run is finished; its atexit hook would end its service process
        sys.modules["wandb"].teardown()
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name == "posix":  # what C and C++ libraries wrote through stdio, as NCCL_DEBUG=INFO's lines
        ctypes.CDLL(None).fflush(None)
    os._exit(0)
