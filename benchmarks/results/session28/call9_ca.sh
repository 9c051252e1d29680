# session 28 call 9 (carry .kc28g, .build/ab/ca): the gathered rows' cp.async through L1
# (.ca, as SonicMoE's load warps issue them) against L2 only (.cg, the head); trees by process
# in ABBA order, each with pull beside gather in the process
ROOT=$PWD; i=0
for side in ca base base ca; do
  i=$((i + 1))
  if [ $side = base ]; then tree=$ROOT; kc=$ROOT/.kc28g; else tree=$ROOT/.build/ab/ca; kc=$tree/kc; fi
  (cd $tree && PYTHONPATH=$tree MOKGEN_CACHE=$kc timeout 120 python3 benchmarks/gather_ab.py \
    --variants pull,gather --shapes qwen3-30b-a3b,qwen3-235b-a22b --out $OUT/ab_${i}_$side \
    > $OUT/ab_${i}_$side.log 2>&1)
  echo "== $i $side rc $?"; grep "^| [a-z]" $OUT/ab_${i}_$side.log
done
