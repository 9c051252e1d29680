# session 24, call 1 (carry .peersA): stage SonicMoE's first wheel part, then the GPU tests
# session 23 did not reach that fit in the rest of a short call (trace, transformers).
bash benchmarks/peers_sonicmoe.sh stage
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MOKGEN_CACHE=$PWD/.kc
timeout 170 python3 -m pytest -q -m gpu -o faulthandler_timeout=160 tests/test_gpu_trace.py \
  tests/test_gpu_transformers.py 2>&1 | tail -n 15
