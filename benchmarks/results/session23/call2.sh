# session 23, call 2 (root = next23; carry .build/ab, .build/dev23): replay_cost A/B main / next23
# alternated (L 4: the x-pulling kernel, joining on next23, runs 3 of 4 layers), next23 with 24
# backward comm CTAs; launch_cost; host_overhead main / next23 under ctypes launches, alternated.
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
R=$OUT; T0=$(date +%s); ROOT=$PWD
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/steps.log; }
export MOKGEN_CACHE=$ROOT/.kc
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv > $R/smi.txt 2>&1
i=0
for run in "main pull" "nx pull" "main pull" "nx pull" "nx pull+comm_sms_bwd=24"; do
  set -- $run; i=$((i + 1)); D=$ROOT; [ $1 = main ] && D=$ROOT/.build/ab/main
  (cd $D && PYTHONPATH=$PWD timeout 100 python3 benchmarks/replay_cost.py \
    --shapes qwen3-30b-a3b,olmoe-1b-7b --variants $2 --layers 1,4 --out $R/rc$i > $R/rc$i.log 2>&1)
  el "rc$i $run: $(grep '|' $R/rc$i.log | sed -E 's/\(([0-9]+) TFLOP[^|]*//g' | tr '\n' ' ' | cut -c1-400)"
done
PYTHONPATH=$ROOT timeout 60 python3 benchmarks/launch_cost.py --out $R > $R/launch_cost.log 2>&1
el "launch_cost: $(grep '^|' $R/launch_cost.log | tr '\n' ' ')"
i=0
for run in "main cuda-python" "nx ctypes" "main cuda-python" "nx ctypes" "nx cuda-python"; do
  set -- $run; i=$((i + 1)); D=$ROOT; [ $1 = main ] && D=$ROOT/.build/ab/main
  (cd $D && PYTHONPATH=$PWD MOKGEN_LAUNCH=$2 timeout 60 python3 benchmarks/host_overhead.py > $R/host_$i.txt 2>&1)
  el "host$i $run: $(grep '^{"shape' $R/host_$i.txt | cut -c1-330)"
done
