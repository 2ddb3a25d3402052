#!/usr/bin/env bash
# Session 5 on a 4-GPU host (docs/BENCHMARKS.md section 13).  Parts, in the order given:
#   ab      two 2-rank launches at once, ResNet-50 bf16 B=512, rank 1 emulated 3x slower: GPUs 0,1 with the
#           interleaved emulation (the default), GPUs 2,3 with the old block emulation (PLANNER_EMULATE_MODE=block)
#   f4      4 ranks, F = [1, 1, 2, 4], B = 1024 (emulation mode $F4_MODE, default block)
#   cot4    4 ranks, real co-tenants (benchmarks/cotenant.py) on GPU 2 (duty 0.3) and GPU 3 (duty 0.6), B = 1024
#   cot4h   the same with heavy co-tenants: one full-duty loop on GPU 2, two on GPU 3
#   prof4   wall time of a 4-rank `planner profile --model resnet50 --dataset fake` (fp32 224), and its loader spread
#   sweep   2 ranks, F = 1.5, 2, 4 (one launch each); loader  2 ranks, --data loader --emulate-loader 1=2
#   stall-F 2 ranks at F with the stall emulation (PLANNER_EMULATE_MODE=stall), 3 rounds, step logs (e.g. stall-3:
#           session 16 ran the plan alone at F = 3 on device, 0.983 of ideal at -0.6%; #16 asks equal and
#           proportional beside it, section 24)
#   sweep2  F = 1.5 (GPUs 0,1) beside F = 2 (GPUs 2,3), then F = 4 beside the loader skew, two launches at a time
#   pair-F  2 ranks at F: interleaved emulation on GPUs 0,1 beside block emulation on GPUs 2,3 (e.g. pair-3)
#   sweep-interleave  F = 1.5 (GPUs 0,1) beside F = 2 (GPUs 2,3), interleaved emulation
#   hf      benchmarks/hf_gpu.py (HF Trainer, 110M LM) on GPUs 0,1 (factors $HF_FACTORS, default 2,3; $HF_ARGS
#           passes through, e.g. HF_ARGS=--tiny for a CPU dry run)
#   hf-loader  hf (F = 3) on GPUs 2,3 beside the loader-skew bench on GPUs 0,1
#   mech    benchmarks/loader_mechanism.py (CPU only); hf-mech-loader  hf, then mech, on GPUs 2,3 beside the
#           loader-skew bench on GPUs 0,1 (with CPUSPLIT=1 each side has its own half of the cores)
#   train18 benchmarks/loader_gpu.sh: the skew and mid-run cases on GPUs 0,1 beside the loader case, then a
#           10-epoch skew launch, on GPUs 2,3 (CPUSPLIT=1 gives each pair half the cores)
# Result names end in $TAG (default s5).  Session 5's "ab" and "f4" ran before the interleaved mode took its final
# form: their "interleave" files are the abandoned sliced variant (renamed *_slices_s5 in docs/results).
# Every part writes under $WORK (default /tmp/s5) and $OUT/s5.tar is refreshed after each part, so a run cut
# short still returns what it finished.   TINY=1 runs the logic on CPU with an MLP in seconds.
set -uo pipefail
source "$(dirname "$0")/_gpu_common.sh"
WORK=${WORK:-/tmp/s5}; mkdir -p "$WORK"
PY=${PYTHON:-python3}
LIMIT=${LIMIT:-200}  # seconds per part
TAG=${TAG:-s5}
if [ -n "${TINY:-}" ]; then
  CARD=cpu
  B2=(--device cpu --nproc 2 --model mlp --quick --global-batch 16 --steps 4 --rounds 1 --quiet --timeout 120)
  B4=(--device cpu --nproc 4 --model mlp --quick --global-batch 32 --steps 4 --rounds 1 --quiet --timeout 120)
  COT_DEV=(cpu cpu)
else
  CARD=$($PY -c "import torch; n=torch.cuda.get_device_name(0).split(); print((n[1] if len(n) > 1 else n[0]).lower())")
  # No --quiet: the bench's progress lines ("[bench  12s] ...") land in the part's log, so a launch stopped by
  # $LIMIT still says where its time went (part() leaves them out of the printed tail); the numbers so far are in
  # <json>.partial.json.
  B2=(--device cuda --nproc 2 --model resnet50 --amp --global-batch 512 --steps 20 --rounds 3)
  B4=(--device cuda --nproc 4 --model resnet50 --amp --global-batch 1024 --steps 15 --rounds 3)
  COT_DEV=(cuda:2 cuda:3)
fi
S=(--strategies equal,proportional,plan)
OUT_SAVE=$OUT
pack() { tar -cf "$OUT_SAVE/s5.tar" -C "$WORK" . 2>/dev/null; }
b2() { local name=$1; shift; part "$name" timeout "$LIMIT" $PY -m planner bench "${B2[@]}" "${S[@]}" "$@" \
         --json "$WORK/${CARD}x2_${name}.json" --profile-out "$WORK/${CARD}x2_${name}_profile.json"; }
