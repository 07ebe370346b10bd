"""scripts/lra_summary.py over real (tiny) training runs: accuracy mean ± std per pattern over seeds,
the speed-up column from step times, and the plot."""

import json
import statistics
import subprocess
import sys

from tests.test_train import ROOT, make_cfg

from sparseflash.train import run


def test_summary_of_seeds_and_step_times(tmp_path):
    runs = []
    for pattern, seed in [("dense", 0), ("dense", 1), ("butterfly", 0)]:
        run_dir = tmp_path / f"{pattern}_s{seed}"
        run(make_cfg(tmp_path, f"attention={pattern}", f"seed={seed}", "trainer.max_steps=4",
                     "trainer.eval_every=2"), run_dir=run_dir)
        runs.append(run_dir)
    step_time = tmp_path / "step_time.jsonl"
    rows = [{"pattern": "dense", "backend": "standard", "length": 64, "batch": 8, "median_ms": 30.0},
            {"pattern": "dense", "backend": "triton", "length": 64, "batch": 8, "median_ms": 10.0},
            {"pattern": "butterfly", "backend": "triton", "length": 64, "batch": 8, "median_ms": 7.5},
            {"pattern": "butterfly", "backend": "triton", "attention_dropout": 0.1, "length": 64, "batch": 8,
             "median_ms": 9.0},  # with attention dropout: not a speed-up row
            {"pattern": "butterfly", "backend": "triton", "compiled": True, "length": 64, "batch": 8,
             "median_ms": 5.0}]  # under torch.compile: not one either
    step_time.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "summary"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "lra_summary.py"), *map(str, runs),
                    "--step-time", str(step_time), "--out", str(out)], check=True, cwd=ROOT)

    table = (out / "summary.md").read_text().splitlines()
    dense = next(line for line in table if "| dense |" in line).split(" | ")
    tests = [json.loads((d / "results.json").read_text())["test_acc"] for d in runs[:2]]
    assert dense[2] == "2"
    assert dense[3] == f"{100 * statistics.mean(tests):.2f} ± {100 * statistics.stdev(tests):.2f}"
    assert dense[-1].rstrip(" |") == "3.00x"
    butterfly = next(line for line in table if "| butterfly |" in line).split(" | ")
    assert butterfly[2] == "1" and butterfly[-1].rstrip(" |") == "4.00x"
    assert (out / "listops_val_acc.png").stat().st_size > 0


def test_an_unfinished_run_is_refused(tmp_path):
    (tmp_path / "run").mkdir()
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "lra_summary.py"), str(tmp_path / "run"),
                             "--out", str(tmp_path / "out")], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode != 0 and "is not a finished run: it has no config.yaml" in result.stderr
