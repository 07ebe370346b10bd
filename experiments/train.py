"""Train an LRA model: `python experiments/train.py [overrides]` (Hydra; see configs/train.yaml).

    python experiments/train.py                                   # the small ListOps default
    python experiments/train.py experiment=lra/listops attention=butterfly
    python experiments/train.py -m experiment=lra/listops attention=dense,butterfly seed=0,1,2
    torchrun --nproc_per_node=2 experiments/train.py experiment=smoke   # DDP

A mistake in the command (an unknown pattern, a missing dataset, ...) ends it with one line
`error: ...` and exit status 2 (sparseflash/cli.py); HYDRA_FULL_ERROR=1 shows the traceback.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402


@hydra.main(version_base="1.3", config_path="../configs", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from sparseflash import cli
    from sparseflash.train import run

    with cli.job():
        results = run(cfg)
    return results.get("best_val_acc")  # what a Hydra sweeper would maximise


if __name__ == "__main__":
    main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from sparseflash.distributed import end_worker

        end_worker()
