#!/usr/bin/env bash
# The GPU benchmark suite: every scenario of docs/PERFORMANCE.md and the GPU checks, one part at a time.
#
#   OUT=/tmp/gpu-out benchmarks/gpu_suite.sh PART...        (no PART: the bench scenarios, about 25 min on 2 GPUs)
#   TINY=1 OUT=/tmp/tiny benchmarks/gpu_suite.sh skew loader  (the suite's logic on CPU with an MLP, in seconds)
#
# Bench parts (`planner bench`: DistributedSampler + DDP, the throughput-proportional split and the plan in one
# launch, $ROUNDS interleaved rounds, timed over the synchronized window; one raw JSON each, <card>x<n>_<part>.json):
#   equal     no heterogeneity (an emulated factor of 1): the plan must cost nothing
#   skew      emulated compute skew, $SKEW (default: the last rank 3x slower; 4 ranks: 2=2,3=4), $PLANNER_EMULATE_MODE
#             picks the emulation (interleave by default; stall: GPU sleeps)
#   loader    real loader skew: rank 1's DataLoader capped at 2 workers, ResNet-50's PIL pipeline on fake images
#   cotenant  a real co-tenant process (benchmarks/cotenant.py, a bf16 matmul loop at duty $DUTY) on the last GPU
#   mixed     a real CPU rank beside GPU 0 (ResNet-18 at 32x32, gloo)
#   memory    emulated small memory (rank 0 capped at 20 GiB, real out-of-memory errors) with rank 1 2x slower, B = 1024:
#             DistributedSampler with gradient accumulation (equal-accum) vs the plan
#   midrun    rank 1 turns 3x slower after the first epoch: plan+replan against the ideal after the slowdown
# Other parts:
#   train     `planner train --auto --replan`, the README's path: loader-fed ResNet-50 in the skew (rank 1 3x slower)
#             and loader (rank 1 at 2 workers) cases, $LAUNCHES launches each of $EPOCHS epochs, `planner report`
#             on each; raw files <case>_r<i>_{profile,plan}.json, _run.jsonl, _report.{json,html,txt}
#   frameworks  benchmarks/frameworks_gpu.py: Lightning and Accelerate, planned twin vs the default, rank 1 3x slower
#   hf        benchmarks/hf_gpu.py: the HF Trainer, ~110M-parameter LM, rank 1 2x and 3x slower
#   exact     benchmarks/gpu_accumulation_check.py and gpu_syncbn_check.py: float64 exactness over NCCL
#   predict   benchmarks/gpu_profile_check.py: one GPU's profile against held-out batch sizes
#   causes    benchmarks/gpu_causes_check.py: does `planner report` name a real co-tenant as the cause?
#   overhead  benchmarks/comm_breakdown.py --overhead: the runtime's per-step cost against plain DDP
#   comm      where the all-reduce time goes (benchmarks/comm_breakdown.py, 4 GPUs, ResNet-50 fp32, B = 256, about
#             5 min on 4 H100s): co-tenants $COTENANT (default 2:1,3:2: 1 benchmarks/cotenant.py process on GPU 2, 2 on GPU 3,
#             at $DUTY) run through the part; a --quick profile and `planner plan` under them; then (i) the
#             breakdown of the equal split and the plan, (ii) the same plan over a slow link (NCCL_P2P_DISABLE=1
#             NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo: NCCL over sockets), uncompressed against
#             weighted bf16; (iii) the DDP settings (bucket_cap_mb 100, gradient_as_bucket_view, static_graph, all
#             three) at the plan's and the equal split, the winner written to comm_plan_ddp.json's meta.ddp, which
#             `planner train --plan` applies; $ROUNDS rounds each; one JSON line per launch in comm_breakdown.jsonl
#             (without a plan, (i) and (ii) measure a throughput-proportional split themselves and (iii) is skipped)
#   promise   does a plan keep the step time it prints? (4 GPUs, about 6 min on 4 H100s, never past $PR_BUDGET = 500 s) co-tenants $PR_COTENANT
#             (default 2:1,3:2, benchmarks/cotenant.py at $DUTY) run through the part; (a) own loop: a profile and
#             `planner plan` (ResNet-50 bf16 channels-last, B = $PR_B) under them, then $LAUNCHES interleaved launches of
#             examples/ddp_planned.py (re-plans) and examples/ddp_stock.py (equal split), $PR_EPOCHS epochs, one more
#             co-tenant joining GPU 1 when epoch 2 starts (2 GPUs: 1 co-tenant on GPU 1, one joining GPU 0; rank 0
#             capped in (b)); (b) `planner train` with ranks 0-1 capped at $PR_MEM_GIB GiB
#             (--emulate-memory) so they accumulate, B = $PR_B_ACC, inputs made on the GPU (PR_B_LOADER=1: a DataLoader,
#             whose prefetched batches would make 2 short epochs the loaders' drain); (c) `planner train
#             --data-on-device`, B = $PR_B; (b) and (c) run ${PR_EPOCHS_BC:-2} epochs (the steady error is the
#             median of those after the first), profile once (--auto) and reuse that plan in the later launches; raw files promise_*; then
#             `summarize_bench.py --promise $OUT` prints the table and writes promise_records.jsonl
#   slowlink  weighted bf16 compression over a slow link (2+ GPUs, about 6 min on 2 H100s): NCCL over sockets
#             (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo), the last rank emulated
#             ${SL_SKEW:-2x} slower; one --quick profile and plan per wire format (none, bf16: `planner profile
#             --grad-compress`), then $LAUNCHES interleaved launches of `planner train --grad-compress` with each
#             (ResNet-50 bf16 autocast, B = $SL_B, inputs made on the GPU); `summarize_bench.py --slowlink $OUT`:
#             per launch samples/s, x the uncompressed plan of the same round, measured vs printed step
#   nodes     two torchrun agents on this host as two nodes of $NODE_A + $NODE_B ranks (default NPROC-1 + 1; c10d,
#             node B named by PLANNER_HOST_ID and --local-addr 127.0.0.2), real co-tenants $NODES_COTENANT on node A's
#             GPUs (default 1:1,2:2); a --quick profile through both agents, then $LAUNCHES rounds of `planner train`
#             with the equal split, the throughput-proportional split and the plan (ResNet-50 bf16, B = 512, inputs
#             made on the GPU); `summarize_bench.py --nodes $OUT`: per launch samples/s, x equal, measured vs printed
#             step, one record per launch in nodes_records.jsonl
#   convergence  does weighted gradient compression train as the uncompressed run does? (2 GPUs, about 5 min on 2
#             H100s; on a one-GPU host two ranks share it over gloo) ResNet-18 bf16 on
#             benchmarks.comm_breakdown:learnable_cifar (40960 32x32 images made from their index, learnable over
#             epochs; TINY: an MLP on learnable_cifar_tiny), a --quick profile and one plan with an uneven split
#             ($CONV_SPLIT, default 3:1:..:1 of B = $CONV_B = 512), then one `planner train` launch per entry of
#             $CONV_RUNS (default "none bf16 fp16 lossscale": --weighting hook with that --grad-compress; lossscale:
#             uncompressed, --weighting loss-scale, the same update up to fp32 rounding, so its distance from the
#             first launch is the curve's sensitivity to rounding alone) with that plan, --seed $CONV_SEED,
#             $CONV_EPOCHS (5) epochs, --lr $CONV_LR (CONV_PROFILE=FILE: plan from that profile, no profiling); run
#             logs convergence_<run>_r<i>_run.jsonl;
#             `summarize_bench.py --convergence $OUT`: per epoch each launch's mean training loss and its relative
#             difference to the first uncompressed launch's, one record per launch in convergence_records.jsonl
#   profile   wall seconds of a torchrun `planner profile` on every rank (ResNet-50 fp32, fake data, loader measured)
#   sampler   benchmarks/sampler_bench.py on the host's CPU
#   env       the machine: GPUs, CPUs, library versions
# Every part writes NAME.log under $OUT and prints its tail.  Raw bench JSON then becomes records with
#   python benchmarks/summarize_bench.py --compact OUT/*.json && \
#     python benchmarks/summarize_bench.py --write docs/PERFORMANCE.md README.md
# Environment: NPROC (default: every visible GPU), ROUNDS (3), STEPS (20), LIMIT (seconds per part, 600),
# HOSTMON=1 (benchmarks/hostmon.py samples the host beside every part into NAME_host.jsonl).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
ROUNDS=${ROUNDS:-3}; STEPS=${STEPS:-20}; LIMIT=${LIMIT:-600}; DUTY=${DUTY:-0.5}
LAUNCHES=${LAUNCHES:-3}; EPOCHS=${EPOCHS:-4}

