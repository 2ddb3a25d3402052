# Sourced by the benchmarks/gpu_*.sh scripts: the repository root, the environment every GPU part runs under
# (NVLink multicast off), $OUT, a 2-rank torchrun ($TR), and `part NAME CMD...`, which runs CMD into
# $OUT/NAME.log and prints its last $PART_TAIL meaningful lines (default 25), its exit status and its seconds.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
TR="python3 -m torch.distributed.run --standalone --nproc-per-node 2"

part() {
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  grep -v -E "^\s*$|Warning|warn\(|^\[" "$OUT/$name.log" | tail -"${PART_TAIL:-25}"
  echo "=== $name rc=$rc in $((SECONDS - t0)) s"
}
