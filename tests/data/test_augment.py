"""Training-batch symmetries of square images (task.augment): the right ones, drawn reproducibly."""

import pytest
import torch

from sparseflash.data.augment import GridAugment, grid_augment


def _symmetries(grid: torch.Tensor) -> list[torch.Tensor]:
    """The eight rotations and mirrors of a square grid, by torch's own ops."""
    turns = [torch.rot90(grid, r) for r in range(4)]
    return turns + [t.flip(1) for t in turns]


def _batch(rows: int, size: int) -> dict:
    x = torch.randint(1, 257, (rows, size * size))
    return {"x": x, "lengths": torch.full((rows,), size * size), "y": torch.randint(0, 2, (rows,))}


@pytest.mark.parametrize("size", [5, 32])
def test_dihedral_gives_each_row_one_of_the_eight_symmetries_and_all_of_them_occur(size):
    batch = _batch(400, size)
    out = GridAugment("dihedral", size, seed=3, device=torch.device("cpu"))(batch, step=7)
    assert torch.equal(out["y"], batch["y"]) and torch.equal(out["lengths"], batch["lengths"])
    seen = set()
    for row, image in zip(batch["x"], out["x"]):
        matches = [i for i, s in enumerate(_symmetries(row.view(size, size))) if torch.equal(s, image.view(size, size))]
        assert matches, "an augmented image is no rotation or mirror of its original"
        seen.add(matches[0])
    assert seen == set(range(8))


def test_hflip_mirrors_left_right_or_leaves_alone():
    size = 6
    batch = _batch(200, size)
    out = GridAugment("hflip", size, seed=0, device=torch.device("cpu"))(batch, step=0)
    kinds = set()
    for row, image in zip(batch["x"], out["x"]):
        grid, got = row.view(size, size), image.view(size, size)
        assert torch.equal(got, grid) or torch.equal(got, grid.flip(1))
        kinds.add(torch.equal(got, grid))
    assert kinds == {True, False}


def _turned(batch, seed: int, step: int, device="cpu") -> torch.Tensor:
    return GridAugment("dihedral", 8, seed, torch.device(device))(batch, step)["x"]


def test_draws_depend_on_seed_and_step_only():
    batch = _batch(64, 8)
    torch.manual_seed(0)
    first = _turned(batch, 1, 5)
    torch.manual_seed(1)  # torch's global generator is not what draws
    assert torch.equal(first, _turned(batch, 1, 5))
    assert not torch.equal(first, _turned(batch, 1, 6))
    assert not torch.equal(first, _turned(batch, 2, 5))


@pytest.mark.gpu
def test_draws_on_cuda_match_the_cpu():
    batch = _batch(64, 8)
    on_gpu = {k: v.cuda() for k, v in batch.items()}
    assert torch.equal(_turned(on_gpu, 3, 9, "cuda").cpu(), _turned(batch, 3, 9))


def test_bad_settings_are_clear_errors():
    cpu = torch.device("cpu")
    assert grid_augment(None, 32, "pathfinder", 0, cpu) is None
    with pytest.raises(ValueError, match="expected one of hflip, dihedral"):
        grid_augment("rotate", 32, "pathfinder", 0, cpu)
    with pytest.raises(ValueError, match="needs a task of square images.*listops has none"):
        grid_augment("dihedral", None, "listops", 0, cpu)
    with pytest.raises(ValueError, match="length 50 is no image of 64 pixels"):
        GridAugment("dihedral", 8, 0, cpu)({"x": torch.ones(2, 50, dtype=torch.long)}, 0)
