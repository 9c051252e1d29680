#!/usr/bin/env bash
# The GPU machine's one driver: the GPU tests and the maintained benchmarks, in chunks that
# each fit one device call (10 minutes; every step has a timeout inside a 570 s budget and
# writes its log under $OUT as it goes, so a call cut short still returns what it did).
#
#   MOKGEN_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/run_gpu.sh CHUNK [ARGS]
#   bash benchmarks/run_gpu.sh list          the chunks, what each carries, minutes expected
#
# The device's copy of the tree has no git history: pass MOKGEN_COMMIT so results name their
# commit. Results: $OUT/results/<name>.json holds this call's rows only; back here, fold them
# into the repository's files (rows per GPU kind):
#   python benchmarks/result_file.py merge <returned $OUT>/results/*.json
# Kernels build on the machine's cores at the start of each chunk (benchmarks/prebuild.py)
# into $MOKGEN_CACHE (default /tmp/mokgen-cache: kept while the machine stays warm), after
# unpacking any carried .kcache/kernels*.tar.xz there (`prebuild.py --pack` here: then they
# are found built). Two-GPU chunks print why they are skipped where one GPU is visible and
# exit 0.
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export MOKGEN_CACHE=${MOKGEN_CACHE:-/tmp/mokgen-cache}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
RES=$OUT/results
BUDGET=${BUDGET:-570}  # seconds of the call's 600 this script may use
mkdir -p "$OUT" "$RES"

FAILED=""
left() { echo $(( BUDGET - SECONDS )); }
# step LOG LIMIT CMD...: CMD under a timeout of LIMIT seconds or what is left of the budget,
# its output into $OUT/LOG; prints the last lines and the exit status (a failed step makes
# the chunk's exit status 1)
step() {
  local log=$1 limit=$2; shift 2
  local t; t=$(left); [ "$limit" -lt "$t" ] && t=$limit
  if [ "$t" -lt 10 ]; then
    echo "== $log: skipped, the call's time is spent"; FAILED="$FAILED $log"; return 124
  fi
  echo "== $log (at most ${t} s): $*"
  timeout "$t" "$@" > "$OUT/$log" 2>&1
  local rc=$?
  tail -n "${TAIL:-15}" "$OUT/$log"
  echo "== $log: exit $rc after $SECONDS s"
  [ "$rc" = 0 ] || FAILED="$FAILED $log"
  return $rc
}
gpus() { python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0; }
need_gpus() {  # need_gpus N: exit 0 with the reason where fewer are visible
  local n; n=$(gpus)
  if [ "$n" -lt "$1" ]; then
    echo "skipped: '$CHUNK' needs $1 GPUs, $n visible (ask for a multi-GPU kind)"; exit 0
  fi
}
pytest_gpu() {  # pytest_gpu LOG FILES...: one GPU's share of the suite (TIMEOUT: its limit)
  local log=$1; shift
  # -v: each test named as it ends (a call cut short still says which ran); the slowest
  step "$log" "${TIMEOUT:-450}" python3 -m pytest -v --durations=25 -m gpu -p no:cacheprovider \
    -o faulthandler_timeout=120 "$@"
}
prebuild_tests() {  # the GPU tests' kernels from the plan list collected on a CPU machine
  if [ -f "${KERNELS:-.kcache/tests.pkl}" ]; then
    step prebuild.log 150 python3 benchmarks/prebuild.py build "${KERNELS:-.kcache/tests.pkl}"
  else
    echo "no ${KERNELS:-.kcache/tests.pkl}: the tests build their kernels one by one (slow);"
    echo "make it here first: python benchmarks/prebuild.py collect .kcache/tests.pkl"
  fi
}

TESTS_A="tests/test_gpu_memory.py tests/test_gpu_shapes.py tests/test_gpu_widths.py
  tests/test_gpu_module.py tests/test_gpu_backward.py tests/test_gpu_forward.py
  tests/test_gpu_trace.py"
