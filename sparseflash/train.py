"""The training loop for the LRA tasks: ``run(cfg)`` (plain PyTorch, DDP-aware).

- AdamW; linear warm-up then ``constant``/``linear``/``cosine``/``rsqrt`` decay; gradient clipping;
  bf16 autocast on CUDA (``trainer.precision``).
- ``trainer.max_time`` (seconds) ends training early, still testing the best weights.
- Evaluation every ``trainer.eval_every`` steps; the weights with the best validation accuracy
  are kept and the test set is scored with them (not with the last weights).
- Checkpoints (``<run_dir>/checkpoints/last.pt``, see ``sparseflash.train_state``) hold
  everything a run needs to continue exactly where it stopped; they are written every
  ``trainer.checkpoint_every`` steps, at the end (with ``checkpoint_every`` or ``resume`` set), at
  ``trainer.stop_after``, and on SIGTERM, SIGUSR2 (submitit's warning before a SLURM time limit) and
  a first Ctrl-C: every rank hears them and all stop at the next logged step (a second Ctrl-C stops
  at once, without one). Resuming a run that finished returns its results.
  ``resume=true`` continues the run in ``run_dir`` (an error if it has no checkpoint),
  ``resume=<path>`` the named checkpoint, ``resume=auto`` the run's own checkpoint when there is
  one and starts from scratch otherwise.
  A resumed run first drops the ``metrics.jsonl`` records of steps after its checkpoint (the
  stopped run may have logged some), so no step is logged twice.
- DDP under ``torchrun`` (gloo on CPU, nccl on CUDA; ``sparseflash.distributed``): the global
  batch is split across ranks (``sparseflash.data.stream``), evaluation is sharded and summed;
  only rank 0 logs and writes.
- Logged per step: loss, acc, lr, step_time, tokens_per_s, peak_mem_mb; per evaluation: val_loss,
  val_acc; with both, ``elapsed`` (the run's seconds so far, summed over resumed legs); at the end:
  best_val_acc, test_acc, total_time, the mask's density and picture.
  ``metrics.jsonl``, ``config.yaml`` and ``results.json`` go into the run directory. Console
  lines go to the ``sparseflash.train`` logger, which Hydra's job logging also writes into the
  run's ``train.log``.

``_run`` reads top to bottom as nanoGPT's loop does: set-up and resume, then per step the batch,
forward, backward, optimizer step, logging, validation, and the stop/checkpoint decisions; then
the test with the best weights (``_test``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import random
import resource
import signal
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from sparseflash.data import TaskData, build_task
from sparseflash.data.augment import grid_augment
from sparseflash.data.stream import BatchLoader, BatchStream, count_tokens, load_batch
from sparseflash.distributed import Dist
from sparseflash.logging import RunLogger, console_fallback, drop_records_after, output_dir
from sparseflash.masks import MaskSpec, import_patterns
from sparseflash.models import build_model
from sparseflash.models.lra import ATTENTION_KEYS
from sparseflash.train_state import TrainState, resume_path

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- schedule
def lr_factor(step: int, *, schedule: str, warmup: int, max_steps: int, min_ratio: float = 0.0) -> float:
    """Multiplier of the base learning rate at ``step`` (0-based): linear warm-up over
    ``warmup`` steps, then ``constant``, ``linear`` or ``cosine`` decay to ``min_ratio`` at
    ``max_steps``, or ``rsqrt`` (``sqrt(warmup / step)``, LRA's ``rsqrt_decay``)."""
    s = step + 1
    warm = min(1.0, s / warmup) if warmup > 0 else 1.0
    if schedule == "constant":
        decay = 1.0
    elif schedule in ("linear", "cosine"):
        progress = min(1.0, max(0.0, (s - warmup) / max(1, max_steps - warmup)))
        shape = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        decay = min_ratio + (1.0 - min_ratio) * shape
    elif schedule == "rsqrt":
        decay = math.sqrt(max(1, warmup) / max(s, warmup, 1))
    else:
        raise ValueError(f"trainer.schedule must be constant, linear, cosine or rsqrt; got {schedule!r}")
    return warm * decay


def _optimizer(module: torch.nn.Module, tr: DictConfig):
    """AdamW (no weight decay on biases, norms, positions and the CLS token) and its schedule."""
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or name.endswith(".pos") or name.endswith("cls") else decay).append(p)
    groups = [{"params": decay, "weight_decay": float(tr.weight_decay)}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=float(tr.lr), betas=tuple(tr.get("betas", (0.9, 0.98))),
                                  eps=float(tr.get("eps", 1e-8)))
    schedule = functools.partial(lr_factor, schedule=str(tr.schedule), warmup=int(tr.warmup_steps),
                                 max_steps=int(tr.max_steps), min_ratio=float(tr.get("min_lr_ratio", 0.0)))
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


