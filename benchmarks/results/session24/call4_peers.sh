# session 24, call 4 (carry .peersB and .peersC; .kc24 carried by the stage call before it: mokgen's kernels for the five shapes and the stack,
# prebuilt here with --prebuild; SonicMoE installed and its QuACK cache filled by call 2 on
# this warm machine): all five rows of benchmarks/results/peers_sonicmoe.json at the head.
MOKGEN_CACHE=$PWD/.kc24 RUN_TIMEOUT=560 bash benchmarks/peers_sonicmoe.sh run