TESTS_B="tests/test_gpu_fp8.py tests/test_gpu_reliability.py tests/test_gpu_prologue.py
  tests/test_gpu_side_by_side.py"
TESTS_C="tests/test_gpu_transformers.py tests/test_gpu_pair.py
  tests/test_gpu_cluster.py tests/test_hardware.py tests/test_docs.py"
PRESETS=kimi-k2.7,glm-5.2,qwen3.5-397b-a17b,deepseek-v4-pro
MODELS_A=qwen3-30b-a3b,qwen3-235b-a22b,qwen1.5-moe-a2.7b,deepseek-v2-lite,deepseek-v3
MODELS_B=mixtral-8x7b,mixtral-8x22b,olmoe-1b-7b,llama-4-scout,granite-3.0-3b-a800m

CHUNK=${1:-list}
shift || true
[ "$CHUNK" != tests ] || [ $# -gt 0 ] || { echo "tests FILE..: name the test files"; exit 2; }
[ "$CHUNK" = list ] || {
  nvidia-smi --query-gpu=index,name,clocks.sm,power.limit,memory.used --format=csv,noheader
  [ -n "${MOKGEN_COMMIT:-}" ] || [ -e .git ] || echo "warning: no MOKGEN_COMMIT and no .git:" \
    "results will record commit '?'"
}
if [ "$CHUNK" != list ]; then
  for pack in .kcache/kernels*.tar.xz; do
    [ -f "$pack" ] || continue
    mkdir -p "$MOKGEN_CACHE" && tar -xJf "$pack" -C "$MOKGEN_CACHE" --skip-old-files &&
      echo "unpacked $pack into $MOKGEN_CACHE ($SECONDS s)"
  done
fi
case $CHUNK in
  list)
    cat <<'EOF'
chunk            carry                     minutes  what
tests-a          .kcache (tests.pkl)       8-9      GPU tests: memory shapes widths module backward forward trace
tests-b          .kcache (tests.pkl)       6-8      GPU tests: fp8 reliability prologue side-by-side
tests-c          .kcache (tests.pkl)       5-7      GPU tests: transformers pair cluster hardware docs
tests-bc         .kcache (tests.pkl, pack) 6        tests-b and tests-c in one pytest: fits a call where
                                                    the kernels come packed (kernels*.tar.xz)
tests FILE..     .kcache (tests.pkl, pack) 1-9      the named GPU test files alone (a short call: the
                                                    tests a change touches, ahead of the whole suite)
