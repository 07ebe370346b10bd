#!/usr/bin/env bash
# LRA ListOps on one GPU, LRA's Transformer base and 5K steps, dense and butterfly attention run
# concurrently on the one GPU. Writes into $OUT (<= 8 flat files): gpu.txt, {dense,butterfly}.log,
# {dense,butterfly}_metrics.jsonl, {dense,butterfly}_results.json, summary.txt.
#   bash scripts/lra_gpu.sh                 # from the repository root, with .whl/ carried along
# Knobs (environment): STEPS (5000), EVAL_EVERY (250), MAX_TIME (seconds of training per run, 420),
# PATTERNS ("dense butterfly"), DATA (/tmp/lra_data), EXTRA (more Hydra overrides for both runs),
# GEN_ARGS (arguments of the ListOps generator; they must agree with the task config).
set -uo pipefail
OUT=${OUT:-outputs/lra_gpu}
STEPS=${STEPS:-5000}
EVAL_EVERY=${EVAL_EVERY:-250}
MAX_TIME=${MAX_TIME:-420}
PATTERNS=${PATTERNS:-"dense butterfly"}
EXTRA=${EXTRA:-}
GEN_ARGS=${GEN_ARGS:-}
export SPARSEFLASH_DATA=${DATA:-/tmp/lra_data}
mkdir -p "$OUT"
if [ -z "${SKIP_WHEELS:-}" ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=.:/tmp/site || exit 1
else
  export PYTHONPATH=.
fi
export WANDB_MODE=offline PYTHONUNBUFFERED=1
t0=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/gpu.txt" 2>&1

# 1. LRA's ListOps (96K/2K/2K, length 500-2000), generated once with every core (~30-60 s).
python3 -m sparseflash.data.listops "$SPARSEFLASH_DATA/listops-1000" $GEN_ARGS || exit 1
echo "data ready after $(( $(date +%s) - t0 ))s" >> "$OUT/gpu.txt"

# 2. Both runs at once on the one GPU. LRA evaluates every 20 steps on 20 batches; here every
#    $EVAL_EVERY steps (same 20 batches) to leave the time to training. MAX_TIME bounds each run:
#    if reached, it stops and tests its best-validation weights (results.json: time_limited).
for a in $PATTERNS; do
  python3 experiments/train.py experiment=lra/listops attention=$a hydra.run.dir=/tmp/lra_runs/$a \
    trainer.max_steps=$STEPS trainer.eval_every=$EVAL_EVERY trainer.max_time=$MAX_TIME \
    trainer.progress=false trainer.checkpoint_every=0 $EXTRA > "$OUT/$a.log" 2>&1 &
done
wait
for a in $PATTERNS; do
  cp /tmp/lra_runs/$a/metrics.jsonl "$OUT/${a}_metrics.jsonl" 2>/dev/null
  cp /tmp/lra_runs/$a/results.json "$OUT/${a}_results.json" 2>/dev/null
done
python3 - "$OUT" $PATTERNS > "$OUT/summary.txt" 2>&1 <<'PY'
import json, sys
out, patterns = sys.argv[1], sys.argv[2:]
for p in patterns:
    try:
        recs = [json.loads(l) for l in open(f"{out}/{p}_metrics.jsonl")]
        res = json.load(open(f"{out}/{p}_results.json"))
    except OSError as err:
        print(p, "no results:", err); continue
    st = [r["step_time"] for r in recs if "step_time" in r]
    tail = st[len(st) // 5:] or st  # skip compilation / warm-up
    print(f"{p}: steps {res['steps']} test_acc {res['test_acc']:.4f} best_val_acc {res['best_val_acc']:.4f} "
          f"(step {res['best_step']}) mask_density {res['mask_density']:.3f} "
          f"median step {sorted(tail)[len(tail) // 2] * 1e3:.1f} ms ({len(patterns)} run(s) sharing the GPU) "
          f"total {res['total_time']:.0f}s time_limited {res['time_limited']}")
PY
echo "total $(( $(date +%s) - t0 ))s" >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
