# next session, call B (root = main at the head): the joining x-pulling backward's comm CTAs
# swept (replay_cost, L 1 and 4; the planner's 18 on Qwen3-30B, 14 on OLMoE; 24 was slower in
# session 23), torch.profiler's CPU ops of a step (host_overhead --torch-ops: what the stacked
# forward's host time is), then model_stack.py with the keep_h default against keep_h=0 for
# the README's model table. Outputs: $OUT/b.tgz, rewritten after every step.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
W=/tmp/wB; mkdir -p $W; T0=$(date +%s); export MOKGEN_CACHE=$PWD/.kc
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $W/steps.log; tar -czf $OUT/b.tgz -C $W .; }
i=0
for v in pull pull+comm_sms_bwd=12 pull+comm_sms_bwd=15 pull pull+comm_sms_bwd=12; do
  i=$((i + 1))
  timeout 60 python3 benchmarks/replay_cost.py --shapes qwen3-30b-a3b,olmoe-1b-7b --variants $v \
    --layers 1,4 --out $W/rc$i > $W/rc$i.log 2>&1
  el "rc$i $v: $(grep '|' $W/rc$i.log | sed -E 's/\(([0-9]+) TFLOP[^|]*//g' | tr '\n' ' ' | cut -c1-300)"
done
timeout 60 python3 benchmarks/host_overhead.py --torch-ops > $W/host_ops.txt 2>&1
el "host_overhead --torch-ops: $(grep '^{"shape' $W/host_ops.txt | cut -c1-200)"
for L in 4 48; do
  timeout $([ $L = 4 ] && echo 90 || echo 140) python3 benchmarks/model_stack.py \
    --shapes qwen3-30b-a3b --layers $L --keep-h d,0 --out $W/model_stack_$L.json > $W/model_stack_$L.log 2>&1
  el "model_stack L$L: $(grep '^|' $W/model_stack_$L.log | tail -n 4 | tr '\n' ' ')"
done