layer-ep64       -                         4-6      moe_layer.py, the presets' ep 64 slices, forward + backward
layer-ep8        -                         5-7      moe_layer.py, the ep 8 slices
fp8-ep64         -                         5-7      fp8.py --backward, ep 64
fp8-ep8          -                         5-7      fp8.py --backward, ep 8
models-a         -                         5-7      models.py, five models (Qwen, DeepSeek), --sustained 2
models-b         -                         5-7      models.py, the other five (Mixtral, OLMoE, Llama, Granite)
stack            -                         4-8      model_stack.py (Qwen3-30B, OLMoE; 4 and 48 layers; --fit;
                                                    DTYPE=fp8: mokgen's layers in fp8)
training         -                         3-4      training_step.py (Mixtral-8x22B, Qwen3-30B)
sonicmoe-stage   .peersA                   <1       SonicMoE, call 1 of 2: the first part of its big wheel
sonicmoe [S,..]  .peersB .peersC           3-9      SonicMoE, call 2 (right after 1): install, peers_sonicmoe.py
                                                    (DTYPES=bf16,fp8: mokgen's fp8 columns too)
multigpu         -                         5-7      2+ GPUs: multigpu.py and fsdp_overlap.py at R = GPUs
multigpu-tests   -                         5-8      2+ GPUs: test_multigpu, the killed-rank test, the FSDP2 example
deepep           .peers-deepep             5-8      2 GPUs: build DeepEP, peers_deepep.py
torchtitan M [R] .torchtitan               2-9      torchtitan_train.py: model M (debug | qwen3-30b-a3b),
                                                    runs R (IMPL:SEED; default the four of the band;
                                                    IMPL+graphs: CUDA-graph steps, --cuda-graphs);
                                                    TESTS=1: tests/test_torchtitan.py's GPU tests first;
                                                    TT_ARGS: more options (e.g. "--steps 24 --profile 3")
Here first: tests.pkl by `python benchmarks/prebuild.py collect .kcache/tests.pkl` (~2-10 min),
its kernels packed by `python benchmarks/prebuild.py --pack .kcache/kernels.tar.xz build
.kcache/tests.pkl` (~10 min on 2 cores; optional, saves the call ~1-2 min);
SonicMoE's wheels by benchmarks/peers/fetch_sonicmoe.sh, DeepEP's source by fetch_deepep.sh,
torchtitan's wheels and text by fetch_torchtitan.sh.
EOF
    ;;
  tests-a|tests-b|tests-c|tests-bc|tests)
    prebuild_tests
    case $CHUNK in
      tests) TIMEOUT=$(left) pytest_gpu pytest_files.log "$@" ;;
      tests-a) pytest_gpu pytest_a.log $TESTS_A ;;
      tests-b) pytest_gpu pytest_b.log $TESTS_B ;;
      tests-c) pytest_gpu pytest_c.log $TESTS_C ;;
      tests-bc) TIMEOUT=$(left) pytest_gpu pytest_bc.log $TESTS_B $TESTS_C ;;
    esac
    grep -h "^FAILED\|^ERROR\|::.* FAILED\|::.* ERROR" "$OUT"/pytest_*.log | head -20
    ;;
  layer-ep64|layer-ep8)
    EP=${CHUNK#layer-ep}
    ARGS="--shapes ${SHAPES:-$PRESETS} --ep $EP --tokens 1024,2048,4096 --iters 20"
    step prebuild.log 240 python3 benchmarks/prebuild.py build --bench "$ARGS --backward"
    step moe_layer_ep$EP.log 420 python3 benchmarks/moe_layer.py $ARGS --out "$RES" "$@"
    ;;
  fp8-ep64|fp8-ep8)
    EP=${CHUNK#fp8-ep}
    step prebuild.log 270 python3 benchmarks/prebuild.py layers "${SHAPES:-$PRESETS}" --ep "$EP" \
      --tokens 2048 --dtypes bf16,fp8,mxfp8
    step fp8_ep$EP.log 400 python3 benchmarks/fp8.py --shapes "${SHAPES:-$PRESETS}" --ep "$EP" \
      --tokens 2048 --backward --out "$RES" "$@"
    ;;
  models-a|models-b)
    M=$([ "$CHUNK" = models-a ] && echo "${MODELS:-$MODELS_A}" || echo "${MODELS:-$MODELS_B}")
    step prebuild.log 270 python3 benchmarks/prebuild.py layers "$M" --tokens 4096
    step models_${CHUNK#models-}.log 400 python3 benchmarks/models.py --models "$M" \
      --tokens 4096 --sustained 2 --out "$RES" "$@"
    ;;
  stack)
    # DTYPE=fp8: mokgen's layers in fp8 (against the same bf16 PyTorch stack)
    step prebuild.log 150 python3 benchmarks/prebuild.py layers qwen3-30b-a3b,olmoe-1b-7b \
      --ep 1 --tokens 8192 --dtypes "${DTYPE:-bf16}"
    step model_stack.log 480 python3 benchmarks/model_stack.py --layers 4,fit --ckpt 0,1 --fit \
      --dtype "${DTYPE:-bf16}" --out "$RES" "$@"
    ;;
  training)
    M=${MODELS:-mixtral-8x22b,qwen3-30b-a3b}
    step prebuild.log 150 python3 benchmarks/prebuild.py layers "$M" --ep 1 --tokens 4096
    step training_step.log 300 python3 benchmarks/training_step.py --models "$M" --tokens 4096 \
      --out "$RES" "$@"
    ;;
  sonicmoe-stage)
    # call 1 of 2: the first part of the CuTe DSL wheel into /tmp, which the next call on this
    # warm machine finds (issue call 2 at once: an idle machine is given back in ~30 s)
    [ -d .peersA ] || { echo "no .peersA: run benchmarks/peers/fetch_sonicmoe.sh here, carry .peersA"; exit 2; }
    mkdir -p /tmp/peers-wheels && cp .peersA/part.* /tmp/peers-wheels/ && ls /tmp/peers-wheels
    ;;
  sonicmoe)
    W=/tmp/peers-wheels
    if [ ! -d /tmp/peers/sonicmoe ]; then  # a later call on the same warm machine reuses it
      ls "$W"/part.* > /dev/null 2>&1 || { echo "no $W/part.*: run sonicmoe-stage in the call right before"; exit 2; }
      [ -f .peersB/big.name ] || { echo "no .peersB: carry .peersB (and .peersC)"; exit 2; }
      cat "$W"/part.* .peersB/part.* > "$W/$(cat .peersB/big.name)" && rm "$W"/part.*
      python3 -m pip install -q --no-index --no-deps --target /tmp/peers "$W"/*.whl \
        .peersB/*.whl || exit 3
    fi
    # the CuTe DSL wheel puts `cutlass` on the path through a .pth file, which --target does
    # not process: both paths are needed
    export PYTHONPATH=/tmp/peers:/tmp/peers/nvidia_cutlass_dsl/python_packages:$PYTHONPATH
    # QuACK keeps SonicMoE's compiled kernels here (keyed by its sources, not the shape):
    # returned as quack_cache.tgz; unpack it into .peersC here and the next machine skips the
    # JIT (2-8 minutes a process when cold)
    export QUACK_CACHE_DIR=${QUACK_CACHE_DIR:-$PWD/.peersC/quack_cache}
    mkdir -p "$QUACK_CACHE_DIR"
    echo "QuACK cache: $(ls "$QUACK_CACHE_DIR" | wc -l) entries"
    step prebuild.log 120 python3 benchmarks/peers_sonicmoe.py --prebuild ${1:+--shapes "$1"} \
      ${DTYPES:+--dtypes "$DTYPES"}
    TAIL=25 step peers_sonicmoe.log 480 python3 benchmarks/peers_sonicmoe.py --sustained 2 \
      --out "$RES" ${1:+--shapes "$1"} ${DTYPES:+--dtypes "$DTYPES"}
    tar -czf "$OUT/quack_cache.tgz" -C "$(dirname "$QUACK_CACHE_DIR")" \
      "$(basename "$QUACK_CACHE_DIR")" && ls -la "$OUT/quack_cache.tgz"
    ;;
  multigpu)
    need_gpus 2
    R=$(gpus)
    step prebuild.log 150 python3 benchmarks/prebuild.py multigpu --world "$R" --tokens 2048
    TAIL=22 step multigpu.log 240 torchrun --nproc-per-node="$R" benchmarks/multigpu.py \
      --tokens 2048 --out "$RES"
    step fsdp_overlap.log 120 torchrun --nproc-per-node="$R" benchmarks/fsdp_overlap.py --out "$RES"
    ;;
  multigpu-tests)
    need_gpus 2
    R=$(gpus)
    step prebuild.log 120 python3 benchmarks/prebuild.py multigpu --world "$R" --skip-bench
    # 1,000 training calls (MOKGEN_TEST_STEPS) keep it inside the call; 10,000 is the full test
    MOKGEN_TEST_STEPS=${TEST_STEPS:-1000} step pytest_multigpu.log 240 torchrun \
      --nproc-per-node="$R" -m pytest -q -p no:cacheprovider -m multigpu tests/test_multigpu.py
    step pytest_multigpu_faults.log 150 python3 -m pytest -q -p no:cacheprovider -m multigpu \
      tests/test_multigpu_faults.py
    step train_fsdp_ep2.log 80 torchrun --nproc-per-node=2 examples/04_train_fsdp_ep.py \
      --moe mokgen --steps 100 --out "$OUT/train_fsdp_ep2_vs_reference.json"
    grep -h "^FAILED\|^ERROR" "$OUT"/pytest_multigpu*.log | head -20
    ;;
  deepep)
    need_gpus 2
    step build_deepep.log 300 bash benchmarks/peers/build_deepep.sh || exit $?
    export PYTHONPATH=/tmp/deepep:$PYTHONPATH
    step prebuild.log 100 python3 benchmarks/prebuild.py multigpu --world 2 --tokens 2048
    TAIL=16 step peers_deepep.log 240 torchrun --nproc-per-node=2 benchmarks/peers_deepep.py \
      --tokens 2048 --out "$RES"
    ;;
  torchtitan)
    # one step per run (IMPL:SEED, IMPL torchtitan | mokgen | mokgen-fp8 | mokgen-mxfp8, a
    # bf16 IMPL+graphs: its steps captured in a CUDA graph, --cuda-graphs), each
    # stopping before the call's budget; a debug run is 1-2 minutes: the band's four fit a call
    [ -d .torchtitan/whl ] || { echo "no .torchtitan: run benchmarks/peers/fetch_torchtitan.sh, carry .torchtitan"; exit 2; }
    python3 -m pip install -q --no-index --no-deps --target /tmp/torchtitan .torchtitan/whl/*.whl || exit 3
    # torch211_compat: the two PyTorch 2.12 additions torchtitan 0.3 uses (no-ops on newer)
    export PYTHONPATH=$PYTHONPATH:/tmp/torchtitan:$PWD/benchmarks/peers/torch211_compat
    M=${1:-debug}
    shift || true
    [ -n "${TESTS:-}" ] && pytest_gpu pytest_torchtitan.log tests/test_torchtitan.py
    DTS=bf16  # the mokgen runs' kernels first, on every core (found at once where packed)
    for R in "$@"; do I=${R%%:*}; I=${I%+graphs}; case $I in mokgen-*) DTS=$DTS,${I#mokgen-};; esac; done
    step prebuild.log 200 python3 benchmarks/torchtitan_train.py prebuild --models "$M" \
      --dtypes "$DTS"
    for R in ${@:-torchtitan:0 torchtitan:1 torchtitan:2 mokgen:0}; do
      IMPL=${R%%:*} SEED=${R#*:} GRAPHS=
      case $IMPL in *+graphs) GRAPHS=--cuda-graphs IMPL=${IMPL%+graphs};; esac
      DT=bf16; case $IMPL in mokgen-*) DT=${IMPL#mokgen-} IMPL=mokgen;; esac
      L=${R/:/_s}  # no "+" in a file name: the device's transfer refuses it
      step "torchtitan_${M}_${L//+/-}.log" 560 python3 benchmarks/torchtitan_train.py run \
        --model "$M" --impl "$IMPL" --dtype "$DT" --seed "$SEED" --out "$RES" $GRAPHS \
        --max-seconds $(( $(left) - 30 )) ${TT_ARGS:-}
    done
    ;;
  *)
    echo "unknown chunk '$CHUNK'; bash benchmarks/run_gpu.sh list"; exit 2 ;;
esac
ls "$RES"/*.json 2>/dev/null && echo "fold back here: python benchmarks/result_file.py merge" \
  "<returned \$OUT>/results/*.json"
[ -z "$FAILED" ] || { echo "failed or cut short:$FAILED"; exit 1; }
