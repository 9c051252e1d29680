# next session, the call between next_tests.sh and next_sonic.sh (carry .peersA and .kc24;
# root = main with pt192.patch applied): stage SonicMoE's first wheel part for next_sonic.sh
# and leave .kc24 on the machine, then the pt192 experiment (next_pt192.sh).
bash benchmarks/results/session24/call3_stage.sh
bash benchmarks/results/session24/next_pt192.sh
