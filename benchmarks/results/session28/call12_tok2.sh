# session 28 call 12 (carry .kc28h, .build/ab/tok2): an MN-major gathered operand's tokens read
# a slice ahead (tok2) against the head (f00cb59: read at each slice's head), trees by process
# ABBA, pull beside gather in each process; then the gathered rows' bitwise test on tok2. (The
# call ran an inline copy of ab_gather.sh's loop, before that script took BASE_KC.)
BASE_KC=$PWD/.kc28h AB_TIMEOUT=120 bash benchmarks/ab_gather.sh tok2 \
  qwen3-30b-a3b,qwen3-235b-a22b pull,gather
(cd .build/ab/tok2 && MOKGEN_CACHE=$PWD/kc timeout 200 python3 -m pytest -q -m gpu \
  tests/test_gpu_backward.py -k gathered 2>&1 | tail -2)
