"""The entry points as a user meets them: a mistake is one line `error: ...` and exit status 2 (a
bug keeps its traceback), a failed run leaves no empty run directory, console lines reach the
job's log file, a bench that timed nothing fails, and the bench defaults to its CPU preset on a CPU."""

import logging
import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf, open_dict

from sparseflash import cli, masks
from tests.helpers import module_from_file
from tests.test_train import ROOT, SMALL_LISTOPS, TINY, read_jsonl


def _python(script, *args, cwd, env=None):
    return subprocess.run([sys.executable, str(ROOT / "experiments" / script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=240)


# ----------------------------------------------------------------------------- cli.job in-process
@pytest.fixture
def hydra_job(tmp_path):
    """A Hydra job as experiments/train.py runs it, whose run directory holds Hydra's own files."""
    run_dir = tmp_path / "outputs" / "listops" / "now"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("{}")
    (run_dir / "train.log").write_text("")
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir, cfg.hydra.job.name, cfg.hydra.mode = str(run_dir), "train", RunMode.RUN
    HydraConfig.instance().set_config(cfg)
    yield cfg, run_dir
    HydraConfig.instance().cfg = None
    logging.captureWarnings(False)  # cli.job turned it on for the process


def test_a_mistake_exits_2_with_one_line(hydra_job, caplog, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    _, run_dir = hydra_job
    with pytest.raises(SystemExit) as exit_info, cli.job():
        masks.make("bogus", 64)  # sparseflash's own ValueError
    assert exit_info.value.code == 2
    assert [r.getMessage() for r in caplog.records if r.name == "sparseflash.cli"] == [
        "error: unknown pattern 'bogus'; registered patterns: " + ", ".join(masks.registered())]
    assert not (tmp_path / "outputs").exists()  # the run directory and the folders it leaves empty


def test_a_bug_keeps_its_traceback_and_a_run_with_files_keeps_its_dir(hydra_job, monkeypatch):
    _, run_dir = hydra_job
    (run_dir / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="from a library"), cli.job():
        raise ValueError("from a library")  # not raised by sparseflash: a bug, shown as one
    with pytest.raises(IndexError), cli.job():
        [][0]
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ValueError, match="unknown pattern"), cli.job():
        masks.make("bogus", 64)
    assert (run_dir / "metrics.jsonl").exists() and (run_dir / ".hydra").is_dir()


def test_a_mistake_in_a_multirun_goes_to_hydra(hydra_job, caplog):
    cfg, _ = hydra_job
    OmegaConf.set_readonly(cfg.hydra, False)  # HydraConfig.set_config made it read-only
    cfg.hydra.mode = RunMode.MULTIRUN
    HydraConfig.instance().set_config(cfg)
    with pytest.raises(cli.RunError, match="unknown pattern") as err, cli.job():
        masks.make("bogus", 64)
    assert isinstance(err.value.__cause__, ValueError)
    assert any(r.levelno == logging.ERROR and r.getMessage().startswith("error: ") for r in caplog.records)


# ----------------------------------------------------------------------------- the commands
def test_train_mistake_on_the_command_line(tmp_path):
    proc = _python("train.py", "experiment=smoke", "attention.pattern=bogus", f"data_root={tmp_path / 'data'}",
                   cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: unknown pattern 'bogus'") and proc.stderr.count("\n") == 1, proc.stderr
    assert not (tmp_path / "outputs").exists()


def test_train_log_has_the_console_lines(tmp_path):
    proc = _python("train.py", *TINY, *SMALL_LISTOPS, f"data_root={tmp_path / 'data'}", "trainer.max_steps=2",
                   "trainer.eval_every=2", "hydra.run.dir=run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    log = (tmp_path / "run" / "train.log").read_text()
    for line in ("task listops:", "run dir:", "step 2/2 | val_loss", "done in"):
        assert line in proc.stdout and line in log, line
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "step_time" in r] == [1, 2]


def test_bench_that_times_nothing_fails_without_plots(tmp_path):
    proc = _python("bench.py", "backends=[flex]", "seq_lens=[128]", "modes=[fwd]", "patterns=[dense,butterfly]",
                   "device=cpu", "hydra.run.dir=run", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: no row was timed (2 skipped):\n  flex: the peers are timed on CUDA only")
    assert (tmp_path / "run" / "results.csv").exists() and not (tmp_path / "run" / "plots").exists()


def _bench_module():
    return module_from_file(ROOT / "experiments" / "bench.py", "bench_entry")


def test_bench_on_a_cpu_defaults_to_the_cpu_preset(tmp_path, monkeypatch):
    import torch

    entry = _bench_module()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert entry._cpu_preset([]) == entry._cpu_preset(["patterns=[dense]"]) == "smoke"
    assert entry._cpu_preset(["device=cpu"]) == "smoke"
    for named in (["bench=h100"], ["bench=smoke"], ["~bench"], ["device=cuda"]):
        assert entry._cpu_preset(named) is None, named
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert entry._cpu_preset([]) is None and entry._cpu_preset(["device=cpu"]) == "smoke"
    # the command itself, with no CUDA device to see: smoke's 1024 tokens, not bench.yaml's 16384
    proc = _python("bench.py", "--cfg", "job", cwd=tmp_path, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0 and "tokens: 1024\n" in proc.stdout, proc.stderr
