# session 28 call 12 (carry .kc28h, .build/ab/tok2): an MN-major gathered operand's tokens read
# a slice ahead (tok2) against the head (f00cb59: read at each slice's head), trees by process
# ABBA, pull beside gather in each process; then the gathered rows' bitwise test on tok2
ROOT=$PWD; i=0
for side in tok2 base base tok2; do
  i=$((i + 1))
  if [ $side = base ]; then tree=$ROOT; kc=$ROOT/.kc28h; else tree=$ROOT/.build/ab/tok2; kc=$tree/kc; fi
  (cd $tree && PYTHONPATH=$tree MOKGEN_CACHE=$kc timeout 120 python3 benchmarks/gather_ab.py \
    --variants pull,gather --shapes qwen3-30b-a3b,qwen3-235b-a22b --out $OUT/ab_${i}_$side \
    > $OUT/ab_${i}_$side.log 2>&1)
  echo "== $i $side rc $?"; grep "^| [a-z]" $OUT/ab_${i}_$side.log
done
(cd .build/ab/tok2 && MOKGEN_CACHE=$PWD/kc timeout 200 python3 -m pytest -q -m gpu \
  tests/test_gpu_backward.py -k gathered 2>&1 | tail -2)
