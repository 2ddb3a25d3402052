#!/usr/bin/env bash
# Session 8 on a 2-GPU host: the loader-fed measurements of issues #16 and #18 after the whole-worker-cycle
# timing (runtime.timing.worker_cycle).  Parts, in the order given:
#   bench     planner bench --data loader --emulate-loader 1=2 (ResNet-50 bf16, B = 512, 3 rounds; gpu_session5.sh's
#             "loader" part), LIMIT seconds at most
#   mech      benchmarks/loader_mechanism.py (CPU only, ~3 minutes): warm-up, batch size, two loaders at once, and
#             the drift of one loader alone against the plan's two together (DRIFT_S seconds each, default 40)
#   idle      IDLE_S seconds (default 20) of nothing: hostmon's baseline
#   h2d       benchmarks/h2d_probe.py on GPU 0 (~1 minute): a batch's host-to-device copy, on the compute stream or
#             prefetched on a side stream, against a step on a batch already on the GPU (section 17's 5-11 ms gap)
#   handover  benchmarks/handover_probe.py (~1 minute): batches/s a DataLoader hands the loop with the workers'
#             build cost taken away, pin_memory on and off (session 10's 150-195 ms a delivered batch);
#             HANDOVER_ARGS passes more, e.g. "--batch 32,128,455 --load 24 --pin-only" (sizes, under load)
#   gate      the GPU tests of the emulation (tests/profiler/test_emulate.py -k "gpu or calibration", ~60 s, output
#             in $WORK/gpu_tests.txt); when any fails the later parts are skipped, so a broken emulation does not
#             spend a call's launches (session 15's call 2 did: 478 s of void skew numbers)
#   contention  benchmarks/cpu_contention_probe.py on GPU 0 (~2 minutes): rank 0's compute span beside 0-30 CPU
#             burners running the PIL pipeline, nice'd or kept off its cores (session 16: the skew case's compute tail)
#             CONTENTION_ARGS passes more, e.g. "--batch 393 --conditions idle,burn30"
#   s5-<part>  benchmarks/gpu_session5.sh's part <part> (e.g. s5-stall-3: the F = 3 bench with the stall emulation,
#             3 rounds), its files under $WORK/s5
#   t18-<cases>  benchmarks/loader_gpu.sh with CASES="<cases>" (comma-separated, e.g. t18-loader, t18-skew,midrun),
#             LAUNCHES launches each, BUDGET_S seconds at most
#   t18pair   on a 4-GPU host: loader_gpu.sh with CASES=$A_CASES on GPUs 0,1 and the first half of the cores, beside
#             CASES=$B_CASES on GPUs 2,3 and the second half (so each launch has what a 2-GPU host gives it), files
#             under $WORK/t18a_<cases> and $WORK/t18b_<cases>; A_ENV/B_ENV add settings to one side only, e.g.
#             B_ENV="EPOCHS=10 NUM_SAMPLES=40960 LAUNCHES=2"
# benchmarks/hostmon.py samples the host (busy cores, steal, cgroup throttling, MHz, top processes) every second
# into $WORK/hostmon.jsonl through all parts, and $WORK/marks.txt holds "unix_time part" at each part's start.
# Every part's files go under $WORK and $OUT/s8.tar is refreshed after each part: a device call returns at most
# 8 files, so everything travels as this one tar (session 8's first #18 call lost 35 of its 43 files).
#   usage: TAG=s8 LIMIT=330 LAUNCHES=3 BUDGET_S=220 bash benchmarks/gpu_session8.sh bench t18-loader
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=${WORK:-/tmp/s8}; mkdir -p "$WORK"
OUT_SAVE=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT_SAVE"
pack() { tar -cf "$OUT_SAVE/s8.tar" -C "$WORK" . 2>/dev/null; }
python3 "$HERE/hostmon.py" --out "$WORK/hostmon.jsonl" --interval 1 & MON=$!
trap 'kill $MON 2>/dev/null; wait $MON 2>/dev/null; pack' EXIT
for p in "$@"; do
  echo "$(date +%s.%N) $p" >> "$WORK/marks.txt"
  case $p in
    bench) mkdir -p /tmp/s8_s5tar; WORK=$WORK/bench OUT=/tmp/s8_s5tar bash "$HERE/gpu_session5.sh" loader ;;
    s5-*) mkdir -p /tmp/s8_s5tar; WORK=$WORK/s5 OUT=/tmp/s8_s5tar bash "$HERE/gpu_session5.sh" "${p#s5-}" ;;
    t18-*) cases=${p#t18-}; dir=$WORK/t18_${cases//,/_}; mkdir -p "$dir"
           OUT=$dir CASES="${cases//,/ }" LAUNCHES=${LAUNCHES:-3} BUDGET_S=${BUDGET_S:-500} \
             bash "$HERE/loader_gpu.sh" 2>&1 | tee "$dir/loader_gpu.log" ;;
    t18pair) n=$(nproc --all); h=$(( n / 2 )); pids=(); logs=()
           for side in a b; do
             if [ $side = a ]; then c=${A_CASES:-skewS}; g=0,1; cores=0-$(( h - 1 )); e=${A_ENV:-}
             else c=${B_CASES:-loader}; g=2,3; cores=$h-$(( n - 1 )); e=${B_ENV:-}; fi
             dir=$WORK/t18${side}_${c//,/_}; mkdir -p "$dir"; logs+=("$dir/loader_gpu.log")
             # shellcheck disable=SC2086  # $e is a list of VAR=value words
             env CUDA_VISIBLE_DEVICES=$g OUT="$dir" CASES="${c//,/ }" LAUNCHES=${LAUNCHES:-3} BUDGET_S=${BUDGET_S:-500} $e \
               taskset -c "$cores" bash "$HERE/loader_gpu.sh" > "$dir/loader_gpu.log" 2>&1 & pids+=($!)
           done
           wait "${pids[@]}"; for l in "${logs[@]}"; do echo "== $l"; cat "$l"; done ;;
    mech) mkdir -p "$WORK/mech"; python3 "$HERE/loader_mechanism.py" --json "$WORK/mech/loader_mechanism.json" \
            --drift-s "${DRIFT_S:-40}" ${DRIFT_ONLY:+--drift-only} 2>&1 | grep -v -E "UserWarning|check_worker" | tee "$WORK/mech/loader_mechanism.log" ;;
    gate) timeout 150 python3 -m pytest -q -p no:cacheprovider -rA -s --tb=line "$HERE/../tests/workloads/test_emulate.py" \
            -k "gpu or calibration" 2>&1 | grep -v Warning | tail -30 | tee "$WORK/gpu_tests.txt"
          if ! grep -qE "^[0-9]+ passed" "$WORK/gpu_tests.txt" || grep -qE "failed|error" "$WORK/gpu_tests.txt"; then
            echo "gate: the GPU tests did not all pass; the later parts are skipped"; pack; exit 1
          fi ;;
    contention) mkdir -p "$WORK/contention"; timeout 300 python3 "$HERE/cpu_contention_probe.py" ${CONTENTION_ARGS:-} \
           --json "$WORK/contention/cpu_contention_probe.json" 2>&1 | grep -v -E "UserWarning|warn" \
           | tee "$WORK/contention/cpu_contention_probe.log" ;;
    idle) sleep "${IDLE_S:-20}" ;;  # the host monitor's probe on an idle host, as a baseline
    h2d) mkdir -p "$WORK/h2d"; timeout 240 python3 "$HERE/h2d_probe.py" --json "$WORK/h2d/h2d_probe.json" 2>&1 \
           | tee "$WORK/h2d/h2d_probe.log" ;;
    handover) mkdir -p "$WORK/handover"; timeout 240 python3 "$HERE/handover_probe.py" --workers "${HANDOVER_WORKERS:-4,16,28}" ${HANDOVER_ARGS:-} \
           --json "$WORK/handover/handover_probe.json" 2>&1 | grep -v -E "UserWarning|check_worker" \
           | tee "$WORK/handover/handover_probe.log" ;;
    *) echo "unknown part $p" >&2; exit 2 ;;
  esac
  pack
done
pack
