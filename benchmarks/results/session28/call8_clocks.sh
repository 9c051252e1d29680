# session 28 call 8 (carry .kc28t): Qwen3-235B (N 16384) and Mixtral-8x7B (N 8192) at ep 1,
# traced, with the SM clock and board power of each direction (nvidia-smi every 20 ms)
for a in "qwen3-235b-a22b 1 16384" "mixtral-8x7b 1 8192"; do
  PYTHONPATH=$PWD MOKGEN_CACHE=$PWD/.kc28t timeout 200 python3 benchmarks/trace.py $a --clocks \
    --out $OUT 2>&1 | grep -v Warn | tee "$OUT/trace_${a// /_}.log" | grep -v "^  _warn" | head -40
done
