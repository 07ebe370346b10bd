"""The training loop end to end on tiny data: every task, resume, W&B offline, metrics (DDP: test_ddp.py)."""

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from sparseflash.logging import read_jsonl
from sparseflash import train as train_module
from sparseflash.train import lr_factor, run
from tests.data.fixtures import write_aan, write_cifar, write_imdb, write_listops, write_pathfinder_release

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model=tiny", "trainer.progress=false", "trainer.print_every=100", "attention.backend=blocked",
        "trainer.batch_size=16", "trainer.warmup_steps=2", "trainer.checkpoint_every=0"]
# a tiny ListOps of short expressions (added when the task is the default one)
SMALL_LISTOPS = ["task.data_dir=${data_root}/listops-smoke", "task.max_len=64",
                 "task.generator={min_length: 5, max_length: 60, max_depth: 3, max_args: 4}",
                 "task.sizes={train: 256, val: 64, test: 64}"]


def make_cfg(tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        if not any(o.startswith("task=") for o in overrides):
            overrides = (*SMALL_LISTOPS, *overrides)
        return compose("train", overrides=[*TINY, f"data_root={tmp_path / 'data'}", *overrides])


def _task_overrides(name, tmp_path):
    data = tmp_path / "data"
    if name == "listops_tsv":
        write_listops(data / "lo", n=40)
        return ["task=listops", f"task.data_dir={data / 'lo'}", "task.generate=false", "task.max_len=64"]
    if name == "listops_generated":
        return []
    if name == "pathfinder_generated":
        return ["task=pathfinder", "task.num=48", "model.pool=mean", "model.positions=sinusoidal"]
    if name == "pathfinder_release":
        write_pathfinder_release(data / "pf", n=40, bad=1)
        return ["task=pathfinder", f"task.data_dir={data / 'pf'}", "task.generate=false"]
    if name == "image_cifar":
        write_cifar(data / "c", per_batch=8)
        return ["task=image", f"task.data_dir={data / 'c'}", "task.val_size=8", "model.embedding=pixel"]
    if name == "image_digits":
        return ["task=image_digits"]
    if name == "text":
        write_imdb(data / "imdb", per_class=10)
        return ["task=text", f"task.data_dir={data / 'imdb'}", "task.max_len=200", "task.val_fraction=0.2"]
    if name == "retrieval":
        write_aan(data / "aan", n=16)
        return ["task=retrieval", f"task.data_dir={data / 'aan'}", "task.max_len=100"]
    raise KeyError(name)


@pytest.mark.filterwarnings("ignore:skipped")
@pytest.mark.parametrize("name", ["listops_tsv", "listops_generated", "pathfinder_generated", "pathfinder_release",
                                  "image_cifar", "image_digits", "text", "retrieval"])
def test_each_task_trains(tmp_path, name):
    cfg = make_cfg(tmp_path, *_task_overrides(name, tmp_path), "trainer.max_steps=3", "trainer.batch_size=8",
                   "trainer.eval_every=2", "trainer.eval_batches=2", "attention.block=16")
    results = run(cfg, run_dir=tmp_path / "run")
    assert 0.0 <= results["test_acc"] <= 1.0 and results["steps"] == 3
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records if "loss" in r and "test_acc" not in r] == [1, 2, 3]


def test_metrics_jsonl_config_and_best_checkpoint(tmp_path):
    cfg = make_cfg(tmp_path, "trainer.max_steps=6", "trainer.eval_every=2", "trainer.log_every=1")
    results = run(cfg, run_dir=tmp_path / "run")
    run_dir = tmp_path / "run"
    records = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in records if "step_time" in r]
    assert [r["step"] for r in steps] == list(range(1, 7))
    for r in steps:
        assert {"loss", "acc", "lr", "step_time", "tokens_per_s", "peak_mem_mb"} <= set(r)
        assert r["tokens_per_s"] > 0 and r["peak_mem_mb"] > 0
    evals = [r for r in records if "val_acc" in r and "test_acc" not in r]
    assert [r["step"] for r in evals] == [2, 4, 6]
    final = records[-1]
    assert {"test_acc", "best_val_acc", "total_time", "mask_density", "mask"} <= set(final)
    assert final["best_val_acc"] == max(r["val_acc"] for r in evals)
    assert "#" in final["mask"] and 0 < final["mask_density"] <= 1
    saved = OmegaConf.load(run_dir / "config.yaml")
    assert saved.trainer.max_steps == 6 and saved.task.data_dir == str(tmp_path / "data" / "listops-smoke")
    assert json.loads((run_dir / "results.json").read_text())["test_acc"] == results["test_acc"]
    # the test set is scored with the best-validation weights
    from sparseflash.data import build_task
    from sparseflash.models import build_model
    from sparseflash.distributed import Dist
    from sparseflash.train import evaluate

    task = build_task(saved.task)
    model = build_model(saved.model, saved.attention, vocab_size=task.vocab_size, max_len=task.max_len,
                        num_classes=task.num_classes)
    model.load_state_dict(torch.load(run_dir / "best_model.pt"))
    again = evaluate(model, task.test, batch_size=16, device=torch.device("cpu"), autocast=torch.no_grad,
                     ctx=Dist("cpu"))
    assert again["acc"] == pytest.approx(results["test_acc"])


