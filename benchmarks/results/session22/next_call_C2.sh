# next session, call C2 (right after C1, same warm machine: its .kc6 kernels): replay_cost.py
# A/B, main against xpull-join, alternated; L 4 is where the x-pulling kernel runs (3 of 4
# layers). Then xpull-join with 24 backward comm CTAs (joining, more may pay).
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
R=$OUT; T0=$(date +%s); ROOT=$PWD
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/steps.log; }
export MOKGEN_CACHE=$ROOT/.kc6
i=0
for run in "main pull" "xj pull" "main pull" "xj pull" "xj pull+comm_sms_bwd=24"; do
  set -- $run; i=$((i + 1))
  (cd .build/ab/$1 && PYTHONPATH=$PWD timeout 110 python3 benchmarks/replay_cost.py \
    --shapes qwen3-30b-a3b,olmoe-1b-7b --variants $2 --layers 1,4 --out $R/rc$i > $R/rc$i.log 2>&1)
  el "$i $run: $(grep '|' $R/rc$i.log | cut -c1-200 | tr '\n' ' ')"
done
