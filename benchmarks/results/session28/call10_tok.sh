# session 28 call 10 (carry .kc28g, .build/ab/tok): a K-major gathered A's tokens read once
# a task (held in a register, as SonicMoE's load warps hold their row indices) against once a
# slice (the head); trees by process ABBA, pull beside gather in each process. (The call ran an
# inline copy of ab_gather.sh's loop, before that script took BASE_KC; the same runs.)
BASE_KC=$PWD/.kc28g AB_TIMEOUT=120 bash benchmarks/ab_gather.sh tok \
  qwen3-30b-a3b,qwen3-235b-a22b pull,gather
