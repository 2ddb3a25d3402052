#!/usr/bin/env bash
# Session 4's GPU checks (through the device tool). Usage: benchmarks/gpu_session4.sh PART...
#   lightning / accelerate  planned twin vs the framework's default, rank 1 3x slower, 3 rounds, #14
#   hf                      HF Trainer default vs planned, ~110M LM bf16 seq 1024, rank 1 2x and 3x slower, 3 rounds, #15
#   comm-F3                 benchmarks/comm_gpu.sh F3 (the wait-factor model, default NCCL env, 3 rounds), #16
#   bench-F3                planner bench ResNet-50 bf16 B=512, rank 1 3x slower, default NCCL env, 3 rounds, #16
# Raw JSON and logs land in $OUT.
set -uo pipefail
source "$(dirname "$0")/_gpu_common.sh"

for p in "$@"; do
  case $p in
    lightning)   part lightning $TR benchmarks/frameworks_gpu.py --framework lightning --steps 30 --warmup 6 ;;
    accelerate)  part accelerate $TR benchmarks/frameworks_gpu.py --framework accelerate --steps 30 --warmup 6 ;;
    hf)          part hf $TR benchmarks/hf_gpu.py --json "$OUT/hf_gpu.json" ;;
    comm-F3)     part comm-F3 bash benchmarks/comm_gpu.sh F3 ;;
    bench-F3)    part bench-F3 python3 -m planner bench --device cuda --nproc 2 --model resnet50 --amp --global-batch 512 \
                   --emulate-slowdown 1=3 --rounds 3 --quiet --json "$OUT/bench_resnet50_F3.json" \
                   --profile-out "$OUT/bench_resnet50_F3_profile.json" ;;
    *) echo "unknown part $p"; exit 2 ;;
  esac
done
