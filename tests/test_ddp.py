"""DDP on CPU: two gloo processes train as one process does on the same global batch, resume
exactly across both ranks, the torchrun entry point logs once, and a rank killed mid-run fails the
job cleanly, which resume=true then finishes as if nothing had happened (also on two GPUs, with nccl,
the Triton kernels and bf16, where there are two); SIGTERM stops every rank at one checkpoint; W&B
runs once; scripts/ddp_scaling.py compares the two ways."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from sparseflash.train import run
from tests.test_train import ROOT, SMALL_LISTOPS, TINY, _wandb_history, make_cfg, read_jsonl

# fp32 on CPU: two processes differ from one only in the order of sums (each rank pads its half
# batch to its own longest example; the gradients are averaged by an all-reduce). Seen: 5e-8 to 1e-7.
LOSS_TOL = 1e-6
VOLATILE = {"time", "elapsed", "step_time", "tokens_per_s", "peak_mem_mb", "total_time"}
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


# What a run on two GPUs changes: nccl, the Triton kernels and bf16 autocast (the trainer's default).
ON_GPUS = ["device=cuda", "attention.backend=triton"]


def _torchrun(tmp_path, run_dir, *overrides, processes: int = 2) -> subprocess.Popen:
    """``torchrun --nproc_per_node=2 experiments/train.py`` on the tiny ListOps (on the CPU unless
    ``overrides`` say otherwise), started; ``processes=1``: plain ``python experiments/train.py``."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # keep where packages are
    # a tuning cache of its own: the runs a test compares must launch the same kernel configs
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "SPARSEFLASH_CACHE_DIR": str(tmp_path / "cache")}
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"] if processes > 1 else []
    cmd = [sys.executable, *launcher, str(ROOT / "experiments" / "train.py"), *TINY, *SMALL_LISTOPS,
           f"data_root={tmp_path / 'data'}", f"hydra.run.dir={run_dir}", "device=cpu", *overrides]
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 240) -> subprocess.CompletedProcess:
    stdout, stderr = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def test_torchrun_entry_point_logs_once(tmp_path):
    run_dir = tmp_path / "ddp"
    proc = _finish(_torchrun(tmp_path, run_dir, "trainer.max_steps=4", "trainer.eval_every=2", "trainer.batch_size=8"))
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-1000:]
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records if "step_time" in r] == [1, 2, 3, 4]  # logged once (rank 0 only)
    assert "test_acc" in records[-1]
    assert proc.stdout.count("done in") == 1


def test_torchrun_makes_one_wandb_run(tmp_path, monkeypatch):
    """Under torchrun only rank 0 opens W&B: one offline run, whose history has each step once and the
    final test scores."""
    pytest.importorskip("wandb", reason="install the dev extra (wandb) to check W&B logging")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    run_dir = tmp_path / "ddp"
    proc = _finish(_torchrun(tmp_path, run_dir, "logger=wandb", "trainer.max_steps=4", "trainer.eval_every=2",
                             "trainer.batch_size=8"))
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-1000:]
    runs = list(tmp_path.rglob("offline-run-*"))
    assert [r.parent for r in runs] == [run_dir / "wandb"], runs
    history = _wandb_history(run_dir, until=lambda h: any("test_acc" in r for r in h))
    assert [h["_step"] for h in history if "step_time" in h] == [1, 2, 3, 4], history
    assert sum("test_acc" in h for h in history) == 1


def _last_step(run_dir) -> int:
    try:
        return max((r["step"] for r in _steps(run_dir)), default=0)
    except (OSError, ValueError):  # not written yet, or a line half written
        return 0