b4() { local name=$1; shift; part "$name" timeout "$LIMIT" $PY -m planner bench "${B4[@]}" "${S[@]}" "$@" \
         --json "$WORK/${CARD}x4_${name}.json" --profile-out "$WORK/${CARD}x4_${name}_profile.json"; }
OUT=$WORK  # part() writes NAME.log under $OUT: keep the logs with the results
PIDS=(); LOGS=()
# CPUSPLIT=1: each side-by-side launch gets its own half of the host's cores (GPUs 0,1 the first half, 2,3 the
# second), so two launches with real DataLoaders do not share loader cores; the profiler reads the affinity.
pin() {  # pin GPUS: under CPUSPLIT=1, restrict this (sub)shell and so its children to GPUS' half of the cores
  [ -n "${CPUSPLIT:-}" ] && command -v taskset > /dev/null || return 0
  local n; n=$(nproc --all); local h=$(( n / 2 )) cores
  case $1 in 0,1) cores=0-$(( h - 1 )) ;; 2,3) cores=$h-$(( n - 1 )) ;; *) return 0 ;; esac
  taskset -cp "$cores" "$BASHPID" > /dev/null
}
beside() {  # beside GPUS LOG CMD...: CMD in the background on GPUS (a 2-rank launch per GPU pair), output in $WORK/LOG
  local gpus=$1 log=$2; shift 2
  ( pin "$gpus"; CUDA_VISIBLE_DEVICES=$gpus "$@" ) > "$WORK/$log" 2>&1 &
  PIDS+=($!); LOGS+=("$WORK/$log")
}
together() {  # wait for every `beside` command, then print their outputs in the order they were started
  wait "${PIDS[@]}"; cat "${LOGS[@]}"; PIDS=(); LOGS=()
}

