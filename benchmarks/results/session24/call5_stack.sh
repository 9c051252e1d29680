# session 24, call 5 (carry .kc24): SonicMoE stacked beside mokgen's default and keep_h=false
# (replay_cost.py, Qwen3-30B, L = 1, 4) at the head.
MOKGEN_CACHE=$PWD/.kc24 RUN_TIMEOUT=400 bash benchmarks/peers_sonicmoe.sh stack
