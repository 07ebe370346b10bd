"""Pathfinder (LRA): a seeded generator cached to disk, and a loader for LRA's released
``pathfinder32/curv_contour_length_14/{imgs,metadata}`` layout.

An image holds two circular markers and several "snakes" — curved contours made of short
paddles with gaps. Label 1: the markers sit at the two ends of one snake; label 0: each marker
ends a different snake. Distractor snakes (shorter) clutter the image. The defaults follow LRA's
pathfinder32 "hard" set (``contour_length=14``, ``paddle_length=2``, ``paddle_margin=1``,
``marker_radius=1.5``, ``distractor_length=14 // 3``, ``num_distractors=20 // distractor_length``,
``continuity=1.0``, anti-aliasing 2x). Pixels are grey levels 0-255 read row by row into a
sequence of ``size * size`` tokens (id = level + 1).

Released metadata: ``metadata/<n>.npy`` are text files, one image a line, space-separated:
``imgs/<n> sample_<k>.png <...> <label> ...`` (directory, file name, ..., label in column 4).
"""

from __future__ import annotations

import glob
import json
import math
import os
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from sparseflash.data.common import SequenceDataset, TaskData, require, seeded_split

LAYOUT = """<task.data_dir>/                    (LRA's lra_release/pathfinder32/)
  curv_contour_length_14/
    imgs/<n>/sample_<k>.png          grey-level PNG images, 32x32
    metadata/<n>.npy                 text: "imgs/<n> sample_<k>.png <x> <label> ..." a line"""

DEFAULTS = dict(contour_length=14, paddle_length=2, paddle_margin=1, marker_radius=1.5, continuity=1.0,
                antialias=2, contrast=0.75)


def _draw_segment(canvas: np.ndarray, p0, p1, value: float, width: float) -> None:
    """Anti-aliased-ish thick segment onto a (super-sampled) canvas, in place (max blend)."""
    n = max(2, int(math.hypot(p1[0] - p0[0], p1[1] - p0[1]) * 3) + 1)
    t = np.linspace(0.0, 1.0, n)
    ys, xs = p0[0] + (p1[0] - p0[0]) * t, p0[1] + (p1[1] - p0[1]) * t
    r = int(math.ceil(width))
    for dy in range(-r, r + 1):
        for dx in range(-r, r + 1):
            if dy * dy + dx * dx > width * width:
                continue
            yy, xx = np.round(ys + dy).astype(int), np.round(xs + dx).astype(int)
            ok = (yy >= 0) & (yy < canvas.shape[0]) & (xx >= 0) & (xx < canvas.shape[1])
            np.maximum.at(canvas, (yy[ok], xx[ok]), value)


def _snake(rng: np.random.Generator, size: float, n_paddles: int, paddle: float, gap: float,
           continuity: float, margin: float, tries: int = 20):
    """Points ``[a0, b0, a1, b1, ...]`` (paddle ends, ``np.array([y, x])``) of a smooth random
    contour inside the image. A paddle that would leave the image turns away from the edge."""
    lo, hi = margin, size - margin
    for _ in range(tries):
        y, x = rng.uniform(lo, hi, 2)
        angle = rng.uniform(0, 2 * math.pi)
        turns = rng.uniform(-1, 1, n_paddles) * continuity * math.pi / 6
        pts = []
        for k in range(n_paddles):
            for bend in (0.0, 0.5, -0.5, 1.0, -1.0, 1.5, -1.5, 2.0, -2.0, 3.0):
                a = angle + turns[k] + bend * math.pi / 4
                dy, dx = math.sin(a), math.cos(a)
                ey, ex = y + dy * paddle, x + dx * paddle
                if lo <= ey <= hi and lo <= ex <= hi:
                    break
            else:
                break
            angle = a
            pts += [np.array([y, x]), np.array([ey, ex])]
            y, x = min(max(ey + dy * gap, lo), hi), min(max(ex + dx * gap, lo), hi)
        if len(pts) == 2 * n_paddles:
            return pts
    return None


