# next session, call C (carry .build/ab: the trees main and own and own_plans.pkl, exported
# and collected in session 23; root = main): branch own-routes. own-routes: the route kernel
# also writes the call's routes into tensors of its own (no routes_of clones), and launches
# take the current stream's raw handle (no torch Stream object a launch).
#   bash next_C.sh tests   its GPU tests (~6 min); then at once, on the warm machine:
#   bash next_C.sh ab      host_overhead and replay_cost, main / own alternated (~5 min)
# Outputs: $OUT/c_$1.tgz, rewritten after every step.
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
W=/tmp/wC_$1; mkdir -p $W; T0=$(date +%s); ROOT=$PWD; export MOKGEN_CACHE=$ROOT/.kc
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $W/steps.log; tar -czf $OUT/c_$1.tgz -C $W .; }
if [ "$1" = tests ]; then
  cd $ROOT/.build/ab/own
  # the tests' kernels (own_plans.pkl: collected with benchmarks.collect_kernels)
  PYTHONPATH=$PWD timeout 90 python3 benchmarks/collect_kernels.py ../own_plans.pkl \
    > $W/build.log 2>&1
  el "built: $(tail -n 1 $W/build.log)"
  PYTHONPATH=$PWD timeout 130 python3 -m pytest -q -m gpu -o faulthandler_timeout=120 \
    tests/test_gpu_prologue.py tests/test_gpu_module.py > $W/pytest_1.log 2>&1
  el "prologue + module: $(tail -n 1 $W/pytest_1.log)"
  PYTHONPATH=$PWD timeout 170 python3 -m pytest -q -m gpu -o faulthandler_timeout=160 \
    tests/test_gpu_memory.py tests/test_gpu_forward.py > $W/pytest_2.log 2>&1
  el "memory + forward: $(tail -n 1 $W/pytest_2.log)"
  grep -hE "FAILED|ERROR" $W/pytest_*.log | head
else
  i=0
  for side in main own main own; do
    i=$((i + 1))
    (cd $ROOT/.build/ab/$side && PYTHONPATH=$PWD timeout 45 python3 benchmarks/host_overhead.py \
      > $W/host_${side}_$i.txt 2>&1)
    el "host $side: $(grep '^{"shape' $W/host_${side}_$i.txt | cut -c1-260)"
  done
  for side in main own main own; do
    i=$((i + 1))
    (cd $ROOT/.build/ab/$side && PYTHONPATH=$PWD timeout 60 python3 benchmarks/replay_cost.py \
      --shapes qwen3-30b-a3b --variants pull --layers 1,4 --out $W/rc$i > $W/rc$i.log 2>&1)
    el "replay_cost $side: $(grep '|' $W/rc$i.log | sed -E 's/\(([0-9]+) TFLOP[^|]*//g' | cut -c1-200)"
  done
fi
