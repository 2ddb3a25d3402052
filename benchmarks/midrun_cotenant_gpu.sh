#!/usr/bin/env bash
# Issue 17's mid-run case on 2 GPUs: `planner train --auto` for 6 epochs; once the run log holds 2 epochs a real
# co-tenant (benchmarks/cotenant.py, duty 0.8, holding 4 GiB) starts on GPU 1; then `planner report --log` must
# attribute rank 1's slowdown at that epoch to the other process. Raw files in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"; rm -f "$OUT/midrun_run.jsonl"
python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m planner train --auto --global-batch 512 \
  --model resnet50 --amp --epochs 6 --num-samples 40960 --data-on-device --quiet \
  --log-file "$OUT/midrun_run.jsonl" --plan-out "$OUT/midrun_plan.json" --profile-out "$OUT/midrun_profile.json" \
  > "$OUT/midrun_train.log" 2>&1 &
TRAIN=$!
epochs() { local n; n=$(grep -c '"event": "epoch"' "$OUT/midrun_run.jsonl" 2>/dev/null); echo "${n:-0}"; }
until [ "$(epochs)" -ge 2 ] || ! kill -0 $TRAIN 2>/dev/null; do
  sleep 0.5
done
setsid python3 benchmarks/cotenant.py --device cuda:1 --duty 0.8 --hold-gib 4 > "$OUT/midrun_cotenant.log" 2>&1 &
CT=$!
wait $TRAIN; echo "train rc=$?"
kill -- -$CT 2>/dev/null; kill $CT 2>/dev/null
grep -v -E "Warning|warn\(" "$OUT/midrun_train.log" | grep -E "^epoch" | tail -8
python3 -m planner report --profile "$OUT/midrun_profile.json" --plan "$OUT/midrun_plan.json" \
  --log "$OUT/midrun_run.jsonl" --out "$OUT/midrun_report.html" --json "$OUT/midrun_report.json" 2>&1 \
  | grep -i -E "rank 1|slow|process" | head -12
