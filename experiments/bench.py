"""Runtime curves of sparse and dense attention (see docs/bench.md).

    python experiments/bench.py bench=smoke
    python experiments/bench.py seq_lens=[1024,4096,16384] patterns=[dense,causal,butterfly,local] \
        backends=[sparseflash,flex,sdpa] modes=[fwd,fwdbwd] head_dim=128 dtype=bf16
    python experiments/bench.py compare a/results.csv b/results.csv
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "compare":
    from sparseflash.bench.compare import main as compare_main

    sys.exit(compare_main(sys.argv[2:]))

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402


@hydra.main(config_path="../configs", config_name="bench", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from sparseflash.bench import run

    run(cfg)


if __name__ == "__main__":
    main()