# ----------------------------------------------------------------------------- set-up
def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (dropout, initialisation)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _run_dir(cfg: DictConfig, run_dir: str | os.PathLike | None) -> Path:
    return Path(run_dir) if run_dir is not None else output_dir(cfg.get("run_dir"), "outputs")


def _load_task(task_cfg: DictConfig, ctx: Dist) -> TaskData:
    """The task's datasets: rank 0 first (it may generate and cache them), the others once they are on disk."""
    task = build_task(task_cfg) if ctx.main else None
    ctx.barrier()
    return task if ctx.main else build_task(task_cfg)


def _compile_backend(setting) -> str | None:
    """The torch.compile backend ``trainer.compile`` names: None for false/null, inductor for true."""
    if setting is None or setting is False:
        return None
    if setting is True:
        return "inductor"
    known = torch._dynamo.list_backends(exclude_tags=())
    if not isinstance(setting, str) or setting not in known:
        raise ValueError(f"trainer.compile must be false, true (inductor) or one of {known}; got {setting!r}")
    return setting


def _build_model(cfg: DictConfig, task: TaskData, ctx: Dist, compile_backend: str | None):
    """``(model, module)``: ``module`` on this rank's device, and ``model`` what trains: the same, wrapped
    in DDP when there are several processes and compiled by ``compile_backend`` when given (the bare
    module is evaluated and saved)."""
    module = build_model(cfg.model, cfg.attention, vocab_size=task.vocab_size, max_len=task.max_len,
                         num_classes=task.num_classes, pair=task.pair).to(ctx.device)
    model = module
    if ctx.enabled:
        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(module, device_ids=ids)
    if compile_backend is not None:
        # the padded length changes from batch to batch: Dynamo compiles a second graph with a symbolic
        # length at the second length it sees (and one more for the model's pad-to-multiple branch)
        model = torch.compile(model, backend=compile_backend)
    return model, module


def _attention_summary(cfg: DictConfig, task: TaskData) -> dict:
    """What a run reports about its attention: the pattern's name, the density and picture of its
    mask at the task's longest input, and the model line's description."""
    mask = MaskSpec.from_config(cfg.attention, other_keys=ATTENTION_KEYS).build(task.max_len, heads=cfg.model.heads)
    density = float(mask.density) if hasattr(mask, "density") else 1.0
    attn = cfg.attention
    score_mod = f", score_mod {attn.score_mod}" if attn.get("score_mod") else ""
    return {"pattern": str(attn.pattern), "density": density, "picture": str(mask),
            "description": f"{attn.pattern} (block {attn.block}, backend {attn.backend}{score_mod}, "
                           f"density {density:.3f})"}


def _open_logger(cfg: DictConfig, run_dir: Path, state: TrainState, ctx: Dist) -> RunLogger:
    """Rank 0's sinks (``metrics.jsonl``, W&B when configured) and ``config.yaml``. A resumed run
    (``state.step > 0``) drops the records after its checkpoint first, and continues its W&B run."""
    wandb_kwargs = None
    if cfg.get("logger") is not None and cfg.logger.get("wandb") is not None:
        wandb_kwargs = dict(OmegaConf.to_container(cfg.logger.wandb, resolve=True))
        if state.wandb_id:
            wandb_kwargs["resume_id"] = state.wandb_id
    if ctx.main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        if state.step > 0:
            drop_records_after(run_dir / "metrics.jsonl", state.step)
    logger = RunLogger(run_dir, wandb=wandb_kwargs, config=OmegaConf.to_container(cfg, resolve=True),
                       enabled=ctx.main)
    if logger.wandb is not None:
        state.wandb_id = logger.wandb.run.id
    return logger


