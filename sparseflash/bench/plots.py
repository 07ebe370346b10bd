"""PNG plots of a sweep (matplotlib, Agg): time against sequence length on log-log axes (one line
per pattern x backend) and speed-up over dense against density (with the ideal ``1/density``).

One figure per (mode, head_dim, dtype), or with ``combined`` one figure of each kind holding every
group as a panel (fewer files to browse). Groups without a timed row get no
figure or panel: an empty plot would only hide that nothing was measured."""

from __future__ import annotations

import math
from pathlib import Path

from sparseflash.bench.report import group_key

MARKERS = "osD^vP*Xhp<>"
STYLES = ["-", "--", ":", "-."]


def _title(group) -> str:
    mode, head_dim, dtype = group
    return f"{mode} · head_dim {head_dim} · {dtype}"


def _styles(rows):
    patterns = list(dict.fromkeys(r["pattern_label"] for r in rows))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    return ({p: f"C{i % 10}" for i, p in enumerate(patterns)},
            {b: (MARKERS[i % len(MARKERS)], STYLES[i % len(STYLES)]) for i, b in enumerate(backends)})


def _time_panel(ax, rows, colors, marks):
    lines = {}
    for r in rows:
        if r["status"] == "ok":
            lines.setdefault((r["pattern_label"], r["backend"]), []).append((r["seq_len"], r["median_ms"]))
    for (label, backend), pts in lines.items():
        pts.sort()
        marker, style = marks[backend]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colors[label], marker=marker, linestyle=style,
                label=f"{label} · {backend}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length")
    ax.set_ylabel("median time (ms)")
    ax.grid(True, which="both", alpha=0.3)
    return bool(lines)


def _speedup_panel(ax, rows, colors, marks):
    drawn = False
    densities = []
    for backend in dict.fromkeys(r["backend"] for r in rows):
        pts = [r for r in rows if r["backend"] == backend and r["status"] == "ok"
               and r["speedup_vs_dense"] == r["speedup_vs_dense"]]
        if not pts:
            continue
        marker, _ = marks[backend]
        ax.scatter([r["density"] for r in pts], [r["speedup_vs_dense"] for r in pts], marker=marker,
                   c=[colors[r["pattern_label"]] for r in pts], label=backend, alpha=0.8)
        for r in pts:
            ax.annotate(str(r["seq_len"]), (r["density"], r["speedup_vs_dense"]), fontsize=6, alpha=0.6)
        densities += [r["density"] for r in pts]
        drawn = True
    if densities:
        lo = max(min(densities) * 0.8, 1e-3)
        xs = [lo * (1.0 / lo) ** (i / 50) for i in range(51)]
        ax.plot(xs, [1 / x for x in xs], "k--", lw=0.8, label="ideal 1/density")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("mask density (fraction of scores computed)")
    ax.set_ylabel("speed-up over the same backend's dense")
    ax.grid(True, which="both", alpha=0.3)
    return drawn


def _legend_for_patterns(ax, colors):
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=c, marker="o", linestyle="", label=p) for p, c in colors.items()]
    return ax.legend(handles=handles, fontsize=7, title="pattern (colour)", loc="lower left")


def pyplot():
    """matplotlib's pyplot on the Agg backend (files, no display), or ImportError saying how to install it."""
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("the benchmark's plots need matplotlib: pip install 'sparseflash[plot]' "
                          "(or plots.enabled=false)") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(rows: list[dict], out_dir: str | Path, combined: bool = False) -> list[Path]:
    """Write the PNGs into ``out_dir`` (none, and no folder, when no row was timed); returns their paths."""
    groups = list(dict.fromkeys(group_key(r) for r in rows if r["status"] == "ok"))
    if not groups:
        return []
    plt = pyplot()

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    colors, marks = _styles(rows)
    written = []
    kinds = (("time", _time_panel), ("speedup", _speedup_panel))
    if combined:
        for kind, panel in kinds:
            n = len(groups)
            cols = min(n, 3)
            nrows = math.ceil(n / cols)
            fig, axes = plt.subplots(nrows, cols, figsize=(6.5 * cols, 5 * nrows), squeeze=False)
            for ax, group in zip(axes.flat, groups):
                panel(ax, [r for r in rows if group_key(r) == group], colors, marks)
                ax.set_title(_title(group))
            for ax in list(axes.flat)[n:]:
                ax.axis("off")
            _finish(axes.flat[0], kind, colors)
            path = out_dir / f"bench_{kind}.png"
            fig.savefig(path, dpi=110, bbox_inches="tight")
            plt.close(fig)
            written.append(path)
        return written
    for group in groups:
        mode, head_dim, dtype = group
        for kind, panel in kinds:
            fig, ax = plt.subplots(figsize=(7.5, 5.5))
            panel(ax, [r for r in rows if group_key(r) == group], colors, marks)
            ax.set_title(_title(group))
            _finish(ax, kind, colors)
            path = out_dir / f"{kind}_{mode}_hd{head_dim}_{dtype}.png"
            fig.savefig(path, dpi=110, bbox_inches="tight")
            plt.close(fig)
            written.append(path)
    return written


def _finish(ax, kind, colors):
    if not ax.get_legend_handles_labels()[0]:
        return
    if kind == "time":
        ax.legend(fontsize=7, loc="upper left", ncol=1)
    else:
        first = ax.legend(fontsize=7, title="backend (marker)", loc="upper right")
        ax.add_artist(first)
        _legend_for_patterns(ax, colors)
