#!/usr/bin/env bash
# Issue 16 item 6: wall time of a torchrun profile of ResNet-50 fp32 224 (fake data, loader measured), the default
# (fast) profile against `--thorough` (the profile of before: full repeats, the sweep growing to its budget, the
# loader after the sweep), and how far their fitted step-time curves differ.  Goal: 4 ranks <= 45 s wall (it took
# 103 s on 4 H100s).  NPROC ranks (default: every visible GPU, at most 4); on 2 GPUs it times a 2-rank profile.
# Usage: benchmarks/profile_speed_gpu.sh        Raw profiles, logs and profile_speed.json land in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
NPROC=${NPROC:-$(( GPUS < 4 ? GPUS : 4 ))}
TR="python3 -m torch.distributed.run --standalone --nproc-per-node $NPROC -m planner profile --model resnet50 --dataset fake"

timed() {  # timed NAME ARGS...: wall seconds of the whole command (start-up included) into $OUT/NAME.wall
  local name=$1; shift
  local t0; t0=$(date +%s.%N)
  $TR "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1; local rc=$?
  python3 -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 2))" "$t0" "$(date +%s.%N)" > "$OUT/$name.wall"
  echo "=== $name: rc=$rc, $(cat "$OUT/$name.wall") s wall ($NPROC ranks)"
  grep -E "profile parts|launch setting|DDP cost" "$OUT/$name.log" | tail -4
  return $rc
}

# The fast profile first: any warm-up of the machine (page cache, cuDNN's caches) favours the second run.
timed profile_fast || exit 1
timed profile_thorough --thorough || exit 1
python3 benchmarks/compare_profiles.py --fast "$OUT/profile_fast.json" --thorough "$OUT/profile_thorough.json" \
  --fast-wall-s "$(cat "$OUT/profile_fast.wall")" --thorough-wall-s "$(cat "$OUT/profile_thorough.wall")" \
  --json "$OUT/profile_speed.json"