@pytest.mark.parametrize("attention_backend", ["blocked", "triton"])
def test_compiled_training_equals_eager(tmp_path, attention_backend):
    """trainer.compile=aot_eager (torch.compile with the eager ops: what Dynamo captures, run as
    captured) trains as the eager model does, over batches of several padded lengths: a graph, one
    with a symbolic length, one for the other side of the model's pad-to-multiple branch, then none."""
    common = ["trainer.max_steps=5", "trainer.eval_every=5", "model.dropout=0.0",
              f"attention.backend={attention_backend}"]
    eager = run(make_cfg(tmp_path, *common), run_dir=tmp_path / "eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = run(make_cfg(tmp_path, *common, "trainer.compile=aot_eager"), run_dir=tmp_path / "compiled")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 3
    losses = [[r["loss"] for r in read_jsonl(tmp_path / d / "metrics.jsonl") if "step_time" in r]
              for d in ("eager", "compiled")]
    assert len(losses[0]) == 5 and losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert compiled["test_acc"] == eager["test_acc"]


@pytest.mark.parametrize("bad", ["turbo", 3])
def test_bad_compile_setting_is_refused_before_the_data(tmp_path, bad):
    with pytest.raises(ValueError, match=r"trainer.compile must be false, true \(inductor\) or one of"):
        run(make_cfg(tmp_path, f"trainer.compile={bad}"), run_dir=tmp_path / "run")
    assert not (tmp_path / "data").exists()


def test_bad_precision_is_refused_before_the_data(tmp_path):
    with pytest.raises(ValueError, match=r"trainer.precision must be bf16 \(autocast on CUDA\) or fp32; got 'fp16'"):
        run(make_cfg(tmp_path, "trainer.precision=fp16"), run_dir=tmp_path / "run")
    assert not (tmp_path / "data").exists()


def test_resume_is_exact(tmp_path):
    common = ["trainer.max_steps=8", "trainer.eval_every=3", "trainer.checkpoint_every=5", "model.dropout=0.2",
              "model.attention_dropout=0.2", "trainer.schedule=linear", "trainer.warmup_steps=3"]
    straight = run(make_cfg(tmp_path, *common), run_dir=tmp_path / "a")
    stopped = run(make_cfg(tmp_path, *common, "trainer.stop_after=4"), run_dir=tmp_path / "b")
    assert stopped["stopped_at"] == 4
    resumed = run(make_cfg(tmp_path, *common, "resume=true"), run_dir=tmp_path / "b")
    for key in ("test_acc", "test_loss", "best_val_acc", "best_step", "steps"):
        assert resumed[key] == straight[key], key
    volatile = {"time", "elapsed", "step_time", "tokens_per_s", "peak_mem_mb", "total_time"}
    strip = lambda rs: [{k: v for k, v in r.items() if k not in volatile} for r in rs]  # noqa: E731
    assert strip(read_jsonl(tmp_path / "b" / "metrics.jsonl")) == strip(read_jsonl(tmp_path / "a" / "metrics.jsonl"))
    elapsed = [r["elapsed"] for r in read_jsonl(tmp_path / "b" / "metrics.jsonl") if "elapsed" in r]
    assert len(elapsed) == 8 + 3 and elapsed == sorted(elapsed)  # the resumed leg counts on from the first one
    a = torch.load(tmp_path / "a" / "checkpoints" / "last.pt", weights_only=False)
    b = torch.load(tmp_path / "b" / "checkpoints" / "last.pt", weights_only=False)
    assert a["step"] == b["step"] == 8
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["stream"] == b["stream"]


def test_pathfinder_augmented_trains_differently_and_resumes_exactly(tmp_path):
    common = [*_task_overrides("pathfinder_generated", tmp_path), "trainer.max_steps=6", "trainer.eval_every=3",
              "trainer.checkpoint_every=3"]
    plain = run(make_cfg(tmp_path, *common), run_dir=tmp_path / "plain")
    straight = run(make_cfg(tmp_path, *common, "task.augment=dihedral"), run_dir=tmp_path / "a")
    assert straight["test_loss"] != plain["test_loss"]  # the training images were turned
    stopped = run(make_cfg(tmp_path, *common, "task.augment=dihedral", "trainer.stop_after=4"),
                  run_dir=tmp_path / "b")
    assert stopped["stopped_at"] == 4
    resumed = run(make_cfg(tmp_path, *common, "task.augment=dihedral", "resume=true"), run_dir=tmp_path / "b")
    for key in ("test_acc", "test_loss", "best_val_acc", "steps"):
        assert resumed[key] == straight[key], key
    with pytest.raises(ValueError, match="needs a task of square images"):
        run(make_cfg(tmp_path, "+task.augment=dihedral"), run_dir=tmp_path / "listops")


def test_cifar_trains_with_left_right_mirrors(tmp_path):
    common = [*_task_overrides("image_cifar", tmp_path), "trainer.max_steps=3", "trainer.eval_every=3"]
    plain = run(make_cfg(tmp_path, *common), run_dir=tmp_path / "plain")
    mirrored = run(make_cfg(tmp_path, *common, "task.augment=hflip"), run_dir=tmp_path / "mirrored")
    assert mirrored["steps"] == 3 and mirrored["test_loss"] != plain["test_loss"]


def _wandb_records(path):
    """The protobuf records of a ``.wandb`` transaction log: a 7-byte header (``:W&B``, magic,
    version), then 32 KiB blocks of LevelDB-log chunks (crc32, length, type: 1 full, 2 first,
    3 middle, 4 last)."""
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", "not a W&B transaction log"
    pos, block, out, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if pos + 7 + length > len(data):
            break  # the writer is still appending this chunk
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        if kind in (1, 2):
            pending = chunk
        else:
            pending += chunk
        if kind in (1, 4):
            out.append(pending)
    return out


def _wandb_history(run_dir, until, wait_s: float = 30.0):
    """The history records of the offline run in ``run_dir``. The W&B service process may still be
    flushing the transaction log when ``finish()`` has returned (it did under load, and a read
    once caught a record half written), so the file is re-read until ``until(history)`` holds or
    ``wait_s`` has passed."""
    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + wait_s
    while True:
        try:
            history = _read_wandb_history(run_dir)
        except DecodeError:
            if time.monotonic() > deadline:
                raise
        else:
            if until(history) or time.monotonic() > deadline:
                return history
        time.sleep(0.2)


def _read_wandb_history(run_dir):
    from wandb.proto import wandb_internal_pb2

    files = list(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))
    assert files, "no offline W&B run was written"
    history = []
    for data in _wandb_records(files[0]):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    return history


