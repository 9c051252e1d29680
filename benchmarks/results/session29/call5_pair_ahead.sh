# session 29 call 5 (carry .kc29q): pairs claimed and posted a pair ahead (rank 0): the GPU
# tests again, the pair's forward traced (Qwen3-30B, against call 4's default), the A/B at
# the power cap on four shapes
export PYTHONPATH=$PWD
timeout 150 python3 -m pytest -q -x tests/test_gpu_pair.py 2>&1 | tail -3
MOKGEN_CACHE=$PWD/.kc29q timeout 100 python3 benchmarks/trace.py qwen3-30b-a3b 1 8192 --gemm \
  128x256x4-pair --gemm-bwd 128x256x4 --out $OUT 2>&1 | grep -v Warn | tee $OUT/trace.log \
  | grep -v "^  _warn" | sed -n '1,/^### backward/p' | head -9
MOKGEN_CACHE=$PWD/.kc29q timeout 330 python3 benchmarks/gather_ab.py --out $OUT --sustained 2 \
  --variants pull,pull+gemm_fwd=128:256:4:false:false:false:true \
  --shapes qwen3-235b-a22b,mixtral-8x7b,sonicmoe-readme,qwen3-30b-a3b \
  2>&1 | grep -v Warn | tee $OUT/gather_ab.log | tail -12
