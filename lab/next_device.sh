# The next GPU session's calls, in order (lab/NOTES.md says why each). Each CALL block is one
# `run`; ask `status` first. Paths are from the repository root. The patches apply to this
# tree's HEAD (ktail and pad-half-fp8 on top of pad-half); kernels and plan lists do not
# survive a new checkout: build them here first (~15 min of CPU in all).
#
# Here first:
#   M=mixtral-8x22b,mixtral-8x7b,qwen3-30b-a3b,qwen3-235b-a22b,olmoe-1b-7b
#   bash lab/prepare_ab.sh pad lab/patches/pad_half.patch --models $M 1 4096 \
#     --trace "qwen3-30b-a3b 1 8192"
#   the GPU tests' plans, collected in the tree that is to land (pad-half's has one test more):
#   (cd .build/ab/pad && python benchmarks/prebuild.py collect $OLDPWD/.kcache/tests.pkl)
#
# CALL 1 (carry .build/kc, .build/ab/pad; ~45 MB): pad-half against main at the cap, and the
# energy a step: `MOKGEN_COMMIT=<sha> bash lab/pad_ab.sh`. Prediction: +1.5% (Mixtral-8x22B)
# to +4% (Qwen3-30B N 4096) synced, less at the cap; J a step lower by the skipped MMAs' share.
#
# CALLS 2-4 (carry .kcache: tests.pkl): the GPU suite of the tree that lands (pad-half's if
# call 1 holds, else main's: the weight gradients' tile order's untested files), one third a
# call:
#   (cd .build/ab/pad && KERNELS=$OLDPWD/.kcache/tests.pkl MOKGEN_COMMIT=<sha> \
#      bash benchmarks/run_gpu.sh tests-a)     (then tests-b, tests-c; main's: from the root)
# test_gpu_trace's test_padding_halves_skip_their_mmas_in_every_row_tile_kind is pad-half's.
#
# CALL 5 (carry .build/kc, .build/ab/pad): the missed Mixtral-8x22B ep 1 N 4096 row,
# 8 processes alternating base / pad (each side from its own tree and cache):
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
ROOT=$PWD
for i in 1 2 3 4 5 6 7 8; do
  for side in base pad; do
    d=$ROOT; c=$ROOT/.build/kc
    [ $side = base ] || { d=$ROOT/.build/ab/pad; c=$d/kc; }
    (cd $d && PYTHONPATH=$d MOKGEN_CACHE=$c timeout 60 python3 benchmarks/models.py \
      --models mixtral-8x22b --ep 1 --tokens 4096 --sustained 2 --out $OUT/${side}_$i \
      > $OUT/${side}_$i.log 2>&1) || echo "$side $i: exit $?"
  done
done
python3 - $OUT <<'PY'
import glob, json, statistics, sys
for side in ("base", "pad"):
    xs, xc = [], []
    for f in sorted(glob.glob(f"{sys.argv[1]}/{side}_*/models.json")):
        (r,) = [r for r in json.load(open(f))["rows"] if r["shape"] == "mixtral-8x22b"]
        b = r["backward"]
        xs.append(r["train_grouped_ms"] / r["train_mokgen_ms"])
        xc.append(b["grouped_train_sustained_ms"] / b["mokgen_train_sustained_ms"])
    if xs:
        print(f"{side} synced x grouped_mm:", " ".join(f"{v:.3f}" for v in xs),
              "median %.3f" % statistics.median(xs))
        print(f"{side} capped x grouped_mm:", " ".join(f"{v:.3f}" for v in xc),
              "median %.3f" % statistics.median(xc))
PY
# (16 runs of ~30 s: if the call's 600 s do not hold them, 6 pairs.) The row's target is a
# capped median >= 1.3 on the tree that lands, with its GPU suite green.
#
# CALL 6: if pad-half paid, ktail (lab/patches/ktail_on_pad_half.patch, on top of pad-half)
# the same way as call 1: `bash lab/prepare_ab.sh kt lab/patches/pad_half.patch
# lab/patches/ktail_on_pad_half.patch --models $M 1 4096 --trace "qwen3-30b-a3b 1 8192"`, its
# tree against pad-half's as the base; and lab/trace.py's Wgrad FLOP/clk of both on Qwen3-30B
# N 8192 (its SASS has no dummy HGMMA since f5029bd: the slices pipeline as main's; the
# shorter last slice is what is measured).
#
# CALL 7 (carry .build/ab/pair, ~31 MB; pairs with a scheduling thread,
# lab/patches/pair_sched.patch; prepared by `bash lab/prepare_ab.sh pair
# lab/patches/pair_sched.patch --gather qwen3-235b-a22b,mixtral-8x7b,sonicmoe-readme,qwen3-30b-a3b
# pull,pull+gemm_fwd=128:256:4:true`): its GPU tests, then pairs against the
# default at the cap in one process:
#   cd .build/ab/pair && export PYTHONPATH=$PWD
#   timeout 150 python3 -m pytest -q -x tests/test_gpu_pair.py 2>&1 | tail -3
#   MOKGEN_CACHE=$PWD/kc timeout 330 python3 lab/gather_ab.py --out $OUT --sustained 2 \
#     --variants pull,pull+gemm_fwd=128:256:4:true \
#     --shapes qwen3-235b-a22b,mixtral-8x7b,sonicmoe-readme,qwen3-30b-a3b 2>&1 | tail -12
# Prediction: the forward at the cap +1-3% with pairs (their SM clock was 54 MHz higher
# without a scheduler, eaten by a 5.5 us ask a task that the scheduling thread now hides);
# the step +0.5-1%.
#
# CALL 8: pad-half for fp8 (lab/patches/pad_half_fp8_on_pad_half.patch, on pad-half):
# test_gpu_fp8 on its tree, then `benchmarks/fp8.py --backward --shapes kimi-k2.7,glm-5.2
# --ep 64,8` in both trees (pad-half's as the base).
# If several pay: lab/patches/combo.patch (pad-half + ktail + pairs + pad-half for fp8,
# compile-checked together) is the one tree to run the GPU suite on and land.
# Also owed: the backward's share of its floor on the ep 8 / ep 64 slices at the head
# (`benchmarks/run_gpu.sh layer-ep64`, `layer-ep8`; results/moe_layer.json is from 0e2a036).
