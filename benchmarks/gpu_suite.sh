#!/usr/bin/env bash
# GPU benchmark suite run through the device tool on a 2-GPU machine. Usage: benchmarks/gpu_suite.sh PART...
# Parts: env sampler smoke profile r50a r50b replan r18 loader mixed nccl2 cotenant. Results land in $OUT (JSON + logs).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
P="python3 -m planner"
R50="--model resnet50 --amp --global-batch 512 --steps 20"

part() {
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$OUT/$name.log" | grep -v -E "^\s*$|Warning|warn\(" | tail -40
  echo "=== $name done in $((SECONDS - t0)) s"
}

for p in "$@"; do
  case $p in
    env)     nvidia-smi -L; python3 -c "import torch, torchvision, scipy, numpy; print('torch', torch.__version__, 'tv', torchvision.__version__, 'scipy', scipy.__version__, 'gpus', torch.cuda.device_count(), torch.cuda.get_device_name(0))"; nproc ;;
    sampler) part sampler python3 benchmarks/sampler_bench.py --json "$OUT/sampler_host.json" ;;
    smoke)   part smoke $P bench --device cuda --nproc 2 --model resnet18 --image-size 64 --global-batch 128 --steps 4 --quick --replan-epochs 2 --emulate-slowdown 1=2 --json "$OUT/smoke.json" ;;
    profile) part profile python3 benchmarks/gpu_profile_check.py --model resnet50 --device cuda:0 --out "$OUT/gpu_check.json" --profile-out "$OUT/r50_profile.json" ;;
    r50a)    part r50a $P bench --device cuda --nproc 2 $R50 --sweep-slowdown "1=1;1=3" --json "$OUT/bench_r50_a.json" ;;
    r50b)    part r50b $P bench --device cuda --nproc 2 $R50 --sweep-slowdown "1=1.5;1=2;1=3;1=4" --replan-epochs 3 --json "$OUT/bench_r50_b.json" ;;
    replan)  part replan $P bench --device cuda --nproc 2 $R50 --late-slowdown 1=3 --strategies plan+replan --replan-epochs 5 --json "$OUT/bench_replan.json" ;;
    r18)     part r18 $P bench --device cuda --nproc 2 --model resnet18 --image-size 32 --amp --global-batch 1024 --steps 30 --sweep-slowdown "1=1;1=3" --json "$OUT/bench_r18.json" ;;
    loader)  part loader $P bench --device cuda --nproc 2 --model resnet50 --amp --global-batch 512 --steps 20 --data loader --num-samples 20000 --emulate-loader 1=2 --strategies equal,proportional,plan --json "$OUT/bench_loader.json" ;;
    mixed)   part mixed $P bench --rank-devices cuda:0,cpu --model resnet18 --image-size 32 --global-batch 256 --steps 10 --strategies equal,proportional,plan --json "$OUT/bench_mixed.json" ;;
    nccl2)   part nccl2 env NCCL_MAX_NCHANNELS=2 $P bench --device cuda --nproc 2 $R50 --emulate-slowdown 1=3 --strategies equal,plan --json "$OUT/bench_nccl2.json" ;;
    nccl2h)  part nccl2h env NCCL_MAX_NCHANNELS=2 $P bench --device cuda --nproc 2 $R50 --strategies equal,plan --json "$OUT/bench_nccl2_homog.json" ;;
    cotenant)
      python3 benchmarks/cotenant.py --device cuda:1 --duty 0.5 & CT=$!
      sleep 5
      part cotenant $P bench --device cuda --nproc 2 $R50 --strategies equal,proportional,plan --label "real co-tenant: a duty-0.5 bf16 matmul loop on GPU 1" --json "$OUT/bench_cotenant.json"
      kill $CT; wait $CT ;;
    *) echo "unknown part $p"; exit 2 ;;
  esac
done