def test_wandb_offline_run_has_the_history(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="install the dev extra (wandb) to check W&B logging")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    cfg = make_cfg(tmp_path, "logger=wandb", "trainer.max_steps=4", "trainer.eval_every=2")
    results = run(cfg, run_dir=tmp_path / "run")
    history = _wandb_history(tmp_path / "run", until=lambda h: any("test_acc" in r for r in h))
    steps = [h for h in history if "step_time" in h]
    assert [h["_step"] for h in steps] == [1, 2, 3, 4], f"history records read: {history}"
    assert all({"loss", "acc", "lr", "tokens_per_s", "peak_mem_mb"} <= set(h) for h in steps)
    assert [h["val_acc"] for h in history if "val_acc" in h and "test_acc" not in h]
    assert any(h.get("test_acc") == pytest.approx(results["test_acc"]) for h in history)


def test_logger_none_writes_no_wandb(tmp_path):
    run(make_cfg(tmp_path, "trainer.max_steps=2"), run_dir=tmp_path / "run")
    assert not list(tmp_path.rglob("wandb"))


def test_lr_schedules():
    kw = dict(warmup=10, max_steps=100)
    assert lr_factor(4, schedule="cosine", **kw) == pytest.approx(0.5)
    assert lr_factor(9, schedule="linear", **kw) == pytest.approx(1.0)
    assert lr_factor(99, schedule="linear", **kw) == pytest.approx(0.0)
    assert lr_factor(99, schedule="cosine", **kw) == pytest.approx(0.0)
    assert lr_factor(39, schedule="rsqrt", **kw) == pytest.approx(0.5)
    assert lr_factor(50, schedule="constant", **kw) == 1.0


