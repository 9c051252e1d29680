#!/usr/bin/env bash
# One device call for the single-GPU test suite: build the kernels the GPU tests need on every
# core (benchmarks/collect_kernels.py, from a list collected ahead), then the suite split in two
# halves over the GPUs present (one GPU: one after the other); a command given as arguments
# runs after the second half, on its GPU. Logs and results under $OUT.
#   KERNELS=.kcache/collected.pkl MOKGEN_COMMIT=<sha> bash benchmarks/device_suite.sh [cmd ...]
# Collect the list afresh each session, from the halves' files (here, ~6 min; carry the pkl):
#   python -m pytest -p benchmarks.collect_kernels -m gpu $A $B --collect-out .kcache/X.pkl
# (a list made for a few files leaves the rest to build one by one inside the tests, which
# then outrun the call: session 31 lost a call that way.)
# BENCH_ARGS="--backward ..." also builds the layers `python -m mokgen bench $BENCH_ARGS` runs.
# EXTRA_CACHE=$PWD/.build/kc: the command's kernel cache (prebuilt here and carried as .build).
# HALVES="a" or "b": one half only (on one GPU both halves take longer than a call may run).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MOKGEN_CACHE=${MOKGEN_CACHE:-$PWD/.kcache}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,clocks.sm,memory.used --format=csv,noheader
KERNELS=${KERNELS:-.kcache/collected.pkl}
[ -f "$KERNELS" ] && timeout 240 python3 benchmarks/collect_kernels.py "$KERNELS" \
  ${BENCH_ARGS:+--bench "$BENCH_ARGS"} 2>&1 | tail -2
A="tests/test_gpu_memory.py tests/test_gpu_shapes.py tests/test_gpu_widths.py tests/test_gpu_module.py
   tests/test_gpu_backward.py tests/test_gpu_forward.py tests/test_gpu_trace.py"
B="tests/test_gpu_fp8.py tests/test_gpu_reliability.py tests/test_gpu_transformers.py
   tests/test_gpu_prologue.py tests/test_gpu_directions.py"
NG=$(nvidia-smi -L | wc -l)
GA=0 GB=$(( NG > 1 ? 1 : 0 ))
half() {  # name gpu files...
  local name=$1 gpu=$2; shift 2
  # a test past 120 s dumps every thread's Python stack into the log (a hang shows where)
  CUDA_VISIBLE_DEVICES=$gpu timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -m gpu \
    -o faulthandler_timeout=120 "$@" > "$OUT/pytest_$name.log" 2>&1
  echo "== pytest $name (GPU $gpu): $(tail -1 "$OUT/pytest_$name.log")"
}
HALVES=${HALVES:-a b}
PA=
if [[ $HALVES == *a* ]]; then
  if [ "$NG" -gt 1 ]; then
    half a $GA $A &
    PA=$!
  else
    half a $GA $A
  fi
fi
[[ $HALVES == *b* ]] && half b $GB $B
if [ $# -gt 0 ]; then
  CUDA_VISIBLE_DEVICES=$GB MOKGEN_CACHE=${EXTRA_CACHE:-$MOKGEN_CACHE} \
    timeout ${EXTRA_TIMEOUT:-300} "$@" > "$OUT/extra.log" 2>&1
  echo "== extra: exit $?"; tail -${EXTRA_TAIL:-30} "$OUT/extra.log"
fi
[ -n "$PA" ] && wait $PA
# exit status 1 only when a test failed (a bare grep with no match made every clean run read 1)
fails=$(grep -h "^FAILED\|^ERROR" "$OUT"/pytest_*.log | head -20)
[ -z "$fails" ] || { echo "$fails"; exit 1; }
