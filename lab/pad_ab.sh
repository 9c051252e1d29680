# next session (prepared in session 32): pad-half against main, one device call.
# Here first (.build and branches do not survive a new checkout):
#   git checkout -b pad-half && git apply benchmarks/results/session32/pad_half.patch && git commit -am pad-half
#   git checkout main && mkdir -p .build/ab/pad && git archive pad-half | tar -x -C .build/ab/pad
#   M=mixtral-8x22b,mixtral-8x7b,qwen3-30b-a3b,qwen3-235b-a22b,olmoe-1b-7b
#   MOKGEN_CACHE=$PWD/.build/kc python benchmarks/prebuild_models.py $M 1 4096
#   (cd .build/ab/pad && MOKGEN_CACHE=$PWD/kc python benchmarks/prebuild_models.py $M 1 4096)
# then `run` this with carry [".build/kc", ".build/ab/pad"] (~45 MB).
# Prediction (NOTES session 32 item 7): synced training step +1.5% (Mixtral-8x22B) to +4%
# (Qwen3-30B N 4096); at the cap less; energy a step lower by the skipped MMAs' share.
export PYTHONPATH=$PWD TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
ARGS="--sustained 2" RUN_TIMEOUT=130 bash benchmarks/ab_models.sh pad \
  mixtral-8x22b,mixtral-8x7b,qwen3-30b-a3b,qwen3-235b-a22b,olmoe-1b-7b 1 4096 2>&1 | tail -16
for side in base pad; do
  d=$PWD; c=$PWD/.build/kc
  [ $side = base ] || { d=$PWD/.build/ab/pad; c=$d/kc; }
  for m in qwen3-30b-a3b mixtral-8x22b; do
    (cd $d && PYTHONPATH=$d MOKGEN_CACHE=$c timeout 70 python3 benchmarks/energy_step.py $m 4096 \
      --seconds 2 2>&1 | tail -4 | sed "s/^/$side: /")
  done
done
