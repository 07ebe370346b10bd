"""Pathfinder: the generator (seeded, cached, independent of the number of workers; whether the
markers are connected is decided by the pixels) and the loader of LRA's released files."""

import json
from collections import deque

import numpy as np
import pytest
from omegaconf import OmegaConf

from sparseflash.data import build_task, pathfinder
from tests.data.fixtures import write_pathfinder_release


def test_pathfinder_generator_seeded_and_cached(tmp_path):
    a, ya = pathfinder.generate(6, seed=1, workers=1)
    b, yb = pathfinder.generate(6, seed=1, workers=1)
    assert a.shape == (6, 32, 32) and a.dtype == np.uint8
    assert (a == b).all() and (ya == yb).all()
    assert (a.reshape(6, -1).max(1) == 255).all()  # byte-scaled to its brightest pixel, as LRA's images
    big, _ = pathfinder.generate(2, size=64, seed=0, workers=1)
    assert big.shape == (2, 64, 64)
    imgs, labels = pathfinder.load_generated(tmp_path, 8, 32, 0, {})
    cached = list(tmp_path.glob("generated_32_8_seed0.npz"))
    assert cached and (pathfinder.load_generated(tmp_path, 8, 32, 0, {})[0] == imgs).all()


def test_pathfinder_release_skips_unreadable(tmp_path):
    write_pathfinder_release(tmp_path, n=20, bad=2)
    cfg = OmegaConf.create({"name": "pathfinder", "data_dir": str(tmp_path), "generate": False})
    with pytest.warns(UserWarning, match="skipped 2 unreadable"):
        task = build_task(cfg)
    assert len(task.train) + len(task.val) + len(task.test) == 18
    assert task.max_len == 1024 and task.num_classes == 2


def test_generate_independent_of_workers():
    one, y1 = pathfinder.generate(10, seed=3, workers=1, chunk=4)
    two, y2 = pathfinder.generate(10, seed=3, workers=2, chunk=4)
    assert (one == two).all() and (y1 == y2).all()
    other, _ = pathfinder.generate(10, seed=4, workers=1, chunk=4)
    assert (one != other).any()


def test_cache_from_an_older_generator_is_remade(tmp_path):
    path = tmp_path / "generated_32_4_seed0.npz"
    old_meta = json.dumps({**pathfinder.DEFAULTS}, sort_keys=True)  # no generator version: made by v1
    np.savez_compressed(path, images=np.zeros((4, 32, 32), np.uint8), labels=np.zeros(4, np.int64),
                        params=np.array(old_meta))
    with pytest.warns(UserWarning, match="regenerating"):
        images, _ = pathfinder.load_generated(tmp_path, 4, 32, 0, {})
    assert (images.reshape(4, -1).max(1) == 255).all()


def components(mask: np.ndarray) -> np.ndarray:
    """8-connected components of ``mask``: labels 1.. (0 off the mask)."""
    labels = np.zeros(mask.shape, np.int32)
    h, w = mask.shape
    count = 0
    for y0, x0 in zip(*np.nonzero(mask)):
        if labels[y0, x0]:
            continue
        count += 1
        labels[y0, x0] = count
        todo = deque([(y0, x0)])
        while todo:
            y, x = todo.popleft()
            for dy in (-1, 0, 1):
                for dx in (-1, 0, 1):
                    v, u = y + dy, x + dx
                    if 0 <= v < h and 0 <= u < w and mask[v, u] and not labels[v, u]:
                        labels[v, u] = count
                        todo.append((v, u))
    return labels


def marker_components(img: np.ndarray, markers: np.ndarray) -> set:
    """The components (of all lit pixels) holding the two markers (``markers``: their pixels)."""
    each = components(markers)
    assert each.max() == 2, "expected two separate markers"
    lit = components(img > 0)
    return {int(lit[each == m][0]) for m in (1, 2)}


@pytest.mark.parametrize("params", [{"closed": True}, {"paddle_margin": 0}], ids=["gaps_closed", "no_gaps"])
def test_markers_connected_iff_label(params):
    """With the gaps between paddles drawn (the same contours) or without gaps, each contour is one
    8-connected stroke and contours never touch: the markers share a component iff label == 1."""
    rng = np.random.default_rng(7)
    for label in [0, 1] * 50:
        img, markers = pathfinder.render(rng, label, 32, **{**pathfinder.DEFAULTS, **params}, with_markers=True)
        assert (img[markers] > 0).all() and len(marker_components(img, markers)) == 2 - label


def test_target_contours_three_quarters_as_bright_as_distractors():
    """As in LRA's images: the two target snakes at paddle contrast x snake contrast (0.75 x 2), the
    distractors at the snake contrast (2). With label 0 each marker's component is a target snake."""
    ratios = []
    for seed in range(0, 40, 2):
        img, markers = pathfinder.render(np.random.default_rng(seed), 0, 32, **pathfinder.DEFAULTS, closed=True,
                                         with_markers=True)
        lit = components(img > 0)
        targets = np.isin(lit, list(marker_components(img, markers)))
        distractors = (lit > 0) & ~targets
        if distractors.any():
            ratios.append(np.median(img[targets & ~markers]) / np.median(img[distractors]))
    assert len(ratios) >= 15 and 0.7 < np.median(ratios) < 0.8 and max(ratios) < 0.9


def test_paddles_dashed():
    """The images are the closed ones less the gaps (their lit pixels: each image is scaled to its own
    brightest): paddles separated by dark pixels."""
    ratios = []
    for seed in range(20):
        open_ = pathfinder.render(np.random.default_rng(seed), seed % 2, 32, **pathfinder.DEFAULTS)
        closed = pathfinder.render(np.random.default_rng(seed), seed % 2, 32, **pathfinder.DEFAULTS, closed=True)
        assert ((open_ > 0) <= (closed > 0)).all() and ((open_ > 0) < (closed > 0)).any()
        ratios.append(components(open_ > 0).max() / components(closed > 0).max())
    # 7 contours (2 of 14 paddles, 5 of 4): 48 pieces (ratio 6.9) if every gap shows
    assert np.mean(ratios) > 5
