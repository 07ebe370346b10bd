"""Runtime curves of sparse and dense attention, and of the peers (SDPA, FlexAttention).

One job per module:
- ``spec``: the config read into ``BenchConfig``; patterns with params; the FLOP count;
- ``backends``: the harness backends by name (``sparseflash``, ``sparseflash-blocked``,
  ``sparseflash-triton``, ``reference``, ``sdpa``, ``sdpa-flash``, ``sdpa-cudnn``, ``flex``, ``flex-flash``);
- ``measure``: the timed step of each mode, timers, peak memory, the correctness gate;
- ``sweep``: the loop over cases, one row per measurement, derived speed-ups;
- ``report``: environment, ``results.csv``/``results.jsonl``, the markdown table;
- ``plots``: PNGs; ``compare``: two result files side by side; ``runner``: ``run(cfg)``.

See docs/bench.md.
"""

from sparseflash.bench.compare import compare_rows
from sparseflash.bench.report import read_rows
from sparseflash.bench.runner import run
from sparseflash.bench.spec import BenchConfig, attention_flops, parse_patterns

__all__ = ["run", "BenchConfig", "attention_flops", "parse_patterns", "read_rows", "compare_rows"]