def _workers(agent_pid: int) -> dict[int, int]:
    """The torchrun agent's worker processes, by LOCAL_RANK -> pid (Linux /proc)."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == agent_pid:
                env = dict(line.split("=", 1) for line in (proc / "environ").read_text().split("\0") if "=" in line)
                if "LOCAL_RANK" in env:
                    found[int(env["LOCAL_RANK"])] = int(proc.name)
        except (OSError, ValueError, IndexError):
            continue  # a process that ended while being read
    return found


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the workers through Linux's /proc")
@pytest.mark.parametrize("where", [
    pytest.param([], id="cpu-gloo"),
    pytest.param(ON_GPUS, id="2gpu-nccl", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]),
])
def test_a_killed_rank_fails_the_job_and_resume_finishes_it_exactly(tmp_path, where):
    """SIGKILL rank 1 once a checkpoint exists: torchrun exits non-zero within seconds and no worker
    is left; resume=true then completes the run with the metrics of an uninterrupted one."""
    steps = ["trainer.max_steps=300", "trainer.checkpoint_every=20", "trainer.eval_every=100", "trainer.batch_size=8",
             *where]
    straight = _finish(_torchrun(tmp_path, tmp_path / "straight", *steps))
    assert straight.returncode == 0, straight.stderr[-4000:]

    cut_dir = tmp_path / "cut"
    agent = _torchrun(tmp_path, cut_dir, *steps)
    deadline = time.monotonic() + 180
    # past the first checkpoint (step 20) by a few steps, so that resuming must drop logged steps
    while not ((cut_dir / "checkpoints" / "last.pt").exists() and _last_step(cut_dir) >= 25):
        assert agent.poll() is None, "the run ended before it was killed: give it more steps"
        assert time.monotonic() < deadline, "no checkpoint within 180 s"
        time.sleep(0.01)
    workers = _workers(agent.pid)
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGKILL)
    killed = time.monotonic()
    failed = _finish(agent, timeout=120)
    assert failed.returncode != 0 and time.monotonic() - killed < 60, failed.stderr[-4000:]
    for pid in workers.values():
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text(), pid
    cut_steps = [r["step"] for r in _steps(cut_dir)]
    assert 25 <= cut_steps[-1] < 300, f"killed at step {cut_steps[-1]}: give the run more steps"

    resumed = _finish(_torchrun(tmp_path, cut_dir, *steps, "resume=true"))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert _strip(read_jsonl(cut_dir / "metrics.jsonl")) == _strip(read_jsonl(tmp_path / "straight" / "metrics.jsonl"))


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the workers through Linux's /proc")
@pytest.mark.parametrize("processes", [2, 1], ids=["torchrun-2-processes", "one-process"])
def test_sigterm_stops_every_rank_at_one_checkpoint_and_resume_finishes_exactly(tmp_path, processes):
    """SIGTERM (what SLURM sends on pre-emption or at the time limit, and ``timeout -s TERM`` for legs of
    a long run) to torchrun, which passes it to its workers, or to a single process: the ranks agree on
    a logged step, checkpoint there together and exit; resume then completes the run with the metrics
    of an uninterrupted one."""
    steps = ["trainer.max_steps=300", "trainer.checkpoint_every=0", "trainer.eval_every=100", "trainer.batch_size=8",
             "trainer.log_every=5"]
    straight = _finish(_torchrun(tmp_path, tmp_path / "straight", *steps, processes=processes))
    assert straight.returncode == 0, straight.stderr[-4000:]

    cut_dir = tmp_path / "cut"
    agent = _torchrun(tmp_path, cut_dir, *steps, processes=processes)
    deadline = time.monotonic() + 180
    while _last_step(cut_dir) < 20:
        assert agent.poll() is None, "the run ended before the signal: give it more steps"
        assert time.monotonic() < deadline, "not at step 20 within 180 s"
        time.sleep(0.01)
    workers = _workers(agent.pid) if processes > 1 else {0: agent.pid}
    assert len(workers) == processes, workers
    agent.send_signal(signal.SIGTERM)
    stopped = _finish(agent, timeout=120)
    for pid in workers.values():
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text(), pid
    # with checkpoint_every=0 a checkpoint exists only if the ranks saved on the signal, at a logged step
    ckpt = torch.load(cut_dir / "checkpoints" / "last.pt", weights_only=False)
    assert 20 <= ckpt["step"] < 300 and ckpt["step"] % 5 == 0, (ckpt["step"], stopped.stderr[-4000:])
    assert max(r["step"] for r in _steps(cut_dir)) == ckpt["step"]

    resumed = _finish(_torchrun(tmp_path, cut_dir, *steps, "resume=auto", processes=processes))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert _strip(read_jsonl(cut_dir / "metrics.jsonl")) == _strip(read_jsonl(tmp_path / "straight" / "metrics.jsonl"))


@pytest.mark.parametrize("weak", [False, True], ids=["same-global-batch", "weak"])
def test_scaling_script_compares_one_process_with_two(tmp_path, weak):
    """scripts/ddp_scaling.py on two gloo processes: with the same global batch the curves agree to fp32
    rounding (and it prints their differences); with --weak the torchrun run takes twice the batch and
    only throughput is compared. A second call into the same --out is refused rather than resumed."""
    out = tmp_path / "scaling"
    cmd = [sys.executable, str(ROOT / "scripts" / "ddp_scaling.py"), "--gpus", "2", "--steps", "6", "--skip", "2",
           "--out", str(out), *(["--weak"] if weak else []), *TINY, *SMALL_LISTOPS, f"data_root={tmp_path / 'data'}",
           "device=cpu", "trainer.batch_size=8", "trainer.eval_every=3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:] + done.stdout[-2000:]
    result = json.loads((out / "scaling.json").read_text())
    assert result["steps"] == 6 and result["throughput_scaling"] > 0
    assert result["global_batch"] == {"one": 8, "ddp": 16 if weak else 8}
    if weak:
        assert "loss_rel_diff_max" not in result
    else:
        assert result["loss_rel_diff_max"] < LOSS_TOL, result
        assert [int(s) for s in result["val_loss"]] == [3, 6]
        for v in result["val_loss"].values():
            assert v["ddp"] == pytest.approx(v["one"], rel=LOSS_TOL)
    assert "throughput" in done.stdout and ("loss relative difference" in done.stdout) != weak, done.stdout
    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "exists" in again.stderr
