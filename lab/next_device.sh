# The next device session's calls (prepared in session 33, which had no GPU: `status` said
# new loans were paused). Each CALL block is one `run`; ask `status` first.
#
# Here first (a new checkout keeps neither branches, .build nor .kcache; ~15 min of CPU; this
# checkout kept them: .build/kc, .build/ab/pad and .build/ab/pair were built at 4d83821):
#   git branch pad-half && git worktree add ../wt_pad pad-half
#   (cd ../wt_pad && git apply $PWD/benchmarks/results/session33/pad_half.patch && git commit -qam pad-half)
#   mkdir -p .build/ab/pad && git archive pad-half | tar -x -C .build/ab/pad
#   (pair-sched2 likewise from pair_sched.patch, exported to .build/ab/pair)
#   M=mixtral-8x22b,mixtral-8x7b,qwen3-30b-a3b,qwen3-235b-a22b,olmoe-1b-7b
#   MOKGEN_CACHE=$PWD/.build/kc python benchmarks/prebuild_models.py $M 1 4096
#   (cd .build/ab/pad && MOKGEN_CACHE=$PWD/kc python benchmarks/prebuild_models.py $M 1 4096)
#   the GPU tests' plans (any tree: plans, not sources; pad-half's tree has one test more):
#   (cd ../wt_pad && python -m pytest -p benchmarks.collect_kernels -m gpu <device_suite.sh's
#    A and B files> --collect-out <this checkout>/.kcache/s34.pkl)
#   (this checkout has .kcache/s33.pkl: 146 plans, collected in pad-half's tree at 4d83821)
#
# CALL 1 (carry .build/kc, .build/ab/pad; ~45 MB): pad-half against main at the cap, and
# energy a step: `bash benchmarks/results/session32/next_pad_ab.sh` (unchanged; its header's
# preparation is the one above). Prediction (NOTES session 32 item 7): +1.5% (Mixtral-8x22B)
# to +4% (Qwen3-30B N 4096) synced, less at the cap; J a step lower by the skipped MMAs'
# share.
#
# CALLS 2-3 (carry .kcache/s34.pkl, or s33.pkl where the checkout kept it): the GPU suite of
# the tree that lands (pad-half's if call 1 holds, else main's: the solo hand barrier and
# scheduler, 3d33791 / ea281d5, and wg-order's untested files):
#   KERNELS=.kcache/s34.pkl HALVES=a MOKGEN_COMMIT=<sha> bash benchmarks/device_suite.sh
#   KERNELS=.kcache/s34.pkl HALVES=b MOKGEN_COMMIT=<sha> bash benchmarks/device_suite.sh
# test_gpu_backward's engine experiments [solo] and [mixed] are the solo fix's GPU check
# (the protocol model's race, closed by the hand barrier); test_gpu_trace's
# test_padding_halves_skip_their_mmas_in_every_row_tile_kind is pad-half's.
#
# CALL 4 (carry .build/kc, .build/ab/pad): #16's row, Mixtral-8x22B ep 1 N 4096, 8 processes
# alternating base / pad (session 32's call6.sh loop, each side from its own tree and cache):
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
ROOT=$PWD
for i in 1 2 3 4 5 6 7 8; do
  for side in base pad; do
    d=$ROOT; c=$ROOT/.build/kc
    [ $side = base ] || { d=$ROOT/.build/ab/pad; c=$d/kc; }
    (cd $d && PYTHONPATH=$d MOKGEN_CACHE=$c timeout 60 python3 benchmarks/models.py \
      --models mixtral-8x22b --tokens 4096 --sustained 2 --out $OUT/${side}_$i \
      > $OUT/${side}_$i.log 2>&1) || echo "$side $i: exit $?"
  done
done
python3 - $OUT <<'PY'
import glob, json, statistics, sys
for side in ("base", "pad"):
    xs, xc = [], []
    for f in sorted(glob.glob(f"{sys.argv[1]}/{side}_*/models_fwdbwd_bf16.json")):
        r = json.load(open(f))["rows"][0]; b = r["backward"]
        xs.append(r["train_grouped_ms"] / r["train_mokgen_ms"])
        xc.append(b["grouped_train_sustained_ms"] / b["mokgen_train_sustained_ms"])
    if xs:
        print(f"{side} synced x grouped_mm:", " ".join(f"{v:.3f}" for v in xs),
              "median %.3f" % statistics.median(xs))
        print(f"{side} capped x grouped_mm:", " ".join(f"{v:.3f}" for v in xc),
              "median %.3f" % statistics.median(xc))
PY
# (16 runs of ~30 s: if the call's 600 s do not hold them, 6 pairs.) Resolve #16 if the suite
# passed and the capped median of the tree that lands is >= 1.3.
#
# CALL 5: if pad-half paid, ktail (benchmarks/results/session33/ktail_on_pad_half.patch, on
# top of pad-half) the same way as call 1 (its tree as .build/ab/kt against pad-half's as the
# base), and trace.py's Wgrad FLOP/clk of both on Qwen3-30B N 8192 (ptxas adds a dummy
# HGMMA.64x8x16 a weight-gradient slice: whether it costs more than the dropped steps save).
#
# CALL 6 (carry .build/ab/pair, 31 MB; pairs with a scheduling thread, branch pair-sched2,
# `results/session33/pair_sched.patch`): its GPU tests, then pairs against the default at the
# cap in one process (session 29's call 6, which measured the pairs without a scheduler):
#   cd .build/ab/pair && export PYTHONPATH=$PWD
#   timeout 150 python3 -m pytest -q -x tests/test_gpu_pair.py 2>&1 | tail -3
#   MOKGEN_CACHE=$PWD/kc timeout 330 python3 benchmarks/gather_ab.py --out $OUT --sustained 2 \
#     --variants pull,pull+gemm_fwd=128:256:4:false:false:false:true \
#     --shapes qwen3-235b-a22b,mixtral-8x7b,sonicmoe-readme,qwen3-30b-a3b 2>&1 | tail -12
# Prediction: the forward at the cap +1-3% with pairs (session 29: the pairs' SM clock 54 MHz
# higher, eaten by a 5.5 us ask a task that the scheduling thread now hides); the step +0.5-1%.
# pad-half-fp8 (`pad_half_fp8_on_pad_half.patch`, on pad-half): test_gpu_fp8 on its tree, then
# benchmarks/profile_fp8.py or fp8.py --backward against pad-half's on the kimi / glm slices.
# If several pay: `results/session33/combo.patch` (pad-half + ktail + pairs + pad-half for
# fp8, compile-checked together) is the one tree to run the GPU suite on and land.
# Also owed (#17): the backward's share of its floor on the ep 8 / ep 64 slices
# (benchmarks/moe_layer.py --backward; the README's table is from 0e2a036).