for p in "$@"; do
  case $p in
    ab) beside 0,1 ab_interleave.txt b2 resnet50_F3_interleave_$TAG --emulate-slowdown 1=3
        PLANNER_EMULATE_MODE=block beside 2,3 ab_block.txt b2 resnet50_F3_block_$TAG --emulate-slowdown 1=3
        together ;;
    f4) PLANNER_EMULATE_MODE=${F4_MODE:-block} b4 resnet50_F1124_${F4_MODE:-block}_$TAG --emulate-slowdown 2=2,3=4 ;;
    cot4) $PY benchmarks/cotenant.py --device "${COT_DEV[0]}" --duty 0.3 > "$WORK/cotenant_gpu2.log" 2>&1 &
          c1=$!
          $PY benchmarks/cotenant.py --device "${COT_DEV[1]}" --duty 0.6 > "$WORK/cotenant_gpu3.log" 2>&1 &
          c2=$!
          sleep 5
          b4 resnet50_cotenant_$TAG --label "real co-tenants: duty-0.3 bf16 matmul loop on GPU 2, duty-0.6 on GPU 3"
          kill $c1 $c2 2>/dev/null; wait $c1 $c2 2>/dev/null ;;
    prof4) t0=$(date +%s.%N)
           part "prof4_$TAG" timeout "$LIMIT" $PY -m torch.distributed.run --standalone --nproc-per-node "${NPROC4:-4}" \
             -m planner profile --model resnet50 --dataset fake ${TINY:+--device cpu --model mlp --quick} \
             --out "$WORK/${CARD}x4_profile_speed_$TAG.json"
           $PY -c "import sys; print('prof4 wall', round(float(sys.argv[2]) - float(sys.argv[1]), 1), 's')" \
             "$t0" "$(date +%s.%N)" | tee "$WORK/prof4_$TAG.wall" ;;
    cot4h) pids=()
           $PY benchmarks/cotenant.py --device "${COT_DEV[0]}" --duty 1 > "$WORK/cotenant_gpu2.log" 2>&1 & pids+=($!)
           for i in 1 2; do
             $PY benchmarks/cotenant.py --device "${COT_DEV[1]}" --duty 1 > "$WORK/cotenant_gpu3_$i.log" 2>&1 & pids+=($!)
           done
           sleep 5
           b4 resnet50_cotenant_heavy_$TAG --label "real co-tenants: one full-duty bf16 matmul loop on GPU 2, two on GPU 3"
           kill "${pids[@]}" 2>/dev/null; wait "${pids[@]}" 2>/dev/null ;;
    sweep2) beside 0,1 sw1.txt b2 "resnet50_F1.5_$TAG" --emulate-slowdown 1=1.5
            beside 2,3 sw2.txt b2 "resnet50_F2_$TAG" --emulate-slowdown 1=2
            together; pack
            beside 0,1 sw3.txt b2 "resnet50_F4_$TAG" --emulate-slowdown 1=4
            beside 2,3 sw4.txt b2 "resnet50_loader_skew_$TAG" --data loader --emulate-loader 1=2
            together ;;
    pair-*)  # pair-F: F with the interleaved emulation on GPUs 0,1 beside the block emulation on GPUs 2,3
            f=${p#pair-}
            PLANNER_EMULATE_MODE=interleave beside 0,1 p1.txt b2 "resnet50_F${f}_interleave_$TAG" --emulate-slowdown "1=$f"
            PLANNER_EMULATE_MODE=block beside 2,3 p2.txt b2 "resnet50_F${f}_block_$TAG" --emulate-slowdown "1=$f"
            together ;;
    sweep-interleave)
            PLANNER_EMULATE_MODE=interleave beside 0,1 sw1.txt b2 "resnet50_F1.5_interleave_$TAG" --emulate-slowdown 1=1.5
            PLANNER_EMULATE_MODE=interleave beside 2,3 sw2.txt b2 "resnet50_F2_interleave_$TAG" --emulate-slowdown 1=2
            together ;;
    train18)  # #18: `planner train --auto --replan` with the real DataLoader (benchmarks/loader_gpu.sh): the skew
              # and mid-run cases on GPUs 0,1 beside the loader case and then one 10-epoch skew launch (the
              # churn check) on GPUs 2,3.  Budgets: BUDGET_A (default 500 s), BUDGET_B (330 s) + BUDGET_C (190 s)
        mkdir -p "$WORK/train18_a" "$WORK/train18_b" "$WORK/train18_churn"
        OUT="$WORK/train18_a" CASES="skew midrun" BUDGET_S=${BUDGET_A:-500} beside 0,1 t18a.txt \
          bash benchmarks/loader_gpu.sh
        OUT="$WORK/train18_b" CASES=loader BUDGET_S=${BUDGET_B:-330} beside 2,3 t18b.txt bash -c \
          'bash benchmarks/loader_gpu.sh; OUT=$0 CASES=skew LAUNCHES=1 EPOCHS=10 NUM_SAMPLES=20480 \
             BUDGET_S=$1 bash benchmarks/loader_gpu.sh' "$WORK/train18_churn" "${BUDGET_C:-190}"
        together ;;
    sweep) for f in 1.5 2 4; do b2 "resnet50_F${f}_$TAG" --emulate-slowdown "1=$f"; done ;;
    stall-*) f=${p#stall-}; PLANNER_EMULATE_MODE=stall b2 "resnet50_F${f}_stall_$TAG" --emulate-slowdown "1=$f" \
          --step-log "$WORK/${CARD}x2_resnet50_F${f}_stall_${TAG}_steps_{strategy}_r{round}_{rank}.jsonl" ;;
    loader)  # about 300 s with its standalone "ideal" part on 2x H100 (session 14: LIMIT=290 cut it before that)
        LIMIT=$(( LIMIT > ${LOADER_LIMIT:-360} ? LIMIT : ${LOADER_LIMIT:-360} )) \
          b2 resnet50_loader_skew_$TAG --data loader --emulate-loader 1=2 \
            --step-log "$WORK/${CARD}x2_resnet50_loader_skew_${TAG}_steps_{strategy}_r{round}_{rank}.jsonl" ;;
    hf) CUDA_VISIBLE_DEVICES=0,1 part hf timeout "$LIMIT" $TR benchmarks/hf_gpu.py --factors "${HF_FACTORS:-2,3}" ${HF_ARGS:-} \
          --json "$WORK/${CARD}x2_hf_trainer_$TAG.json" ;;
    hf-loader)  # the HF Trainer bench (F = 3) on GPUs 2,3 beside the loader-skew bench on GPUs 0,1
        beside 2,3 hf.txt part hf timeout "$LIMIT" $TR benchmarks/hf_gpu.py --factors "${HF_FACTORS:-3}" \
          --json "$WORK/${CARD}x2_hf_trainer_$TAG.json"
        beside 0,1 ld.txt b2 "resnet50_loader_skew_$TAG" --data loader --emulate-loader 1=2
        together ;;
    mech)  # benchmarks/loader_mechanism.py (CPU only): why the profiled loader cost misses training's
        part mech timeout "$LIMIT" $PY benchmarks/loader_mechanism.py --json "$WORK/${CARD}_loader_mechanism_$TAG.json" ;;
    hf-mech-loader)  # hf then mech on GPUs 2,3 (their half of the cores) beside the loader-skew bench on GPUs 0,1
        beside 2,3 hf.txt bash -c "$(declare -f part); OUT=$WORK; \
          part hf timeout $LIMIT $TR benchmarks/hf_gpu.py --factors ${HF_FACTORS:-2,3} ${HF_ARGS:-} \
            --json $WORK/${CARD}x2_hf_trainer_$TAG.json; \
          part mech timeout 150 $PY benchmarks/loader_mechanism.py --json $WORK/${CARD}_loader_mechanism_$TAG.json"
        beside 0,1 ld.txt b2 "resnet50_loader_skew_$TAG" --data loader --emulate-loader 1=2
        together ;;
    *) echo "unknown part $p"; exit 2 ;;
  esac
  pack
done