def _resume(source: Path | None, resume, run_dir: Path, state: TrainState, parts: dict, ctx: Dist) -> None:
    """Load the checkpoint ``source`` (what ``resume`` named, see ``train_state.resume_path``) into
    ``state`` and ``parts`` (module, optimizer, scheduler, stream), and say where the run starts."""
    if source is not None:
        state.load(source, **parts, rank=ctx.rank, device=ctx.device)
    if ctx.main and resume:
        log.info(f"resumed from {source} at step {state.step}" if source is not None
                 else f"resume=auto: no checkpoint in {run_dir}; starting from step 0")


def _introduce(task: TaskData, module, attention: dict, state: TrainState, logger: RunLogger, ctx: Dist,
               run_dir: Path) -> None:
    """Rank 0 describes the task, model and run directory; a new run logs the same as step 0."""
    if not ctx.main:
        return
    n_params, majority = sum(p.numel() for p in module.parameters()), task.info.get("majority", 0.0)
    log.info(f"task {task.name}: {len(task.train)} train / {len(task.val)} val / {len(task.test)} test, "
             f"max_len {task.max_len}, {task.num_classes} classes (test majority {majority:.3f})\n"
             f"model: {n_params / 1e6:.2f}M parameters, attention {attention['description']}, "
             f"device {ctx.device}, {ctx.world} process(es)\nrun dir: {run_dir}")
    if state.step == 0:
        logger.log({"n_params": n_params, "mask_density": attention["density"], "train_size": len(task.train),
                    "majority": majority}, step=0)


