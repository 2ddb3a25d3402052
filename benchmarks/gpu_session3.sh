#!/usr/bin/env bash
# Session 3's GPU checks on a 2-GPU machine (through the device tool). Usage: benchmarks/gpu_session3.sh PART...
#   accum-check  fp64 exactness of micro-batches over NCCL (DDP no_sync, FSDP2, SyncBatchNorm), #13
#   accum        ResNet-50 bf16, rank 0 capped at 20 GiB (--emulate-memory), rank 1 emulated 2x slower, B=1024:
#                equal-accum (what users do) vs no-accum vs plan, 3 interleaved rounds, #13
#   causes       a co-tenant on GPU 1 during a torchrun profile -> the report names it, #17
#   lightning / accelerate   planned twin vs the framework's default, rank 1 3x slower, 3 rounds, #14
# Raw JSON and logs land in $OUT.
set -uo pipefail
source "$(dirname "$0")/_gpu_common.sh"

for p in "$@"; do
  case $p in
    accum-check) part accum-check $TR benchmarks/gpu_accumulation_check.py ;;
    accum)       part accum python3 -m planner bench --device cuda --nproc 2 --model resnet50 --amp --global-batch 1024 \
                   --steps 12 --emulate-memory 0=20 --emulate-slowdown 1=2 --strategies equal-accum,no-accum,plan \
                   --rounds 3 --quiet --json "$OUT/bench_accum_mem20_F2.json" ;;
    causes)      part causes python3 benchmarks/gpu_causes_check.py --nproc 2 --cotenant-rank 1 --hold-gib 4 --duty 0.8 \
                   --model resnet50 ;;
    lightning)   part lightning $TR benchmarks/frameworks_gpu.py --framework lightning --steps 30 --warmup 6 ;;
    accelerate)  part accelerate $TR benchmarks/frameworks_gpu.py --framework accelerate --steps 30 --warmup 6 ;;
    *) echo "unknown part $p"; exit 2 ;;
  esac
done
