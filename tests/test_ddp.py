"""DDP on CPU: two gloo processes train as one process does on the same global batch, resume
exactly across both ranks, and the torchrun entry point logs once."""

import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp

from sparseflash.train import run
from tests.test_train import ROOT, SMALL_LISTOPS, TINY, make_cfg, read_jsonl

# fp32 on CPU: two processes differ from one only in the order of sums (each rank pads its half
# batch to its own longest example; the gradients are averaged by an all-reduce). Seen: 5e-8 to 1e-7.
LOSS_TOL = 1e-6
VOLATILE = {"time", "step_time", "tokens_per_s", "peak_mem_mb", "total_time"}
COMMON = ["trainer.max_steps=4", "trainer.eval_every=2", "trainer.checkpoint_every=2", "trainer.batch_size=8",
          "trainer.schedule=linear", "trainer.lr=3e-3", "device=cpu"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, jobs: list) -> None:
    """One rank of a DDP group: the runs of ``jobs`` (config, run dir, port) one after another."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    for cfg, run_dir, port in jobs:
        os.environ["MASTER_PORT"] = str(port)  # a fresh rendezvous for each process group
        run(cfg, run_dir=run_dir)


def _steps(run_dir):
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "step_time" in r]


def _strip(records):
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in records]


def test_two_processes_train_as_one_and_resume_exactly(tmp_path):
    single = run(make_cfg(tmp_path, *COMMON), run_dir=tmp_path / "single")  # also writes the data, once
    jobs = [(make_cfg(tmp_path, *COMMON), tmp_path / "ddp", _free_port()),
            (make_cfg(tmp_path, *COMMON, "trainer.stop_after=2"), tmp_path / "cut", _free_port()),
            (make_cfg(tmp_path, *COMMON, "resume=true"), tmp_path / "cut", _free_port())]
    mp.spawn(_rank, args=(2, jobs), nprocs=2, join=True)

    one, two = _steps(tmp_path / "single"), _steps(tmp_path / "ddp")
    assert [r["step"] for r in two] == [1, 2, 3, 4]  # rank 0 alone logs
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=LOSS_TOL), (a["step"], a["loss"], b["loss"])
        assert b["acc"] == a["acc"] and b["lr"] == a["lr"]
    final = read_jsonl(tmp_path / "ddp" / "metrics.jsonl")[-1]
    assert final["test_loss"] == pytest.approx(single["test_loss"], rel=LOSS_TOL)
    assert final["test_acc"] == single["test_acc"] and final["best_step"] == single["best_step"]
    # stopped after step 2 by both ranks, resumed by both: the same records as the straight DDP run
    assert _strip(read_jsonl(tmp_path / "cut" / "metrics.jsonl")) == _strip(read_jsonl(tmp_path / "ddp" / "metrics.jsonl"))
    a = torch.load(tmp_path / "ddp" / "checkpoints" / "last.pt", weights_only=False)
    b = torch.load(tmp_path / "cut" / "checkpoints" / "last.pt", weights_only=False)
    assert len(b["rng"]) == 2 and a["step"] == b["step"] == 4
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_torchrun_entry_point_logs_once(tmp_path):
    run_dir = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "experiments" / "train.py"), *TINY, *SMALL_LISTOPS, f"data_root={tmp_path / 'data'}",
           f"hydra.run.dir={run_dir}", "trainer.max_steps=4", "trainer.eval_every=2", "trainer.batch_size=8",
           "device=cpu"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-1000:]
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records if "step_time" in r] == [1, 2, 3, 4]  # logged once (rank 0 only)
    assert "test_acc" in records[-1]
    assert proc.stdout.count("done in") == 1