# ----------------------------------------------------------------------------- pieces of the loop
class _Console:
    """Rank 0's console: lines through the logger and, when asked for and tqdm is installed, a
    progress bar, which each line is written above (tqdm's external write mode). Other ranks are silent."""

    def __init__(self, total: int, initial: int, enabled: bool, bar: bool):
        self.total, self.enabled, self.bar = total, enabled, None
        if enabled and bar:
            with contextlib.suppress(ImportError):
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True, leave=False,
                                mininterval=0.5 if sys.stderr.isatty() else 10.0, file=sys.stderr)

    def line(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            log.info(text)
        else:
            with self.bar.external_write_mode():
                log.info(text)

    def step(self, step: int, text: str) -> None:
        self.line(f"step {step}/{self.total} | {text}")

    def advance(self, record: dict | None) -> None:
        """One step done; ``record`` (if one was logged) goes into the bar's postfix."""
        if self.bar is None:
            return
        if record is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", acc=f"{record['acc']:.3f}", lr=f"{record['lr']:.2e}",
                                 refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class _Window:
    """Training metrics of the steps since the last record, averaged (``trainer.log_every``)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.loss = self.acc = self.seconds = 0.0
        self.steps = self.tokens = 0

    def add(self, loss: float, acc: float, tokens: float, seconds: float) -> None:
        self.loss += loss
        self.acc += acc
        self.tokens += tokens
        self.seconds += seconds
        self.steps += 1

    def record(self, lr: float, device: torch.device, epoch: int) -> dict:
        """The averages (and the current lr, memory peak, epoch), and a fresh window."""
        n = self.steps
        record = {"loss": self.loss / n, "acc": self.acc / n, "lr": lr, "step_time": self.seconds / n,
                  "tokens_per_s": self.tokens / max(self.seconds, 1e-9), "peak_mem_mb": _peak_mem_mb(device),
                  "epoch": epoch}
        self.reset()
        return record


def _peak_mem_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


# SLURM's pre-emption and time limit and torchrun stopping its workers (SIGTERM), the warning submitit asks
# SLURM for before the time limit (SIGUSR2; its own handler then requeues the job), Ctrl-C (SIGINT)
STOP_SIGNALS = ("SIGTERM", "SIGUSR2", "SIGINT")


@contextlib.contextmanager
def _stop_signals() -> Iterator[dict]:
    """While the block runs, a stop signal (``STOP_SIGNALS``) sets ``stop["signal"]`` instead of ending the
    process, so that the loop checkpoints at a step boundary and stops; ``stop["previous"]`` holds the
    handlers the signals had (the loop calls submitit's SIGUSR2 handler after its checkpoint). A second
    Ctrl-C interrupts at once (KeyboardInterrupt, no checkpoint). Every rank listens (SLURM and torchrun
    signal them all, and a rank that did not listen would die at once); the loop shares the flags, so
    that all stop at the same step."""
    stop: dict = {"signal": None, "previous": {}}

    def handler(signum, _frame):
        if signum == signal.SIGINT and stop["signal"] == signal.SIGINT:
            raise KeyboardInterrupt
        if signum == signal.SIGINT:
            log.info("Ctrl-C: stopping at the next logged step, with a checkpoint (Ctrl-C again: at once, without)")
        stop["signal"] = signum

    for name in STOP_SIGNALS:
        number = getattr(signal, name, None)  # no SIGUSR2 on Windows
        if number is not None:
            with contextlib.suppress(ValueError):  # ValueError: not the main thread, no handler there
                stop["previous"][number] = signal.signal(number, handler)
    try:
        yield stop
    finally:
        for number, previous in stop["previous"].items():
            signal.signal(number, previous)


def _after_stop(stop: dict) -> None:
    """What the signal that stopped the loop asks for once its checkpoint is written: Ctrl-C ends the process
    as an interruption (KeyboardInterrupt), submitit's SIGUSR2 handler (where the signal had one) requeues
    the job; after SIGTERM the run returns."""
    number = stop["signal"]
    if number == signal.SIGINT:
        raise KeyboardInterrupt
    previous = stop["previous"].get(number)
    if number != signal.SIGTERM and callable(previous):
        previous(number, None)


@torch.no_grad()
def evaluate(model, dataset, *, batch_size: int, device, autocast, ctx: Dist, max_batches: int | None = None) -> dict:
    """Loss and accuracy over ``dataset`` (its first ``max_batches`` batches), sharded over
    ranks and summed."""
    was_training = model.training
    model.eval()
    n = len(dataset)
    starts = list(range(0, n, batch_size))
    if max_batches:
        starts = starts[: int(max_batches)]
    loss_sum = correct = count = 0.0
    for i, start in enumerate(starts):
        if i % ctx.world != ctx.rank:
            continue
        batch = load_batch(dataset, range(start, min(n, start + batch_size)), device)
        with autocast():
            logits = model(batch)
        loss_sum += F.cross_entropy(logits.float(), batch["y"], reduction="sum").item()
        correct += (logits.argmax(-1) == batch["y"]).sum().item()
        count += batch["y"].numel()
    loss_sum, correct, count = ctx.sum([loss_sum, correct, count])
    model.train(was_training)
    return {"loss": loss_sum / max(1.0, count), "acc": correct / max(1.0, count), "count": int(count)}


def _validate(score: Callable, module, dataset, state: TrainState, logger: RunLogger, console: _Console) -> None:
    """Score the validation set, keep the weights if they are the best so far, log both."""
    val = score(module, dataset)
    improved = state.keep_if_best(val["acc"], module)
    logger.log({"val_loss": val["loss"], "val_acc": val["acc"], "best_val_acc": state.best_val,
                "elapsed": state.seconds()}, step=state.step)
    console.step(state.step, f"val_loss {val['loss']:.4f} | val_acc {val['acc']:.3f}{' (best)' if improved else ''}")


# ----------------------------------------------------------------------------- main loop
def run(cfg: DictConfig, run_dir: str | os.PathLike | None = None) -> dict:
    """Train and test one configuration; returns the final results (on every rank), or
    ``{"stopped_at", "run_dir"}`` when it stopped early with a checkpoint."""
    ctx = Dist(str(cfg.get("device", "auto")))
    try:
        with console_fallback():
            results = _run(cfg, ctx, run_dir)
    except BaseException:
        ctx.close(wait=False)  # a failed rank must not wait for the others
        raise
    ctx.close()
    return results


def _run(cfg: DictConfig, ctx: Dist, run_dir) -> dict:
    state = TrainState()  # its clock starts now: a run's time counts its set-up
    tr, device = cfg.trainer, ctx.device
    compile_backend = _compile_backend(tr.get("compile"))  # a bad value fails before the data is loaded
    precision = str(tr.get("precision", "bf16"))
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"trainer.precision must be bf16 (autocast on CUDA) or fp32; got {precision!r}")
    import_patterns(cfg.get("import_patterns") or [])
    run_dir = Path(ctx.broadcast(str(_run_dir(cfg, run_dir))))
    resume = cfg.get("resume", False)
    source = resume_path(resume, run_dir)  # before the data is loaded: a missing checkpoint fails at once
    if tr.get("num_threads"):
        torch.set_num_threads(int(tr.num_threads))
    seed = int(cfg.seed)
    seed_everything(seed + ctx.rank)
    task = _load_task(cfg.task, ctx)
    augment = grid_augment(cfg.task.get("augment"), task.image_size, task.name, seed + ctx.rank, device)
    model, module = _build_model(cfg, task, ctx, compile_backend)
    optimizer, scheduler = _optimizer(module, tr)
    stream = BatchStream(len(task.train), int(tr.batch_size), seed, ctx.rank, ctx.world)
    parts = {"module": module, "optimizer": optimizer, "scheduler": scheduler, "stream": stream}
    ckpt_path = run_dir / "checkpoints" / "last.pt"
    _resume(source, resume, run_dir, state, parts, ctx)
    if state.step >= int(tr.max_steps) and (run_dir / "results.json").is_file():  # resumed after its end
        log.info(f"the run in {run_dir} already finished at step {state.step}: nothing to do")
        return {**json.loads((run_dir / "results.json").read_text()), "run_dir": str(run_dir)}
    logger = _open_logger(cfg, run_dir, state, ctx)
    attention = _attention_summary(cfg, task)
    _introduce(task, module, attention, state, logger, ctx, run_dir)
    max_steps, eval_every, ckpt_every = int(tr.max_steps), int(tr.eval_every), int(tr.get("checkpoint_every") or 0)
    log_every, print_every = max(1, int(tr.get("log_every", 1))), max(1, int(tr.get("print_every", 10)))
    stop_after, max_time, clip = tr.get("stop_after"), tr.get("max_time"), float(tr.get("grad_clip") or 0.0)
    use_bf16 = device.type == "cuda" and precision == "bf16"
    autocast = functools.partial(torch.autocast, "cuda", dtype=torch.bfloat16, enabled=use_bf16)
    score = functools.partial(evaluate, batch_size=int(tr.get("eval_batch_size") or tr.batch_size), device=device,
                              autocast=autocast, ctx=ctx)
    console = _Console(max_steps, state.step, ctx.main, bool(tr.get("progress", True)))
    validate = functools.partial(_validate, functools.partial(score, max_batches=tr.get("eval_batches")), module,
                                 task.val, state, logger, console)
    save = functools.partial(state.save, ckpt_path, **parts, ctx=ctx, config=OmegaConf.to_container(cfg, resolve=True))
    window, timed_out, stopped = _Window(), False, False
    loader = BatchLoader(task.train, device)
    model.train()
    with _stop_signals() as stop:
        try:
            while state.step < max_steps:
                t0 = time.perf_counter()
                batch = loader.load(stream.next())
                if augment is not None:
                    batch = augment(batch, state.step)
                with autocast():
                    logits = model(batch)
                loss = F.cross_entropy(logits.float(), batch["y"])
                loss.backward()
                if clip > 0:
                    torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                state.step += 1
                if state.step < max_steps:
                    loader.prefetch(stream.peek())  # while the device runs this step
                acc = (logits.argmax(-1) == batch["y"]).float().mean().item()
                term = 1.0 if stop["signal"] is not None else 0.0
                late = 1.0 if max_time and state.seconds() > float(max_time) else 0.0
                # summed over the ranks with the metrics, so that every rank takes the same decisions
                loss_sum, acc_sum, tokens, terms, lates = ctx.sum([loss.item(), acc, float(count_tokens(batch)),
                                                                   term, late])
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                window.add(loss_sum / ctx.world, acc_sum / ctx.world, tokens, time.perf_counter() - t0)
                record = None
                logged = state.step % log_every == 0 or state.step == max_steps
                if logged:
                    record = window.record(scheduler.get_last_lr()[0], device, stream.epoch)
                    logger.log({**record, "elapsed": state.seconds()}, step=state.step)
                    if state.step % print_every == 0:
                        console.step(state.step, f"loss {record['loss']:.4f} | acc {record['acc']:.3f} | "
                                                 f"lr {record['lr']:.2e} | {record['step_time'] * 1e3:.0f} ms/step | "
                                                 f"{record['tokens_per_s']:.0f} tok/s")
                console.advance(record)
                if eval_every > 0 and (state.step % eval_every == 0 or state.step == max_steps):
                    validate()
                if lates > 0 and state.step < max_steps:
                    console.line(f"trainer.max_time={max_time}s reached at step {state.step}: stopping early, "
                                 f"testing the best-validation weights")
                    timed_out = True
                    break
                stop_now = stop_after is not None and state.step >= int(stop_after) and logged
                # on a stop signal every rank stops at the next logged step, so that no window of averaged
                # metrics is cut and a resumed run logs what an uninterrupted one does
                signalled = logged and terms > 0
                if (ckpt_every and state.step % ckpt_every == 0) or stop_now or signalled:
                    save()
                if stop_now or signalled:
                    console.line(f"stopped at step {state.step}; checkpoint in {ckpt_path} "
                                 f"(continue with resume=true hydra.run.dir={run_dir})")
                    stopped = True
                    break
        except KeyboardInterrupt:  # a second Ctrl-C: mid-step, so no checkpoint (it would not resume exactly)
            console.close()
            log.info(f"interrupted during step {state.step + 1}; the last checkpoint, if any, is in {ckpt_path}")
            logger.close()
            raise
    console.close()
    if stopped:
        logger.close()
        _after_stop(stop)
        return {"stopped_at": state.step, "run_dir": str(run_dir)}
    if timed_out and eval_every > 0 and state.step % eval_every:
        validate()  # the steps since the last validation may hold the best weights
    if ckpt_every or resume:
        save()
    return _test(state, module, task, score, attention, logger, ctx, run_dir, timed_out)


def _test(state: TrainState, module, task: TaskData, score: Callable, attention: dict, logger: RunLogger,
          ctx: Dist, run_dir: Path, timed_out: bool) -> dict:
    """Score the test set with the best-validation weights (the last ones if there was no
    validation), log and write the results (``results.json``, ``best_model.pt``)."""
    if state.best_weights is not None:
        module.load_state_dict(state.best_weights)
    test = score(module, task.test)
    results = {"test_acc": test["acc"], "test_loss": test["loss"], "best_val_acc": state.best_val,
               "best_step": state.best_step, "total_time": state.seconds(), "steps": state.step,
               "mask_density": attention["density"], "majority": task.info.get("majority", 0.0),
               "task": task.name, "attention": attention["pattern"], "n_params": sum(p.numel() for p in module.parameters()),
               "time_limited": timed_out}
    logger.log({**results, "mask": attention["picture"]}, step=state.step)
    if ctx.main:
        if logger.wandb is not None:
            for k, v in {**results, "mask": attention["picture"]}.items():
                logger.wandb.run.summary[k] = v
        (run_dir / "results.json").write_text(json.dumps(results, indent=1))
        torch.save(module.state_dict(), run_dir / "best_model.pt")
        log.info(f"attention mask ({attention['pattern']}, density {attention['density']:.3f}):\n{attention['picture']}\n"
                 f"done in {results['total_time']:.1f}s: best val acc {state.best_val:.4f} (step {state.best_step}), "
                 f"test acc {test['acc']:.4f} (majority class {results['majority']:.4f})")
    logger.close()
    results["run_dir"] = str(run_dir)
    return results