if [ -n "${TINY:-}" ]; then
  NPROC=${NPROC:-2}; CARD=cpu; DEV=cpu
  BENCH=(--device cpu --nproc "$NPROC" --model mlp --quick --global-batch 16 --steps 4 --rounds 1 --quiet --timeout 300)
  B1024=(--global-batch 32); R18=(--model mlp --quick --global-batch 16 --steps 4)
  TRAIN=(--device cpu --model cifar_cnn --quick --global-batch 64 --num-samples 1024); TORCHRUN_DEV=(--device cpu)
  CB_B=32; CB=(--device cpu --model mlp --global-batch "$CB_B" --steps 3 --rounds 1 --warmup 2)
  CB_PROFILE=(--device cpu --model mlp); CB_COTENANT=cpu:1
  NODES_B=16; NODES_PROFILE=(--device cpu --model mlp); NODES_COTENANT_DEFAULT=cpu:1
  NODES_TRAIN=(--device cpu --model mlp --data-on-device --epochs 2 --max-steps-per-epoch 4)
  PR_B=16; PR_B_ACC=32; PR_JOIN=cpu; PR_COTENANT_DEFAULT=cpu:1; PR_SAMPLES=96; PR_EPOCHS=${PR_EPOCHS:-4}
  PR_PROFILE=(--device cpu --model mlp); PR_MEM=(); PR_EX=(--device cpu --arch mlp --image-size 8 --num-classes 10 --workers 0)
  PR_TRAIN=(--device cpu --model mlp --quick --num-samples 128)
  SL_B=16; SL_PROFILE=(--device cpu --model mlp); SL_TRAIN=(--device cpu --model mlp --data-on-device --epochs 2 --max-steps-per-epoch 4)
