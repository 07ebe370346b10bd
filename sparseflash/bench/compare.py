"""Compare two sweeps: ``python experiments/bench.py compare a/results.csv b/results.csv``.

Rows are matched on (mode, head_dim, dtype, shape, pattern, backend); the table gives both
medians and ``a/b`` (> 1: b is faster), then the geometric mean of ``a/b`` per backend.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from sparseflash.bench.report import read_rows

MATCH = ("mode", "head_dim", "dtype", "shape", "pattern_label", "backend")


def compare_rows(a: list[dict], b: list[dict], names: tuple[str, str] = ("a", "b")) -> tuple[list[dict], str]:
    """Matched rows ``{key..., a_ms, b_ms, speedup}`` and their markdown table."""
    index_b = {tuple(r[c] for c in MATCH): r for r in b}
    matched = []
    for ra in a:
        key = tuple(ra[c] for c in MATCH)
        rb = index_b.get(key)
        if rb is None:
            continue
        a_ms = ra["median_ms"] if ra["status"] == "ok" else math.nan
        b_ms = rb["median_ms"] if rb["status"] == "ok" else math.nan
        matched.append({**dict(zip(MATCH, key)), "a_status": ra["status"], "b_status": rb["status"],
                        "a_ms": a_ms, "b_ms": b_ms,
                        "speedup": a_ms / b_ms if a_ms == a_ms and b_ms == b_ms else math.nan})
    na, nb = names
    fmt = lambda x: "—" if x != x else f"{x:.4g}"  # noqa: E731
    lines = [f"| mode | head_dim | dtype | S | pattern | backend | {na} ms | {nb} ms | {na}/{nb} |",
             "|---|---:|---|---:|---|---|---:|---:|---:|"]
    for m in matched:
        a_cell = fmt(m["a_ms"]) if m["a_status"] == "ok" else m["a_status"]
        b_cell = fmt(m["b_ms"]) if m["b_status"] == "ok" else m["b_status"]
        lines.append(f"| {m['mode']} | {m['head_dim']} | {m['dtype']} | {m['shape']} | {m['pattern_label']} | "
                     f"{m['backend']} | {a_cell} | {b_cell} | {fmt(m['speedup'])} |")
    summary = []
    for backend in dict.fromkeys(m["backend"] for m in matched):
        ratios = [m["speedup"] for m in matched if m["backend"] == backend and m["speedup"] == m["speedup"]]
        if ratios:
            geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
            summary.append(f"- {backend}: geometric mean {na}/{nb} = {geo:.3f} over {len(ratios)} cases")
    only = len(a) - len(matched), len(b) - len(matched)
    text = "\n".join(lines) + "\n\n" + ("\n".join(summary) + "\n" if summary else "")
    text += f"\n{len(matched)} matched rows; {only[0]} only in {na}, {only[1]} only in {nb}.\n"
    return matched, text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.py compare", description=__doc__.splitlines()[0])
    parser.add_argument("a", help="results.csv / results.jsonl (or a run directory)")
    parser.add_argument("b", help="results.csv / results.jsonl (or a run directory)")
    parser.add_argument("--names", nargs=2, default=None, metavar=("A", "B"), help="column names")
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    names = tuple(args.names) if args.names else ("a", "b")
    _, text = compare_rows(read_rows(args.a), read_rows(args.b), names)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0
