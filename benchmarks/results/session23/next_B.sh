# next session, call B (root = main at the head): the joining x-pulling backward's comm CTAs
# swept (replay_cost, L 1 and 4; the planner's 18 on Qwen3-30B, 14 on OLMoE; 24 was slower in
# session 23), then model_stack.py with the keep_h default against keep_h=0 for the README's
# model table. Outputs: $OUT/b.tgz, rewritten after every step.
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
timeout 250 python3 benchmarks/model_stack.py --shapes qwen3-30b-a3b --layers 4,48 --keep-h d,0 \
  --out $W/model_stack.json > $W/model_stack.log 2>&1
el "model_stack: $(tail -n 8 $W/model_stack.log | tr '\n' ' ')"