def test_overfits_a_tiny_training_set(tmp_path):
    """16 examples, one batch: 30 steps of AdamW take the loss from ~2.3 (ln 10) to below a tenth
    of it and the batch accuracy to 1. A loop that does not update the weights (optimizer.step
    gone, gradients zeroed before the step) or breaks the gradients stays near 2.3."""
    cfg = make_cfg(tmp_path, "task.sizes={train: 16, val: 16, test: 16}", "trainer.batch_size=16",
                   "trainer.max_steps=30", "trainer.eval_every=0", "trainer.schedule=constant", "trainer.warmup_steps=0",
                   "trainer.lr=3e-3", "trainer.weight_decay=0", "trainer.grad_clip=0")
    run(cfg, run_dir=tmp_path / "run")
    steps = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "step_time" in r]
    assert len(steps) == 30 and steps[0]["loss"] > 2.0
    assert steps[-1]["loss"] < steps[0]["loss"] / 10, [round(r["loss"], 3) for r in steps]
    assert steps[-1]["acc"] == 1.0


def test_resume_true_without_a_checkpoint_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="resume=true but there is no checkpoint at .*resume=auto"):
        run(make_cfg(tmp_path, "trainer.max_steps=2", "resume=true"), run_dir=tmp_path / "run")
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*nowhere"):
        run(make_cfg(tmp_path, "trainer.max_steps=2", f"resume={tmp_path / 'nowhere'}"), run_dir=tmp_path / "run")
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()  # it failed before the data


def _signal_at_step(monkeypatch, step: int, *signals: int) -> None:
    """Send ``signals`` to this process while the training loop loads the batch of ``step`` (1-based)."""
    original, calls = train_module.BatchLoader.load, []

    def load(self, indices):
        calls.append(None)
        if len(calls) == step:
            for number in signals:
                os.kill(os.getpid(), number)
        return original(self, indices)

    monkeypatch.setattr(train_module.BatchLoader, "load", load)


@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR2", "SIGINT"])
def test_a_stop_signal_checkpoints_at_a_step_boundary_and_resume_is_exact(tmp_path, monkeypatch, name):
    """SIGTERM (pre-emption), SIGUSR2 (submitit's warning before a time limit: its own handler, called after
    the checkpoint, requeues the job) and a first Ctrl-C stop the run at the next logged step with a
    checkpoint; resumed, the run ends as one never stopped, its metrics logged once each."""
    number = getattr(signal, name)
    common = ["trainer.max_steps=8", "trainer.eval_every=3", "model.dropout=0.2", "trainer.log_every=2"]
    straight = run(make_cfg(tmp_path, *common), run_dir=tmp_path / "a")
    ckpt = tmp_path / "b" / "checkpoints" / "last.pt"
    requeued = []
    previous = signal.signal(number, lambda *_: requeued.append(ckpt.is_file())) if name == "SIGUSR2" else None
    _signal_at_step(monkeypatch, 3, number)
    try:
        if name == "SIGINT":
            with pytest.raises(KeyboardInterrupt):
                run(make_cfg(tmp_path, *common), run_dir=tmp_path / "b")
        else:
            assert run(make_cfg(tmp_path, *common), run_dir=tmp_path / "b")["stopped_at"] == 4
    finally:
        if previous is not None:
            signal.signal(number, previous)
    assert torch.load(ckpt, weights_only=False)["step"] == 4  # the logged step after the signal's
    assert requeued == ([True] if name == "SIGUSR2" else [])
    monkeypatch.undo()
    resumed = run(make_cfg(tmp_path, *common, "resume=true"), run_dir=tmp_path / "b")
    for key in ("test_acc", "test_loss", "best_val_acc", "steps"):
        assert resumed[key] == straight[key], key
    volatile = {"time", "elapsed", "step_time", "tokens_per_s", "peak_mem_mb", "total_time"}
    strip = lambda rs: [{k: v for k, v in r.items() if k not in volatile} for r in rs]  # noqa: E731
    assert strip(read_jsonl(tmp_path / "b" / "metrics.jsonl")) == strip(read_jsonl(tmp_path / "a" / "metrics.jsonl"))


