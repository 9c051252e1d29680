# next session (carry .build/ab/pair): branch pair-sched (86414fe: multicast pairs with a
# scheduling thread) on the GPU: its pair tests (kernels prebuilt in session 31, 34, no
# spills), then pairs against the default forward at the power cap (gather_ab ABBA)
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
cd .build/ab/pair && export PYTHONPATH=$PWD MOKGEN_CACHE=$PWD/kc
timeout 200 python3 -m pytest -q -m gpu -x -o faulthandler_timeout=100 tests/test_gpu_pair.py 2>&1 | tail -4
timeout 330 python3 benchmarks/gather_ab.py --out $OUT --sustained 2 \
  --variants pull,pull+gemm_fwd=128:256:4:false:false:false:true \
  --shapes qwen3-235b-a22b,mixtral-8x7b,sonicmoe-readme 2>&1 | tail -14
