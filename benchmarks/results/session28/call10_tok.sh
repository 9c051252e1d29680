# session 28 call 10 (carry .kc28g, .build/ab/tok): a K-major gathered A's tokens read once
# a task (held in a register, as SonicMoE's load warps hold their row indices) against once a slice (the head); trees by process
# in ABBA order, each with pull beside gather in the process
ROOT=$PWD; i=0
for side in tok base base tok; do
  i=$((i + 1))
  if [ $side = base ]; then tree=$ROOT; kc=$ROOT/.kc28g; else tree=$ROOT/.build/ab/tok; kc=$tree/kc; fi
  (cd $tree && PYTHONPATH=$tree MOKGEN_CACHE=$kc timeout 120 python3 benchmarks/gather_ab.py \
    --variants pull,gather --shapes qwen3-30b-a3b,qwen3-235b-a22b --out $OUT/ab_${i}_$side \
    > $OUT/ab_${i}_$side.log 2>&1)
  echo "== $i $side rc $?"; grep "^| [a-z]" $OUT/ab_${i}_$side.log
done
