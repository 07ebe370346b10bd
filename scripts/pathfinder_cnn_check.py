"""Is a Pathfinder dataset learnable at all? A small CNN (ten 3x3 convolutions with batch norm, three
max-pools, global average pool) trained on the task's own training split, scored on its validation
split: a check of the data (images, labels, split) apart from the Transformer.

    python scripts/pathfinder_cnn_check.py task.num=100000 --seconds 170
    python scripts/pathfinder_cnn_check.py task.num=100000 "task.generator={contour_length: 6}" \
        task.data_dir=data/pathfinder32_contour6

Arguments past the options override ``configs/task/pathfinder.yaml`` (``task.`` prefix optional; the
images are made and cached as training would, under ``$SPARSEFLASH_DATA``, default ``data/``; the
cache file is named by size, number and seed, not by the generator's settings, so other settings
want another ``task.data_dir``). Prints the validation accuracy about a dozen times, and at the end.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from omegaconf import OmegaConf

from sparseflash.data import pathfinder

TASK_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "task" / "pathfinder.yaml"


def images(dataset, size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(N, 1, size, size)`` grey levels in [0, 1] (token ids are level + 1) and ``(N,)`` labels."""
    levels = torch.from_numpy(np.stack(dataset.seqs).astype(np.float32) - 1).view(-1, 1, size, size) / 255
    return levels.to(device), torch.from_numpy(dataset.labels).to(device)


def cnn(width: int) -> nn.Sequential:
    """Convolutions per stage 3, 3, 2, 2 (32, 16, 8 and 4 pixels a side for 32x32 images)."""
    layers, channels = [], 1
    for stage, convs in enumerate((3, 3, 2, 2)):
        if stage:
            layers.append(nn.MaxPool2d(2))
        for _ in range(convs):
            layers += [nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
            channels = width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 2))


def accuracy(net, x, y, batch: int = 1024) -> float:
    """Fraction of the images ``x`` that ``net`` (in eval mode) labels ``y``."""
    net.eval()
    with torch.no_grad():
        correct = sum((net(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum().item() for i in range(0, len(x), batch))
    net.train()
    return correct / len(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="overrides of the pathfinder task config, key=value")
    parser.add_argument("--seconds", type=float, default=170.0, help="training time")
    parser.add_argument("--width", type=int, default=64, help="channels of every convolution")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    overrides = [o.removeprefix("task.") for o in args.overrides]  # as on train.py's command line, or bare
    data_root = os.environ.get("SPARSEFLASH_DATA", "data")
    cfg = OmegaConf.merge(OmegaConf.load(TASK_CONFIG), {"data_root": data_root}, OmegaConf.from_dotlist(overrides))
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    task = pathfinder.build(cfg)
    (x, y), (x_val, y_val) = images(task.train, task.image_size, device), images(task.val, task.image_size, device)
    print(f"{len(x)} training and {len(x_val)} validation images on {device}", flush=True)
    net = cnn(args.width).to(device)
    optimizer = torch.optim.Adam(net.parameters(), 1e-3)
    start, step, shown = time.time(), 0, 0.0
    while time.time() - start < args.seconds:
        batch = torch.randint(0, len(x), (args.batch_size,), device=device)
        loss = nn.functional.cross_entropy(net(x[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if time.time() - shown > args.seconds / 12:
            shown = time.time()
            score = accuracy(net, x_val, y_val)
            print(f"{shown - start:6.0f} s  step {step}  loss {loss.item():.3f}  validation {score:.4f}", flush=True)
    print(f"final validation accuracy {accuracy(net, x_val, y_val):.4f} after {step} steps")


if __name__ == "__main__":
    main()
