"""Label-preserving symmetries of square images read row by row into sequences (Pathfinder, LRA
Image), applied to training batches on their device.

``task.augment``: ``hflip`` (left-right mirror: photographs, LRA Image) or ``dihedral`` (the eight
rotations and mirrors of the square: Pathfinder, whose label, "are the markers connected", none of
them changes). Each training example gets one symmetry drawn from ``(seed, step)``, so a resumed run
draws the same ones. Validation and test images are left as they are.
"""

from __future__ import annotations

import torch

# symmetry k: transpose if k & 4, then mirror top-bottom if k & 1 and left-right if k & 2
SYMMETRIES = {"hflip": (0, 2), "dihedral": tuple(range(8))}


def _permutations(size: int, ks: tuple[int, ...]) -> torch.Tensor:
    """``(len(ks), size * size)``: position ``j`` of symmetry ``ks[i]``'s image reads position
    ``out[i, j]`` of the original."""
    grids = []
    for k in ks:
        grid = torch.arange(size * size).view(size, size)
        if k & 4:
            grid = grid.t()
        if k & 1:
            grid = grid.flip(0)
        if k & 2:
            grid = grid.flip(1)
        grids.append(grid.reshape(-1))
    return torch.stack(grids)


class GridAugment:
    """Draws one of the ``kind``'s symmetries for each row of a batch's ``x`` (``(B, size * size)``
    tokens) and applies it; ``seed``: the run's seed (plus the rank, so that ranks differ)."""

    def __init__(self, kind: str, size: int, seed: int, device: torch.device):
        if kind not in SYMMETRIES:
            raise ValueError(f"task.augment={kind!r}: expected one of {', '.join(SYMMETRIES)} or null")
        self.seed = seed
        self.perms = _permutations(size, SYMMETRIES[kind]).to(device)

    def __call__(self, batch: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
        x = batch["x"]
        if x.shape[1] != self.perms.shape[1]:
            raise ValueError(f"task.augment: a batch of length {x.shape[1]} is no image of "
                             f"{self.perms.shape[1]} pixels")
        draw = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        choice = torch.randint(len(self.perms), (x.shape[0],), generator=draw).to(x.device, non_blocking=True)
        return {**batch, "x": x.gather(1, self.perms[choice])}


def grid_augment(kind: str | None, image_size: int | None, task: str, seed: int,
                 device: torch.device) -> GridAugment | None:
    """The augmentation ``task.augment`` asks for (None for none); an error for a task without images."""
    if not kind:
        return None
    if not image_size:
        raise ValueError(f"task.augment={kind!r} needs a task of square images (pathfinder, image); "
                         f"{task} has none")
    return GridAugment(str(kind), image_size, seed, device)
