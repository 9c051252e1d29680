# session 24, call 3 (carry .peersA and .kc24): stage again (the machine had been given
# back), and leave .kc24 (mokgen's kernels for the peers' shapes) on the warm machine.
bash benchmarks/peers_sonicmoe.sh stage; ls .kc24 | wc -l
