# session 28 call 9 (carry .kc28g, .build/ab/ca): the gathered rows' cp.async through L1
# (.ca, as SonicMoE's load warps issue them) against L2 only (.cg, the head); trees by process
# in ABBA order, each with pull beside gather in the process. (The call ran an inline copy of
# ab_gather.sh's loop, before that script took BASE_KC; the same runs and outputs.)
BASE_KC=$PWD/.kc28g AB_TIMEOUT=120 bash benchmarks/ab_gather.sh ca \
  qwen3-30b-a3b,qwen3-235b-a22b pull,gather
