"""The training loop for the LRA tasks: ``run(cfg)`` (plain PyTorch, DDP-aware).

- AdamW; linear warm-up then ``constant``/``linear``/``cosine``/``rsqrt`` decay; gradient clipping;
  bf16 autocast on CUDA (``trainer.precision``).
- ``trainer.max_time`` (seconds) ends training early, still testing the best weights.
- Evaluation every ``trainer.eval_every`` steps; the weights with the best validation accuracy
  are kept and the test set is scored with them (not with the last weights).
- Checkpoints (``<run_dir>/checkpoints/last.pt``, written atomically: tmp file + rename) hold
  the step, model, optimizer, scheduler, every rank's RNG states, the data position and the best
  weights; ``resume=true`` continues exactly where an interrupted run stopped.
- DDP under ``torchrun`` (gloo on CPU, nccl on CUDA): the global batch is split across ranks,
  evaluation is sharded and summed; only rank 0 logs and writes.
- Logged per step: loss, acc, lr, step_time, tokens_per_s, peak_mem_mb; per evaluation: val_loss,
  val_acc; at the end: best_val_acc, test_acc, total_time, the mask's density and picture.
  ``metrics.jsonl``, ``config.yaml`` and ``results.json`` go into the run directory.
"""

from __future__ import annotations

import json
import math
import os
import random
import resource
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from sparseflash.data import TaskData, build_task, collate
from sparseflash.logging import RunLogger
from sparseflash.masks import MaskSpec, import_patterns
from sparseflash.models import build_model


# ----------------------------------------------------------------------------- distributed
class Dist:
    """Rank, world size and device of this process (a single process when not under torchrun)."""

    def __init__(self, device_cfg: str = "auto"):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        want_cuda = device_cfg == "cuda" or (device_cfg == "auto" and torch.cuda.is_available())
        if device_cfg not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda; got {device_cfg!r}")
        if want_cuda and not torch.cuda.is_available():
            raise ValueError("device=cuda but no CUDA device is available")
        self.device = torch.device(f"cuda:{self.local_rank}" if want_cuda else "cpu")
        if want_cuda:
            torch.cuda.set_device(self.device)
        self.enabled = self.world > 1
        if self.enabled and not dist.is_initialized():
            dist.init_process_group("nccl" if want_cuda else "gloo")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def sum(self, values: list[float]) -> list[float]:
        if not self.enabled:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def broadcast(self, obj: Any) -> Any:
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def close(self, wait: bool = True) -> None:
        if self.enabled and dist.is_initialized():
            try:
                if wait:  # let every rank finish (rank 0 writes last) before tearing gloo down
                    dist.barrier()
            finally:
                dist.destroy_process_group()