def test_a_second_ctrl_c_stops_at_once_without_a_checkpoint(tmp_path, monkeypatch):
    _signal_at_step(monkeypatch, 3, signal.SIGINT, signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        run(make_cfg(tmp_path, "trainer.max_steps=8"), run_dir=tmp_path / "b")
    assert not (tmp_path / "b" / "checkpoints" / "last.pt").exists()  # a mid-step one would not resume exactly


def test_resuming_a_finished_run_returns_its_results(tmp_path):
    common = ["trainer.max_steps=4", "trainer.eval_every=2", "trainer.checkpoint_every=2"]
    first = run(make_cfg(tmp_path, *common), run_dir=tmp_path / "a")
    records = read_jsonl(tmp_path / "a" / "metrics.jsonl")
    again = run(make_cfg(tmp_path, *common, "resume=true"), run_dir=tmp_path / "a")
    assert again == first and read_jsonl(tmp_path / "a" / "metrics.jsonl") == records


def test_stop_after_stops_at_a_logged_step(tmp_path):
    stopped = run(make_cfg(tmp_path, "trainer.max_steps=12", "trainer.log_every=4", "trainer.stop_after=6"),
                  run_dir=tmp_path / "b")
    assert stopped["stopped_at"] == 8


def test_resume_auto_starts_fresh_then_continues(tmp_path):
    common = ["trainer.max_steps=6", "trainer.eval_every=3", "trainer.checkpoint_every=3", "resume=auto"]
    straight = run(make_cfg(tmp_path, *common), run_dir=tmp_path / "a")  # no checkpoint yet: from scratch
    assert straight["steps"] == 6
    assert run(make_cfg(tmp_path, *common, "trainer.stop_after=3"), run_dir=tmp_path / "b")["stopped_at"] == 3
    resumed = run(make_cfg(tmp_path, *common), run_dir=tmp_path / "b")  # the same command, requeued
    assert resumed["test_acc"] == straight["test_acc"] and resumed["best_val_acc"] == straight["best_val_acc"]


def test_resumed_run_logs_each_step_once(tmp_path):
    """A run killed after its checkpoint logged steps past it; the resumed run logs them again,
    so the records after the checkpoint's step must go first."""
    common = ["trainer.max_steps=8", "trainer.eval_every=2", "trainer.checkpoint_every=4", "model.dropout=0.1"]
    run(make_cfg(tmp_path, *common), run_dir=tmp_path / "a")
    run(make_cfg(tmp_path, *common, "trainer.stop_after=4"), run_dir=tmp_path / "b")
    ckpt = tmp_path / "b" / "checkpoints" / "last.pt"
    at_step_4 = ckpt.read_bytes()
    run(make_cfg(tmp_path, *common, "trainer.stop_after=6", "resume=true"), run_dir=tmp_path / "b")
    ckpt.write_bytes(at_step_4)  # as if killed at step 6 before its checkpoint: steps 5, 6 are logged past step 4
    assert [r["step"] for r in read_jsonl(tmp_path / "b" / "metrics.jsonl") if "step_time" in r] == [1, 2, 3, 4, 5, 6]
    run(make_cfg(tmp_path, *common, "resume=true"), run_dir=tmp_path / "b")
    volatile = {"time", "elapsed", "step_time", "tokens_per_s", "peak_mem_mb", "total_time"}
    strip = lambda rs: [{k: v for k, v in r.items() if k not in volatile} for r in rs]  # noqa: E731
    assert strip(read_jsonl(tmp_path / "b" / "metrics.jsonl")) == strip(read_jsonl(tmp_path / "a" / "metrics.jsonl"))


def test_smoke_preset_trains_with_sparse_attention(tmp_path):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=smoke", f"data_root={tmp_path / 'data'}",
                                          "trainer.progress=false"])
    results = run(cfg, run_dir=tmp_path / "run")
    assert results["steps"] == 20 and results["attention"] == "butterfly"
    assert results["mask_density"] <= 0.7  # butterfly over >= 5 blocks of 16 tokens, not one dense tile


def test_max_time_stops_early_validates_and_tests(tmp_path):
    """A run past ``trainer.max_time`` stops after its current step, validates the steps since the last
    validation and scores the test set (``time_limited`` in its results)."""
    cfg = make_cfg(tmp_path, "trainer.max_steps=20", "trainer.eval_every=5", "trainer.max_time=1e-9")
    results = run(cfg, run_dir=tmp_path / "run")
    assert results["time_limited"] and results["steps"] == 1 and 0.0 <= results["test_acc"] <= 1.0
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records if "val_acc" in r and "test_acc" not in r] == [1]