else
  NPROC=${NPROC:-$($PY -c "import torch; print(torch.cuda.device_count())")}
  CARD=$($PY -c "import torch; n=torch.cuda.get_device_name(0).split(); print((n[1] if len(n) > 1 else n[0]).lower())")
  DEV=cuda
  BENCH=(--device cuda --nproc "$NPROC" --model resnet50 --amp --global-batch $(( 256 * NPROC )) --steps "$STEPS"
         --rounds "$ROUNDS" --quiet)
  B1024=(--global-batch 1024); R18=(--model resnet18 --image-size 32 --global-batch 256 --steps 10)
  TRAIN=(--model resnet50 --amp --global-batch 512 --num-samples 122880); TORCHRUN_DEV=()
  CB_B=256; CB=(--model resnet50 --global-batch "$CB_B" --steps "$STEPS" --rounds "$ROUNDS")
  CB_PROFILE=(--model resnet50); CB_COTENANT=2:1,3:2
  NODES_B=512; NODES_PROFILE=(--model resnet50 --amp --dataset fake); NODES_COTENANT_DEFAULT=1:1,2:2
  NODES_TRAIN=(--model resnet50 --amp --data-on-device --epochs 3 --max-steps-per-epoch 25)
  # 4 GPUs: co-tenants 1 on GPU 2, 2 on GPU 3, one more joins GPU 1; ranks 0-1 memory-capped in (b).
  # 2 GPUs: 1 co-tenant on GPU 1, one joins GPU 0 (the fast rank slows: the plan must move work back); rank 0 capped.
  if [ "$NPROC" -ge 4 ]; then PR_COTENANT_DEFAULT=2:1,3:2; PR_JOIN=${PR_JOIN:-cuda:1}; PR_MEM_RANKS=${PR_MEM_RANKS:-0,1}
  else PR_COTENANT_DEFAULT=1:1; PR_JOIN=${PR_JOIN:-cuda:0}; PR_MEM_RANKS=${PR_MEM_RANKS:-0}; fi
  PR_B=${PR_B:-512}; PR_B_ACC=${PR_B_ACC:-1024}
  PR_SAMPLES=$(( PR_B * ${PR_STEPS:-40} )); PR_EPOCHS=${PR_EPOCHS:-8}
  PR_PROFILE=(--model resnet50 --amp --channels-last on); PR_MEM=(--emulate-memory "$(echo "$PR_MEM_RANKS" | sed -E "s/([0-9]+)/\1=${PR_MEM_GIB:-12}/g")")
  PR_EX=(--arch resnet50 --amp --channels-last --workers "${PR_WORKERS:-8}")
  PR_TRAIN=(--model resnet50 --amp --quick)
  SL_B=${SL_B:-512}; SL_PROFILE=(--model resnet50 --amp --dataset fake)
  SL_TRAIN=(--model resnet50 --amp --data-on-device --epochs 4 --max-steps-per-epoch 20)
fi
LAST=$(( NPROC - 1 ))
SKEW=${SKEW:-$( [ "$NPROC" -ge 4 ] && echo "2=2,3=4" || echo "$LAST=3" )}
S=(--strategies equal,proportional,plan)
TR=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC")

part() {  # part NAME CMD...: CMD's output into $OUT/NAME.log (at most $LIMIT s), its tail, exit status and seconds
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS mon=
  if [ -n "${HOSTMON:-}" ]; then $PY benchmarks/hostmon.py --out "$OUT/${name}_host.jsonl" & mon=$!; fi
  timeout -k 10 "$LIMIT" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  if [ -n "$mon" ]; then kill "$mon" 2>/dev/null; wait "$mon" 2>/dev/null; fi
  grep -v -E "^\s*$|Warning|warn\(|^\[" "$OUT/$name.log" | tail -"${PART_TAIL:-25}"
  echo "=== $name rc=$rc in $((SECONDS - t0)) s"
}

