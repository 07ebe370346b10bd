"""``run(cfg)``: a whole sweep with its outputs, as ``experiments/bench.py`` calls it.

Writes into the output directory (the Hydra run directory, or ``cfg.out_dir``): ``results.jsonl``
(streamed row by row while it runs, rewritten at the end with the derived columns),
``results.csv``, ``results.md`` and ``plots/*.png`` (when some row was timed); logs progress and the
markdown table (logger ``sparseflash.bench.runner``, which Hydra's job logging also writes into
``bench.log``); with ``logger=wandb`` logs the rows as a ``wandb.Table``, the curves as
``wandb.plot.line_series`` and the PNGs (wandb is imported only then; offline unless the logger
config says otherwise). ``untimed`` says why a sweep timed nothing.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from sparseflash import masks
from sparseflash.bench import plots as plots_mod
from sparseflash.bench import report
from sparseflash.bench.spec import BenchConfig
from sparseflash.bench.sweep import count, sweep
from sparseflash.logging import console_fallback, output_dir

log = logging.getLogger(__name__)


class _Progress:
    """tqdm when installed (and progress is on), else one logged line per row."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.bar = total, 0, None
        self.enabled = enabled
        if enabled and sys.stderr.isatty():  # a bar in a log file is noise: print lines there
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc="bench", dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                pass

    def __call__(self, row: dict) -> None:
        self.done += 1
        if not self.enabled:
            return
        result = (f"{row['median_ms']:.4g} ms, {row['tflops']:.3g} TFLOP/s" if row["status"] == "ok"
                  else f"{row['status']}: {row['reason'][:90]}")
        line = (f"[{self.done}/{self.total}] {row['mode']} hd{row['head_dim']} {row['dtype']} S={row['shape']} "
                f"{row['pattern_label']} {row['backend']}: {result}")
        if self.bar is not None:
            with self.bar.external_write_mode():  # the line above the bar, not through it
                log.info(line)
            self.bar.update(1)
        else:
            log.info(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def log_wandb(rows: list[dict], pngs: list[Path], out_dir: Path, wandb_cfg: dict, config: dict) -> None:
    """The rows as a ``wandb.Table``, time-vs-S curves as ``line_series``, and the PNGs."""
    from sparseflash.logging import WandbSink

    sink = WandbSink(out_dir, config=config, **wandb_cfg)
    try:
        cols = report.columns(rows)
        table_rows = [[(None if isinstance(r.get(c), float) and math.isnan(r[c]) else r.get(c)) for c in cols]
                      for r in rows]
        sink.log_table("bench/results", cols, table_rows)
        for group in dict.fromkeys(report.group_key(r) for r in rows):
            mode, head_dim, dtype = group
            lines: dict[str, list] = {}
            for r in rows:
                if report.group_key(r) == group and r["status"] == "ok":
                    lines.setdefault(f"{r['pattern_label']} · {r['backend']}", []).append((r["seq_len"], r["median_ms"]))
            if not lines:
                continue
            keys = list(lines)
            xs = [[p[0] for p in sorted(lines[k])] for k in keys]
            ys = [[p[1] for p in sorted(lines[k])] for k in keys]
            title = f"time (ms) vs sequence length · {mode} · hd {head_dim} · {dtype}"
            plot = sink.wandb.plot.line_series(xs=xs, ys=ys, keys=keys, title=title, xname="seq_len")
            sink.run.log({f"bench/time_{mode}_hd{head_dim}_{dtype}": plot})
        for path in pngs:
            sink.run.log({f"bench/plots/{path.stem}": sink.wandb.Image(str(path))})
    finally:
        sink.close()


def untimed(rows: list[dict]) -> str | None:
    """None if some row was timed; else why none was: the rows by status and their distinct reasons."""
    if any(r["status"] == "ok" for r in rows):
        return None
    statuses = ", ".join(f"{n} {status}" for status, n in Counter(r["status"] for r in rows).items())
    reasons = list(dict.fromkeys(f"{r['backend']}: {r['reason']}" for r in rows))
    shown = "".join(f"\n  {reason}" for reason in reasons[:5])
    if len(reasons) > 5:
        shown += f"\n  ... and {len(reasons) - 5} more in results.csv"
    return f"no row was timed ({statuses or 'no rows'}):{shown}"


def run(cfg: Any) -> list[dict]:
    """Run the sweep ``cfg`` describes (see ``configs/bench.yaml``); returns the rows."""
    with console_fallback():
        return _run(cfg)


def _run(cfg: Any) -> list[dict]:
    masks.import_patterns(cfg.get("import_patterns") or [])
    spec = BenchConfig.from_cfg(cfg)
    env = report.environment(spec.torch_device())  # a device this machine lacks fails here
    if spec.plots.enabled:
        plots_mod.pyplot()  # and so does a missing matplotlib, not after the sweep
    out_dir = output_dir(spec.out_dir, "outputs/bench")
    out_dir.mkdir(parents=True, exist_ok=True)
    log.info(f"bench: {count(spec)} rows on {env['gpu']} (torch {env['torch']}, triton {env['triton']}) -> {out_dir}")
    stream = open(out_dir / "results.jsonl", "w", encoding="utf-8")
    progress = _Progress(count(spec), spec.progress)

    def on_row(row: dict) -> None:
        stream.write(json.dumps({k: report._jsonable(v) for k, v in row.items()}) + "\n")
        stream.flush()
        progress(row)

    try:
        rows = sweep(spec, env, on_row)
    finally:
        progress.close()
        stream.close()
    report.write_jsonl(rows, out_dir / "results.jsonl")
    report.write_csv(rows, out_dir / "results.csv")
    (out_dir / "results.md").write_text(report.markdown(rows, spec.backends, full=True))
    pngs = plots_mod.write_plots(rows, out_dir / "plots", spec.plots.combined) if spec.plots.enabled else []
    if spec.print_table:
        log.info(report.markdown(rows, spec.backends))
    if spec.wandb:
        log_wandb(rows, pngs, out_dir, spec.wandb, spec.as_dict())
    log.info(f"bench: wrote {out_dir / 'results.csv'}, results.jsonl, results.md and {len(pngs)} plots")
    return rows
