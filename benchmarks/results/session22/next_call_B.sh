# next session, call B (carry .build/dev, .build/ab): the launch path's host cost
# (benchmarks/launch_cost.py on the ctypes-launch tree), then host_overhead.py alternated:
# main (cuda-python launches) / ctypes-launch with MOKGEN_LAUNCH=ctypes. Kernels build on the
# device into one cache shared by both trees (the same sources).
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
R=$OUT; T0=$(date +%s); ROOT=$PWD
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/steps.log; }
export MOKGEN_CACHE=$ROOT/.kc5
(cd .build/ab/cl && PYTHONPATH=$PWD timeout 60 python3 benchmarks/launch_cost.py --out $R > $R/launch_cost.log 2>&1)
el "launch_cost: $(grep '^|' $R/launch_cost.log | tr '\n' ' ')"
# first run builds the layer's kernels (both trees: same sources)
(cd .build/ab/main && PYTHONPATH=$PWD timeout 200 python3 benchmarks/host_overhead.py > $R/host_main_0.txt 2>&1)
el "host main (build): $(grep -c shape $R/host_main_0.txt)"
for i in 1 2; do
  for side in main cl; do
    L=cuda-python; [ $side = cl ] && L=ctypes
    (cd .build/ab/$side && PYTHONPATH=$PWD MOKGEN_LAUNCH=$L timeout 60 python3 benchmarks/host_overhead.py > $R/host_${side}_$i.txt 2>&1)
    el "host $side ($L) $i"
  done
done
grep -h '^{"shape' $R/host_*_[12].txt