bench() {  # bench NAME ARGS...: one `planner bench` launch, its raw JSON and profile under $OUT
  local name=$1; shift
  local file="$OUT/${CARD}x${NPROC}_$name"
  part "$name" $PY -m planner bench "${BENCH[@]}" "$@" --json "$file.json" --profile-out "${file}_profile.json"
}

with_cotenant() {  # with_cotenant DEVICE CMD...: CMD while a co-tenant keeps DEVICE busy $DUTY of the time
  local dev=$1; shift
  $PY benchmarks/cotenant.py --device "$dev" --duty "$DUTY" > "$OUT/cotenant_load.log" 2>&1 &
  local load=$!
  sleep 10
  "$@"
  kill "$load" 2>/dev/null; wait "$load" 2>/dev/null
}

write_setup() {  # write_setup FILE KEY VALUE...: a part's setup as one JSON object of the pairs, for the summaries'
  # records; a pair `train "ARGS"` (the part's `planner train` arguments) stands for its model, bf16 autocast (--amp)
  # and inputs made on the device
  $PY - "$@" <<'PY'
import json, sys
path, pairs = sys.argv[1], dict(zip(sys.argv[2::2], sys.argv[3::2]))
if "train" in pairs:
    args = pairs.pop("train").split()
    pairs = {"model": args[args.index("--model") + 1], "amp": "--amp" in args, "data": "on device", **pairs}
json.dump(pairs, open(path, "w"))
PY
}

