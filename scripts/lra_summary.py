"""Summarise LRA training runs: test accuracy mean ± std per task and attention pattern over seeds,
the median training step, and (with ``--step-time``) the speed-up over a standard Transformer measured
by ``scripts/lra_step_time.py``; plus a plot per task of validation accuracy against steps and
against the run's seconds (``elapsed``, summed over resumed legs).

    python scripts/lra_summary.py outputs/listops/* --step-time step_time.jsonl --out summary/

Each run directory needs ``config.yaml``, ``results.json`` and ``metrics.jsonl`` (what
``experiments/train.py`` writes). Writes ``summary.md`` and ``<task>_val_acc.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from omegaconf import OmegaConf

from sparseflash.logging import read_jsonl


def load_run(run_dir: Path) -> dict:
    """One finished run: its task, pattern, seed, results and metric records."""
    missing = [f for f in ("config.yaml", "results.json", "metrics.jsonl") if not (run_dir / f).exists()]
    if missing:
        raise FileNotFoundError(f"{run_dir} is not a finished run: it has no {', '.join(missing)}")
    cfg = OmegaConf.load(run_dir / "config.yaml")
    records = read_jsonl(run_dir / "metrics.jsonl")
    return {"dir": run_dir, "task": str(cfg.task.name), "pattern": str(cfg.attention.pattern), "seed": int(cfg.seed),
            "results": json.loads((run_dir / "results.json").read_text()),
            "steps": [r for r in records if "step_time" in r],
            "evals": [r for r in records if "val_acc" in r and "test_acc" not in r]}


def _mean_std(values: list[float]) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.mean(values):.2f} ± {100 * std:.2f}"


def _speedups(step_time: list[dict], pattern: str) -> dict[int, float | None]:
    """Per length: the standard Transformer's step time over this pattern's on the kernels (both
    without attention dropout, in eager mode)."""
    out = {}
    for r in step_time:
        if (r["pattern"], r["backend"]) != (pattern, "triton") or r.get("attention_dropout", 0.0) or r.get("compiled"):
            continue
        base = next(b for b in step_time if (b["pattern"], b["backend"]) == ("dense", "standard")
                    and (b["length"], b["batch"]) == (r["length"], r["batch"]))
        out[r["length"]] = (base["median_ms"] / r["median_ms"]) if base["median_ms"] and r["median_ms"] else None
    return out


def table(runs: list[dict], step_time: list[dict]) -> str:
    """Markdown: one row per task and pattern."""
    lengths = sorted({r["length"] for r in step_time})
    head = ["task", "attention", "seeds", "test acc % (mean ± std)", "per seed", "best val % (mean)",
            "median step in training (ms)", *(f"speed-up over standard at {n}" for n in lengths)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    groups = defaultdict(list)
    for run in runs:
        groups[run["task"], run["pattern"]].append(run)
    for (task, pattern), group in sorted(groups.items()):
        group.sort(key=lambda r: r["seed"])
        tests = [r["results"]["test_acc"] for r in group]
        seeds = ", ".join(f"s{r['seed']} {100 * r['results']['test_acc']:.2f}" for r in group)
        best_val = statistics.mean(r["results"]["best_val_acc"] for r in group)
        step_ms = statistics.median(statistics.median(s["step_time"] for s in r["steps"]) for r in group) * 1e3
        speedups = _speedups(step_time, pattern)
        cells = [f"{speedups[n]:.2f}x" if speedups.get(n) else "-" for n in lengths]
        lines.append(f"| {task} | {pattern} | {len(group)} | {_mean_std(tests)} | {seeds} | {100 * best_val:.2f} | "
                     f"{step_ms:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: list[dict], task: str, path: Path) -> None:
    """Validation accuracy against steps and against seconds, one line per run, a colour per pattern."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    patterns = sorted({r["pattern"] for r in runs})
    colours = dict(zip(patterns, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for run in sorted(runs, key=lambda r: (r["pattern"], r["seed"])):
        label = f"{run['pattern']} s{run['seed']}"
        acc = [100 * e["val_acc"] for e in run["evals"]]
        axes[0].plot([e["step"] for e in run["evals"]], acc, color=colours[run["pattern"]], marker=".", label=label)
        axes[1].plot([e["elapsed"] for e in run["evals"]], acc, color=colours[run["pattern"]], marker=".")
    axes[0].set(xlabel="training step", ylabel="validation accuracy (%)", title=f"{task}: against steps")
    axes[1].set(xlabel="seconds (set-up, training and validation)", title=f"{task}: against time")
    axes[0].legend(fontsize=7, ncol=2)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+", help="run directories")
    parser.add_argument("--step-time", type=Path, help="JSON lines of scripts/lra_step_time.py")
    parser.add_argument("--out", type=Path, required=True, help="folder for summary.md and the plots")
    args = parser.parse_args(argv)
    runs = [load_run(d) for d in args.runs]
    step_time = read_jsonl(args.step_time) if args.step_time else []
    args.out.mkdir(parents=True, exist_ok=True)
    text = table(runs, step_time)
    (args.out / "summary.md").write_text(text + "\n")
    for task in sorted({r["task"] for r in runs}):
        plot([r for r in runs if r["task"] == task], task, args.out / f"{task}_val_acc.png")
    print(text)
    return text


if __name__ == "__main__":
    main()
