"""Outputs of a sweep: the environment columns, ``results.csv`` / ``results.jsonl`` and the markdown table."""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import socket
import statistics
import subprocess
from pathlib import Path
from typing import Iterable

import torch

from sparseflash.atomic_write import replacing


def environment(device: torch.device) -> dict:
    """GPU, versions and host, added to every row."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - no triton on this platform
        triton_version = ""
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=5, cwd=Path(__file__).resolve().parent).stdout.strip()
    except Exception:  # noqa: BLE001
        git = ""
    import sparseflash

    return {
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu"),
        "torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda or "",
        "cudnn": str(torch.backends.cudnn.version() or "") if device.type == "cuda" else "",
        "python": platform.python_version(), "hostname": socket.gethostname(),
        "sparseflash": sparseflash.__version__, "git": git,
    }


def columns(rows: Iterable[dict]) -> list[str]:
    out: dict[str, None] = {}
    for r in rows:
        out.update(dict.fromkeys(r))
    return list(out)


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_jsonl(rows: list[dict], path: str | os.PathLike) -> None:
    with replacing(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps({k: _jsonable(v) for k, v in r.items()}) + "\n")


def write_csv(rows: list[dict], path: str | os.PathLike) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns(rows))
        writer.writeheader()
        for r in rows:
            writer.writerow({k: ("" if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()})


def _number(text: str):
    if text in ("", None):
        return math.nan
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


NUMERIC = {"head_dim", "seq_len", "kv_len", "batch", "heads", "kv_heads", "block", "density", "flops", "median_ms",
           "p20_ms", "p80_ms", "repeats", "first_call_ms", "compiled_kernels", "cached_kernels", "dynamo_graphs",
           "tflops", "speedup_vs_dense", "dropout_p", "dropout_cost", "check_err", "peak_mem_mb",
           "key_lengths_mean"}


def _with_shape(row: dict) -> dict:
    """Rows written before shapes had labels: a square shape, named by its length."""
    row.setdefault("shape", str(row["seq_len"]))
    return row


def read_rows(path: str | os.PathLike) -> list[dict]:
    """Rows of a ``results.csv`` or ``results.jsonl`` (numbers as numbers, missing as NaN)."""
    path = Path(path)
    if path.is_dir():
        path = path / "results.csv"
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [_with_shape({k: (math.nan if v is None and (k in NUMERIC or k.startswith("speedup_vs_")) else v)
                             for k, v in r.items()}) for r in rows]
    with open(path, newline="", encoding="utf-8") as f:
        return [_with_shape({k: (_number(v) if k in NUMERIC or k.startswith("speedup_vs_") else v)
                             for k, v in r.items()}) for r in csv.DictReader(f)]


# ---------------------------------------------------------------------------- markdown
def _fmt(x: float, digits: int = 3) -> str:
    if x != x:
        return "—"
    return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:.0f}"


def group_key(r: dict) -> tuple:
    return (r["mode"], r["head_dim"], r["dtype"])


def _first_calls(rows: list[dict], backends: list[str]) -> list[str]:
    """Per backend: its rows' first-call seconds (median, max) and what those calls compiled."""
    lines = ["", "First calls (seconds; compiles, JIT and torch.compile included; a kernel variant an earlier "
                 "row compiled costs later rows nothing):", "",
             "| backend | rows | median s | max s | Triton kernels compiled | from Triton's cache | Dynamo graphs |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for backend in backends:
        timed = [r for r in rows if r["backend"] == backend and r["first_call_ms"] == r["first_call_ms"]]
        if not timed:
            continue
        seconds = sorted(r["first_call_ms"] / 1e3 for r in timed)
        totals = [sum(int(r.get(c, 0) or 0) for r in timed if r.get(c) == r.get(c))
                  for c in ("compiled_kernels", "cached_kernels", "dynamo_graphs")]
        lines.append(f"| {backend} | {len(timed)} | {_fmt(statistics.median(seconds))} | {_fmt(seconds[-1])} | "
                     + " | ".join(map(str, totals)) + " |")
    return lines


def _dropout_costs(rows: list[dict], backends: list[str]) -> list[str]:
    """Per case with dropout: each backend's time with it / its time without it (``dropout_cost``)."""
    costly = [r for r in rows if not math.isnan(r.get("dropout_cost", math.nan))]
    if not costly:
        return []
    lines = ["", "Dropout's cost (time with dropout / the same backend's time without it):", "",
             "| mode | head_dim | S | pattern | " + " | ".join(backends) + " |",
             "|---|---:|---:|---|" + "---:|" * len(backends)]
    cost = {(r["mode"], r["head_dim"], r["shape"], r["pattern_label"], r["backend"]): r["dropout_cost"]
            for r in costly}
    for case in dict.fromkeys(key[:4] for key in cost):
        cells = [f"{_fmt(cost[(*case, b)], 3)}×" if (*case, b) in cost else "—" for b in backends]
        lines.append("| " + " | ".join(str(part) for part in case) + " | " + " | ".join(cells) + " |")
    return lines


def markdown(rows: list[dict], backends: list[str] | None = None, full: bool = False) -> str:
    """Per (mode, head_dim, dtype): rows ``S x pattern``, one column per backend with
    ``median ms (TFLOP/s, speed-up over that backend's dense)``; then the skips and failures. With
    ``full``, also every row."""
    backends = backends or list(dict.fromkeys(r["backend"] for r in rows))
    by_key = {(group_key(r), r["shape"], r["pattern_label"], r["backend"]): r for r in rows}
    padded = any(not math.isnan(r.get("key_lengths_mean", math.nan)) for r in rows)
    lines = ["cells: median ms (TFLOP/s, speed-up over the same backend's dense); "
             "skipped —, failed the correctness gate WRONG, crashed ERROR"
             + ("; S (keys N): padded batches, N keys on average" if padded else "")]
    for group in dict.fromkeys(group_key(r) for r in rows):
        mode, head_dim, dtype = group
        first = next(r for r in rows if group_key(r) == group)
        lines += ["", f"### {mode} · head_dim {head_dim} · {dtype} · {first['heads']} heads · "
                      f"{first['batch'] * first['seq_len']} tokens · {first.get('gpu', '')}", "",
                  "| S | pattern | density | " + " | ".join(backends) + " |",
                  "|---:|---|---:|" + "---:|" * len(backends)]
        for shape in dict.fromkeys(r["shape"] for r in rows if group_key(r) == group):
            for label in dict.fromkeys(r["pattern_label"] for r in rows if group_key(r) == group):
                cells = []
                density = math.nan
                for b in backends:
                    r = by_key.get((group, shape, label, b))
                    if r is None:
                        cells.append("")
                        continue
                    density = r["density"]
                    if r["status"] == "ok":
                        cells.append(f"{_fmt(r['median_ms'])} ({_fmt(r['tflops'])}, {_fmt(r['speedup_vs_dense'], 2)}×)")
                    else:
                        cells.append({"skipped": "—", "wrong": "WRONG", "error": "ERROR"}.get(r["status"], r["status"]))
                lines.append(f"| {shape} | {label} | {density:.3f} | " + " | ".join(cells) + " |")
    lines += _dropout_costs(rows, backends)
    lines += _first_calls(rows, backends)
    problems: dict[tuple, int] = {}
    for r in rows:
        if r["status"] != "ok":
            key = (r["status"], r["backend"], r["pattern_label"] if r["status"] != "skipped" or "mask" in r["reason"] else "*",
                   r["reason"])
            problems[key] = problems.get(key, 0) + 1
    if problems:
        lines += ["", "Not timed:"]
        for (status, backend, label, reason), n in problems.items():
            lines.append(f"- {status}: {backend} × {label} ({n} rows): {reason}")
    if full:
        cols = ["mode", "head_dim", "dtype", "shape", "batch", "pattern_label", "density", "backend", "impl",
                "status", "median_ms", "p20_ms", "p80_ms", "tflops", "speedup_vs_dense", "dropout_cost",
                "first_call_ms", "compiled_kernels", "cached_kernels", "dynamo_graphs", "peak_mem_mb", "check_against",
                "check_err"]
        cols += [c for c in columns(rows) if c.startswith("speedup_vs_") and c != "speedup_vs_dense"]
        lines += ["", "### All rows", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in rows:
            cells = [(_fmt(r.get(c, math.nan), 4) if isinstance(r.get(c), float) else str(r.get(c, ""))) for c in cols]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
