# session 29 call 8 (carry .kc29m): #16's one missed row (Mixtral-8x22B ep 1, training 1.24x
# autograd grouped_mm, target 1.3x) and Mixtral-8x7B, also back to back at the power cap
PYTHONPATH=$PWD MOKGEN_CACHE=$PWD/.kc29m timeout 230 python3 benchmarks/models.py \
  --models mixtral-8x22b,mixtral-8x7b --ep 1 --tokens 4096 --sustained 2 --out $OUT 2>&1 \
  | grep -v Warn | tail -12
