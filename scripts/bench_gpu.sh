#!/usr/bin/env bash
# The issue's H100 grid (configs/bench/h100.yaml): head_dim 128, bf16, 16k tokens, S in {1k, 4k, 16k};
# dense, causal, butterfly, local (2-block window), random (25%); sparseflash-triton,
# sparseflash-blocked, flex and sdpa; fwd and fwdbwd. Run from the repository root on a machine with
# torch + triton, the wheels of hydra-core/omegaconf (and their deps) in .whl/
# (fetch them here with /work/shared/device/wheels.sh); extra Hydra overrides are passed through:
#   bash scripts/bench_gpu.sh [overrides...]
# It writes into $OUT (default outputs/bench_gpu) six files: results.csv, results.md, results.jsonl,
# bench_time.png, bench_speedup.png and bench.log; KEEP="results.csv bench.log" keeps fewer (the
# device tool returns at most 8 files per call, so two runs in one call need KEEP).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=.:/tmp/site || exit 1
set -uo pipefail
OUT=${OUT:-outputs/bench_gpu}
RUN=/tmp/sparseflash_bench_h100
mkdir -p "$OUT"
rm -rf "$RUN"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee "$OUT/bench.log"
# The grid takes ~3-5 minutes (first calls compile Triton and FlexAttention); the guard (BENCH_TIMEOUT,
# seconds) stops it at 8 minutes by default.
timeout "${BENCH_TIMEOUT:-480}" python3 experiments/bench.py bench=h100 hydra.run.dir="$RUN" hydra.output_subdir=null "$@" 2>&1 \
    | tee -a "$OUT/bench.log"
status=${PIPESTATUS[0]}
# results.jsonl is streamed row by row, so even a stopped run leaves its rows behind.
KEEP=${KEEP:-"results.csv results.md results.jsonl bench_time.png bench_speedup.png bench.log"}
for f in results.csv results.md results.jsonl plots/bench_time.png plots/bench_speedup.png; do
    case " $KEEP " in *" $(basename "$f") "*) [ -f "$RUN/$f" ] && cp "$RUN/$f" "$OUT/" ;; esac
done
case " $KEEP " in *" bench.log "*) ;; *) rm -f "$OUT/bench.log" ;; esac
ls -l "$OUT"
exit "$status"
