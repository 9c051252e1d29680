# session 24, call 2 (carry .peersB and .build/ab; right after `peers_sonicmoe.sh stage`):
# own-routes' GPU tests (next_C.sh tests) in the foreground while SonicMoE's cold JIT for
# Qwen3-30B runs in the background (the JIT is CPU work; that run's timings are thrown away,
# it only fills the QuACK cache in /tmp/quack_cache on the warm machine, so the
# timed calls after it skip the JIT). Outputs: $OUT/c_tests.tgz, $OUT/quack_cache.tgz.
export PYTHONUNBUFFERED=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0
ROOT=$PWD; T0=$(date +%s)
(OUT=/tmp/jitwarm QUACK_CACHE_DIR=/tmp/quack_cache MOKGEN_CACHE=$ROOT/.kc24 RUN_TIMEOUT=560 bash benchmarks/peers_sonicmoe.sh run qwen3-30b-a3b \
   > /tmp/jitwarm.log 2>&1; echo "jit done rc=$? at $(( $(date +%s) - T0 )) s" >> /tmp/jitwarm.log) &
BG=$!
bash benchmarks/results/session23/next_C.sh tests
echo "[tests done at $(( $(date +%s) - T0 )) s]"
while kill -0 $BG 2>/dev/null && [ $(( $(date +%s) - T0 )) -lt 575 ]; do sleep 5; done
tail -n 15 /tmp/jitwarm.log
cp /tmp/jitwarm.log $OUT/ 2>/dev/null; cp /tmp/jitwarm/quack_cache.tgz $OUT/ 2>/dev/null
ls -la $OUT