# ----------------------------------------------------------------------------- data stream
class BatchStream:
    """Resumable, seeded batches of a dataset: epoch ``e`` is the permutation drawn from
    ``(seed, e)``; a global batch is ``batch_size`` consecutive indices of it, and rank ``r`` of
    ``world`` takes every ``world``-th of them. ``state()``/``load()`` save the position."""

    def __init__(self, n: int, batch_size: int, seed: int, rank: int = 0, world: int = 1):
        if batch_size % world:
            raise ValueError(f"trainer.batch_size={batch_size} must be divisible by the {world} processes")
        if n < batch_size:
            raise ValueError(f"the training set has {n} examples, fewer than trainer.batch_size={batch_size}")
        self.n, self.batch_size, self.seed, self.rank, self.world = n, batch_size, seed, rank, world
        self.epoch, self.pos = 0, 0
        self._perm: np.ndarray | None = None

    def _permutation(self) -> np.ndarray:
        if self._perm is None:
            self._perm = np.random.default_rng([self.seed, self.epoch]).permutation(self.n)
        return self._perm

    def next(self) -> np.ndarray:
        if self.pos + self.batch_size > self.n:  # drop the ragged tail, start the next epoch
            self.epoch, self.pos, self._perm = self.epoch + 1, 0, None
        batch = self._permutation()[self.pos:self.pos + self.batch_size]
        self.pos += self.batch_size
        return batch[self.rank::self.world]

    def state(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load(self, state: dict) -> None:
        self.epoch, self.pos, self._perm = int(state["epoch"]), int(state["pos"]), None


def _to(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _tokens(batch: dict) -> int:
    return int(batch["lengths"].sum()) + int(batch["lengths2"].sum() if "lengths2" in batch else 0)


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


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or name.endswith(".pos") or name.endswith("cls") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# ----------------------------------------------------------------------------- RNG
def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ----------------------------------------------------------------------------- helpers
def _save_atomic(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _peak_mem_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _run_dir(cfg: DictConfig, run_dir: str | os.PathLike | None) -> Path:
    if run_dir is not None:
        return Path(run_dir)
    if cfg.get("run_dir"):
        return Path(cfg.run_dir)
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except Exception:
        return Path("outputs") / time.strftime("%Y-%m-%d_%H-%M-%S")


def _progress(total: int, initial: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True, leave=False,
                mininterval=0.5 if sys.stderr.isatty() else 10.0, file=sys.stderr)


def _print(bar, text: str) -> None:
    if bar is not None:
        bar.write(text)
    else:
        print(text, flush=True)


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
        batch = _to(collate([dataset[j] for j in range(start, min(n, start + batch_size))]), device)
        with autocast():
            logits = model(batch)
        loss_sum += F.cross_entropy(logits.float(), batch["y"], reduction="sum").item()
        correct += (logits.argmax(-1) == batch["y"]).sum().item()
        count += batch["y"].numel()
    loss_sum, correct, count = ctx.sum([loss_sum, correct, count])
    model.train(was_training)
    return {"loss": loss_sum / max(1.0, count), "acc": correct / max(1.0, count), "count": int(count)}


# ----------------------------------------------------------------------------- main loop
def run(cfg: DictConfig, run_dir: str | os.PathLike | None = None) -> dict:
    """Train and test one configuration; returns the final results (on every rank)."""
    tr = cfg.trainer
    ctx = Dist(str(cfg.get("device", "auto")))
    try:
        results = _run(cfg, tr, ctx, run_dir)
    except BaseException:
        ctx.close(wait=False)  # a failed rank must not wait for the others
        raise
    ctx.close()
    return results


def _run(cfg: DictConfig, tr: DictConfig, ctx: Dist, run_dir) -> dict:
    t_start = time.time()
    import_patterns(cfg.get("import_patterns") or [])
    run_dir = Path(ctx.broadcast(str(_run_dir(cfg, run_dir))))
    device = ctx.device
    if tr.get("num_threads"):
        torch.set_num_threads(int(tr.num_threads))
    seed = int(cfg.seed)
    seed_everything(seed + ctx.rank)

    # data: rank 0 first (it may generate and cache), the others once it is on disk
    if ctx.main:
        task = build_task(cfg.task, seed=seed)
    ctx.barrier()
    if not ctx.main:
        task = build_task(cfg.task, seed=seed)
    model = build_model(cfg.model, cfg.attention, vocab_size=task.vocab_size, max_len=task.max_len,
                        num_classes=task.num_classes, pair=task.pair).to(device)
    module = model
    if ctx.enabled:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    n_params = sum(p.numel() for p in module.parameters())

    max_steps = int(tr.max_steps)
    optimizer = torch.optim.AdamW(_param_groups(module, float(tr.weight_decay)), lr=float(tr.lr),
                                  betas=tuple(tr.get("betas", (0.9, 0.98))), eps=float(tr.get("eps", 1e-8)))
    schedule = lambda step: lr_factor(step, schedule=str(tr.schedule), warmup=int(tr.warmup_steps),  # noqa: E731
                                      max_steps=max_steps, min_ratio=float(tr.get("min_lr_ratio", 0.0)))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    stream = BatchStream(len(task.train), int(tr.batch_size), seed, ctx.rank, ctx.world)
    use_bf16 = device.type == "cuda" and str(tr.get("precision", "bf16")) == "bf16"
    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_bf16)  # noqa: E731

    # resume
    ckpt_path = run_dir / "checkpoints" / "last.pt"
    step, best_val, best_step, best_state, elapsed, wandb_id = 0, -1.0, -1, None, 0.0, None
    resume = cfg.get("resume", False)
    if resume:
        src = ckpt_path if resume is True or str(resume).lower() == "true" else Path(str(resume))
        if src.is_dir():
            src = src / "checkpoints" / "last.pt" if (src / "checkpoints").is_dir() else src / "last.pt"
        if src.exists():
            ckpt = torch.load(src, map_location=device, weights_only=False)
            module.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
            scheduler.load_state_dict(ckpt["scheduler"])
            stream.load(ckpt["stream"])
            step, best_val, best_step = ckpt["step"], ckpt["best_val"], ckpt["best_step"]
            best_state, elapsed, wandb_id = ckpt["best_state"], ckpt["elapsed"], ckpt.get("wandb_id")
            rng = ckpt["rng"]
            _set_rng_state(rng[ctx.rank] if ctx.rank < len(rng) else rng[0])
            if ctx.main:
                print(f"resumed from {src} at step {step}", flush=True)
        elif ctx.main:
            print(f"resume: no checkpoint at {src}; starting from step 0", flush=True)

    # logging (rank 0 only)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    wandb_cfg = cfg.logger.get("wandb") if cfg.get("logger") is not None else None
    wandb_kwargs = None
    if wandb_cfg is not None:
        wandb_kwargs = dict(OmegaConf.to_container(wandb_cfg, resolve=True))
        if wandb_id:
            wandb_kwargs["resume_id"] = wandb_id
    if ctx.main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    logger = RunLogger(run_dir, console=False, wandb=wandb_kwargs, config=resolved, enabled=ctx.main)
    if logger.wandb is not None:
        wandb_id = logger.wandb.run.id

    mask = MaskSpec.from_config(cfg.attention, other_keys=("backend",)).build(task.max_len, heads=cfg.model.heads)
    density = float(mask.density) if hasattr(mask, "density") else 1.0
    if ctx.main:
        print(f"task {task.name}: {len(task.train)} train / {len(task.val)} val / {len(task.test)} test, "
              f"max_len {task.max_len}, {task.num_classes} classes (test majority {task.info.get('majority', 0):.3f})\n"
              f"model: {n_params / 1e6:.2f}M parameters, attention {cfg.attention.pattern} "
              f"(block {cfg.attention.block}, backend {cfg.attention.backend}, density {density:.3f}), "
              f"device {device}, {ctx.world} process(es)\nrun dir: {run_dir}", flush=True)
        if step == 0:
            logger.log({"n_params": n_params, "mask_density": density, "train_size": len(task.train),
                        "majority": task.info.get("majority", 0.0)}, step=0)

    def checkpoint() -> None:
        rngs = ctx.gather(_rng_state())
        if ctx.main:
            _save_atomic({"step": step, "model": module.state_dict(), "optimizer": optimizer.state_dict(),
                          "scheduler": scheduler.state_dict(), "stream": stream.state(), "rng": rngs,
                          "best_val": best_val, "best_step": best_step, "best_state": best_state,
                          "elapsed": elapsed + time.time() - t_start, "wandb_id": wandb_id,
                          "config": resolved}, ckpt_path)
        ctx.barrier()

    eval_bs = int(tr.get("eval_batch_size") or tr.batch_size)
    eval_every, ckpt_every = int(tr.eval_every), int(tr.get("checkpoint_every") or 0)
    log_every, print_every = max(1, int(tr.get("log_every", 1))), max(1, int(tr.get("print_every", 10)))
    stop_after = tr.get("stop_after")
    max_time, timed_out = tr.get("max_time"), False
    clip = float(tr.get("grad_clip") or 0.0)
    bar = _progress(max_steps, step, bool(tr.get("progress", True)) and ctx.main)

    # SIGTERM (e.g. SLURM pre-emption) -> checkpoint and stop, like an interruption
    interrupted = {"flag": False}
    previous = None
    if ctx.main and hasattr(signal, "SIGTERM"):
        try:
            previous = signal.signal(signal.SIGTERM, lambda *_: interrupted.__setitem__("flag", True))
        except ValueError:  # not the main thread
            previous = None

    model.train()
    window: dict[str, float] = {"loss": 0.0, "acc": 0.0, "n": 0, "time": 0.0, "tokens": 0}
    try:
        while step < max_steps:
            t0 = time.perf_counter()
            idx = stream.next()
            batch = _to(collate([task.train[i] for i in idx]), device)
            with autocast():
                logits = model(batch)
            loss = F.cross_entropy(logits.float(), batch["y"])
            loss.backward()
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            acc = (logits.argmax(-1) == batch["y"]).float().mean().item()
            loss_v, acc, tokens = ctx.sum([loss.item(), acc, float(_tokens(batch))])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            window["loss"] += loss_v / ctx.world
            window["acc"] += acc / ctx.world
            window["n"] += 1
            window["time"] += dt
            window["tokens"] += tokens
            if step % log_every == 0 or step == max_steps:
                n = window["n"]
                record = {"loss": window["loss"] / n, "acc": window["acc"] / n,
                          "lr": scheduler.get_last_lr()[0], "step_time": window["time"] / n,
                          "tokens_per_s": window["tokens"] / max(window["time"], 1e-9),
                          "peak_mem_mb": _peak_mem_mb(device), "epoch": stream.epoch}
                logger.log(record, step=step)
                if bar is not None:
                    bar.set_postfix(loss=f"{record['loss']:.3f}", acc=f"{record['acc']:.3f}", lr=f"{record['lr']:.2e}",
                                    refresh=False)
                if ctx.main and (step % print_every == 0):
                    _print(bar, f"step {step}/{max_steps} | loss {record['loss']:.4f} | acc {record['acc']:.3f} | "
                                f"lr {record['lr']:.2e} | {record['step_time'] * 1e3:.0f} ms/step | "
                                f"{record['tokens_per_s']:.0f} tok/s")
                window = {"loss": 0.0, "acc": 0.0, "n": 0, "time": 0.0, "tokens": 0}
            if bar is not None:
                bar.update(1)
            if eval_every > 0 and (step % eval_every == 0 or step == max_steps):
                val = evaluate(module, task.val, batch_size=eval_bs, device=device, autocast=autocast, ctx=ctx,
                               max_batches=tr.get("eval_batches"))
                improved = val["acc"] > best_val
                if improved:
                    best_val, best_step = val["acc"], step
                    best_state = {k: v.detach().clone() for k, v in module.state_dict().items()}
                logger.log({"val_loss": val["loss"], "val_acc": val["acc"], "best_val_acc": best_val}, step=step)
                if ctx.main:
                    _print(bar, f"step {step}/{max_steps} | val_loss {val['loss']:.4f} | val_acc {val['acc']:.3f}"
                                f"{' (best)' if improved else ''}")
            if max_time and elapsed + time.time() - t_start > float(max_time) and step < max_steps:
                if ctx.main:
                    _print(bar, f"trainer.max_time={max_time}s reached at step {step}: stopping early, "
                                f"testing the best-validation weights")
                timed_out = True
                break
            stop_now = stop_after is not None and step >= int(stop_after)
            flag = ctx.sum([1.0 if interrupted["flag"] else 0.0])[0] > 0
            if (ckpt_every and step % ckpt_every == 0) or stop_now or flag:
                checkpoint()
            if stop_now or flag:
                if ctx.main:
                    _print(bar, f"stopped at step {step}; checkpoint in {ckpt_path} "
                                f"(continue with resume=true hydra.run.dir={run_dir})")
                    logger.close()
                if bar is not None:
                    bar.close()
                return {"stopped_at": step, "run_dir": str(run_dir)}
    except KeyboardInterrupt:
        if not ctx.enabled:
            checkpoint()
            print(f"\ninterrupted at step {step}; checkpoint in {ckpt_path}", flush=True)
        logger.close()
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if bar is not None:
        bar.close()
    if timed_out and eval_every > 0 and step % eval_every:
        val = evaluate(module, task.val, batch_size=eval_bs, device=device, autocast=autocast, ctx=ctx,
                       max_batches=tr.get("eval_batches"))
        if val["acc"] > best_val:
            best_val, best_step = val["acc"], step
            best_state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        logger.log({"val_loss": val["loss"], "val_acc": val["acc"], "best_val_acc": best_val}, step=step)
    if int(tr.get("checkpoint_every") or 0) or cfg.get("resume", False):
        checkpoint()

    # test with the best-validation weights
    last_state = None
    if best_state is not None:
        last_state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        module.load_state_dict(best_state)
    test = evaluate(module, task.test, batch_size=eval_bs, device=device, autocast=autocast, ctx=ctx)
    total_time = elapsed + time.time() - t_start
    picture = str(mask)
    results = {"test_acc": test["acc"], "test_loss": test["loss"], "best_val_acc": best_val,
               "best_step": best_step, "total_time": total_time, "steps": step,
               "mask_density": density, "majority": task.info.get("majority", 0.0),
               "task": task.name, "attention": str(cfg.attention.pattern), "n_params": n_params,
               "time_limited": timed_out}
    logger.log({**results, "mask": picture}, step=step)
    if ctx.main:
        if logger.wandb is not None:
            for k, v in {**results, "mask": picture}.items():
                logger.wandb.run.summary[k] = v
        (run_dir / "results.json").write_text(json.dumps(results, indent=1))
        torch.save(best_state if best_state is not None else module.state_dict(), run_dir / "best_model.pt")
        print(f"attention mask ({cfg.attention.pattern}, density {density:.3f}):\n{picture}\n"
              f"done in {total_time:.1f}s: best val acc {best_val:.4f} (step {best_step}), "
              f"test acc {test['acc']:.4f} (majority class {results['majority']:.4f})", flush=True)
    logger.close()
    if last_state is not None:
        module.load_state_dict(last_state)
    results["run_dir"] = str(run_dir)
    return results
