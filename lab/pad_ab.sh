#!/usr/bin/env bash
# One device call: pad-half (lab/patches/pad_half.patch) against this tree at the power cap,
# whole layers (lab/ab_models.sh, alternating processes) and the energy a training step costs
# (benchmarks/training_step.py) in both trees. Made here first (~10 s a model a tree):
#   M=mixtral-8x22b,mixtral-8x7b,qwen3-30b-a3b,qwen3-235b-a22b,olmoe-1b-7b
#   bash lab/prepare_ab.sh pad lab/patches/pad_half.patch --models $M 1 4096
# then `run` this with carry [".build/kc", ".build/ab/pad"] (~45 MB):
#   MOKGEN_COMMIT=<sha> bash lab/pad_ab.sh
# The same for another patch: NAME=kt bash lab/pad_ab.sh (its tree under .build/ab/kt).
# Prediction (lab/NOTES.md, the waiting patches): synced training step +1.5% (Mixtral-8x22B)
# to +4% (Qwen3-30B N 4096); at the cap less; energy a step lower by the skipped MMAs' share.
export PYTHONPATH=$PWD TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
NAME=${NAME:-pad}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
ARGS="--sustained 2" RUN_TIMEOUT=130 bash lab/ab_models.sh "$NAME" \
  mixtral-8x22b,mixtral-8x7b,qwen3-30b-a3b,qwen3-235b-a22b,olmoe-1b-7b 1 4096 2>&1 | tail -16
for side in base "$NAME"; do
  d=$PWD; c=$PWD/.build/kc
  [ "$side" = base ] || { d=$PWD/.build/ab/$NAME; c=$d/kc; }
  (cd "$d" && PYTHONPATH=$d MOKGEN_CACHE=$c timeout 100 python3 benchmarks/training_step.py \
    --models qwen3-30b-a3b,mixtral-8x22b --tokens 4096 --seconds 2 --out "$OUT/energy_$side" \
    2>&1 | grep "J a step\|energy" | sed "s/^/$side: /")
done
