# session 28 call 7 (carry .kc28b): the minibatch on the two big-T shapes (planner: Qwen3-235B
# 3,968 rows, README shape 3,840) against 1,920 and 7,680; ABBA in one process
PYTHONPATH=$PWD MOKGEN_CACHE=$PWD/.kc28b timeout 500 python3 benchmarks/gather_ab.py --out $OUT \
  --variants pull,pull+minibatch=1920,pull+minibatch=7680 \
  --shapes qwen3-235b-a22b,sonicmoe-readme 2>&1 | grep -v Warn | tee $OUT/gather_ab.log | tail -4