def render(rng: np.random.Generator, label: int, size: int = 32, contour_length: int = 14,
           paddle_length: float = 2, paddle_margin: float = 1, marker_radius: float = 1.5,
           continuity: float = 1.0, antialias: int = 2, contrast: float = 0.75,
           distractor_length: int | None = None, num_distractors: int | None = None) -> np.ndarray:
    """One Pathfinder image, uint8 ``(size, size)``; ``label`` 1 = the markers are connected."""
    distractor_length = distractor_length or max(1, contour_length // 3)
    num_distractors = 20 // distractor_length if num_distractors is None else num_distractors
    s = antialias
    big = size * s
    scale = size / 32.0  # LRA's lengths are for 32x32; larger images keep the same shapes, scaled
    paddle, gap = paddle_length * s * scale, paddle_margin * s * scale
    width, radius = 0.5 * s * max(1.0, scale), marker_radius * s * scale
    margin = radius + 1
    while True:
        canvas = np.zeros((big, big), dtype=np.float32)
        snakes = [_snake(rng, big, contour_length, paddle, gap, continuity, margin) for _ in range(2)]
        if any(sn is None for sn in snakes):
            continue
        for sn in snakes:
            for a, b in zip(sn[0::2], sn[1::2]):
                _draw_segment(canvas, a, b, contrast, width)
        for _ in range(num_distractors):
            sn = _snake(rng, big, distractor_length, paddle, gap, continuity, margin)
            if sn is not None:
                for a, b in zip(sn[0::2], sn[1::2]):
                    _draw_segment(canvas, a, b, contrast, width)
        ends = [snakes[0][0], snakes[0][-1]] if label else [snakes[0][0], snakes[1][-1]]
        if np.hypot(*(ends[0] - ends[1])) < 4 * radius:
            continue  # markers too close to tell apart
        yy, xx = np.mgrid[0:big, 0:big]
        for cy, cx in ends:
            canvas[(yy - cy) ** 2 + (xx - cx) ** 2 <= radius ** 2] = 1.0
        img = canvas.reshape(size, s, size, s).mean(axis=(1, 3))
        return np.clip(img * 255.0 + 0.5, 0, 255).astype(np.uint8)


def _render_chunk(args):
    seed, count, size, params = args
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, count)
    return np.stack([render(rng, int(y), size, **params) for y in labels]), labels


def generate(num: int, size: int = 32, seed: int = 0, workers: int | None = None, chunk: int = 500,
             **params) -> tuple[np.ndarray, np.ndarray]:
    """``num`` images ``uint8 (num, size, size)`` and labels, seeded (independent of ``workers``)."""
    params = {**DEFAULTS, **params}
    jobs = [(seed * 1_000_003 + c, min(chunk, num - c * chunk), size, params) for c in range(-(-num // chunk))]
    workers = workers or min(16, os.cpu_count() or 1)
    if workers > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(min(workers, len(jobs))) as pool:
            parts = list(pool.map(_render_chunk, jobs))
    else:
        parts = [_render_chunk(j) for j in jobs]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def load_generated(data_dir: str | os.PathLike, num: int, size: int, seed: int, params: dict):
    """Images from the disk cache ``data_dir/generated_<size>_<n>_seed<seed>.npz`` (made once)."""
    path = Path(data_dir) / f"generated_{size}_{num}_seed{seed}.npz"
    meta = json.dumps({**DEFAULTS, **params}, sort_keys=True)
    if path.exists():
        with np.load(path) as f:
            if str(f["params"]) == meta:
                return f["images"], f["labels"]
        warnings.warn(f"{path} was made with other parameters; regenerating")
    print(f"generating {num} Pathfinder {size}x{size} images into {path} ...", flush=True)
    images, labels = generate(num, size, seed, **params)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}.npz")
    np.savez_compressed(tmp, images=images, labels=labels, params=np.array(meta))
    os.replace(tmp, path)
    return images, labels


def load_released(root: str | os.PathLike) -> tuple[list[np.ndarray], list[int]]:
    """Images and labels listed in ``root/metadata/*.npy``; unreadable images are skipped with a
    warning (the release has a few)."""
    from PIL import Image  # pillow: only needed for the released PNGs

    root = Path(root)
    images, labels, bad = [], [], []
    for meta in sorted(glob.glob(str(root / "metadata" / "*.npy"))):
        for line in Path(meta).read_text().splitlines():
            parts = line.split(" ")
            if len(parts) < 4:
                continue
            path = root / parts[0] / parts[1]
            try:
                with Image.open(path) as im:
                    images.append(np.asarray(im.convert("L"), dtype=np.uint8))
                labels.append(int(parts[3]))
            except Exception as err:  # a truncated or missing PNG
                bad.append(f"{path} ({type(err).__name__})")
    if bad:
        warnings.warn(f"skipped {len(bad)} unreadable Pathfinder images, e.g. {bad[:3]}")
    return images, labels


def build(cfg, seed: int = 0) -> TaskData:
    """``cfg``: the ``task`` config (data_dir, size, difficulty, generate, num, splits)."""
    size = int(cfg.get("size", 32))
    data_dir = Path(cfg.data_dir)
    if cfg.get("generate", False):
        images, labels = load_generated(data_dir, int(cfg.num), size, int(cfg.get("data_seed", 0)),
                                        dict(cfg.get("generator") or {}))
        images = list(images)
    else:
        root = data_dir / str(cfg.get("difficulty", "curv_contour_length_14"))
        require("Pathfinder", [root / "metadata"], LAYOUT,
                hint="Or generate it with task.generate=true (cached in task.data_dir).")
        images, labels = load_released(root)
        if not images:
            raise ValueError(f"no readable Pathfinder images listed in {root / 'metadata'}")
    seqs = [img.reshape(-1).astype(np.int16) + 1 for img in images]
    full = SequenceDataset(seqs, labels)
    fractions = list(cfg.get("splits", [0.8, 0.1, 0.1]))
    tr, va, te = seeded_split(len(full), [float(fractions[0]), float(fractions[1]), -1], int(cfg.get("split_seed", 0)))
    return TaskData("pathfinder", full.subset(tr), full.subset(va), full.subset(te), num_classes=2,
                    vocab_size=257, max_len=max(len(s) for s in seqs), info={"majority": full.subset(te).majority()})
