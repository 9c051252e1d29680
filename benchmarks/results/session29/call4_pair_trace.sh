# session 29 call 4 (carry .kc29t): where the pairs' forward loses (call 3: 2-5% on three of
# four shapes), traced against the default on Qwen3-30B (N 8192); then the A/B again with the
# pair's producer decoding two tasks a pair, not three
export PYTHONPATH=$PWD MOKGEN_CACHE=$PWD/.kc29t
for g in "" "--gemm 128x256x4-pair --gemm-bwd 128x256x4"; do
  timeout 150 python3 benchmarks/trace.py qwen3-30b-a3b 1 8192 $g --out $OUT 2>&1 | grep -v Warn \
    | tee -a $OUT/trace.log | grep -v "^  _warn" | sed -n '1,/^### bwd/p' | head -32
done
timeout 300 python3 benchmarks/gather_ab.py --out $OUT --sustained 2 \
  --variants pull,pull+gemm_fwd=128:256:4:false:false:false:true \
  --shapes qwen3-235b-a22b,mixtral-8x7b,qwen3-30b-a3b \
  2>&1 | grep -v Warn | tee $OUT/gather_ab.log | tail -11
