#!/usr/bin/env bash
# Issue 16's re-runs on a 2-GPU machine: every headline group again, timed over the bench's synchronized window
# (planner/cli/bench_window.py), 5 interleaved rounds per launch, the proportional split in every one.
# Usage: benchmarks/gpu_honest.sh [PART...]   (no PART: all of them, about 25 minutes on 2x H100)
#   f1       ResNet-50 bf16, B = 512, equal ranks: the plan must not cost anything
#   f3       ResNet-50 bf16, B = 512, rank 1 emulated 3x slower (NCCL defaults)
#   f3nccl2  the same with NCCL_MAX_NCHANNELS=2
#   loader   ResNet-50 bf16, B = 512, DataLoader, rank 1 capped at 2 workers
#   cotenant ResNet-50 bf16, B = 512, a duty-0.5 bf16 matmul loop on GPU 1 (benchmarks/cotenant.py)
# Raw JSON (one `planner bench --json` file per part, the profile beside it) and logs land in $OUT; copy the JSON
# into docs/results/ under a name starting with the card (e.g. h100x2_) and run
#   python benchmarks/summarize_bench.py --write docs/BENCHMARKS.md README.md
set -uo pipefail
PART_TAIL=12
source "$(dirname "$0")/_gpu_common.sh"
PY=${PYTHON:-python3}
if [ -n "${TINY:-}" ]; then  # the script's logic on CPU in seconds: TINY=1 benchmarks/gpu_honest.sh f1 f3
  CARD=cpu; DEV=cpu
  COMMON=(--device cpu --nproc 2 --model mlp --quick --global-batch 16 --steps 4 --rounds 2
          --strategies equal,proportional,plan --quiet --timeout 300)
else
  CARD=$($PY -c "import torch; n=torch.cuda.get_device_name(0).split(); print((n[1] if len(n) > 1 else n[0]).lower())")
  DEV=cuda:1
  COMMON=(--device cuda --nproc 2 --model resnet50 --amp --global-batch 512 --steps 30 --rounds 5
          --strategies equal,proportional,plan --quiet)
fi

bench() {  # bench NAME ARGS...: one launch, its JSON and profile under $OUT
  local name=$1; shift
  part "$name" $PY -m planner bench "${COMMON[@]}" "$@" --json "$OUT/${CARD}x2_${name}.json" \
    --profile-out "$OUT/${CARD}x2_${name}_profile.json"
}

PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(f1 f3 f3nccl2 loader cotenant)
for p in "${PARTS[@]}"; do
  case $p in
    f1)       bench resnet50_F1_rounds5 --emulate-slowdown 1=1 ;;  # labelled as the earlier F = 1 runs
    f3)       bench resnet50_F3_rounds5 --emulate-slowdown 1=3 ;;
    f3nccl2)  NCCL_MAX_NCHANNELS=2 bench resnet50_F3_nccl2ch_rounds5 --emulate-slowdown 1=3 ;;  # "nccl2ch": its setting
    loader)   bench resnet50_loader_skew_rounds5 --data loader --emulate-loader 1=2 ;;
    cotenant) $PY benchmarks/cotenant.py --device "$DEV" --duty 0.5 > "$OUT/cotenant_load.log" 2>&1 &
              load=$!
              sleep 10
              bench resnet50_cotenant_rounds5 --label "real co-tenant: a duty-0.5 bf16 matmul loop on GPU 1"
              kill "$load" 2>/dev/null; wait "$load" 2>/dev/null ;;
    *) echo "unknown part $p"; exit 2 ;;
  esac
done
