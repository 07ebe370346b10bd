"""Runtime curves of sparse and dense attention (see docs/bench.md).

    python experiments/bench.py                      # on a machine without CUDA: bench=smoke
    python experiments/bench.py bench=h100           # the GPU grid
    python experiments/bench.py seq_lens=[1024,4096,16384] patterns=[dense,causal,butterfly,local] \
        backends=[sparseflash,flex,sdpa] modes=[fwd,fwdbwd] head_dim=128 dtype=bf16
    python experiments/bench.py compare a/results.csv b/results.csv

bench.yaml's defaults are GPU-sized (bf16, head_dim 128, 16K tokens: hours on a CPU), so when
the sweep would run on a CPU (device=cpu, or device=auto without CUDA) and no `bench=` preset is
named, the small CPU preset bench=smoke is added, with a line that says so; `~bench` (no preset)
keeps the defaults. A sweep that timed no row exits with status 2 and the reasons (sparseflash/cli.py).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "compare":
    from sparseflash.bench.compare import main as compare_main

    sys.exit(compare_main(sys.argv[2:]))

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

CPU_PRESET = "smoke"
ADDED_PRESET = None  # set below, before Hydra parses the command line


def _cpu_preset(argv: list[str]) -> str | None:
    """The preset to add to ``argv``'s overrides: ``CPU_PRESET`` when none is named and the sweep
    would run on a CPU, else None."""
    overrides = [a.lstrip("+~") for a in argv if not a.startswith("-")]
    if any(a.startswith("bench=") or a == "bench" for a in overrides):
        return None
    device = next((a.split("=", 1)[1] for a in overrides if a.startswith("device=")), "auto")
    if device == "cuda":
        return None
    if device == "auto":
        import torch

        if torch.cuda.is_available():
            return None
    return CPU_PRESET


@hydra.main(config_path="../configs", config_name="bench", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from sparseflash import cli
    from sparseflash.bench import runner

    with cli.job():
        if ADDED_PRESET:
            runner.log.info(f"bench: the sweep runs on the CPU, so it takes the CPU preset bench={ADDED_PRESET} "
                            f"(name a preset, e.g. bench=h100, or ~bench for the GPU-sized defaults)")
        why = runner.untimed(runner.run(cfg))
        if why:
            raise cli.RunError(why)


if __name__ == "__main__":
    ADDED_PRESET = _cpu_preset(sys.argv[1:])
    if ADDED_PRESET:
        sys.argv.append(f"bench={ADDED_PRESET}")
    main()
