#!/usr/bin/env bash
# FSDP2 row of issue 13: plan vs equal split under `planner train --fsdp`, ResNet-50 bf16, rank 1 emulated 2x
# slower, global batch 512, 3 interleaved rounds of 2 epochs (the first warms up). Raw run logs + summary in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
TR="python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m planner"
COMMON="--model resnet50 --amp --emulate-slowdown 1=2"
$TR profile $COMMON --quick --quiet --out "$OUT/fsdp_profile.json" > "$OUT/fsdp_profile.log" 2>&1 || exit 1
python3 -m planner plan --profile "$OUT/fsdp_profile.json" --global-batch 512 --mode fsdp --min-gain 0 \
  --out "$OUT/fsdp_plan.json" | tail -4
python3 -m planner plan --profile "$OUT/fsdp_profile.json" --global-batch 512 --mode fsdp --from-batches 256,256 \
  --out "$OUT/fsdp_equal.json" | tail -4
for r in 1 2 3; do
  for p in equal plan; do
    $TR train --fsdp --plan "$OUT/fsdp_$p.json" --profile "$OUT/fsdp_profile.json" $COMMON --data-on-device \
      --num-samples 200000 --epochs 2 --max-steps-per-epoch 15 --quiet --log-file "$OUT/fsdp_${p}_r$r.jsonl" \
      > "$OUT/fsdp_${p}_r$r.log" 2>&1 || { echo "train $p round $r failed"; tail -5 "$OUT/fsdp_${p}_r$r.log"; }
  done
done
python3 - "$OUT" <<'PY'
import json, statistics, sys, pathlib
out = pathlib.Path(sys.argv[1]); res = {}
for p in ("equal", "plan"):
    sps, pred = [], None
    for r in (1, 2, 3):
        f = out / f"fsdp_{p}_r{r}.jsonl"
        if not f.exists():
            continue
        recs = [json.loads(l) for l in f.read_text().splitlines() if l.strip()]
        ep = [x for x in recs if x.get("event") == "epoch"]
        start = next(x for x in recs if x.get("event") == "start")
        pred = start["plan"]["predicted"]["samples_per_s"]
        if ep:
            sps.append(ep[-1]["samples_per_s"])
    res[p] = {"rounds_samples_per_s": sps, "median": statistics.median(sps) if sps else None, "predicted": pred}
if res["equal"]["median"] and res["plan"]["median"]:
    res["plan_vs_equal"] = res["plan"]["median"] / res["equal"]["median"]
    res["plan_vs_equal_rounds"] = [a / b for a, b in zip(res["plan"]["rounds_samples_per_s"], res["equal"]["rounds_samples_per_s"])]
    res["plan_prediction_error"] = res["plan"]["predicted"] / res["plan"]["median"] - 1  # step-time error: T_meas/T_pred-1
(out / "fsdp_summary.json").write_text(json.dumps(res, indent=1))
print(json.dumps(res, indent=1))
PY
