"""One GPU against several: the same training run (same global batch, seed and data order) as one
process and under ``torchrun``, then their loss curves and training throughput side by side.

    python scripts/ddp_scaling.py --gpus 2 --steps 300 experiment=lra/listops attention=butterfly
    python scripts/ddp_scaling.py --gpus 2 --weak experiment=lra/listops   # the batch per GPU kept

With ``--weak`` the torchrun run takes ``--gpus`` times the one-GPU run's batch (each GPU gets that
batch): its throughput is compared, its losses are not (another batch, another curve).

Every argument after the options is a Hydra override of ``experiments/train.py``. Dropout is turned
off unless an override sets it: each rank draws its own dropout masks (seed + rank), so with dropout
the two runs are different samples and their curves cannot be compared step by step. Without it
they differ only in the order of floating-point sums (each rank pads its share of the batch to its
own longest example, the gradients are averaged by an all-reduce), which bf16 autocast amplifies.

Writes ``<out>/one`` and ``<out>/ddp`` (run directories) and ``<out>/scaling.json``, and prints:
per-step loss differences, validation losses at each evaluation, and the median time per step
(the first ``--skip`` steps, which compile kernels, left out) of each run, and the throughput
(tokens per second, medians over the same steps) of the torchrun run over the one-GPU run's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

from sparseflash.logging import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "experiments" / "train.py"
# Logged every step, evaluated rarely: a curve to compare and step times that evaluation doesn't break.
DEFAULTS = {"model.dropout": "0", "model.attention_dropout": "0", "trainer.log_every": "1",
            "trainer.print_every": "50", "trainer.progress": "false", "trainer.eval_every": "100",
            "trainer.checkpoint_every": "0"}


def _overrides(user: list[str], steps: int) -> list[str]:
    given = {o.split("=", 1)[0].lstrip("+~") for o in user}
    if "trainer.max_steps" in given:
        raise ValueError("give the number of steps as --steps, not as trainer.max_steps")
    extra = {**DEFAULTS, "trainer.max_steps": str(steps)}
    return [*user, *(f"{k}={v}" for k, v in extra.items() if k not in given)]


def _train(cmd: list[str], run_dir: Path, log: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(log, "w") as out:
        proc = subprocess.run([*cmd, f"hydra.run.dir={run_dir}"], cwd=ROOT, env=env, stdout=out,
                              stderr=subprocess.STDOUT)
    if proc.returncode:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:])
        sys.exit(f"{' '.join(cmd)} failed (exit {proc.returncode}); the end of its output ({log}):\n{tail}")


def _records(run_dir: Path) -> tuple[dict[int, dict], dict[int, float]]:
    """(training records by step, validation loss by step) of a run's metrics.jsonl."""
    steps, vals = {}, {}
    for r in read_jsonl(run_dir / "metrics.jsonl"):
        if "step_time" in r:
            steps[r["step"]] = r
        if "val_loss" in r:
            vals[r["step"]] = r["val_loss"]
    return steps, vals


def compare(one_dir: Path, ddp_dir: Path, skip: int, curves: bool = True) -> dict:
    """Time per step and throughput of two runs' metrics.jsonl (steps logged by both) and, with
    ``curves``, their loss differences."""
    (one, one_val), (ddp, ddp_val) = _records(one_dir), _records(ddp_dir)
    common = sorted(set(one) & set(ddp))
    if not common:
        raise ValueError(f"{one_dir} and {ddp_dir} have no logged step in common")
    timed = [s for s in common if s > skip] or common
    t_one = statistics.median(one[s]["step_time"] for s in timed)
    t_ddp = statistics.median(ddp[s]["step_time"] for s in timed)
    tokens = {"one": statistics.median(one[s]["tokens_per_s"] for s in timed),
              "ddp": statistics.median(ddp[s]["tokens_per_s"] for s in timed)}
    result = {"steps": len(common), "step_time_ms": {"one": t_one * 1e3, "ddp": t_ddp * 1e3},
              "tokens_per_s": tokens, "throughput_scaling": tokens["ddp"] / tokens["one"]}
    if curves:
        rel = {s: abs(ddp[s]["loss"] - one[s]["loss"]) / abs(one[s]["loss"]) for s in common}
        result.update({
            "loss_rel_diff_max": max(rel.values()),
            "loss_rel_diff_max_step": max(rel, key=rel.get),
            "loss_rel_diff_median": statistics.median(rel.values()),
            "loss_rel_diff_first_10_max": max(rel[s] for s in common[:10]),
            "final_loss": {"one": one[common[-1]]["loss"], "ddp": ddp[common[-1]]["loss"]},
            "val_loss": {s: {"one": one_val[s], "ddp": ddp_val[s]} for s in sorted(set(one_val) & set(ddp_val))},
        })
    return result


def _batch_size(run_dir: Path) -> int:
    """The global batch a finished run trained with (from the config Hydra saved in its run dir)."""
    return int(yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())["trainer"]["batch_size"])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=2, help="processes of the torchrun run (one per GPU)")
    ap.add_argument("--steps", type=int, default=300, help="training steps of each run")
    ap.add_argument("--skip", type=int, default=20, help="first steps left out of the timing (compilation)")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "ddp_scaling")
    ap.add_argument("--weak", action="store_true",
                    help="give each GPU the one-GPU run's batch (compare throughput only)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of experiments/train.py")
    args = ap.parse_args(argv)
    if args.gpus < 2:
        ap.error(f"--gpus must be at least 2 (the run to compare with one GPU); got {args.gpus}")
    try:
        overrides = _overrides(args.overrides, args.steps)
    except ValueError as e:
        ap.error(str(e))
    taken = [d for d in (args.out / "one", args.out / "ddp") if d.exists()]
    if taken:
        ap.error(f"{taken[0]} exists (a run there would resume or mix with it): give another --out")
    args.out.mkdir(parents=True, exist_ok=True)
    _train([sys.executable, str(TRAIN), *overrides], args.out / "one", args.out / "one.log")
    batch = _batch_size(args.out / "one")
    ddp_overrides = [*overrides, f"trainer.batch_size={batch * args.gpus}"] if args.weak else overrides
    _train([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.gpus}",
            str(TRAIN), *ddp_overrides], args.out / "ddp", args.out / "ddp.log")
    result = {"gpus": args.gpus, "global_batch": {"one": batch, "ddp": _batch_size(args.out / "ddp")},
              "overrides": overrides, **compare(args.out / "one", args.out / "ddp", args.skip, curves=not args.weak)}
    (args.out / "scaling.json").write_text(json.dumps(result, indent=1) + "\n")
    if not args.weak:
        print(f"{result['steps']} steps, 1 GPU vs {args.gpus}: loss relative difference median "
              f"{result['loss_rel_diff_median']:.2e}, max {result['loss_rel_diff_max']:.2e} "
              f"(step {result['loss_rel_diff_max_step']}), "
              f"first 10 steps max {result['loss_rel_diff_first_10_max']:.2e}")
        for step, v in result["val_loss"].items():
            print(f"  val_loss at step {step}: {v['one']:.4f} (1 GPU) {v['ddp']:.4f} ({args.gpus} GPUs)")
    t, b = result["step_time_ms"], result["global_batch"]
    print(f"median step {t['one']:.1f} ms (1 GPU, batch {b['one']}) vs {t['ddp']:.1f} ms ({args.gpus} GPUs, batch "
          f"{b['ddp']}): throughput {result['throughput_scaling']:.2f}x")


if __name__ == "__main__":
    main()
