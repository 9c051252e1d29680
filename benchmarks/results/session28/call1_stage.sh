# session 28 call 1 (carry .peersA, .kc28): SonicMoE's wheel parts staged, mokgen's kernels
# for the five peers shapes (tuned plans and replay_cost's L 1 twins) copied to /tmp for the
# next calls (the carry of call 2 has no room for them)
bash benchmarks/peers_sonicmoe.sh stage && rm -rf /tmp/kc28 && cp -r .kc28 /tmp/kc28 && ls /tmp/kc28 | wc -l
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
