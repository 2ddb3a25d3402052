#!/usr/bin/env bash
# Issue 16 item 4 on 2 GPUs: ResNet-50 224 bf16, global batch 512, emulated compute skew F = 3 on rank 1, NCCL's
# default environment (no NCCL_* channel or CTA variable set by hand; the profile may record one it measured to
# help, and `planner bench`/`train` then apply it to every strategy alike).  3 interleaved rounds of equal /
# proportional / plan.  Goals: plan >= 1.9x equal, >= 0.95 of ideal, |prediction error| <= 3% on every plan row.
# Usage: benchmarks/comm_gpu.sh [F3] [F1]   (default F3; F1 = the homogeneous pair: the plan must stay equal and
# the setting must cost nothing).  Raw bench JSON, profiles, logs and comm_summary.json land in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=4
unset NCCL_MIN_NCHANNELS NCCL_MAX_NCHANNELS NCCL_MIN_CTAS NCCL_MAX_CTAS
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
parts=("$@"); [ ${#parts[@]} -eq 0 ] && parts=(F3)

for p in "${parts[@]}"; do
  case $p in
    F3) slow=3 ;;
    F1) slow=1 ;;
    *) echo "unknown part $p"; exit 2 ;;
  esac
  t0=$SECONDS
  python3 -m planner bench --device cuda --nproc 2 --model resnet50 --amp --global-batch 512 \
    --emulate-slowdown "1=$slow" --strategies equal,proportional,plan --rounds 3 --steps 20 \
    --profile-out "$OUT/comm_${p}_profile.json" --json "$OUT/comm_${p}.json" > "$OUT/comm_${p}.log" 2>&1
  echo "=== $p: rc=$? in $((SECONDS - t0)) s"
  grep -E "launch setting|warning" "$OUT/comm_${p}.log" | tail -5
done

python3 - "$OUT" "${parts[@]}" <<'PY'
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1]); summary = {}
for part in sys.argv[2:]:
    f = out / f"comm_{part}.json"
    if not f.exists():
        summary[part] = {"missing": str(f)}; continue
    d = json.loads(f.read_text()); prof = json.loads((out / f"comm_{part}_profile.json").read_text())
    B = d["meta"]["global_batch"]; eq = d["equal"]["samples_per_s"]; ideal = d["ideal"]["samples_per_s"]
    s = {"launch_env": d["meta"]["plan"].get("launch_env"), "comm": prof.get("comm"),
         "ddp_cost": {k: v for k, v in prof["meta"].items() if k.startswith("ddp_cost")}}
    for name in ("equal", "proportional", "plan"):
        r = d.get(name)
        if not r:
            continue
        pred = r["predicted_step_time_s"]
        errs = [B / sps / pred - 1 for sps in r["rounds_samples_per_s"]]  # every round's prediction error
        s[name] = {"batches": r["batch_sizes"], "samples_per_s": r["samples_per_s"],
                   "rounds_samples_per_s": r["rounds_samples_per_s"], "vs_equal": r["samples_per_s"] / eq,
                   "vs_ideal": r["samples_per_s"] / ideal, "predicted_step_ms": 1000 * pred,
                   "errors_per_round": [round(e, 4) for e in errs]}
        print(f"{part} {name:12s} {r['batch_sizes']}  {r['samples_per_s']:7.0f} samples/s  {r['samples_per_s'] / eq:.2f}x equal"
              f"  {r['samples_per_s'] / ideal:.3f} of ideal  errors {', '.join(f'{100 * e:+.1f}%' for e in errs)}")
    if "plan" in s:
        pl = s["plan"]
        s["goals"] = {"plan_vs_equal_ge_1.9": pl["vs_equal"] >= 1.9, "plan_vs_ideal_ge_0.95": pl["vs_ideal"] >= 0.95,
                      "every_plan_error_le_3pct": all(abs(e) <= 0.03 for e in pl["errors_per_round"])}
        print(f"{part} launch setting {s['launch_env']}; wait factors {(prof.get('comm') or {}).get('wait_factors')}; "
              f"goals {s['goals']}")
    summary[part] = s
(out / "comm_summary.json").write_text(json.dumps(summary, indent=1))
PY
