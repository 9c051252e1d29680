# session 29 call 7: the GPU tests touched by this session's changes (run_both's bwd flag;
# the runtime's cluster launch path): ping-pong / signal-warp layers, clusters
export PYTHONPATH=$PWD
timeout 500 python3 -m pytest -q tests/test_gpu_pingpong.py tests/test_gpu_cluster.py 2>&1 | tail -4
