# session 29 call 1 (carry .peersA, .kc29): SonicMoE's wheel parts staged, mokgen's kernels for
# the five peers shapes at a832273 copied to /tmp for the next call
bash benchmarks/peers_sonicmoe.sh stage && rm -rf /tmp/kc29 && cp -r .kc29 /tmp/kc29 && ls /tmp/kc29 | wc -l
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
