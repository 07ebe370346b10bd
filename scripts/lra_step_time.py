"""Training-step time of an LRA preset's Transformer per attention pattern, against a standard
Transformer (dense attention on the ``standard`` backend: the whole score matrix materialised, as
a plain PyTorch model computes it), at the task's length and at longer ones, on one GPU.

A step is what ``experiments/train.py`` does: forward under bf16 autocast, cross-entropy, backward,
AdamW. Inputs are random tokens of exactly the given length (no padding), so every configuration
does the same work. Attention dropout is off (the model's other dropout stays), so that the standard
backend, whose dropout draws the kernels' counter-based mask with PyTorch ops, is not slowed by it;
``--attention-dropout P`` adds each pattern on the kernels with it, to show its cost, and
``--compile`` each pattern with the model under ``torch.compile`` (``trainer.compile=true``). The
configurations take turns (``--rounds``), each timing ``--steps`` steps by CUDA events after
warm-up; a configuration that runs out of memory is reported as ``OOM``.

    python scripts/lra_step_time.py experiment=lra/listops --lengths 2000 4096 --batches 32 8 \\
        --patterns dense butterfly bigbird --attention-dropout 0.1 --out step_time.jsonl

Prints a Markdown table: median ms per step (p20-p80) and the speed-up over the standard
Transformer at the same length and batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

from sparseflash.models import build_model

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
STANDARD = ("dense", "standard")


def _model(overrides: list[str], pattern: str, backend: str, attention_dropout: float, length: int,
           device) -> torch.nn.Module:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, f"attention={pattern}", f"attention.backend={backend}",
                                          f"model.attention_dropout={attention_dropout}"])
    model = build_model(cfg.model, cfg.attention, vocab_size=256, max_len=length, num_classes=10).to(device)
    return model.train()


class Config:
    """One (pattern, backend, attention dropout) model at one length and batch, with its optimizer and
    step times."""

    def __init__(self, overrides, pattern, backend, attention_dropout, length, batch, device, compiled=False):
        self.key = {"pattern": pattern, "backend": backend, "attention_dropout": attention_dropout,
                    "length": length, "batch": batch, "compiled": compiled}
        self.times: list[float] = []
        self.oom = False
        model = _model(overrides, pattern, backend, attention_dropout, length, device)
        self.model = torch.compile(model) if compiled else model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.batch = {"x": torch.randint(1, 256, (batch, length), device=device),
                      "lengths": torch.full((batch,), length, device=device),
                      "y": torch.randint(0, 10, (batch,), device=device)}

    def step(self) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = self.model(self.batch)
        F.cross_entropy(logits.float(), self.batch["y"]).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def time(self, steps: int, warmup: int) -> None:
        """Time ``steps`` steps after ``warmup`` untimed ones; on running out of memory, mark the
        configuration and free what it holds."""
        if self.oom:
            return
        try:
            for _ in range(warmup):
                self.step()
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(steps)]
            for start, end in events:
                start.record()
                self.step()
                end.record()
            torch.cuda.synchronize()
            self.times += [start.elapsed_time(end) for start, end in events]
        except torch.cuda.OutOfMemoryError:
            self.oom = True
            self.optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()

    def result(self) -> dict:
        if self.oom or not self.times:
            return {**self.key, "median_ms": None, "oom": self.oom}
        q = statistics.quantiles(self.times, n=5)
        return {**self.key, "median_ms": statistics.median(self.times), "p20_ms": q[0], "p80_ms": q[-1],
                "steps": len(self.times), "oom": False}


def _table(results: list[dict]) -> str:
    lines = ["| length | batch | attention | backend | attention dropout | ms per step (p20-p80) "
             "| speed-up over standard |", "|---:|---:|---|---|---:|---:|---:|"]
    for r in results:
        base = next(b for b in results if (b["pattern"], b["backend"]) == STANDARD
                    and (b["length"], b["batch"]) == (r["length"], r["batch"]))
        if r["median_ms"] is None:
            time, speedup = "OOM", "-"
        else:
            time = f"{r['median_ms']:.1f} ({r['p20_ms']:.1f}-{r['p80_ms']:.1f})"
            speedup = f"{base['median_ms'] / r['median_ms']:.2f}x" if base["median_ms"] else "standard OOM"
        backend = r["backend"] + (" (compiled)" if r.get("compiled") else "")
        lines.append(f"| {r['length']} | {r['batch']} | {r['pattern']} | {backend} | {r['attention_dropout']} "
                     f"| {time} | {speedup} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of configs/train.yaml (the preset)")
    parser.add_argument("--lengths", type=int, nargs="+", required=True)
    parser.add_argument("--batches", type=int, nargs="+", required=True, help="one batch size per length")
    parser.add_argument("--patterns", nargs="+", default=["dense", "butterfly", "bigbird"],
                        help="attention configs timed on the triton backend (configs/attention)")
    parser.add_argument("--attention-dropout", type=float, default=0.0,
                        help="also time each pattern on the kernels with this attention dropout")
    parser.add_argument("--compile", action="store_true",
                        help="also time each pattern on the kernels with the model under torch.compile")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration and round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before each round's")
    parser.add_argument("--out", type=Path, help="also write the results as JSON lines")
    args = parser.parse_args(argv)
    if len(args.batches) != len(args.lengths):
        parser.error(f"--batches needs one size per length: {len(args.lengths)} lengths, "
                     f"{len(args.batches)} batch sizes given")
    if not torch.cuda.is_available():
        parser.error("step times are measured on a CUDA GPU; none is available")
    device = torch.device("cuda")
    dropouts = [0.0] + ([args.attention_dropout] if args.attention_dropout > 0 else [])
    rows = [(*STANDARD, 0.0, False), *((p, "triton", d, False) for d in dropouts for p in args.patterns),
            *((p, "triton", 0.0, True) for p in (args.patterns if args.compile else []))]
    configs = [Config(args.overrides, pattern, backend, dropout, length, batch, device, compiled)
               for length, batch in zip(args.lengths, args.batches) for pattern, backend, dropout, compiled in rows]
    for _ in range(args.rounds):
        for config in configs:
            config.time(args.steps, args.warmup)
    results = [c.result() for c in configs]
    print(_table(results))
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in results))
    return results


if __name__ == "__main__":
    main()