start_cotenants() {  # start_cotenants SPEC LOG: for each GPU:N of SPEC ("2:1,3:2"; cpu:N on CPU), N processes of
  local item dev i   # benchmarks/cotenant.py at duty $DUTY, their output appended to LOG; their pids in COTENANT_PIDS
  COTENANT_PIDS=()
  for item in ${1//,/ }; do
    dev=${item%%:*}; [ "$dev" != cpu ] && dev=cuda:$dev
    for i in $(seq 1 "${item#*:}"); do
      $PY benchmarks/cotenant.py --device "$dev" --duty "$DUTY" >> "$2" 2>&1 & COTENANT_PIDS+=($!)
    done
  done
}

train() {  # the loader-fed `planner train --auto --replan` launches, skew and loader interleaved launch by launch
  for i in $(seq 1 "$LAUNCHES"); do
    for case in skew loader; do
      local tag="$OUT/${case}_r$i" emulate
      if [ "$case" = skew ]; then emulate=(--emulate-slowdown 1=3); else emulate=(--emulate-loader 1=2); fi
      part "${case}_r${i}_train" "${TR[@]}" -m planner train --auto --replan "${TRAIN[@]}" "${emulate[@]}" \
        --epochs "$EPOCHS" --quiet --log-file "${tag}_run.jsonl" --plan-out "${tag}_plan.json" \
        --profile-out "${tag}_profile.json" --step-log "${tag}_steps{rank}.jsonl"
      [ -s "${tag}_run.jsonl" ] && part "${case}_r${i}_report" $PY -m planner report --profile "${tag}_profile.json" \
        --plan "${tag}_plan.json" --log "${tag}_run.jsonl" --out "${tag}_report.html" --json "${tag}_report.json"
    done
  done
}

nodes() {  # two torchrun agents on this host as two nodes of $NODE_A + $NODE_B ranks (c10d), co-tenants on node A
  local a=${NODE_A:-$(( NPROC - 1 ))} b=${NODE_B:-1} spec=${NODES_COTENANT:-$NODES_COTENANT_DEFAULT} pids=() i s
  local vis_a vis_b
  vis_a=$(seq -s, 0 $(( a - 1 ))); vis_b=$(seq -s, "$a" $(( a + b - 1 )))
  [ "$DEV" = cpu ] && { vis_a=; vis_b=; }
  start_cotenants "$spec" "$OUT/nodes_cotenant_load.log"; pids+=("${COTENANT_PIDS[@]}")
  sleep "${COTENANT_SETTLE:-10}"
  two_nodes() {  # two_nodes NAME ARGS...: `planner ARGS` on both agents, each its own --nproc-per-node; both awaited
    local name=$1; shift
    local port=$(( 29500 + RANDOM % 2000 )) t0=$SECONDS agents=() rc=0 node n vis host addr
    echo "=== $name: planner $*"
    for node in 0 1; do
      if [ "$node" = 0 ]; then n=$a vis=$vis_a host= addr=127.0.0.1; else n=$b vis=$vis_b host=node-b addr=127.0.0.2; fi
      ( [ -n "$vis" ] && export CUDA_VISIBLE_DEVICES=$vis; [ -n "$host" ] && export PLANNER_HOST_ID=$host
        exec timeout -k 10 "$LIMIT" $PY -m torch.distributed.run --nnodes 2 --nproc-per-node "$n" \
          --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$port" --rdzv-id "$name-$port" --local-addr "$addr" \
          --max-restarts 0 -m planner "$@" ) > "$OUT/${name}_node$node.log" 2>&1 &
      agents+=($!)
    done
    for node in 0 1; do wait "${agents[$node]}" || rc=$?; done
    grep -v -E "^\s*$|Warning|warn\(|^\[" "$OUT/${name}_node0.log" | tail -"${PART_TAIL:-12}"
    echo "=== $name rc=$rc in $((SECONDS - t0)) s"
  }
  local p="$OUT/nodes"
  rm -f "${p}_profile.json" "${p}"_*.jsonl
  write_setup "${p}_setup.json" train "${NODES_TRAIN[*]}" \
    nodes "$a + $b ranks: two torchrun agents on one host, c10d; node A GPUs ${vis_a:-cpu}, node B GPU ${vis_b:-cpu} (PLANNER_HOST_ID=node-b, --local-addr 127.0.0.2)" \
    heterogeneity "real co-tenants on node A: benchmarks/cotenant.py at duty $DUTY, GPU:processes $spec" \
    command "DUTY=$DUTY NODES_COTENANT=$spec LAUNCHES=$LAUNCHES benchmarks/gpu_suite.sh nodes"
  two_nodes nodes_profile profile "${NODES_PROFILE[@]}" --quick --no-loader --out "${p}_profile.json"
  if [ -s "${p}_profile.json" ]; then
    part nodes_plan $PY -m planner plan --profile "${p}_profile.json" --global-batch "$NODES_B" --out "${p}_plan.json"
    local eq prop
    eq=$($PY -c "print(','.join([str($NODES_B // $NPROC)] * $NPROC))")
    prop=$($PY -c "
import planner; from planner.cli.bench import proportional_split
print(','.join(map(str, proportional_split(planner.Profile.load('${p}_profile.json'), $NODES_B, 1))))")
    part nodes_equal_plan $PY -m planner plan --profile "${p}_profile.json" --global-batch "$NODES_B" \
      --from-batches "$eq" --force --out "${p}_equal.json"
    part nodes_prop_plan $PY -m planner plan --profile "${p}_profile.json" --global-batch "$NODES_B" \
      --from-batches "$prop" --force --out "${p}_proportional.json"
    for i in $(seq 1 "$LAUNCHES"); do
      for s in equal proportional plan; do
        [ -s "${p}_$s.json" ] && two_nodes "nodes_${s}_r$i" train --plan "${p}_$s.json" --profile "${p}_profile.json" \
          "${NODES_TRAIN[@]}" --log-file "${p}_${s}_r$i.jsonl" --quiet
      done
    done
  fi
  kill "${pids[@]}" 2>/dev/null; wait "${pids[@]}" 2>/dev/null
  $PY benchmarks/summarize_bench.py --nodes "$OUT" | tee "$OUT/nodes_summary.txt"
}

comm() {  # the communication breakdown under real co-tenants, then over sockets (the header says what it runs)
  local spec=${COTENANT:-$CB_COTENANT} pids=() plan=()
  local cb=("${TR[@]}" benchmarks/comm_breakdown.py "${CB[@]}" --json "$OUT/comm_breakdown.jsonl")
  local label="co-tenants $spec (GPU:processes, benchmarks/cotenant.py at duty $DUTY)"
  rm -f "$OUT/comm_profile.json" "$OUT/comm_plan.json"
  start_cotenants "$spec" "$OUT/comm_cotenant_load.log"; pids+=("${COTENANT_PIDS[@]}")
  sleep "${COTENANT_SETTLE:-10}"
  LIMIT=150 part comm_profile "${TR[@]}" -m planner profile "${CB_PROFILE[@]}" --dataset fake --quick --no-loader \
    --out "$OUT/comm_profile.json"
  [ -s "$OUT/comm_profile.json" ] && LIMIT=60 part comm_plan $PY -m planner plan --profile "$OUT/comm_profile.json" \
    --global-batch "$CB_B" --min-batch 2 --max-accumulation-steps 1 --out "$OUT/comm_plan.json"
  [ -s "$OUT/comm_plan.json" ] && plan=(--plan "$OUT/comm_plan.json")
  LIMIT=150 part comm_cotenant "${cb[@]}" --variants equal,plan "${plan[@]}" --label "$label"
  NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo LIMIT=200 part comm_slowlink \
    "${cb[@]}" --variants plan,plan+bf16 --warmup 5 "${plan[@]}" --label "$label; NCCL over sockets on lo"
  [ -s "$OUT/comm_plan.json" ] && LIMIT=200 part comm_choose "${cb[@]}" --choose all "${plan[@]}" \
    --plan-out "$OUT/comm_plan_ddp.json" --label "$label; DDP settings"
  kill "${pids[@]}" 2>/dev/null; wait "${pids[@]}" 2>/dev/null
}

promise() {  # does a plan keep the step time it prints (the header says what it runs)
  local spec=${PR_COTENANT:-$PR_COTENANT_DEFAULT} pids=() i v tag join= a=() b=() c=() t0=$SECONDS
  local budget=${PR_BUDGET:-500}
  trap 'kill ${pids[*]} $join 2>/dev/null' EXIT
  trap 'kill ${pids[*]} $join 2>/dev/null; exit 143' TERM INT
  left() { echo $(( budget - (SECONDS - t0) )); }
  go() {  # go NAME LIMIT CMD...: `part`, at most LIMIT s and never past the part's budget; skipped when it is spent
    local name=$1 lim=$2; shift 2
    if [ "$(left)" -lt 20 ]; then echo "=== $name skipped: the part's ${budget} s budget is spent"; return 1; fi
    [ "$(left)" -lt "$lim" ] && lim=$(left)
    LIMIT=$lim part "$name" "$@"
  }
  start_cotenants "$spec" "$OUT/promise_cotenant_load.log"; pids+=("${COTENANT_PIDS[@]}")
  echo "co-tenants $spec at duty $DUTY; joining at epoch 2: $PR_JOIN" > "$OUT/promise_setup.txt"
  sleep "${COTENANT_SETTLE:-8}"
  local cases=" ${PR_CASES:-a b c} "  # which of (a), (b), (c) to run (PR_CASES="b c": the two planner train cases)
  # (a) own loop: one profile and plan under the co-tenants
  [[ $cases == *" a "* ]] && go promise_a_profile 120 "${TR[@]}" -m planner profile "${PR_PROFILE[@]}" --dataset fake --quick --no-loader \
    --out "$OUT/promise_a_profile.json"
  [[ $cases == *" a "* ]] && go promise_a_plan 60 $PY -m planner plan --profile "$OUT/promise_a_profile.json" --global-batch "$PR_B" \
    --max-accumulation-steps 1 --out "$OUT/promise_a_plan.json"
  # then launch by launch: (a) planned and stock; (b) accumulation, ranks 0-1 memory-capped; (c) no DataLoader.
  # (b) and (c) profile in their first launch (--auto) and reuse that plan after it.
  for i in $(seq 1 "$LAUNCHES"); do
    for v in planned stock; do
      [[ $cases == *" a "* ]] || continue
      tag="$OUT/promise_a_${v}_r$i"; rm -f "${tag}_epochs.jsonl" "${tag}_run.jsonl"
      if [ "$v" = planned ]; then a=(--plan "$OUT/promise_a_plan.json" --profile "$OUT/promise_a_profile.json" \
        --log-file "${tag}_run.jsonl"); else a=(--batch-size $(( PR_B / NPROC ))); fi
      # The joiner sets up now and waits for its start file, touched the moment epoch 1's line appears: it loads
      # the GPU from epoch 2 on, without its own start-up (seconds) delaying the change by several short epochs.
      rm -f "${tag}_go"
      $PY benchmarks/cotenant.py --device "$PR_JOIN" --duty "$DUTY" --start-file "${tag}_go" \
        >> "$OUT/promise_cotenant_load.log" 2>&1 &
      join=$!
      (while ! grep -q '"epoch": 1,' "${tag}_epochs.jsonl" 2>/dev/null; do sleep 0.05; done
       touch "${tag}_go"; date +%s.%N > "${tag}_join.txt") &
      join="$join $!"
      go "promise_a_${v}_r$i" "${PR_LIMIT_A:-80}" "${TR[@]}" "examples/ddp_$v.py" "${PR_EX[@]}" "${a[@]}" \
        --num-samples "$PR_SAMPLES" --epochs "$PR_EPOCHS" --epoch-log "${tag}_epochs.jsonl"
      kill $join 2>/dev/null; wait $join 2>/dev/null; join=
    done
    for v in b c; do
      [[ $cases == *" $v "* ]] || continue
      tag="$OUT/promise_${v}_r$i"
      if [ "$v" = b ]; then c=("${PR_MEM[@]}" --global-batch "$PR_B_ACC" --num-samples $(( PR_B_ACC * ${PR_STEPS_B:-10} )))
        [ -z "${PR_B_LOADER:-}" ] && c+=(--data-on-device)
      else c=(--data-on-device --global-batch "$PR_B" --num-samples $(( PR_B * ${PR_STEPS_C:-15} ))); fi
      if [ ! -s "$OUT/promise_${v}_r1_plan.json" ]; then
        b=(--auto --plan-out "${tag}_plan.json" --profile-out "${tag}_profile.json")
      else
        b=(--plan "$OUT/promise_${v}_r1_plan.json" --profile "$OUT/promise_${v}_r1_profile.json")
      fi
      go "promise_${v}_r$i" "${PR_LIMIT_BC:-100}" "${TR[@]}" -m planner train "${PR_TRAIN[@]}" "${b[@]}" "${c[@]}" \
        --no-replan --epochs "${PR_EPOCHS_BC:-2}" --log-file "${tag}_run.jsonl"
    done
  done
  kill "${pids[@]}" 2>/dev/null; wait "${pids[@]}" 2>/dev/null; pids=(); trap - EXIT TERM INT
  echo "=== promise: $((SECONDS - t0)) s"
  $PY benchmarks/summarize_bench.py --promise "$OUT" | tee "$OUT/promise_summary.txt"
}

slowlink() {  # weighted bf16 against the uncompressed plan over NCCL sockets (the header says what it runs)
  local p="$OUT/slowlink" i c skew=${SL_SKEW:-$LAST=2}
  local -a slow=(env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo)
  [ "$DEV" = cpu ] && slow=(env)
  rm -f "${p}"_*.jsonl "${p}"_*.json
  write_setup "${p}_setup.json" train "${SL_TRAIN[*]}" \
    link "NCCL over sockets on one host: NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo" \
    heterogeneity "emulated compute skew: rank $skew (--emulate-slowdown)" \
    command "SL_SKEW=$skew LAUNCHES=$LAUNCHES benchmarks/gpu_suite.sh slowlink"
  for c in none bf16; do
    LIMIT=150 part "slowlink_${c}_profile" "${slow[@]}" "${TR[@]}" -m planner profile "${SL_PROFILE[@]}" --quick \
      --no-loader --emulate-slowdown "$skew" --grad-compress "$c" --out "${p}_${c}_profile.json"
    [ -s "${p}_${c}_profile.json" ] && part "slowlink_${c}_plan" $PY -m planner plan \
      --profile "${p}_${c}_profile.json" --global-batch "$SL_B" --out "${p}_${c}.json"
  done
  for i in $(seq 1 "$LAUNCHES"); do
    for c in none bf16; do
      [ -s "${p}_${c}.json" ] && LIMIT=120 part "slowlink_${c}_r$i" "${slow[@]}" "${TR[@]}" -m planner train \
        --plan "${p}_${c}.json" --profile "${p}_${c}_profile.json" "${SL_TRAIN[@]}" --emulate-slowdown "$skew" \
        --grad-compress "$c" --log-file "${p}_${c}_r$i.jsonl" --quiet
    done
  done
  $PY benchmarks/summarize_bench.py --slowlink "$OUT" | tee "$OUT/slowlink_summary.txt"
}

convergence() {  # weighted compression against uncompressed, one plan and seed (the header says what it runs)
  local p="$OUT/convergence" wl=() runs=${CONV_RUNS:-none bf16 fp16 lossscale} seen=" " b split c i n=$NPROC how
  local epochs=${CONV_EPOCHS:-5} seed=${CONV_SEED:-1} lr=${CONV_LR:-0.02} tr=("${TR[@]}") where
  if [ "$DEV" = cpu ]; then
    b=${CONV_B:-64}; wl=(--device cpu --model mlp --dataset benchmarks.comm_breakdown:learnable_cifar_tiny)
  else
    b=${CONV_B:-512}; wl=(--model resnet18 --amp --dataset benchmarks.comm_breakdown:learnable_cifar)
  fi
  where="$n ranks, one device each"
  if [ "$DEV" = cuda ] && [ "$NPROC" -lt 2 ]; then  # one GPU: two ranks share it over gloo (the numbers are the same)
    n=2; tr=("$PY" -m torch.distributed.run --standalone --nproc-per-node 2); wl+=(--device cuda:0)
    where="2 ranks sharing GPU 0, gloo"
  fi
  split=${CONV_SPLIT:-$($PY -c "b, n = $b, $n; s = [b * (3 if r == 0 else 1) // (n + 2) for r in range(n)]
s[0] += b - sum(s); print(','.join(map(str, s)))")}
  rm -f "${p}"_*.json "${p}"_*_run.jsonl "${p}_records.jsonl"
  write_setup "${p}_setup.json" workload "${wl[*]}" split "$split" seed "$seed" epochs "$epochs" lr "$lr" weighting hook \
    ranks "$where" command "CONV_RUNS='$runs' benchmarks/gpu_suite.sh convergence"
  if [ -n "${CONV_PROFILE:-}" ]; then cp "$CONV_PROFILE" "${p}_profile.json"  # another seed's runs: the same plan
  else LIMIT=180 part convergence_profile "${tr[@]}" -m planner profile "${wl[@]}" --quick --out "${p}_profile.json"; fi
  [ -s "${p}_profile.json" ] && LIMIT=60 part convergence_plan $PY -m planner plan --profile "${p}_profile.json" \
    --global-batch "$b" --from-batches "$split" --force --max-accumulation-steps 1 --out "${p}_plan.json"
  [ -s "${p}_plan.json" ] || { echo "=== convergence: no plan"; return; }
  for c in $runs; do
    seen+="$c "; i=$(grep -o " $c " <<< "$seen" | wc -l)
    how=(--weighting hook --grad-compress "$c")
    [ "$c" = lossscale ] && how=(--weighting loss-scale --grad-compress none)
    LIMIT=${CONV_LIMIT:-240} part "convergence_${c}_r$i" "${tr[@]}" -m planner train --plan "${p}_plan.json" "${wl[@]}" \
      --seed "$seed" --epochs "$epochs" --lr "$lr" "${how[@]}" --quiet --log-file "${p}_${c}_r${i}_run.jsonl"
  done
  $PY benchmarks/summarize_bench.py --convergence "$OUT" | tee "$OUT/convergence_summary.txt"
}

PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(equal skew loader cotenant mixed memory midrun)
for p in "${PARTS[@]}"; do
  case $p in
    env)        { nvidia-smi -L; nproc; $PY -c "import torch, scipy, numpy; print('torch', torch.__version__, \
'scipy', scipy.__version__, 'numpy', numpy.__version__, 'gpus', torch.cuda.device_count())"; } 2>&1 ;;
    equal)      bench equal "${S[@]}" --emulate-slowdown "$LAST=1" ;;
    skew)       bench skew "${S[@]}" --emulate-slowdown "$SKEW" ;;
    loader)     bench loader "${S[@]}" --data loader --emulate-loader 1=2 ;;
    cotenant)   with_cotenant "$( [ "$DEV" = cpu ] && echo cpu || echo "cuda:$LAST" )" bench cotenant "${S[@]}" \
                  --label "real co-tenant: a duty-$DUTY bf16 matmul loop on GPU $LAST" ;;
    mixed)      part mixed $PY -m planner bench --rank-devices "$( [ "$DEV" = cpu ] && echo cpu,cpu || echo cuda:0,cpu )" \
                  "${R18[@]}" "${S[@]}" --json "$OUT/${CARD}-cpu_mixed.json" ;;
    memory)     bench memory "${B1024[@]}" --emulate-memory 0=20 --emulate-slowdown 1=2 \
                  --strategies equal-accum,no-accum,plan ;;
    midrun)     bench midrun --late-slowdown 1=3 --strategies equal,plan+replan --replan-epochs 5 ;;
    train)      train ;;
    frameworks) for fw in lightning accelerate; do
                  part "$fw" "${TR[@]}" benchmarks/frameworks_gpu.py --framework "$fw" "${TORCHRUN_DEV[@]}" \
                    --json "$OUT/frameworks_$fw.json"
                done ;;
    hf)         part hf "${TR[@]}" benchmarks/hf_gpu.py ${TINY:+--tiny} --json "$OUT/hf_gpu.json" ;;
    exact)      part exact "${TR[@]}" benchmarks/gpu_accumulation_check.py "${TORCHRUN_DEV[@]}" \
                  --json "$OUT/gpu_accumulation_check.json"
                [ "$DEV" = cuda ] && part syncbn "${TR[@]}" benchmarks/gpu_syncbn_check.py ;;
    predict)    part predict $PY benchmarks/gpu_profile_check.py --model "$( [ "$DEV" = cpu ] && echo mlp || echo resnet50 )" \
                  --device "$( [ "$DEV" = cpu ] && echo cpu || echo cuda:0 )" --out "$OUT/gpu_profile_check.json" ;;
    causes)     part causes $PY benchmarks/gpu_causes_check.py --device "$DEV" --nproc "$NPROC" --cotenant-rank "$LAST" \
                  --out-dir "$OUT" ;;
    overhead)   part overhead "${TR[@]}" benchmarks/comm_breakdown.py --overhead --json "$OUT/hook_overhead.json" ;;
    comm)       comm ;;
    nodes)      nodes ;;
    promise)    promise ;;
    convergence) convergence ;;
    slowlink)   slowlink ;;
    profile)    t0=$(date +%s.%N)
                part profile "${TR[@]}" -m planner profile --model resnet50 --dataset fake --out "$OUT/profile_wall.json"
                $PY -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f} s wall, $NPROC ranks')" \
                  "$t0" "$(date +%s.%N)" | tee "$OUT/profile_wall.txt" ;;
    sampler)    part sampler $PY benchmarks/sampler_bench.py --json "$OUT/sampler.json" ;;
    *) echo "unknown part $p" >&2; exit 2 ;;
  esac
done
