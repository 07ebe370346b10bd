"""Hydra's submitit launcher without a cluster: the SLURM config becomes a valid sbatch job, and a
sweep runs through submitit's local executor."""

import json
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError

from tests.test_configs import compose_train
from tests.test_train import ROOT, SMALL_LISTOPS, TINY

submitit = pytest.importorskip("submitit", reason="the launcher tests need hydra-submitit-launcher (dev extra)")


def _sbatch_text(launcher, folder) -> str:
    """The sbatch file submitit would submit for ``launcher`` (the composed hydra.launcher), mapped to
    submitit's parameters the way the plugin's SlurmLauncher.launch does."""
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    params = {k: v for k, v in OmegaConf.to_container(launcher, resolve=False).items() if k != "_target_"}
    executor = submitit.AutoExecutor(folder=str(folder), cluster="slurm", slurm_max_num_timeout=params.pop("max_num_timeout"))
    params.pop("submitit_folder")
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})
    return executor._executor._make_submission_file_text("python -u experiments/train.py", "job")


def test_slurm_config_builds_an_sbatch_job(tmp_path, monkeypatch):
    """configs/hydra/launcher/slurm.yaml composes over the plugin's schema, submitit's SLURM executor
    takes every key (an unknown one raises), and the job asks for what the config says. submitit only
    checks that ``srun`` exists, so a stand-in on PATH is enough."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "bin" / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    cfg = compose_train(["hydra/launcher=slurm", "hydra.launcher.partition=gpu",
                         "hydra.launcher.name=listops"], hydra_cfg=True)
    text = _sbatch_text(cfg.hydra.launcher, tmp_path / "submitit")
    for line in ("#SBATCH --partition=gpu", "#SBATCH --time=240", "#SBATCH --gpus-per-node=1",
                 "#SBATCH --cpus-per-task=8", "#SBATCH --mem=64GB", "#SBATCH --signal=USR2@120",
                 "#SBATCH --job-name=listops", "#SBATCH --open-mode=append"):
        assert line in text, f"{line!r} not in the sbatch file:\n{text}"
    with pytest.raises(ConfigKeyError, match="partitions"):  # the plugin's schema refuses a misspelt key
        OmegaConf.merge(cfg.hydra.launcher, {"partitions": "gpu"})


def test_a_sweep_runs_through_the_local_executor(tmp_path):
    """``-m hydra/launcher=submitit_local seed=0,1``: two jobs run as submitit jobs, each writes its
    metrics, and the sweep exits 0."""
    sweep = tmp_path / "sweep"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "experiments" / "train.py"), "-m", "hydra/launcher=submitit_local",
           "hydra.launcher.timeout_min=10", "hydra.launcher.gpus_per_node=0", f"hydra.sweep.dir={sweep}",
           "hydra.sweep.subdir=${hydra.job.num}",  # these many overrides would name a directory past 255 bytes
           *TINY, *SMALL_LISTOPS, f"data_root={tmp_path / 'data'}", "trainer.max_steps=2", "trainer.eval_every=2",
           "device=cpu", "seed=0,1"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    for job in ("0", "1"):
        records = [json.loads(line) for line in (sweep / job / "metrics.jsonl").read_text().splitlines()]
        assert "test_acc" in records[-1], job
    assert list((sweep / ".submitit").iterdir()), "no submitit job folder"
