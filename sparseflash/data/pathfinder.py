"""Pathfinder (LRA): a seeded generator cached to disk, and a loader for LRA's released
``pathfinder32/curv_contour_length_14/{imgs,metadata}`` layout.

An image holds two circular markers and several "snakes": dashed contours, chains of short straight
paddles separated by gaps. Label 1: the markers sit at the two ends of one snake; label 0: each
marker ends a different snake. Shorter distractor snakes clutter the image. Pixels are grey levels
0-255 read row by row into a sequence of ``size * size`` tokens (id = level + 1).

The generator re-implements the one LRA's images came from (Linsley et al. 2018; github
drewlinsley/pathfinder, ``snakes2.py`` and ``snakes.py``) with LRA's pathfinder32 settings (listed in
lra_benchmarks/data/pathfinder.py): ``contour_length=14`` paddles, ``paddle_length=2``,
``paddle_margin=1``, ``paddle_thickness=0.5``, ``marker_radius=1.5``, ``seed_distance=7``,
``continuity=1.0``, ``padding=1``, anti-aliasing 2x, ``distractor_length=14 // 3``,
``num_distractors=20 // distractor_length``, ``paddle_contrast_list=[0.75]``,
``snake_contrast_list=[2]``. As there:

* The two target snakes start near the centre, ``seed_distance`` apart, and grow (in turn) paddle by
  paddle from that end. A paddle starts ``2 * paddle_margin`` after the end of the previous one (the
  gap; it turns at its middle), turned by an angle drawn with weight ``cos(min(|turn| * continuity,
  pi/2))**2``.
* Nothing touches: every paddle, with the gap before it, must stay on the image, off a ``padding``
  border and more than ``max(1, paddle_margin)`` pixels away from everything drawn (markers included)
  except the paddle it follows. Turns that would not are not drawn; when none is left the snake
  takes paddles back and grows them again (the n-th dead end in a row takes n back; the original
  starts the snakes again instead), and after ``2 * contour_length`` dead ends both target snakes
  start again. A distractor is tried 5 times, then left out.
* One marker is at the start of target snake A, the other at the far end of A (label 1) or of B
  (label 0); room for a marker is kept at all four ends.

Differences: the test that nothing touches is made on the output pixels, exactly: a pixel counts as
used when a super-sampled pixel of a stroke (the gaps included) falls into it, so distinct contours
are never 8-connected, not even with the gaps drawn (``render(..., closed=True)`` draws them; the
placement and random draws are the same). The original compares masks resized with a lanczos filter
(``mask + new < 1.8``), which lets contours come closer. Strokes are drawn one fine pixel wide on
the 2x grid and box-filtered (the original: PIL lines, lanczos); a paddle's ink is as long as the
paddle, half a fine pixel short of its end points at each end (they still count as used). Lengths
are given for 32x32 and scale with ``size / 32``. The original's single-paddle distractors (off in
its wrapper) are left out.

Intensities follow the original's: the two target snakes are drawn at ``contrast * snake_contrast``
(its paddle contrast times its snake contrast, 0.75 * 2 in LRA's run), the distractors at
``snake_contrast`` alone (``make_many_snakes`` is given the snake contrasts only), the markers at 1
(kept where brighter, as its ``np.maximum``), and the image is scaled so that its brightest pixel is
255 (the byte scaling of scipy's ``imsave``, which wrote LRA's images). So the target contours are
three quarters as bright as the distractors: a cue that the images carry.

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

from sparseflash.atomic_write import replacing
from sparseflash.data.common import SequenceDataset, TaskData, require, seeded_split

LAYOUT = """<task.data_dir>/                    (LRA's lra_release/pathfinder32/)
  curv_contour_length_14/
    imgs/<n>/sample_<k>.png          grey-level PNG images, 32x32
    metadata/<n>.npy                 text: "imgs/<n> sample_<k>.png <x> <label> ..." a line"""

DEFAULTS = dict(contour_length=14, paddle_length=2, paddle_margin=1, paddle_thickness=0.5, marker_radius=1.5,
                seed_distance=7, continuity=1.0, padding=1, antialias=2, contrast=0.75, snake_contrast=2.0)
# The generator's version, part of the disk cache's key: raise it whenever the images it draws change
VERSION = 3

_OWN = 1            # a paddle may come near this many paddles before it on its own snake
_TURNS = 16         # candidate turns for each paddle
_SEEDS = 16         # candidate first paddles for each snake
_DISTRACTOR_TRIES = 5
_TARGET_TRIES = 1000


def _disc(radius: float) -> np.ndarray:
    """Integer offsets ``(n, 2)`` within ``radius`` of the origin."""
    r = int(math.floor(radius))
    dy, dx = np.mgrid[-r:r + 1, -r:r + 1]
    keep = dy * dy + dx * dx <= radius * radius + 1e-9
    return np.stack([dy[keep], dx[keep]], -1)


def _unit(a) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    return np.stack([np.sin(a), np.cos(a)], -1)


class _Scene:
    """One image under construction. Points are ``(y, x)`` on the super-sampled grid (``s`` pixels
    an output pixel; pixel ``i`` covers ``[i - 1/2, i + 1/2)``). A snake is a list of units
    ``[head, angle, id]``: a paddle ending at ``head``, with the gap before it (and the marker at an
    end of a target snake). ``cover`` (the output grid with a frame of ``reach`` pixels, flattened)
    counts, for each pixel, the units whose pixels, grown by ``clear`` pixels, reach it; the border
    and the frame count as many."""

    BORDER = 1 << 20

    def __init__(self, size: int, s: int, pad: int, clear: int, paddle: float, half_gap: float,
                 brush: np.ndarray, disc: np.ndarray, reach: int):
        self.size, self.s, self.paddle, self.half_gap = size, s, paddle, half_gap
        self.brush, self.disc = brush, disc
        self.width = w = size + 2 * reach
        self.origin = reach * w + reach  # flat index of output pixel (0, 0)
        cover = np.full((w, w), self.BORDER, np.int32)
        pad = max(1, pad)
        cover[reach + pad:reach + size - pad, reach + pad:reach + size - pad] = 0
        self.cover = cover.reshape(-1)
        self.scratch = np.zeros_like(self.cover)
        r = np.arange(-clear, clear + 1)
        self.near = (r[:, None] * w + r[None, :]).reshape(-1)
        self.units = 0
        self.grown: dict[int, np.ndarray] = {}                       # id -> flat indices it reaches
        self.strokes: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # id -> (inked, other) pixels
        # the points of a unit: head + a * (old direction) + b * (new direction): the gap, then the paddle
        m_gap, m_pad = int(math.ceil(2 * half_gap)) + 1, int(math.ceil(2 * paddle)) + 1  # steps <= 1/2 pixel
        t_gap, self.t_pad = np.linspace(0, half_gap, m_gap), np.linspace(0, paddle, m_pad)
        if half_gap > 0:
            self.a = np.concatenate([t_gap, np.full(m_gap + m_pad, half_gap)])
            self.b = np.concatenate([np.zeros(m_gap), t_gap, half_gap + self.t_pad])
        else:
            self.a, self.b = np.zeros(m_pad), self.t_pad
        # inked: the paddle's points less half a pixel at each end (so that a paddle of length L
        # covers L pixels, not L + 1); the ends still count as occupied
        ink = (self.t_pad >= 0.5 - 1e-9) & (self.t_pad <= paddle - 0.5 + 1e-9)
        self.ink_seed = np.repeat(ink, len(brush))
        self.ink = np.repeat(np.concatenate([np.zeros(len(self.a) - m_pad, bool), ink]), len(brush))

    def pixels(self, pts: np.ndarray) -> np.ndarray:
        """Super-sampled pixels ``(K, m * len(brush), 2)`` under the points ``pts`` ``(K, m, 2)``."""
        pix = np.floor(pts + 0.5).astype(np.int64)
        if len(self.brush) > 1:
            pix = (pix[:, :, None, :] + self.brush).reshape(len(pix), -1, 2)
        return pix

    def marker(self, centres) -> np.ndarray:
        """Pixels ``(K, n, 2)`` of markers at ``centres`` ``(K, 2)``."""
        return np.floor(np.asarray(centres) + 0.5).astype(np.int64)[:, None, :] + self.disc

    def flat(self, pix: np.ndarray) -> np.ndarray:
        """Flat ``cover`` indices of the output pixels holding super-sampled pixels ``pix``."""
        f = pix // self.s
        return f[..., 0] * self.width + f[..., 1] + self.origin

    def fits(self, idx: np.ndarray, allowed=()) -> np.ndarray:
        """``(K,)``: candidate ``k`` (output pixels ``idx[k]``) lies on the image, off the border, and
        farther than ``clear`` pixels (Chebyshev) from every unit but those ``allowed``."""
        hits = self.cover[idx]
        if allowed:
            mine = self.scratch
            for uid in allowed:
                mine[self.grown[uid]] += 1
            hits = hits - mine[idx]
            for uid in allowed:
                mine[self.grown[uid]] = 0
        return ~hits.any(1)

    def commit(self, pix: np.ndarray, ink: np.ndarray, idx: np.ndarray) -> int:
        grown = (idx[:, None] + self.near).reshape(-1)
        self.cover[grown] += 1  # once a pixel, however often it is listed (so for -= below)
        self.units += 1
        self.grown[self.units] = grown
        self.strokes[self.units] = (pix[ink], pix[~ink])
        return self.units

    def remove(self, uid: int) -> None:
        self.cover[self.grown.pop(uid)] -= 1
        del self.strokes[uid]

    def seed(self, rng, tails, marker: bool, last: bool):
        """A snake's first paddle from the first of the candidate ``tails`` ``(K, 2)`` where it fits
        (a random direction each); None if none does."""
        angle = rng.uniform(-math.pi, math.pi, len(tails))
        d = _unit(angle)
        pix = self.pixels(tails[:, None, :] + self.t_pad[None, :, None] * d[:, None, :])
        heads = tails + self.paddle * d
        extra = ([self.marker(tails)] + ([self.marker(heads)] if last else [])) if marker else []
        idx = self.flat(np.concatenate([pix] + extra, 1))
        ok = self.fits(idx)
        if not ok.any():
            return None
        k = int(np.argmax(ok))
        return [[heads[k], angle[k], self.commit(pix[k, :len(self.ink_seed)], self.ink_seed, idx[k])]], tails[k]

    def extend(self, rng, snake, continuity: float, marker: bool) -> bool:
        """Append a paddle to ``snake``: one of ``_TURNS`` turns that fit, drawn with weight
        ``cos(min(|turn| * continuity, pi/2))**2``; with ``marker``, one at its head. False if none fits."""
        head, angle, _ = snake[-1]
        span = math.pi if continuity <= 0.5 else math.pi / (2 * continuity)
        turn = ((np.arange(_TURNS) + rng.random()) / _TURNS - 0.5) * (2 * span)
        weight = np.cos(np.minimum(np.abs(turn) * continuity, math.pi / 2)) ** 2
        new = turn + angle
        d = np.empty((_TURNS, 2))
        np.sin(new, out=d[:, 0])
        np.cos(new, out=d[:, 1])
        base = head + self.a[:, None] * np.array([math.sin(angle), math.cos(angle)])
        pix = self.pixels(base + self.b[:, None] * d[:, None, :])
        end = base[-1] + (self.half_gap + self.paddle) * d
        if marker:
            pix = np.concatenate([pix, self.marker(end)], 1)
        idx = self.flat(pix)
        weight *= self.fits(idx, allowed=[unit[2] for unit in snake[-_OWN:]])
        total = weight.sum()
        if total <= 1e-12:
            return False
        k = min(int(np.searchsorted(np.cumsum(weight), rng.random() * total, side="right")), _TURNS - 1)
        snake.append([end[k], new[k], self.commit(pix[k, :len(self.ink)], self.ink, idx[k])])
        return True

    def grow(self, rng, snake, length: int, continuity: float, marker: bool, budget: list) -> bool:
        """Extend ``snake`` to ``length`` paddles (``marker`` at the far end). The n-th dead end in a
        row takes the last n paddles back (``budget[0]`` dead ends in all, then False)."""
        dead = 0
        while len(snake) < length:
            if self.extend(rng, snake, continuity, marker and len(snake) == length - 1):
                continue
            if budget[0] <= 0 or len(snake) < 2:
                return False
            budget[0] -= 1
            dead += 1
            for _ in range(min(dead, len(snake) - 1)):
                self.remove(snake.pop()[2])
        return True


def render(rng: np.random.Generator, label: int, size: int = 32, contour_length: int = 14,
           paddle_length: float = 2, paddle_margin: float = 1, paddle_thickness: float = 0.5,
           marker_radius: float = 1.5, seed_distance: float = 7, continuity: float = 1.0, padding: int = 1,
           antialias: int = 2, contrast: float = 0.75, snake_contrast: float = 2.0,
           distractor_length: int | None = None, num_distractors: int | None = None, closed: bool = False,
           with_markers: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """One Pathfinder image, uint8 ``(size, size)``; ``label`` 1 = the markers are connected.
    ``closed=True`` also draws the gaps between paddles (same random draws, same placement: each
    contour is then one connected stroke; for checking the generator). ``with_markers=True`` returns
    ``(image, markers)``, ``markers`` the bool ``(size, size)`` mask of the pixels the markers touch."""
    distractor_length = distractor_length or max(1, contour_length // 3)
    num_distractors = 20 // distractor_length if num_distractors is None else num_distractors
    s = int(antialias)
    big = size * s
    unit = s * size / 32.0  # LRA's lengths are for 32x32; larger images keep the same shapes, scaled
    paddle, half_gap = paddle_length * unit, paddle_margin * unit
    radius, distance, width = marker_radius * unit, seed_distance * unit, paddle_thickness * unit
    clear = max(1, int(round(paddle_margin * unit / s)))
    reach = int(math.ceil((2 * half_gap + paddle + width + radius + distance) / s)) + clear + 2
    geometry = dict(size=size, s=s, pad=int(round(padding * unit / s)), clear=clear, paddle=paddle,
                    half_gap=half_gap, brush=_disc(width / 2), disc=_disc(radius), reach=reach)
    lo = min(2 * distance, big / 2 - 1)  # the first target snake starts near the centre
    n = contour_length
    for _ in range(_TARGET_TRIES):
        scene = _Scene(**geometry)
        a = scene.seed(rng, rng.uniform(lo, big - lo, (_SEEDS, 2)), True, n == 1)
        if a is None:
            continue
        b = scene.seed(rng, a[1] + distance * _unit(rng.uniform(0, 2 * math.pi, _SEEDS)), True, n == 1)
        if b is None:
            continue
        budget = [2 * n]
        if all(scene.grow(rng, sn[0], k, continuity, k == n, budget) for k in range(2, n + 1) for sn in (a, b)):
            break
    else:
        raise RuntimeError(f"could not place two Pathfinder contours of {n} paddles in {size}x{size}")
    for _ in range(num_distractors):
        for _ in range(_DISTRACTOR_TRIES):
            sn = scene.seed(rng, rng.uniform(0, big, (_SEEDS, 2)), False, False)
            if sn is not None and scene.grow(rng, sn[0], distractor_length, continuity, False, [distractor_length]):
                break
            for part in sn[0] if sn else []:
                scene.remove(part[2])
    targets = {part[2] for snake in (a[0], b[0]) for part in snake}  # the units of the two target snakes
    canvas = np.zeros((big, big), dtype=np.float32)
    for uid, (inked, other) in scene.strokes.items():
        level = snake_contrast * (contrast if uid in targets else 1.0)
        canvas[inked[:, 0], inked[:, 1]] = level
        if closed:
            canvas[other[:, 0], other[:, 1]] = level
    first = int(rng.integers(0, 2))
    ends = [(a, b)[first][1], (a, b)[first if label else 1 - first][0][-1][0]]
    marks = scene.marker(np.stack(ends)).reshape(-1, 2)
    canvas[marks[:, 0], marks[:, 1]] = np.maximum(canvas[marks[:, 0], marks[:, 1]], 1.0)
    img = canvas.reshape(size, s, size, s).mean(axis=(1, 3))
    img = np.clip(img * (255.0 / img.max()) + 0.5, 0, 255).astype(np.uint8)
    if not with_markers:
        return img
    markers = np.zeros((size, size), dtype=bool)
    markers[marks[:, 0] // s, marks[:, 1] // s] = True
    return img, markers


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
    workers = workers or os.cpu_count() or 1
    if workers > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(min(workers, len(jobs))) as pool:
            parts = list(pool.map(_render_chunk, jobs))
    else:
        parts = [_render_chunk(j) for j in jobs]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def load_generated(data_dir: str | os.PathLike, num: int, size: int, seed: int, params: dict):
    """Images from the disk cache ``data_dir/generated_<size>_<n>_seed<seed>.npz`` (made once)."""
    path = Path(data_dir) / f"generated_{size}_{num}_seed{seed}.npz"
    meta = json.dumps({"version": VERSION, **DEFAULTS, **params}, sort_keys=True)
    if path.exists():
        with np.load(path) as f:
            if str(f["params"]) == meta:
                return f["images"], f["labels"]
        warnings.warn(f"{path} was made with other parameters; regenerating")
    print(f"generating {num} Pathfinder {size}x{size} images into {path} ...", flush=True)
    images, labels = generate(num, size, seed, **params)
    with replacing(path, suffix=".npz") as tmp:
        np.savez_compressed(tmp, images=images, labels=labels, params=np.array(meta))
    return images, labels


def load_released(root: str | os.PathLike) -> tuple[list[np.ndarray], list[int]]:
    """Images and labels listed in ``root/metadata/*.npy``; unreadable images are skipped with a
    warning (the release has a few)."""
    try:
        from PIL import Image  # pillow: only needed for the released PNGs
    except ImportError as err:
        raise ImportError("the released Pathfinder images need pillow: pip install 'sparseflash[lra]'") from err

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


def build(cfg) -> TaskData:
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
    shapes = {img.shape for img in images}
    side = shapes.pop()[0] if len(shapes) == 1 and images[0].shape[0] == images[0].shape[1] else None
    full = SequenceDataset(seqs, labels)
    fractions = list(cfg.get("splits", [0.8, 0.1, 0.1]))
    tr, va, te = seeded_split(len(full), [float(fractions[0]), float(fractions[1]), -1], int(cfg.get("split_seed", 0)))
    return TaskData("pathfinder", full.subset(tr), full.subset(va), full.subset(te), num_classes=2,
                    vocab_size=257, max_len=max(len(s) for s in seqs), info={"majority": full.subset(te).majority()},
                    image_size=side)
