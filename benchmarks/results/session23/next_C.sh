# next session, call C (carry .build/ab: main and own-routes exported by
# benchmarks/results/session23's note; root = main): branch own-routes' GPU tests, then its
# host time against main's, trees alternated. own-routes: the route kernel also writes the
# call's routes into tensors of its own (no routes_of clones), and launches take the current
# stream's raw handle (no torch Stream object a launch). Outputs: $OUT/c.tgz.
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
W=/tmp/wC; mkdir -p $W; T0=$(date +%s); ROOT=$PWD; export MOKGEN_CACHE=$ROOT/.kc
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $W/steps.log; tar -czf $OUT/c.tgz -C $W .; }
cd $ROOT/.build/ab/own
# the tests' kernels (.build/ab/own_plans.pkl: collected here with benchmarks.collect_kernels)
PYTHONPATH=$PWD timeout 90 python3 benchmarks/collect_kernels.py ../own_plans.pkl > $W/build.log 2>&1
el "built: $(tail -n 1 $W/build.log)"
PYTHONPATH=$PWD timeout 130 python3 -m pytest -q -m gpu -o faulthandler_timeout=140 \
  tests/test_gpu_prologue.py tests/test_gpu_module.py > $W/pytest_1.log 2>&1
el "prologue + module: $(tail -n 1 $W/pytest_1.log)"
PYTHONPATH=$PWD timeout 150 python3 -m pytest -q -m gpu -o faulthandler_timeout=140 \
  tests/test_gpu_memory.py tests/test_gpu_forward.py > $W/pytest_2.log 2>&1
el "memory + forward: $(tail -n 1 $W/pytest_2.log)"
grep -hE "FAILED|ERROR" $W/pytest_*.log | head
i=0
for side in main own main own; do
  i=$((i + 1))
  (cd $ROOT/.build/ab/$side && PYTHONPATH=$PWD timeout 45 python3 benchmarks/host_overhead.py \
    > $W/host_${side}_$i.txt 2>&1)
  el "host $side: $(grep '^{"shape' $W/host_${side}_$i.txt | cut -c1-260)"
done
for side in main own main own; do
  i=$((i + 1))
  (cd $ROOT/.build/ab/$side && PYTHONPATH=$PWD timeout 50 python3 benchmarks/replay_cost.py \
    --shapes qwen3-30b-a3b --variants pull --layers 1,4 --out $W/rc$i > $W/rc$i.log 2>&1)
  el "replay_cost $side: $(grep '|' $W/rc$i.log | sed -E 's/\(([0-9]+) TFLOP[^|]*//g' | cut -c1-200)"
done
